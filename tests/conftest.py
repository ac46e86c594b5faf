"""Shared fixtures: a tiny random-weight checkpoint written once per test session, in the published layout."""

from __future__ import annotations

import os

import pytest
import torch

from engine.model.checkpoint import load_checkpoint
from engine.model.random_model import write_checkpoint

torch.set_num_threads(2)
# VOICELANE_TEST_DEVICE=cuda runs the engine tests on a GPU (fp32, TF32 off so tolerances stay those of fp32).
TEST_DEVICE = os.environ.get("VOICELANE_TEST_DEVICE", "cpu")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint, TEST_DEVICE, torch.float32)
