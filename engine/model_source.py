"""`--model`: a checkpoint directory, `tiny-random` (a small random checkpoint made once into a cache folder, the
embedded default), or `random:1.7b` / `random:0.6b` / `random:tiny` (random weights built in memory).

Cache folder: $VOICELANE_CACHE, else ~/.cache/voicelane. Folders are written under a temporary name and renamed
into place, so concurrent first starts never see half a checkpoint.

`--device`, `--dtype` and `--cpu-threads` resolve here too (resolve_device, resolve_dtype, set_cpu_threads), so the
server's CLI never touches torch itself. Importing this module loads no torch (the server parses its flags with it):
torch comes with the first model or the first of those calls that needs it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.model.checkpoint import LoadedModel

TINY_RANDOM = "tiny-random"
TINY_RANDOM_DIR = "tiny-random-v1"
TOKENIZER_DIR = "qwen2-tokenizer-v1"
RANDOM_SIZES = {"1.7b": "1.7b", "0.6b": "0.6b", "tiny": "tiny"}
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # --dtype -> the torch dtype's name

RANDOM_NOTICE = """
################################################################################
#                                                                              #
#   RANDOM WEIGHTS: this server speaks NOISE, not speech.                      #
#                                                                              #
#   model {model:<69}#
#   It exercises the whole pipeline (protocol, scheduling, streaming, codecs)  #
#   with random weights of the published geometry. For real speech, pass a     #
#   Qwen3-TTS 12Hz CustomVoice checkpoint: --model /path/to/checkpoint         #
#   Random weights never end an utterance, so unless --bench-frames-per-word   #
#   says otherwise each one lasts 5 frames (0.4 s) per word.                   #
#                                                                              #
################################################################################
"""


class ModelSourceError(ValueError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("VOICELANE_CACHE") or Path.home() / ".cache" / "voicelane")


# Beside the weights: nothing in the published layout says they are random, and random weights never end an
# utterance, so the tools that load this folder cap each one by its words (as the server does) only if told.
RANDOM_MARKER = "voicelane_random_weights.json"


def is_random_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / RANDOM_MARKER).is_file()


def is_random(spec: str) -> bool:
    """Random weights: tiny-random, random:<size>, or a folder written by engine.tools.make_checkpoint."""
    return spec == TINY_RANDOM or spec.startswith("random:") or is_random_checkpoint(Path(spec).expanduser())


def _make_once(target: Path, build) -> Path:
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / ".complete").is_file():  # a stale, incomplete folder: replace it
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_random_dir(seed: int = 0) -> Path:
    from engine.model.random_model import write_checkpoint

    name = TINY_RANDOM_DIR if seed == 0 else f"{TINY_RANDOM_DIR}-seed{seed}"
    return _make_once(cache_dir() / name, lambda d: write_checkpoint(d, "tiny", seed=seed))


def tokenizer_dir() -> Path:
    from engine.text.tokenizer_files import write_tokenizer_files

    return _make_once(cache_dir() / TOKENIZER_DIR, lambda d: write_tokenizer_files(d))


def resolve_device(name: str) -> str:
    """--device as a torch device name: "auto" is cuda where a CUDA device is available, else cpu."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def set_cpu_threads(threads: int) -> None:
    """How many threads torch runs CPU work on (0: torch's default, left as it is)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def resolve_dtype_name(name: str | None, device: str) -> str:
    """--dtype as the name of a torch dtype ("auto": bfloat16 on CUDA, float32 elsewhere)."""
    if name in ("auto", "", None):
        return "bfloat16" if device.startswith("cuda") else "float32"
    if name not in DTYPES:
        raise ModelSourceError(f"--dtype {name!r}; one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    import torch

    return getattr(torch, resolve_dtype_name(name, device))


def load_model(spec: str, device: str, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    from engine.model.checkpoint import load_checkpoint

    if spec == TINY_RANDOM:
        loaded = load_checkpoint(tiny_random_dir(seed), device, dtype)
        loaded.random_weights = True
        loaded.source = TINY_RANDOM
        return loaded
    if spec.startswith("random:"):
        from engine.model.random_model import build_random_model

        size = RANDOM_SIZES.get(spec.split(":", 1)[1].lower())
        if size is None:
            raise ModelSourceError(f"--model {spec!r}; random sizes: random:1.7b, random:0.6b, random:tiny")
        return build_random_model(size, device, dtype, seed, tokenizer_dir())
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelSourceError(f"--model {spec!r} is not a directory; give a Qwen3-TTS checkpoint directory, "
                               "tiny-random, random:1.7b or random:0.6b")
    loaded = load_checkpoint(path, device, dtype)
    if is_random(spec):
        loaded.random_weights = True
    if loaded.tokenizer_dir is None:
        raise ModelSourceError(f"{path}: no tokenizer files (tokenizer.json or vocab.json + merges.txt)")
    return loaded
