"""One line per timed row of every profile_stages JSON named (the variants of one GPU round side by side), and each
file's compiles: python3 bench/stages_summary.py OUT/stages_*.json"""

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"{path}: unreadable ({exc})")
            continue
        kernels = record.get("kernels", {})
        print(f"{path}: {record.get('gpu')} torch {record.get('torch')} complete={record.get('complete')} "
              f"failures={record.get('capture_failures')}")
        for c in kernels.get("compile", {}).get("compiles", []):
            print(f"  compile {c}")
        for r in record["rows"]:
            extra = r.get("prompt_len", r.get("chunk", ""))
            print(f"  {r['stage']:<15} B{r['batch']:<3} {extra!s:>4} {r['graphs']:>3} {r['ms']:8.3f} ms "
                  f"{r['kernel_us'] / 1e3:7.3f} kernel ms {r['kernels']:5} kernels")


if __name__ == "__main__":
    main(sys.argv[1:])
