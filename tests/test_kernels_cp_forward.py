"""The Code Predictor's one-kernel forward (engine/kernels/cp_forward.py) against the model's own path, on the CPU
through triton's interpreter: logits and the caches it writes, in both modes, at the first forward (two tokens)
and later ones (up to the last cache column); its stacked weights; its switch."""

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
from engine.model.code_predictor import cp_forward_reference  # noqa: E402
from engine.model.layers import rope_cos_sin, signed_sin  # noqa: E402
from engine.model.random_model import build_random_model  # noqa: E402


@pytest.fixture(scope="module")
def code_predictor():
    return build_random_model("tiny", seed=4).tts.talker.code_predictor


def _inputs(cp, B: int, T: int, start: int, dtype, seed: int):
    """x [B, T, H], RoPE tables, positions start..start+T-1, cache rows in reverse order of the batch rows, and a
    cache whose columns hold random values (those below `start` are the frame's earlier keys and values)."""
    cfg = cp.model.cfg
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, cfg.hidden_size, generator=g).to(dtype)
    positions = (torch.arange(T) + start).expand(B, T)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
    cache = cp.new_cache(B + 1, "cpu", dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    slots = torch.arange(B, 0, -1)
    return x, cos, signed_sin(sin), cache, slots, positions


def _run(cp, mode: str, B: int, T: int, start: int, dtype, group: int = 3, ranges=None):
    x, cos, sin, cache, slots, positions = _inputs(cp, B, T, start, dtype, seed=B * 100 + T * 10 + start)
    stack = cp.to(dtype).model
    args = (stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight, cp.lm_head[group].weight)
    with torch.inference_mode():
        if mode == "reference":
            with kernels.backend("torch"):
                logits = cp_forward_reference(*args)
        elif mode == "streamed":  # engine/kernels/cp_stream.py (tests/test_kernels_cp_stream.py)
            from engine.kernels.cp_stream import stream_forward

            logits = stream_forward(*args)
        elif ranges is None:
            logits = cf.cp_forward(*args, mode)
        else:  # launches of step ranges (engine.tools.probe_cp_forward's cuts); each has fresh scratch buffers
            for step_range in ranges:
                logits = cf.cp_forward(*args, mode, step_range=step_range)
    return logits, cache.k, cache.v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("B", "T", "start"), [(1, 2, 0), (3, 1, 4), (2, 1, 15)])  # 15: the cache's last column
@pytest.mark.parametrize("mode", ["phased", "persistent"])
def test_forward_matches_the_model(code_predictor, dtype, B, T, start, mode):
    got = _run(code_predictor, mode, B, T, start, dtype)
    want = _run(code_predictor, "reference", B, T, start, dtype)
    tol = {torch.float32: 2e-5, torch.float16: 3e-3}[dtype]
    assert got[0].shape == (B, code_predictor.cfg.vocab_size) and got[0].dtype == dtype
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


def test_persistent_equals_phased_exactly(code_predictor):
    """The same arithmetic in the same order: a barrier step is a kernel boundary."""
    persistent = _run(code_predictor, "persistent", 2, 2, 0, torch.float32)
    phased = _run(code_predictor, "phased", 2, 2, 0, torch.float32)
    for a, b in zip(persistent, phased, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["phased", "persistent"])
def test_a_step_range_runs_exactly_those_steps(code_predictor, mode):
    """The probe's cuts (engine.tools.probe_cp_forward): steps 0 .. 6 are layers 0 and 1 through attention (steps 1
    and 6 write the cache), so those layers' cache columns equal the whole forward's and the later layers' are
    untouched; a range outside the forward is refused."""
    whole = _run(code_predictor, mode, 2, 1, 4, torch.float32)
    untouched = _inputs(code_predictor, 2, 1, 4, torch.float32, seed=2 * 100 + 10 + 4)[3]
    _, k, v = _run(code_predictor, mode, 2, 1, 4, torch.float32, ranges=[(0, 7)])
    assert torch.equal(k[:2], whole[1][:2]) and torch.equal(v[:2], whole[2][:2])
    assert torch.equal(k[2:], untouched.k[2:]) and torch.equal(v[2:], untouched.v[2:])
    assert not torch.equal(k[1], untouched.k[1])
    with pytest.raises(ValueError, match="step range"):
        _run(code_predictor, mode, 1, 1, 0, torch.float32, ranges=[(3, cf.steps(code_predictor.cfg.num_layers) + 1)])


def test_a_barrier_that_waits_in_vain_counts_a_timeout_and_goes_on(code_predictor):
    """A persistent grid whose programs cannot all be resident must not hang the device: here one program waits
    for two at every barrier; each of the forward's 25 barriers gives up after its polls and counts a timeout (the
    lone program did all the work, so its result is still the phased one)."""
    x, cos, sin, cache, slots, positions = _inputs(code_predictor, 1, 2, 0, torch.float32, seed=3)
    stack = code_predictor.float().model
    counters = cf.barrier_counters(1, stack.cfg.num_layers, "cpu")
    args = (stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight, code_predictor.lm_head[0].weight)
    with torch.inference_mode():
        waited = cf.cp_forward(*args, "persistent", counters[0], programs=1, barrier_target=2, spin_limit=3)
        phased = cf.cp_forward(*args, "phased")
    assert cf.barrier_timeouts(counters) == cf.steps(stack.cfg.num_layers) - 1
    assert counters[0, :-2].tolist() == [1] * (cf.steps(stack.cfg.num_layers) - 1)  # one arrival at each barrier
    torch.testing.assert_close(waited, phased, rtol=0, atol=0)
    ok = cf.barrier_counters(1, stack.cfg.num_layers, "cpu")
    with torch.inference_mode():
        cf.cp_forward(*args, "persistent", ok[0], programs=1)
    assert cf.barrier_timeouts(ok) == 0


def test_stacked_weights_are_views_and_follow_a_replaced_weight(caplog):
    """Stacking moves the layers' weights (no copy stays behind); a weight replaced afterwards is stacked again
    (logged) and used, not the stale one."""
    cp = build_random_model("tiny", seed=5).tts.talker.code_predictor
    before = {k: v.clone() for k, v in cp.state_dict().items()}
    stacked = cf.stacked_layers(cp.model)
    for i, layer in enumerate(cp.model.layers):
        assert layer.self_attn.q_proj.weight.data_ptr() == stacked.qkv[i].data_ptr()
        assert layer.mlp.down_proj.weight.data_ptr() == stacked.down[i].data_ptr()
    after = cp.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert cf.stacked_layers(cp.model) is stacked
    baseline = _run(cp, "phased", 1, 1, 2, torch.float32)[0]
    layer = cp.model.layers[1]
    layer.mlp.down_proj.weight = torch.nn.Parameter(layer.mlp.down_proj.weight * 3)
    with caplog.at_level(logging.WARNING, "voicelane.kernels.cp_forward"):
        changed = _run(cp, "phased", 1, 1, 2, torch.float32)[0]
    assert "stacking them again" in caplog.text
    assert cf.stacked_layers(cp.model) is not stacked
    torch.testing.assert_close(changed, _run(cp, "reference", 1, 1, 2, torch.float32)[0], rtol=2e-5, atol=2e-5)
    assert not torch.allclose(changed, baseline)


def test_another_launch_shape_gives_the_same_forward(code_predictor, monkeypatch):
    """VOICELANE_CP_FORWARD_TILES (a launch shape to measure on the H200) changes how the work is cut, not what is
    computed; a shape that cannot be a tensor-core tile is refused by name."""
    default = _run(code_predictor, "phased", 2, 2, 0, torch.float32)
    monkeypatch.setenv(cf.TILES_ENV, "qkv=64,residual=32,up=16/head=64/k=16,warps=2,stages=2")
    assert cf.Tiles.from_env() == cf.Tiles(qkv=64, residual=32, up=16, head=64, k=16, warps=2, stages=2)
    assert kernels.kernels_status()["cp_forward"]["tiles"]["qkv"] == 64  # /ready
    for ours, theirs in zip(_run(code_predictor, "persistent", 2, 2, 0, torch.float32), default, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)
    # the residual steps' K split in runs, reduced by the last run to arrive (the tiny model's K: 64 and 96)
    monkeypatch.setenv(cf.TILES_ENV, "split=2,k=16")
    split = _run(code_predictor, "persistent", 2, 2, 0, torch.float32)
    for ours, theirs in zip(split, default, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)
    for a, b in zip(split, _run(code_predictor, "phased", 2, 2, 0, torch.float32), strict=True):
        assert torch.equal(a, b)  # the split order fixes the sum, whichever program finishes last
    monkeypatch.setenv(cf.TILES_ENV, "split=4,k=32")  # 4 runs of 32 do not tile the tiny model's K of 64
    with pytest.raises(ValueError, match="do not tile"):
        _run(code_predictor, "phased", 1, 1, 0, torch.float32)
    for bad, message in (("residual=24", "power of two"), ("warps=3", "warps 3"), ("block=64", "names"),
                         ("qkv=x", "names"), ("split=3", "split=3")):
        monkeypatch.setenv(cf.TILES_ENV, bad)
        with pytest.raises(ValueError, match=message):
            cf.Tiles.from_env()


def test_a_batch_above_the_kernels_rows_runs_layer_by_layer_and_says_so(code_predictor, monkeypatch, caplog):
    monkeypatch.setenv(cf.CP_FORWARD_ENV, "persistent")
    monkeypatch.setattr(cf, "MAX_ROWS", 4)  # the first forward has two tokens a row: batches of 2 rows fit, 3 do not
    monkeypatch.setattr(cf, "_REFUSED_ROWS", set())
    cpu = torch.device("cpu")
    with kernels.backend("triton"), caplog.at_level(logging.WARNING, "voicelane.kernels.cp_forward"):
        assert code_predictor._forward_kernel(cpu, 2) is not None
        assert code_predictor._forward_kernel(cpu, 3) is None
        assert code_predictor._forward_kernel(cpu, 3) is None
    assert caplog.text.count("a Code Predictor forward of 6 rows runs the layer-by-layer kernels") == 1
    assert kernels.kernels_status()["cp_forward"]["layer_by_layer_rows"] == [6]  # /ready
    x, cos, sin, cache, slots, positions = _inputs(code_predictor, 3, 2, 0, torch.float32, seed=0)
    stack = code_predictor.float().model
    with pytest.raises(ValueError, match="6 rows, at most 4"):
        cf.cp_forward(stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight,
                      code_predictor.lm_head[0].weight, "phased")


def test_switch_and_shape_errors(code_predictor, monkeypatch):
    monkeypatch.setenv(cf.CP_FORWARD_ENV, "fast")
    with pytest.raises(ValueError, match="choose one of off, phased, persistent, streamed"):
        cf.cp_forward_mode()
    monkeypatch.setenv(cf.CP_FORWARD_ENV, "persistent")
    assert cf.cp_forward_mode() == "persistent"
    assert kernels.kernels_status()["cp_forward"]["mode"] == "persistent"  # /ready
    monkeypatch.delenv(cf.CP_FORWARD_ENV)
    assert cf.cp_forward_mode() == "off"
    x, cos, sin, cache, slots, positions = _inputs(code_predictor, 1, 1, 0, torch.float32, seed=0)
    stack = code_predictor.float().model
    with pytest.raises(ValueError, match="do not fit"):  # a head of the Talker's width
        cf.cp_forward(stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight,
                      torch.zeros(8, stack.cfg.hidden_size + 1), "phased")
    with pytest.raises(ValueError, match="phased or persistent"):
        cf.cp_forward(stack, x, cos, sin, cache.k, cache.v, slots, positions, stack.norm.weight,
                      code_predictor.lm_head[0].weight, "off")


def test_the_probe_tool_measures_every_step_and_shape_on_the_cpu(capsys):
    """engine.tools.probe_cp_forward's own logic (cuts, steps alone, barriers alone, shapes, the table) through
    triton's interpreter with one program; a bench that counts its calls stands in for the GPU timer."""
    from engine.tools import probe_cp_forward as probe

    loaded = build_random_model("tiny", seed=5)
    calls = []

    def bench(fn):
        fn()
        calls.append(1)
        return 0.001 * len(calls)

    # split=4 runs of k=32 cannot tile the tiny model's K of 64: that shape records its error, the others go on
    record = probe.probe(loaded, [2], ["default", "split=4/k=32", "warps=2/k=16"], device="cpu", bench=bench)
    steps = cf.steps(loaded.tts.talker.code_predictor.cfg.num_layers)
    row = record["batches"]["2"]
    assert list(row["shapes"]) == ["default", "split=4/k=32", "warps=2/k=16"]
    assert "do not tile" in row["shapes"]["split=4/k=32"]["error"] and "ms" in row["shapes"]["warps=2/k=16"]
    assert len(row["prefix_ms"]) == steps and len(row["phased_step_ms"]) == steps
    # shapes, cuts, steps alone, barriers alone, then (2 rows fit the streamed forward) streamed with both polls, 16
    # warps, without L2 hints, on layer 0's weights, and layer by layer
    assert len(calls) == 2 + 2 * steps + 1 + 6 and row["barrier_timeouts"] == 0 and row["stream_timeouts"] == 0
    streamed = ("streamed_ms", "streamed_acquire_poll_ms", "streamed_warps16_ms", "streamed_no_prefetch_ms",
                "streamed_l2_weights_ms", "layers_ms")
    assert [row[k] for k in streamed] == sorted(row[k] for k in streamed)  # the bench's order
    assert 0 < row["stream_vs_layers"] < 1e-5  # fp32: the two paths' sums in another order
    probe.print_tables(record, loaded.tts.talker.code_predictor.cfg.num_layers)
    out = capsys.readouterr().out
    assert "head" in out and "L0 qkv" in out and "barriers alone" in out and "do not tile" in out
    assert "streamed forward" in out
    assert "16 warps" in out and "without L2 hints" in out and "layer 0's weights" in out
    calls.clear()
    streamed_only = probe.probe(loaded, [1], ["default"], device="cpu", bench=bench, persistent=False)["batches"]["1"]
    assert len(calls) == 6 and streamed_only["shapes"] == {} and "barriers_only_ms" not in streamed_only
    assert streamed_only["prefix_ms"] == [] and streamed_only["phased_step_ms"] == []
    shapes_only = probe.probe(loaded, [1], ["default"], device="cpu", bench=bench, per_step=False)["batches"]["1"]
    assert shapes_only["prefix_ms"] == [] and shapes_only["phased_step_ms"] == [] and "ms" in shapes_only["shapes"][
        "default"]
