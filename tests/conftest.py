"""Shared fixtures: a tiny random-weight checkpoint written once per test session, in the published layout."""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoint import load_checkpoint
from engine.model.random_model import write_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint, "cpu", torch.float32)
