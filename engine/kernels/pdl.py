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

VOICELANE_CP_PIPELINE=<rows> is those experiments put together where they measured faster: the Code Predictor's
frames of at most <rows> rows run pipelined, whatever the switches above say: PDL with the early trigger, and every
projection on the skinny GEMM (its default config) with one K block of PIPELINE_BLOCK_K a program, its weights read
before the wait (engine/kernels/linear.py). Unset, it covers frames of up to 8 rows where PDL can run (the H200,
9e4473b, docs/PERFORMANCE.md: 2 to 11% off a B1 and B8 frame in two calls; slower at B64) and is off elsewhere,
saying why; `off` turns it off. VOICELANE_TALKER_PIPELINE=<rows> does the same for the Talker's steps (off:
measured slower). VOICELANE_PIPELINE_FOLD_NORMS=on moves a pipelined step's RMSNorms into its projections
(folded_norms; off: no faster at B1, slower at B8).
`model_part(name, rows)` carries the rows.
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
PIPELINE_ENV = "VOICELANE_CP_PIPELINE"
TALKER_PIPELINE_ENV = "VOICELANE_TALKER_PIPELINE"
FOLD_ENV = "VOICELANE_PIPELINE_FOLD_NORMS"
PIPELINE_BLOCK_K = 512  # the preload K block that measured best (H100: 128, 256, 512 tried)
_PART: ContextVar[str | None] = ContextVar("voicelane_model_part", default=None)
_ROWS: ContextVar[int | None] = ContextVar("voicelane_model_rows", default=None)


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
    why = _unable(device)
    if why is not None:
        raise KernelsUnavailable(f"{PDL_ENV}={wanted}, but {why}")
    where = "every Triton kernel" if parts is None else f"the Triton kernels of {', '.join(sorted(parts))}"
    when = trigger()
    return True, f"{PDL_ENV}={wanted}: {where} launch as programmatic dependents, trigger {when}", parts, \
        TRIGGERS[when]


def _unable(device: torch.device) -> str | None:
    """Why Triton launches on `device` cannot be programmatic dependents, or None."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "not a CUDA device" if device.type != "cuda" else "triton's interpreter"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))} (PDL needs sm_90 or later)"
    return None


# part -> (its switch, the rows it covers when unset where PDL can run)
PIPELINES = {"code_predictor": (PIPELINE_ENV, 8),  # H200, 9e4473b: faster at B1 and B8, slower at B64 (H100)
             "talker": (TALKER_PIPELINE_ENV, 0)}  # off: slower at B1 and B8 (H100, 5ac8b58)
_pipeline: dict[tuple[str, str], tuple[int, str]] = {}  # (device, part) -> (the rows it pipelines up to, 0: off; why)


def pipeline_rows(device: torch.device, part: str = "code_predictor") -> int:
    """The pipeline switch of `part` for `device` (decided once): 0 (off), or the most rows a pipelined step of
    that part has. Unset: PIPELINES' default where PDL can run, else off (logged, and said by pipeline_status).
    Asked for where PDL cannot run: an error, never a silent fallback."""
    key = (str(device), part)
    if key not in _pipeline:
        env, default = PIPELINES[part]
        value = os.environ.get(env, "").strip().lower()
        if not value:
            why = _unable(device) if default else None
            rows = 0 if why else default
            reason = f"{env} unset: " + (f"off, {why}" if why else f"the default, {rows} rows" if rows else "off")
        else:
            rows = 0 if value == "off" else int(value) if value.isdigit() else -1
            if not 0 <= rows <= 64:
                raise ValueError(f"{env}={value!r}: off, or the most rows (1-64) of a pipelined step")
            why = _unable(device) if rows else None
            if why is not None:
                raise KernelsUnavailable(f"{env}={value}, but {why}")
            reason = f"{env}={value}"
        _pipeline[key] = rows, reason
        log.info("%s pipeline on %s: %s (%s)", part, key[0], f"steps of <= {rows} rows (PDL, early trigger, skinny "
                 f"GEMMs preloading K blocks of {PIPELINE_BLOCK_K})" if rows else "off", reason)
    return _pipeline[key][0]


def pipelined(device: torch.device) -> bool:
    """Whether the launch about to be made on `device` belongs to a pipelined step (of a part whose switch covers
    the step's rows)."""
    part, rows = _PART.get(), _ROWS.get()
    return part in PIPELINES and rows is not None and 0 < rows <= pipeline_rows(device, part)


def folded_norms(device: torch.device) -> bool:
    """Whether a pipelined step's decoder layers run each RMSNorm (with the residual add before it) inside the
    projection after it, not as a kernel of its own: VOICELANE_PIPELINE_FOLD_NORMS=on (off by default:
    on an H100 no faster at B1 and slower at B8; engine.model.layers.DecoderStack)."""
    value = os.environ.get(FOLD_ENV, "off").strip().lower() or "off"
    if value not in ("on", "off"):
        raise ValueError(f"{FOLD_ENV}={value!r}: choose on or off")
    return value == "on" and pipelined(device)


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
    if pipelined(device):
        return {"GDC": TRIGGERS["early"], "launch_pdl": True}
    on, _, parts, gdc = _decided(device)
    if on and (parts is None or _PART.get() in parts):
        return {"GDC": gdc, "launch_pdl": True}
    return {"GDC": False}


@contextlib.contextmanager
def model_part(name: str, rows: int | None = None) -> Iterator[None]:
    """Kernels launched (and graphs captured) inside belong to this part of the model (one of PDL_PARTS), for a
    batch of `rows` rows (None: not said)."""
    if name not in PDL_PARTS:
        raise ValueError(f"model part {name!r}: one of {', '.join(PDL_PARTS)}")
    token, rows_token = _PART.set(name), _ROWS.set(rows)
    try:
        yield
    finally:
        _PART.reset(token)
        _ROWS.reset(rows_token)


def pdl_status() -> dict:
    """{device: {"enabled", "reason", "parts", "trigger"}} for the devices decided so far."""
    names = {v: k for k, v in TRIGGERS.items()}
    return {device: {"enabled": on, "reason": why, "parts": sorted(parts) if parts else "all" if on else None,
                     "trigger": names.get(gdc)} for device, (on, why, parts, gdc) in _pdl_devices.items()}


def pipeline_status() -> dict:
    """The pipelines per part: the switch as set, and per device decided so far the rows it covers (0: off) and
    why; whether pipelined steps fold their norms."""
    return {part: {"switch": env, "set": os.environ.get(env) or None, "block_k": PIPELINE_BLOCK_K,
                   "rows": {dev: rows for (dev, p), (rows, _) in _pipeline.items() if p == part},
                   "reason": {dev: why for (dev, p), (_, why) in _pipeline.items() if p == part}}
            for part, (env, _) in PIPELINES.items()} | {"fold_norms": os.environ.get(FOLD_ENV) or "off"}


def reset_pdl() -> None:
    """Forget the per-device decisions (after VOICELANE_PDL or VOICELANE_CP_PIPELINE changed)."""
    _pdl_devices.clear()
    _pipeline.clear()


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
