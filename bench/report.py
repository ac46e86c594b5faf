"""Report files: the environment a run measured in, and JSON that survives +inf.

JSON has no infinity: non-finite floats are written as the strings "inf", "-inf" and "nan" and read back as floats
by `load_report`. A latency percentile is "inf" when more of the offered requests than the percentile allows
failed (they count as +inf: docs/benchmarks/README.md 1).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPORT_VERSION = 1
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def repo_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def git_info() -> dict:
    """The commit measured. A copy of the tree whose git metadata is missing or stale (a container image, a
    remote GPU machine) names its commit in VOICELANE_COMMIT, which then wins."""
    named = os.environ.get("VOICELANE_COMMIT")
    if named:
        return {"commit": named, "dirty": None, "commit_from": "VOICELANE_COMMIT"}
    root = repo_root()
    commit = _run(["git", "rev-parse", "HEAD"], root)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def gpu_info() -> list[dict] | None:
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if not out:
        return None
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    return gpus or None


def package_versions(names=("numpy", "httpx", "websockets", "torch", "transformers", "qwen-tts", "matplotlib")):
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


def command_line(module: str | None = None) -> str:
    """The command as typed: `python -m <module> args...` when run as a module."""
    args = sys.argv[1:]
    if module:
        return shlex.join(["python", "-m", module, *args])
    return shlex.join([os.path.basename(sys.executable), *sys.argv])


def environment(module: str | None = None) -> dict:
    return {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(module),
        **git_info(),
        "gpu": gpu_info(),
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "packages": package_versions(),
    }


def jsonable(x, digits: int = 4):
    """JSON-safe copy: non-finite floats as strings, floats rounded to `digits` decimals (0.1 us on ms values)."""
    if isinstance(x, float):
        if math.isfinite(x):
            return round(x, digits)
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): jsonable(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, digits) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return jsonable(x.item(), digits)
    return x


def _revive(x):
    if isinstance(x, str) and x in _NONFINITE:
        return _NONFINITE[x]
    if isinstance(x, dict):
        return {k: _revive(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_revive(v) for v in x]
    return x


def write_report(report: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(jsonable(report), indent=1) + "\n")
    tmp.replace(path)
    return path


def load_report(path) -> dict:
    return _revive(json.loads(Path(path).read_text()))


def fmt_ms(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return f"{v:.1f}"
