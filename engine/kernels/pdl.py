"""Programmatic dependent launch (PDL, sm_90 and later), host side: whether Triton kernels launch with it.

Under PDL each Triton kernel of the hot path is launched while the kernel before it still runs, waits on the
device for that kernel's writes (engine/kernels/gdc.py) and lets the next one launch in turn; the skinny GEMM
also pulls its weights into L2 before it waits. VOICELANE_PDL=on turns it on; it is off by default because it
measured no faster on the H200 (docs/PERFORMANCE.md: the Talker and the prefill slower, the Code Predictor within
noise). Kernel launch wrappers pass `**launch_options(device)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

log = logging.getLogger("voicelane.kernels")

PDL_ENV = "VOICELANE_PDL"
PDL_CHOICES = ("off", "on")


class KernelsUnavailable(RuntimeError):
    """A kernel path was forced where it cannot run (no triton, a CPU without TRITON_INTERPRET=1, PDL before
    sm_90)."""


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


def pdl_status() -> dict:
    """{device: {"enabled", "reason"}} for the devices decided so far."""
    return {device: {"enabled": on, "reason": why} for device, (on, why) in _pdl_devices.items()}


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
