"""Triton kernels for the language model's hot path, and the switch that decides where they run.

Each kernel module (norm, attention) holds the kernels, their launch wrappers and a plain PyTorch reference
beside each one. The model code asks `use_triton(device)` per call:

- CUDA: the Triton kernels. If triton cannot be imported, the PyTorch path runs instead; that is logged as an
  error once and `kernels_status()` says so (for /ready), never silently.
- CPU: the PyTorch path (CI needs neither a GPU nor a compiler), unless forced: VOICELANE_KERNELS=triton (or
  `set_backend("triton")`) runs the Triton kernels through triton's interpreter, which needs TRITON_INTERPRET=1
  in the environment before the kernel modules are first imported (tests compare whole-model outputs this way).
- VOICELANE_KERNELS=torch forces the PyTorch path everywhere (a GPU baseline).

Programmatic dependent launch (PDL, sm_90 and later; VOICELANE_PDL=on, off by default): each Triton kernel of
the hot path is launched while the kernel before it still runs, waits on the device for that kernel's writes
(engine/kernels/gdc.py) and lets the next one launch in turn; the skinny GEMM also pulls its weights into L2
before it waits. Off by default because it measured no faster on the H200 (docs/PERFORMANCE.md: the Talker and
the prefill slower, the Code Predictor within noise). `pdl(device)` says whether launches use it;
`kernels_status()` says so for /ready.

The kernel modules are imported on first use only, so importing the model never imports triton.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

log = logging.getLogger("voicelane.kernels")

ENV = "VOICELANE_KERNELS"
CHOICES = ("auto", "triton", "torch")
PDL_ENV = "VOICELANE_PDL"
PDL_CHOICES = ("off", "on")


class KernelsUnavailable(RuntimeError):
    """The Triton path was forced where it cannot run (no triton, or a CPU without TRITON_INTERPRET=1)."""


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


_pdl_devices: dict[str, tuple[bool, str]] = {}
_pdl_override: str | None = None


def _pdl_decision(device: torch.device) -> tuple[bool, str]:
    """(PDL on, why) for Triton launches on `device`: off unless VOICELANE_PDL=on, which where the device cannot
    (before sm_90, the CPU) is an error, not a silent fallback."""
    wanted = _pdl_override or os.environ.get(PDL_ENV, "off").strip().lower() or "off"
    if wanted not in PDL_CHOICES:
        raise ValueError(f"{PDL_ENV}={wanted!r}: choose one of {', '.join(PDL_CHOICES)}")
    if wanted == "off":
        return False, f"{PDL_ENV}=off (the default: no faster on the H200)"
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        why = "not a CUDA device" if device.type != "cuda" else "triton's interpreter"
    elif torch.cuda.get_device_capability(device) < (9, 0):
        why = f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))} (PDL needs sm_90 or later)"
    else:
        return True, f"{PDL_ENV}=on: Triton kernels launch as programmatic dependents"
    raise KernelsUnavailable(f"{PDL_ENV}=on, but {why}")


def pdl(device: torch.device) -> bool:
    """Whether Triton kernels on `device` launch with programmatic dependent launch (decided once per device)."""
    key = str(device)
    if key not in _pdl_devices:
        _pdl_devices[key] = _pdl_decision(device)
        log.info("programmatic dependent launch on %s: %s", key, _pdl_devices[key][1])
    return _pdl_devices[key][0]


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch with a `GDC` constexpr: PDL on or off for this device."""
    return {"GDC": True, "launch_pdl": True} if pdl(device) else {"GDC": False}


def reset_pdl() -> None:
    """Forget the per-device decisions (after VOICELANE_PDL changed)."""
    _pdl_devices.clear()


@contextlib.contextmanager
def pdl_mode(value: str) -> Iterator[None]:
    """VOICELANE_PDL overridden for a with-block (a GPU check compares both in one process: kernels launched and
    graphs captured inside it use `value`)."""
    global _pdl_override
    if value not in PDL_CHOICES:
        raise ValueError(f"PDL mode {value!r}: choose one of {', '.join(PDL_CHOICES)}")
    before, _pdl_override = _pdl_override, value
    _pdl_devices.clear()
    try:
        yield
    finally:
        _pdl_override = before
        _pdl_devices.clear()


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
    status["pdl"] = {device: {"enabled": on, "reason": why} for device, (on, why) in _pdl_devices.items()}
    return status
