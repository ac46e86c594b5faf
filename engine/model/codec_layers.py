"""Building blocks of the 12 Hz codec decoder (see codec.py for the decoder itself).

Every layer runs in two modes with the same weights:
- whole mode (`io is None`): the input is a complete sequence starting at frame 0; causal convolutions pad on the
  left with zeros, as the official decoder does;
- streaming mode (`io` is a `TailIO`): the input holds only new samples of each stream; every causal (transposed)
  convolution reads the input history it needs from `io` and writes the updated history back.

Module and parameter names mirror the official `Qwen3TTSTokenizerV2Decoder`, so its state dict loads as is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels.snake import snake


def fingerprint(tensors) -> tuple:
    """Identity of tensors' current contents: changes when one is written in place, replaced, moved or cast.
    (Tensors made under torch.inference_mode keep no version counter: for those, in-place writes are not seen.)"""
    return tuple((t.data_ptr(), None if t.is_inference() else t._version, t.dtype, t.device) for t in tensors)


class Prepared(nn.Module):
    """A module with inference constants derived from its parameters, made by `prepare_inference()` (once at load)
    and remade if those parameters change afterwards (loading weights, `.to(dtype)`): `is_prepared()` compares a
    fingerprint of the sources, so stale constants are never used. Subclasses list `prepared_from()`."""

    _prepared_key: tuple | None = None

    def prepared_from(self) -> list[Tensor]:
        raise NotImplementedError

    def _prepare(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def prepare_inference(self) -> None:
        self._prepare()
        self._prepared_key = fingerprint(self.prepared_from())

    def is_prepared(self) -> bool:
        return self._prepared_key == fingerprint(self.prepared_from())


class TailIO:
    """Per-call carrier of convolution histories: `tails[i]` ([B, C_i, H_i], a view into the gathered stream state)
    holds the history of conv `i` on entry; the conv overwrites it with its updated history (the last H_i samples
    of [history, new input]) after reading it."""

    def __init__(self, tails: list[Tensor]):
        self.tails = tails


def _window(x: Tensor, history: int, io: TailIO | None, tail_id: int, act: Callable | None) -> Tensor:
    """x [B, C, T] -> [B, C, history + T]: the `history` input samples before x (zeros in whole mode, the stream's
    tail otherwise), then act(x) written in place (no `cat`, no separate activation output). In streaming mode the
    last `history` samples become the new tail."""
    B, C, T = x.shape
    win = x.new_empty(B, C, history + T)
    if io is None:
        win[..., :history].zero_()
    else:
        win[..., :history].copy_(io.tails[tail_id])
    if act is None:
        win[..., history:].copy_(x)
    else:
        act(x, out=win[..., history:])
    if io is not None:
        io.tails[tail_id].copy_(win[..., T:])
    return win


class CausalConv1d(nn.Module):
    """Stride-1 conv that sees only the present and the past: (k-1)*dilation samples of left context."""

    def __init__(self, cin: int, cout: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size, dilation=dilation, groups=groups)
        self.history = (kernel_size - 1) * dilation  # input samples of left context
        self.tail_id = -1  # index into the stream state's tails; set by the decoder when history > 0

    def forward(self, x: Tensor, io: TailIO | None = None, act: Callable | None = None) -> Tensor:
        """conv(act(x)) (act: an elementwise module taking `out=`, applied on the way into the window):
        x [B, C, T] -> [B, C', T]."""
        if self.history == 0:
            return self.conv(x if act is None else act(x))
        return self.conv(_window(x, self.history, io, self.tail_id, act))


class CausalConvTranspose1d(nn.Module):
    """Transposed conv (kernel k >= stride s) with the k - s trailing samples dropped, so T inputs give T*s
    outputs and output j depends on inputs <= j // s. Streaming keeps ceil(k/s) - 1 past input samples."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int):
        super().__init__()
        if kernel_size < stride:
            raise ValueError("kernel_size must be >= stride")
        self.conv = nn.ConvTranspose1d(cin, cout, kernel_size, stride=stride)
        self.stride = stride
        self.history = -(-kernel_size // stride) - 1  # past inputs that still reach the new outputs
        self.tail_id = -1

    def forward(self, x: Tensor, io: TailIO | None = None, act: Callable | None = None) -> Tensor:
        """conv(act(x)) with the causal cut: x [B, C, T] -> [B, C', T*s]."""
        n_out = x.shape[-1] * self.stride
        if io is None or self.history == 0:
            return self.conv(x if act is None else act(x))[..., :n_out]
        h = self.history
        y = self.conv(_window(x, h, io, self.tail_id, act))  # [B, C', (h+T-1)*s + k]; the first h*s: past frames
        return y[..., h * self.stride: h * self.stride + n_out]


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


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # [B, C, T]
        y = self.conv1(x, io, act=self.act1)
        y = self.conv2(y, io, act=self.act2)
        return y.add_(x)


class DecoderBlock(nn.Module):
    """SnakeBeta, causal transposed conv (x rate, channels halved), three residual units (dilation 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        )

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # [B, C, T] -> [B, C/2, T*rate]
        act, up, *units = self.block
        x = up(x, io, act=act)
        for unit in units:
            x = unit(x, io)
        return x


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # [B, C, T]
        y = self.dwconv(x, io).transpose(1, 2)  # [B, T, C]
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return torch.addcmul(x, self.gamma[:, None], y.transpose(1, 2))


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
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """residual + scale * x in one pass."""
        return torch.addcmul(residual, self.scale, x)


def _rotate_half_rows(w: Tensor, heads: int) -> Tensor:
    """Rows of a projection [heads * hd, ...] permuted and negated per head so that it computes rotate_half of
    the original projection's output (rotate_half(y) = [-y2, y1] for y = [y1, y2] per head)."""
    w = w.view(heads, w.shape[0] // heads, *w.shape[1:])
    half = w.shape[1] // 2
    return torch.cat([-w[:, half:], w[:, :half]], dim=1).reshape(-1, *w.shape[2:])


class Attention(Prepared):
    """Self-attention with RoPE. At inference one GEMM computes q, k, their rotate_half images and v (weights
    stacked by prepare_inference), RoPE is one multiply and one addcmul, and attention is one SDPA call."""

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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """x [B, t, D]; cos/sin [B|1, t, hd] (activation dtype); mask [B|1, 1, t, P+t] bool (True = attend);
        past [B, 2, Hkv, P, hd] post-RoPE keys and values of the P frames before x. Returns (out [B, t, D],
        (k, v) [B, Hkv, P+t, hd] each, or None when past is None)."""
        B, t, _ = x.shape
        H, Hkv, hd = self.heads, self.kv_heads, self.head_dim
        n_qk = (H + Hkv) * hd
        proj = F.linear(x, self.qkv_weight, self.qkv_bias)  # [B, t, 2 * n_qk + Hkv * hd]
        qk = proj[..., :n_qk].view(B, t, H + Hkv, hd)
        qk_rot = proj[..., n_qk: 2 * n_qk].view(B, t, H + Hkv, hd)
        qk = torch.addcmul(qk * cos[:, :, None], qk_rot, sin[:, :, None])  # RoPE: q*cos + rotate_half(q)*sin
        q = qk[:, :, :H].transpose(1, 2)  # [B, H, t, hd]
        k = qk[:, :, H:].transpose(1, 2)  # [B, Hkv, t, hd]
        v = proj[..., 2 * n_qk:].view(B, t, Hkv, hd).transpose(1, 2)
        kv = None
        if past is not None:
            k = torch.cat([past[:, 0], k], dim=2)  # [B, Hkv, P+t, hd]
            v = torch.cat([past[:, 1], v], dim=2)
            kv = (k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=H != Hkv)
        return self.o_proj(out.transpose(1, 2).reshape(B, t, H * hd)), kv


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
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
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

    def forward(self, x, cos, sin, mask, past=None):  # x [B, t, D]; see Attention.forward
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = self.self_attn_layer_scale.add_to(x, a)
        x = self.mlp_layer_scale.add_to(x, self.mlp(self.post_attention_layernorm(x)))
        return x, kv


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
        self._window_masks: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def _stream_mask(self, pos: Tensor, t: int) -> Tensor:
        """[B, 1, t, W-1+t] bool for queries at pos .. pos+t-1 over keys at pos-W+1 .. pos+t-1. The window part
        depends on t only and is made once per (t, device); only `key position >= 0` is per call."""
        key = (t, pos.device)
        if key not in self._window_masks:
            offs = torch.arange(t, device=pos.device)  # query offsets
            rel = torch.cat([torch.arange(1 - self.window, 0, device=pos.device), offs])  # key offsets [W-1+t]
            dist = offs[:, None] - rel[None, :]  # [t, W-1+t]
            self._window_masks[key] = ((dist >= 0) & (dist < self.window), rel)
        window, rel = self._window_masks[key]
        return (window & (pos[:, None, None] + rel >= 0))[:, None]

    def forward(self, x: Tensor, pos: Tensor | None = None, kv: Tensor | None = None) -> Tensor:
        """x [B, t, latent] -> y [B, t, latent]. Whole mode: pos and kv None, frames are at positions 0..t-1.
        Streaming: pos [B] int64 = position of x's first frame per row; kv [B, L, 2, Hkv, W-1, hd] holds the keys
        and values of positions pos-W+1 .. pos-1 (entries at negative positions are masked out) and is updated in
        place to those of pos+t-W+1 .. pos+t-1."""
        t = x.shape[1]
        if pos is None:
            qpos = torch.arange(t, device=x.device)[None]  # [1, t]
            dist = qpos[0, :, None] - qpos[0, None, :]
            mask = ((dist >= 0) & (dist < self.window))[None, None]  # [1, 1, t, t]
        else:
            qpos = pos[:, None] + torch.arange(t, device=x.device)  # [B, t]
            mask = self._stream_mask(pos, t)
        h = self.input_proj(x)  # [B, t, D]
        cos, sin = self.rotary_emb(qpos, h.dtype)
        keep = self.window - 1
        for i, layer in enumerate(self.layers):
            h, new_kv = layer(h, cos, sin, mask, None if kv is None else kv[:, i])
            if kv is not None:
                for j, full in enumerate(new_kv):  # [B, Hkv, W-1+t, hd]: keep the last W-1
                    kv[:, i, j].copy_(full[:, :, full.shape[2] - keep:])
        return self.output_proj(self.norm(h))
