"""The Code Predictor's forward as one persistent kernel whose weights are read ahead of its barriers.

VOICELANE_CP_FORWARD=streamed, for forwards of at most STREAM_ROWS rows (a B1 or B2 frame; larger ones run the
layer-by-layer kernels, logged). The same 26 steps and 25 grid barriers as engine/kernels/cp_forward.py's
persistent mode (per layer qkv, attn, o, up, down; then the head), cut differently. That kernel spent 5 to 12 us a
step at B1 against 1 to 3 us of weights (docs/PERFORMANCE.md, fifth session): each step began its weight read
only after its barrier, so every step paid an HBM round trip and a filling pipeline on top of the barrier. Here:

- A step's output columns are cut once per program (cdiv(N, programs) columns, all of K): each program's tile of
  a step is one register tensor, read between the program's arrival at a barrier and its wait there: o's at
  q/k/v's barrier (held through attention), gate/up's at attention's, down's at up's, the next layer's q/k/v (or
  the head's) at down's; o's barrier reads nothing (gate/up and down at once would not fit the registers). Layer
  0's q/k/v is read before the kernel waits for its inputs (PDL), so it overlaps the kernels before it.
- After a barrier, a step reads its activation rows whole (a few KB, from L2; the norm's weight was read ahead
  with the tile) and multiplies them by the tile in registers: row dot products on the CUDA cores (at most
  STREAM_ROWS rows, no tensor-core tile to fill). An RMSNorm is taken from the row itself, which every program
  holds whole (no partial sums of squares).
- A barrier is an arrival (release) and a wait (relaxed polls, then one acquire), so the weight reads between them
  are in flight while the slowest program arrives.

Rounding follows engine/model/layers.py op by op as cp_forward does; the sums run in another order, so the result
equals the model's path within the dtype's tolerance, not bit for bit. A program holds at most about 96 KB of
weights (gate and up, then down, at 132 programs): 16 warps keep that under 128 registers a thread.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from engine.kernels.cp_forward import (
    SPIN_LIMIT,
    _attention_item,
    _multiprocessors,
    counter_slots,
    stacked_layers,
    steps,
)
from engine.kernels.gdc import wait_inputs
from engine.kernels.pdl import launch_options

STREAM_ROWS = 4  # rows (batch x tokens) of one launch: each row is a dot product per column on the CUDA cores
WARPS_ENV = "VOICELANE_CP_STREAM_WARPS"
DEFAULT_WARPS = 16


def stream_warps() -> int:
    value = os.environ.get(WARPS_ENV, "").strip() or str(DEFAULT_WARPS)
    if value not in ("4", "8", "16", "32"):
        raise ValueError(f"{WARPS_ENV}={value!r}: 4, 8, 16 or 32")
    return int(value)


def stamp_marks(layers: int) -> int:
    """Marks a program stamps in one probed forward (_stamp): a start and an end per step."""
    return 2 * steps(layers)


# --------------------------------------------------------------------------------------------------- device parts
@triton.jit
def _stamp(stamps_ptr, pid, mark, MARKS: tl.constexpr):
    """Probes (MARKS > 0, stamp_marks(L)): the global timer (ns) and this multiprocessor's clock (cycles) at `mark`
    of this program, into stamps_ptr [programs, MARKS, 2]. Mark 2s is step s's start (its barrier passed), 2s + 1
    its end (its stores issued, before its arrival)."""
    if MARKS > 0:
        timer = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        clock = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        at = stamps_ptr + (pid * MARKS + mark) * 2
        tl.store(at, timer)
        tl.store(at + 1, clock)


@triton.jit
def _arrive(counter_ptr, stamps_ptr, pid, mark, MARKS: tl.constexpr):
    """This program's step is done: its stores are visible to whoever acquires the counter after."""
    tl.debug_barrier()
    _stamp(stamps_ptr, pid, mark, MARKS)
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(counter_ptr, target, timeouts_ptr, stamps_ptr, pid, mark, SPIN_LIMIT: tl.constexpr,
          ACQUIRE_POLL: tl.constexpr, MARKS: tl.constexpr):
    """Until `target` programs have arrived: relaxed polls, then one acquire (an arrival is a read-modify-write, so
    reading the last one synchronises with every release before it); ACQUIRE_POLL: every poll an acquire (one L2
    round trip fewer after the last arrival, an L1 invalidation a poll). Past SPIN_LIMIT polls it counts a timeout
    and goes on, as cp_forward's _grid_barrier does."""
    if ACQUIRE_POLL:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        polls = 0
        while (arrived < target) & (polls < SPIN_LIMIT):
            arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            polls += 1
    else:
        arrived = tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu")
        polls = 0
        while (arrived < target) & (polls < SPIN_LIMIT):
            arrived = tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu")
            polls += 1
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")  # its value used: not optimised away
    if arrived < target:
        tl.atomic_add(timeouts_ptr, 1)
    tl.debug_barrier()
    _stamp(stamps_ptr, pid, mark, MARKS)


@triton.jit
def _weights(w_ptr, tile, N: tl.constexpr, K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows tile * CN .. tile * CN + CN - 1 of w [N, K] (row-major) as one [BN, BK] tensor, zeros past CN, N and K
    (a tile past the last reads nothing)."""
    r = tl.arange(0, BN)
    n = tile * CN + r
    k = tl.arange(0, BK)
    ok = ((r < CN) & (n < N))[:, None] & (k < K)[None, :]
    return tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=ok, other=0.0)


@triton.jit
def _row(x_ptr, row, K: tl.constexpr, BK: tl.constexpr):
    """Row `row` of a [rows, K] activation written by other programs before the last barrier (read from L2)."""
    k = tl.arange(0, BK)
    return tl.load(x_ptr + row * K + k, mask=k < K, other=0.0, cache_modifier=".cg")


@triton.jit
def _norm_weight(norm_ptr, K: tl.constexpr, BK: tl.constexpr):
    """An RMSNorm's weight [BK] in fp32 (zeros past K): read ahead with the step's weights, so the norm after the
    barrier waits on no load of its own."""
    k = tl.arange(0, BK)
    return tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)


@triton.jit
def _normed(x, nw, K: tl.constexpr, eps):
    """RMSNorm of one row x [BK] (zeros past K) times the norm's weight nw (_norm_weight), rounded as add_rms_norm
    rounds."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    return (nw * (xf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _dot(w, x):
    """w [BN, BK] times the row x [BK]: [BN] fp32."""
    return tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _store_cols(y_ptr, row, tile, y, N: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr):
    r = tl.arange(0, BN)
    n = tile * CN + r
    tl.store(y_ptr + row * N + n, y, mask=(r < CN) & (n < N))


@triton.jit
def _projection(x_ptr, nw, w, w_ptr, y_ptr, pid, programs, eps, ROWS: tl.constexpr, N: tl.constexpr,
                K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[ROWS, N] = RMSNorm(x)[ROWS, K] @ w_ptr[N, K]^T, tile by tile; w: this program's first tile, read ahead (a
    program with several tiles, as in the interpreter's single program, reads the rest as it goes)."""
    tile = pid
    while tile < (N + CN - 1) // CN:
        for m in tl.static_range(ROWS):
            x = _normed(_row(x_ptr, m, K, BK), nw, K, eps)
            _store_cols(y_ptr, m, tile, _dot(w, x).to(y_ptr.dtype.element_ty), N, CN, BN)
        tile += programs
        w = _weights(w_ptr, tile, N, K, CN, BN, BK)


@triton.jit
def _residual(x_ptr, w, w_ptr, res_ptr, h_ptr, pid, programs, ROWS: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
              CN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """h[ROWS, N] = x[ROWS, K] @ w_ptr[N, K]^T + res, rounded as add_rms_norm's residual add; in place is fine (a
    column belongs to one program)."""
    tile = pid
    while tile < (N + CN - 1) // CN:
        r = tl.arange(0, BN)
        n = tile * CN + r
        ok = (r < CN) & (n < N)
        for m in tl.static_range(ROWS):
            res = tl.load(res_ptr + m * N + n, mask=ok, other=0.0, cache_modifier=".cg")
            acc = _dot(w, _row(x_ptr, m, K, BK))
            y = (acc.to(res.dtype).to(tl.float32) + res.to(tl.float32)).to(res.dtype)
            tl.store(h_ptr + m * N + n, y, mask=ok)
        tile += programs
        w = _weights(w_ptr, tile, N, K, CN, BN, BK)


@triton.jit
def _swiglu(x_ptr, nw, w_gate, w_up, gu_ptr, act_ptr, pid, programs, eps, ROWS: tl.constexpr, FF: tl.constexpr,
            K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """act[ROWS, FF] = SwiGLU(RMSNorm(x) @ gate^T, RMSNorm(x) @ up^T); gu_ptr: [gate; up] [2 FF, K]."""
    tile = pid
    while tile < (FF + CN - 1) // CN:
        for m in tl.static_range(ROWS):
            x = _normed(_row(x_ptr, m, K, BK), nw, K, eps)
            gate = _dot(w_gate, x).to(act_ptr.dtype.element_ty).to(tl.float32)
            up = _dot(w_up, x).to(act_ptr.dtype.element_ty)
            silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # SwiGLU as engine.kernels.norm.swiglu
            _store_cols(act_ptr, m, tile, (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype), FF, CN, BN)
        tile += programs
        w_gate = _weights(gu_ptr, tile, FF, K, CN, BN, BK)
        w_up = _weights(gu_ptr + FF * K, tile, FF, K, CN, BN, BK)


@triton.jit
def _cp_stream_kernel(x_ptr, h_ptr, qkv_ptr, attn_ptr, act_ptr, out_ptr, bar_ptr, stamps_ptr,
                      w_in_ptr, w_qkv_ptr, w_qn_ptr, w_kn_ptr, w_o_ptr, w_post_ptr, w_gu_ptr, w_down_ptr,
                      w_final_ptr, w_head_ptr,
                      kc_ptr, vc_ptr, s_kl, s_cs, s_ch, s_cl, cos_ptr, sin_ptr, s_cb, s_ct, s_sb, s_st,
                      slots_ptr, pos_ptr, s_pb, s_pt, B, T, target, eps, scale,
                      L: tl.constexpr, H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      FF: tl.constexpr, V: tl.constexpr, ROWS: tl.constexpr, BLOCK_QM: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                      CN_QKV: tl.constexpr, BN_QKV: tl.constexpr, CN_RES: tl.constexpr, BN_RES: tl.constexpr,
                      CN_UP: tl.constexpr, BN_UP: tl.constexpr, CN_HEAD: tl.constexpr, BN_HEAD: tl.constexpr,
                      BK_H: tl.constexpr, BK_O: tl.constexpr, BK_FF: tl.constexpr,
                      SPIN_LIMIT: tl.constexpr, ACQUIRE_POLL: tl.constexpr, IEEE: tl.constexpr, GDC: tl.constexpr,
                      MARKS: tl.constexpr = 0, LAYER_WEIGHTS: tl.constexpr = True):
    """MARKS, LAYER_WEIGHTS: probes only (stream_forward's stamps, layer_weights)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    HO: tl.constexpr = HQ * D  # the o projection's K
    timeouts = bar_ptr + 5 * L + 1  # cp_forward.counter_slots' layout: a counter per step, then the timeouts
    w_qkv = _weights(w_qkv_ptr, pid, NQKV, H, CN_QKV, BN_QKV, BK_H)  # constants: read before the inputs are ready
    nw_in = _norm_weight(w_in_ptr, H, BK_H)
    wait_inputs(GDC)
    _stamp(stamps_ptr, pid, 0, MARKS)
    for layer in tl.static_range(L):
        residual = h_ptr
        if layer == 0:
            residual = x_ptr  # the stack's input is the first residual
        at = layer if LAYER_WEIGHTS else 0  # the weights' layer (a probe reads layer 0's for every layer)
        bar = bar_ptr + 5 * layer
        mark = 10 * layer  # step 5 * layer's start
        # qkv
        _projection(residual, nw_in, w_qkv, w_qkv_ptr + at * NQKV * H, qkv_ptr, pid, programs, eps,
                    ROWS, NQKV, H, CN_QKV, BN_QKV, BK_H)
        _arrive(bar, stamps_ptr, pid, mark + 1, MARKS)
        w_o = _weights(w_o_ptr + at * H * HO, pid, H, HO, CN_RES, BN_RES, BK_O)
        _wait(bar, target, timeouts, stamps_ptr, pid, mark + 2, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
        # attn
        item = pid
        while item < B * HKV:
            _attention_item(item // HKV, item % HKV, T, qkv_ptr, attn_ptr, w_qn_ptr + layer * D, w_kn_ptr + layer * D,
                            cos_ptr, sin_ptr, s_cb, s_ct, s_sb, s_st, kc_ptr + layer * s_kl, vc_ptr + layer * s_kl,
                            s_cs, s_ch, s_cl, slots_ptr, pos_ptr, s_pb, s_pt, eps, scale, HQ, HKV, D, BLOCK_QM,
                            BLOCK_T, BLOCK_C, IEEE)
            item += programs
        _arrive(bar + 1, stamps_ptr, pid, mark + 3, MARKS)
        gu = w_gu_ptr + at * 2 * FF * H
        w_gate = _weights(gu, pid, FF, H, CN_UP, BN_UP, BK_H)
        w_up = _weights(gu + FF * H, pid, FF, H, CN_UP, BN_UP, BK_H)
        nw_post = _norm_weight(w_post_ptr + layer * H, H, BK_H)
        _wait(bar + 1, target, timeouts, stamps_ptr, pid, mark + 4, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
        # o
        _residual(attn_ptr, w_o, w_o_ptr + at * H * HO, residual, h_ptr, pid, programs, ROWS, H, HO, CN_RES, BN_RES,
                  BK_O)
        _arrive(bar + 2, stamps_ptr, pid, mark + 5, MARKS)
        _wait(bar + 2, target, timeouts, stamps_ptr, pid, mark + 6, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
        # up
        _swiglu(h_ptr, nw_post, w_gate, w_up, gu, act_ptr, pid, programs, eps, ROWS, FF, H, CN_UP, BN_UP,
                BK_H)
        _arrive(bar + 3, stamps_ptr, pid, mark + 7, MARKS)
        w_down = _weights(w_down_ptr + at * H * FF, pid, H, FF, CN_RES, BN_RES, BK_FF)
        _wait(bar + 3, target, timeouts, stamps_ptr, pid, mark + 8, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
        # down
        _residual(act_ptr, w_down, w_down_ptr + at * H * FF, h_ptr, h_ptr, pid, programs, ROWS, H, FF, CN_RES,
                  BN_RES, BK_FF)
        _arrive(bar + 4, stamps_ptr, pid, mark + 9, MARKS)
        if layer + 1 < L:
            w_qkv = _weights(w_qkv_ptr + (at + 1 if LAYER_WEIGHTS else 0) * NQKV * H, pid, NQKV, H, CN_QKV, BN_QKV,
                             BK_H)
            nw_in = _norm_weight(w_in_ptr + (layer + 1) * H, H, BK_H)
        else:
            w_head = _weights(w_head_ptr, pid, V, H, CN_HEAD, BN_HEAD, BK_H)
            nw_final = _norm_weight(w_final_ptr, H, BK_H)
        _wait(bar + 4, target, timeouts, stamps_ptr, pid, mark + 10, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
    # the head, on each batch row's last token
    tile = pid
    while tile < (V + CN_HEAD - 1) // CN_HEAD:
        b = 0
        while b < B:
            x = _normed(_row(h_ptr, b * T + T - 1, H, BK_H), nw_final, H, eps)
            _store_cols(out_ptr, b, tile, _dot(w_head, x).to(out_ptr.dtype.element_ty), V, CN_HEAD, BN_HEAD)
            b += 1
        tile += programs
        w_head = _weights(w_head_ptr, tile, V, H, CN_HEAD, BN_HEAD, BK_H)
    tl.debug_barrier()
    _stamp(stamps_ptr, pid, 10 * L + 1, MARKS)


# --------------------------------------------------------------------------------------------------- launch
# tests: columns a program per step kind ("qkv", "residual", "up", "head") instead of an even cut over the grid, so
# that one program takes several tiles of a step
_TEST_COLUMNS: dict[str, int] | None = None


def stream_forward(stack: nn.Module, x: Tensor, cos: Tensor, sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slots: Tensor, positions: Tensor, final_norm: Tensor, head: Tensor, counters: Tensor | None = None,
                   programs: int | None = None, barrier_target: int | None = None,
                   spin_limit: int = SPIN_LIMIT, acquire_poll: bool = False, stamps: Tensor | None = None,
                   layer_weights: bool = True) -> Tensor:
    """One forward of the decoder stack and its head, as cp_forward (same arguments; counters: one row of
    cp_forward.barrier_counters, None: allocated here): the logits [B, V] of each row's last token. Probes only:
    acquire_poll, every barrier poll an acquire (_wait); stamps, an int64 [programs, stamp_marks(L), 2] that gets
    each program's timer and clock at each step's start and end (_stamp; GPU only: the interpreter has no inline
    assembly); layer_weights False, every layer multiplies by layer 0's weights (wrong logits; its timing says what
    the forward costs with weights that stay in L2)."""
    weights = stacked_layers(stack)
    cfg = stack.cfg
    B, T, H = x.shape
    L, HQ, HKV, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    FF, V = cfg.intermediate_size, head.shape[0]
    C = k_cache.shape[3]
    if (not x.is_contiguous() or k_cache.shape[:3] != (L, k_cache.shape[1], HKV) or k_cache.stride() != v_cache.stride()
            or C > 64 or head.shape[1] != H or T * (HQ // HKV) > 64):
        raise ValueError(f"stream_forward: x {tuple(x.shape)}, cache {tuple(k_cache.shape)}, head {tuple(head.shape)} "
                         f"do not fit a {L}-layer stack of width {H} ({HQ} heads, {HKV} kv heads, head_dim {D})")
    M = B * T
    if M > STREAM_ROWS:
        raise ValueError(f"stream_forward: {M} rows, at most {STREAM_ROWS} a launch")
    dev, dtype = x.device, x.dtype
    if programs is None:
        programs = _multiprocessors(dev) if dev.type == "cuda" else 1
    nqkv = (HQ + 2 * HKV) * D
    cut = {"qkv": nqkv, "residual": H, "up": FF, "head": V}
    per = {name: (_TEST_COLUMNS or {}).get(name, triton.cdiv(n, programs)) for name, n in cut.items()}
    h = torch.empty(M, H, device=dev, dtype=dtype)
    qkv = torch.empty(M, nqkv, device=dev, dtype=dtype)
    attn = torch.empty(M, HQ * D, device=dev, dtype=dtype)
    act = torch.empty(M, FF, device=dev, dtype=dtype)
    out = torch.empty(B, V, device=dev, dtype=dtype)
    if counters is None:
        counters = torch.zeros(counter_slots(L), device=dev, dtype=torch.int32)
    if stamps is not None and (stamps.shape != (programs, stamp_marks(L), 2) or stamps.dtype != torch.int64):
        raise ValueError(f"stream_forward: stamps {tuple(stamps.shape)} {stamps.dtype}, not int64 "
                         f"{(programs, stamp_marks(L), 2)}")
    _cp_stream_kernel[(programs,)](
        x, h, qkv, attn, act, out, counters, counters if stamps is None else stamps,
        weights.input_norm, weights.qkv, weights.q_norm, weights.k_norm, weights.o, weights.post_norm,
        weights.gate_up, weights.down, final_norm, head,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        cos, sin_signed, cos.stride(0), cos.stride(1), sin_signed.stride(0), sin_signed.stride(1),
        slots, positions, positions.stride(0), positions.stride(1), B, T,
        programs if barrier_target is None else barrier_target, stack.norm.eps, D**-0.5,
        L=L, H=H, HQ=HQ, HKV=HKV, D=D, FF=FF, V=V, ROWS=M,
        BLOCK_QM=max(16, triton.next_power_of_2(T * HQ // HKV)), BLOCK_T=max(2, triton.next_power_of_2(T)),
        BLOCK_C=max(16, triton.next_power_of_2(C)),
        CN_QKV=per["qkv"], BN_QKV=triton.next_power_of_2(per["qkv"]),
        CN_RES=per["residual"], BN_RES=triton.next_power_of_2(per["residual"]),
        CN_UP=per["up"], BN_UP=triton.next_power_of_2(per["up"]),
        CN_HEAD=per["head"], BN_HEAD=triton.next_power_of_2(per["head"]),
        BK_H=triton.next_power_of_2(H), BK_O=triton.next_power_of_2(HQ * D), BK_FF=triton.next_power_of_2(FF),
        SPIN_LIMIT=spin_limit, ACQUIRE_POLL=acquire_poll, IEEE=dtype == torch.float32, num_warps=stream_warps(),
        MARKS=0 if stamps is None else stamp_marks(L), LAYER_WEIGHTS=layer_weights, num_stages=1,
        **launch_options(dev))
    return out
