"""Parity with the official qwen-tts 0.1.1 package on the same random weights (fp32, CPU, greedy)."""

from __future__ import annotations

import parity
import pytest
import torch

from engine.model import layers

FRAMES = 32
CASES = [
    parity.Case("dual", "Ryan", "English", instruction=True),
    parity.Case("dual", "Vivian", "Auto", instruction=False),
    parity.Case("whole", "Vivian", "Auto", instruction=True),
    parity.Case("whole", "Ryan", "English", instruction=False),
]


@pytest.fixture(scope="module")
def official(tiny_checkpoint):
    return parity.official_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def prompt_ids():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 151643, (12,), generator=g).tolist(), torch.randint(0, 151643, (5,), generator=g).tolist()


@pytest.fixture(scope="module")
def official_runs(official, prompt_ids):
    text, instr = prompt_ids
    return {i: parity.official_greedy(official, case, text, instr, FRAMES) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_greedy_codes_identical(tiny_model, official_runs, prompt_ids, case_index):
    text, instr = prompt_ids
    ref = official_runs[case_index]
    assert ref.codes.shape == (FRAMES, 16), "the random model stopped early: parity would cover too few frames"
    ours = parity.our_greedy(tiny_model, CASES[case_index], text, instr, FRAMES)
    assert torch.equal(ours, ref.codes)


@pytest.mark.parametrize("case_index", [0, 2])
def test_teacher_forced_logits(tiny_model, official_runs, prompt_ids, case_index):
    text, instr = prompt_ids
    ref = official_runs[case_index]
    talker, cp = parity.our_teacher_forced(tiny_model, CASES[case_index], text, instr, ref.codes)
    assert parity.relative_error(talker, ref.talker_logits) < 1e-5
    assert parity.relative_error(cp, ref.cp_logits) < 1e-5


def test_waveform_matches_official_decoder(tiny_model, tiny_checkpoint, official_runs):
    import qwen_oracle
    from safetensors.torch import load_file

    T = qwen_oracle.codec_modeling()
    import json

    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config

    cfg = Qwen3TTSTokenizerV2Config(**json.loads((tiny_checkpoint / "speech_tokenizer" / "config.json").read_text()))
    cfg.decoder_config._attn_implementation = "eager"
    dec = T.Qwen3TTSTokenizerV2Decoder(cfg.decoder_config).eval()
    state = load_file(str(tiny_checkpoint / "speech_tokenizer" / "model.safetensors"))
    dec.load_state_dict({k.removeprefix("decoder."): v for k, v in state.items()}, strict=True)
    codes = official_runs[0].codes.T[None]  # [1, 16, T]
    with torch.no_grad():
        ref = dec.chunked_decode(codes)  # what the package's decode() runs
        ours = tiny_model.codec(codes)
    assert ours.shape == ref.shape
    assert ref.std() > 0.01, "degenerate codec weights: the comparison would prove nothing"
    assert float((ours - ref).abs().max()) < 1e-4


def _broken_rope(positions, head_dim, theta, dtype, _orig=layers.rope_cos_sin):
    return _orig(positions, head_dim, theta * 2, dtype)


@pytest.mark.parametrize("mutation", ["rope_theta", "no_qk_norm"])
def test_parity_detects_a_broken_model(tiny_model, official_runs, prompt_ids, monkeypatch, mutation):
    """The parity checks above must fail when a piece of the model is wrong."""
    if mutation == "rope_theta":
        monkeypatch.setattr(layers, "rope_cos_sin", _broken_rope)
    else:
        monkeypatch.setattr(layers.Attention, "forward", _attention_without_qk_norm)
    text, instr = prompt_ids
    ref = official_runs[0]
    talker, cp = parity.our_teacher_forced(tiny_model, CASES[0], text, instr, ref.codes)
    assert parity.relative_error(talker, ref.talker_logits) > 1e-3
    ours = parity.our_greedy(tiny_model, CASES[0], text, instr, FRAMES)
    assert not torch.equal(ours, ref.codes)


_attention_forward = layers.Attention.forward


def _attention_without_qk_norm(self, x, batch, k_cache, v_cache):
    saved = self.q_norm, self.k_norm
    self.q_norm = self.k_norm = torch.nn.Identity()
    try:
        return _attention_forward(self, x, batch, k_cache, v_cache)
    finally:
        self.q_norm, self.k_norm = saved
