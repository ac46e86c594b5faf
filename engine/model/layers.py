"""Building blocks shared by the Talker and the Code Predictor: Qwen3-style pre-norm decoder layers.

Numerics follow the official package so random-weight parity holds in fp32 and bf16: RMSNorm normalises in
fp32 and casts back before the weight multiply; q/k get a per-head RMSNorm before RoPE; RoPE cos/sin are
computed in fp32 and rounded to the activation dtype; softmax runs in fp32.

At load time `prepare_inference()` (engine.model.checkpoint calls it on every module that has one) fuses each
layer's q/k/v weights into one matrix and gate/up into another: one GEMM instead of three or two. The separate
Linear weights become views into the fused matrix, so the checkpoint names, the state_dict and later weight
loads stay exactly as they were.

Where `engine.kernels.use_triton` says so (CUDA by default), the same arithmetic runs in fused Triton kernels:
residual add + RMSNorm, SwiGLU, q/k-norm + RoPE + cache write, and attention read in place from the cache
(engine/kernels/); the PyTorch code below stays the reference and the CPU path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import kernels
from engine.model.attention_ops import apply_rope, attention
from engine.model.config import DecoderStackConfig

log = logging.getLogger("voicelane.layers")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # rms_norm upcasts half-precision input to fp32 and rounds its result back: the official arithmetic
        # (normalise in fp32, cast, then the weight multiply) in one op and without two dtype copies.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


_INV_FREQ: dict[tuple[int, float, str], Tensor] = {}


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """[head_dim / 2] fp32, computed once per device: `theta ** tensor` copies theta from the host, which a CUDA
    graph capture forbids, so captured steps must find it made already (their warm-up run makes it)."""
    key = (head_dim, theta, str(device))
    if key not in _INV_FREQ:
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        _INV_FREQ[key] = 1.0 / (theta**exponent)
    return _INV_FREQ[key]


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables for NeoX-style RoPE at the given positions: [...] -> [..., head_dim] each."""
    inv_freq = _inv_freq(head_dim, theta, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [..., head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def signed_sin(sin: Tensor) -> Tensor:
    """sin [..., D] -> [-sin[:D/2], sin[D/2:]]: folds rotate-half's negation into the table, once per forward."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def dense(x: Tensor, weight: Tensor, swiglu: bool = False) -> Tensor:
    """x [..., in] @ weight [out, in]^T (x = [gate | up] of width 2 * in with swiglu: silu(gate) * up first).
    The Triton path runs engine.kernels.linear, which picks the measured-faster of its skinny decode kernel and
    cuBLAS per shape; the PyTorch path runs F.linear."""
    if kernels.use_triton(x.device):
        from engine.kernels.linear import linear

        return linear(x, weight, swiglu)
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return F.linear(x, weight)


class FusedRows:
    """The weights of several bias-free nn.Linear over one input (or of several nn.Embedding tables), stacked by
    row into one matrix; each module's weight becomes a view of its rows. `weight` [sum of rows, columns]."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.sizes = [lin.weight.shape[0] for lin in linears]
        self._fuse()

    def _fuse(self) -> None:
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in self.linears])
            for lin, part in zip(self.linears, self.weight.split(self.sizes), strict=True):
                lin.weight = nn.Parameter(part, requires_grad=lin.weight.requires_grad)

    def adopt(self, storage: Tensor) -> None:
        """Move the fused matrix into `storage` (same shape; e.g. one layer's slice of a tensor stacking every
        layer's, engine.kernels.cp_forward) and make each Linear's weight a view of it there."""
        with torch.no_grad():
            storage.copy_(self.current())
            self.weight = storage
            for lin, part in zip(self.linears, storage.split(self.sizes), strict=True):
                lin.weight = nn.Parameter(part, requires_grad=lin.weight.requires_grad)

    def intact(self) -> bool:
        """False once a Linear's weight no longer lives in the fused matrix (after a .to() or a new Parameter)."""
        start, row_bytes = self.weight.data_ptr(), self.weight.stride(0) * self.weight.element_size()
        for lin, rows in zip(self.linears, self.sizes, strict=True):
            if lin.weight.data_ptr() != start:
                return False
            start += rows * row_bytes
        return True

    def current(self) -> Tensor:
        """The fused matrix, fused again first if a module's weight was replaced since (a stale one would
        silently compute with old weights). Inside a compiled part (engine.kernels.compiled) it is skipped: dynamo
        cannot trace a pointer comparison, so weights replaced after loading need prepare_inference() again."""
        if not torch.compiler.is_compiling() and not self.intact():
            log.warning("fused weights were replaced after prepare_inference(); fusing them again")
            self._fuse()
        return self.weight

    def project(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., sum of out_features]: every Linear's output side by side, from one GEMM."""
        return dense(x, self.current())

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """x [..., in] -> one output per Linear, views of the single GEMM's result."""
        return self.project(x).split(self.sizes, dim=-1)


def fused_or_separate(fused: FusedRows | None, linears: tuple[nn.Linear, ...], x: Tensor) -> tuple[Tensor, ...]:
    """One GEMM once prepare_inference() ran; the separate Linears before (a module used for training or tests)."""
    return fused(x) if fused is not None else tuple(lin(x) for lin in linears)


def side_by_side(fused: FusedRows | None, linears: tuple[nn.Linear, ...], x: Tensor) -> Tensor:
    """Like fused_or_separate, the outputs concatenated on the last dimension (what the fused kernels read)."""
    return fused.project(x) if fused is not None else torch.cat([lin(x) for lin in linears], dim=-1)


@dataclass
class KVCache:
    """Keys and values of every layer for a set of cache rows ("slots"), preallocated at a fixed length."""

    k: Tensor  # [layers, slots, kv_heads, max_len, head_dim]
    v: Tensor  # [layers, slots, kv_heads, max_len, head_dim]

    @classmethod
    def allocate(cls, cfg: DecoderStackConfig, slots: int, max_len: int, device, dtype) -> KVCache:
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class AttentionBatch:
    """What one forward of a decoder stack attends to and where it writes its keys and values."""

    slots: Tensor  # [B] int64, cache rows of the batch rows
    positions: Tensor  # [B, T] int64, absolute position of each new token (RoPE angle and cache column)
    # [B, 1, T, S] bool, True where a new token may NOT attend cache column s < S; None where attention reads the
    # cache in place by position (a compiled Talker step: engine.model.talker.decode_step)
    blocked: Tensor | None
    cos: Tensor  # [B, T, head_dim], activation dtype
    sin_signed: Tensor  # [B, T, head_dim], signed_sin of the sine table
    valid_len: Tensor | None = None  # [B] int64: columns a row wrote (right-padded prefill), None: all of them

    @classmethod
    def build(cls, cfg: DecoderStackConfig, slots: Tensor, positions: Tensor, kv_len: int, dtype,
              valid_len: Tensor | None = None) -> AttentionBatch:
        """Causal attention over cache columns [0, kv_len). valid_len [B] (optional) hides columns a row never
        wrote (right padding of a batched prefill)."""
        cols = torch.arange(kv_len, device=positions.device)
        mask = cols[None, None, :] <= positions[:, :, None]  # [B, T, S]
        if valid_len is not None:
            mask = mask & (cols[None, None, :] < valid_len[:, None, None])
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
        return cls(slots=slots, positions=positions, blocked=~mask[:, None], cos=cos, sin_signed=signed_sin(sin),
                   valid_len=valid_len)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv: FusedRows | None = None

    def prepare_inference(self) -> None:
        self.qkv = FusedRows(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, hidden] -> q [B, T, H * D], k and v [B, T, Hkv * D] (views of one GEMM once prepared)."""
        return fused_or_separate(self.qkv, (self.q_proj, self.k_proj, self.v_proj), x)

    def forward(self, x: Tensor, batch: AttentionBatch, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """x [B, T, hidden]; k_cache, v_cache [slots, kv_heads, max_len, head_dim] of this layer."""
        return self.attend(*self.project(x), batch, k_cache, v_cache)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, batch: AttentionBatch, k_cache: Tensor,
               v_cache: Tensor) -> Tensor:
        """From the projections (q [B, T, H * D], k and v [B, T, Hkv * D]) on: q/k-norm, RoPE, the cache write,
        attention and the o projection -> [B, T, hidden]."""
        B, T, _ = q.shape
        triton = kernels.use_triton(q.device)
        if triton or kernels.compiled_attention(q.device):
            args = (q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, batch.cos, batch.sin_signed,
                    k_cache, v_cache, batch.slots, batch.positions, batch.valid_len, self.num_heads)
            if triton:
                from engine.kernels.attention import layer_attention

                out = layer_attention(*args)
            else:  # inside a compiled part: the same kernels, one opaque op that inductor schedules around
                from engine.kernels.compiled import attention_op

                out = attention_op(*args)
            return dense(out.view(B, T, -1), self.o_proj.weight)  # [B, T, H, D] -> [B, T, H * D]
        q = self.q_norm(q.view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, batch.cos, batch.sin_signed), apply_rope(k, batch.cos, batch.sin_signed)  # [B,H,T,D]

        rows = batch.slots[:, None]  # [B, 1] broadcast against positions [B, T]
        k_cache[rows, :, batch.positions] = k.transpose(1, 2)
        v_cache[rows, :, batch.positions] = v.transpose(1, 2)
        S = batch.blocked.shape[-1]
        keys = k_cache[batch.slots, :, :S]  # [B, kv_heads, S, D]
        values = v_cache[batch.slots, :, :S]
        out = attention(q, keys, values, batch.blocked)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: FusedRows | None = None

    def prepare_inference(self) -> None:
        self.gate_up = FusedRows(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor) -> Tensor:
        if kernels.use_triton(x.device):  # SwiGLU inside the down projection's kernel (or its own kernel first)
            return dense(side_by_side(self.gate_up, (self.gate_proj, self.up_proj), x), self.down_proj.weight,
                         swiglu=True)
        gate, up = fused_or_separate(self.gate_up, (self.gate_proj, self.up_proj), x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, batch: AttentionBatch, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Layers plus the final norm. Subclasses add their embeddings under the checkpoint's names."""

    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def run(self, x: Tensor, batch: AttentionBatch, cache: KVCache) -> Tensor:
        """x [B, T, hidden] -> final-norm hidden states [B, T, hidden]."""
        if kernels.use_triton(x.device):
            if kernels.folded_norms(x.device) and self._fused():
                return self._run_folded_norms(x, batch, cache)
            return self._run_fused_norms(x, batch, cache)
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, cache.k[i], cache.v[i])
        return self.norm(x)

    def _run_fused_norms(self, x: Tensor, batch: AttentionBatch, cache: KVCache) -> Tensor:
        """run() with each residual add folded into the RMSNorm after it (the final norm included): the same
        sums and norms as DecoderLayer.forward, in one kernel each."""
        from engine.kernels.norm import add_rms_norm

        eps = self.norm.eps
        residual, h = add_rms_norm(x, None, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn(h, batch, cache.k[i], cache.v[i])
            residual, h = add_rms_norm(attn, residual, layer.post_attention_layernorm.weight, eps)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            residual, h = add_rms_norm(layer.mlp(h), residual, after.weight, eps)
        return h

    def _fused(self) -> bool:
        return all(layer.self_attn.qkv is not None and layer.mlp.gate_up is not None for layer in self.layers)

    def _run_folded_norms(self, x: Tensor, batch: AttentionBatch, cache: KVCache) -> Tensor:
        """_run_fused_norms with each layer's two RMSNorms (and the residual adds before them) inside the q/k/v
        and gate/up projections' launches (engine.kernels.linear.norm_linear): 2 kernels a layer fewer, the same
        arithmetic. The final norm stays a kernel of its own (the head after it is the caller's)."""
        from engine.kernels.linear import norm_linear
        from engine.kernels.norm import add_rms_norm

        eps = self.norm.eps
        residual, delta = None, x  # the first layer's norm is of x itself
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            residual, qkv = norm_linear(delta, residual, layer.input_layernorm.weight, eps, attn.qkv.current())
            delta = attn.attend(*qkv.split(attn.qkv.sizes, dim=-1), batch, cache.k[i], cache.v[i])
            residual, gate_up = norm_linear(delta, residual, layer.post_attention_layernorm.weight, eps,
                                            mlp.gate_up.current())
            delta = dense(gate_up, mlp.down_proj.weight, swiglu=True)
        return add_rms_norm(delta, residual, self.norm.weight, eps)[1]
