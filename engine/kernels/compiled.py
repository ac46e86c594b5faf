"""Inductor-generated kernels for one part of the model: VOICELANE_COMPILE (off by default).

VOICELANE_COMPILE=code_predictor runs the Code Predictor's forward (its stack and the group's head, not the
sampler) through torch.compile. Inside the compiled region the model's PyTorch path is what gets traced
(`engine.kernels.use_triton` says no while dynamo traces), and inductor fuses its glue (norms, q/k-norm, RoPE,
the cache write, masks, residuals, SwiGLU) into generated Triton kernels around cuBLAS GEMMs. The result is
launched like any other kernels, so the stage's own CUDA graph captures it (mode "default": torch.compile's own
cudagraph trees are not used). Why not always: the hand-written kernels are the measured default, and a compile
costs start-up time per part and batch bucket, which `compile_status()` reports with inductor's cache folder.

Nothing falls back silently: `fullgraph=True` makes a graph break an error, and an error while compiling reaches
the graph capture, which the runner reports (log and /ready). VOICELANE_COMPILE_BACKEND picks the backend:
"inductor" (the default; on the CPU it needs a C++ compiler), or "aot_eager" (traced and functionalised like
inductor's input, run eagerly: what the CPU tests use, since CI has no compiler). VOICELANE_COMPILE_MODE picks
inductor's mode: "default", or "max-autotune-no-cudagraphs" (GEMMs as autotuned Triton templates that can take
their neighbours' elementwise work, at a far longer compile). The modes with cudagraphs are refused: the stage's
graph already captures the compiled code, and torch.compile's own graphs cannot be captured inside another.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from torch import Tensor

log = logging.getLogger("voicelane.kernels")

COMPILE_ENV = "VOICELANE_COMPILE"
BACKEND_ENV = "VOICELANE_COMPILE_BACKEND"
COMPILE_PARTS = ("code_predictor", "talker")  # the parts with a compiled path
BACKENDS = ("inductor", "aot_eager")
MODE_ENV = "VOICELANE_COMPILE_MODE"
MODES = ("default", "max-autotune-no-cudagraphs")
# Dynamo keeps one compiled graph per input signature of a function (batch bucket x tokens): the engine's 8 buckets
# and the first forward's 2 tokens need 16, over its default limit of 8, past which it would run eagerly with only
# a warning; here the limit is 64 and hitting it is an error.
RECOMPILE_LIMIT = 64

_compiles: list[dict] = []


def compile_parts() -> frozenset[str]:
    """The parts VOICELANE_COMPILE names ("off" or unset: none; "on": all)."""
    wanted = os.environ.get(COMPILE_ENV, "off").strip().lower() or "off"
    if wanted == "off":
        return frozenset()
    if wanted == "on":
        return frozenset(COMPILE_PARTS)
    parts = frozenset(part.strip() for part in wanted.split(","))
    if not parts <= set(COMPILE_PARTS):
        raise ValueError(f"{COMPILE_ENV}={wanted!r}: choose off, on, or parts of the model "
                         f"({', '.join(COMPILE_PARTS)}, comma-separated)")
    return parts


def compile_backend() -> str:
    backend = os.environ.get(BACKEND_ENV, "inductor").strip().lower() or "inductor"
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={backend!r}: choose one of {', '.join(BACKENDS)}")
    return backend


def compile_mode() -> str:
    mode = os.environ.get(MODE_ENV, "default").strip().lower() or "default"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: choose one of {', '.join(MODES)} (the modes with cudagraphs would "
                         "nest torch.compile's graphs inside the stage's own)")
    return mode


def compiled(part: str, fn: Callable) -> Callable:
    """fn compiled for `part` (static shapes, no graph breaks). Each call that meets a new input signature is
    timed (a compile, or a hit in inductor's cache) and recorded for compile_status()."""
    if part not in COMPILE_PARTS:
        raise ValueError(f"compiled part {part!r}: one of {', '.join(COMPILE_PARTS)}")
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    dynamo.fail_on_recompile_limit_hit = True
    backend, mode = compile_backend(), compile_mode()
    graph_fn = torch.compile(fn, backend=backend, mode=mode if backend == "inductor" else None, fullgraph=True,
                             dynamic=False)
    seen: set[tuple] = set()

    def run(*args):
        signature = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a) for a in args)
        if signature in seen:
            return graph_fn(*args)
        start = time.perf_counter()
        out = graph_fn(*args)
        seconds = round(time.perf_counter() - start, 2)
        seen.add(signature)
        shape = next(list(s[0]) for s in signature if isinstance(s, tuple))  # the first tensor's: rows x tokens
        _compiles.append({"part": part, "backend": backend, "shape": shape, "seconds": seconds})
        log.info("compiled %s (%s) for input %s in %.2f s", part, backend, shape, seconds)
        return out

    return run


def compile_status() -> dict:
    """For /ready and benchmark records: the parts compiled, the backend, each compile's time, inductor's cache."""
    parts = sorted(compile_parts())
    status = {"parts": parts, "switch": COMPILE_ENV, "compiles": list(_compiles),
              "compile_seconds": round(sum(c["seconds"] for c in _compiles), 2)}
    if parts:
        status["backend"], status["mode"] = compile_backend(), compile_mode()
        status["inductor_cache"] = _inductor_cache()
    return status


@torch.library.custom_op("voicelane::layer_attention", mutates_args=("k_cache", "v_cache"))
def attention_op(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                 sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor,
                 valid_len: Tensor | None, num_heads: int) -> Tensor:
    """engine.kernels.attention.layer_attention as an op that dynamo records whole (it writes the caches in place,
    declared so that functionalisation orders it against every other use of them)."""
    from engine.kernels.attention import layer_attention

    return layer_attention(q, k, v, q_weight, k_weight, eps, cos, sin_signed, k_cache, v_cache, slots, positions,
                           valid_len, num_heads)


@attention_op.register_fake
def _attention_shape(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                     sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor,
                     valid_len: Tensor | None, num_heads: int) -> Tensor:
    B, T, _ = q.shape
    return q.new_empty(B, T, num_heads, cos.shape[-1])


def _inductor_cache() -> str:
    """Inductor's cache folder (a private helper of torch's: if it moves, say so rather than break /ready)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError as exc:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or f"unknown ({exc})"
    return cache_dir()
