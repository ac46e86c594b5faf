"""One Code Predictor forward (5 layers, the final norm and the group's head) in one kernel launch.

At batch 1 the Code Predictor is launch-bound: 15 forwards a frame of about 47 kernels each (706 launches, 2.6 ms
of kernels for 0.58 ms of weights), each kernel paying its ramp and tail. Here a forward is 26 steps of one
kernel, each step a loop over its work items (tiles of output columns, or (row, kv head) pairs for attention):

    per layer: 0 qkv    x -> RMSNorm (prologue) -> [q | k | v] projection               -> qkv scratch
               1 attn   q/k-norm, RoPE, k/v into the cache, attention over <= 16 columns -> attn scratch
               2 o      attn @ Wo + residual                                             -> h
               3 up     h -> RMSNorm (prologue) -> gate and up -> SwiGLU                -> act scratch
               4 down   act @ Wdown + residual                                           -> h
    then       head     h (each row's last token) -> final RMSNorm (prologue) -> lm_head[group] -> logits

The switch, VOICELANE_CP_FORWARD:
- "persistent": one launch, one program per multiprocessor (all resident at once); the steps are separated by a
  grid-wide barrier (an arrival counter per step in global memory, release on arrival, acquire while waiting; a wait
  past its poll limit counts a timeout and goes on, so a grid that cannot be resident never hangs the device).
- "phased": one launch per step, a kernel boundary between steps (26 a forward instead of ~47). Triton's
  interpreter runs programs one after another, so a barrier could never be passed there: the CPU tests run this
  mode, and the persistent mode with a single program (whose barrier is its own arrival).
- "streamed": the persistent kernel of engine/kernels/cp_stream.py, for forwards of at most its STREAM_ROWS rows:
  each program's weights read into registers ahead of the barrier before their step.
- "off" (the default until measured on the H200): the layer-by-layer kernels of engine/model/layers.py.

The steps that end in the residual add (o, down) also leave each row's sum of squares per column tile, so an
RMSNorm prologue reads a few partials a row instead of every program re-reading the whole residual (at 64 rows that
was 128 KB per program per norm).

Rounding follows engine/model/layers.py op by op (the norms' fp32 statistics and rounded products, the residual
sums rounded to the activation dtype, SwiGLU rounded before its multiply), so the reference of a forward is the
model's own path: `DecoderStack.run` then `dense(h, lm_head)` (engine.model.code_predictor.cp_forward_reference).

The layers' weights are used in place: `StackedLayers` moves each kind of weight of the 5 layers into one [L, ...]
tensor once and makes every layer's parameters views of it, so the kernel indexes layers by stride and the
checkpoint's module tree and names stay as they are.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from engine.kernels.attention import _attend_short, _norm_rope_rows
from engine.kernels.gdc import wait_inputs
from engine.kernels.pdl import launch_options

log = logging.getLogger("voicelane.kernels.cp_forward")

CP_FORWARD_ENV = "VOICELANE_CP_FORWARD"
MODES = ("off", "phased", "persistent", "streamed")
PHASES = 5  # steps per layer: qkv, attn, o, up, down
MAX_ROWS = 128  # rows (batch x tokens) of one launch: the 128-row dot tiles' shared memory is about 110 KB
_REFUSED_ROWS: set[int] = set()


def refuse_rows(rows: int, limit: int, mode: str) -> bool:
    """True (and logged once per size, and listed by refused_rows() for /ready) when a forward of `rows` rows is
    above the `limit` that `mode` takes (MAX_ROWS, or cp_stream.STREAM_ROWS): the caller runs the layer-by-layer
    kernels for it instead."""
    if rows <= limit:
        return False
    if rows not in _REFUSED_ROWS:
        _REFUSED_ROWS.add(rows)
        log.warning("cp_forward %s takes at most %d rows a launch; a Code Predictor forward of %d rows runs the "
                    "layer-by-layer kernels", mode, limit, rows)
    return True


def refused_rows() -> list[int]:
    return sorted(_REFUSED_ROWS)


def cp_forward_mode() -> str:
    value = os.environ.get(CP_FORWARD_ENV, "off").strip().lower() or "off"
    if value not in MODES:
        raise ValueError(f"{CP_FORWARD_ENV}={value!r}: choose one of {', '.join(MODES)}")
    return value


def steps(layers: int) -> int:
    """Steps of one forward: PHASES per layer and the head."""
    return PHASES * layers + 1


def counter_slots(layers: int) -> int:
    """int32 counters of one persistent launch: one per step's barrier, then its barrier timeouts."""
    return steps(layers) + 1


SPIN_LIMIT = 1 << 16  # polls of a barrier before it counts a timeout: tens of ms by estimate, far above a step


# --------------------------------------------------------------------------------------------------- device parts
@triton.jit
def _grid_barrier(counter_ptr, target, timeouts_ptr, SPIN_LIMIT: tl.constexpr):
    """Every program arrives (release: its stores before are visible to whoever acquires after) and waits until
    `target` programs have (acquire). A scalar atomic is one per program; the counter is used once per launch.
    A program that is still waiting after SPIN_LIMIT polls counts a timeout at timeouts_ptr and goes on: a grid
    that cannot be resident at once (a GPU shared with other work, MIG) gives wrong results that say so, never a
    hung device."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (arrived < target) & (polls < SPIN_LIMIT):
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if arrived < target:
        tl.atomic_add(timeouts_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _row_rstd(x_ptr, row_stride, rows, K: tl.constexpr, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of each of `rows` rows of K values (fp32 statistics): [BLOCK_M]."""
    rm = tl.arange(0, BLOCK_M)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * row_stride + k[None, :], mask=(rm < rows)[:, None] & (k < K)[None, :],
                    other=0.0, cache_modifier=".cg").to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _matmul_tile(x_ptr, row_stride, rows, K: tl.constexpr, norm_ptr, rstd, w_ptr, n0, N,
                 NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, k_lo, K_SPAN: tl.constexpr):
    """x[rows, k_lo : k_lo + K_SPAN] @ w[n0 : n0 + BLOCK_N, same columns of K]^T in fp32 [BLOCK_M, BLOCK_N] (the
    whole of K: k_lo 0, K_SPAN K); with NORM, x is first RMS-normed (rstd [BLOCK_M]) and multiplied by norm_ptr's
    weight, rounded as add_rms_norm rounds."""
    rm = tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    m_ok = rm < rows
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kk in range(0, K_SPAN, BLOCK_K):  # constexpr bounds: triton's interpreter takes no runtime range() bound
        k = k_lo + kk + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_ptr + rm[:, None] * row_stride + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        if NORM:
            nw = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            a = (nw[None, :] * (a.to(tl.float32) * rstd[:, None]).to(a.dtype).to(tl.float32)).to(a.dtype)
        w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    return acc


@triton.jit
def _store_tile(y_ptr, row_stride, rows, n0, N, y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rm[:, None] * row_stride + rn[None, :], y, mask=(rm < rows)[:, None] & (rn < N)[None, :])


@triton.jit
def _load_residual(res_ptr, rows, tile, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The residual's [BLOCK_M, BLOCK_N] tile `tile` (rows x N, row stride N); zeros past the edges."""
    rm = tl.arange(0, BLOCK_M)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rm < rows)[:, None] & (rn < N)[None, :]
    return tl.load(res_ptr + rm[:, None] * N + rn[None, :], mask=ok, other=0.0, cache_modifier=".cg")


@triton.jit
def _residual_tile(res, rows, tile, N: tl.constexpr, acc, out_ptr, sumsq_ptr, TILES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[:, tile] = (acc rounded) + res, rounded: the residual add of add_rms_norm (res: _load_residual's tile, so
    a caller can issue that load before its K loop rather than wait for it after). In place is fine (the residual
    is out_ptr): a tile's columns belong to one program. The tile's share of each row's sum of squares goes to
    sumsq[row, tile] ([rows, TILES] fp32), so the RMSNorm after it reads TILES partials a row instead of the whole
    row in every program (_rstd_from_partials)."""
    rm = tl.arange(0, BLOCK_M)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rm < rows)[:, None] & (rn < N)[None, :]
    y = (acc.to(res.dtype).to(tl.float32) + res.to(tl.float32)).to(res.dtype)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], y, mask=ok)
    f = tl.where(ok, y.to(tl.float32), 0.0)
    tl.store(sumsq_ptr + rm * TILES + tile, tl.sum(f * f, axis=1), mask=rm < rows)


@triton.jit
def _rstd_from_partials(sumsq_ptr, row_stride, rows, tiles, K: tl.constexpr, eps, BLOCK_M: tl.constexpr,
                        BLOCK_TILES: tl.constexpr):
    """_row_rstd from the `tiles` partial sums of squares a row that _residual_tile left ([BLOCK_M])."""
    rm = tl.arange(0, BLOCK_M)
    rt = tl.arange(0, BLOCK_TILES)
    ok = (rm < rows)[:, None] & (rt < tiles)[None, :]
    parts = tl.load(sumsq_ptr + rm[:, None] * row_stride + rt[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    return tl.rsqrt(tl.sum(parts, axis=1) / K + eps)


@triton.jit
def _residual_step(x_ptr, K: tl.constexpr, w_ptr, res_ptr, h_ptr, sumsq_ptr, part_ptr, ticket_ptr, rows, pid,
                   programs, H: tl.constexpr, H_TILES: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """h = x[rows, K] @ w[H, K]^T + residual, as H_TILES column tiles of BLOCK_N, each split into SPLIT runs of K
    (more work items than tiles: at one row 1024 columns make 64 tiles for 132 multiprocessors). A split's partial
    goes to part[split] (fp32); the last of a tile's splits to arrive (an acq_rel ticket, then reset for the next
    use) adds them in split order, so the sum does not depend on which program finished last."""
    K_SPAN: tl.constexpr = K // SPLIT
    item = pid
    while item < H_TILES * SPLIT:
        tile = item // SPLIT
        run = item % SPLIT
        if SPLIT == 1:  # the residual's load issued first: its latency overlaps the K loop instead of following it
            res = _load_residual(res_ptr, rows, tile, H, BLOCK_M, BLOCK_N)
            acc = _matmul_tile(x_ptr, K, rows, K, w_ptr, 0.0, w_ptr, tile * BLOCK_N, H, False, BLOCK_M, BLOCK_N,
                               BLOCK_K, IEEE, 0, K)
            _residual_tile(res, rows, tile, H, acc, h_ptr, sumsq_ptr, H_TILES, BLOCK_M, BLOCK_N)
        else:
            acc = _matmul_tile(x_ptr, K, rows, K, w_ptr, 0.0, w_ptr, tile * BLOCK_N, H, False, BLOCK_M, BLOCK_N,
                               BLOCK_K, IEEE, run * K_SPAN, K_SPAN)
            rm = tl.arange(0, BLOCK_M)
            rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = (rm < rows)[:, None] & (rn < H)[None, :]
            at = part_ptr + rm[:, None] * H + rn[None, :]
            tl.store(at + run * rows * H, acc, mask=ok)
            ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")  # partials visible before the ticket
            if ticket == SPLIT - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLIT):
                    total += tl.load(at + s * rows * H, mask=ok, other=0.0, cache_modifier=".cg")
                _residual_tile(_load_residual(res_ptr, rows, tile, H, BLOCK_M, BLOCK_N), rows, tile, H, total, h_ptr,
                               sumsq_ptr, H_TILES, BLOCK_M, BLOCK_N)
                tl.atomic_xchg(ticket_ptr + tile, 0)
        item += programs


@triton.jit
def _attention_item(b, kvh, T, qkv_ptr, attn_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, s_cb, s_ct, s_sb, s_st,
                    kc_ptr, vc_ptr, s_cs, s_ch, s_cl, slots_ptr, pos_ptr, s_pb, s_pt, eps, scale,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_QM: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr):
    """Batch row b, kv head kvh: short_attention's work (engine/kernels/attention.py) on the qkv scratch rows
    b * T + t, its output into the attn scratch rows."""
    G: tl.constexpr = HQ // HKV
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    d = tl.arange(0, D)
    rolled = (d + D // 2) % D
    base = tl.load(slots_ptr + b) * s_cs + kvh * s_ch
    tt = tl.arange(0, BLOCK_T)
    t_ok = tt < T
    at = base + tl.load(pos_ptr + b * s_pb + tt * s_pt, mask=t_ok, other=0)[:, None] * s_cl + d[None, :]
    k_src = qkv_ptr + (b * T + tt)[:, None] * NQKV + (HQ + kvh) * D
    k_cos = tl.load(cos_ptr + b * s_cb + tt[:, None] * s_ct + d[None, :], mask=t_ok[:, None], other=0.0)
    k_sin = tl.load(sin_ptr + b * s_sb + tt[:, None] * s_st + d[None, :], mask=t_ok[:, None], other=0.0)
    keys = _norm_rope_rows(tl.load(k_src + d[None, :], mask=t_ok[:, None], other=0.0, cache_modifier=".cg"),
                           tl.load(k_src + rolled[None, :], mask=t_ok[:, None], other=0.0, cache_modifier=".cg"),
                           tl.load(kn_ptr + d).to(tl.float32)[None, :],
                           tl.load(kn_ptr + rolled).to(tl.float32)[None, :],
                           k_cos.to(tl.float32), k_sin.to(tl.float32), eps, D)
    tl.store(kc_ptr + at, keys, mask=t_ok[:, None])
    values = tl.load(qkv_ptr + (b * T + tt)[:, None] * NQKV + (HQ + HKV + kvh) * D + d[None, :], mask=t_ok[:, None],
                     other=0.0, cache_modifier=".cg")
    tl.store(vc_ptr + at, values, mask=t_ok[:, None])
    rows = tl.arange(0, BLOCK_QM)  # query rows t * G + g of this kv head
    row_ok = rows < T * G
    t = rows // G
    head = kvh * G + rows % G
    q_src = qkv_ptr + (b * T + t)[:, None] * NQKV + head[:, None] * D
    q_cos = tl.load(cos_ptr + b * s_cb + t[:, None] * s_ct + d[None, :], mask=row_ok[:, None], other=0.0)
    q_sin = tl.load(sin_ptr + b * s_sb + t[:, None] * s_st + d[None, :], mask=row_ok[:, None], other=0.0)
    q = _norm_rope_rows(tl.load(q_src + d[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg"),
                        tl.load(q_src + rolled[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg"),
                        tl.load(qn_ptr + d).to(tl.float32)[None, :], tl.load(qn_ptr + rolled).to(tl.float32)[None, :],
                        q_cos.to(tl.float32), q_sin.to(tl.float32), eps, D)
    tl.debug_barrier()  # the keys and values stored above are read below, by other threads of this program
    out = _attend_short(q, kc_ptr, vc_ptr, base, pos_ptr + b * s_pb + t * s_pt, row_ok, s_cl, scale, D, BLOCK_C, IEEE)
    tl.store(attn_ptr + (b * T + t)[:, None] * (HQ * D) + head[:, None] * D + d[None, :],
             out.to(attn_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _cp_forward_kernel(x_ptr, h_ptr, qkv_ptr, attn_ptr, act_ptr, out_ptr, bar_ptr, sumsq_ptr, part_ptr, ticket_ptr,
                       w_in_ptr, w_qkv_ptr, w_qn_ptr, w_kn_ptr, w_o_ptr, w_post_ptr, w_gu_ptr, w_down_ptr,
                       w_final_ptr, w_head_ptr,
                       kc_ptr, vc_ptr, s_kl, s_cs, s_ch, s_cl, cos_ptr, sin_ptr, s_cb, s_ct, s_sb, s_st,
                       slots_ptr, pos_ptr, s_pb, s_pt, B, T, first, last, target, eps, scale,
                       L: tl.constexpr, H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       FF: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_QM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                       BN_QKV: tl.constexpr, BN_RES: tl.constexpr, BN_UP: tl.constexpr,
                       BN_HEAD: tl.constexpr, BLOCK_TILES: tl.constexpr, SPLIT: tl.constexpr, PERSISTENT: tl.constexpr,
                       SPIN_LIMIT: tl.constexpr,
                       IEEE: tl.constexpr, GDC: tl.constexpr):
    wait_inputs(GDC)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    M = B * T
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    # the residual's partial sums of squares: one per column tile of the two steps that end in the residual add
    H_TILES: tl.constexpr = (H + BN_RES - 1) // BN_RES
    # while loops: triton 3.6's interpreter cannot take a runtime scalar as a range() bound (numpy >= 2)
    step = first
    while step < last:
        layer = step // 5
        phase = step % 5
        if layer == L:  # the head, on each batch row's last token (row stride T * H)
            last_tokens = h_ptr + (T - 1) * H
            rstd = _rstd_from_partials(sumsq_ptr + (T - 1) * H_TILES, T * H_TILES, B, H_TILES, H, eps, BLOCK_B,
                                       BLOCK_TILES)
            tile = pid
            while tile < tl.cdiv(V, BN_HEAD):
                acc = _matmul_tile(last_tokens, T * H, B, H, w_final_ptr, rstd, w_head_ptr, tile * BN_HEAD, V, True,
                                   BLOCK_B, BN_HEAD, BLOCK_K, IEEE, 0, H)
                _store_tile(out_ptr, V, B, tile * BN_HEAD, V, acc.to(out_ptr.dtype.element_ty), BLOCK_B, BN_HEAD)
                tile += programs
        else:
            at_layer = layer.to(tl.int64)
            residual = h_ptr
            if layer == 0:
                residual = x_ptr  # the stack's input is the first residual
            if phase == 0:
                if layer == 0:
                    rstd = _row_rstd(x_ptr, H, M, H, eps, BLOCK_M, BLOCK_K)
                else:
                    rstd = _rstd_from_partials(sumsq_ptr, H_TILES, M, H_TILES, H, eps, BLOCK_M, BLOCK_TILES)
                tile = pid
                while tile < tl.cdiv(NQKV, BN_QKV):
                    acc = _matmul_tile(residual, H, M, H, w_in_ptr + at_layer * H, rstd,
                                       w_qkv_ptr + at_layer * NQKV * H, tile * BN_QKV, NQKV, True, BLOCK_M, BN_QKV,
                                       BLOCK_K, IEEE, 0, H)
                    _store_tile(qkv_ptr, NQKV, M, tile * BN_QKV, NQKV, acc.to(qkv_ptr.dtype.element_ty), BLOCK_M,
                                BN_QKV)
                    tile += programs
            elif phase == 1:
                item = pid
                while item < B * HKV:
                    _attention_item(item // HKV, item % HKV, T, qkv_ptr, attn_ptr, w_qn_ptr + at_layer * D,
                                    w_kn_ptr + at_layer * D, cos_ptr, sin_ptr, s_cb, s_ct, s_sb, s_st,
                                    kc_ptr + at_layer * s_kl, vc_ptr + at_layer * s_kl, s_cs, s_ch, s_cl, slots_ptr,
                                    pos_ptr, s_pb, s_pt, eps, scale, HQ, HKV, D, BLOCK_QM, BLOCK_T, BLOCK_C, IEEE)
                    item += programs
            elif phase == 2:
                _residual_step(attn_ptr, HQ * D, w_o_ptr + at_layer * H * HQ * D, residual, h_ptr, sumsq_ptr, part_ptr,
                               ticket_ptr, M, pid, programs, H, H_TILES, SPLIT, BLOCK_M, BN_RES, BLOCK_K, IEEE)
            elif phase == 3:
                rstd = _rstd_from_partials(sumsq_ptr, H_TILES, M, H_TILES, H, eps, BLOCK_M, BLOCK_TILES)
                tile = pid
                while tile < tl.cdiv(FF, BN_UP):
                    up_w = w_gu_ptr + at_layer * 2 * FF * H
                    gate = _matmul_tile(h_ptr, H, M, H, w_post_ptr + at_layer * H, rstd, up_w, tile * BN_UP, FF, True,
                                        BLOCK_M, BN_UP, BLOCK_K, IEEE, 0, H).to(act_ptr.dtype.element_ty)
                    up = _matmul_tile(h_ptr, H, M, H, w_post_ptr + at_layer * H, rstd, up_w + FF * H, tile * BN_UP, FF,
                                      True, BLOCK_M, BN_UP, BLOCK_K, IEEE, 0, H).to(act_ptr.dtype.element_ty)
                    gate = gate.to(tl.float32)
                    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # SwiGLU as engine.kernels.norm.swiglu
                    act = (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
                    _store_tile(act_ptr, FF, M, tile * BN_UP, FF, act, BLOCK_M, BN_UP)
                    tile += programs
            else:
                _residual_step(act_ptr, FF, w_down_ptr + at_layer * H * FF, h_ptr, h_ptr, sumsq_ptr, part_ptr,
                               ticket_ptr, M, pid, programs, H, H_TILES, SPLIT, BLOCK_M, BN_RES, BLOCK_K, IEEE)
        if PERSISTENT:
            if step + 1 < last:
                _grid_barrier(bar_ptr + step, target, bar_ptr + last, SPIN_LIMIT)
        step += 1


# --------------------------------------------------------------------------------------------------- weights
class StackedLayers:
    """Each kind of weight of a decoder stack's layers as one [L, ...] tensor; the layers' parameters become views
    of it (the fused q/k/v and gate/up matrices included), so nothing is stored twice."""

    def __init__(self, stack: nn.Module):
        layers = list(stack.layers)
        for layer in layers:
            if layer.self_attn.qkv is None or layer.mlp.gate_up is None:
                raise ValueError("StackedLayers needs prepare_inference() to have fused q/k/v and gate/up")
        self.stack = stack
        with torch.no_grad():
            self.qkv = self._adopt_fused([layer.self_attn.qkv for layer in layers])
            self.gate_up = self._adopt_fused([layer.mlp.gate_up for layer in layers])
            self.o = self._adopt([layer.self_attn.o_proj for layer in layers])
            self.down = self._adopt([layer.mlp.down_proj for layer in layers])
            self.input_norm = self._adopt([layer.input_layernorm for layer in layers])
            self.post_norm = self._adopt([layer.post_attention_layernorm for layer in layers])
            self.q_norm = self._adopt([layer.self_attn.q_norm for layer in layers])
            self.k_norm = self._adopt([layer.self_attn.k_norm for layer in layers])

    @staticmethod
    def _adopt(modules: list[nn.Module]) -> Tensor:
        stacked = torch.stack([m.weight.detach() for m in modules])
        for m, part in zip(modules, stacked, strict=True):
            m.weight = nn.Parameter(part, requires_grad=m.weight.requires_grad)
        return stacked

    @staticmethod
    def _adopt_fused(fused: list) -> Tensor:
        stacked = torch.stack([f.current() for f in fused])
        for f, part in zip(fused, stacked, strict=True):
            f.adopt(part)
        return stacked

    def intact(self) -> bool:
        """False once any layer's weight is no longer a view of the stacked tensors (replaced after loading)."""
        for i, layer in enumerate(self.stack.layers):
            pairs = ((layer.self_attn.o_proj.weight, self.o), (layer.mlp.down_proj.weight, self.down),
                     (layer.input_layernorm.weight, self.input_norm),
                     (layer.post_attention_layernorm.weight, self.post_norm),
                     (layer.self_attn.q_norm.weight, self.q_norm), (layer.self_attn.k_norm.weight, self.k_norm),
                     (layer.self_attn.qkv.weight, self.qkv), (layer.mlp.gate_up.weight, self.gate_up))
            if any(w.data_ptr() != stacked[i].data_ptr() for w, stacked in pairs):
                return False
            if not (layer.self_attn.qkv.intact() and layer.mlp.gate_up.intact()):
                return False
        return True


def stacked_layers(stack: nn.Module) -> StackedLayers:
    """The stack's StackedLayers, made on first use and again (logged) if a weight was replaced since."""
    current = getattr(stack, "_stacked_layers", None)
    if current is not None and current.intact():
        return current
    if current is not None:
        log.warning("Code Predictor weights were replaced after stacking them; stacking them again")
    current = StackedLayers(stack)
    stack._stacked_layers = current
    return current


# --------------------------------------------------------------------------------------------------- launch
_SM_COUNT: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# e.g. "qkv=64,o=16,k=256,warps=8" (or "/" between items, for bench/gpu_round.sh's VARIANTS): a shape to measure
TILES_ENV = "VOICELANE_CP_FORWARD_TILES"


@dataclass(frozen=True)
class Tiles:
    """The launch shape: output columns per work item of each GEMM step, K per loop block, warps and pipeline stages.
    The defaults are a first guess (every step's items fill 64 to 128 of the H200's 132 multiprocessors at B1), to
    be replaced by what the H200 measures; TILES_ENV overrides any of them."""

    qkv: int = 32
    residual: int = 16  # the o and down projections: the steps that end in the residual add (one tiling)
    up: int = 32
    head: int = 16
    split: int = 1  # K runs of each residual tile (its work items: tiles x split)
    k: int = 128
    warps: int = 4
    stages: int = 3

    @classmethod
    def from_env(cls) -> Tiles:
        return cls.parse(os.environ.get(TILES_ENV, ""))

    @classmethod
    def parse(cls, text: str) -> Tiles:
        """A shape in TILES_ENV's syntax ("" or "default": the defaults)."""
        text = text.strip()
        if not text or text == "default":
            return cls()
        names = {f.name for f in fields(cls)}
        values = {}
        for item in text.replace("/", ",").split(","):
            name, _, value = item.partition("=")
            if name.strip() not in names or not value.strip().isdigit():
                raise ValueError(f"{TILES_ENV}={text!r}: items name=value, names {', '.join(sorted(names))}")
            values[name.strip()] = int(value)
        tiles = cls(**values)
        for name in ("qkv", "residual", "up", "head", "k"):
            size = getattr(tiles, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{TILES_ENV}: {name}={size} must be a power of two >= 16 (a tensor-core tile)")
        if tiles.split not in (1, 2, 4, 8):
            raise ValueError(f"{TILES_ENV}: split={tiles.split} must be 1, 2, 4 or 8")
        if tiles.warps not in (1, 2, 4, 8, 16) or not 1 <= tiles.stages <= 6:
            raise ValueError(f"{TILES_ENV}: warps {tiles.warps} (1-16, a power of two), stages {tiles.stages} (1-6)")
        return tiles


def barrier_counters(forwards: int, layers: int, device) -> Tensor:
    """Zeroed counters for `forwards` persistent launches (one row of counter_slots each): one memset a frame."""
    return torch.zeros(forwards, counter_slots(layers), device=device, dtype=torch.int32)


def barrier_timeouts(counters: Tensor) -> int:
    """Barrier timeouts the launches that used `counters` counted (reads the device: for checks, not steps)."""
    return int(counters[..., -1].sum())


def cp_forward(stack: nn.Module, x: Tensor, cos: Tensor, sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor,
               slots: Tensor, positions: Tensor, final_norm: Tensor, head: Tensor, mode: str,
               counters: Tensor | None = None, programs: int | None = None, barrier_target: int | None = None,
               spin_limit: int = SPIN_LIMIT, tiles: Tiles | None = None,
               step_range: tuple[int, int] | None = None) -> Tensor:
    """One forward of the decoder stack `stack` and its head: the logits [B, V] of each row's last token.

    x [B, T, H] (contiguous, the stack's input); cos, sin_signed [B, T, D] (unit last stride); k_cache, v_cache
    [L, slots, Hkv, C, D] (C <= 64); slots [B]; positions [B, T]; final_norm [H]; head [V, H]. mode: "phased" or
    "persistent"; counters [counter_slots] int32, zero (persistent; None: allocated here; barrier_timeouts reads
    them after); programs: the persistent grid (None: one per multiprocessor on CUDA, 1 elsewhere);
    barrier_target, spin_limit (tests): the arrivals a barrier waits for (None: every program) and its polls;
    tiles: the launch shape (None: Tiles.from_env()); step_range (probes, engine.tools.probe_cp_forward): only steps
    first .. last - 1 (the logits are written only if the head's step is among them)."""
    weights = stacked_layers(stack)
    tiles = tiles if tiles is not None else Tiles.from_env()
    cfg = stack.cfg
    B, T, H = x.shape
    L, HQ, HKV, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    FF, V = cfg.intermediate_size, head.shape[0]
    C = k_cache.shape[3]
    if (x.stride(-1) != 1 or not x.is_contiguous() or k_cache.shape[:3] != (L, k_cache.shape[1], HKV)
            or k_cache.stride() != v_cache.stride() or C > 64 or head.shape[1] != H or T * (HQ // HKV) > 64):
        raise ValueError(f"cp_forward: x {tuple(x.shape)}, cache {tuple(k_cache.shape)}, head {tuple(head.shape)} "
                         f"do not fit a {L}-layer stack of width {H} ({HQ} heads, {HKV} kv heads, head_dim {D})")
    if mode not in ("phased", "persistent"):
        raise ValueError(f"cp_forward mode {mode!r}: phased or persistent (streamed: cp_stream.stream_forward)")
    M = B * T
    if M > MAX_ROWS:
        raise ValueError(f"cp_forward: {M} rows, at most {MAX_ROWS} a launch")
    dev, dtype = x.device, x.dtype
    h = torch.empty(M, H, device=dev, dtype=dtype)
    qkv = torch.empty(M, (HQ + 2 * HKV) * D, device=dev, dtype=dtype)
    attn = torch.empty(M, HQ * D, device=dev, dtype=dtype)
    act = torch.empty(M, FF, device=dev, dtype=dtype)
    out = torch.empty(B, V, device=dev, dtype=dtype)
    residual_tiles = triton.cdiv(H, tiles.residual)
    sumsq = torch.empty(M, residual_tiles, device=dev, dtype=torch.float32)  # _residual_tile's partials
    if tiles.split > 1:
        for width in (HQ * D, FF):  # the K of the o and down projections
            if width % (tiles.split * tiles.k):
                raise ValueError(f"{TILES_ENV}: split={tiles.split} runs of k={tiles.k} do not tile K={width}")
        parts = torch.empty(tiles.split, M, H, device=dev, dtype=torch.float32)
        tickets = torch.zeros(residual_tiles, device=dev, dtype=torch.int32)  # each left at zero by its reducer
    else:
        parts, tickets = sumsq, slots  # not read
    n_steps = steps(L)
    first, last = step_range if step_range is not None else (0, n_steps)
    if not 0 <= first < last <= n_steps:
        raise ValueError(f"cp_forward: step range {step_range} outside 0 .. {n_steps}")
    if mode == "persistent" and counters is None:
        counters = torch.zeros(counter_slots(L), device=dev, dtype=torch.int32)
    args = (x, h, qkv, attn, act, out, counters if counters is not None else slots, sumsq, parts, tickets,
            weights.input_norm, weights.qkv, weights.q_norm, weights.k_norm, weights.o, weights.post_norm,
            weights.gate_up, weights.down, final_norm, head,
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
            cos, sin_signed, cos.stride(0), cos.stride(1), sin_signed.stride(0), sin_signed.stride(1),
            slots, positions, positions.stride(0), positions.stride(1), B, T)
    meta = dict(L=L, H=H, HQ=HQ, HKV=HKV, D=D, FF=FF, V=V, BLOCK_M=max(16, triton.next_power_of_2(M)),
                BLOCK_B=max(16, triton.next_power_of_2(B)), BLOCK_QM=max(16, triton.next_power_of_2(T * HQ // HKV)),
                BLOCK_T=max(2, triton.next_power_of_2(T)), BLOCK_C=max(16, triton.next_power_of_2(C)),
                BLOCK_K=tiles.k, BN_QKV=tiles.qkv, BN_RES=tiles.residual, BN_UP=tiles.up,
                BN_HEAD=tiles.head, BLOCK_TILES=triton.next_power_of_2(residual_tiles), SPLIT=tiles.split,
                SPIN_LIMIT=spin_limit,
                IEEE=dtype == torch.float32, num_warps=tiles.warps,
                num_stages=tiles.stages, **launch_options(dev))
    eps, scale = stack.norm.eps, D**-0.5
    if mode == "persistent":
        if programs is None:
            programs = _multiprocessors(dev) if dev.type == "cuda" else 1
        target = programs if barrier_target is None else barrier_target
        _cp_forward_kernel[(programs,)](*args, first, last, target, eps, scale, PERSISTENT=True, **meta)
        return out
    nqkv = (HQ + 2 * HKV) * D
    items = (triton.cdiv(nqkv, tiles.qkv), B * HKV, residual_tiles * tiles.split, triton.cdiv(FF, tiles.up),
             residual_tiles * tiles.split)
    for step in range(first, last):
        grid = triton.cdiv(V, tiles.head) if step == n_steps - 1 else items[step % PHASES]
        _cp_forward_kernel[(grid,)](*args, step, step + 1, grid, eps, scale, PERSISTENT=False, **meta)
    return out
