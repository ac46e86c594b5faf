"""Fused kernels of the codec decoder's sliding-window transformer (engine.model.codec_layers.SlidingTransformer).

- `scaled_add_rms_norm`: h = x + scale * a (LayerScale's addcmul, rounded once), then RMSNorm of h (normalised in
  fp32, rounded, times the weight, rounded): one pass instead of the addcmul and RMSNorm's four kernels (cast,
  norm, cast back, weight).
- `rope_kv`: RoPE of the stacked q/k projection (q*cos rounded, then + rotate_half(q)*sin rounded, as the PyTorch
  path's mul and addcmul), q written [B, H, t, hd] and the new keys and values written straight into the
  attention's key/value buffer after the P past frames: no cat, no separate copies.

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

    return scaled_add_rms_norm_kernel, rope_kv_kernel


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
