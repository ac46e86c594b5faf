"""Random-weight models in the published geometry: in memory (random:1.7b) or written as a checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.model.checkpoint import CODEC_PREFIX, LoadedModel, save_weights
from engine.model.codec import CodecConfig, CodecDecoder, randomize_codec_
from engine.model.config import ModelConfig
from engine.model.presets import GENERATION_CONFIG, PREPROCESSOR_CONFIG, SIZES, codec_config, model_config
from engine.model.qwen3_tts import Qwen3TTS
from engine.model.random_weights import randomize_tts_

log = logging.getLogger("voicelane.random_model")


def build_random_model(size: str, device="cpu", dtype=torch.float32, seed: int = 0,
                       tokenizer_dir: Path | None = None) -> LoadedModel:
    """A model of the published geometry with seeded random weights, built directly on `device`."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = ModelConfig.from_dict(model_config(size), dict(GENERATION_CONFIG), where=f"random:{size}")
    codec_cfg = CodecConfig.from_dict(codec_config(size)["decoder_config"])
    with torch.device(device):
        tts = Qwen3TTS(cfg)
        codec = CodecDecoder(codec_cfg)
    randomize_tts_(tts, seed)
    randomize_codec_(codec, seed + 1)
    tts.to(dtype).eval()
    codec.to(dtype).eval()
    codec.prepare_inference()
    return LoadedModel(cfg, codec_cfg, tts, codec, tokenizer_dir, f"random:{size}", True)


def write_checkpoint(out: Path, size: str, seed: int = 0, dtype=torch.float32,
                     max_shard_bytes: int | None = None, tokenizer: bool = True) -> Path:
    """Write a random-weight checkpoint directory in the published layout (loadable by qwen-tts too)."""
    out = Path(out)
    (out / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    model = build_random_model(size, "cpu", dtype, seed)
    (out / "config.json").write_text(json.dumps(model_config(size), indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    save_weights(model.tts.state_dict(), out, max_shard_bytes)
    codec_tensors = {CODEC_PREFIX + k: v for k, v in model.codec.state_dict().items()}
    save_weights(codec_tensors, out / "speech_tokenizer")
    (out / "speech_tokenizer" / "config.json").write_text(json.dumps(codec_config(size), indent=2))
    (out / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    if tokenizer:
        from engine.text.tokenizer_files import write_tokenizer_files

        write_tokenizer_files(out)
    log.info("wrote random %s checkpoint (seed %d) to %s", size, seed, out)
    return out
