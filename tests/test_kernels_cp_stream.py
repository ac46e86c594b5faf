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

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine import kernels  # noqa: E402
from engine.kernels import cp_forward as cf  # noqa: E402
from engine.kernels import cp_stream as cs  # noqa: E402
from engine.model.code_predictor import cp_forward_reference  # noqa: E402
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
    # one tile a step or several a program (the GPU's straight path, the interpreter's loop); K in one chunk, or in
    # chunks of 32 (the down projection's 96 columns in two parts of 64 and 32, cs.chunks)
    for columns, chunk in ((None, None), (SEVERAL_TILES, None), (None, 32), (SEVERAL_TILES, 32)):
        monkeypatch.setattr(cs, "_TEST_COLUMNS", columns)
        monkeypatch.setattr(cs, "_TEST_CHUNK", chunk)
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
    assert cs.stream_warps() == cs.DEFAULT_WARPS == 8
    monkeypatch.setenv(cs.WARPS_ENV, "16")
    assert cs.stream_warps() == 16 and kernels.kernels_status()["cp_forward"]["stream_warps"] == 16
    monkeypatch.setenv(cs.WARPS_ENV, "12")
    with pytest.raises(ValueError, match="4, 8, 16 or 32"):
        cs.stream_warps()


def test_the_probes_l2_variant_multiplies_every_layer_by_layer_0s_weights(code_predictor):
    """layer_weights=False (engine.tools.probe_cp_forward's "weights in L2" timing) is the forward of a model whose
    every layer has layer 0's projections and its own norms: what it times is a forward, with other weights."""
    twin = _model(torch.float32)
    stacked = cf.stacked_layers(twin.model)
    with torch.no_grad():
        for weights in (stacked.qkv, stacked.o, stacked.gate_up, stacked.down):
            weights[1:] = weights[0]  # the layers' parameters are views of these
    x, cos, sin, cache, slots, positions = _inputs(code_predictor, 1, 2, 0, torch.float32, seed=8)
    twin_cache_k, twin_cache_v = cache.k.clone(), cache.v.clone()
    with torch.inference_mode():
        stack = code_predictor.model
        probed = cs.stream_forward(stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight,
                                   code_predictor.lm_head[0].weight, layer_weights=False)
        usual = cs.stream_forward(stack, x, cos, sin, cache.k.clone(), cache.v.clone(), slots, positions,
                                  stack.norm.weight, code_predictor.lm_head[0].weight)
        with kernels.backend("torch"):
            want = cp_forward_reference(twin.model, x, cos, sin, twin_cache_k, twin_cache_v, slots, positions,
                                        twin.model.norm.weight, twin.lm_head[0].weight)
    torch.testing.assert_close(probed, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(cache.k, twin_cache_k, rtol=2e-5, atol=2e-5)
    assert (probed - usual).abs().max() > 1e-3  # the layers' own weights do differ


def test_stamps_take_an_int64_buffer_of_every_programs_marks(code_predictor):
    x, cos, sin, cache, slots, positions = _inputs(code_predictor, 1, 1, 3, torch.float32, seed=2)
    stack = code_predictor.model
    args = (stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight, code_predictor.lm_head[0].weight)
    assert cs.stamp_marks(stack.cfg.num_layers) == 2 * cf.steps(stack.cfg.num_layers)
    for bad in (torch.zeros(1, cs.stamp_marks(stack.cfg.num_layers), 2, dtype=torch.int32),
                torch.zeros(2, cs.stamp_marks(stack.cfg.num_layers), 2, dtype=torch.int64)):
        with pytest.raises(ValueError, match="stamps"):
            cs.stream_forward(*args, programs=1, stamps=bad)


def test_the_probes_timeline_reads_work_wait_spread_and_release_from_the_stamps():
    """engine.tools.probe_cp_forward.timeline on stamps of a made-up forward (one layer, three programs whose clocks
    run at different rates from different origins): each program works 1 + step + 0.5 * program us, the barrier
    lets the first waiter through 0.25 us after the last arrival and program p 0.1 * p us after that."""
    from engine.tools.probe_cp_forward import PHASE_NAMES, timeline

    layers, programs = 1, 3
    n_steps = cf.steps(layers)
    rates = [1000.0, 1500.0, 2000.0]  # cycles a us
    launches = []
    for launch in range(2):  # the second 50 us later: the timeline is per launch
        stamps = torch.zeros(programs, cs.stamp_marks(layers), 2, dtype=torch.int64)
        start = [0.3 * p + 50.0 * launch for p in range(programs)]
        for s in range(n_steps):
            end = [start[p] + 1 + s + 0.5 * p for p in range(programs)]
            for p in range(programs):
                for mark, t in ((2 * s, start[p]), (2 * s + 1, end[p])):
                    stamps[p, mark, 0] = round(t * 1000) + 7_000_000  # the timer in ns
                    stamps[p, mark, 1] = round(123_456 * (p + 1) + t * rates[p])  # the clock in cycles
            start = [max(end) + 0.25 + 0.1 * p for p in range(programs)]
        launches.append(stamps.numpy())
    import numpy as np

    got = timeline(np.stack(launches), layers)
    spreads = []  # by hand: each step's last arrival minus its first
    start = [0.3 * p for p in range(programs)]
    for s in range(n_steps):
        end = [start[p] + 1 + s + 0.5 * p for p in range(programs)]
        spreads.append(max(end) - min(end))
        start = [max(end) + 0.25 + 0.1 * p for p in range(programs)]
    values = sorted({int(v) for stamps in launches for v in stamps[:, :, 0].ravel()})
    smallest_gap = min(b - a for a, b in zip(values, values[1:], strict=False)) / 1e3
    assert got["launches"] == 2 and got["timer_step_us"] == pytest.approx(smallest_gap)
    for s, name in enumerate((*PHASE_NAMES, "head")):
        kind = got["kinds"][name]
        assert abs(kind["work_us"] - (1.5 + s)) < 0.01 and abs(kind["work_slowest_us"] - (2 + s)) < 0.01, (name, kind)
        assert abs(kind["spread_us"] - spreads[s]) < 0.01
        if name == "head":
            assert kind["wait_us"] == 0 and kind["release_us"] == 0
        else:
            assert abs(kind["release_us"] - 0.25) < 0.01
    first_wait = got["kinds"]["qkv"]["wait_us"]  # median program (p = 1) of step 0
    ends = [0.3 * p + 1 + 0.5 * p for p in range(programs)]
    assert abs(first_wait - (max(ends) + 0.25 + 0.1 - ends[1])) < 0.01


def test_k_comes_in_at_most_two_parts_of_a_power_of_two_chunks():
    assert cs.chunks(1024, 256) == (4, 0) and cs.chunks(2048, 256) == (8, 0)
    assert cs.chunks(3072, 256) == (8, 4)  # the real down projection: 12 chunks
    assert cs.chunks(96, 32) == (2, 1) and cs.chunks(48, 64) == (1, 0)
    assert cs.chunks(5 * 32, 32) == (4, 1) and cs.chunks(7 * 32, 32) == (4, 4)  # the rest rounded up, masked


@triton.jit
def _lines_probe(w_ptr, out_ptr, tile, N: tl.constexpr, K: tl.constexpr, CN: tl.constexpr, BN: tl.constexpr,
                 LINES: tl.constexpr):
    """What lies at each of cp_stream._lines' addresses (w holds its own flat index)."""
    at = cs._lines(w_ptr, tile, N, K, CN, BN)
    tl.store(out_ptr + tl.arange(0, BN)[:, None] * LINES + tl.arange(0, LINES)[None, :], tl.load(at).to(tl.int32))


@pytest.mark.parametrize("tile", [0, 5, 127, 128, 131])
def test_l2_hints_cover_the_tiles_lines_and_stay_inside_the_weights(tile):
    """_prefetch's addresses (cp_stream._lines) for the real o projection's cut (1024 rows of 2048, 8 rows a tile,
    132 programs: tiles 128 to 131 have no rows), fp32 weights (32 a 128-byte line) that hold their own index:
    one address in each line of the tile's rows, none outside w."""
    N, K, CN, BN = 1024, 2048, 8, 16
    lines = K * 4 // 128
    w = torch.arange(N * K, dtype=torch.float32).reshape(N, K)
    out = torch.full((BN, lines), -1, dtype=torch.int32)
    _lines_probe[(1,)](w, out, tile, N=N, K=K, CN=CN, BN=BN, LINES=lines)
    hit = {(int(v) // K, int(v) % K // 32) for v in out.flatten()}  # (row, line)
    assert all(0 <= int(v) < N * K for v in out.flatten())
    if tile * CN < N:
        assert hit == {(n, k) for n in range(tile * CN, tile * CN + CN) for k in range(lines)}
    else:
        assert {n for n, _ in hit} == {N - 1}
