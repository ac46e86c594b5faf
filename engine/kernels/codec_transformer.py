"""Fused kernels of the codec decoder's sliding-window transformer (engine.model.codec_layers.SlidingTransformer).

- `scaled_add_rms_norm`: h = x + scale * a (LayerScale's addcmul, rounded once), then RMSNorm of h (normalised in
  fp32, rounded, times the weight, rounded): one pass instead of the addcmul and RMSNorm's four kernels (cast,
  norm, cast back, weight).
- `rope_kv`: RoPE of the stacked q/k projection (q*cos rounded, then + rotate_half(q)*sin rounded, as the PyTorch
  path's mul and addcmul), q written [B, H, t, hd] and the new keys and values written straight into the
  attention's key/value buffer after the P past frames: no cat, no separate copies.
- `ring_attention`: a streaming step's attention, reading the past W-1 frames' keys and values in place from each
  row's slot of the stream state's ring (frame p at column p mod (W-1)) and the step's own t frames from a small
  buffer, masked from the row's position on the device: no gathered window, no mask tensor.

Each has a PyTorch path with the same rounding steps (`*_torch`, also the CPU path) and runs its Triton kernel where
engine.kernels.snake.use_triton says the codec's kernels are Triton (the same switch as the window kernel).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels.snake import use_triton


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_add_rms_norm_kernel(x_ptr, a_ptr, scale_ptr, w_ptr, h_ptr, out_ptr, N, eps, x_s, a_s, h_s, o_s,
                                   HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < N
        x = tl.load(x_ptr + row * x_s + cols, mask=keep, other=0.0)
        if HAS_ADD:
            a = tl.load(a_ptr + row * a_s + cols, mask=keep, other=0.0).to(tl.float32)
            scale = tl.load(scale_ptr + cols, mask=keep, other=0.0).to(tl.float32)
            h = (x.to(tl.float32) + scale * a).to(x.dtype)
            tl.store(h_ptr + row * h_s + cols, h, mask=keep)
        else:
            h = x
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
        normed = (hf * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * o_s + cols, (w * normed).to(x.dtype), mask=keep)

    @triton.jit
    def rope_kv_kernel(proj_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, t, H, HKV, P,
                       p_sb, p_st, c_sb, c_st, q_sb, q_sh, q_st, kv_sb, kv_sj, kv_sh, kv_st,
                       HD: tl.constexpr, BLOCK: tl.constexpr):
        # One (row b, frame s) per program 0, one head per program 1: q heads, then k heads, then v heads.
        bs = tl.program_id(0)
        b = (bs // t).to(tl.int64)
        s = bs % t
        head = tl.program_id(1)
        d = tl.arange(0, BLOCK)
        keep = d < HD
        base = proj_ptr + b * p_sb + s * p_st
        n_qk = (H + HKV) * HD
        if head < H + HKV:
            x = tl.load(base + head * HD + d, mask=keep, other=0.0)
            rot = tl.load(base + n_qk + head * HD + d, mask=keep, other=0.0).to(tl.float32)
            cos = tl.load(cos_ptr + b * c_sb + s * c_st + d, mask=keep, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + b * c_sb + s * c_st + d, mask=keep, other=0.0).to(tl.float32)
            first = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
            y = (first + rot * sin).to(x.dtype)
            if head < H:
                tl.store(q_ptr + b * q_sb + head * q_sh + s * q_st + d, y, mask=keep)
            else:
                tl.store(kv_ptr + b * kv_sb + (head - H) * kv_sh + (P + s) * kv_st + d, y, mask=keep)
        else:
            v = tl.load(base + 2 * n_qk + (head - H - HKV) * HD + d, mask=keep, other=0.0)
            tl.store(kv_ptr + b * kv_sb + kv_sj + (head - H - HKV) * kv_sh + (P + s) * kv_st + d, v, mask=keep)

    @triton.jit
    def ring_attention_kernel(q_ptr, new_ptr, ring_ptr, slots_ptr, pos_ptr, out_ptr, t, R, W, GROUP, scale,
                              q_sb, q_sh, q_st, n_sb, n_sj, n_sh, n_st, r_ss, r_sj, r_sh, r_sc, o_sb, o_st, o_sh,
                              HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # One (row b, query head, block of BLOCK_T query frames) per program. The keys are one sequence: the ring's
        # R = W-1 columns, then the step's t new frames; blocks of BLOCK_N of it folded into one fp32 online
        # softmax (the launcher makes one block hold all R + t where it can: one round of loads, no rescaling).
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        kvh = head // GROUP
        s = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)  # query frame offsets
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HD
        q = tl.load(q_ptr + b * q_sb + head * q_sh + s[:, None] * q_st + d[None, :],
                    mask=(s < t)[:, None] & d_ok[None, :], other=0.0)
        pos = tl.load(pos_ptr + b)
        ring = ring_ptr + tl.load(slots_ptr + b) * r_ss + kvh * r_sh
        new = new_ptr + b * n_sb + kvh * n_sh
        m_i = tl.full([BLOCK_T], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_T], tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        # A while loop: triton 3.6's interpreter cannot take a kernel argument as a range() bound.
        block = 0
        while block < tl.cdiv(R + t, BLOCK_N):
            j = block * BLOCK_N + tl.arange(0, BLOCK_N)
            in_ring = j < R
            c = tl.where(in_ring, j, j - R)  # the ring's column, or the new frame
            # Ring column c holds frame pos - R + age, age = (c - pos) mod R: query pos + s sees it inside the
            # window (age >= s: distance <= R = W - 1) and from the stream's start on (age >= R - pos). New frame
            # c: 0 <= s - c < W.
            age = (c + R - pos % R) % R
            dist = s[:, None] - c[None, :]
            seen = tl.where(in_ring[None, :], (age[None, :] >= s[:, None]) & (age >= R - pos)[None, :],
                            (c < t)[None, :] & (dist >= 0) & (dist < W))
            key = tl.where(in_ring, ring + c * r_sc, new + c * n_st)
            load_ok = (j < R + t)[:, None] & d_ok[None, :]
            k = tl.load(key[:, None] + d[None, :], mask=load_ok, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(seen, scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet (a fresh stream): p = 0
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(key[:, None] + tl.where(in_ring, r_sj, n_sj)[:, None] + d[None, :], mask=load_ok, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
            block += 1
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i = 0 only on rows past t, not stored
        tl.store(out_ptr + b * o_sb + s[:, None] * o_st + head * o_sh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(s < t)[:, None] & d_ok[None, :])

    return scaled_add_rms_norm_kernel, rope_kv_kernel, ring_attention_kernel


def scaled_add_rms_norm_torch(x: Tensor, scale: Tensor | None, a: Tensor | None, weight: Tensor,
                              eps: float) -> tuple[Tensor, Tensor]:
    """(h, weight * rms_norm(h)) with h = x + scale * a (h = x when a is None); x, a [..., N]; scale, weight [N]."""
    h = x if a is None else torch.addcmul(x, scale, a)
    return h, weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)


def scaled_add_rms_norm(x: Tensor, scale: Tensor | None, a: Tensor | None, weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    """See scaled_add_rms_norm_torch; one kernel on the Triton path."""
    if not use_triton(x.device):
        return scaled_add_rms_norm_torch(x, scale, a, weight, eps)
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    a2 = x2 if a is None else a.reshape(-1, N)
    if x2.stride(-1) != 1 or a2.stride(-1) != 1:
        x2, a2 = x2.contiguous(), a2.contiguous()
    h = x2 if a is None else torch.empty_like(x2)
    out = torch.empty_like(x2)
    block = 1 << max(N - 1, 0).bit_length()
    _kernels()[0][(x2.shape[0],)](x2, a2, weight if scale is None else scale, weight, h, out, N, eps,
                                  x2.stride(0), a2.stride(0), h.stride(0), out.stride(0),
                                  HAS_ADD=a is not None, BLOCK=block)
    return (x if a is None else h.view(x.shape)), out.view(x.shape)


def rope_kv_torch(proj: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, past: int, heads: int, kv_heads: int,
                  head_dim: int) -> Tensor:
    """proj [B, t, (2 * (H + Hkv) + Hkv) * hd]: q, k, rotate_half(q), rotate_half(k), v; cos, sin [B|1, t, hd];
    kv [B, 2, Hkv, past + t, hd]: the new keys and values are written at [..., past:, :]. Returns q [B, H, t, hd]
    (a view)."""
    B, t, _ = proj.shape
    H, Hkv, hd = heads, kv_heads, head_dim
    n_qk = (H + Hkv) * hd
    qk = proj[..., :n_qk].view(B, t, H + Hkv, hd)
    qk_rot = proj[..., n_qk: 2 * n_qk].view(B, t, H + Hkv, hd)
    qk = torch.addcmul(qk * cos[:, :, None], qk_rot, sin[:, :, None])  # RoPE: q*cos + rotate_half(q)*sin
    kv[:, 0, :, past:].copy_(qk[:, :, H:].transpose(1, 2))
    kv[:, 1, :, past:].copy_(proj[..., 2 * n_qk:].view(B, t, Hkv, hd).transpose(1, 2))
    return qk[:, :, :H].transpose(1, 2)


def rope_kv(proj: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, past: int, heads: int, kv_heads: int,
            head_dim: int) -> Tensor:
    """See rope_kv_torch; one kernel on the Triton path (q then contiguous [B, H, t, hd])."""
    if not use_triton(proj.device):
        return rope_kv_torch(proj, cos, sin, kv, past, heads, kv_heads, head_dim)
    B, t, width = proj.shape
    if width != (2 * (heads + kv_heads) + kv_heads) * head_dim or kv.shape != (B, 2, kv_heads, past + t, head_dim):
        raise ValueError(f"rope_kv: proj {tuple(proj.shape)} and kv {tuple(kv.shape)} for {heads} heads, "
                         f"{kv_heads} kv heads of {head_dim}, {past} past frames")
    if proj.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("rope_kv: proj, cos, sin and kv need a unit stride along the head dimension")
    q = proj.new_empty(B, heads, t, head_dim)
    cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    _kernels()[1][(B * t, heads + 2 * kv_heads)](
        proj, cos, sin, q, kv, t, heads, kv_heads, past, proj.stride(0), proj.stride(1), cos_b, cos.stride(1),
        *q.stride()[:3], kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        HD=head_dim, BLOCK=1 << max(head_dim - 1, 0).bit_length())
    return q


def ring_mask(pos: Tensor, t: int, window: int) -> Tensor:
    """[B, 1, t, W-1+t] bool (True = attend) for a streaming step's queries at pos .. pos+t-1 (pos [B] int64) over
    the ring's W-1 columns, then the step's t new frames. Ring column c holds frame pos - (W-1) + age with
    age = (c - pos) mod (W-1): the query at pos+s sees it when age >= s (inside the window) and age >= W-1-pos
    (not before the stream's start); it sees new frame j when 0 <= s - j < W."""
    R = window - 1
    s = torch.arange(t, device=pos.device)
    age = (torch.arange(R, device=pos.device) - pos[:, None]).remainder(R)  # [B, R]
    past = (age[:, None, :] >= s[None, :, None]) & (age >= R - pos[:, None])[:, None, :]  # [B, t, R]
    dist = s[:, None] - s[None, :]
    new = ((dist >= 0) & (dist < window)).expand(pos.shape[0], t, t)
    return torch.cat([past, new], dim=2)[:, None]


def ring_attention_torch(q: Tensor, new_kv: Tensor, ring: Tensor, slots: Tensor, pos: Tensor, window: int,
                         scale: float, mask: Tensor | None = None) -> Tensor:
    """q [B, H, t, hd]; new_kv [B, 2, Hkv, t, hd]: the step's post-RoPE keys and values; ring [S, 2, Hkv, W-1, hd]:
    every slot's keys and values of its last W-1 frames, frame p at column p mod (W-1) (the state's ring, read
    here, not written); slots, pos [B]; mask: ring_mask(pos, t, window) as an additive mask in q's dtype (made
    here if None). Returns out [B, t, H, hd]. The rows' ring columns are gathered and put before the new frames,
    each of keys and values dense for SDPA."""
    if mask is None:
        bool_mask = ring_mask(pos, q.shape[2], window)
        mask = torch.zeros(bool_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~bool_mask, float("-inf"))
    k, v = (torch.cat([ring[:, j].index_select(0, slots), new_kv[:, j]], dim=2) for j in (0, 1))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


# One round of keys is faster where a step has few programs, rounds of 32 where it has many (H100, e3d8483, 16
# heads: 16 programs 8.4 -> 5.5 us a launch, 1024 programs 19.4 -> 23.8 us).
ONE_ROUND_PROGRAMS = 256


def default_block_n(programs: int, keys: int) -> int:
    """Keys a loop round of ring attention for a grid of `programs` over `keys` keys (ring columns and new frames):
    all of them in one round (up to 128) where the grid is small enough for the registers that takes
    (ONE_ROUND_PROGRAMS; measured on the H100, PERFORMANCE.md's eighteenth session), else rounds of 32."""
    return min(128, max(16, 1 << (keys - 1).bit_length())) if programs <= ONE_ROUND_PROGRAMS else 32


def ring_attention(q: Tensor, new_kv: Tensor, ring: Tensor, slots: Tensor, pos: Tensor, window: int,
                   scale: float, mask: Tensor | None = None, block_n: int | None = None) -> Tensor:
    """See ring_attention_torch; one kernel on the Triton path (which ignores `mask`: it masks from pos itself),
    out then contiguous [B, t, H, hd]. block_n: keys a loop round (default: all W-1+t of them, up to 128, for a
    grid of at most ONE_ROUND_PROGRAMS programs, else 32; tests pass it to exercise both)."""
    if not use_triton(q.device):
        return ring_attention_torch(q, new_kv, ring, slots, pos, window, scale, mask)
    B, H, t, hd = q.shape
    Hkv, R = new_kv.shape[2], window - 1
    if new_kv.shape != (B, 2, Hkv, t, hd) or ring.shape[1:] != (2, Hkv, R, hd) or H % Hkv:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, new_kv {tuple(new_kv.shape)} and ring "
                         f"{tuple(ring.shape)} for a window of {window}")
    if q.stride(-1) != 1 or new_kv.stride(-1) != 1 or ring.stride(-1) != 1:
        raise ValueError("ring_attention: q, new_kv and ring need a unit stride along the head dimension")
    out = q.new_empty(B, t, H, hd)
    block_t = 16  # tl.dot needs 16 rows; a step's t is 1..12 in the engine
    grid = (B, H, -(-t // block_t))
    if block_n is None:  # the real codec's 71 ring columns and up to 57 new frames in one round, for a small grid
        block_n = default_block_n(B * H * grid[2], R + t)
    _kernels()[2][grid](
        q, new_kv, ring, slots, pos, out, t, R, window, H // Hkv, scale, *q.stride()[:3], *new_kv.stride()[:4],
        *ring.stride()[:4], *out.stride()[:3], HD=hd, BLOCK_D=max(16, 1 << max(hd - 1, 0).bit_length()),
        BLOCK_T=block_t, BLOCK_N=block_n, IEEE=q.dtype == torch.float32)
    return out
