"""Write a random-weight Qwen3-TTS 12 Hz CustomVoice checkpoint in the published layout.

    python -m engine.tools.make_checkpoint --size {tiny,0.6b,1.7b} --out DIR [--seed N]

Its weights are random (the model speaks noise); tests and benchmarks use it where real weights cannot be had.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.model.presets import SIZES
from engine.model.random_model import write_checkpoint
from engine.model_source import RANDOM_MARKER

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mark_random(directory: str | Path, size: str, seed: int) -> None:
    (Path(directory) / RANDOM_MARKER).write_text(json.dumps({"size": size, "seed": seed}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", required=True, choices=SIZES)
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="stored dtype (default: float32 for tiny, bfloat16 otherwise, as published)")
    ap.add_argument("--max-shard-mb", type=float, default=None,
                    help="split model.safetensors into shards of at most this size, with an index")
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if args.size == "tiny" else torch.bfloat16)
    shard = int(args.max_shard_mb * 2**20) if args.max_shard_mb else None
    t0 = time.time()
    out = write_checkpoint(args.out, args.size, args.seed, dtype, shard)
    mark_random(out, args.size, args.seed)
    print(f"wrote random-weight {args.size} checkpoint to {out} in {time.time() - t0:.1f}s (seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
