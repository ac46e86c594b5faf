"""Skinny linear layers in Triton: y = x @ W^T for the decode steps' few rows (M <= 64).

At decode the Talker's and the Code Predictor's GEMMs are weight reads (4-48 MB each, at M = 1..64 rows), and
cuBLAS's small-tile kernels read them at about a quarter of the H200's bandwidth (issue 11: the Code Predictor's
gate/up GEMM, 12 MB, takes 11.4 us against a 2.8 us floor), with a separate split-K reduce kernel on top. Here
each program owns BLOCK_N output columns and one of `split_k` slices of K, so the grid can cover every SM even
for 1024 output columns; partial sums of a split go to a float32 scratch, and the last program to finish a
column block (an atomic ticket) adds the slices in a fixed order and writes the output: one kernel, deterministic,
and the ticket is reset by that program, so a CUDA graph can replay it.

`swiglu=True` reads x as [gate | up] (width 2K) and multiplies by silu(gate) * up rounded to the activation
dtype exactly as engine.kernels.norm.swiglu does: the MLP's down projection without its separate SwiGLU kernel.

Which kernel runs for a shape is decided by measurement on the GPU (engine.tools.tune_linear writes the table
engine/kernels/linear_table.json, per GPU name, per weight shape and row bucket: the fastest kernel config and
whether cuBLAS beat it): where cuBLAS measured faster, or for a GPU or shape the table does not hold, `linear()`
runs F.linear, and `kernels_status()` says which GPU the table was tuned on. VOICELANE_LINEAR=triton runs the
kernel for every shape (its tuned config, else DEFAULT_CONFIG): under programmatic dependent launch a cuBLAS GEMM
breaks the chain of overlapping launches, which the tuner's one-shape-at-a-time timing does not see. Rows above
64 (prefill) always go to cuBLAS. VOICELANE_LINEAR_PRELOAD=256 (a K block) gives every skinny launch one K block a
program, its weights read into registers before the program waits for the kernel before: under PDL the weight
read of one GEMM overlaps the kernels before it, where the L2 prefetch only moves it closer (an experiment, off).
Inside a pipelined step (VOICELANE_CP_PIPELINE, engine/kernels/pdl.py) every launch is the kernel,
preloading, whatever the switches and the table's choice of cuBLAS say.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.gdc import L2_LINE_BYTES, prefetch_l2, wait_inputs
from engine.kernels.lanes import current_lane
from engine.kernels.norm import swiglu as swiglu_kernel
from engine.kernels.norm import swiglu_reference
from engine.kernels.pdl import PIPELINE_BLOCK_K, launch_options, pipelined

log = logging.getLogger("voicelane.kernels.linear")

MAX_ROWS = 64
TUNED_DTYPE = torch.bfloat16
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TABLE_ENV = "VOICELANE_LINEAR_TABLE"  # another table file (the tuner's output, before it is committed)
FORCE_ENV = "VOICELANE_LINEAR"  # "triton": DEFAULT_CONFIG for every shape without an entry (CPU tests); "cublas"
PRELOAD_ENV = "VOICELANE_LINEAR_PRELOAD"  # a block_k: every skinny launch takes preload=True with that K block
TABLE_PATH = Path(__file__).with_name("linear_table.json")
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class LinearConfig:
    """One launch shape of the kernel. dot=False multiplies on CUDA cores (a row or four need no tensor core).
    preload=True gives each program one block of K (split_k is then K / block_k, rounded up) and loads its weights
    before it waits for the kernel before (under PDL they arrive while that kernel still runs)."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    dot: bool = True
    num_warps: int = 4
    num_stages: int = 3
    preload: bool = False


DEFAULT_CONFIG = LinearConfig()


@triton.jit
def _h_block(x_ptr, res_ptr, rm, k, m_ok, K, stride_xm, stride_rm, NORM: tl.constexpr):
    """x[rm, k], plus the residual's block for NORM == 2, the sum rounded as engine.kernels.norm.add_rms_norm
    rounds it."""
    mask = m_ok[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    if NORM == 2:
        r = tl.load(res_ptr + rm[:, None] * stride_rm + k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _row_rstd(x_ptr, res_ptr, rm, m_ok, K, stride_xm, stride_rm, eps, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr, NORM_K: tl.constexpr):
    """1 / rms of each row of h = x (+ residual) over all K columns [BLOCK_M], in float32: every program reads
    the whole rows (a few KB from L2 at the pipeline's row counts) instead of a norm kernel writing them."""
    total = tl.zeros([BLOCK_M], tl.float32)
    for k0 in tl.static_range(0, NORM_K, BLOCK_K):
        h = _h_block(x_ptr, res_ptr, rm, k0 + tl.arange(0, BLOCK_K), m_ok, K, stride_xm, stride_rm, NORM)
        hf = h.to(tl.float32)
        total += tl.sum(hf * hf, axis=1)
    return tl.rsqrt(total / K + eps)


@triton.jit
def _x_block(x_ptr, rm, k, m_ok, K, stride_xm, SWIGLU: tl.constexpr, res_ptr, nw_ptr, h_ptr, stride_rm, stride_hm,
             rstd, store_h, NORM: tl.constexpr):
    """x[rm, k] for one block of columns k of K (silu(gate) * up for SWIGLU; RMSNorm(x + residual) with rstd
    for NORM, the sum itself also stored into h by the programs told to)."""
    x_mask = m_ok[:, None] & (k < K)[None, :]
    x_at = x_ptr + rm[:, None] * stride_xm + k[None, :]
    if SWIGLU:  # x is [gate | up]: the rounding of engine.kernels.norm.swiglu, step by step
        up = tl.load(x_at + K, mask=x_mask, other=0.0)
        g = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(up.dtype)
        return (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    elif NORM:  # engine.kernels.norm.add_rms_norm's rounding: h, then h * rstd, then times the weight
        h = _h_block(x_ptr, res_ptr, rm, k, m_ok, K, stride_xm, stride_rm, NORM)
        if NORM == 2:
            tl.store(h_ptr + rm[:, None] * stride_hm + k[None, :], h, mask=x_mask & store_h)
        normed = (h.to(tl.float32) * rstd[:, None]).to(h.dtype)
        w = tl.load(nw_ptr + k, mask=k < K, other=0.0)
        return (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(h.dtype)
    else:
        return tl.load(x_at, mask=x_mask, other=0.0)


@triton.jit
def _w_block(w_ptr, rn, k, n_ok, K, stride_wn):
    """w[rn, k]: one [BLOCK_N, BLOCK_K] tile of the weight."""
    return tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _product(acc, a, w, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += a [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T."""
    if DOT:
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    else:
        acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _k_block(acc, x_ptr, w_ptr, rm, rn, k, m_ok, n_ok, K, stride_xm, stride_wn, SWIGLU: tl.constexpr,
             DOT: tl.constexpr, IEEE: tl.constexpr, res_ptr, nw_ptr, h_ptr, stride_rm, stride_hm, rstd, store_h,
             NORM: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += x[rm, k] @ w[rn, k]^T for one block of columns k of K."""
    a = _x_block(x_ptr, rm, k, m_ok, K, stride_xm, SWIGLU, res_ptr, nw_ptr, h_ptr, stride_rm, stride_hm, rstd,
                 store_h, NORM)
    return _product(acc, a, _w_block(w_ptr, rn, k, n_ok, K, stride_wn), DOT, IEEE)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, stride_xm, stride_wn, stride_ym, split_k,
                   k_span, res_ptr, nw_ptr, h_ptr, stride_rm, stride_hm, eps,
                   SWIGLU: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                   INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GDC: tl.constexpr, LINE: tl.constexpr, PRELOAD: tl.constexpr, NORM: tl.constexpr,
                   NORM_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    store_h = pid_n == 0  # NORM == 2: the first column block's programs write h, each its slice of K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * k_span  # k_span is a multiple of BLOCK_K: the slices tile K without overlap
    k_hi = k_lo + k_span
    if PRELOAD:  # the slice is one block, read into registers before the wait: under PDL while the kernel before runs
        w = _w_block(w_ptr, rn, k_lo + rk, n_ok, K, stride_wn)
        wait_inputs(GDC)
        rstd = tl.zeros([BLOCK_M], tl.float32)
        if NORM:
            rstd = _row_rstd(x_ptr, res_ptr, rm, m_ok, K, stride_xm, stride_rm, eps, NORM, BLOCK_M, BLOCK_K, NORM_K)
        a = _x_block(x_ptr, rm, k_lo + rk, m_ok, K, stride_xm, SWIGLU, res_ptr, nw_ptr, h_ptr, stride_rm, stride_hm,
                     rstd, store_h, NORM)
        acc = _product(acc, a, w, DOT, IEEE)
    else:
        if GDC:  # the weights never depend on the kernel before: pull this program's slice into L2 while it runs
            w_rows = w_ptr + tl.minimum(rn, N - 1)[:, None] * stride_wn
            for k0 in range(k_lo, k_hi, BLOCK_K):
                prefetch_l2(w_rows + tl.minimum(k0 + tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)[None, :])
        wait_inputs(GDC)
        rstd = tl.zeros([BLOCK_M], tl.float32)
        if NORM:
            rstd = _row_rstd(x_ptr, res_ptr, rm, m_ok, K, stride_xm, stride_rm, eps, NORM, BLOCK_M, BLOCK_K, NORM_K)
        if INTERPRET:  # triton 3.6's interpreter cannot take a device scalar as a range() bound (numpy >= 2)
            k0 = k_lo
            while k0 < k_hi:
                acc = _k_block(acc, x_ptr, w_ptr, rm, rn, k0 + rk, m_ok, n_ok, K, stride_xm, stride_wn, SWIGLU, DOT,
                               IEEE, res_ptr, nw_ptr, h_ptr, stride_rm, stride_hm, rstd, store_h, NORM)
                k0 += BLOCK_K
        else:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                acc = _k_block(acc, x_ptr, w_ptr, rm, rn, k0 + rk, m_ok, n_ok, K, stride_xm, stride_wn, SWIGLU, DOT,
                               IEEE, res_ptr, nw_ptr, h_ptr, stride_rm, stride_hm, rstd, store_h, NORM)
    out_mask = m_ok[:, None] & n_ok[None, :]
    y_at = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if not SPLIT:
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_at = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part_at + pid_k * M * N, acc, mask=out_mask)
        # acq_rel: this program's partials are visible before its ticket; the last one sees all of them
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")
        if ticket == split_k - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            s = 0
            while s < split_k:  # in split order: the sum does not depend on which program finished last
                total += tl.load(part_at + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                s += 1
            tl.store(y_at, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(ticket_ptr + pid_n, 0)  # ready for the next launch (graph replays included)


_TICKETS: dict[tuple[str, int, str | None], Tensor] = {}


def _tickets(device: torch.device, blocks: int) -> Tensor:
    """Zeroed int32 tickets, one per column block, shared by every launch of one lane on the device (launches on
    one stream run one after another, and each leaves its tickets at zero; two lanes run at once, so each has its
    own). Made before capture: the warm-up run makes it."""
    key = (str(device), blocks, current_lane())
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(blocks, dtype=torch.int32, device=device)
    return _TICKETS[key]


def block_m(rows: int, dot: bool) -> int:
    return max(16, triton.next_power_of_2(rows)) if dot else triton.next_power_of_2(rows)


def skinny_linear(x: Tensor, weight: Tensor, config: LinearConfig = DEFAULT_CONFIG, swiglu: bool = False) -> Tensor:
    """x [..., K] (or [..., 2K] = [gate | up] with swiglu) with at most 64 rows in all; weight [N, K] with
    contiguous rows -> [..., N] in x's dtype."""
    return _launch(x, weight, config, swiglu, None)[1]


@dataclass(frozen=True)
class NormPrologue:
    """An RMSNorm (of x + residual, or of x alone) that a launch applies to its input before the product:
    engine.kernels.norm.add_rms_norm's arithmetic, without its kernel."""

    residual: Tensor | None  # [..., K] like x, or None: the norm of x itself
    weight: Tensor  # [K], the norm's weight
    eps: float


def skinny_norm_linear(x: Tensor, norm: NormPrologue, weight: Tensor,
                       config: LinearConfig = DEFAULT_CONFIG) -> tuple[Tensor, Tensor]:
    """add_rms_norm(x, norm.residual, norm.weight, norm.eps) then skinny_linear, in one launch:
    -> (h = x + residual (x itself without one), rms_norm(h) @ weight^T)."""
    return _launch(x, weight, config, False, norm)


def _launch(x: Tensor, weight: Tensor, config: LinearConfig, swiglu: bool,
            norm: NormPrologue | None) -> tuple[Tensor, Tensor]:
    """The kernel's launch: (h, y) with h as skinny_norm_linear returns it (x when there is no norm)."""
    N, K = weight.shape
    width = 2 * K if swiglu else K
    if x.shape[-1] != width:
        raise ValueError(f"skinny_linear: x has {x.shape[-1]} columns, the weight [{N}, {K}] needs {width}")
    if weight.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError(f"skinny_linear: weight must be {x.dtype} with contiguous rows")
    x2 = x.reshape(-1, width)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"skinny_linear: {M} rows, at most {MAX_ROWS}")
    res2, h = x2, x2
    if norm is not None:
        if norm.weight.shape != (K,) or norm.weight.dtype != x.dtype or (
                norm.residual is not None and (norm.residual.shape != x.shape or norm.residual.dtype != x.dtype)):
            raise ValueError(f"skinny_norm_linear: the norm's weight must be [{K}] and the residual {tuple(x.shape)}, "
                             f"both {x.dtype}")
        if norm.residual is not None:
            res2 = norm.residual.reshape(-1, K)
            res2 = res2 if res2.stride(1) == 1 else res2.contiguous()
            h = torch.empty_like(x2)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return (h.view(x.shape) if h is not x2 else x), y.view(*x.shape[:-1], N)
    blocks = triton.cdiv(N, config.block_n)
    splits = max(1, min(config.split_k, triton.cdiv(K, config.block_k)))
    if config.preload:
        splits = triton.cdiv(K, config.block_k)
    k_span = triton.cdiv(triton.cdiv(K, splits), config.block_k) * config.block_k
    splits = triton.cdiv(K, k_span)
    part = torch.empty(splits if splits > 1 else 0, M, N, dtype=torch.float32, device=x.device)
    tickets = _tickets(x.device, blocks)  # read only with splits > 1
    norm_mode = 0 if norm is None else 1 if norm.residual is None else 2
    _skinny_kernel[(blocks, splits)](
        x2, weight, y, part, tickets, M, N, K, x2.stride(0), weight.stride(0), y.stride(0), splits, k_span,
        res2, norm.weight if norm is not None else weight, h, res2.stride(0), h.stride(0),
        norm.eps if norm is not None else 0.0,
        SWIGLU=swiglu, DOT=config.dot, IEEE=x.dtype == torch.float32, SPLIT=splits > 1,
        INTERPRET=_INTERPRET, BLOCK_M=block_m(M, config.dot), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        LINE=min(config.block_k, L2_LINE_BYTES // weight.element_size()), PRELOAD=config.preload,
        NORM=norm_mode, NORM_K=triton.cdiv(K, config.block_k) * config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x.device))
    return (h.view(x.shape) if h is not x2 else x), y.view(*x.shape[:-1], N)


def reference(x: Tensor, weight: Tensor, swiglu: bool = False) -> Tensor:
    """What the PyTorch path computes: SwiGLU (when asked), then F.linear."""
    return F.linear(swiglu_reference(x) if swiglu else x, weight)


# --- the tuned table: which kernel each (GPU, weight shape, row bucket) runs --------------------------------------


def _bucket(rows: int) -> int:
    return next(b for b in ROW_BUCKETS if b >= rows)


def _load_table() -> dict:
    path = Path(os.environ.get(TABLE_ENV) or TABLE_PATH)
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


_table: dict | None = None
_device_names: dict[str, str] = {}


def table() -> dict:
    """{gpu name: {"N,K,swiglu,rows": {"use": "skinny" or "cublas" (which measured faster), "skinny": the fastest
    correct kernel config dict, or None if no candidate was correct}}}."""
    global _table
    if _table is None:
        _table = _load_table()
    return _table


def reload_table() -> None:
    global _table
    _table = None


def _device_name(device: torch.device) -> str:
    key = str(device)
    if key not in _device_names:
        _device_names[key] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return _device_names[key]


def entry_key(N: int, K: int, swiglu: bool, rows: int) -> str:
    return f"{N},{K},{int(swiglu)},{_bucket(rows)}"


def choose(device: torch.device, N: int, K: int, rows: int, swiglu: bool,
           dtype: torch.dtype = torch.bfloat16) -> LinearConfig | None:
    """The kernel config for this launch, or None for cuBLAS. The table is measured in bfloat16 (the serving
    dtype); other dtypes take cuBLAS unless forced."""
    force = os.environ.get(FORCE_ENV, "").strip().lower()
    if rows > MAX_ROWS:
        return None
    per_gpu = table().get(_device_name(device), {}) if dtype == TUNED_DTYPE else {}
    entry = per_gpu.get(entry_key(N, K, swiglu, rows))
    if pipelined(device):  # a pipelined step (engine.kernels.pdl): every projection preloads, in
        # the shape measured (a tuned entry's wider blocks would hold twice the registers a program while it waits)
        return replace(DEFAULT_CONFIG, block_k=PIPELINE_BLOCK_K, preload=True)
    if force == "cublas":
        return None
    if force == "triton":
        config = LinearConfig(**entry["skinny"]) if entry and entry["skinny"] else DEFAULT_CONFIG
    else:
        config = LinearConfig(**entry["skinny"]) if entry and entry["use"] == "skinny" else None
    return _preloaded(config)


def _preloaded(config: LinearConfig | None) -> LinearConfig | None:
    """config as VOICELANE_LINEAR_PRELOAD asks (unset or "off": unchanged; a power of two: that block_k, preload)."""
    value = os.environ.get(PRELOAD_ENV, "off").strip().lower() or "off"
    if config is None or value == "off":
        return config
    if not value.isdigit() or int(value) < 16 or int(value) & (int(value) - 1):
        raise ValueError(f"{PRELOAD_ENV}={value!r}: a power of two >= 16 (the K block), or off")
    return replace(config, block_k=int(value), preload=True)


def linear(x: Tensor, weight: Tensor, swiglu: bool = False) -> Tensor:
    """The model's linear layer on the Triton path: x [..., K] (or [..., 2K] with swiglu) @ weight [N, K]^T,
    by the tuned skinny kernel or by cuBLAS (engine.kernels.norm.swiglu first, for swiglu)."""
    N, K = weight.shape
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    config = choose(x.device, N, K, rows, swiglu, x.dtype)
    if config is not None:
        return skinny_linear(x, weight, config, swiglu)
    return F.linear(swiglu_kernel(x) if swiglu else x, weight)


def norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                weight: Tensor) -> tuple[Tensor, Tensor]:
    """add_rms_norm(x, residual, norm_weight, eps) then linear: (h, rms_norm(h) @ weight^T). One launch where the
    skinny kernel runs the shape (a pipelined step always does); the two kernels where cuBLAS
    does (the same arithmetic: the product then needs the normed rows in memory)."""
    N, K = weight.shape
    config = choose(x.device, N, K, x.numel() // K, False, x.dtype)
    if config is not None:
        return skinny_norm_linear(x, NormPrologue(residual, norm_weight, eps), weight, config)
    from engine.kernels.norm import add_rms_norm

    h, normed = add_rms_norm(x, residual, norm_weight, eps)
    return h, F.linear(normed, weight)


def kernels_status() -> dict:
    """For readiness: the GPUs the table was tuned on, and how many shapes take the Triton kernel on each."""
    return {"skinny_linear_tuned_for": {gpu: sum(v["use"] == "skinny" for v in entries.values())
                                        for gpu, entries in table().items()},
            "skinny_linear_force": os.environ.get(FORCE_ENV) or None,
            "skinny_linear_preload": os.environ.get(PRELOAD_ENV) or None}


def config_dict(config: LinearConfig | None) -> dict | None:
    return None if config is None else asdict(config)
