"""Code Predictor preparation at load: the projected input tables give what per-step projection gives."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.model.checkpoint import load_checkpoint
from engine.model.sampling import SamplerRows


@pytest.fixture(scope="module")
def own_model(tiny_checkpoint):
    """A private copy: preparing it must not change the session model other tests use unprepared."""
    return load_checkpoint(tiny_checkpoint, "cpu", torch.float32)


def _frame_inputs(model, B: int):
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, model.cfg.talker.stack.hidden_size, generator=gen)
    code0 = torch.randint(0, 2048, (B,), generator=gen)
    rows = SamplerRows(torch.tensor([0.0, 0.9, 1.0, 0.0]), torch.tensor([0, 50, 0, 0]),
                       torch.tensor([1.0, 1.0, 0.8, 1.0]), torch.tensor([1, 2, 3, 4]))
    forced = torch.randint(0, 2048, (B, 15), generator=gen)
    return hidden, code0, rows, torch.tensor([0, 1, 2, 40]), forced


@torch.no_grad()
def test_prepared_tables_keep_codes_and_logits(own_model, caplog):
    model = own_model.tts
    cp = model.talker.code_predictor
    hidden, code0, rows, frame, forced = _frame_inputs(model, 4)
    cp.projected_codec_embedding = None  # as before prepare_inference() (load_checkpoint prepares)
    with caplog.at_level(logging.WARNING, logger="voicelane.code_predictor"):
        codes, logits = model.codes_1_to_15(hidden, code0, rows, frame, keep_logits=True)
        _, forced_logits = model.codes_1_to_15(hidden, code0, rows, frame, forced=forced, keep_logits=True)
    assert "prepare_inference() was not called" in caplog.text  # the slow path says so

    cp.prepare_inference()
    table = cp.projected_codec_embedding
    assert table.shape == (14, 2048, cp.cfg.hidden_size) and "projected_codec_embedding" not in model.state_dict()
    some = torch.tensor([0, 7, 2047])
    assert torch.allclose(table[3][some], cp.small_to_mtp_projection(cp.model.codec_embedding[3](some)), atol=1e-6)

    codes_p, logits_p = model.codes_1_to_15(hidden, code0, rows, frame, keep_logits=True)
    _, forced_p = model.codes_1_to_15(hidden, code0, rows, frame, forced=forced, keep_logits=True)
    assert logits_p.dtype == torch.float32 and logits_p.shape == (4, 15, 2048)
    assert torch.equal(codes_p, codes)
    for ours, ref in ((logits_p, logits), (forced_p, forced_logits)):
        assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-6


@torch.no_grad()
def test_preparation_follows_the_weights(own_model):
    """Tables are derived: a changed projection after prepare_inference() would be stale, a second call is not."""
    cp = own_model.tts.talker.code_predictor
    cp.prepare_inference()
    before = cp.projected_codec_embedding.clone()
    saved = cp.small_to_mtp_projection.bias.clone()
    try:
        cp.small_to_mtp_projection.bias.add_(1.0)
        cp.prepare_inference()
        assert torch.allclose(cp.projected_codec_embedding, before + 1.0, atol=1e-5)
    finally:
        cp.small_to_mtp_projection.bias.copy_(saved)
        cp.prepare_inference()
