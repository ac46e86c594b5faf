"""Codec kernels against their PyTorch references. On the CPU the Triton kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set before the first kernel is built); on a GPU the same tests run the compiled kernels."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.kernels import snake as sk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def constants(C: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    alpha = torch.randn(C, generator=gen) * 0.5
    beta = torch.randn(C, generator=gen) * 0.5
    return torch.exp(alpha).to(DEVICE), (1.0 / (torch.exp(beta) + 1e-9)).to(DEVICE)


@pytest.mark.parametrize("shape", [(1, 3, 1), (2, 5, 37), (3, 4, 1100)])
def test_snake_triton_equals_reference_fp32(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(DEVICE)
    freq, inv = constants(shape[1], gen)
    ref = sk.snake_reference(x, freq, inv)
    got = sk.snake_triton(x, freq, inv)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_snake_triton_writes_into_a_window_view():
    """The kernel reads a strided input and writes the new part of a conv window, leaving the history alone."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 6, 40, generator=gen).to(DEVICE)
    x = base[:, :, 5:25]  # batch/channel strides of the larger tensor, time stride 1
    freq, inv = constants(6, gen)
    win = torch.full((2, 6, 4 + 20), 7.0, device=DEVICE)
    sk.snake_triton(x, freq, inv, out=win[..., 4:])
    assert torch.all(win[..., :4] == 7.0)
    assert (win[..., 4:] - sk.snake_reference(x, freq, inv)).abs().max().item() < 1e-5


def test_snake_triton_bf16_rounds_once():
    """bf16 in and out, fp32 inside: within one bf16 ulp of the fp32 result (the interpreter truncates where the
    GPU rounds to nearest, so one ulp rather than half)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 8, 300, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    freq, inv = constants(8, gen)
    exact = sk.snake_reference(x.float(), freq.float(), inv.float())
    got = sk.snake_triton(x, freq.to(torch.bfloat16), inv.to(torch.bfloat16))
    ref16 = sk.snake_reference(x.float(), freq.to(torch.bfloat16).float(), inv.to(torch.bfloat16).float())
    assert got.dtype == torch.bfloat16
    ulp = ref16.abs() * 2.0**-7 + 1e-30
    assert torch.all((got.float() - ref16).abs() <= ulp)
    assert (got.float() - exact).abs().max().item() < 0.05  # constants rounded to bf16: a small, bounded shift


def test_snake_torch_path_equals_reference():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 7, 50, generator=gen) * 3
    alpha, beta = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    freq, inv = torch.exp(alpha), 1.0 / (torch.exp(beta) + 1e-9)
    ref = sk.snake_reference(x, freq, inv)
    assert (sk.snake_torch(x, freq, inv) - ref).abs().max().item() < 1e-5
    out = torch.empty(2, 7, 53)
    sk.snake_torch(x, freq, inv, out=out[..., 3:])
    assert (out[..., 3:] - ref).abs().max().item() < 1e-5


def test_snake_rejects_bad_shapes():
    x = torch.zeros(1, 4, 8, device=DEVICE)
    c = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="freq/inv_mag"):
        sk.snake_triton(x, torch.ones(3, device=DEVICE), c)
    with pytest.raises(ValueError, match="out has shape"):
        sk.snake_triton(x, c, c, out=torch.zeros(1, 4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="tail_out has shape"):
        sk.conv_window_triton(x, torch.zeros(1, 4, 10, device=DEVICE), tail_out=torch.zeros(1, 4, 3, device=DEVICE))


def test_snake_triton_channels_last():
    """Channel stride 1 (a [B, T, C] tensor seen as [B, C, T]), in and out: the channels_last codec layout."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 37, 6, generator=gen) * 3).to(DEVICE).transpose(1, 2)
    freq, inv = constants(6, gen)
    got = sk.snake_triton(x, freq, inv)
    assert got.stride() == x.stride()
    assert (got - sk.snake_reference(x, freq, inv)).abs().max().item() < 1e-5


def _activation(B, C, T, channels_last, gen, dtype=torch.float32):
    t = torch.randn(B, T, C, generator=gen).transpose(1, 2) if channels_last else torch.randn(B, C, T, generator=gen)
    return t.to(DEVICE, dtype)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("B,C,T,H", [(2, 5, 7, 3), (1, 1, 9, 0), (2, 6, 2, 6), (1, 3, 1, 18), (1, 130, 40, 6)])
@pytest.mark.parametrize("parts", ["all", "snake_tail", "bias_only", "clamp"])
def test_conv_window_triton_equals_torch_path(channels_last, B, C, T, H, parts):
    """The one-pass window kernel against the PyTorch path: bias + residual (stored), SnakeBeta, history in,
    new history out (also when T < H, where part of the old history stays), clamp; fp32."""
    gen = torch.Generator().manual_seed(B * 1000 + C * 10 + T + H)
    y, res = _activation(B, C, T, channels_last, gen), _activation(B, C, T, channels_last, gen)
    bias = torch.randn(C, generator=gen).to(DEVICE)
    freq, inv = constants(C, gen)
    tail_in = _activation(B, C, H, channels_last, gen)
    kw = {"all": dict(bias=bias, res=res, freq=freq, inv_mag=inv, tail_in=tail_in),
          "snake_tail": dict(freq=freq, inv_mag=inv, tail_in=tail_in), "bias_only": dict(bias=bias),
          "clamp": dict(bias=bias, res=res, clamp=True)}[parts]
    outs = []
    for fn in (sk.conv_window_torch, sk.conv_window_triton):
        win = _activation(B, C, H + T, channels_last, gen)
        x_out = _activation(B, C, T, channels_last, gen) if parts == "all" else None
        tail_out = _activation(B, C, H, channels_last, gen) if parts != "bias_only" else None
        fn(y, win, x_out=x_out, tail_out=tail_out, **kw)
        outs.append([t for t in (win, x_out, tail_out) if t is not None])
    for ref, got in zip(*outs, strict=True):
        assert got.shape == ref.shape
        if ref.numel():
            assert (got - ref).abs().max().item() < 1e-5
    if parts == "bias_only" and H:
        assert torch.all(outs[1][0][..., :H] == 0)  # whole mode: zeros before the first sample


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("H", [0, 3, 18])
def test_conv_window_per_row_valid_lengths(channels_last, H):
    """tail_valid: each row's new history ends at its own last real sample (valid frames x samples per frame),
    also where that leaves part of the old history in it; kernel and PyTorch path against the definition."""
    gen = torch.Generator().manual_seed(H + 7)
    B, C, frames, factor = 3, 5, 4, 3
    T = frames * factor
    y, tail_in = _activation(B, C, T, channels_last, gen), _activation(B, C, H, channels_last, gen)
    valid = torch.tensor([4, 1, 2], device=DEVICE)
    for fn in (sk.conv_window_torch, sk.conv_window_triton):
        win, tail_out = _activation(B, C, H + T, channels_last, gen), _activation(B, C, H, channels_last, gen)
        fn(y, win, tail_in=tail_in, tail_out=tail_out, tail_valid=valid, tail_factor=factor)
        for b, n in enumerate(valid.tolist()):
            assert torch.equal(tail_out[b], win[b, :, n * factor: n * factor + H])
        assert torch.equal(win[..., :H], tail_in) and torch.equal(win[..., H:], y)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("with_valid", [False, True], ids=["all_frames", "valid"])
def test_conv_window_reads_and_writes_tails_in_a_state_by_offset(channels_last, with_valid):
    """tail_in_at / tail_out_at: each batch row reads its history from one of a slot's two tail buffers inside a
    state row and writes the new history into the other, at element offsets (the codec's in-place stream state).
    Kernel and PyTorch path equal the dense call on the gathered rows; nothing else in the state changes."""
    gen = torch.Generator().manual_seed(31 + channels_last + 2 * with_valid)
    S, C, H, frames, factor, lead = 4, 5, 6, 3, 2, 7  # lead: other state before the tails (the codec's ring)
    B, T = 2, frames * factor
    row_width = lead + 2 * C * H + 3
    state = torch.randn(S, row_width, generator=gen).to(DEVICE)
    slots, sides = torch.tensor([2, 0], device=DEVICE), torch.tensor([1, 0], device=DEVICE)
    read_at = slots * row_width + sides * C * H
    write_at = slots * row_width + (1 - sides) * C * H
    y, res = _activation(B, C, T, channels_last, gen), _activation(B, C, T, channels_last, gen)
    freq, inv = constants(C, gen)
    valid = torch.tensor([3, 1], device=DEVICE) if with_valid else None
    per_row = dict(tail_valid=valid, tail_factor=factor) if with_valid else {}

    def tail_of(st, slot, side):  # [C, H] of one slot's buffer
        buf = st[slot, lead + side * C * H: lead + (side + 1) * C * H]
        return buf.view(H, C).t() if channels_last else buf.view(C, H)

    tail_in = torch.stack([tail_of(state, s, d) for s, d in zip(slots.tolist(), sides.tolist(), strict=True)])
    win_ref = _activation(B, C, H + T, channels_last, gen)
    tail_ref = torch.empty_like(tail_in)
    sk.conv_window_torch(y, win_ref, res=res, freq=freq, inv_mag=inv, tail_in=tail_in, tail_out=tail_ref, **per_row)
    for fn in (sk.conv_window_torch, sk.conv_window_triton):
        st = state.clone()
        part = st[:, lead:lead + C * H]
        view = part.view(S, H, C).transpose(1, 2) if channels_last else part.view(S, C, H)
        win = _activation(B, C, H + T, channels_last, gen)
        fn(y, win, res=res, freq=freq, inv_mag=inv, tail_in=view, tail_out=view, tail_in_at=read_at,
           tail_out_at=write_at, **per_row)
        assert (win - win_ref).abs().max().item() < 1e-5
        expected = state.clone()
        for b, (s, d) in enumerate(zip(slots.tolist(), sides.tolist(), strict=True)):
            tail_of(expected, s, 1 - d).copy_(tail_ref[b])
        assert (st - expected).abs().max().item() < 1e-5  # the new tails where they belong, nothing else touched
        assert torch.equal(tail_of(st, 2, 1), tail_of(state, 2, 1))  # the history read stays as it was


def test_conv_window_tail_offsets_come_with_their_tails():
    x, win = torch.zeros(1, 4, 7, device=DEVICE), torch.zeros(1, 4, 10, device=DEVICE)
    at = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="tail_in_at and tail_out_at come together"):
        sk.conv_window_triton(x, win, tail_in=torch.zeros(3, 4, 3, device=DEVICE), tail_in_at=at)
    with pytest.raises(ValueError, match=r"tail_in has shape \(3, 4, 2\)"):
        sk.conv_window_torch(x, win, tail_in=torch.zeros(3, 4, 2, device=DEVICE),
                             tail_out=torch.zeros(3, 4, 3, device=DEVICE), tail_in_at=at, tail_out_at=at)


def test_conv_window_triton_bf16_sums_and_rounds_once():
    """bf16: y + bias + residual summed in fp32 and rounded once (x_out), SnakeBeta of that rounded sum."""
    gen = torch.Generator().manual_seed(13)
    B, C, T = 2, 8, 50
    y, res = (_activation(B, C, T, True, gen, torch.bfloat16) for _ in range(2))
    bias = torch.randn(C, generator=gen).to(DEVICE, torch.bfloat16)
    freq, inv = (c.to(torch.bfloat16) for c in constants(C, gen))
    win, x_out = torch.empty(B, C, T, device=DEVICE, dtype=torch.bfloat16), torch.empty_like(y)
    sk.conv_window_triton(y, win, bias=bias, res=res, freq=freq, inv_mag=inv, x_out=x_out)
    exact = y.float() + bias.float()[:, None] + res.float()
    ulp = exact.abs() * 2.0**-7 + 1e-30
    assert torch.all((x_out.float() - exact).abs() <= ulp)
    ref = sk.snake_reference(x_out.float(), freq.float(), inv.float())
    assert torch.all((win.float() - ref).abs() <= ref.abs() * 2.0**-7 + 1e-30)


def test_kernels_status_says_what_runs():
    status = sk.kernels_status()
    assert set(status) == {"enabled", "reason"}
    if not torch.cuda.is_available():
        assert status == {"enabled": False, "reason": "no CUDA device: the PyTorch path runs on the CPU"}
    sk.set_triton_enabled(False)
    try:
        off = sk.kernels_status()
        assert off["enabled"] is False and "switched off" in off["reason"]
    finally:
        sk.set_triton_enabled(True)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_decoder_on_the_triton_path_equals_the_torch_path(layout):
    """The tiny codec decoding a stream (1 + 2 frames, two rows, then a step of 2 and 1 valid frames) and a whole
    utterance with every kernel on Triton (forced; the interpreter on the CPU) equals the PyTorch path, in both
    activation layouts."""
    from engine import kernels
    from engine.model.codec import CodecConfig, CodecDecoder, randomize_codec_

    tiny = CodecConfig(codebook_dim=64, latent_dim=64, hidden_size=32, head_dim=8, num_attention_heads=4,
                       num_key_value_heads=4, intermediate_size=64, num_hidden_layers=2, decoder_dim=96)
    dec = randomize_codec_(CodecDecoder(tiny, layout=layout), seed=5).to(DEVICE).eval()
    codes = torch.randint(0, 2048, (2, 16, 3), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = {}
    valid = torch.tensor([2, 1], device=DEVICE)
    for name in ("torch", "triton"):
        state, slots = dec.new_stream_state(3), torch.tensor([2, 0], device=DEVICE)
        with kernels.backend(name), torch.inference_mode():
            waves = [dec.decode_stream(codes[..., :1], state, slots), dec.decode_stream(codes[..., 1:], state, slots)]
            mixed = dec.decode_stream(codes[..., :2], state, slots, valid=valid)  # rows of 2 and 1 frames
            results[name] = (torch.cat(waves, -1), state.flat.clone(), dec(codes[:1, :, :2])[:, 0], mixed[1, :1920])
    for got, ref in zip(results["triton"], results["torch"], strict=True):
        assert (got - ref).abs().max().item() < 1e-5
    assert (results["torch"][0][:1, : 2 * 1920] - results["torch"][2]).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_add", [True, False])
def test_scaled_add_rms_norm_triton_equals_torch_path(dtype, with_add):
    """x + scale * a rounded once, then RMSNorm (fp32 inside, rounded, times the weight, rounded): the kernel
    against the PyTorch path in fp32, and in bf16 against the fp32 formula (one rounding of the sum: within an
    ulp; two of the norm: within two; the interpreter truncates where the GPU rounds to nearest)."""
    from engine import kernels
    from engine.kernels.codec_transformer import scaled_add_rms_norm, scaled_add_rms_norm_torch

    gen = torch.Generator().manual_seed(3)
    x, a = (torch.randn(2, 5, 48, generator=gen).to(DEVICE, dtype) for _ in range(2))
    scale, weight = (torch.rand(48, generator=gen).add(0.25).to(DEVICE, dtype) for _ in range(2))
    ref_h, ref = scaled_add_rms_norm_torch(x, scale if with_add else None, a if with_add else None, weight, 1e-5)
    with kernels.backend("triton"):
        h, got = scaled_add_rms_norm(x, scale if with_add else None, a if with_add else None, weight, 1e-5)
    assert got.shape == ref.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        assert (h - ref_h).abs().max().item() < 1e-6 and (got - ref).abs().max().item() < 1e-5
    else:
        exact_h = x.float() + scale.float() * a.float() if with_add else x.float()
        assert torch.all((h.float() - exact_h).abs() <= exact_h.abs() * 2.0**-7)
        hf = h.float()
        exact = weight.float() * hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.all((got.float() - exact).abs() <= exact.abs() * 2.0**-6 + 1e-6)
    if not with_add:
        assert h is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cos_rows", [1, 3])
def test_rope_kv_triton_equals_torch_path(dtype, cos_rows):
    """RoPE of the stacked projection: q out, k and v written after the past frames of the key/value buffer (the
    past left as it was); the kernel against the PyTorch path (fp32) and the fp32 formula (bf16)."""
    from engine import kernels
    from engine.kernels.codec_transformer import rope_kv, rope_kv_torch

    gen = torch.Generator().manual_seed(4)
    B, t, H, Hkv, hd, past = 3, 5, 4, 2, 8, 6
    proj = torch.randn(B, t, (2 * (H + Hkv) + Hkv) * hd, generator=gen).to(DEVICE, dtype)
    angle = torch.randn(cos_rows, t, hd, generator=gen) * 4
    cos, sin = angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)
    kv0 = torch.randn(B, 2, Hkv, past + t, hd, generator=gen).to(DEVICE, dtype)
    kv_ref, kv_got = kv0.clone(), kv0.clone()
    q_ref = rope_kv_torch(proj, cos, sin, kv_ref, past, H, Hkv, hd)
    with kernels.backend("triton"):
        q_got = rope_kv(proj, cos, sin, kv_got, past, H, Hkv, hd)
    assert q_got.shape == q_ref.shape == (B, H, t, hd)
    assert torch.equal(kv_got[..., :past, :], kv0[..., :past, :])
    if dtype == torch.float32:
        assert (q_got - q_ref).abs().max().item() < 1e-6 and (kv_got - kv_ref).abs().max().item() < 1e-6
        return
    # bf16 against the fp32 formula: two roundings (the interpreter truncates), so within two ulps of the terms
    n_qk = (H + Hkv) * hd
    qk, rot = (proj[..., o: o + n_qk].float().view(B, t, H + Hkv, hd) for o in (0, n_qk))
    c, s = cos.float()[:, :, None], sin.float()[:, :, None]
    exact, size = (qk * c + rot * s).transpose(1, 2), (qk * c).abs().add((rot * s).abs()).transpose(1, 2)
    got = torch.cat([q_got, kv_got[:, 0, :, past:]], dim=1).float()
    assert torch.all((got - exact).abs() <= size * 2.0**-6 + 1e-6)
    assert torch.equal(kv_got[:, 1, :, past:], proj[..., 2 * n_qk:].view(B, t, Hkv, hd).transpose(1, 2))


def _ring_case(dtype, positions, t, window=6, H=4, Hkv=2, hd=8, slots=(3, 0, 2)):
    """A step of rows at `positions` (one per slot) over a ring of W-1 columns filled from each row's random
    history (frame p at column p mod (W-1)); columns of negative positions hold random stale values. Returns the
    step's inputs and, per row, the keys and values of every position it has (the history then its new frames)."""
    gen = torch.Generator().manual_seed(sum(positions) + t)
    R, S, B = window - 1, 4, len(positions)
    ring = torch.randn(S, 2, Hkv, R, hd, generator=gen)  # stale everywhere until written below
    history = [torch.randn(2, Hkv, p + t, hd, generator=gen) for p in positions]
    for b, p in enumerate(positions):
        for frame in range(max(0, p - R), p):
            ring[slots[b], :, :, frame % R] = history[b][:, :, frame]
    q = torch.randn(B, H, t, hd, generator=gen)
    new_kv = torch.stack([h[:, :, -t:] for h in history])  # [B, 2, Hkv, t, hd]
    inputs = [x.to(DEVICE, dtype) for x in (q, new_kv, ring)]
    return inputs, torch.tensor(slots[:B], device=DEVICE), torch.tensor(positions, device=DEVICE), history


def _ring_definition(q, history, positions, window, scale):
    """Per row and query frame s: softmax attention over the row's frames pos+s-W+1 .. pos+s (those >= 0)."""
    B, H, t, _ = q.shape
    out = torch.empty(B, t, H, q.shape[-1], dtype=torch.float64)
    for b, p in enumerate(positions):
        k, v = history[b].double().repeat_interleave(H // history[b].shape[1], dim=1)  # [H, p + t, hd] each
        for s in range(t):
            lo = max(0, p + s - window + 1)
            scores = (q[b, :, s, None].double().cpu() @ k[:, lo: p + s + 1].transpose(1, 2))[:, 0]  # [H, n]
            w = torch.softmax(scores * scale, dim=-1)
            out[b, s] = (w[:, :, None] * v[:, lo: p + s + 1]).sum(1)
    return out


def test_ring_attention_reads_its_keys_in_one_round_for_small_grids_only():
    from engine.kernels.codec_transformer import ONE_ROUND_PROGRAMS, default_block_n

    assert default_block_n(16, 72) == 128  # B1 x 16 heads: the real codec's 71 ring columns and a new frame
    assert default_block_n(16, 71 + 57) == 128
    assert default_block_n(16, 9) == 16  # a tiny window: never under the 16 keys a dot needs
    assert default_block_n(ONE_ROUND_PROGRAMS, 72) == 128
    assert default_block_n(ONE_ROUND_PROGRAMS + 1, 72) == 32  # B64 x 16 heads: rounds of 32
    assert default_block_n(64 * 16, 72) == 32


@pytest.mark.parametrize("positions,t,window", [((0, 3, 1003), 1, 6), ((7, 0, 2), 4, 6), ((41, 5, 1), 9, 6),
                                                ((10, 26, 0), 40, 6), ((0, 17, 300), 3, 40)],
                         ids=["t1-wrapped", "t4", "t9-longer-than-window", "t40-several-blocks", "ring-of-2-blocks"])
@pytest.mark.parametrize("block_n", [None, 16], ids=["one-round", "rounds-of-16"])
def test_ring_attention_equals_the_definition(positions, t, window, block_n):
    """A streaming step's attention over the ring (W = 6: 5 columns; or 40: 39 columns) and its new frames, for rows
    at different positions in one batch (a fresh stream, one inside its first window, one that has wrapped the ring
    many times), rows in a different order than their slots, GQA, t longer than the window and past one block of
    queries: the PyTorch path and the Triton kernel (the interpreter on the CPU; its keys in one round, as the
    engine's, or in rounds of 16 that cut across the ring's end) against the definition, fp32; stale columns
    (before a stream's start) are never read."""
    from engine import kernels
    from engine.kernels.codec_transformer import ring_attention, ring_attention_torch

    scale = 8**-0.5
    (q, new_kv, ring), slots, pos, history = _ring_case(torch.float32, positions, t, window)
    ring_before = ring.clone()
    ref = _ring_definition(q, history, positions, window, scale)
    got_torch = ring_attention_torch(q, new_kv, ring, slots, pos, window, scale)
    with kernels.backend("triton"):
        got_triton = ring_attention(q, new_kv, ring, slots, pos, window, scale, block_n=block_n)
    assert got_torch.shape == got_triton.shape == (len(positions), t, 4, 8)
    assert (got_torch.double().cpu() - ref).abs().max().item() < 1e-5
    assert (got_triton.double().cpu() - ref).abs().max().item() < 1e-5
    assert torch.equal(ring, ring_before)  # read only


def test_ring_attention_triton_half_close_to_torch_path():
    """16-bit keys, values and queries (bf16 on a GPU; fp16 in the interpreter, whose bf16 is not rounded like the
    GPU's): the kernel (fp32 scores and softmax, probabilities rounded to the activation dtype before the value
    product, as flash attention does) within that rounding of the fp32 PyTorch path."""
    from engine import kernels
    from engine.kernels.codec_transformer import ring_attention, ring_attention_torch

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    (q, new_kv, ring), slots, pos, _ = _ring_case(dtype, (9, 0, 130), 3)
    ref = ring_attention_torch(q.float(), new_kv.float(), ring.float(), slots, pos, 6, 8**-0.5)
    with kernels.backend("triton"):
        got = ring_attention(q, new_kv, ring, slots, pos, 6, 8**-0.5)
    assert got.dtype == dtype
    assert (got.float() - ref).abs().max().item() < (0.03 if dtype == torch.bfloat16 else 0.005)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_conv_window_launch_configs_give_identical_windows(channels_last):
    """Tile shape and warps change only how the work is cut: every config writes the same bits as the default."""
    gen = torch.Generator().manual_seed(11)
    B, C, T, H = 2, 24, 50, 6
    y, res = _activation(B, C, T, channels_last, gen), _activation(B, C, T, channels_last, gen)
    tail_in = _activation(B, C, H, channels_last, gen)
    freq, inv = constants(C, gen)
    outs = []
    default = sk.window_config(C, H + T, channels_last, torch.float32)
    configs = [None, sk.WindowConfig(8, 16), sk.WindowConfig(32, 4, num_warps=8), sk.WindowConfig(1, 64, 2)]
    for cfg in configs:
        win, tail_out = _activation(B, C, H + T, channels_last, gen), _activation(B, C, H, channels_last, gen)
        sk.conv_window_triton(y, win, res=res, freq=freq, inv_mag=inv, tail_in=tail_in, tail_out=tail_out,
                              config=cfg)
        outs.append((win, tail_out))
    assert default not in configs[1:]  # the others really are different launches
    for win, tail_out in outs[1:]:
        assert torch.equal(win, outs[0][0]) and torch.equal(tail_out, outs[0][1])


def test_sin_poly_accuracy_and_nan():
    """FAST_SIN's SnakeBeta against float64 over the range activations take (and far past it), and the
    non-finite inputs: nan in, nan out, as sinf. One channel with freq 1 and inv_mag 1: the window holds x +
    sin(x)^2."""
    xs = torch.cat([torch.linspace(-2000, 2000, 20001), torch.linspace(-4, 4, 4001),
                    torch.tensor([0.0, 1e-30, -1e-30, 3.14159265, 1.5707963])])
    x = xs.reshape(1, 1, -1).to(DEVICE)
    one = torch.ones(1, device=DEVICE)
    win = torch.empty_like(x)
    sk.conv_window_triton(x, win, freq=one, inv_mag=one, config=sk.WindowConfig(1, 1024, fast_sin=True))
    exact = xs.double() + torch.sin(xs.double()) ** 2
    err = (win.cpu().double() - exact).abs()
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp(min=1.0)  # the store's own rounding
    assert torch.all(err <= ulp + 4e-7), err.max()
    bad = torch.tensor([[[float("nan"), float("inf"), -float("inf")]]], device=DEVICE)
    out = torch.empty_like(bad)
    sk.conv_window_triton(bad, out, freq=one, inv_mag=one, config=sk.WindowConfig(1, 16, fast_sin=True))
    assert torch.isnan(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_window_fast_sin_against_torch_path(dtype):
    """The whole window with FAST_SIN (bias, residual, SnakeBeta, tails) against the kernel with libdevice's sine
    and, in fp32, against the PyTorch path: fp32 within 2e-6, bf16 at most one step of bf16 (both round once; the
    two sines may put a value on neighbouring bf16 numbers). The PyTorch path rounds bf16 after every op."""
    gen = torch.Generator().manual_seed(5)
    B, C, T, H = 2, 16, 40, 6
    y, res = _activation(B, C, T, True, gen, dtype), _activation(B, C, T, True, gen, dtype)
    tail_in = _activation(B, C, H, True, gen, dtype)
    freq, inv = constants(C, gen)
    bias = torch.randn(C, generator=gen).to(DEVICE)
    outs = []
    runs = [(sk.conv_window_triton, {"config": sk.WindowConfig(16, 8)}),
            (sk.conv_window_triton, {"config": sk.WindowConfig(16, 8, fast_sin=True)})]
    if dtype == torch.float32:
        runs.append((sk.conv_window_torch, {}))
    for fn, kw in runs:
        win = _activation(B, C, H + T, True, gen, dtype)
        fn(y, win, bias=bias, res=res, freq=freq.to(dtype), inv_mag=inv.to(dtype), tail_in=tail_in, **kw)
        outs.append(win.float())
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2e-6  # bf16's spacing at 1..2, relative below
    for other in outs[:1] + outs[2:]:
        diff = (other - outs[1]).abs()
        assert torch.all(diff <= step * other.abs().clamp(min=1.0)), diff.max()
    if dtype == torch.bfloat16:
        assert (outs[0] != outs[1]).float().mean() < 0.02  # neighbours only now and then


def test_conv_window_refuses_rows_past_int32_offsets():
    class Huge:  # a row of 2^31 elements: only its shape and strides are read before the refusal
        shape, dtype = (1, 2, 2**30 + 1), torch.float32

        def stride(self):
            return (2 * (2**30 + 1), 2**30 + 1, 1)

    assert sk._row_offsets_fit(torch.zeros(2, 3, 4))
    assert not sk._row_offsets_fit(Huge())


def test_window_tuner_smoke_checks_every_call_of_a_codec_step(tmp_path):
    """The tuner records a real codec step's window calls (every one the decoder makes: a kernel path taken without
    the window would leave the count short) and checks each candidate on each of them against the default."""
    import json

    from engine.tools.tune_conv_window import main

    assert main([str(tmp_path), "--smoke", "--batch", "2", "--frames", "2"]) == 0
    report = json.loads((tmp_path / "conv_window_tune.json").read_text())
    snakes = sum(r["snake"] for r in report["rows"])
    assert report["calls"] == len(report["rows"]) == 34 and snakes == 29  # the decoder's 29 SnakeBeta instances
    assert all(c["ok"] for r in report["rows"] for c in r["configs"])
    fast = [c for r in report["rows"] if r["snake"] for c in r["configs"] if c["config"]["fast_sin"]]
    assert fast and not all(c["identical"] for c in fast)  # the polynomial sine really ran (fp32 in --smoke)
    assert all(c["identical"] for r in report["rows"] if not r["snake"] for c in r["configs"])


def test_window_config_follows_the_tuning():
    """The tuned launch (docs/PERFORMANCE.md): the polynomial sine below fp32 only, 128 x 64 tiles of 8 warps for
    long channels-last windows, the old tiles elsewhere."""
    long_bf16 = sk.window_config(384, 1920, True, torch.bfloat16)
    assert long_bf16 == sk.WindowConfig(128, 64, num_warps=8, fast_sin=True)
    assert sk.window_config(384, 1920, True, torch.float32) == sk.WindowConfig(128, 64, num_warps=8, fast_sin=False)
    assert sk.window_config(512, 14, True, torch.bfloat16) == sk.WindowConfig(128, 16, fast_sin=True)
    assert sk.window_config(1, 23040, True, torch.bfloat16) == sk.WindowConfig(1, 1024, fast_sin=True)
    assert sk.window_config(24, 1920, False, torch.float32) == sk.WindowConfig(2, 1024)
