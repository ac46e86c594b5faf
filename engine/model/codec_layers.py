"""Building blocks of the 12 Hz codec decoder (see codec.py for the decoder itself).

Every layer runs in two modes with the same weights:
- whole mode (`io is None`): the input is a complete sequence starting at frame 0; causal convolutions pad on the
  left with zeros, as the official decoder does;
- streaming mode (`io` is a `TailIO`): the input holds only new samples of each stream; every causal (transposed)
  convolution reads the input history it needs from `io` and writes the updated history to it.

Between two convolutions the activations pass through one kernel (engine.kernels.snake.conv_window): it adds the
previous convolution's bias and the residual, applies SnakeBeta and writes the next convolution's input window
(history + new samples) and the new history. So a convolution runs without its bias and returns a `Pre` (output,
bias, residual still to add), and the next window adds them on the way in.

Layouts (`LAYOUTS`, chosen per decoder, VOICELANE_CODEC_LAYOUT): activations [B, C, T] are stored either with time
stride 1 ("contiguous") or with channel stride 1 ("channels_last": a [B, T, C] tensor seen through a transpose).
Convolutions run as 2-D convolutions over a [B, C, 1, T] view with weights in the same memory format, so in
channels_last cuDNN reads and writes NHWC directly instead of transposing around every convolution.

Module and parameter names mirror the official `Qwen3TTSTokenizerV2Decoder`, so its state dict loads as is.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels.codec_transformer import ring_attention, ring_mask, rope_kv, scaled_add_rms_norm
from engine.kernels.snake import conv_window, snake, use_triton

LAYOUTS = ("contiguous", "channels_last")
LAYOUT_ENV = "VOICELANE_CODEC_LAYOUT"
DEFAULT_LAYOUT = "channels_last"  # H200, 2026-12-02: faster at every batch and chunk (docs/PERFORMANCE.md)


def layout_choice(value: str | None = None) -> str:
    """`value`, else $VOICELANE_CODEC_LAYOUT, else DEFAULT_LAYOUT; checked against LAYOUTS."""
    chosen = (os.environ.get(LAYOUT_ENV, "") if value is None else value).strip().lower() or DEFAULT_LAYOUT
    if chosen not in LAYOUTS:
        raise ValueError(f"codec layout {chosen!r} ({LAYOUT_ENV}): choose one of {', '.join(LAYOUTS)}")
    return chosen


def fingerprint(tensors) -> tuple:
    """Identity of tensors' current contents: changes when one is written in place, replaced, moved or cast (a
    moved or replaced tensor has new storage, so its address names its device too). Tensors made under
    torch.inference_mode keep no version counter: for those, in-place writes are not seen. On a newcomer's path to
    first audio (the prefix cache's check, 315 tensors for the 1.7B): the common case, no inference tensor, in one
    pass of three attributes."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    try:
        return tuple((t.data_ptr(), t._version, t.dtype) for t in tensors)
    except RuntimeError:  # an inference tensor: it has no _version
        return tuple((t.data_ptr(), None if t.is_inference() else t._version, t.dtype) for t in tensors)


class Prepared(nn.Module):
    """A module with inference constants derived from its parameters, made by `prepare_inference()` (once at load)
    and remade if those parameters change afterwards (loading weights, `.to(dtype)`) or the module's
    `prepared_token()` (a setting the constants depend on) changes: `is_prepared()` compares a fingerprint of the
    sources, so stale constants are never used. Subclasses list `prepared_from()`."""

    _prepared_key: tuple | None = None

    def prepared_from(self) -> list[Tensor]:
        raise NotImplementedError

    def prepared_token(self) -> object:
        return None

    def _prepare(self) -> None:
        raise NotImplementedError

    def _key(self) -> tuple:
        return fingerprint(self.prepared_from()), self.prepared_token()

    @torch.no_grad()
    def prepare_inference(self) -> None:
        self._prepare()
        self._prepared_key = self._key()

    def is_prepared(self) -> bool:
        return self._prepared_key == self._key()


class TailIO:
    """Per-call carrier of convolution histories, read and written where the stream state keeps them: `tails[i]`
    ([S, C_i, H_i], a view of the state's first tails buffer) is conv `i`'s history for every slot; batch row b
    reads its history at element offset `read_at[b]` from that view's row 0 and writes its updated one (the last
    H_i samples of [history, new input]) at `write_at[b]`, which must not overlap what any row reads.

    valid [B] int64 (or None: every frame): how many of the call's `frames` frames are real in each row; the rest
    is padding, and each new history ends at the row's last real sample (causal layers never let the padding
    reach a real output)."""

    def __init__(self, tails: list[Tensor], read_at: Tensor, write_at: Tensor, valid: Tensor | None = None,
                 frames: int = 1):
        self.tails, self.read_at, self.write_at = tails, read_at, write_at
        self.valid, self.frames = valid, frames


class Pre(NamedTuple):
    """y + bias[c] + res, not added yet: a convolution's output whose bias (and a residual) the next kernel adds."""

    y: Tensor  # [B, C, T]
    bias: Tensor | None = None  # [C]
    res: Tensor | None = None  # [B, C, T]


def new_activation(like: Tensor, B: int, C: int, T: int, channels_last: bool) -> Tensor:
    """Uninitialised [B, C, T] in like's dtype and device: time stride 1, or channel stride 1 (channels_last)."""
    if channels_last:
        return like.new_empty(B, T, C).transpose(1, 2)
    return like.new_empty(B, C, T)


def run_window(x: Tensor | Pre, history: int, act: SnakeBeta | None = None, *, io: TailIO | None = None,
               tail_id: int = -1, channels_last: bool = False, keep_input: bool = False,
               clamp: bool = False) -> tuple[Tensor, Tensor | None]:
    """x [B, C, T] (or a Pre, summed here) -> (window [B, C, history + T], x summed or None): the `history` samples
    before x (zeros in whole mode, the stream's tail otherwise), then act(x) (clamped to [-1, 1] if asked), in one
    kernel. In streaming mode the window's last `history` samples are written to each row's io.write_at.
    keep_input: also return x itself (stored by the same kernel when it is a Pre), e.g. as a residual."""
    y, bias, res = x if isinstance(x, Pre) else (x, None, None)
    summed = bias is None and res is None
    if history == 0 and act is None and summed and not clamp:
        return y, (y if keep_input else None)  # nothing to add or apply: the convolution reads x as it is
    B, C, T = y.shape
    win = new_activation(y, B, C, history + T, channels_last)
    kept = None
    if keep_input:
        kept = y if summed else new_activation(y, B, C, T, channels_last)
    stream = io is not None and history > 0
    per_row = {}
    if stream and io.valid is not None:  # T = frames * samples per frame here
        per_row = {"tail_valid": io.valid, "tail_factor": T // io.frames}
    conv_window(y, win, bias=bias, res=res, freq=None if act is None else act.freq,
                inv_mag=None if act is None else act.inv_mag, x_out=None if kept is y else kept,
                clamp=clamp, **per_row, **(_tails(io, tail_id) if stream else {}))
    return win, kept


def _tails(io: TailIO, tail_id: int) -> dict:
    tail = io.tails[tail_id]
    return {"tail_in": tail, "tail_out": tail, "tail_in_at": io.read_at, "tail_out_at": io.write_at}


class CausalConvBase(Prepared):
    """A causal (transposed) convolution: its input window, its layout and its weights as 4-D [.., .., 1, k].

    `defer_bias`: return Pre(output, bias) and let the next window add the bias (True), or add it in the
    convolution (False, for outputs that PyTorch ops read next)."""

    def __init__(self, conv: nn.Module, history: int, defer_bias: bool):
        super().__init__()
        self.conv = conv
        self.history = history  # input samples of left context
        self.tail_id = -1  # index into the stream state's tails; set by the decoder when history > 0
        self.defer_bias = defer_bias
        self.channels_last = False  # set by the decoder's layout
        self.weight4: Tensor | None = None  # [.., .., 1, k] in the layout's memory format
        self.prepared_bias: Tensor | None = None  # the conv's bias, detached (Pre carries it: no autograd leaf)

    def prepared_from(self) -> list[Tensor]:
        return [p for p in (self.conv.weight, self.conv.bias) if p is not None]

    def prepared_token(self) -> object:
        return self.channels_last

    def _prepare(self) -> None:
        w = self.conv.weight.detach().unsqueeze(2)
        self.weight4 = w.contiguous(memory_format=torch.channels_last) if self.channels_last else w
        self.prepared_bias = None if self.conv.bias is None else self.conv.bias.detach()

    def _conv4d(self, x4: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor | Pre, io: TailIO | None = None, act: SnakeBeta | None = None,
                keep_input: bool = False):
        """conv(act(x)): x [B, C, T] (or a Pre) -> out [B, C', T'] (a Pre when defer_bias); with keep_input,
        (out, x summed)."""
        if self.weight4 is None:
            self.prepare_inference()  # the decoder keeps it fresh (CodecDecoder._ensure_prepared)
        win, kept = run_window(x, self.history, act, io=io, tail_id=self.tail_id, channels_last=self.channels_last,
                               keep_input=keep_input)
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        x4 = win.unsqueeze(2)
        if not x4.is_contiguous(memory_format=memory_format):
            x4 = x4.contiguous(memory_format=memory_format)
        bias = self.prepared_bias
        defer = self.defer_bias and bias is not None
        y = self._conv4d(x4, self.weight4, None if defer else bias).squeeze(2)
        out = Pre(y, bias) if defer else y
        return (out, kept) if keep_input else out


class CausalConv1d(CausalConvBase):
    """Stride-1 conv that sees only the present and the past: (k-1)*dilation samples of left context."""

    def __init__(self, cin: int, cout: int, kernel_size: int, dilation: int = 1, groups: int = 1,
                 defer_bias: bool = True):
        super().__init__(nn.Conv1d(cin, cout, kernel_size, dilation=dilation, groups=groups),
                         (kernel_size - 1) * dilation, defer_bias)

    def _conv4d(self, x4: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.conv2d(x4, weight, bias, dilation=(1, self.conv.dilation[0]), groups=self.conv.groups)


class CausalConvTranspose1d(CausalConvBase):
    """Transposed conv (kernel k >= stride s) with the causal cut: T inputs give T*s outputs and output j depends on
    inputs <= j // s. It reads h = ceil(k/s) - 1 past inputs (zeros in whole mode), and its padding drops exactly
    the h*s outputs of those past frames at the start and the k - s trailing ones at the end (output_padding
    s*ceil(k/s) - k, always < s), so the output is a whole new tensor, not an offset slice of a longer one."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int, defer_bias: bool = True):
        if kernel_size < stride:
            raise ValueError("kernel_size must be >= stride")
        history = -(-kernel_size // stride) - 1  # past inputs that still reach the new outputs
        super().__init__(nn.ConvTranspose1d(cin, cout, kernel_size, stride=stride), history, defer_bias)
        self.stride = stride
        self.padding = history * stride
        self.output_padding = stride * (history + 1) - kernel_size

    def _conv4d(self, x4: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.conv_transpose2d(x4, weight, bias, stride=(1, self.stride), padding=(0, self.padding),
                                  output_padding=(0, self.output_padding))


class SnakeBeta(Prepared):
    """x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel (alpha, beta are stored as logs). The two per-channel
    constants are made once by prepare_inference(), in the parameters' dtype with the official ops (so bf16
    constants are bit-identical to the official module's per-call ones)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.freq: Tensor | None = None  # [C] exp(alpha)
        self.inv_mag: Tensor | None = None  # [C] 1 / (exp(beta) + 1e-9)

    def prepared_from(self) -> list[Tensor]:
        return [self.alpha, self.beta]

    def _prepare(self) -> None:
        self.freq = torch.exp(self.alpha.detach())
        self.inv_mag = 1.0 / (torch.exp(self.beta.detach()) + 1e-9)

    def forward(self, x: Tensor, io: TailIO | None = None, out: Tensor | None = None) -> Tensor:  # [B, C, T]
        return snake(x, self.freq, self.inv_mag, out)


def _plus(out: Tensor | Pre, res: Tensor) -> Pre:
    """out + res, still to add (the next window adds it)."""
    return Pre(out.y, out.bias, res) if isinstance(out, Pre) else Pre(out, None, res)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: Tensor | Pre, io: TailIO | None = None) -> Pre:  # [B, C, T]: x + conv2(conv1(x))
        y, x = self.conv1(x, io, act=self.act1, keep_input=True)
        return _plus(self.conv2(y, io, act=self.act2), x)


class DecoderBlock(nn.Module):
    """SnakeBeta, causal transposed conv (x rate, channels halved), three residual units (dilation 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        )

    def forward(self, x: Tensor | Pre, io: TailIO | None = None) -> Tensor | Pre:  # [B, C, T] -> [B, C/2, T*rate]
        act, up, *units = self.block
        x = up(x, io, act=act)
        for unit in units:
            x = unit(x, io)
        return x


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim, defer_bias=False)  # LayerNorm reads its output
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor | Pre, io: TailIO | None = None) -> Tensor:  # [B, C, T]
        y, x = self.dwconv(x, io, keep_input=True)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y.transpose(1, 2)))))  # [B, T, C]
        out = new_activation(x, *x.shape, self.dwconv.channels_last)
        return torch.addcmul(x, self.gamma[:, None], y.transpose(1, 2), out=out)


class UpsampleStage(nn.ModuleList):
    """[transposed conv (kernel = stride = factor), ConvNeXt block]; a ModuleList so the keys read
    `upsample.<i>.0.conv.weight`, `upsample.<i>.1.gamma` as in the official checkpoint."""

    def __init__(self, dim: int, factor: int):
        super().__init__([CausalConvTranspose1d(dim, dim, factor, factor), ConvNeXtBlock(dim)])

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # [B, C, T] -> [B, C, T*factor]
        for layer in self:
            x = layer(x, io)
        return x


# ----------------------------------------------------------------------------------------- quantizer


class Codebook(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def lookup(self, codes: Tensor) -> Tensor:  # codes [B, T] -> [B, T, dim]
        # Row gather, then the division: bit-identical to dividing the whole table first, at O(B*T) cost.
        usage = F.embedding(codes, self.cluster_usage[:, None]).clamp(min=1e-5)  # [B, T, 1]
        return F.embedding(codes, self.embedding_sum) / usage


class VQLayer(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self._codebook = Codebook(dim, size)


class VQStack(nn.Module):
    def __init__(self, n_q: int, dim: int, size: int):
        super().__init__()
        self.layers = nn.ModuleList([VQLayer(dim, size) for _ in range(n_q)])


class RVQGroup(nn.Module):
    """Sum of n_q codebook vectors (dim = codebook_dim / 2), then a 1x1 conv to codebook_dim. `input_proj` is only
    used by the encoder; it is kept so the checkpoint loads strictly."""

    def __init__(self, n_q: int, dim: int, size: int, io_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = VQStack(n_q, dim, size)

    def decode(self, codes: Tensor) -> Tensor:  # codes [B, n_q, T] -> [B, io_dim, T]
        acc = None
        for i, layer in enumerate(self.vq.layers):
            e = layer._codebook.lookup(codes[:, i])  # [B, T, dim]
            acc = e if acc is None else acc + e
        return self.output_proj(acc.transpose(1, 2))


class SplitRVQ(Prepared):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) decoded by separate groups, results added.

    At inference the whole quantizer is one table lookup: each group's output 1x1 conv is linear and bias-free, so
    W (sum_i e_i) = sum_i (W e_i) and the normalised codebooks can carry their group's projection. `table` stacks
    the n_q projected codebooks ([n_q * size, io_dim], folded in float64, stored in the weights' dtype) and one
    embedding_bag sums a frame's n_q rows. `decode_reference` is the official computation."""

    def __init__(self, n_q: int, dim: int, size: int, io_dim: int):
        super().__init__()
        self.rvq_first = RVQGroup(1, dim, size, io_dim)
        self.rvq_rest = RVQGroup(n_q - 1, dim, size, io_dim)
        self.size = size
        self.table: Tensor | None = None  # [n_q * size, io_dim]
        self.offsets: Tensor | None = None  # [n_q, 1] int64: first row of codebook q in `table`

    def _groups(self):
        for group in (self.rvq_first, self.rvq_rest):
            for layer in group.vq.layers:
                yield group.output_proj.weight, layer._codebook

    def prepared_from(self) -> list[Tensor]:
        return [t for w, cb in self._groups() for t in (w, cb.embedding_sum, cb.cluster_usage)]

    def _prepare(self) -> None:
        parts = []
        for weight, cb in self._groups():
            normalised = cb.embedding_sum.double() / cb.cluster_usage.double().clamp(min=1e-5)[:, None]  # [size, dim]
            parts.append(normalised @ weight[:, :, 0].double().t())  # [size, io_dim]
        self.table = torch.cat(parts).to(self.rvq_first.output_proj.weight.dtype)
        n_q = len(parts)
        self.offsets = torch.arange(n_q, device=self.table.device)[:, None] * self.size

    def decode(self, codes: Tensor) -> Tensor:  # codes [B, n_q, T] in [0, size) -> [B, io_dim, T]
        B, _, T = codes.shape
        rows = (codes + self.offsets).transpose(1, 2).reshape(B * T, -1)  # [B*T, n_q] rows of `table`
        return F.embedding_bag(rows, self.table, mode="sum").view(B, T, -1).transpose(1, 2)

    def decode_reference(self, codes: Tensor) -> Tensor:  # codes [B, n_q, T] -> [B, io_dim, T]
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# --------------------------------------------------------------------------------------- transformer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., D]; normalize in fp32, cast back, then scale
        return scaled_add_rms_norm(x, None, None, self.weight, self.eps)[1]


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x



def _rotate_half_rows(w: Tensor, heads: int) -> Tensor:
    """Rows of a projection [heads * hd, ...] permuted and negated per head so that it computes rotate_half of
    the original projection's output (rotate_half(y) = [-y2, y1] for y = [y1, y2] per head)."""
    w = w.view(heads, w.shape[0] // heads, *w.shape[1:])
    half = w.shape[1] // 2
    return torch.cat([-w[:, half:], w[:, :half]], dim=1).reshape(-1, *w.shape[2:])


class RingRead(NamedTuple):
    """Where a streaming step's attention finds each row's keys and values of its past W-1 frames: this layer's
    ring in the stream state, read in place (see engine.kernels.codec_transformer.ring_attention)."""

    ring: Tensor  # [S, 2, Hkv, W-1, hd]: frame p of slot s at [s, :, :, p mod (W-1)]
    slots: Tensor  # [B] int64: each row's slot
    pos: Tensor  # [B] int64: each row's position (its first new frame)
    window: int  # W


class Attention(Prepared):
    """Self-attention with RoPE. At inference one GEMM computes q, k, their rotate_half images and v (weights
    stacked by prepare_inference), RoPE is one multiply and one addcmul, and attention is one SDPA call (whole
    mode) or one ring_attention call over the stream state's ring and the step's frames (streaming)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.qkv_weight: Tensor | None = None  # [(2 * (H + Hkv) + Hkv) * hd, hidden]: q, k, rot q, rot k, v
        self.qkv_bias: Tensor | None = None

    def prepared_from(self) -> list[Tensor]:
        return [p for m in (self.q_proj, self.k_proj, self.v_proj) for p in m.parameters()]

    def _prepare(self) -> None:
        def stack(get):
            q, k, v = get(self.q_proj), get(self.k_proj), get(self.v_proj)
            return torch.cat([q, k, _rotate_half_rows(q, self.heads), _rotate_half_rows(k, self.kv_heads), v])

        self.qkv_weight = stack(lambda m: m.weight.detach())
        self.qkv_bias = stack(lambda m: m.bias.detach()) if self.q_proj.bias is not None else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, kv: Tensor,
                past: RingRead | None = None) -> Tensor:
        """x [B, t, D]; cos/sin [B|1, t, hd] (activation dtype); kv [B, 2, Hkv, t, hd]: x's post-RoPE keys and
        values are written here (one kernel with RoPE). Whole mode (past None): attention over kv alone, mask
        [1, 1, t, t] additive. Streaming: attention over the rows' past W-1 frames in `past`'s ring, then kv;
        mask [B, 1, t, W-1+t] additive (ring_mask), None on the Triton path. Returns out [B, t, D]."""
        B, t, _ = x.shape
        H, Hkv, hd = self.heads, self.kv_heads, self.head_dim
        proj = F.linear(x, self.qkv_weight, self.qkv_bias)  # [B, t, 2 * (H + Hkv) * hd + Hkv * hd]
        q = rope_kv(proj, cos, sin, kv, 0, H, Hkv, hd)  # [B, H, t, hd]
        if past is None:
            out = F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=mask, scale=self.scaling,
                                                 enable_gqa=H != Hkv).transpose(1, 2)
        else:
            out = ring_attention(q, kv, past.ring, past.slots, past.pos, past.window, self.scaling, mask)
        return self.o_proj(out.reshape(B, t, H * hd))  # out [B, t, H, hd]


class MLP(Prepared):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up_weight: Tensor | None = None  # [2 * inter, hidden]: gate and up in one GEMM

    def prepared_from(self) -> list[Tensor]:
        return [self.gate_proj.weight, self.up_proj.weight]

    def _prepare(self) -> None:
        self.gate_up_weight = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])

    def forward(self, x: Tensor) -> Tensor:
        gate_up = F.linear(x, self.gate_up_weight)
        if use_triton(x.device):
            from engine.kernels.norm import swiglu  # one kernel, silu rounded before the multiply as below

            return self.down_proj(swiglu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class TransformerLayer(nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 eps: float, ls_init: float):
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, bias)
        self.mlp = MLP(hidden, inter)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn_layer_scale = LayerScale(hidden, ls_init)
        self.mlp_layer_scale = LayerScale(hidden, ls_init)

    # No forward: SlidingTransformer runs the layers, each LayerScale residual add fused with the RMSNorm after it.


class RopeFreqs(nn.Module):
    """Holds inv_freq (non-persistent) and keeps it in fp32 whatever dtype the module is cast to."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self._fp32 = 1.0 / (theta**exps)  # [hd/2] fp32, CPU master copy
        inv_freq = torch.empty(self._fp32.shape)  # on the ambient default device (cuda, meta, cpu)
        if inv_freq.device.type != "meta":
            inv_freq.copy_(self._fp32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._fp32.to(self.inv_freq.device)
        return self

    def forward(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """pos [B|1, t] int64 absolute frame positions -> cos, sin [B|1, t, hd] computed in fp32, cast to dtype."""
        freqs = pos.float()[..., None] * self.inv_freq  # [B|1, t, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class SlidingTransformer(nn.Module):
    """input_proj -> N pre-norm layers with causal sliding-window attention -> RMSNorm -> output_proj.
    A query at position p attends to keys at positions p-W+1 .. p (W = sliding_window)."""

    def __init__(self, cfg):
        super().__init__()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList([
            TransformerLayer(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, cfg.attention_bias, cfg.rms_norm_eps,
                             cfg.layer_scale_initial_scale)
            for _ in range(cfg.num_hidden_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RopeFreqs(cfg.head_dim, cfg.rope_theta)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self._mask_values: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}

    def _additive(self, mask: Tensor, dtype: torch.dtype) -> Tensor:
        """bool mask -> 0 / -inf in dtype, once per step (SDPA would convert a bool mask in every layer: two
        kernels each; the values are the same)."""
        key = (dtype, mask.device)
        if key not in self._mask_values:
            self._mask_values[key] = (torch.zeros((), dtype=dtype, device=mask.device),
                                      torch.full((), float("-inf"), dtype=dtype, device=mask.device))
        return torch.where(mask, *self._mask_values[key])

    def forward(self, x: Tensor, pos: Tensor | None = None, ring: Tensor | None = None,
                slots: Tensor | None = None, valid: Tensor | None = None) -> Tensor:
        """x [B, t, latent] -> y [B, t, latent]. Whole mode: pos, ring and slots None, frames at positions 0..t-1.
        Streaming: pos [B] int64 = position of x's first frame per row; ring [S, L, 2, Hkv, W-1, hd]: the stream
        state's keys and values, slot s's frame p at [s, :, :, :, p mod (W-1)], holding (at least) the rows' frames
        pos-W+1 .. pos-1 (columns of negative positions are masked out, whatever they hold); slots [B] int64: the
        rows' slots. The step reads the ring in place and then writes each row's last min(n, W-1) new frames into
        it, n = t, or valid[b] ([B] int64, 1 <= n <= t) for rows whose frames past n are padding (never written:
        the ring columns they would map to may still hold frames inside the window)."""
        t = x.shape[1]
        h = self.input_proj(x)  # [B, t, D]
        if pos is None:
            qpos = torch.arange(t, device=x.device)[None]  # [1, t]
            dist = qpos[0, :, None] - qpos[0, None, :]
            mask = self._additive(((dist >= 0) & (dist < self.window))[None, None], h.dtype)  # [1, 1, t, t]
        else:
            qpos = pos[:, None] + torch.arange(t, device=x.device)  # [B, t]
            # The Triton kernel masks from pos itself; the PyTorch path gets one additive mask for all layers.
            mask = None if use_triton(x.device) else self._additive(ring_mask(pos, t, self.window), h.dtype)
        cos, sin = self.rotary_emb(qpos, h.dtype)
        first = self.layers[0]
        # The step's keys and values of every layer, [L, 2, B, Hkv, t, hd] (so each layer's keys and values are
        # dense tensors), written by RoPE. Streaming reads the past frames from the ring, not from here.
        kv_new = h.new_empty(len(self.layers), 2, h.shape[0], first.self_attn.kv_heads, t, first.self_attn.head_dim)
        norms = [m for layer in self.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        scales = [m.scale for layer in self.layers for m in (layer.self_attn_layer_scale, layer.mlp_layer_scale)]
        res, normed = scaled_add_rms_norm(h, None, None, norms[0].weight, norms[0].eps)
        for i, layer in enumerate(self.layers):
            past = None if pos is None else RingRead(ring[:, i], slots, pos, self.window)
            a = layer.self_attn(normed, cos, sin, mask, kv_new[i].transpose(0, 1), past)
            res, normed = scaled_add_rms_norm(res, scales[2 * i], a, norms[2 * i + 1].weight, norms[2 * i + 1].eps)
            after = norms[2 * i + 2] if 2 * i + 2 < len(norms) else self.norm
            res, normed = scaled_add_rms_norm(res, scales[2 * i + 1], layer.mlp(normed), after.weight, after.eps)
        if pos is not None:  # every layer has read its ring: now the new frames may replace the oldest ones
            self._write_ring(ring, kv_new, slots, pos, valid)
        return self.output_proj(normed)

    def _write_ring(self, ring: Tensor, kv_new: Tensor, slots: Tensor, pos: Tensor, valid: Tensor | None) -> None:
        """Store each row's last m = min(n, W-1) new frames (n = t or valid[b]) of kv_new [L, 2, B, Hkv, t, hd] in
        ring [S, L, 2, Hkv, W-1, hd] at their columns (pos + frame) mod (W-1): one index_put over every layer, m
        columns per row (one frame per row per layer at t = 1). Frames n-m .. n-1 are consecutive, so their
        columns differ; a row with n < m writes its frame n-1 again in place of the m-n missing ones (same
        column, same value: a well-defined duplicate), so no padding frame and no other column is touched."""
        L, _, B, Hkv, t, hd = kv_new.shape
        R = self.window - 1
        m = min(t, R)
        k = torch.arange(m, device=pos.device)
        if valid is None:
            frames = (t - m + k).expand(B, m)
            kept = kv_new[..., t - m:, :]  # [L, 2, B, Hkv, m, hd]
        else:
            frames = valid[:, None] - m + k  # [B, m]
            frames = torch.where(frames >= 0, frames, valid[:, None] - 1)
            kept = kv_new.gather(4, frames.view(1, 1, B, 1, m, 1).expand(L, 2, B, Hkv, m, hd))
        cols = (pos[:, None] + frames).remainder(R)  # [B, m]
        ring.permute(0, 4, 1, 2, 3, 5)[slots[:, None], cols] = kept.permute(2, 4, 0, 1, 3, 5)  # [B, m, L, 2, Hkv, hd]
