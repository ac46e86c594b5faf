"""Load-time weight preparation: fused q/k/v and gate/up matrices give the separate projections' results, and the
checkpoint layout (names, shapes, values) does not change."""

from __future__ import annotations

import torch

from engine.model.checkpoint import load_checkpoint, prepare_inference
from engine.model.layers import MLP, Attention, FusedRows
from engine.model.random_model import build_random_model


def _fused(tts) -> list[FusedRows | None]:
    return [m.qkv if isinstance(m, Attention) else m.gate_up for m in tts.modules() if isinstance(m, Attention | MLP)]


def test_loading_prepares_every_decoder_layer_and_keeps_the_state_dict(tiny_model):
    plain = build_random_model("tiny", prepare=False)
    assert len(_fused(plain.tts)) == 8 and all(f is None for f in _fused(plain.tts))  # 2 + 2 layers, attn + MLP
    assert all(f is not None and f.intact() for f in _fused(tiny_model.tts))
    ours, reference = tiny_model.tts.state_dict(), plain.tts.state_dict()
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(ours[name], value), name


def test_fused_projection_equals_the_separate_ones():
    torch.manual_seed(0)
    lins = [torch.nn.Linear(24, n, bias=False) for n in (16, 8, 8)]
    x = torch.randn(3, 5, 24)
    expected = [lin(x) for lin in lins]
    fused = FusedRows(*lins)
    for got, want in zip(fused(x), expected, strict=True):
        torch.testing.assert_close(got, want)
    # The separate weights are views of the fused matrix: loading new values into them updates both.
    with torch.no_grad():
        lins[1].weight.mul_(2)
    assert torch.allclose(fused(x)[1], 2 * expected[1], atol=1e-5)


def test_a_conversion_after_preparation_refuses_stale_fused_weights(tiny_model):
    model = build_random_model("tiny").tts
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    x = torch.randn(2, 3, attn.q_proj.in_features, dtype=torch.float64)
    model.double()  # new storage for every Parameter: the fused matrix no longer holds them
    assert not attn.qkv.intact()
    q, k, v = attn.project(x)
    torch.testing.assert_close(q, attn.q_proj(x))
    torch.testing.assert_close(v, attn.v_proj(x))
    assert attn.qkv.intact() and attn.qkv.weight.dtype == torch.float64


def test_a_prepared_model_saves_and_loads_in_the_published_layout(tmp_path):
    from engine.model.random_model import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", "tiny", seed=3, tokenizer=False)
    loaded = load_checkpoint(path)
    fresh = build_random_model("tiny", seed=3)
    for name, value in fresh.tts.state_dict().items():
        assert torch.equal(loaded.tts.state_dict()[name], value), name
    assert prepare_inference(torch.nn.Linear(2, 2)) == 0  # nothing to prepare is not an error


def test_stacked_frame_tables_give_the_same_frame_embedding(tiny_model):
    plain = build_random_model("tiny", prepare=False).tts.talker
    prepared = tiny_model.tts.talker
    assert prepared.frame_tables is not None and plain.frame_tables is None
    g = torch.Generator().manual_seed(2)
    code0 = torch.tensor([0, 3071, 2150])  # the first and last rows of code 0's table, and EOS
    rest = torch.randint(0, 2048, (3, 15), generator=g)
    rest[0], rest[1] = 0, 2047  # first and last rows of every Code Predictor table
    with torch.no_grad():
        assert torch.equal(prepared.frame_embedding(code0, rest), plain.frame_embedding(code0, rest))
