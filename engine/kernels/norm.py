"""RMSNorm fused with the residual add before it, and SwiGLU on a fused gate/up projection.

Rounding follows the PyTorch path step by step (engine/model/layers.py): the residual sum is rounded to the
activation dtype, normalised in fp32, rounded, then multiplied by the weight and rounded again; SwiGLU rounds
silu(gate) before the multiply. In bf16 the kernels therefore differ from the references only by the order of
the fp32 sum of squares.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.gdc import wait_inputs
from engine.kernels.pdl import launch_options


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, res_out_ptr, out_ptr, N, eps,
                         stride_x, stride_r, stride_ro, stride_o,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    wait_inputs(GDC)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    normed = (hf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def _rows(x: Tensor) -> Tensor:
    """[..., N] -> [M, N] with a unit column stride (a view when possible)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual [..., N]; weight [N] -> (h, weight * rms_norm(h)) with h = x + residual (h = x when residual
    is None; then x itself is returned as h). Both outputs [..., N] in x's dtype."""
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        raise TypeError(f"add_rms_norm: x {x.dtype}, residual {None if residual is None else residual.dtype} "
                        f"and weight {weight.dtype} must share one dtype")
    N = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else x2
    BLOCK = triton.next_power_of_2(N)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, h, out, N, eps, x2.stride(0), r2.stride(0), h.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=8 if BLOCK >= 4096 else 4,
        **launch_options(x.device))
    shape = x.shape
    return (h.view(shape) if residual is not None else x), out.view(shape)


def add_rms_norm_reference(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """What engine.model.layers computes: the residual add, then RMSNorm."""
    h = x if residual is None else x + residual
    return h, weight * F.rms_norm(h, (h.shape[-1],), eps=eps)


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, width, stride_gu, stride_o, BLOCK: tl.constexpr, GDC: tl.constexpr):
    wait_inputs(GDC)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def swiglu(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2 * I] (gate columns first, then up) -> silu(gate) * up [..., I]."""
    both = gate_up.shape[-1]
    if both % 2:
        raise ValueError(f"swiglu: the last dimension {both} is not gate and up of equal width")
    width = both // 2
    x2 = _rows(gate_up)
    out = torch.empty(x2.shape[0], width, device=gate_up.device, dtype=gate_up.dtype)
    BLOCK = min(1024, triton.next_power_of_2(width))
    _swiglu_kernel[(x2.shape[0], triton.cdiv(width, BLOCK))](x2, out, width, x2.stride(0), out.stride(0),
                                                             BLOCK=BLOCK, num_warps=4,
                                                             **launch_options(gate_up.device))
    return out.view(*gate_up.shape[:-1], width)


def swiglu_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
