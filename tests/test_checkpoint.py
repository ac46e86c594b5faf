"""Checkpoint layout: our writer, our loader, and the official package loading each other's files."""

from __future__ import annotations

import json
import shutil

import parity
import pytest
import qwen_oracle
import torch
from safetensors.torch import load_file, save_file

from engine.model.checkpoint import CheckpointError, load_checkpoint
from engine.model.config import ConfigError
from engine.model.random_model import write_checkpoint


def _tensors(directory):
    index = directory / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    out = {}
    for f in files:
        out.update(load_file(str(directory / f)))
    return out


def test_layout_is_the_published_one(tiny_checkpoint):
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "speech_tokenizer/config.json", "speech_tokenizer/preprocessor_config.json",
                 "speech_tokenizer/model.safetensors"):
        assert (tiny_checkpoint / name).is_file(), name
    codec_keys = load_file(str(tiny_checkpoint / "speech_tokenizer" / "model.safetensors")).keys()
    assert all(k.startswith("decoder.") for k in codec_keys)


def test_official_modules_take_our_tensors_and_we_take_theirs(tiny_checkpoint, tiny_model, tmp_path):
    official = parity.official_model(tiny_checkpoint)  # load_state_dict(strict=True) inside
    ours = set(_tensors(tiny_checkpoint))
    assert ours == set(official.state_dict())

    # The other way: a checkpoint whose weights were saved from the official modules (fresh random init).
    torch.manual_seed(3)
    fresh = parity.official_model(tiny_checkpoint)
    for p in fresh.parameters():
        torch.nn.init.normal_(p, std=0.05)
    other = tmp_path / "official_saved"
    shutil.copytree(tiny_checkpoint, other)
    for f in other.glob("model*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in fresh.state_dict().items()}, str(other / "model.safetensors"))
    loaded = load_checkpoint(other)
    for name, value in loaded.tts.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_sharded_and_single_file_load_identically(tmp_path, tiny_model):
    sharded = write_checkpoint(tmp_path / "sharded", "tiny", seed=0, max_shard_bytes=2 * 2**20, tokenizer=False)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    loaded = load_checkpoint(sharded)
    for name, value in loaded.tts.state_dict().items():
        assert torch.equal(value, tiny_model.tts.state_dict()[name]), name


def test_load_in_bfloat16(tiny_checkpoint):
    loaded = load_checkpoint(tiny_checkpoint, "cpu", torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert loaded.codec(torch.zeros(1, 16, 2, dtype=torch.int64)).dtype == torch.bfloat16


def test_errors_name_file_tensor_and_shapes(tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    tensors = _tensors(broken)
    for f in broken.glob("model*.safetensors*"):
        f.unlink()
    name = "talker.model.layers.1.self_attn.k_proj.weight"
    tensors[name] = torch.zeros(3, 5)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(broken)
    msg = str(err.value)
    assert "model.safetensors" in msg and name in msg and "(3, 5)" in msg and "(64, 64)" in msg

    del tensors[name]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="k_proj.weight' is missing"):
        load_checkpoint(broken)

    (broken / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json: not found"):
        load_checkpoint(broken)


def test_official_front_door_runs_on_our_checkpoint(tiny_checkpoint):
    """Qwen3TTSModel.from_pretrained(DIR).generate_custom_voice(...) end to end, text tokenizer included."""
    qwen_oracle.install_stubs()
    from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel

    tts = Qwen3TTSModel.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    wavs, sample_rate = tts.generate_custom_voice(text="Hello there, this is a test.", speaker="Ryan",
                                                  language="English", max_new_tokens=12, do_sample=False,
                                                  subtalker_dosample=False)
    assert sample_rate == 24000
    assert len(wavs) == 1 and wavs[0].ndim == 1 and wavs[0].shape[0] % 1920 == 0 and wavs[0].shape[0] > 0
