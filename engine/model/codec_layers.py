"""Building blocks of the 12 Hz codec decoder (see codec.py for the decoder itself).

Every layer runs in two modes with the same weights:
- whole mode (`io is None`): the input is a complete sequence starting at frame 0; causal convolutions pad on the
  left with zeros, as the official decoder does;
- streaming mode (`io` is a `TailIO`): the input holds only new samples of each stream; every causal (transposed)
  convolution reads the input history it needs from `io` and writes the updated history back.

Module and parameter names mirror the official `Qwen3TTSTokenizerV2Decoder`, so its state dict loads as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TailIO:
    """Per-call carrier of convolution histories: `inp[i]` is the gathered history of conv `i` ([B, C_i, H_i]),
    `out[i]` receives its updated history (the last H_i samples of [history, new input])."""

    def __init__(self, inp: list[Tensor]):
        self.inp = inp
        self.out: list[Tensor | None] = [None] * len(inp)


class CausalConv1d(nn.Module):
    """Stride-1 conv that sees only the present and the past: (k-1)*dilation samples of left context."""

    def __init__(self, cin: int, cout: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size, dilation=dilation, groups=groups)
        self.history = (kernel_size - 1) * dilation  # input samples of left context
        self.tail_id = -1  # index into the stream state's tails; set by the decoder when history > 0

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # x [B, C, T] -> [B, C', T]
        if self.history == 0:
            return self.conv(x)
        if io is None:
            return self.conv(F.pad(x, (self.history, 0)))
        buf = torch.cat([io.inp[self.tail_id], x], dim=-1)  # [B, C, H + T]
        io.out[self.tail_id] = buf[..., buf.shape[-1] - self.history:]
        return self.conv(buf)


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

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # x [B, C, T] -> [B, C', T*s]
        n_out = x.shape[-1] * self.stride
        if io is None or self.history == 0:
            return self.conv(x)[..., :n_out]
        h = self.history
        buf = torch.cat([io.inp[self.tail_id], x], dim=-1)  # [B, C, h + T]
        io.out[self.tail_id] = buf[..., buf.shape[-1] - h:]
        y = self.conv(buf)  # [B, C', (h + T - 1) * s + k]; the first h*s outputs belong to past frames
        return y[..., h * self.stride: h * self.stride + n_out]


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel (alpha, beta are stored as logs)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # [B, C, T]
        freq = torch.exp(self.alpha)[None, :, None]  # [1, C, 1]
        inv_mag = 1.0 / (torch.exp(self.beta)[None, :, None] + 1e-9)
        return x + inv_mag * torch.sin(x * freq).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # [B, C, T]
        y = self.conv1(self.act1(x), io)
        y = self.conv2(self.act2(y), io)
        return x + y


class DecoderBlock(nn.Module):
    """SnakeBeta, causal transposed conv (x rate, channels halved), three residual units (dilation 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        )

    def forward(self, x: Tensor, io: TailIO | None = None) -> Tensor:  # [B, C, T] -> [B, C/2, T*rate]
        for layer in self.block:
            x = layer(x, io)
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
        return x + (self.gamma * y).transpose(1, 2)


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


class SplitRVQ(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) decoded by separate groups, results added."""

    def __init__(self, n_q: int, dim: int, size: int, io_dim: int):
        super().__init__()
        self.rvq_first = RVQGroup(1, dim, size, io_dim)
        self.rvq_rest = RVQGroup(n_q - 1, dim, size, io_dim)

    def decode(self, codes: Tensor) -> Tensor:  # codes [B, n_q, T] -> [B, io_dim, T]
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# --------------------------------------------------------------------------------------- transformer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., D]; normalize in fp32, cast back, then scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, t, D]; cos/sin [B|1, t, hd] (activation dtype); mask [B|1, 1, t, P+t] bool (True = attend);
        past: (k, v) [B, Hkv, P, hd] post-RoPE. Returns (out [B, t, D], k_all, v_all [B, Hkv, P+t, hd])."""
        B, t, _ = x.shape
        q = self.q_proj(x).view(B, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, t, hd]
        k = self.k_proj(x).view(B, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, t, hd]
        v = self.v_proj(x).view(B, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [B|1, 1, t, hd]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # [B, Hkv, P+t, hd]
            v = torch.cat([past[1], v], dim=2)
        rep = self.heads // self.kv_heads
        kr = k.repeat_interleave(rep, dim=1) if rep > 1 else k  # [B, H, P+t, hd]
        vr = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        scores = torch.matmul(q, kr.transpose(-1, -2)) * self.scaling  # [B, H, t, P+t]
        probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
        out = torch.matmul(probs, vr).transpose(1, 2).reshape(B, t, -1)  # [B, t, H*hd]
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, x, cos, sin, mask, past=None):  # x [B, t, D]
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + self.self_attn_layer_scale(a)
        x = x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))
        return x, k, v


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

    def forward(self, x: Tensor, pos: Tensor | None = None,
                kv: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """x [B, t, latent]. Whole mode: pos and kv None, frames are at positions 0..t-1.
        Streaming: pos [B] int64 = position of x's first frame per row; kv = (k, v) [B, L, Hkv, W-1, hd] holding
        the keys/values of positions pos-W+1 .. pos-1 (entries at negative positions are masked out).
        Returns (y [B, t, latent], updated (k, v) of the same shape, or None in whole mode)."""
        t = x.shape[1]
        offs = torch.arange(t, device=x.device)  # [t]
        if pos is None:
            qpos = offs[None]  # [1, t]
            kpos = qpos
        else:
            qpos = pos[:, None] + offs  # [B, t]
            past = torch.arange(1 - self.window, 0, device=x.device)  # [W-1]: -(W-1) .. -1
            kpos = torch.cat([pos[:, None] + past, qpos], dim=1)  # [B, W-1+t]
        dist = qpos[:, :, None] - kpos[:, None, :]  # [B|1, t, P+t]
        mask = ((dist >= 0) & (dist < self.window) & (kpos[:, None, :] >= 0))[:, None]  # [B|1, 1, t, P+t]
        h = self.input_proj(x)  # [B, t, D]
        cos, sin = self.rotary_emb(qpos, h.dtype)
        new_k, new_v = [], []
        keep = self.window - 1
        for i, layer in enumerate(self.layers):
            past_kv = None if kv is None else (kv[0][:, i], kv[1][:, i])
            h, k, v = layer(h, cos, sin, mask, past_kv)
            if kv is not None:
                new_k.append(k[:, :, k.shape[2] - keep:])  # [B, Hkv, W-1, hd]
                new_v.append(v[:, :, v.shape[2] - keep:])
        y = self.output_proj(self.norm(h))
        if kv is None:
            return y, None
        return y, (torch.stack(new_k, dim=1), torch.stack(new_v, dim=1))
