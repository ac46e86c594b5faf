"""The Code Predictor's forward as one persistent kernel whose weights are read ahead of its barriers.

VOICELANE_CP_FORWARD=streamed, for forwards of at most STREAM_ROWS rows (a B1 or B2 frame; larger ones run the
layer-by-layer kernels, logged). The same 26 steps and 25 grid barriers as engine/kernels/cp_forward.py's
persistent mode (per layer qkv, attn, o, up, down; then the head), cut differently. That kernel spent 5 to 12 us a
step at B1 against 1 to 3 us of weights (docs/PERFORMANCE.md, fifth session): each step began its weight read
only after its barrier, so every step paid an HBM round trip and a filling pipeline on top of the barrier. Here:

- A step's output columns are cut once per program (cdiv(N, programs) columns, all of K): each program's tile of
  a step is held in registers, read between the program's arrival at a barrier and its wait there: o's at
  q/k/v's barrier (held through attention), gate's at attention's, up's at o's, down's at up's, the next layer's
  q/k/v (or the head's) at down's. Layer 0's q/k/v is read before the kernel waits for its inputs (PDL), so it
  overlaps the kernels before it.
- A tile is [rows, chunks, chunk] (_tile): a chunk is 16 bytes a lane over a warp's 32 lanes, so triton puts a
  row's K in one warp and the warps along the rows. After a barrier each warp reads the activation row it needs
  in that same layout (_row: a few KB, the same for every warp; the barrier's acquire cleared L1) with the norm's
  weight, and a step's products, RMSNorm and stores need no exchange between warps (a 2026-12-08 sm_90 build: 2
  CTA barriers in a q/k/v step, where the layout with warps across K had about 10, each after a round through
  shared memory). The products run on the CUDA cores (at most STREAM_ROWS rows, no tensor-core tile to fill).
- A barrier is an arrival (release) and a wait (relaxed polls, then one acquire), so the weight reads between them
  are in flight while the slowest program arrives.

Rounding follows engine/model/layers.py op by op as cp_forward does; the sums run in another order, so the result
equals the model's path within the dtype's tolerance, not bit for bit. A program holds at most about 96 KB of
weights (gate and up at 132 programs, as two halves of a warp's row each: _swiglu). 8 warps (DEFAULT_WARPS): 255
registers a thread and about 0.1 KB spilled (ptxas -v of the sm_90 build); 16 warps fit 128 registers with 0.6 KB
spilled and repeat each row's RMSNorm in twice as many warps: 173.8 against 161.2 us a B1 forward on an H100
(docs/PERFORMANCE.md, twenty-first session). A tile loop on the GPU spilled 2.4 KB: hence ONE_TILE.
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
from engine.kernels.gdc import prefetch_l2, wait_inputs
from engine.kernels.pdl import launch_options

STREAM_ROWS = 4  # rows (batch x tokens) of one launch: each row is a dot product per column on the CUDA cores
WARPS_ENV = "VOICELANE_CP_STREAM_WARPS"
DEFAULT_WARPS = 8  # measured against 16 and 32 (above)


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
def _tile(w_ptr, tile, N: tl.constexpr, K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr, K0: tl.constexpr,
          C: tl.constexpr, KC: tl.constexpr, R0: tl.constexpr = 0):
    """Rows tile * CN + R0 .. tile * CN + R0 + BN - 1 of w [N, K] (row-major; the tile's CN rows, from its row R0),
    columns K0 .. K0 + C * KC - 1, as one [BN, C, KC] tensor (zeros past CN, N and K; a tile past the last reads
    nothing). With KC = 16 bytes a lane of a warp's 32 lanes, triton lays a row's C x KC out in one warp and the
    warps along BN, so the products below need no exchange between warps."""
    r = R0 + tl.arange(0, BN)[:, None, None]
    n = tile * CN + r
    k = K0 + tl.arange(0, C)[None, :, None] * KC + tl.arange(0, KC)[None, None, :]
    return tl.load(w_ptr + n.to(tl.int64) * K + k, mask=(r < CN) & (n < N) & (k < K), other=0.0)


@triton.jit
def _prefetch(w_ptr, tile, N: tl.constexpr, K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr,
              PREFETCH: tl.constexpr):
    """PREFETCH: bring this program's tile of w [N, K] (rows tile * CN .., all of K) into L2, one hint a 128-byte
    line, no registers: the weighted step after the one whose tile is read into registers at the same barrier, so
    that read finds its tile in L2 (the probe's weights-in-L2 forward is the bound). Every hint points inside w: a row
    past the tile's last is its first, a tile past the last is w's last row."""
    if PREFETCH:
        prefetch_l2(_lines(w_ptr, tile, N, K, CN, BN))


@triton.jit
def _lines(w_ptr, tile, N: tl.constexpr, K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr):
    """_prefetch's addresses: one in each 128-byte line of the tile's rows, [BN, lines]."""
    LINE: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth * 8
    r = tl.arange(0, BN)[:, None]
    n = tl.minimum(tl.where((r < CN) & (tile * CN + r < N), tile * CN + r, tile * CN), N - 1)
    k = tl.arange(0, triton.next_power_of_2((K + LINE - 1) // LINE))[None, :] * LINE
    return w_ptr + n.to(tl.int64) * K + tl.minimum(k, K - 1)


@triton.jit
def _row(x_ptr, row, K: tl.constexpr, BN: tl.constexpr, K0: tl.constexpr, C: tl.constexpr, KC: tl.constexpr):
    """Row `row` of a [rows, K] activation (or a [K] weight), columns K0 .., repeated over BN as [BN, C, KC]: the
    layout of a _tile, so each warp reads the row it multiplies (written by other programs before the last barrier,
    whose acquire invalidated this multiprocessor's L1)."""
    k = K0 + tl.arange(0, C)[None, :, None] * KC + tl.arange(0, KC)[None, None, :] + tl.arange(0, BN)[:, None, None] * 0
    return tl.load(x_ptr + row * K + k, mask=k < K, other=0.0)


@triton.jit
def _normed(x, nw, K: tl.constexpr, eps):
    """RMSNorm of one row x [BN, C, KC] (zeros past K, the same in every BN) times the norm's weight nw (a _row of
    it), rounded as add_rms_norm rounds."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(xf * xf, axis=1), axis=1) / K + eps)
    return (nw.to(tl.float32) * (xf * rstd[:, None, None]).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _dot(w, x):
    """A tile w [BN, C, KC] times a row x [BN, C, KC]: [BN] fp32 (each warp sums its own rows)."""
    return tl.sum(tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1), axis=1)


@triton.jit
def _columns(y_ptr, row, tile, N: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr, C: tl.constexpr,
             KC: tl.constexpr, R0: tl.constexpr = 0):
    """Where a tile's [BN] results (from its row R0) go in row `row` of y [rows, N], as [BN, C, KC] pointers in the
    tile's layout, and the mask that keeps one element a column (no layout conversion before the store)."""
    r = R0 + tl.arange(0, BN)[:, None, None]
    n = tile * CN + r
    first = (tl.arange(0, C)[None, :, None] == 0) & (tl.arange(0, KC)[None, None, :] == 0)
    return y_ptr + row * N + n + first * 0, (r < CN) & (n < N) & first


@triton.jit
def _projection_tile(x_ptr, norm_ptr, w, y_ptr, tile, eps, ROWS: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     CN: tl.constexpr, BN: tl.constexpr, C: tl.constexpr, KC: tl.constexpr):
    nw = _row(norm_ptr, 0, K, BN, 0, C, KC)
    for m in tl.static_range(ROWS):
        x = _normed(_row(x_ptr, m, K, BN, 0, C, KC), nw, K, eps)
        at, ok = _columns(y_ptr, m, tile, N, CN, BN, C, KC)
        tl.store(at, _dot(w, x).to(y_ptr.dtype.element_ty)[:, None, None], mask=ok)


@triton.jit
def _projection(x_ptr, norm_ptr, w, w_ptr, y_ptr, pid, programs, eps, ROWS: tl.constexpr, N: tl.constexpr,
                K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr, C: tl.constexpr, KC: tl.constexpr,
                ONE_TILE: tl.constexpr):
    """y[ROWS, N] = RMSNorm(x)[ROWS, K] @ w_ptr[N, K]^T; w: this program's tile, read ahead. ONE_TILE: no program
    has a second tile (the GPU's cut: no loop whose carried tiles the compiler would spill); else (the
    interpreter's single program) tile by tile, reading the rest as it goes."""
    if ONE_TILE:
        _projection_tile(x_ptr, norm_ptr, w, y_ptr, pid, eps, ROWS, N, K, CN, BN, C, KC)
    else:
        tile = pid
        while tile < (N + CN - 1) // CN:
            _projection_tile(x_ptr, norm_ptr, w, y_ptr, tile, eps, ROWS, N, K, CN, BN, C, KC)
            tile += programs
            w = _tile(w_ptr, tile, N, K, CN, BN, 0, C, KC)


@triton.jit
def _residual_tile(x_ptr, wa, wb, res_ptr, h_ptr, tile, ROWS: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                   CN: tl.constexpr, BN: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr, KC: tl.constexpr):
    for m in tl.static_range(ROWS):
        at, ok = _columns(res_ptr, m, tile, N, CN, BN, CA, KC)
        res = tl.load(at, mask=ok, other=0.0)
        acc = _dot(wa, _row(x_ptr, m, K, BN, 0, CA, KC))
        if CB > 0:
            acc += _dot(wb, _row(x_ptr, m, K, BN, CA * KC, CB, KC))
        y = (acc.to(res.dtype).to(tl.float32)[:, None, None] + res.to(tl.float32)).to(res.dtype)
        at, ok = _columns(h_ptr, m, tile, N, CN, BN, CA, KC)
        tl.store(at, y, mask=ok)


@triton.jit
def _residual(x_ptr, wa, wb, w_ptr, res_ptr, h_ptr, pid, programs, ROWS: tl.constexpr, N: tl.constexpr,
              K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr,
              KC: tl.constexpr, ONE_TILE: tl.constexpr):
    """h[ROWS, N] = x[ROWS, K] @ w_ptr[N, K]^T + res, rounded as add_rms_norm's residual add; in place is fine (a
    column belongs to one thread). K in two parts: wa, columns 0 .. CA * KC - 1, and wb, the rest (CB chunks; none
    if CB is 0), since a tensor's chunks are a power of two. ONE_TILE as _projection."""
    if ONE_TILE:
        _residual_tile(x_ptr, wa, wb, res_ptr, h_ptr, pid, ROWS, N, K, CN, BN, CA, CB, KC)
    else:
        tile = pid
        while tile < (N + CN - 1) // CN:
            _residual_tile(x_ptr, wa, wb, res_ptr, h_ptr, tile, ROWS, N, K, CN, BN, CA, CB, KC)
            tile += programs
            wa = _tile(w_ptr, tile, N, K, CN, BN, 0, CA, KC)
            if CB > 0:
                wb = _tile(w_ptr, tile, N, K, CN, BN, CA * KC, CB, KC)


@triton.jit
def _gated(x, w_gate, w_up, act_ptr, m, tile, FF: tl.constexpr, CN: tl.constexpr, BH: tl.constexpr,
           C: tl.constexpr, KC: tl.constexpr, R0: tl.constexpr):
    """One half of a gate/up tile (rows R0 .. R0 + BH - 1) on the normed row x: SwiGLU into act's row m."""
    gate = _dot(w_gate, x).to(act_ptr.dtype.element_ty).to(tl.float32)
    up = _dot(w_up, x).to(act_ptr.dtype.element_ty)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # SwiGLU as engine.kernels.norm.swiglu
    at, ok = _columns(act_ptr, m, tile, FF, CN, BH, C, KC, R0)
    tl.store(at, (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)[:, None, None], mask=ok)


@triton.jit
def _swiglu_tile(x_ptr, norm_ptr, g0, g1, u0, u1, act_ptr, tile, eps, ROWS: tl.constexpr, FF: tl.constexpr,
                 K: tl.constexpr, CN: tl.constexpr, BH: tl.constexpr, C: tl.constexpr, KC: tl.constexpr):
    nw = _row(norm_ptr, 0, K, BH, 0, C, KC)
    for m in tl.static_range(ROWS):
        x = _normed(_row(x_ptr, m, K, BH, 0, C, KC), nw, K, eps)
        _gated(x, g0, u0, act_ptr, m, tile, FF, CN, BH, C, KC, 0)
        _gated(x, g1, u1, act_ptr, m, tile, FF, CN, BH, C, KC, BH)


@triton.jit
def _swiglu(x_ptr, norm_ptr, g0, g1, u0, u1, gu_ptr, act_ptr, pid, programs, eps, ROWS: tl.constexpr,
            FF: tl.constexpr, K: tl.constexpr, CN: tl.constexpr, BH: tl.constexpr, C: tl.constexpr,
            KC: tl.constexpr, ONE_TILE: tl.constexpr):
    """act[ROWS, FF] = SwiGLU(RMSNorm(x) @ gate^T, RMSNorm(x) @ up^T); gu_ptr: [gate; up] [2 FF, K]. A tile comes
    in two halves of BH rows (g0/u0 and g1/u1), so the row x and the norm's weight are held once for the warps'
    one row each, not once a row of the tile: the largest step fits the registers. ONE_TILE as _projection."""
    if ONE_TILE:
        _swiglu_tile(x_ptr, norm_ptr, g0, g1, u0, u1, act_ptr, pid, eps, ROWS, FF, K, CN, BH, C, KC)
    else:
        tile = pid
        while tile < (FF + CN - 1) // CN:
            _swiglu_tile(x_ptr, norm_ptr, g0, g1, u0, u1, act_ptr, tile, eps, ROWS, FF, K, CN, BH, C, KC)
            tile += programs
            g0 = _tile(gu_ptr, tile, FF, K, CN, BH, 0, C, KC, 0)
            g1 = _tile(gu_ptr, tile, FF, K, CN, BH, 0, C, KC, BH)
            u0 = _tile(gu_ptr + FF * K, tile, FF, K, CN, BH, 0, C, KC, 0)
            u1 = _tile(gu_ptr + FF * K, tile, FF, K, CN, BH, 0, C, KC, BH)


@triton.jit
def _head_tile(h_ptr, norm_ptr, w, out_ptr, tile, B, T, eps, H: tl.constexpr, V: tl.constexpr, CN: tl.constexpr,
               BN: tl.constexpr, C: tl.constexpr, KC: tl.constexpr):
    """The head's tile on each batch row's last token (rows b * T + T - 1 of h)."""
    nw = _row(norm_ptr, 0, H, BN, 0, C, KC)
    b = 0
    while b < B:
        x = _normed(_row(h_ptr, b * T + T - 1, H, BN, 0, C, KC), nw, H, eps)
        at, ok = _columns(out_ptr, b, tile, V, CN, BN, C, KC)
        tl.store(at, _dot(w, x).to(out_ptr.dtype.element_ty)[:, None, None], mask=ok)
        b += 1


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
                      KC: tl.constexpr, C_H: tl.constexpr, CA_O: tl.constexpr, CB_O: tl.constexpr,
                      CA_FF: tl.constexpr, CB_FF: tl.constexpr, ONE_TILE: tl.constexpr,
                      SPIN_LIMIT: tl.constexpr, ACQUIRE_POLL: tl.constexpr, IEEE: tl.constexpr, GDC: tl.constexpr,
                      MARKS: tl.constexpr = 0, LAYER_WEIGHTS: tl.constexpr = True, PREFETCH: tl.constexpr = False):
    """KC: columns of K a chunk; C_H: chunks of H (the normed inputs, one part); CA_O + CB_O and CA_FF + CB_FF: the
    o and down projections' K in two parts (_residual). MARKS, LAYER_WEIGHTS: probes only (stream_forward's stamps,
    layer_weights)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    HO: tl.constexpr = HQ * D  # the o projection's K
    timeouts = bar_ptr + 5 * L + 1  # cp_forward.counter_slots' layout: a counter per step, then the timeouts
    w_qkv = _tile(w_qkv_ptr, pid, NQKV, H, CN_QKV, BN_QKV, 0, C_H, KC)  # constants: read before the inputs are ready
    _prefetch(w_o_ptr, pid, H, HO, CN_RES, BN_RES, PREFETCH)
    wait_inputs(GDC)
    _stamp(stamps_ptr, pid, 0, MARKS)
    for layer in tl.static_range(L):
        residual = h_ptr
        if layer == 0:
            residual = x_ptr  # the stack's input is the first residual
        wl = layer if LAYER_WEIGHTS else 0  # the weights' layer (a probe reads layer 0's for every layer)
        bar = bar_ptr + 5 * layer
        mark = 10 * layer  # step 5 * layer's start
        o = w_o_ptr + wl * H * HO
        gu = w_gu_ptr + wl * 2 * FF * H
        down = w_down_ptr + wl * H * FF
        # qkv
        _projection(residual, w_in_ptr + layer * H, w_qkv, w_qkv_ptr + wl * NQKV * H, qkv_ptr, pid, programs, eps,
                    ROWS, NQKV, H, CN_QKV, BN_QKV, C_H, KC, ONE_TILE)
        _arrive(bar, stamps_ptr, pid, mark + 1, MARKS)
        w_oa = _tile(o, pid, H, HO, CN_RES, BN_RES, 0, CA_O, KC)
        w_ob = w_oa
        if CB_O > 0:
            w_ob = _tile(o, pid, H, HO, CN_RES, BN_RES, CA_O * KC, CB_O, KC)
        _prefetch(gu, pid, FF, H, CN_UP, BN_UP, PREFETCH)
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
        g0 = _tile(gu, pid, FF, H, CN_UP, BN_UP // 2, 0, C_H, KC, 0)
        g1 = _tile(gu, pid, FF, H, CN_UP, BN_UP // 2, 0, C_H, KC, BN_UP // 2)
        _prefetch(gu + FF * H, pid, FF, H, CN_UP, BN_UP, PREFETCH)
        _wait(bar + 1, target, timeouts, stamps_ptr, pid, mark + 4, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
        # o
        _residual(attn_ptr, w_oa, w_ob, o, residual, h_ptr, pid, programs, ROWS, H, HO, CN_RES, BN_RES, CA_O, CB_O,
                  KC, ONE_TILE)
        _arrive(bar + 2, stamps_ptr, pid, mark + 5, MARKS)
        u0 = _tile(gu + FF * H, pid, FF, H, CN_UP, BN_UP // 2, 0, C_H, KC, 0)
        u1 = _tile(gu + FF * H, pid, FF, H, CN_UP, BN_UP // 2, 0, C_H, KC, BN_UP // 2)
        _prefetch(down, pid, H, FF, CN_RES, BN_RES, PREFETCH)
        _wait(bar + 2, target, timeouts, stamps_ptr, pid, mark + 6, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
        # up
        _swiglu(h_ptr, w_post_ptr + layer * H, g0, g1, u0, u1, gu, act_ptr, pid, programs, eps, ROWS, FF, H, CN_UP,
                BN_UP // 2, C_H, KC, ONE_TILE)
        _arrive(bar + 3, stamps_ptr, pid, mark + 7, MARKS)
        w_da = _tile(down, pid, H, FF, CN_RES, BN_RES, 0, CA_FF, KC)
        w_db = w_da
        if CB_FF > 0:
            w_db = _tile(down, pid, H, FF, CN_RES, BN_RES, CA_FF * KC, CB_FF, KC)
        if layer + 1 < L:
            _prefetch(w_qkv_ptr + (wl + 1 if LAYER_WEIGHTS else 0) * NQKV * H, pid, NQKV, H, CN_QKV, BN_QKV, PREFETCH)
        else:
            _prefetch(w_head_ptr, pid, V, H, CN_HEAD, BN_HEAD, PREFETCH)
        _wait(bar + 3, target, timeouts, stamps_ptr, pid, mark + 8, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
        # down
        _residual(act_ptr, w_da, w_db, down, h_ptr, h_ptr, pid, programs, ROWS, H, FF, CN_RES, BN_RES, CA_FF, CB_FF,
                  KC, ONE_TILE)
        _arrive(bar + 4, stamps_ptr, pid, mark + 9, MARKS)
        if layer + 1 < L:
            w_qkv = _tile(w_qkv_ptr + (wl + 1 if LAYER_WEIGHTS else 0) * NQKV * H, pid, NQKV, H, CN_QKV, BN_QKV, 0,
                          C_H, KC)
            _prefetch(w_o_ptr + (wl + 1 if LAYER_WEIGHTS else 0) * H * HO, pid, H, HO, CN_RES, BN_RES, PREFETCH)
        else:
            w_head = _tile(w_head_ptr, pid, V, H, CN_HEAD, BN_HEAD, 0, C_H, KC)
        _wait(bar + 4, target, timeouts, stamps_ptr, pid, mark + 10, SPIN_LIMIT, ACQUIRE_POLL, MARKS)
    # the head, on each batch row's last token
    if ONE_TILE:
        _head_tile(h_ptr, w_final_ptr, w_head, out_ptr, pid, B, T, eps, H, V, CN_HEAD, BN_HEAD, C_H, KC)
    else:
        tile = pid
        while tile < (V + CN_HEAD - 1) // CN_HEAD:
            _head_tile(h_ptr, w_final_ptr, w_head, out_ptr, tile, B, T, eps, H, V, CN_HEAD, BN_HEAD, C_H, KC)
            tile += programs
            w_head = _tile(w_head_ptr, tile, V, H, CN_HEAD, BN_HEAD, 0, C_H, KC)
    tl.debug_barrier()
    _stamp(stamps_ptr, pid, 10 * L + 1, MARKS)


# --------------------------------------------------------------------------------------------------- launch
# tests: columns a program per step kind ("qkv", "residual", "up", "head") instead of an even cut over the grid, so
# that one program takes several tiles of a step
_TEST_COLUMNS: dict[str, int] | None = None
_TEST_CHUNK: int | None = None  # tests: columns of K a chunk (chunks()), so that a small model's K comes in parts


def chunks(K: int, chunk: int) -> tuple[int, int]:
    """K's chunks of `chunk` columns as two parts of a power of two each (a tensor's dimensions are): (all of them
    and none) where their number is one, else (the largest power of two under it, the rest rounded up)."""
    n = triton.cdiv(K, chunk)
    first = 1 << (n.bit_length() - 1)
    return first, (triton.next_power_of_2(n - first) if n > first else 0)


def stream_forward(stack: nn.Module, x: Tensor, cos: Tensor, sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slots: Tensor, positions: Tensor, final_norm: Tensor, head: Tensor, counters: Tensor | None = None,
                   programs: int | None = None, barrier_target: int | None = None,
                   spin_limit: int = SPIN_LIMIT, acquire_poll: bool = False, stamps: Tensor | None = None,
                   layer_weights: bool = True, l2_prefetch: bool = True) -> Tensor:
    """One forward of the decoder stack and its head, as cp_forward (same arguments; counters: one row of
    cp_forward.barrier_counters, None: allocated here): the logits [B, V] of each row's last token. Probes only:
    acquire_poll, every barrier poll an acquire (_wait); stamps, an int64 [programs, stamp_marks(L), 2] that gets
    each program's timer and clock at each step's start and end (_stamp; GPU only: the interpreter has no inline
    assembly); layer_weights False, every layer multiplies by layer 0's weights (wrong logits; its timing says what
    the forward costs with weights that stay in L2); l2_prefetch False, no L2 hints (_prefetch; the interpreter has
    none either: they are inline assembly)."""
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
    warps = stream_warps()
    # a tile's rows: at least one a warp, so that no warp shares a row's K with another (_tile)
    rows = {name: max(triton.next_power_of_2(n), warps if dev.type == "cuda" else 1) for name, n in per.items()}
    rows["up"] = max(rows["up"], 2 * (warps if dev.type == "cuda" else 1))  # two halves (_swiglu)
    # a chunk: 16 bytes a lane over a warp's 32 lanes, or all of the narrowest K if that is less
    chunk = _TEST_CHUNK or min(32 * 16 // x.element_size(), triton.next_power_of_2(min(H, HQ * D, FF)))
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
    o_parts, ff_parts = chunks(HQ * D, chunk), chunks(FF, chunk)
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
        CN_QKV=per["qkv"], BN_QKV=rows["qkv"], CN_RES=per["residual"], BN_RES=rows["residual"],
        CN_UP=per["up"], BN_UP=rows["up"], CN_HEAD=per["head"], BN_HEAD=rows["head"],
        KC=chunk, C_H=triton.next_power_of_2(triton.cdiv(H, chunk)), CA_O=o_parts[0], CB_O=o_parts[1],
        CA_FF=ff_parts[0], CB_FF=ff_parts[1], ONE_TILE=all(triton.cdiv(n, per[k]) <= programs for k, n in cut.items()),
        SPIN_LIMIT=spin_limit, ACQUIRE_POLL=acquire_poll, IEEE=dtype == torch.float32, num_warps=warps,
        MARKS=0 if stamps is None else stamp_marks(L), LAYER_WEIGHTS=layer_weights,
        PREFETCH=l2_prefetch and dev.type == "cuda", num_stages=1,
        **launch_options(dev))
    return out
