"""VOICELANE_COMPILE: the Code Predictor's forward through torch.compile gives the codes and logits of the eager
forward, with one traced graph per input signature (not one per group), and nothing falls back silently.

CI has no C++ compiler, so these run the "aot_eager" backend: dynamo's trace and AOT functionalisation (the cache
writes become functional updates copied back) exactly as inductor receives them, run by PyTorch.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (torch._dynamo imports it)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from engine import kernels  # noqa: E402
from engine.kernels import compiled as compiled_mod  # noqa: E402
from engine.kernels.compiled import compile_parts, compiled  # noqa: E402
from engine.model.checkpoint import load_checkpoint  # noqa: E402
from engine.model.sampling import SamplerRows  # noqa: E402


@pytest.fixture(scope="module")
def own_model(tiny_checkpoint):
    """A private copy: its compiled forward must not leak into the session model other tests use."""
    return load_checkpoint(tiny_checkpoint, "cpu", torch.float32)


@pytest.fixture
def compile_cp(monkeypatch, own_model):
    own_model.tts.talker.code_predictor._compiled = None  # each test compiles afresh
    monkeypatch.setenv("VOICELANE_COMPILE", "code_predictor")
    monkeypatch.setenv("VOICELANE_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(compiled_mod, "_compiles", [])
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _frame(model, B: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, model.cfg.talker.stack.hidden_size, generator=gen)
    code0 = torch.randint(0, 2048, (B,), generator=gen)
    # greedy, top-k, top-p and a sampled row: the sampler (outside the compiled forward) sees every kind of row
    rows = SamplerRows(torch.tensor([0.0, 0.9, 1.0, 0.7])[:B], torch.tensor([0, 50, 0, 0])[:B],
                       torch.tensor([1.0, 1.0, 0.8, 1.0])[:B], torch.arange(1, B + 1))
    return hidden, code0, rows, torch.arange(B) * 3


def _eager(model, *frame):
    cp = model.talker.code_predictor
    saved, cp._compiled = cp._compiled, None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VOICELANE_COMPILE", "off")
        out = model.codes_1_to_15(*frame, keep_logits=True)
    cp._compiled = saved
    return out


@torch.no_grad()
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_forward_matches_eager(own_model, compile_cp, backend):
    """With the Triton kernels forced (the interpreter), the compiled region still traces the PyTorch path: the
    kernels' switch says no while dynamo traces, else the trace would meet a Triton launch and fail."""
    model = own_model.tts
    with kernels.backend(backend):
        for B, seed in ((4, 1), (1, 2), (4, 3)):
            frame = _frame(model, B, seed)
            codes, logits = model.codes_1_to_15(*frame, keep_logits=True)
            ref_codes, ref_logits = _eager(model, *frame)
            assert torch.equal(codes, ref_codes), B
            assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) < 1e-5, B
    # batch 4 and batch 1, each: the first forward's 2 tokens and the other 14 forwards' one token; the third frame
    # (batch 4 again) and the 13 later groups of each frame (another head, other views) reuse them
    shapes = sorted((c["shape"][0], c["shape"][1]) for c in compiled_mod._compiles)
    assert shapes == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert counters["stats"]["unique_graphs"] == 4
    assert all(c["part"] == "code_predictor" and c["backend"] == "aot_eager" for c in compiled_mod._compiles)
    status = kernels.kernels_status()["compile"] if backend == "triton" else compiled_mod.compile_status()
    assert status["parts"] == ["code_predictor"] and len(status["compiles"]) == 4


@torch.no_grad()
def test_compiled_forward_writes_the_frame_cache(own_model, compile_cp):
    """The cache the forwards write in place (functionalised inside the trace, copied back) holds what eager
    writes: later forwards of a frame read it, and a caller's cache must see it."""
    model = own_model.tts
    cp = model.talker.code_predictor
    frame = _frame(model, 2, 5)
    caches = [cp.new_cache(2, "cpu", torch.float32) for _ in range(2)]
    model.codes_1_to_15(*frame, cache=caches[0])
    saved, cp._compiled = cp._compiled, None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VOICELANE_COMPILE", "off")
        model.codes_1_to_15(*frame, cache=caches[1])
    cp._compiled = saved
    assert caches[0].k.abs().sum() > 0
    for got, want in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_switch(monkeypatch):
    for value, parts in (("", set()), ("off", set()), ("on", {"code_predictor"}), ("code_predictor",
                                                                                      {"code_predictor"})):
        monkeypatch.setenv("VOICELANE_COMPILE", value)
        assert compile_parts() == parts
    monkeypatch.setenv("VOICELANE_COMPILE", "talker")
    with pytest.raises(ValueError, match="VOICELANE_COMPILE='talker'"):
        compile_parts()
    monkeypatch.setenv("VOICELANE_COMPILE", "on")
    monkeypatch.setenv("VOICELANE_COMPILE_BACKEND", "cudagraphs")
    with pytest.raises(ValueError, match="VOICELANE_COMPILE_BACKEND"):
        compiled("code_predictor", lambda x: x)
    with pytest.raises(ValueError, match="compiled part"):
        compiled("codec", lambda x: x)


def test_a_graph_break_is_an_error(compile_cp):
    """No silent eager fallback inside a compiled part: a break in the trace raises."""
    def breaks(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled("code_predictor", breaks)(torch.ones(3))
    assert compiled_mod._compiles == []
