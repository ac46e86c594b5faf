"""SnakeBeta activation of the codec decoder, y = x + inv_mag * sin(x * freq)^2 per channel, in one pass.

`freq` = exp(alpha) and `inv_mag` = 1 / (exp(beta) + 1e-9) are prepared once at load (codec_layers.SnakeBeta);
this module only applies them. Three implementations of the same function:
- `snake_reference`: the official op order in the activation dtype (five elementwise passes); the tests' oracle;
- `snake_torch`: four passes, one temporary, written straight into `out` (CPU and the fallback on CUDA);
- `snake_triton`: one pass in fp32 registers, rounded once to the output dtype (CUDA, and CPU tensors under
  TRITON_INTERPRET=1 in the tests).
`snake` picks Triton for CUDA tensors unless it is unavailable or switched off; `kernels_status()` says which runs
and why (the server's /ready reports it), so a slow path is never silent.

The Triton kernel is built on first use, not at import: TRITON_INTERPRET is read when a kernel is decorated, and
the CPU tests set it before their first call.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger("voicelane.kernels.snake")

_state: dict = {"enabled": True}  # "error" is added on the first CUDA call: None or why Triton cannot run


def snake_reference(x: Tensor, freq: Tensor, inv_mag: Tensor) -> Tensor:
    """x [B, C, T]; freq, inv_mag [C] -> [B, C, T] in x's dtype, exactly the official SnakeBeta's ops."""
    return x + inv_mag[None, :, None] * torch.sin(x * freq[None, :, None]).pow(2)


def snake_torch(x: Tensor, freq: Tensor, inv_mag: Tensor, out: Tensor | None = None) -> Tensor:
    """Same as snake_reference with the last multiply and add fused (addcmul: one rounding fewer in bf16)."""
    s = torch.mul(x, freq[None, :, None])
    s.sin_()
    s.mul_(s)
    return torch.addcmul(x, s, inv_mag[None, :, None], out=out)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def snake_kernel(x_ptr, out_ptr, freq_ptr, inv_ptr, C, T, x_sb, x_sc, o_sb, o_sc, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # b * C + c
        b = (row // C).to(tl.int64)
        c = row % C
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = t < T
        x = tl.load(x_ptr + b * x_sb + c * x_sc + t, mask=keep, other=0.0).to(tl.float32)
        freq = tl.load(freq_ptr + c).to(tl.float32)
        inv = tl.load(inv_ptr + c).to(tl.float32)
        s = tl.sin(x * freq)
        y = x + inv * (s * s)
        tl.store(out_ptr + b * o_sb + c * o_sc + t, y.to(out_ptr.dtype.element_ty), mask=keep)

    return snake_kernel


def snake_triton(x: Tensor, freq: Tensor, inv_mag: Tensor, out: Tensor | None = None) -> Tensor:
    """x [B, C, T] (time stride 1, any batch/channel strides); freq, inv_mag [C] contiguous; out [B, C, T] or None
    (time stride 1; may be a view into a larger buffer, e.g. a convolution's input window)."""
    B, C, T = x.shape
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape:
        raise ValueError(f"snake: out has shape {tuple(out.shape)}, input {tuple(x.shape)}")
    if x.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("snake: input and output need time stride 1")
    if freq.shape != (C,) or inv_mag.shape != (C,):
        raise ValueError(f"snake: freq/inv_mag must be [{C}], got {tuple(freq.shape)}, {tuple(inv_mag.shape)}")
    if B * C == 0 or T == 0:
        return out
    block = min(1024, max(16, 1 << (T - 1).bit_length()))
    grid = (B * C, -(-T // block))
    _kernel()[grid](x, out, freq.contiguous(), inv_mag.contiguous(), C, T, x.stride(0), x.stride(1),
                    out.stride(0), out.stride(1), BLOCK=block)
    return out


def _triton_error() -> str | None:
    """None when the Triton kernel can be built, else why not (logged once, then shown by kernels_status)."""
    if "error" not in _state:
        try:
            _kernel()
            _state["error"] = None
        except Exception as exc:  # noqa: BLE001 - recorded, logged and shown in readiness
            _state["error"] = f"{type(exc).__name__}: {exc}"
            log.error("Triton SnakeBeta unavailable, the codec uses the PyTorch path (slower): %s", _state["error"])
    return _state["error"]


def snake(x: Tensor, freq: Tensor, inv_mag: Tensor, out: Tensor | None = None) -> Tensor:
    """SnakeBeta with prepared constants: x [B, C, T] -> [B, C, T] (into `out` if given)."""
    if x.is_cuda and _state["enabled"] and _triton_error() is None:
        return snake_triton(x, freq, inv_mag, out)
    return snake_torch(x, freq, inv_mag, out)


def set_triton_enabled(enabled: bool) -> None:
    """Switch the Triton kernel on or off (A/B timing); the status reports a switched-off kernel as such."""
    _state["enabled"] = enabled


def kernels_status() -> dict:
    """What /ready should show about the codec's SnakeBeta on CUDA: {"enabled": bool, "reason": str}."""
    if not _state["enabled"]:
        return {"enabled": False, "reason": "switched off (set_triton_enabled(False)): PyTorch path"}
    if not torch.cuda.is_available():
        return {"enabled": False, "reason": "no CUDA device: the PyTorch path runs on the CPU"}
    error = _triton_error()
    return {"enabled": error is None, "reason": error or "Triton one-pass kernel"}
