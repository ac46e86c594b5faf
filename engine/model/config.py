"""Configuration of a Qwen3-TTS 12 Hz CustomVoice checkpoint, read from its config.json files.

The dataclasses hold only what the model code reads; the published files carry more (HF legacy fields),
which are ignored. Every value that shapes a tensor comes from the checkpoint, never from a default here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A checkpoint configuration that cannot be used; the message names the file, the field and the fix."""


def _need(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing field '{key}' (is this a Qwen3-TTS 12 Hz checkpoint?)")
    return d[key]


@dataclass(frozen=True)
class DecoderStackConfig:
    """One Qwen3-style pre-norm decoder stack (the Talker's or the Code Predictor's)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # output classes: 3072 codec ids (Talker), 2048 codes per group (Code Predictor)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> DecoderStackConfig:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported (Qwen3-TTS uses 'silu')")
        if d.get("attention_bias", False):
            raise ConfigError(f"{where}: attention_bias=true is not supported (Qwen3-TTS has no attention biases)")
        heads = int(_need(d, "num_attention_heads", where))
        hidden = int(_need(d, "hidden_size", where))
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=int(_need(d, "intermediate_size", where)),
            num_layers=int(_need(d, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(_need(d, "num_key_value_heads", where)),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(_need(d, "rms_norm_eps", where)),
            rope_theta=float(_need(d, "rope_theta", where)),
            vocab_size=int(_need(d, "vocab_size", where)),
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{cfg.num_kv_heads}")
        return cfg


@dataclass(frozen=True)
class TalkerConfig:
    stack: DecoderStackConfig
    code_predictor: DecoderStackConfig
    num_code_groups: int  # 16 codebooks per frame: code 0 from the Talker, 1..15 from the Code Predictor
    text_vocab_size: int
    text_hidden_size: int
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speaker_ids: dict[str, int]  # lower-case speaker name -> codec id (a row of codec_embedding)
    speaker_dialect: dict[str, str | None]  # speaker -> dialect language name, or None
    language_ids: dict[str, int]  # lower-case language name -> codec id


@dataclass(frozen=True)
class ModelConfig:
    talker: TalkerConfig
    model_size: str  # "1b7" or "0b6"
    model_type: str  # "custom_voice"
    im_start_id: int
    im_end_id: int
    assistant_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    generation: dict[str, Any] = field(default_factory=dict)  # generation_config.json as published

    @property
    def supports_instructions(self) -> bool:
        # The official wrapper drops instructions for the 0.6B model; we refuse them instead.
        return self.model_size != "0b6"

    @classmethod
    def from_dict(cls, d: dict, generation: dict | None = None, where: str = "config.json") -> ModelConfig:
        t = _need(d, "talker_config", where)
        cp = _need(t, "code_predictor_config", f"{where} talker_config")
        dialect = {k.lower(): (v or None) for k, v in t.get("spk_is_dialect", {}).items()}
        model_type = d.get("tts_model_type", "custom_voice")
        if model_type != "custom_voice":
            raise ConfigError(f"{where}: tts_model_type {model_type!r} is not served; voicelane serves CustomVoice "
                              "checkpoints (Qwen3-TTS-12Hz-1.7B-CustomVoice or -0.6B-CustomVoice)")
        if d.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
            raise ConfigError(f"{where}: tokenizer_type {d.get('tokenizer_type')!r} is not supported; "
                              "only the 12 Hz tokenizer ('qwen3_tts_tokenizer_12hz') is")
        talker = TalkerConfig(
            stack=DecoderStackConfig.from_dict(t, f"{where} talker_config"),
            code_predictor=DecoderStackConfig.from_dict(cp, f"{where} talker_config.code_predictor_config"),
            num_code_groups=int(_need(t, "num_code_groups", where)),
            text_vocab_size=int(_need(t, "text_vocab_size", where)),
            text_hidden_size=int(_need(t, "text_hidden_size", where)),
            codec_pad_id=int(_need(t, "codec_pad_id", where)),
            codec_bos_id=int(_need(t, "codec_bos_id", where)),
            codec_eos_id=int(_need(t, "codec_eos_token_id", where)),
            codec_think_id=int(_need(t, "codec_think_id", where)),
            codec_nothink_id=int(_need(t, "codec_nothink_id", where)),
            codec_think_bos_id=int(_need(t, "codec_think_bos_id", where)),
            codec_think_eos_id=int(_need(t, "codec_think_eos_id", where)),
            speaker_ids={k.lower(): int(v) for k, v in _need(t, "spk_id", where).items()},
            speaker_dialect=dialect,
            language_ids={k.lower(): int(v) for k, v in _need(t, "codec_language_id", where).items()},
        )
        return cls(
            talker=talker,
            model_size=str(d.get("tts_model_size", "1b7")),
            model_type=model_type,
            im_start_id=int(_need(d, "im_start_token_id", where)),
            im_end_id=int(_need(d, "im_end_token_id", where)),
            assistant_id=int(d.get("assistant_token_id", 77091)),
            tts_pad_id=int(_need(d, "tts_pad_token_id", where)),
            tts_bos_id=int(_need(d, "tts_bos_token_id", where)),
            tts_eos_id=int(_need(d, "tts_eos_token_id", where)),
            generation=dict(generation or {}),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file}: not found; --model must be a Qwen3-TTS checkpoint directory "
                              "(config.json, model.safetensors, speech_tokenizer/, tokenizer files)")
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(json.loads(cfg_file.read_text()), generation, where=str(cfg_file))
