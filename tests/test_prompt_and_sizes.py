"""Voices, languages, instructions, prompt layouts; both model sizes against the official module tree."""

from __future__ import annotations

import json

import parity
import pytest
import qwen_oracle
import torch

from engine.model.checkpoint import load_checkpoint, save_weights
from engine.model.config import ModelConfig
from engine.model.presets import model_config
from engine.model.prompt import (
    NO_CODEC,
    PromptError,
    build_prompt,
    instruction_ids,
    resolve_voice,
    spoken_languages,
    text_track_id,
)
from engine.model.qwen3_tts import Qwen3TTS
from engine.model.random_model import write_checkpoint
from engine.model.random_weights import randomize_tts_

CFG = ModelConfig.from_dict(model_config("tiny"))


def test_voices_and_languages_resolve_case_insensitively():
    v = resolve_voice(CFG, "Uncle_Fu", "EN")
    assert (v.speaker, v.speaker_id, v.language, v.language_id) == ("uncle_fu", 3010, "english", 2050)
    assert resolve_voice(CFG, "ryan", "Japanese").language_id == 2058
    assert resolve_voice(CFG, "ryan", "auto").language_id is None
    assert sorted(spoken_languages(CFG)) == sorted(["chinese", "english", "german", "italian", "portuguese",
                                                     "spanish", "japanese", "korean", "french", "russian"])
    for code, name in {"zh": "chinese", "de": "german", "it": "italian", "pt": "portuguese", "es": "spanish",
                       "ko": "korean", "fr": "french", "ru": "russian", "ja": "japanese"}.items():
        assert resolve_voice(CFG, "vivian", code).language == name


def test_dialect_speakers_override_chinese_and_auto_only():
    assert resolve_voice(CFG, "eric", "auto").language_id == 2062  # sichuan_dialect
    assert resolve_voice(CFG, "dylan", "zh").language_id == 2074  # beijing_dialect
    assert resolve_voice(CFG, "dylan", "english").language_id == 2050


@pytest.mark.parametrize("voice,language,code", [
    ("nobody", "en", "unknown_voice"), ("ryan", "klingon", "unknown_language"),
    ("ryan", "beijing_dialect", "unknown_language")])
def test_bad_voice_or_language_is_a_typed_error(voice, language, code):
    with pytest.raises(PromptError) as err:
        resolve_voice(CFG, voice, language)
    assert err.value.code == code


def test_prompt_layouts():
    voice = resolve_voice(CFG, "ryan", "english")
    text = [100, 101, 102]
    dual = build_prompt(CFG, voice, text, "dual")
    assert dual.codec_track == [NO_CODEC] * 3 + [2154, 2156, 2050, 2157, 3061, 2148, 2149]
    assert dual.text_track == [151644, 77091, 198] + [151671] * 5 + [151672, 100]
    whole = build_prompt(CFG, voice, text, "whole")
    assert whole.text_track[-5:] == [100, 101, 102, 151673, 151671]
    assert whole.codec_track[-5:] == [2148, 2148, 2148, 2148, 2149]
    auto = build_prompt(CFG, resolve_voice(CFG, "ryan", "auto"), text, "dual")
    assert len(auto) == len(dual) - 1 and 2155 in auto.codec_track
    # the text track of decode steps: next text token, then tts_eos, then tts_pad; None while text is missing
    assert [text_track_id(CFG, text, s, "dual", True) for s in range(4)] == [101, 102, 151673, 151671]
    assert text_track_id(CFG, text, 2, "dual", False) is None
    assert text_track_id(CFG, text, 0, "whole", True) == 151671
    with pytest.raises(PromptError):
        build_prompt(CFG, voice, text, "sideways")


def test_instructions_are_refused_on_the_06b_model():
    small = ModelConfig.from_dict(model_config("0.6b"))
    with pytest.raises(PromptError) as err:
        instruction_ids(small, [872, 198, 5])
    assert err.value.code == "invalid_field" and err.value.param == "instructions"
    assert instruction_ids(CFG, [872, 198, 5]) == [151644, 872, 198, 5, 151645, 198]


@pytest.mark.parametrize("size,params", [("1.7b", 1916.7e6), ("0.6b", 905.8e6)])
def test_full_size_module_tree_equals_the_official_one(size, params):
    M = qwen_oracle.modeling()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig

    with torch.device("meta"):
        ours = Qwen3TTS(ModelConfig.from_dict(model_config(size)))
        official = M.Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**model_config(size)))
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert ours_shapes == {k: tuple(v.shape) for k, v in official.state_dict().items()}
    assert abs(sum(p.numel() for p in ours.parameters()) - params) < 0.1e6


def test_06b_geometry_parity_with_identity_projection(tmp_path):
    """0.6B: the Code Predictor is as wide as the Talker, so small_to_mtp_projection is the identity."""
    config = model_config("tiny")
    config["talker_config"].update(hidden_size=48, intermediate_size=96)
    config["tts_model_size"] = "0b6"
    base = write_checkpoint(tmp_path / "base", "tiny", seed=1, tokenizer=False)
    ckpt = tmp_path / "small"
    (ckpt / "speech_tokenizer").mkdir(parents=True)
    for f in ("generation_config.json", "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors"):
        (ckpt / f).write_bytes((base / f).read_bytes())
    (ckpt / "config.json").write_text(json.dumps(config))
    model = Qwen3TTS(ModelConfig.from_dict(config))
    randomize_tts_(model, seed=5)
    assert not any("small_to_mtp" in k for k in model.state_dict())
    save_weights(model.state_dict(), ckpt)
    loaded = load_checkpoint(ckpt)
    official = parity.official_model(ckpt)
    case = parity.Case("dual", "Aiden", "English", instruction=False)
    text = list(range(2000, 2010))
    ref = parity.official_greedy(official, case, text, [], 24)
    assert ref.codes.shape[0] == 24
    assert torch.equal(parity.our_greedy(loaded, case, text, [], 24), ref.codes)
