"""Loading a Qwen3-TTS checkpoint directory exactly as published, and writing one in the same layout.

  DIR/config.json, generation_config.json
  DIR/model.safetensors                 or model-0000N-of-0000M.safetensors + model.safetensors.index.json
  DIR/vocab.json, merges.txt, tokenizer_config.json (and tokenizer.json)
  DIR/speech_tokenizer/config.json, preprocessor_config.json, model.safetensors (codec under "decoder.")
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engine.model.codec import CodecConfig, CodecDecoder
from engine.model.config import ModelConfig
from engine.model.qwen3_tts import Qwen3TTS

log = logging.getLogger("voicelane.checkpoint")
CODEC_PREFIX = "decoder."


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, the tensor and the fix."""


@dataclass
class LoadedModel:
    config: ModelConfig
    codec_config: CodecConfig
    tts: Qwen3TTS
    codec: CodecDecoder
    tokenizer_dir: Path | None  # where the text tokenizer files are
    source: str  # checkpoint directory or "random:<size>"
    random_weights: bool

    @property
    def device(self) -> torch.device:
        return self.tts.talker.codec_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tts.talker.codec_head.weight.dtype


def _weight_files(directory: Path) -> dict[str, Path]:
    """tensor name -> file, from a single model.safetensors or a sharded index."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise CheckpointError(f"{index}: names shard file(s) {missing} that are not in {directory}")
        return {name: directory / f for name, f in weight_map.items()}
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{directory}: neither model.safetensors nor model.safetensors.index.json found")


def load_weights(module: nn.Module, files: dict[str, Path], prefix: str = "", where: str = "") -> None:
    """Copy every parameter and persistent buffer of `module` from safetensors files, checking names and shapes."""
    expected = module.state_dict()
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        key = prefix + name
        if key not in files:
            raise CheckpointError(f"{where or 'checkpoint'}: tensor '{key}' is missing "
                                  f"(expected shape {tuple(expected[name].shape)})")
        by_file.setdefault(files[key], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                target = expected[name]
                found = f.get_slice(prefix + name).get_shape()
                if tuple(found) != tuple(target.shape):
                    raise CheckpointError(f"{path}: tensor '{prefix + name}' has shape {tuple(found)}, expected "
                                          f"{tuple(target.shape)} for this config.json (wrong or mixed checkpoint?)")
                with torch.no_grad():
                    target.copy_(f.get_tensor(prefix + name).to(device=target.device, dtype=target.dtype))
    unused = [k for k in files if k.startswith(prefix) and k[len(prefix):] not in expected]
    if unused:
        log.info("%s: %d tensors not used by voicelane (e.g. %s)", where, len(unused), unused[0])


def _materialise(factory, device, dtype) -> nn.Module:
    """Build a module without running its random init (weights are about to be overwritten)."""
    with torch.device("meta"):
        module = factory()
    module = module.to_empty(device=device)
    module.to(dtype)
    for sub in module.modules():
        if hasattr(sub, "init_buffers"):
            sub.init_buffers()
    return module.eval()


def load_checkpoint(directory: str | Path, device="cpu", dtype=torch.float32) -> LoadedModel:
    directory = Path(directory)
    cfg = ModelConfig.from_dir(directory)
    codec_dir = directory / "speech_tokenizer"
    codec_cfg_file = codec_dir / "config.json"
    if not codec_cfg_file.is_file():
        raise CheckpointError(f"{codec_cfg_file}: not found; a Qwen3-TTS checkpoint ships its codec in "
                              "speech_tokenizer/")
    codec_cfg = CodecConfig.from_dict(json.loads(codec_cfg_file.read_text()).get("decoder_config", {}))
    tts = _materialise(lambda: Qwen3TTS(cfg), device, dtype)
    load_weights(tts, _weight_files(directory), where=str(directory))
    codec = _materialise(lambda: CodecDecoder(codec_cfg), device, dtype)
    load_weights(codec, _weight_files(codec_dir), CODEC_PREFIX, where=str(codec_dir))
    codec.prepare_inference()  # inference constants from the loaded weights, made once
    has_tokenizer = (directory / "tokenizer.json").is_file() or (directory / "vocab.json").is_file()
    return LoadedModel(cfg, codec_cfg, tts, codec, directory if has_tokenizer else None, str(directory), False)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shard and max_bytes is not None and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def save_weights(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int | None = None) -> None:
    """model.safetensors, or model-0000N-of-0000M.safetensors + index when the weights pass max_shard_bytes."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shards = list(_shards(tensors, max_shard_bytes))
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
