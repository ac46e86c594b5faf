"""SnakeBeta of the codec decoder, y = x + inv_mag * sin(x * freq)^2 per channel, and the one-pass kernel that
builds a causal convolution's input window around it.

`freq` = exp(alpha) and `inv_mag` = 1 / (exp(beta) + 1e-9) are prepared once at load (codec_layers.SnakeBeta);
this module only applies them.

`conv_window` is what the decoder runs between two convolutions, in one pass over the activations:
    v = y + bias[c] + res        (a convolution's output, its bias and a residual: each part optional)
    x = round(v)                 (to the activation dtype; optionally stored: the next residual)
    a = snake(x) or x            (optionally clamped to [-1, 1]: the decoder's output)
    win = [tail_in, a]           (the next convolution's input: H samples of history, zeros without a tail)
    tail_out = win[..., T:]      (the history the next step of the stream starts from; with per-row valid
                                  lengths, win[b, :, n_b : n_b + H] for n_b = tail_valid[b] * tail_factor)
Every tensor may have any strides, so the same kernel serves activations stored [B, C, T] (time stride 1) and
[B, T, C] (channels last, viewed as [B, C, T] with channel stride 1). tail_in and tail_out must not overlap.
The tails are either [B, C, H] (row b at b * stride(0)) or views of a stream state whose rows are addressed per
batch row: tail_in_at / tail_out_at [B] int64, the element offset of row b's tail from the view's row 0. So a
stream step reads and writes each slot's history where the state keeps it, with no gather or scatter.

Implementations of the same functions:
- `snake_reference`: the official op order in the activation dtype (five elementwise passes); the tests' oracle;
- `snake_torch`, `conv_window_torch`: PyTorch ops (the CPU, and the fallback on CUDA);
- `snake_triton`, `conv_window_triton`: one pass in fp32 registers, rounded once to the output dtype (CUDA, and
  CPU tensors under TRITON_INTERPRET=1 in the tests).
`snake` and `conv_window` pick Triton where `engine.kernels.use_triton` says the model's kernels are Triton
(CUDA unless VOICELANE_KERNELS=torch; the CPU only when forced) and the kernel builds, unless switched off here;
`kernels_status()` says which runs and why, so a slow path is never silent.

The Triton kernel is built on first use, not at import: TRITON_INTERPRET is read when a kernel is decorated, and
the CPU tests set it before their first call.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from engine import kernels

log = logging.getLogger("voicelane.kernels.snake")

_state: dict = {"enabled": True}  # "error" is added on the first call: None or why Triton cannot run


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
    def conv_window_kernel(y_ptr, bias_ptr, res_ptr, x_ptr, freq_ptr, inv_ptr, win_ptr, tin_ptr, tout_ptr,
                           tin_at_ptr, tout_at_ptr, valid_ptr, factor, C, T, H,
                           y_sb, y_sc, y_st, r_sb, r_sc, r_st, x_sb, x_sc, x_st, w_sb, w_sc, w_st,
                           ti_sb, ti_sc, ti_st, to_sb, to_sc, to_st,
                           HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STORE_X: tl.constexpr,
                           SNAKE: tl.constexpr, CLAMP: tl.constexpr, HAS_TIN: tl.constexpr,
                           HAS_TOUT: tl.constexpr, TAIL_AT: tl.constexpr, HAS_VALID: tl.constexpr,
                           FAST_SIN: tl.constexpr,
                           BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
        # One tile: BLOCK_C channels x BLOCK_T window positions tau (tau < H: history, tau >= H: new sample
        # tau - H) of one batch row. The row's base is a scalar int64 offset; inside a row the offsets are int32
        # (the wrapper checks that they fit): 64-bit vector index math made this elementwise kernel issue-bound.
        b = tl.program_id(2).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
        tau = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        in_c = c < C
        in_win = in_c & (tau < H + T)
        new = in_win & (tau >= H)
        t = tau - H
        v = tl.load(y_ptr + b * y_sb + (c * y_sc + t * y_st), mask=new, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += tl.load(bias_ptr + c, mask=in_c, other=0.0).to(tl.float32)
        if HAS_RES:
            v += tl.load(res_ptr + b * r_sb + (c * r_sc + t * r_st), mask=new, other=0.0).to(tl.float32)
        v = v.to(win_ptr.dtype.element_ty).to(tl.float32)  # rounded as a stored sum would be
        if STORE_X:
            tl.store(x_ptr + b * x_sb + (c * x_sc + t * x_st), v.to(x_ptr.dtype.element_ty), mask=new)
        if SNAKE:
            freq = tl.load(freq_ptr + c, mask=in_c, other=0.0).to(tl.float32)
            inv = tl.load(inv_ptr + c, mask=in_c, other=0.0).to(tl.float32)
            x = v * freq
            if FAST_SIN:
                # sin(x) by range reduction to r = x - k*pi in [-pi/2, pi/2] (pi in three parts, Cody-Waite) and an
                # odd polynomial fitted to sin(r)/r: about 11 instructions, where libdevice's sinf takes about 30
                # with its quadrant logic and its slow path for huge arguments. Its sign is (-1)^k sin(x), which
                # the square takes away. The square's max abs error is 3.4e-7 for |x| <= 2000 (the fp32
                # reduction; bf16's step at 1 is 2^-8). inf or nan in: nan out, as sinf.
                k = tl.floor(x * 0.3183098861837907 + 0.5)
                r = x - k * 3.140625
                r = r - k * 9.670257568359375e-4
                r = r - k * 6.27832957178498e-7
                u = r * r
                p = 2.60515895e-06 * u - 1.98090432e-04
                p = p * u + 8.33305058e-03
                p = p * u - 1.66666580e-01
                p = p * u + 9.99999996e-01
                s = r * p
            else:
                s = tl.sin(x)
            v = v + inv * (s * s)
        if CLAMP:
            v = tl.minimum(tl.maximum(v, -1.0), 1.0)
        if TAIL_AT:  # each row's tails lie where the stream state keeps them (element offsets, int64)
            tin_row = tl.load(tin_at_ptr + b)
            tout_row = tl.load(tout_at_ptr + b)
        else:
            tin_row = b * ti_sb
            tout_row = b * to_sb
        if HAS_TIN:
            old = tl.load(tin_ptr + tin_row + (c * ti_sc + tau * ti_st), mask=in_win & (tau < H),
                          other=0.0).to(tl.float32)
            v = tl.where(tau < H, old, v)
        else:
            v = tl.where(tau < H, 0.0, v)
        a = v.to(win_ptr.dtype.element_ty)
        tl.store(win_ptr + b * w_sb + (c * w_sc + tau * w_st), a, mask=in_win)
        if HAS_TOUT:
            if HAS_VALID:  # this row's samples end at n: its new history is win[n : n + H]
                n = tl.load(valid_ptr + b).to(tl.int32) * factor
                tl.store(tout_ptr + tout_row + (c * to_sc + (tau - n) * to_st), a,
                         mask=in_win & (tau >= n) & (tau < n + H))
            else:
                tl.store(tout_ptr + tout_row + (c * to_sc + (tau - T) * to_st), a, mask=in_win & (tau >= T))

    return conv_window_kernel


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_window(y: Tensor, win: Tensor, bias, res, freq, inv_mag, x_out, tail_in, tail_out, tail_valid,
                  tail_in_at, tail_out_at) -> int:
    """Shape checks shared by both paths; returns H, the window's history length."""
    B, C, T = y.shape
    if win.dim() != 3 or win.shape[:2] != (B, C) or win.shape[2] < T:
        raise ValueError(f"conv_window: window {tuple(win.shape)} for input {tuple(y.shape)}")
    H = win.shape[2] - T
    if (tail_in_at is None) != (tail_out_at is None) or (tail_in_at is not None and (tail_in is None
                                                                                    or tail_out is None)):
        raise ValueError("conv_window: tail_in_at and tail_out_at come together, with tail_in and tail_out")
    at = tail_in_at is not None
    for name, t, shape in (("res", res, (B, C, T)), ("x_out", x_out, (B, C, T)), ("bias", bias, (C,)),
                           ("tail_valid", tail_valid, (B,)), ("tail_in_at", tail_in_at, (B,)),
                           ("tail_out_at", tail_out_at, (B,))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"conv_window: {name} has shape {tuple(t.shape)}, expected {shape}")
    for name, t in (("tail_in", tail_in), ("tail_out", tail_out)):  # with offsets: the state's rows, any number
        if t is not None and (t.dim() != 3 or tuple(t.shape[1:]) != (C, H) or (not at and t.shape[0] != B)):
            raise ValueError(f"conv_window: {name} has shape {tuple(t.shape)}, expected {('S' if at else B, C, H)}")
    if (freq is None) != (inv_mag is None) or (freq is not None and (freq.shape != (C,) or inv_mag.shape != (C,))):
        raise ValueError(f"snake: freq/inv_mag must be [{C}], got {None if freq is None else tuple(freq.shape)}, "
                         f"{None if inv_mag is None else tuple(inv_mag.shape)}")
    return H


_LONG_WINDOW = 256  # from here on a window's time axis fills 128 x 64 tiles (the tuner's 384-sample windows and up)


@dataclass(frozen=True)
class WindowConfig:
    """How conv_window_kernel is launched: its tile, its warps, and which sine it computes."""

    block_c: int
    block_t: int
    num_warps: int = 4
    fast_sin: bool = False  # sin_poly instead of libdevice's sinf (see the kernel)


def window_config(C: int, width: int, channels_last: bool, dtype: torch.dtype) -> WindowConfig:
    """The launch the engine uses for a [B, C, width] window (width = H + T).

    From engine.tools.tune_conv_window on the H200 (docs/PERFORMANCE.md, a 64 x 12-frame 1.7B codec step):
    the polynomial sine and 128 x 64 tiles of 8 warps for the long channels-last windows took the step's window
    calls from 6.63 to 5.31 ms. The polynomial is within one bf16 step of sinf, so it is used below fp32 only;
    fp32 keeps libdevice's sine, which parity with the reference is measured against."""
    fast_sin = dtype != torch.float32
    if channels_last and C > 1:  # tiles along the channels
        block_c = min(_pow2(C), 128)
        if block_c == 128 and width >= _LONG_WINDOW:
            return WindowConfig(128, 64, num_warps=8, fast_sin=fast_sin)
        return WindowConfig(block_c, max(1, min(_pow2(width), 2048 // block_c)), fast_sin=fast_sin)
    block_t = min(1024, max(16, _pow2(width)))
    return WindowConfig(max(1, min(_pow2(C), 2048 // block_t)), block_t, fast_sin=fast_sin)


def _row_offsets_fit(t: Tensor | None) -> bool:
    """The kernel's offsets inside one batch row are int32."""
    return t is None or sum((n - 1) * abs(st) for n, st in zip(t.shape[1:], t.stride()[1:], strict=True)) < 2**31


def conv_window_triton(y: Tensor, win: Tensor, *, bias: Tensor | None = None, res: Tensor | None = None,
                       freq: Tensor | None = None, inv_mag: Tensor | None = None, x_out: Tensor | None = None,
                       tail_in: Tensor | None = None, tail_out: Tensor | None = None, clamp: bool = False,
                       tail_valid: Tensor | None = None, tail_factor: int = 1, tail_in_at: Tensor | None = None,
                       tail_out_at: Tensor | None = None, config: WindowConfig | None = None) -> Tensor:
    """See the module docstring: y, res, x_out [B, C, T]; win [B, C, H + T]; tail_in, tail_out [B, C, H], or
    [S, C, H] views of a state with tail_in_at, tail_out_at [B] int64 (row b's element offsets); bias, freq, inv_mag
    [C]; tail_valid [B] int64 (each row's valid inputs, in units of tail_factor samples; None: all T). Any strides.
    config: the launch (None: window_config's). Returns win."""
    H = _check_window(y, win, bias, res, freq, inv_mag, x_out, tail_in, tail_out, tail_valid, tail_in_at, tail_out_at)
    B, C, T = y.shape
    if B * C * (H + T) == 0:
        return win
    if not all(_row_offsets_fit(t) for t in (y, win, res, x_out, tail_in, tail_out)):
        raise ValueError(f"conv_window: a batch row of {C} x {H + T} is too large for the kernel's int32 offsets")
    cfg = config or window_config(C, H + T, win.stride(1) == 1, win.dtype)
    dummy = y

    def strides(t: Tensor | None) -> tuple[int, int, int]:
        return tuple(t.stride()) if t is not None else (0, 0, 0)

    freq = freq.contiguous() if freq is not None else None
    inv_mag = inv_mag.contiguous() if inv_mag is not None else None
    bias = bias.contiguous() if bias is not None else None
    grid = (-(-(H + T) // cfg.block_t), -(-C // cfg.block_c), B)
    _kernel()[grid](
        y, dummy if bias is None else bias, dummy if res is None else res, dummy if x_out is None else x_out,
        dummy if freq is None else freq, dummy if inv_mag is None else inv_mag, win,
        dummy if tail_in is None else tail_in, dummy if tail_out is None else tail_out,
        dummy if tail_in_at is None else tail_in_at, dummy if tail_out_at is None else tail_out_at,
        dummy if tail_valid is None else tail_valid, tail_factor, C, T, H,
        *y.stride(), *strides(res), *strides(x_out), *win.stride(), *strides(tail_in), *strides(tail_out),
        HAS_BIAS=bias is not None, HAS_RES=res is not None, STORE_X=x_out is not None, SNAKE=freq is not None,
        CLAMP=clamp, HAS_TIN=tail_in is not None, HAS_TOUT=tail_out is not None, TAIL_AT=tail_in_at is not None,
        HAS_VALID=tail_valid is not None,
        FAST_SIN=cfg.fast_sin, BLOCK_C=cfg.block_c, BLOCK_T=cfg.block_t, num_warps=cfg.num_warps)
    return win


def conv_window_torch(y: Tensor, win: Tensor, *, bias: Tensor | None = None, res: Tensor | None = None,
                      freq: Tensor | None = None, inv_mag: Tensor | None = None, x_out: Tensor | None = None,
                      tail_in: Tensor | None = None, tail_out: Tensor | None = None, clamp: bool = False,
                      tail_valid: Tensor | None = None, tail_factor: int = 1, tail_in_at: Tensor | None = None,
                      tail_out_at: Tensor | None = None) -> Tensor:
    """The same as conv_window_triton in PyTorch ops."""
    H = _check_window(y, win, bias, res, freq, inv_mag, x_out, tail_in, tail_out, tail_valid, tail_in_at, tail_out_at)
    if tail_in_at is not None:  # the state's rows: read them into [B, C, H], and write the new ones back below
        tail_in, tails_at = _AtRows(tail_in, tail_in_at).read(), _AtRows(tail_out, tail_out_at)
        tail_out = torch.empty_like(tail_in)
    T = y.shape[2]
    new = win[..., H:]
    v = y
    if bias is not None or res is not None:  # summed in fp32 and rounded once, as the kernel does
        v = y.float()
        if bias is not None:
            v = v + bias.float()[None, :, None]
        if res is not None:
            v = v + res.float()
        v = v.to(y.dtype)
    if x_out is not None:
        x_out.copy_(v)
    if freq is not None:
        snake_torch(v, freq, inv_mag, out=new)
    else:
        new.copy_(v)
    if clamp:
        new.clamp_(min=-1.0, max=1.0)
    if H:
        if tail_in is None:
            win[..., :H].zero_()
        else:
            win[..., :H].copy_(tail_in)
        if tail_out is not None and tail_valid is None:
            tail_out.copy_(win[..., T:])
        elif tail_out is not None:
            index = tail_valid[:, None] * tail_factor + torch.arange(H, device=win.device)  # [B, H]
            tail_out.copy_(win.gather(2, index[:, None, :].expand(tail_out.shape)))
        if tail_in_at is not None:
            tails_at.write(tail_out)
    return win


class _AtRows:
    """Rows of a [S, C, H] view addressed by element offsets at [B] (conv_window's tail_in_at / tail_out_at),
    read and written as [B, C, H] through one index into the view's storage: no host sync, so capture-safe."""

    def __init__(self, view: Tensor, at: Tensor):
        extent = view.untyped_storage().nbytes() // view.element_size() - view.storage_offset()
        self.storage = view.as_strided((extent,), (1,))  # from the view's first element to the storage's end
        C, H = view.shape[1:]
        c = torch.arange(C, device=at.device) * view.stride(1)
        h = torch.arange(H, device=at.device) * view.stride(2)
        self.index = at[:, None, None] + c[None, :, None] + h[None, None, :]  # [B, C, H]

    def read(self) -> Tensor:
        return self.storage[self.index]

    def write(self, rows: Tensor) -> None:
        self.storage[self.index] = rows


def snake_triton(x: Tensor, freq: Tensor, inv_mag: Tensor, out: Tensor | None = None) -> Tensor:
    """x [B, C, T] (any strides); freq, inv_mag [C]; out [B, C, T] or None (any strides; may be a view into a
    larger buffer, e.g. a convolution's input window; None: a new tensor with x's layout)."""
    if out is None:
        out = torch.empty_like(x)
    if out.shape != x.shape:
        raise ValueError(f"snake: out has shape {tuple(out.shape)}, input {tuple(x.shape)}")
    return conv_window_triton(x, out, freq=freq, inv_mag=inv_mag)


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


def use_triton(device: torch.device) -> bool:
    """Whether the codec's elementwise kernels on `device` are the Triton ones."""
    return _state["enabled"] and kernels.use_triton(device) and _triton_error() is None


def conv_window(y: Tensor, win: Tensor, **parts) -> Tensor:
    """Build a convolution's input window in one pass (see the module docstring); returns win."""
    if use_triton(y.device):
        return conv_window_triton(y, win, **parts)
    return conv_window_torch(y, win, **parts)


def snake(x: Tensor, freq: Tensor, inv_mag: Tensor, out: Tensor | None = None) -> Tensor:
    """SnakeBeta with prepared constants: x [B, C, T] -> [B, C, T] (into `out` if given)."""
    if use_triton(x.device):
        return snake_triton(x, freq, inv_mag, out)
    return snake_torch(x, freq, inv_mag, out)


def set_triton_enabled(enabled: bool) -> None:
    """Switch the Triton kernel on or off (A/B timing); the status reports a switched-off kernel as such."""
    _state["enabled"] = enabled


def kernels_status() -> dict:
    """What /ready should show about the codec's SnakeBeta on CUDA: {"enabled": bool, "reason": str}."""
    if not _state["enabled"]:
        return {"enabled": False, "reason": "switched off (set_triton_enabled(False)): PyTorch path"}
    if kernels.choice() == "torch":
        return {"enabled": False, "reason": f"{kernels.ENV}=torch: PyTorch path"}
    if not torch.cuda.is_available():
        return {"enabled": False, "reason": "no CUDA device: the PyTorch path runs on the CPU"}
    error = _triton_error()
    return {"enabled": error is None, "reason": error or "Triton one-pass kernel"}
