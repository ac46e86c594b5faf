"""Attention over the slot KV cache, read in place: one kernel for the Talker's decode step, the Code Predictor's
16-position frames and the prefill.

Two launches per layer:
- `qk_norm_rope_store`: per-head RMSNorm of q and k, RoPE on both, k and v written into the cache at each
  token's (slot, position); q comes back normed and rotated. Rounding follows engine/model/layers.py op by op.
- `cache_attention`: each query attends its own cache row's columns 0..position (and below the row's valid
  length in a right-padded prefill), straight from the cache: no gathered copy of keys or values, no mask
  tensor, no work for columns past a row's own length (so a batch costs what its rows hold, not its bucket).
  The G query heads of a kv head share one program and one read of each key block (GQA); scores and the
  online softmax are fp32, probabilities are rounded to the activation dtype before the value product.

For a cache of at most SHORT_COLUMNS columns (the Code Predictor's 16), `short_attention` does both in one launch
per layer, behind VOICELANE_SHORT_ATTENTION (off until measured on the H200).

Fixed shapes, no host synchronisation, loop lengths read on the device: both are CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.gdc import wait_inputs
from engine.kernels.pdl import launch_options
from engine.model.attention_ops import apply_rope, attention


@triton.jit
def _qk_norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, kc_ptr, vc_ptr,
                               slots_ptr, pos_ptr, T, H, eps,
                               s_qb, s_qt, s_kb, s_kt, s_vb, s_vt, s_cb, s_ct, s_sb, s_st, s_ob, s_ot,
                               s_cs, s_ch, s_cl, s_pb, s_pt,
                               HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, GDC: tl.constexpr):
    wait_inputs(GDC)
    bt = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1: a query head; H..H+Hkv-1: a key/value head
    b = bt // T
    t = bt % T
    d = tl.arange(0, BLOCK_HALF)
    dm = d < HALF
    D = 2 * HALF
    cos1 = tl.load(cos_ptr + b * s_cb + t * s_ct + d, mask=dm, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + b * s_cb + t * s_ct + HALF + d, mask=dm, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + b * s_sb + t * s_st + d, mask=dm, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + b * s_sb + t * s_st + HALF + d, mask=dm, other=0.0).to(tl.float32)
    is_q = head < H
    if is_q:
        src = q_ptr + b * s_qb + t * s_qt + head * D
        w_ptr = qw_ptr
    else:
        src = k_ptr + b * s_kb + t * s_kt + (head - H) * D
        w_ptr = kw_ptr
    x1 = tl.load(src + d, mask=dm, other=0.0)
    x2 = tl.load(src + HALF + d, mask=dm, other=0.0)
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
    w1 = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=dm, other=0.0).to(tl.float32)
    y1 = (w1 * (f1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (f2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # NeoX RoPE as the PyTorch path rounds it: x * cos + roll(x, D/2) * signed_sin, each product rounded.
    o1 = ((y1 * cos1).to(dtype).to(tl.float32) + (y2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((y2 * cos2).to(dtype).to(tl.float32) + (y1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    if is_q:
        dst = q_out_ptr + b * s_ob + t * s_ot + head * D
        tl.store(dst + d, o1, mask=dm)
        tl.store(dst + HALF + d, o2, mask=dm)
    else:
        kvh = head - H
        slot = tl.load(slots_ptr + b)
        pos = tl.load(pos_ptr + b * s_pb + t * s_pt)
        at = slot * s_cs + kvh * s_ch + pos * s_cl
        tl.store(kc_ptr + at + d, o1, mask=dm)
        tl.store(kc_ptr + at + HALF + d, o2, mask=dm)
        vsrc = v_ptr + b * s_vb + t * s_vt + kvh * D
        tl.store(vc_ptr + at + d, tl.load(vsrc + d, mask=dm, other=0.0), mask=dm)
        tl.store(vc_ptr + at + HALF + d, tl.load(vsrc + HALF + d, mask=dm, other=0.0), mask=dm)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_cache(k_cache: Tensor, v_cache: Tensor, head_dim: int) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k/v caches differ: {tuple(k_cache.shape)} {k_cache.stride()} vs "
                         f"{tuple(v_cache.shape)} {v_cache.stride()}")
    if k_cache.dim() != 4 or k_cache.shape[-1] != head_dim or k_cache.stride(-1) != 1:
        raise ValueError(f"cache of one layer must be [slots, kv_heads, max_len, {head_dim}] with unit last stride, "
                         f"got {tuple(k_cache.shape)} strides {k_cache.stride()}")


def _layer_shapes(kernel: str, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin_signed: Tensor, k_cache: Tensor,
                  v_cache: Tensor) -> tuple[int, int, int, int, int]:
    """One layer's new q, k, v and RoPE tables against its cache (qk_norm_rope_store's contract): (B, T, H, Hkv, D),
    or a ValueError naming `kernel`."""
    B, T, HD = q.shape
    D = cos.shape[-1]
    H, Hkv = HD // D, k.shape[-1] // D
    _check_cache(k_cache, v_cache, D)
    if D % 2 or k_cache.shape[1] != Hkv or v.shape[-1] != k.shape[-1]:
        raise ValueError(f"{kernel}: head_dim {D}, q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, cache {tuple(k_cache.shape)} do not fit together")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin_signed)):
        if t.stride(-1) != 1:
            raise ValueError(f"{kernel}: {name} needs a unit last stride, got {t.stride()}")
    return B, T, H, Hkv, D


def qk_norm_rope_store(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                       sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                       positions: Tensor) -> Tensor:
    """q [B, T, H * D], k and v [B, T, Hkv * D] (views of the fused projection are fine: unit last stride);
    q_weight, k_weight [D]; cos, sin_signed [B, T, D]; k_cache, v_cache [S, Hkv, L, D] of one layer;
    slots [B]; positions [B, T]. Writes rotated k and v at cache[slots[b], :, positions[b, t]] and returns the
    normed, rotated q [B, T, H, D] (contiguous)."""
    B, T, H, Hkv, D = _layer_shapes("qk_norm_rope_store", q, k, v, cos, sin_signed, k_cache, v_cache)
    q_out = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    half = D // 2
    _qk_norm_rope_store_kernel[(B * T, H + Hkv)](
        q, k, v, q_weight, k_weight, cos, sin_signed, q_out, k_cache, v_cache, slots, positions, T, H, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), cos.stride(1), sin_signed.stride(0), sin_signed.stride(1), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), positions.stride(0), positions.stride(1),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), num_warps=1, **launch_options(q.device))
    return q_out


def qk_norm_rope_store_reference(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                                 cos: Tensor, sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                                 positions: Tensor) -> Tensor:
    """The PyTorch path of engine.model.layers.Attention, same arguments and result as qk_norm_rope_store."""
    B, T, _ = q.shape
    D = cos.shape[-1]

    def norm_rope(x: Tensor, weight: Tensor) -> Tensor:  # [B, T, n * D] -> [B, n, T, D]
        x = weight * F.rms_norm(x.reshape(B, T, -1, D), (D,), eps=eps)
        return apply_rope(x.transpose(1, 2), cos, sin_signed)

    qr, kr = norm_rope(q, q_weight), norm_rope(k, k_weight)
    rows = slots[:, None]
    k_cache[rows, :, positions] = kr.transpose(1, 2)
    v_cache[rows, :, positions] = v.reshape(B, T, -1, D)
    return qr.transpose(1, 2).contiguous()


@triton.jit
def _attend_block(q, kc_ptr, vc_ptr, base, start, end, limit, s_cl, scale, m_i, l_i, acc,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One block of cache columns [start, start + BLOCK_N) folded into the online softmax of every row."""
    d = tl.arange(0, D)
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols < end
    k = tl.load(kc_ptr + base + cols[:, None] * s_cl + d[None, :], mask=col_ok[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(cols[None, :] < limit[:, None], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing to read (padding) stay at 0
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(vc_ptr + base + cols[:, None] * s_cl + d[None, :], mask=col_ok[:, None], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _cache_attention_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, slots_ptr, pos_ptr, valid_ptr, part_acc_ptr, part_ml_ptr,
                            T, scale, s_qb, s_qt, s_qh, s_ob, s_ot, s_oh, s_cs, s_ch, s_cl, s_pb, s_pt,
                            G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLITS: tl.constexpr, HAS_VALID: tl.constexpr, IEEE: tl.constexpr,
                            INTERPRET: tl.constexpr, GDC: tl.constexpr):
    wait_inputs(GDC)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    # Rows of this program: (query position t, query head g of this kv head), flattened as t * G + g. With
    # SPLITS > 1 there is one block of rows and the third grid axis splits the columns instead.
    if SPLITS > 1:
        block = 0
    else:
        block = tl.program_id(2)
    local = tl.arange(0, BLOCK_M)
    rows = block * BLOCK_M + local
    row_ok = rows < T * G
    t = rows // G
    head = kvh * G + rows % G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * s_qb + t[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    limit = (tl.load(pos_ptr + b * s_pb + t * s_pt, mask=row_ok, other=-1) + 1).to(tl.int32)  # columns to read
    if HAS_VALID:
        limit = tl.minimum(limit, tl.load(valid_ptr + b).to(tl.int32))
    limit = tl.where(row_ok, limit, 0)
    end = tl.max(limit, axis=0)
    lo = 0
    if SPLITS > 1:
        # Split s reads its own run of whole column blocks; runs past the longest row are empty.
        per_split = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.program_id(2) * per_split
        end = tl.minimum(end, lo + per_split)
    base = tl.load(slots_ptr + b) * s_cs + kvh * s_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if INTERPRET:
        # triton 3.6's interpreter cannot take a device scalar as a range() bound (numpy >= 2): same blocks.
        start = lo
        while start < end:
            m_i, l_i, acc = _attend_block(q, kc_ptr, vc_ptr, base, start, end, limit, s_cl, scale, m_i, l_i, acc,
                                          D, BLOCK_N, IEEE)
            start += BLOCK_N
    else:
        for start in range(lo, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, kc_ptr, vc_ptr, base, start, end, limit, s_cl, scale, m_i, l_i, acc,
                                          D, BLOCK_N, IEEE)
    if SPLITS > 1:
        # Unnormalised partials [B, Hkv, SPLITS, rows (, D)]: _combine_splits_kernel merges them.
        part = (b * tl.num_programs(1) + kvh) * SPLITS + tl.program_id(2)
        tl.store(part_acc_ptr + (part * T * G + local[:, None]) * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + (part * 2) * T * G + local, m_i, mask=row_ok)
        tl.store(part_ml_ptr + (part * 2 + 1) * T * G + local, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * s_ob + t[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, T, s_ob, s_ot, s_oh,
                           G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr,
                           GDC: tl.constexpr):
    wait_inputs(GDC)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    local = tl.arange(0, BLOCK_M)
    row_ok = local < T * G
    t = local // G
    head = kvh * G + local % G
    d = tl.arange(0, D)
    first = (b * tl.num_programs(1) + kvh) * SPLITS
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for i in tl.static_range(SPLITS):
        m = tl.load(part_ml_ptr + ((first + i) * 2) * T * G + local, mask=row_ok, other=float("-inf"))
        m_max = tl.maximum(m_max, m)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for i in tl.static_range(SPLITS):
        m = tl.load(part_ml_ptr + ((first + i) * 2) * T * G + local, mask=row_ok, other=float("-inf"))
        l_i = tl.load(part_ml_ptr + ((first + i) * 2 + 1) * T * G + local, mask=row_ok, other=0.0)
        w = tl.exp(m - m_safe)  # an empty split has m = -inf: weight 0
        total += w * l_i
        part = tl.load(part_acc_ptr + ((first + i) * T * G + local[:, None]) * D + d[None, :], mask=row_ok[:, None],
                       other=0.0)
        acc += w[:, None] * part
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + b * s_ob + t[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


_SM_COUNT: dict[int, int] = {}


def default_splits(q: Tensor, programs: int, max_len: int, block_n: int) -> int:
    """Column splits for a decode-sized call: enough programs for about two waves of the GPU's multiprocessors,
    each split at least two column blocks of the cache's length; 1 on the CPU. Depends on shapes only, so a
    captured graph keeps its choice."""
    if q.device.type != "cuda":
        return 1
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    wanted = triton.cdiv(2 * _SM_COUNT[index], programs)
    return max(1, min(16, triton.next_power_of_2(wanted), triton.cdiv(max_len, 2 * block_n)))


def cache_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor,
                    valid_len: Tensor | None = None, splits: int | None = None) -> Tensor:
    """Causal grouped-query attention read in place from the cache.

    q [B, T, H, D] (normed, rotated); k_cache, v_cache [S, Hkv, L, D] of one layer, this call's keys and values
    already written; slots [B] int64; positions [B, T] int64: query t of row b attends columns
    0..positions[b, t] of cache row slots[b]; valid_len [B] (optional): and only columns < valid_len[b].
    splits: column splits per (row, kv head) when its T * G query rows fit one block (decode); their partial
    softmax sums are merged by a second kernel. None: default_splits. Returns [B, T, H, D] in q's dtype.
    Every row must attend at least one column (positions >= 0, valid_len >= 1).
    """
    B, T, H, D = q.shape
    _check_cache(k_cache, v_cache, D)
    Hkv = k_cache.shape[1]
    if H % Hkv or D & (D - 1) or D < 16 or q.stride(-1) != 1:
        raise ValueError(f"cache_attention: q {tuple(q.shape)} strides {q.stride()} with {Hkv} kv heads "
                         "(need H a multiple of kv heads, head_dim a power of two >= 16, unit last stride)")
    G = H // Hkv
    out = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    rows = T * G
    BLOCK_M = max(16, min(64, triton.next_power_of_2(rows)))
    BLOCK_N = max(16, min(64, triton.next_power_of_2(k_cache.shape[2])))
    if rows > BLOCK_M:
        splits = 1  # prefill: many row blocks already fill the GPU
    elif splits is None:
        splits = default_splits(q, B * Hkv, k_cache.shape[2], BLOCK_N)
    if splits > 1:
        part_acc = torch.empty(B, Hkv, splits, rows, D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(B, Hkv, splits, 2, rows, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # not read
    grid = (B, Hkv, splits if splits > 1 else triton.cdiv(rows, BLOCK_M))
    _cache_attention_kernel[grid](
        q, k_cache, v_cache, out, slots, positions, valid_len if valid_len is not None else slots, part_acc, part_ml,
        T, D**-0.5, q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), positions.stride(0), positions.stride(1),
        G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLITS=splits, HAS_VALID=valid_len is not None,
        IEEE=q.dtype == torch.float32, INTERPRET=_interpreting(), num_warps=4, **launch_options(q.device))
    if splits > 1:
        _combine_splits_kernel[(B, Hkv)](part_acc, part_ml, out, T, out.stride(0), out.stride(1), out.stride(2),
                                         G=G, D=D, BLOCK_M=BLOCK_M, SPLITS=splits, num_warps=4,
                                         **launch_options(q.device))
    return out


# ---------------------------------------------------------------------------------------------- short caches
# The Code Predictor's cache holds 16 columns: its two launches per layer (above) become one, which norms, rotates
# and stores its kv head's new keys and values, norms and rotates the G query heads' rows in registers, and attends
# over the one column block. Off until the H200 measures it against the two launches (SHORT_ATTENTION_ENV).
SHORT_ATTENTION_ENV = "VOICELANE_SHORT_ATTENTION"
SHORT_COLUMNS = 64  # caches of at most this many columns: one block


def short_attention_on() -> bool:
    value = os.environ.get(SHORT_ATTENTION_ENV, "off").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{SHORT_ATTENTION_ENV}={value!r}: choose on or off")
    return value == "on"


@triton.jit
def _norm_rope_rows(x, x_rolled, w, w_rolled, cos, sin, eps, D: tl.constexpr):
    """Rows [M, D]: per-row RMSNorm with weight w, then NeoX RoPE (x * cos + rotate-half(x) * signed sin), rounded
    as _qk_norm_rope_store_kernel rounds them; x_rolled and w_rolled are x and w with their halves swapped."""
    dtype = x.dtype
    f = x.to(tl.float32)
    f_rolled = x_rolled.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(f * f, axis=1) / D + eps)[:, None]
    y = (w * (f * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y_rolled = (w_rolled * (f_rolled * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return ((y * cos).to(dtype).to(tl.float32) + (y_rolled * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _load_norm_rope(src, ok, w_ptr, cos_ptr, sin_ptr, t, s_ct, s_st, eps, D: tl.constexpr):
    """M rows of one head each (src [M, 1]: where each row's D values start; rows not ok read 0), tokens t [M]:
    loaded, normed with weight w_ptr and rotated with the batch row's RoPE tables (cos_ptr, sin_ptr) -> [M, D]."""
    d = tl.arange(0, D)
    rolled = (d + D // 2) % D
    cos = tl.load(cos_ptr + t[:, None] * s_ct + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t[:, None] * s_st + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    return _norm_rope_rows(tl.load(src + d[None, :], mask=ok[:, None], other=0.0),
                           tl.load(src + rolled[None, :], mask=ok[:, None], other=0.0),
                           tl.load(w_ptr + d).to(tl.float32)[None, :], tl.load(w_ptr + rolled).to(tl.float32)[None, :],
                           cos, sin, eps, D)


@triton.jit
def _attend_short(q, kc_ptr, vc_ptr, base, pos_at, row_ok, s_cl, scale, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr):
    """Query rows q [M, D] (normed, rotated), each attending the cache columns 0..its position (read at pos_at [M])
    of one (cache row, kv head) at `base`, all in one column block: the normalised output [M, D] in fp32."""
    limit = tl.where(row_ok, (tl.load(pos_at, mask=row_ok, other=-1) + 1).to(tl.int32), 0)
    m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros([q.shape[0], D], tl.float32)
    m_i, l_i, acc = _attend_block(q, kc_ptr, vc_ptr, base, 0, tl.max(limit, axis=0), limit, s_cl, scale, m_i, l_i,
                                  acc, D, BLOCK_N, IEEE)
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def _short_attention_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, out_ptr,
                            slots_ptr, pos_ptr, T, eps, scale,
                            s_qb, s_qt, s_kb, s_kt, s_vb, s_vt, s_cb, s_ct, s_sb, s_st, s_ob, s_ot, s_oh,
                            s_cs, s_ch, s_cl, s_pb, s_pt,
                            G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_N: tl.constexpr, IEEE: tl.constexpr, GDC: tl.constexpr):
    wait_inputs(GDC)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    d = tl.arange(0, D)
    base = tl.load(slots_ptr + b) * s_cs + kvh * s_ch
    # This kv head's new keys (normed, rotated) and values into the cache at their positions.
    tt = tl.arange(0, BLOCK_T)
    t_ok = tt < T
    at = base + tl.load(pos_ptr + b * s_pb + tt * s_pt, mask=t_ok, other=0)[:, None] * s_cl + d[None, :]
    keys = _load_norm_rope(k_ptr + b * s_kb + tt[:, None] * s_kt + kvh * D, t_ok, kw_ptr, cos_ptr + b * s_cb,
                           sin_ptr + b * s_sb, tt, s_ct, s_st, eps, D)
    tl.store(kc_ptr + at, keys, mask=t_ok[:, None])
    values = tl.load(v_ptr + b * s_vb + tt[:, None] * s_vt + kvh * D + d[None, :], mask=t_ok[:, None], other=0.0)
    tl.store(vc_ptr + at, values, mask=t_ok[:, None])
    # Its G query heads' rows (t * G + g), normed and rotated in registers.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < T * G
    t = rows // G
    head = kvh * G + rows % G
    q = _load_norm_rope(q_ptr + b * s_qb + t[:, None] * s_qt + head[:, None] * D, row_ok, qw_ptr, cos_ptr + b * s_cb,
                        sin_ptr + b * s_sb, t, s_ct, s_st, eps, D)
    tl.debug_barrier()  # the keys and values stored above are read below, by other threads of this program
    out = _attend_short(q, kc_ptr, vc_ptr, base, pos_ptr + b * s_pb + t * s_pt, row_ok, s_cl, scale, D, BLOCK_N, IEEE)
    tl.store(out_ptr + b * s_ob + t[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def short_attention_fits(k_cache: Tensor, T: int, H: int, valid_len: Tensor | None) -> bool:
    """Does short_attention take this call: a cache of at most SHORT_COLUMNS columns (the Code Predictor's), a
    query block of one tile, no right padding, and the switch on?"""
    Hkv = k_cache.shape[1]
    return (valid_len is None and k_cache.shape[2] <= SHORT_COLUMNS and H % Hkv == 0 and T * (H // Hkv) <= 64
            and short_attention_on())


def short_attention(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                    sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                    positions: Tensor) -> Tensor:
    """qk_norm_rope_store then cache_attention in one launch, for a cache of at most SHORT_COLUMNS columns: the same
    arguments as qk_norm_rope_store; returns the attention output [B, T, H, D] (cache_attention's)."""
    B, T, H, Hkv, D = _layer_shapes("short_attention", q, k, v, cos, sin_signed, k_cache, v_cache)
    G = H // Hkv
    if D & (D - 1) or D < 16 or H % Hkv or T * G > 64 or k_cache.shape[2] > SHORT_COLUMNS:
        raise ValueError(f"short_attention: head_dim {D} (a power of two >= 16), {H} heads over {Hkv} kv heads, "
                         f"{T * G} query rows (at most 64), a cache of {k_cache.shape[2]} columns (at most "
                         f"{SHORT_COLUMNS})")
    out = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    _short_attention_kernel[(B, Hkv)](
        q, k, v, q_weight, k_weight, cos, sin_signed, k_cache, v_cache, out, slots, positions, T, eps, D**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), cos.stride(1), sin_signed.stride(0), sin_signed.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), positions.stride(0), positions.stride(1),
        G=G, D=D, BLOCK_M=max(16, triton.next_power_of_2(T * G)), BLOCK_T=max(2, triton.next_power_of_2(T)),
        BLOCK_N=max(16, triton.next_power_of_2(k_cache.shape[2])), IEEE=q.dtype == torch.float32, num_warps=4,
        **launch_options(q.device))
    return out


def layer_attention(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                    sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor,
                    valid_len: Tensor | None, num_heads: int) -> Tensor:
    """One decoder layer's attention on the Triton path, from the projections to the output [B, T, H, D]:
    short_attention where it fits (the Code Predictor's cache), else qk_norm_rope_store then cache_attention.
    The arguments are qk_norm_rope_store's, plus cache_attention's valid_len and the query heads."""
    args = (q, k, v, q_weight, k_weight, eps, cos, sin_signed, k_cache, v_cache, slots, positions)
    if short_attention_fits(k_cache, q.shape[1], num_heads, valid_len):
        return short_attention(*args)
    return cache_attention(qk_norm_rope_store(*args), k_cache, v_cache, slots, positions, valid_len)


def cache_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor,
                              valid_len: Tensor | None = None, kv_len: int | None = None) -> Tensor:
    """The PyTorch path (gathered keys and values, a mask, engine.model.attention_ops.attention); same contract.
    kv_len: columns gathered (> every position), as the model's bucket gives it; None: read from positions."""
    S = kv_len if kv_len is not None else int(positions.max()) + 1
    cols = torch.arange(S, device=q.device)
    allowed = cols[None, None, :] <= positions[:, :, None]  # [B, T, S]
    if valid_len is not None:
        allowed = allowed & (cols[None, None, :] < valid_len[:, None, None])
    out = attention(q.transpose(1, 2), k_cache[slots, :, :S], v_cache[slots, :, :S], ~allowed[:, None])
    return out.transpose(1, 2)
