"""Triton kernels for the language model's hot path, and the switch that decides where they run.

Each kernel module (norm, attention) holds the kernels, their launch wrappers and a plain PyTorch reference
beside each one. The model code asks `use_triton(device)` per call:

- CUDA: the Triton kernels. If triton cannot be imported, the PyTorch path runs instead; that is logged as an
  error once and `kernels_status()` says so (for /ready), never silently.
- CPU: the PyTorch path (CI needs neither a GPU nor a compiler), unless forced: VOICELANE_KERNELS=triton (or
  `set_backend("triton")`) runs the Triton kernels through triton's interpreter, which needs TRITON_INTERPRET=1
  in the environment before the kernel modules are first imported (tests compare whole-model outputs this way).
- VOICELANE_KERNELS=torch forces the PyTorch path everywhere (a GPU baseline).

Programmatic dependent launch (VOICELANE_PDL, off by default): engine/kernels/pdl.py decides, engine/kernels/gdc.py
holds the kernels' side; `kernels_status()` reports it for /ready. A part of the model compiled by torch.compile
(VOICELANE_COMPILE, off by default: engine/kernels/compiled.py) runs the PyTorch path through inductor instead.

The kernel modules are imported on first use only, so importing the model never imports triton.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict

import torch

from engine.kernels.pdl import (
    PDL_ENV,
    KernelsUnavailable,
    folded_norms,
    launch_options,
    model_part,
    pdl,
    pdl_mode,
    pdl_status,
    pipeline_status,
    reset_pdl,
)

__all__ = ["KernelsUnavailable", "PDL_ENV", "folded_norms", "launch_options", "model_part", "pdl", "pdl_mode",
           "reset_pdl"]

log = logging.getLogger("voicelane.kernels")

ENV = "VOICELANE_KERNELS"
CHOICES = ("auto", "triton", "torch")


_override: str | None = None
_triton_error: str | None = None
_triton_checked = False
_logged_fallback = False


def _triton_import_error() -> str | None:
    """None when triton imports, else why not (checked once)."""
    global _triton_checked, _triton_error
    if not _triton_checked:
        _triton_checked = True
        try:
            import triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means no Triton path, reported
            _triton_error = f"{type(exc).__name__}: {exc}"
    return _triton_error


def choice() -> str:
    value = _override if _override is not None else os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(CHOICES)}")
    return value


def set_backend(value: str | None) -> None:
    """Override VOICELANE_KERNELS for this process ("auto", "triton", "torch"; None: back to the environment)."""
    global _override
    if value is not None and value not in CHOICES:
        raise ValueError(f"kernel backend {value!r}: choose one of {', '.join(CHOICES)}")
    _override = value


@contextlib.contextmanager
def backend(value: str) -> Iterator[None]:
    """set_backend for the duration of a with-block (tests compare both paths in one process)."""
    before = _override
    set_backend(value)
    try:
        yield
    finally:
        set_backend(before)


def use_triton(device: torch.device) -> bool:
    """Whether the model's kernels on `device` are the Triton ones (see the module docstring)."""
    if torch.compiler.is_compiling():  # a compiled part (engine.kernels.compiled): inductor fuses the PyTorch path
        return False
    return _triton_kernels(device)


def compiled_attention(device: torch.device) -> bool:
    """Inside a compiled part, whether attention runs the Triton kernels as one opaque op (where they would run
    outside it): the PyTorch path would gather every row's keys and values, which inductor cannot avoid."""
    return torch.compiler.is_compiling() and _triton_kernels(device)


def _triton_kernels(device: torch.device) -> bool:
    global _logged_fallback
    wanted = choice()
    if wanted == "torch":
        return False
    if wanted == "triton":
        error = _triton_import_error()
        if error is not None:
            raise KernelsUnavailable(f"{ENV}=triton but triton does not import: {error}")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise KernelsUnavailable(f"{ENV}=triton on the CPU needs TRITON_INTERPRET=1 (set before the kernels "
                                     "are first imported)")
        return True
    if device.type != "cuda":
        return False
    if _triton_import_error() is not None:
        if not _logged_fallback:
            _logged_fallback = True
            log.error("triton does not import (%s): the model runs its unfused PyTorch kernels (slow)", _triton_error)
        return False
    return True


def kernels_status() -> dict:
    """For readiness and benchmark records: which kernels a CUDA device runs, and why."""
    error = _triton_import_error()
    version = None
    if error is None:
        import triton

        version = triton.__version__
    wanted = choice()
    cuda = "torch" if wanted == "torch" or error is not None else "triton"
    status = {"cuda_kernels": cuda, "choice": wanted, "triton": version, "triton_error": error,
              "interpret": os.environ.get("TRITON_INTERPRET", "0") == "1"}
    if error is None:
        from engine.kernels import linear

        status |= linear.kernels_status()
        from engine.kernels.attention import SHORT_ATTENTION_ENV, short_attention_on

        # the Code Predictor's attention: one launch a layer, or two (qk_norm_rope_store, cache_attention)
        status["short_attention"] = {"on": short_attention_on(), "switch": SHORT_ATTENTION_ENV}
        from engine.kernels.cp_forward import CP_FORWARD_ENV, MAX_ROWS, TILES_ENV, Tiles, cp_forward_mode, refused_rows
        from engine.kernels.cp_stream import STREAM_ROWS, stream_warps

        # the Code Predictor's forward: the layer-by-layer kernels ("off"), 26 launches ("phased") or one; forwards
        # of more rows than it takes run the layer-by-layer kernels (listed once seen)
        status["cp_forward"] = {"mode": cp_forward_mode(), "switch": CP_FORWARD_ENV,
                                "tiles": asdict(Tiles.from_env()), "tiles_switch": TILES_ENV,
                                "max_rows": STREAM_ROWS if cp_forward_mode() == "streamed" else MAX_ROWS,
                                "stream_warps": stream_warps(),
                                "layer_by_layer_rows": refused_rows()}
    status["pdl"] = pdl_status()
    status["pipeline"] = pipeline_status()
    from engine.kernels.compiled import compile_status

    status["compile"] = compile_status()
    return status
