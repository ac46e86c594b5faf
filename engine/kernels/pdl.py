"""Programmatic dependent launch (PDL, sm_90 and later), host side: whether Triton kernels launch with it.

Under PDL each Triton kernel of the hot path is launched while the kernel before it still runs, waits on the
device for that kernel's writes (engine/kernels/gdc.py) and lets the next one launch in turn; the skinny GEMM
also pulls its weights into L2 before it waits. VOICELANE_PDL=on turns it on; it is off by default because it
measured no faster on the H200 (docs/PERFORMANCE.md: the Talker and the prefill slower, the Code Predictor within
noise). VOICELANE_PDL=code_predictor (or talker, or both, comma-separated) turns it on for the kernels launched
inside that part of the model only (`model_part`, set by the model): a part that gains keeps it, one that loses
does not. Kernel launch wrappers pass `**launch_options(device)`.

VOICELANE_PDL_TRIGGER says when, under PDL, a kernel lets the next one launch: `after_wait` (the default: once its
own inputs are ready, two kernels overlap at most) or `early` (at its start: the kernels after it launch while it
still waits, so preloaded weight reads run several kernels ahead; an experiment, engine/kernels/gdc.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextvars import ContextVar

import torch

log = logging.getLogger("voicelane.kernels")

PDL_ENV = "VOICELANE_PDL"
PDL_CHOICES = ("off", "on")
PDL_PARTS = ("talker", "code_predictor")  # the model's parts that name themselves (model_part)
TRIGGER_ENV = "VOICELANE_PDL_TRIGGER"
TRIGGERS = {"after_wait": 1, "early": 2}  # the kernels' GDC constexpr under PDL (0: off): gdc.wait_inputs
_PART: ContextVar[str | None] = ContextVar("voicelane_model_part", default=None)


class KernelsUnavailable(RuntimeError):
    """A kernel path was forced where it cannot run (no triton, a CPU without TRITON_INTERPRET=1, PDL before
    sm_90)."""


_pdl_devices: dict[str, tuple[bool, str, frozenset[str] | None, int]] = {}
_pdl_override: str | None = None


def _wanted() -> tuple[str, frozenset[str] | None]:
    """(the setting, the parts it names; None: every kernel)."""
    wanted = _pdl_override or os.environ.get(PDL_ENV, "off").strip().lower() or "off"
    if wanted in PDL_CHOICES:
        return wanted, None
    parts = frozenset(part.strip() for part in wanted.split(","))
    if not parts <= set(PDL_PARTS):
        raise ValueError(f"{PDL_ENV}={wanted!r}: choose one of {', '.join(PDL_CHOICES)}, or parts of the model "
                         f"({', '.join(PDL_PARTS)}, comma-separated)")
    return wanted, parts


def _pdl_decision(device: torch.device) -> tuple[bool, str, frozenset[str] | None, int]:
    """(PDL on, why, the parts it is on for (None: all), the kernels' GDC value) for Triton launches on `device`:
    off unless VOICELANE_PDL asks, which where the device cannot (before sm_90, the CPU) is an error, not a silent
    fallback."""
    wanted, parts = _wanted()
    if wanted == "off":
        return False, f"{PDL_ENV}=off (the default: no faster on the H200)", None, 0
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        why = "not a CUDA device" if device.type != "cuda" else "triton's interpreter"
    elif torch.cuda.get_device_capability(device) < (9, 0):
        why = f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))} (PDL needs sm_90 or later)"
    else:
        where = "every Triton kernel" if parts is None else f"the Triton kernels of {', '.join(sorted(parts))}"
        when = trigger()
        return True, f"{PDL_ENV}={wanted}: {where} launch as programmatic dependents, trigger {when}", parts, \
            TRIGGERS[when]
    raise KernelsUnavailable(f"{PDL_ENV}={wanted}, but {why}")


def pdl(device: torch.device) -> bool:
    """Whether Triton kernels on `device` (all, or those of the parts VOICELANE_PDL names) launch with
    programmatic dependent launch (decided once per device)."""
    return _decided(device)[0]


def _decided(device: torch.device) -> tuple[bool, str, frozenset[str] | None, int]:
    key = str(device)
    if key not in _pdl_devices:
        _pdl_devices[key] = _pdl_decision(device)
        log.info("programmatic dependent launch on %s: %s", key, _pdl_devices[key][1])
    return _pdl_devices[key]


def trigger() -> str:
    """VOICELANE_PDL_TRIGGER: after_wait (unset) or early."""
    value = os.environ.get(TRIGGER_ENV, "").strip().lower() or "after_wait"
    if value not in TRIGGERS:
        raise ValueError(f"{TRIGGER_ENV}={value!r}: choose one of {', '.join(TRIGGERS)}")
    return value


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch with a `GDC` constexpr: PDL on or off for this device and part, and
    when the next kernel may launch."""
    on, _, parts, gdc = _decided(device)
    if on and (parts is None or _PART.get() in parts):
        return {"GDC": gdc, "launch_pdl": True}
    return {"GDC": False}


@contextlib.contextmanager
def model_part(name: str) -> Iterator[None]:
    """Kernels launched (and graphs captured) inside belong to this part of the model (one of PDL_PARTS)."""
    if name not in PDL_PARTS:
        raise ValueError(f"model part {name!r}: one of {', '.join(PDL_PARTS)}")
    token = _PART.set(name)
    try:
        yield
    finally:
        _PART.reset(token)


def pdl_status() -> dict:
    """{device: {"enabled", "reason", "parts", "trigger"}} for the devices decided so far."""
    names = {v: k for k, v in TRIGGERS.items()}
    return {device: {"enabled": on, "reason": why, "parts": sorted(parts) if parts else "all" if on else None,
                     "trigger": names.get(gdc)} for device, (on, why, parts, gdc) in _pdl_devices.items()}


def reset_pdl() -> None:
    """Forget the per-device decisions (after VOICELANE_PDL changed)."""
    _pdl_devices.clear()


@contextlib.contextmanager
def pdl_mode(value: str) -> Iterator[None]:
    """VOICELANE_PDL overridden for a with-block (a GPU check compares both in one process: kernels launched and
    graphs captured inside it use `value`)."""
    global _pdl_override
    before, _pdl_override = _pdl_override, value
    try:
        _wanted()
    except ValueError:
        _pdl_override = before
        raise
    _pdl_devices.clear()
    try:
        yield
    finally:
        _pdl_override = before
        _pdl_devices.clear()
