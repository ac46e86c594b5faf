"""The Code Predictor's streamed forward (engine/kernels/cp_stream.py, VOICELANE_CP_FORWARD=streamed) against the
model's own path, on the CPU through triton's interpreter (one program: its barriers are its own arrivals): logits
and the caches it writes, with one tile a step and with several a program; its barriers' timeouts; its row limit and
its switches."""

from __future__ import annotations

import logging
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported (they import lazily)
pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("the kernel tests need TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from engine import kernels  # noqa: E402
from engine.kernels import cp_forward as cf  # noqa: E402
from engine.kernels import cp_stream as cs  # noqa: E402
from engine.model.random_model import build_random_model  # noqa: E402
from tests.test_kernels_cp_forward import _inputs, _run  # noqa: E402

# columns a program per step kind, so that the single program walks several tiles of every step and the last tile
# of each is partial (the tiny model's N: q/k/v 128, residual 48, gate/up 96, head 2048)
SEVERAL_TILES = {"qkv": 48, "residual": 20, "up": 40, "head": 600}


def _model(dtype):
    cp = build_random_model("tiny", seed=4).tts.talker.code_predictor.to(dtype)
    cf.stacked_layers(cp.model)  # outside inference mode: the layers' parameters become views once
    return cp


@pytest.fixture(scope="module")
def code_predictor():
    return _model(torch.float32)


@pytest.fixture(scope="module")
def models(code_predictor):
    return {torch.float32: code_predictor, torch.float16: _model(torch.float16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("B", "T", "start"), [(1, 2, 0), (1, 1, 4), (2, 1, 15), (2, 2, 0)])  # 4 rows: the limit
def test_streamed_forward_matches_the_model(models, dtype, B, T, start, monkeypatch):
    code_predictor = models[dtype]
    want = _run(code_predictor, "reference", B, T, start, dtype)
    tol = {torch.float32: 2e-5, torch.float16: 3e-3}[dtype]
    for columns in (None, SEVERAL_TILES):
        monkeypatch.setattr(cs, "_TEST_COLUMNS", columns)
        got = _run(code_predictor, "streamed", B, T, start, dtype)
        assert got[0].shape == (B, code_predictor.cfg.vocab_size) and got[0].dtype == dtype
        for ours, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


def test_a_streamed_barrier_that_waits_in_vain_counts_a_timeout_and_goes_on(code_predictor):
    """One program waiting for two at each of the forward's 25 barriers gives up after its polls, counts a timeout
    each time and still finishes the forward (it did all the work itself)."""
    x, cos, sin, cache, slots, positions = _inputs(code_predictor, 1, 2, 0, torch.float32, seed=3)
    stack = code_predictor.float().model
    args = (stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight, code_predictor.lm_head[0].weight)
    waited_counters = cf.barrier_counters(1, stack.cfg.num_layers, "cpu")
    ok_counters = cf.barrier_counters(1, stack.cfg.num_layers, "cpu")
    acquiring_counters = cf.barrier_counters(1, stack.cfg.num_layers, "cpu")
    with torch.inference_mode():
        waited = cs.stream_forward(*args, waited_counters[0], programs=1, barrier_target=2, spin_limit=3)
        ok = cs.stream_forward(*args, ok_counters[0], programs=1)
        acquiring = cs.stream_forward(*args, acquiring_counters[0], programs=1, barrier_target=2, spin_limit=3,
                                      acquire_poll=True)  # every poll an acquire: the same count, the same result
    assert cf.barrier_timeouts(acquiring_counters) == cf.steps(stack.cfg.num_layers) - 1
    torch.testing.assert_close(acquiring, ok, rtol=0, atol=0)
    barriers = cf.steps(stack.cfg.num_layers) - 1
    assert cf.barrier_timeouts(waited_counters) == barriers
    assert waited_counters[0, :barriers].tolist() == [1] * barriers  # one arrival at each barrier
    assert cf.barrier_timeouts(ok_counters) == 0
    torch.testing.assert_close(waited, ok, rtol=0, atol=0)


def test_more_rows_than_it_takes_run_layer_by_layer_and_say_so(code_predictor, monkeypatch, caplog):
    monkeypatch.setenv(cf.CP_FORWARD_ENV, "streamed")
    monkeypatch.setattr(cf, "_REFUSED_ROWS", set())
    cpu = torch.device("cpu")
    with kernels.backend("triton"), caplog.at_level(logging.WARNING, "voicelane.kernels.cp_forward"):
        assert code_predictor._forward_kernel(cpu, 2) is not None  # the first forward: 2 rows x 2 tokens
        assert code_predictor._forward_kernel(cpu, 3) is None
    assert "cp_forward streamed takes at most 4 rows a launch; a Code Predictor forward of 6 rows" in caplog.text
    status = kernels.kernels_status()["cp_forward"]  # /ready
    assert status["mode"] == "streamed" and status["max_rows"] == cs.STREAM_ROWS == 4
    assert status["layer_by_layer_rows"] == [6]
    x, cos, sin, cache, slots, positions = _inputs(code_predictor, 3, 2, 0, torch.float32, seed=0)
    stack = code_predictor.float().model
    with pytest.raises(ValueError, match="6 rows, at most 4"):
        cs.stream_forward(stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight,
                          code_predictor.lm_head[0].weight)


def test_warps_switch(monkeypatch):
    assert cs.stream_warps() == cs.DEFAULT_WARPS == 16
    monkeypatch.setenv(cs.WARPS_ENV, "8")
    assert cs.stream_warps() == 8 and kernels.kernels_status()["cp_forward"]["stream_warps"] == 8
    monkeypatch.setenv(cs.WARPS_ENV, "12")
    with pytest.raises(ValueError, match="4, 8, 16 or 32"):
        cs.stream_warps()
