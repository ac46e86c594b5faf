"""Codec decoder: parity with the official Qwen3TTSTokenizerV2Decoder and exactness of the streaming state.

Tiny geometry (the parity oracle's tiny decoder config) with the real upsampling, so one
frame is 1920 samples; fp32 on the CPU. Streaming is compared with slices of one whole decode of 340 frames:
the decoder is causal, so a prefix decodes to the prefix of the whole decode.
"""

from __future__ import annotations

import dataclasses

import pytest
import qwen_oracle
import torch
import torch.nn.functional as F

from engine.model import codec_layers
from engine.model.codec import CodecConfig, CodecDecoder, randomize_codec_
from engine.model.codec_layers import LAYOUTS, CausalConvTranspose1d, Pre, TailIO

SPF = 1920
N_LONG = 340  # > 300 (where the official chunked_decode stops being exact) and > 4 windows of 72
STREAM_TOL = 1e-5
OFFICIAL_TOL = 1e-4

# decoder_config of speech_tokenizer/config.json (identical in every 12 Hz checkpoint)
REAL_DECODER_CONFIG = {
    "attention_bias": False, "latent_dim": 1024, "codebook_dim": 512, "codebook_size": 2048, "decoder_dim": 1536,
    "hidden_act": "silu", "hidden_size": 512, "intermediate_size": 1024, "layer_scale_initial_scale": 0.01,
    "max_position_embeddings": 8000, "head_dim": 64, "num_attention_heads": 16, "num_hidden_layers": 8,
    "num_key_value_heads": 16, "num_quantizers": 16, "num_semantic_quantizers": 1, "semantic_codebook_size": 4096,
    "vector_quantization_hidden_dimension": 512, "rms_norm_eps": 1e-05, "rope_theta": 10000, "sliding_window": 72,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
}

TINY = CodecConfig(codebook_dim=64, latent_dim=64, hidden_size=32, head_dim=8, num_attention_heads=4,
                   num_key_value_heads=4, intermediate_size=64, num_hidden_layers=2, decoder_dim=96)


def official_decoder(cfg: CodecConfig, attn: str = "eager"):
    T = qwen_oracle.codec_modeling()
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    kw = {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}
    ocfg = T.Qwen3TTSTokenizerV2DecoderConfig(**kw)
    ocfg._attn_implementation = attn
    return T.Qwen3TTSTokenizerV2Decoder(ocfg).eval()


@pytest.fixture(scope="module")
def dec() -> CodecDecoder:
    return randomize_codec_(CodecDecoder(TINY), seed=1234).eval()


@pytest.fixture(scope="module")
def decoders(dec) -> dict[str, CodecDecoder]:
    """dec's weights in every activation layout."""
    out = {}
    for layout in LAYOUTS:
        d = CodecDecoder(TINY, layout=layout).eval()
        d.load_state_dict(dec.state_dict())
        out[layout] = d
    return out


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 2048, (2, 16, N_LONG), generator=g)  # [2 utterances, 16, 340]


@pytest.fixture(scope="module")
def whole(dec, codes) -> torch.Tensor:
    with torch.no_grad():
        return dec(codes)[:, 0]  # [2, 340 * 1920]


def stream(dec, codes, sizes, state=None, slots=None) -> torch.Tensor:
    """Decode codes [B, 16, T] chunk by chunk (sizes), returning [B, sum(sizes) * 1920]."""
    B = codes.shape[0]
    state = dec.new_stream_state(B) if state is None else state
    slots = torch.arange(B) if slots is None else slots
    out, t0 = [], 0
    with torch.no_grad():
        for n in sizes:
            out.append(dec.decode_stream(codes[..., t0:t0 + n], state, slots))
            t0 += n
    return torch.cat(out, dim=-1)


def stream_padded(dec, codes, steps, state, slots, done, gen) -> list[list[torch.Tensor]]:
    """Decode rows r of codes [R, 16, T] (from frame done[r] on; done is updated) in the slots `slots`, all rows in
    every step: per step, sizes (one per row) padded with random codes to the largest (valid = sizes). Returns each
    row's waves of its real frames, one per step."""
    out = [[] for _ in slots]
    with torch.no_grad():
        for sizes in steps:
            batch = torch.randint(0, 2048, (len(sizes), 16, max(sizes)), generator=gen)  # padding: random codes
            for r, n in enumerate(sizes):
                batch[r, :, :n] = codes[r, :, done[r]:done[r] + n]
            wave = dec.decode_stream(batch, state, slots, valid=torch.tensor(sizes))
            for r, n in enumerate(sizes):
                out[r].append(wave[r, : n * SPF])
                done[r] += n
    return out


def ramp(total: int, steps=(1, 2, 4, 8), tail: int = 12) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(steps[len(sizes)] if len(sizes) < len(steps) else tail)
    sizes[-1] -= sum(sizes) - total
    return sizes


def maxdiff(a, b) -> float:
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------------------------- config


def test_config_from_dict_and_samples_per_frame():
    cfg = CodecConfig.from_dict({**REAL_DECODER_CONFIG, "unknown_key": 1})
    assert cfg == CodecConfig()
    assert cfg.upsample_rates == (8, 5, 4, 3) and cfg.samples_per_frame == 1920
    assert CodecConfig.from_dict({"decoder_config": REAL_DECODER_CONFIG}) == cfg
    assert TINY.samples_per_frame == SPF


@pytest.mark.parametrize("cfg", [TINY, CodecConfig()], ids=["tiny", "real"])
def test_state_dict_keys_and_shapes_equal_official(cfg):
    with torch.device("meta"):
        ours, official = CodecDecoder(cfg), official_decoder(cfg)
    a, b = ours.state_dict(), official.state_dict()
    assert list(a) == list(b)
    assert {k: tuple(v.shape) for k, v in a.items()} == {k: tuple(v.shape) for k, v in b.items()}


def test_rope_inv_freq_stays_fp32():
    d = CodecDecoder(TINY).to(torch.bfloat16)
    assert d.pre_transformer.rotary_emb.inv_freq.dtype == torch.float32
    assert "pre_transformer.rotary_emb.inv_freq" not in d.state_dict()


# ------------------------------------------------------------------------------------ official parity


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_whole_decode_matches_official(dec, codes, whole, attn):
    official = official_decoder(TINY, attn)
    official.load_state_dict(dec.state_dict(), strict=True)
    n = 90  # beyond the 72-frame window, so the window boundary is exercised
    with torch.no_grad():
        ref = official(codes[..., :n])[:, 0]
    assert ref.shape == (2, n * SPF)
    assert maxdiff(whole[:, : n * SPF], ref) < OFFICIAL_TOL


def rms(x) -> float:
    return x.pow(2).mean().sqrt().item()


def test_bf16_whole_decode_matches_official(dec, codes, whole):
    """bf16 keeps the official fp32 islands (norm, softmax, RoPE tables) but fuses elementwise ops (addcmul, one
    rounding instead of two; the codebooks folded in float64), so it is not bit-equal to the official bf16 decode:
    the two differ by about their own bf16 error. Parity here: our bf16 decode is no further from the fp32 decode
    than the official bf16 decode is, and the two bf16 decodes stay close."""
    official = official_decoder(TINY, "eager")
    official.load_state_dict(dec.state_dict(), strict=True)
    official = official.to(torch.bfloat16)
    rot = official.pre_transformer.rotary_emb
    rot.inv_freq = rot.original_inv_freq.float()  # what from_pretrained(dtype=bf16) keeps; .to() rounded it
    ours = CodecDecoder(TINY).eval()
    ours.load_state_dict(dec.state_dict())
    ours = ours.to(torch.bfloat16)
    n = 80
    with torch.no_grad():
        ref, got = official(codes[..., :n]).float()[:, 0], ours(codes[..., :n]).float()[:, 0]
    truth = whole[:, : n * SPF]
    assert rms(got - truth) <= rms(ref - truth)  # 1.09e-3 vs 1.16e-3 at the time of writing
    assert maxdiff(got, truth) <= 1.1 * maxdiff(ref, truth)
    assert maxdiff(got, ref) < 0.05 and rms(got - ref) < 2e-3


def test_folded_codebook_table_equals_official_lookup(dec, codes):
    """One embedding_bag over the projected codebooks equals lookups, sums and the 1x1 output convs."""
    with torch.no_grad():
        dec.prepare_inference()
        got = dec.quantizer.decode(codes[..., :50])
        ref = dec.quantizer.decode_reference(codes[..., :50])
    assert got.shape == ref.shape == (2, TINY.codebook_dim, 50)
    assert maxdiff(got, ref) < 1e-5 * ref.abs().max().item()


def test_prepared_constants_follow_weight_changes(dec, codes):
    """Constants made at load are remade when the weights change afterwards (load, in-place edit, cast)."""
    d = randomize_codec_(CodecDecoder(TINY), seed=99).eval()
    d.prepare_inference()
    snake = d.decoder[-2]
    assert torch.equal(snake.freq, torch.exp(snake.alpha)) and snake.is_prepared()
    with torch.no_grad():
        d(codes[..., :3])  # uses the seed-99 constants
        d.load_state_dict(dec.state_dict())
        assert not snake.is_prepared()
        got = d(codes[..., :30])[:, 0]
        assert maxdiff(got, dec(codes[..., :30])[:, 0]) == 0
        d16 = d.to(torch.bfloat16)
        d16(codes[..., :2])
    assert snake.freq.dtype == torch.bfloat16
    assert torch.equal(snake.freq, torch.exp(snake.alpha))  # bit-equal to the official per-call constant


def test_codes_out_of_range_raise(dec):
    with pytest.raises(ValueError, match="codes must lie in"):
        dec(torch.full((1, 16, 2), 2048))


def test_output_is_audible_and_unclamped(whole):
    assert 0.03 < whole.std().item() < 0.2
    assert (whole.abs() >= 1).float().mean().item() < 0.01
    per_frame = whole.view(2, N_LONG, SPF).std(-1)  # every frame carries signal
    assert per_frame.min().item() > 0.005


def test_window_boundary_matters(dec, codes, whole):
    """A decoder whose window is one frame off agrees before frame 72 and clearly differs after it, so the exact
    streaming comparisons below (which run far past frame 72) would catch an off-by-one in the KV window."""
    n = 100
    for w in (71, 73):
        other = CodecDecoder(dataclasses.replace(TINY, sliding_window=w)).eval()
        other.load_state_dict(dec.state_dict())
        with torch.no_grad():
            out = other(codes[:1, :, :n])[0, 0]
        cut = (min(w, 72)) * SPF
        assert maxdiff(out[:cut], whole[0, :cut]) < STREAM_TOL
        assert maxdiff(out[cut:], whole[0, cut: n * SPF]) > 1e-3


# ------------------------------------------------------------------------------------------ streaming


def test_stream_frame_by_frame(dec, codes, whole):
    n = 160  # more than two windows
    got = stream(dec, codes[..., :n], [1] * n)
    assert maxdiff(got, whole[:, : n * SPF]) < STREAM_TOL


@pytest.mark.parametrize("chunk", [2, 4, 8, 12])
def test_stream_fixed_chunks(dec, codes, whole, chunk):
    n = 120 if chunk < 8 else 168
    got = stream(dec, codes[..., :n], [chunk] * (n // chunk))
    assert maxdiff(got, whole[:, : n * SPF]) < STREAM_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_ramp_past_300_frames(decoders, codes, whole, layout):
    sizes = ramp(N_LONG)  # 1, 2, 4, 8, 12, 12, ..., 340 frames in all
    got = stream(decoders[layout], codes, sizes)
    assert maxdiff(got, whole) < STREAM_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_chunks_longer_than_window(decoders, codes, whole, layout):
    sizes = [3, 80, 1, 100, 7]  # chunks that span more than 72 frames by themselves
    n = sum(sizes)
    got = stream(decoders[layout], codes[..., :n], sizes)
    assert maxdiff(got, whole[:, : n * SPF]) < STREAM_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_slots_at_different_positions_and_reset(decoders, codes, whole, layout):
    """Two utterances in slots 3 and 1 of a 4-slot state, 45 frames apart, batched together (rows in either
    order); then slot 3 is reset and reused for a fresh decode while slot 1 keeps going."""
    dec = decoders[layout]
    state = dec.new_stream_state(4)
    a, b = codes[0:1], codes[1:2]
    lag = 45
    out_a = [stream(dec, a[..., :lag], ramp(lag, tail=8), state, torch.tensor([3]))]
    out_b = []
    pa, pb = lag, 0
    with torch.no_grad():
        for i, n in enumerate([1, 1, 4, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12]):
            if i % 2:
                w = dec.decode_stream(torch.cat([a[..., pa:pa + n], b[..., pb:pb + n]]), state, torch.tensor([3, 1]))
                wa, wb = w[0:1], w[1:2]
            else:
                w = dec.decode_stream(torch.cat([b[..., pb:pb + n], a[..., pa:pa + n]]), state, torch.tensor([1, 3]))
                wb, wa = w[0:1], w[1:2]
            out_a.append(wa)
            out_b.append(wb)
            pa, pb = pa + n, pb + n
    assert state.pos.tolist() == [0, pb, 0, pa]
    assert pa > 72 + lag
    assert maxdiff(torch.cat(out_a, -1)[0], whole[0, : pa * SPF]) < STREAM_TOL
    assert maxdiff(torch.cat(out_b, -1)[0], whole[1, : pb * SPF]) < STREAM_TOL

    # Reuse slot 3 for utterance b from the start; slot 1 continues utterance b where it was.
    state.reset_(torch.tensor([3]))
    assert state.pos.tolist() == [0, pb, 0, 0]
    fresh, cont, p0 = [], [], pb
    with torch.no_grad():
        for n in (1, 2, 4, 8, 12, 12, 12, 12, 12):
            w = dec.decode_stream(torch.cat([b[..., p0 - pb:p0 - pb + n], b[..., p0:p0 + n]]), state,
                                  torch.tensor([3, 1]))
            fresh.append(w[0])
            cont.append(w[1])
            p0 += n
    n_fresh = p0 - pb
    assert maxdiff(torch.cat(fresh), whole[1, : n_fresh * SPF]) < STREAM_TOL
    assert maxdiff(torch.cat(cont), whole[1, pb * SPF: p0 * SPF]) < STREAM_TOL


def test_bf16_runs_and_stays_close(dec, codes, whole):
    d16 = CodecDecoder(TINY).eval()
    d16.load_state_dict(dec.state_dict())
    d16 = d16.to(torch.bfloat16)
    n = 20
    with torch.no_grad():
        ref16 = d16(codes[:, :, :n])[:, 0]
    got = stream(d16, codes[..., :n], [1, 2, 4, 8, 5])
    assert got.dtype == torch.bfloat16 and ref16.dtype == torch.bfloat16
    assert maxdiff(got.float(), ref16.float()) < 0.05
    assert maxdiff(got.float(), whole[:, : n * SPF]) < 0.1


# ------------------------------------------------------------------------------------ layouts, causal cut


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_equals_official_to_fp32_rounding(decoders, codes, layout):
    """Both activation layouts give the official decode to fp32 rounding (bias and residual adds moved into the
    next kernel, transposed convs cut by their padding, 2-D convs over [B, C, 1, T] views)."""
    official = official_decoder(TINY, "eager")
    official.load_state_dict(decoders[layout].state_dict(), strict=True)
    n = 90
    with torch.no_grad():
        ref, got = official(codes[..., :n]), decoders[layout](codes[..., :n])
    assert got.shape == ref.shape == (2, 1, n * SPF)
    assert maxdiff(got, ref) < 2e-6  # 4e-7 / 7e-7 at the time of writing (contiguous / channels_last)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convolutions_read_and_write_the_layout(decoders, codes, layout, monkeypatch):
    """Every convolution's input, weight and output are dense in the layout's memory format (channels_last: NHWC
    over the [B, C, 1, T] view, so cuDNN needs no NCHW<->NHWC transposes), and a transposed conv's output starts
    at its own storage (no offset slice)."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    seen = []

    def spy(fn):
        def call(x, w, *args, **kw):
            y = fn(x, w, *args, **kw)
            seen.append((fn.__name__, x.is_contiguous(memory_format=fmt), w.is_contiguous(memory_format=fmt),
                         y.is_contiguous(memory_format=fmt), y.storage_offset()))
            return y
        return call

    monkeypatch.setattr(codec_layers.F, "conv2d", spy(F.conv2d))
    monkeypatch.setattr(codec_layers.F, "conv_transpose2d", spy(F.conv_transpose2d))
    d = decoders[layout]
    with torch.no_grad():
        d(codes[:1, :, :3])
        d.decode_stream(codes[:, :, :2], d.new_stream_state(2), torch.arange(2))
    n_convs = sum(isinstance(m, codec_layers.CausalConvBase) for m in d.modules())
    assert len(seen) == 2 * n_convs
    assert {s[1:] for s in seen} == {(True, True, True, 0)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel,stride", [(2, 2), (4, 2), (16, 8), (10, 5), (6, 3), (7, 3), (9, 4), (3, 1)])
def test_transposed_conv_gives_exactly_the_causal_cut(kernel, stride, layout):
    """padding h*s and output_padding s*ceil(k/s) - k make the output exactly the kept T*s samples of
    conv_transpose1d(x)[..., :T*s] (whole mode) and of the same with h input frames of history (streaming): for
    the real kernels (2s, and s for the upsampling) and others, with and without output_padding."""
    g = torch.Generator().manual_seed(kernel * 10 + stride)
    up = CausalConvTranspose1d(6, 5, kernel, stride)
    with torch.no_grad():
        up.conv.weight.copy_(torch.randn(up.conv.weight.shape, generator=g))
        up.conv.bias.copy_(torch.randn(5, generator=g))
    up.channels_last = layout == "channels_last"
    up.prepare_inference()
    assert 0 <= up.output_padding < stride
    x = torch.randn(2, 6, 11, generator=g)
    with torch.no_grad():
        ref = F.conv_transpose1d(x, up.conv.weight, up.conv.bias, stride=stride)[..., : 11 * stride]

        def total(out: Pre) -> torch.Tensor:
            dense = out.y.transpose(1, 2) if up.channels_last else out.y
            assert isinstance(out, Pre) and out.y.storage_offset() == 0 and dense.is_contiguous()
            return out.y + out.bias[:, None]

        assert maxdiff(total(up(x)), ref) < 1e-5
        h = up.history
        tails = torch.full((2, 2, 6, h), float("nan"))  # [side, B, C, h]: a step reads one side, writes the other
        tails[0] = 0
        rows, side_stride = torch.arange(2) * tails.stride(1), tails.stride(0)
        parts, t0 = [], 0
        for side, n in enumerate((1, 3, 7)):  # streaming: the tail carries the last h inputs
            io = TailIO([tails[0]], rows + side % 2 * side_stride, rows + (side + 1) % 2 * side_stride)
            parts.append(total(up(x[..., t0:t0 + n], io if h else None)))
            tails[side % 2] = float("nan")  # read once only
            t0 += n
    assert maxdiff(torch.cat(parts, -1), ref) < 1e-5


def test_stream_state_of_another_layout_is_refused(decoders, codes):
    state = decoders["contiguous"].new_stream_state(1)
    with pytest.raises(ValueError, match="another codec layout"):
        decoders["channels_last"].decode_stream(codes[:1, :, :1], state, torch.arange(1))


def test_layout_from_the_environment(monkeypatch):
    monkeypatch.setenv(codec_layers.LAYOUT_ENV, "channels_last")
    assert CodecDecoder(TINY).layout == "channels_last"
    monkeypatch.setenv(codec_layers.LAYOUT_ENV, "")
    assert CodecDecoder(TINY).layout == codec_layers.DEFAULT_LAYOUT
    assert CodecDecoder(TINY, layout="contiguous").layout == "contiguous"
    monkeypatch.setenv(codec_layers.LAYOUT_ENV, "nhwc")
    with pytest.raises(ValueError, match="choose one of contiguous, channels_last"):
        CodecDecoder(TINY)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_rows_with_different_chunk_sizes_in_one_batch(decoders, codes, whole, layout):
    """Rows padded to one chunk size with per-row valid lengths: each row's real frames decode as if alone and
    its state advances by its own count (checked past the 72-frame window), whatever the padding holds."""
    dec = decoders[layout]
    state = dec.new_stream_state(3)
    done = [0, 0]
    steps = [(1, 4), (4, 1), (2, 2), (12, 5), (3, 12)] + [(12, 7), (5, 12)] * 6
    out = stream_padded(dec, codes, steps, state, torch.tensor([2, 0]), done, torch.Generator().manual_seed(3))
    assert state.pos.tolist() == [done[1], 0, done[0]] and min(done) > 72
    for r in range(2):
        assert maxdiff(torch.cat(out[r]), whole[r, : done[r] * SPF]) < STREAM_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_rows_all_valid_equal_the_call_without_valid(decoders, codes, layout):
    """valid = t in every row is the uniform call, bit for bit (audio and state): a codec graph that always takes
    `valid` serves uniform steps exactly."""
    dec = decoders[layout]
    states = [dec.new_stream_state(3), dec.new_stream_state(3)]
    slots, done = torch.tensor([2, 0]), 0
    with torch.no_grad():
        for t in (1, 4, 12, 12, 12, 12, 12, 12, 3):  # past the 72-frame window
            batch = codes[:2, :, done:done + t]
            plain = dec.decode_stream(batch, states[0], slots)
            full = dec.decode_stream(batch, states[1], slots, valid=torch.full((2,), t))
            assert torch.equal(plain, full)
            done += t
    assert torch.equal(states[0].pos, states[1].pos) and torch.equal(states[0].flat, states[1].flat)


def test_attention_reads_dense_queries_keys_and_values(dec, codes, monkeypatch):
    """Each layer's keys and values (past frames then new ones) reach SDPA as dense tensors (no copy inside it),
    queries with a unit stride along the head dimension, with one additive mask for all layers."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.stride(-1) == 1, k.is_contiguous(), v.is_contiguous(), attn_mask.dtype == q.dtype,
                     attn_mask.data_ptr()))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(codec_layers.F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        dec.decode_stream(codes[:, :, :3], dec.new_stream_state(2), torch.arange(2))
    assert len(seen) == TINY.num_hidden_layers
    assert {s[:4] for s in seen} == {(True, True, True, True)} and len({s[4] for s in seen}) == 1


# ------------------------------------------------------------------------------ the keys/values ring in place


def test_stream_wraps_a_small_ring_many_times_with_rows_at_different_positions():
    """A 5-frame window (a ring of 4 columns) wrapped 30 times and more: two rows 7 frames apart share every step,
    padded to one chunk size (valid) with chunks shorter and longer than the window, and equal the whole decode."""
    cfg = dataclasses.replace(TINY, sliding_window=5)
    dec = randomize_codec_(CodecDecoder(cfg), seed=99).eval()
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 2048, (2, 16, 140), generator=g)
    with torch.no_grad():
        whole = dec(codes)[:, 0]
    state, done = dec.new_stream_state(3), [7, 0]
    first = stream(dec, codes[:1, :, :7], [3, 4], state, torch.tensor([1]))[0]
    out = stream_padded(dec, codes, [(1, 3), (6, 1), (2, 9), (4, 4), (1, 1), (7, 2)] * 6, state,
                        torch.tensor([1, 2]), done, g)
    out[0].insert(0, first)
    assert state.pos.tolist() == [0, done[0], done[1]] and min(done) > 25 * 4
    for r in range(2):
        assert maxdiff(torch.cat(out[r]), whole[r, : done[r] * SPF]) < STREAM_TOL


def test_step_writes_only_its_valid_frames_columns_of_the_ring(dec, codes):
    """A padded step (t = 12) writes, per row, only the ring columns of its valid frames (every layer, keys and
    values), never those its padding frames map to (they hold frames still inside the window), and no other slot."""
    state = dec.new_stream_state(3)
    R = TINY.sliding_window - 1
    stream(dec, codes[:1, :, :100], [40, 60], state, torch.tensor([2]))  # wrapped once: every column in use
    stream(dec, codes[1:, :, :30], [30], state, torch.tensor([0]))
    before = state.flat.clone()
    with torch.no_grad():
        dec.decode_stream(torch.cat([codes[:1, :, 100:112], codes[1:, :, 30:42]]), state, torch.tensor([2, 0]),
                          valid=torch.tensor([1, 3]))
    changed = state.kv != state.layout.kv_view(before)  # [S, L, 2, Hkv, R, hd]
    changed_cols = changed.permute(4, 0, 1, 2, 3, 5).reshape(R, 3, -1).any(-1)  # [R, slot]
    assert changed_cols[:, 1].sum() == 0 and torch.equal(state.flat[1], before[1])
    assert changed_cols[:, 2].nonzero().flatten().tolist() == [100 % R]
    assert changed_cols[:, 0].nonzero().flatten().tolist() == [30, 31, 32]
    assert changed[2, :, :, :, 100 % R].all() and changed[0, :, :, :, 30:33].all()
    assert state.pos.tolist() == [33, 0, 101]


def test_step_reads_one_tails_buffer_and_writes_the_other_in_place(dec, codes):
    """A step neither gathers nor overwrites a slot's conv tails: it writes the new ones into the slot's other
    buffer and flips `side`; the buffer it read keeps its values, other slots keep everything. Each buffer holds
    what a separate decode of the same frames leaves as the current tails."""
    state, lay = dec.new_stream_state(3), dec.state_layout
    stream(dec, codes[:1, :, :5], [2, 3], state, torch.tensor([2]))  # two steps: back on buffer 0
    assert state.sides.tolist() == [0, 0, 0]
    before = state.flat.clone()
    with torch.no_grad():
        dec.decode_stream(codes[:, :, 5:9], state, torch.tensor([2, 0]))
    assert state.sides.tolist() == [1, 0, 1]
    assert torch.equal(state.flat[1], before[1])
    for slot in (0, 2):
        read, written = lay.kv_width, lay.kv_width + lay.tail_width
        assert torch.equal(state.flat[slot, read:read + lay.tail_width], before[slot, read:read + lay.tail_width])
        assert not torch.equal(state.flat[slot, written:], before[slot, written:])
    alone = dec.new_stream_state(1)  # slot 2's frames 0-8 decoded by themselves, in other steps
    stream(dec, codes[:1, :, :9], [4, 5], alone, torch.tensor([0]))
    assert alone.sides.tolist() == [0]
    for got, ref in zip(state.current_tails(2), alone.current_tails(0), strict=True):
        assert (got - ref).abs().max().item() < 1e-5


def test_reset_of_one_slot_leaves_the_others_alone(dec, codes):
    state = dec.new_stream_state(3)
    stream(dec, codes[:, :, :20], [5, 15], state, torch.tensor([0, 1]))
    stream(dec, codes[:1, :, :9], [9], state, torch.tensor([2]))
    before = state.flat.clone()
    state.reset_(torch.tensor([1]))
    assert state.pos.tolist() == [20, 0, 9]
    assert torch.equal(state.flat[0], before[0]) and torch.equal(state.flat[2], before[2])
    assert not state.flat[1].any() and before[1].any()
