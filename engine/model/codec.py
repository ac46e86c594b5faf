"""Qwen3-TTS 12 Hz codec decoder (codes -> 24 kHz wave) with an exact streaming state.

Data flow for codes [B, Q=16, T] (docs/model.md 1.4):
  RVQ lookup (codebook 0 and 1..15 in two groups, each ending in a 1x1 conv) -> [B, codebook_dim, T]
  -> causal pre_conv (k=3) -> [B, latent, T]
  -> sliding-window causal transformer (window W=72 frames incl. the query, RoPE by absolute frame position)
  -> 2x (causal transposed conv x2 + ConvNeXt) -> [B, latent, 4T]
  -> causal conv k=7 -> 4 blocks (SnakeBeta, transposed conv x8/x5/x4/x3, 3 residual units) -> SnakeBeta
  -> causal conv k=7 -> clamp [-1, 1] -> [B, 1, 1920 T]

Every layer is causal, so a stream can be decoded a few frames at a time with a small state per stream
(`CodecStreamState`): the post-RoPE keys/values of the last W-1 frames for each transformer layer (a ring, read
and written in place), the frame position, and the input tail of every causal (transposed) convolution.
`decode_stream` then gives the same samples as `forward` on the whole utterance (to float rounding) for any
chunking, at any length. (The official package's `chunked_decode`, 300-frame chunks with 25 frames of context, is
not exact past 300 frames.)

Positions: RoPE uses the absolute frame position, as the official whole decode does (its rotary embedding has no
limit at max_position_embeddings = 8000; attention only sees relative distances <= 71, so the absolute value
matters only through fp32 rounding of the angle). `pos` is int64 and turned into fp32 for the angle, which is exact
up to 2^24 frames (about 37 hours); a stream simply keeps counting past 8000 frames (checked equal to the whole
decode at 8100 frames on a GPU).

dtype: works in fp32 or bf16 (the state takes the weights' dtype). RMSNorm normalizes in fp32, softmax runs in
fp32, RoPE cos/sin are computed in fp32 and cast; inv_freq stays fp32 even after `.to(bfloat16)` (the official
module would round it to bf16 under `.to()`; loaded with from_pretrained(dtype=bf16) it keeps fp32, as here).

Parameter names equal the official `Qwen3TTSTokenizerV2Decoder`: load the tensors of a checkpoint's
`speech_tokenizer/model.safetensors` under the prefix `decoder.` (prefix stripped) with strict=True.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from engine.model.codec_layers import (
    CausalConv1d,
    CausalConvBase,
    DecoderBlock,
    Prepared,
    SlidingTransformer,
    SnakeBeta,
    SplitRVQ,
    TailIO,
    UpsampleStage,
    layout_choice,
    run_window,
)


@dataclass(frozen=True)
class CodecConfig:
    """`decoder_config` of speech_tokenizer/config.json; defaults are the real (every 12 Hz checkpoint) values."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    vector_quantization_hidden_dimension: int = 512
    num_quantizers: int = 16
    num_semantic_quantizers: int = 1
    semantic_codebook_size: int = 4096  # unused by the decoder (both RVQ groups use codebook_size)
    latent_dim: int = 1024
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    hidden_act: str = "silu"
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8000  # informational: RoPE is computed for any absolute position
    sliding_window: int = 72
    layer_scale_initial_scale: float = 0.01
    decoder_dim: int = 1536
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)

    @classmethod
    def from_dict(cls, d: dict) -> CodecConfig:
        """Build from a `decoder_config` dict (or a whole tokenizer config.json dict); unknown keys are ignored."""
        if "decoder_config" in d:
            d = d["decoder_config"]
        names = {f.name for f in fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        return cls(**kw)

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)


@dataclass(frozen=True)
class StateLayout:
    """Where each piece of a slot's streaming state lives in its row of `CodecStreamState.flat`: the ring, then
    the conv tails twice (two buffers a slot alternates between: a step reads one and writes the other)."""

    kv_shape: tuple[int, ...]  # (L, 2, Hkv, W-1, hd): the ring, frame p at column p mod (W-1)
    tail_shapes: tuple[tuple[int, int], ...]  # (C_i, H_i) per conv tail, in module order
    channels_last: bool = False  # tails stored [H_i, C_i] (the activations' layout), else [C_i, H_i]

    @property
    def kv_width(self) -> int:
        """Where the tails start in a row: the ring comes first."""
        return math.prod(self.kv_shape)

    @property
    def tail_width(self) -> int:
        """One buffer of every conv tail."""
        return sum(c * h for c, h in self.tail_shapes)

    @property
    def width(self) -> int:
        return self.kv_width + 2 * self.tail_width

    def kv_view(self, rows: Tensor) -> Tensor:
        """rows [B, width] -> the ring [B, L, 2, Hkv, W-1, hd], a view sharing rows' storage."""
        return rows[:, : self.kv_width].view(rows.shape[0], *self.kv_shape)

    def tail_views(self, rows: Tensor, side: int = 0) -> list[Tensor]:
        """rows [B, width] -> tails buffer `side` (0 or 1) as [[B, C_i, H_i]], views sharing rows' storage."""
        B, start = rows.shape[0], self.kv_width + side * self.tail_width
        parts = rows[:, start:start + self.tail_width].split([c * h for c, h in self.tail_shapes], dim=1)
        if self.channels_last:
            return [p.view(B, h, c).transpose(1, 2) for p, (c, h) in zip(parts, self.tail_shapes, strict=True)]
        return [p.view(B, c, h) for p, (c, h) in zip(parts, self.tail_shapes, strict=True)]


@dataclass
class CodecStreamState:
    """Streaming state of `num_slots` streams, slot-major (dim 0 = slot), all on one device.

    Each slot's state is one contiguous row of `flat`. It starts with a ring of the post-RoPE keys/values of every
    transformer layer, frame q at column q mod (W-1): at position p (frames decoded so far) it holds frames
    p-W+1 .. p-1 (columns of negative positions hold zeros or stale frames of an earlier stream and are masked
    out). A step reads the ring in place and writes only its new frames' columns. Then come the input tails of
    every causal conv, in two buffers: `tail_at[:, s]` holds where slot s's current and next tails start; a step's
    kernels read the current ones and write the new ones into the other buffer, and the step swaps the pair. So no
    step gathers or scatters the tails, and no kernel overwrites a history another part of it still reads. Conv
    tails start as zeros, which is exactly the left zero padding of the whole-utterance decode."""

    pos: Tensor  # [S] int64: frames already decoded = absolute position of the slot's next frame
    tail_at: Tensor  # [2, S] int64: element offsets of each slot's current (0) and next (1) tails buffer, from
    #                  buffer 0 of slot 0 (TailIO's convention); [2, S] so a step's [2, B] selection is two rows
    flat: Tensor  # [S, layout.width] activation dtype
    layout: StateLayout

    @property
    def num_slots(self) -> int:
        return self.pos.shape[0]

    @property
    def kv(self) -> Tensor:  # [S, L, 2, Hkv, W-1, hd] view: the ring, frame q at column q mod (W-1)
        return self.layout.kv_view(self.flat)

    @property
    def sides(self) -> Tensor:
        """[S] int64, 0 or 1: the tails buffer holding each slot's current tails."""
        rows = torch.arange(self.num_slots, device=self.flat.device) * self.flat.stride(0)
        return (self.tail_at[0] - rows) // max(self.layout.tail_width, 1)

    def current_tails(self, slot: int) -> list[Tensor]:
        """Slot `slot`'s current conv tails, each [C_i, H_i] (a host-side read: for tests and tools)."""
        return [t[0] for t in self.layout.tail_views(self.flat[slot:slot + 1], int(self.sides[slot]))]

    def nbytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.pos, self.flat)) + 2 * self.tail_at.element_size()

    def reset_(self, slots: Tensor) -> None:
        """Clear `slots` (LongTensor [n], on the state's device) for new streams (both tails buffers: which one is
        current does not matter). No host sync."""
        for t in (self.pos, self.flat):
            t.index_fill_(0, slots, 0)


class CodecDecoder(nn.Module):
    """layout: how activations are stored, "contiguous" or "channels_last" (codec_layers.LAYOUTS; None:
    $VOICELANE_CODEC_LAYOUT, else codec_layers.DEFAULT_LAYOUT); `set_layout` switches it. Both give the same
    samples; the layout decides which kernels cuDNN runs."""

    def __init__(self, config: CodecConfig, layout: str | None = None):
        super().__init__()
        if config.num_semantic_quantizers != 1:
            raise ValueError("the official decoder always splits the codebooks as 1 + rest")
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        if config.sliding_window < 2:
            raise ValueError("sliding_window must be >= 2")
        if config.num_hidden_layers < 1:
            raise ValueError("the codec's transformer needs at least one layer")
        self.config = config
        c = config
        # Registration order mirrors the official module (state-dict order, randomize_codec_ draw order).
        self.pre_transformer = SlidingTransformer(c)
        self.quantizer = SplitRVQ(c.num_quantizers, c.codebook_dim // 2, c.codebook_size, c.codebook_dim)
        self.pre_conv = CausalConv1d(c.codebook_dim, c.latent_dim, 3, defer_bias=False)  # the transformer reads it
        self.upsample = nn.ModuleList([UpsampleStage(c.latent_dim, f) for f in c.upsampling_ratios])
        dims = [c.decoder_dim // 2**i for i in range(len(c.upsample_rates) + 1)]  # 1536, 768, 384, 192, 96
        self.decoder = nn.ModuleList(
            [CausalConv1d(c.latent_dim, c.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(c.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )
        # Number the convolutions that need input history; (channels, history) per tail, in that order.
        self.tail_shapes: list[tuple[int, int]] = []
        for m in self.modules():
            if isinstance(m, CausalConvBase) and m.history > 0:
                m.tail_id = len(self.tail_shapes)
                self.tail_shapes.append((m.conv.in_channels, m.history))
        self._prepared = [m for m in self.modules() if isinstance(m, Prepared)]
        self.set_layout(layout)

    def set_layout(self, layout: str | None) -> None:
        """Store activations "contiguous" or "channels_last" from now on (None: $VOICELANE_CODEC_LAYOUT or the
        default). Stream states made before are refused afterwards (their tails are laid out for the old layout):
        make new ones."""
        self.layout = layout_choice(layout)
        channels_last = self.layout == "channels_last"
        for m in self.modules():
            if isinstance(m, CausalConvBase):
                m.channels_last = channels_last
        c = self.config
        kv_shape = (c.num_hidden_layers, 2, c.num_key_value_heads, c.sliding_window - 1, c.head_dim)
        self.state_layout = StateLayout(kv_shape, tuple(self.tail_shapes), channels_last)

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    def prepare_inference(self) -> None:
        """Make every inference constant (SnakeBeta exponentials, the folded codebook table, stacked projections)
        from the current weights. The loader calls it once; a call also remakes constants whose weights changed."""
        for m in self._prepared:
            m.prepare_inference()

    def _ensure_prepared(self) -> None:
        # Host-side check only (no device work unless weights changed), so it is safe inside a graph capture.
        for m in self._prepared:
            if not m.is_prepared():
                m.prepare_inference()

    @torch.no_grad()  # inference only: the Triton kernels and the in-place state updates have no backward
    def _run(self, codes: Tensor, io: TailIO | None, pos: Tensor | None, ring: Tensor | None,
             slots: Tensor | None, valid: Tensor | None = None) -> Tensor:
        """codes [B, Q, t] -> wave [B, 1, t*spf]; in streaming mode the rows' new keys and values are written into
        their slots of the ring [S, L, 2, Hkv, W-1, hd] and the new conv tails to io.tails_out."""
        if codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"expected {self.config.num_quantizers} codebooks, got {codes.shape[1]}")
        self._ensure_prepared()
        x = self.quantizer.decode(codes)  # [B, codebook_dim, t]
        x = self.pre_conv(x, io)  # [B, latent, t]
        x = self.pre_transformer(x.transpose(1, 2), pos, ring, slots, valid)  # [B, t, latent]
        x = x.transpose(1, 2)  # [B, latent, t]
        for stage in self.upsample:
            x = stage(x, io)  # [B, latent, t * prod(upsampling_ratios)]
        first, *blocks, act, last = self.decoder
        x = first(x, io)  # from here on a Pre: each conv's bias (and residual) is added by the next kernel
        for block in blocks:
            x = block(x, io)
        x = last(x, io, act=act)  # [B, 1, t * spf]
        wave, _ = run_window(x, 0, channels_last=self.layout == "channels_last", clamp=True)  # + bias, clamp
        return wave

    def forward(self, codes: Tensor) -> Tensor:
        """Whole-utterance exact decode: codes LongTensor [B, Q, T] (values in [0, codebook_size)) ->
        wave [B, 1, T * samples_per_frame]. Attention memory grows as T^2; use decode_stream for long audio."""
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.config.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.config.codebook_size}), got "
                             f"[{int(codes.min())}, {int(codes.max())}]")
        return self._run(codes, None, None, None, None)

    def new_stream_state(self, num_slots: int, device=None, dtype=None) -> CodecStreamState:
        """Zeroed state for `num_slots` streams (default device/dtype: those of the weights)."""
        p = next(self.parameters())
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
        rows = torch.arange(num_slots, dtype=torch.int64, device=device) * self.state_layout.width
        return CodecStreamState(pos=torch.zeros(num_slots, dtype=torch.int64, device=device),
                                tail_at=torch.stack([rows, rows + self.state_layout.tail_width]),
                                flat=torch.zeros(num_slots, self.state_layout.width, dtype=dtype, device=device),
                                layout=self.state_layout)

    def decode_stream(self, codes: Tensor, state: CodecStreamState, slots: Tensor,
                      valid: Tensor | None = None) -> Tensor:
        """Decode t new frames for each of B streams: codes LongTensor [B, Q, t] (values in [0, codebook_size):
        not checked here, that would need a host sync), slots LongTensor [B] (distinct, on the state's device;
        rows may be at different positions). Reads and updates those slots of `state` in place (the keys/values
        ring column by column, only the new frames' columns written; each conv tail read from the slot's current
        tails buffer and written to its other one, both in place) and returns wave [B, t * samples_per_frame].
        Static shapes per (B, t), no host syncs, so a call can be captured in a CUDA graph per (B, t) with static
        codes/slots buffers. Any t >= 1 works (also t > 72).

        valid: LongTensor [B] in [1, t] (on the state's device; not checked), for a batch of rows with different
        chunk sizes padded to t: row b's first valid[b] frames are decoded and its state advances by valid[b]
        frames, as if it had been called with those frames alone; the samples of its padding frames (from
        valid[b] * samples_per_frame on) are garbage, to be cut off by the caller."""
        if state.layout != self.state_layout:
            raise ValueError(f"stream state laid out for another codec layout than {self.layout!r}: make it with "
                             "new_stream_state after set_layout")
        t = codes.shape[-1]
        at = state.tail_at.index_select(1, slots)  # [2, B]: where each row reads its tails and writes the new ones
        io = TailIO(state.layout.tail_views(state.flat), at[0], at[1], valid, t)  # every new tail is written
        pos = state.pos.index_select(0, slots)  # [B]
        wave = self._run(codes, io, pos, state.kv, slots, valid)  # reads and writes the ring and the tails in place
        state.tail_at.index_copy_(1, slots, at.flip(0))  # the buffer just written is current from now on
        state.pos.index_copy_(0, slots, pos + (t if valid is None else valid))
        return wave[:, 0]


@torch.no_grad()
def randomize_codec_(decoder: nn.Module, seed: int, gain: float = 0.65) -> nn.Module:
    """Deterministic, non-degenerate random weights (the official init decodes every code to silence).

    Draws come from a CPU torch.Generator in float64 and are cast, so a seed gives the same weights on every
    machine and device. Conv / transposed conv / linear weights ~ N(0, gain^2 / fan_in) (transposed conv fan_in =
    in_channels * kernel / stride), their biases ~ N(0, 0.01^2); SnakeBeta alpha, beta ~ N(0, 0.1^2); embedding_sum
    ~ N(0, 1); cluster_usage ~ U(0.5, 2); LayerScale and ConvNeXt gamma ~ U(0.25, 0.5); norm weights ~ U(0.5, 1.5);
    LayerNorm biases 0. Draw order follows the official module order, so the same seed gives the same weights
    whether drawn into this decoder or into the official one (the parity tests rely on it)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal_(t: Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64).mul_(std))

    def uniform_(t: Tensor, lo: float, hi: float) -> None:
        t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float64).mul_(hi - lo).add_(lo))

    for m in decoder.modules():
        if isinstance(m, nn.ConvTranspose1d):
            fan_in = m.in_channels * m.kernel_size[0] / m.stride[0]
        elif isinstance(m, nn.Conv1d):
            fan_in = m.in_channels // m.groups * m.kernel_size[0]
        elif isinstance(m, nn.Linear):
            fan_in = m.in_features
        else:
            if isinstance(m, nn.LayerNorm) and m.bias is not None:
                m.bias.zero_()
            continue
        normal_(m.weight, gain / math.sqrt(fan_in))
        if m.bias is not None:
            normal_(m.bias, 0.01)
    for name, p in decoder.named_parameters():
        if name.endswith(("alpha", "beta")):
            normal_(p, 0.1)
        elif name.endswith("embedding_sum"):
            normal_(p, 1.0)
        elif name.endswith("cluster_usage"):
            uniform_(p, 0.5, 2.0)
        elif name.endswith(("gamma", "scale")):
            uniform_(p, 0.25, 0.5)
        elif "norm" in name and name.endswith("weight"):
            uniform_(p, 0.5, 1.5)
    return decoder
