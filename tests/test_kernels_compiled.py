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
    own_model.tts.talker.code_predictor._compiled = own_model.tts.talker._compiled = None  # each test compiles afresh
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
    both = {"code_predictor", "talker"}
    for value, parts in (("", set()), ("off", set()), ("on", both), ("code_predictor", {"code_predictor"}),
                         ("talker, code_predictor", both)):
        monkeypatch.setenv("VOICELANE_COMPILE", value)
        assert compile_parts() == parts
    monkeypatch.setenv("VOICELANE_COMPILE", "codec")
    with pytest.raises(ValueError, match="VOICELANE_COMPILE='codec'"):
        compile_parts()
    monkeypatch.setenv("VOICELANE_COMPILE", "on")
    monkeypatch.setenv("VOICELANE_COMPILE_BACKEND", "cudagraphs")
    with pytest.raises(ValueError, match="VOICELANE_COMPILE_BACKEND"):
        compiled("code_predictor", lambda x: x)
    with pytest.raises(ValueError, match="compiled part"):
        compiled("codec", lambda x: x)
    monkeypatch.setenv("VOICELANE_COMPILE_BACKEND", "inductor")
    monkeypatch.setenv("VOICELANE_COMPILE_MODE", "reduce-overhead")
    with pytest.raises(ValueError, match="VOICELANE_COMPILE_MODE='reduce-overhead'.*nest"):
        compiled("code_predictor", lambda x: x)
    monkeypatch.setenv("VOICELANE_COMPILE_MODE", "max-autotune-no-cudagraphs")
    assert compiled_mod.compile_status()["mode"] == "max-autotune-no-cudagraphs"


def test_a_graph_break_is_an_error(compile_cp):
    """No silent eager fallback inside a compiled part: a break in the trace raises."""
    def breaks(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled("code_predictor", breaks)(torch.ones(3))
    assert compiled_mod._compiles == []


def _greedy(model, frames: int) -> dict[int, torch.Tensor]:
    from engine.model.generate import Frame, GenerationRequest, generate
    from engine.model.prompt import build_prompt, resolve_voice
    from engine.model.sampling_params import SamplingParams

    voice = resolve_voice(model.config, "ryan", "english")
    requests = []
    for i, n in enumerate((3, 10)):
        text = list(range(1000 + 7 * i, 1000 + 7 * i + n))
        requests.append(GenerationRequest(build_prompt(model.config, voice, text, "whole", None), text, "whole",
                                          SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=frames)))
    codes: dict[int, list] = {}
    for event in generate(model.tts, requests):
        if isinstance(event, Frame):
            codes.setdefault(event.request, []).append(event.codes)
    return {r: torch.stack(c) for r, c in codes.items()}


@torch.no_grad()
def test_compiled_talker_and_code_predictor_generate_the_eager_codes(own_model, compile_cp, monkeypatch):
    """Both parts compiled, the Triton kernels forced (the interpreter): the same greedy codes as the eager Triton
    path, the Talker's decode steps compiled once per batch size (not per attention length), and attention inside
    both compiled parts run as the Triton kernels' op."""
    from engine.kernels import attention

    monkeypatch.setenv("VOICELANE_COMPILE", "talker,code_predictor")
    calls = []
    real = attention.layer_attention
    monkeypatch.setattr(attention, "layer_attention", lambda *a: calls.append(torch.compiler.is_compiling())
                        or real(*a))
    with kernels.backend("triton"):
        compiled_codes = _greedy(own_model, 3)
        assert calls and not any(calls)  # run by the op's implementation, not traced into the graph
        monkeypatch.setenv("VOICELANE_COMPILE", "off")
        eager_codes = _greedy(own_model, 3)
    assert compiled_codes.keys() == eager_codes.keys() == {0, 1}
    for r in eager_codes:
        assert compiled_codes[r].shape == (3, 16) and torch.equal(compiled_codes[r], eager_codes[r]), r
    talker = [c for c in compiled_mod._compiles if c["part"] == "talker"]
    assert talker and all(c["shape"][1] == 1 for c in talker)  # decode steps only: the prefill stays eager
    # every graph dynamo made is one of the recorded input signatures: the attention length, which changes every
    # frame, made none of its own
    assert counters["stats"]["unique_graphs"] == len(compiled_mod._compiles)


def test_compiled_talker_needs_the_attention_kernels(own_model, compile_cp, monkeypatch):
    monkeypatch.setenv("VOICELANE_COMPILE", "talker")
    talker = own_model.tts.talker
    cache = talker.new_cache(2, 8, "cpu", torch.float32)
    x = torch.zeros(1, 1, talker.cfg.stack.hidden_size)
    with kernels.backend("torch"), pytest.raises(kernels.KernelsUnavailable, match="VOICELANE_COMPILE=talker"):
        talker(x, torch.tensor([0]), torch.tensor([[0]]), cache, 1, last=torch.tensor([0]))


def test_status_names_inductors_cache(monkeypatch, tmp_path):
    import sys

    monkeypatch.setenv("VOICELANE_COMPILE", "talker")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert compiled_mod.compile_status()["inductor_cache"] == str(tmp_path)
    monkeypatch.setitem(sys.modules, "torch._inductor.runtime.cache_dir_utils", None)  # torch moved its helper
    assert compiled_mod.compile_status()["inductor_cache"] == str(tmp_path)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compiled_mod.compile_status()["inductor_cache"].startswith("unknown (")


def test_past_the_recompile_limit_is_an_error(compile_cp):
    """Dynamo's default past its limit is to run eagerly with a warning; a compiled part raises instead."""
    step = compiled("talker", lambda x: x + 1)
    for n in range(1, compiled_mod.RECOMPILE_LIMIT + 1):
        assert torch.equal(step(torch.zeros(n)), torch.ones(n))
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        step(torch.zeros(compiled_mod.RECOMPILE_LIMIT + 1))


def test_gpu_check_reports_compiled_against_uncompiled_codes(tmp_path, monkeypatch):
    """With VOICELANE_COMPILE on, --graphs-only adds a row: the compiled run's greedy codes against the same run
    with nothing compiled (here both parts, aot_eager, fp32 on the interpreter: the same codes). A compiled part
    that computed something else would show as an agreement below 1."""
    import json

    from engine.model.code_predictor import CodePredictor
    from engine.tools.gpu_check_kernels import main

    monkeypatch.setenv("VOICELANE_COMPILE", "on")
    monkeypatch.setenv("VOICELANE_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    argv = [str(tmp_path), "--smoke", "--graphs-only", "--model", "random:tiny", "--batches", "2", "--frames", "3"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "gpu_check_kernels.json").read_text())["model_checks"]
    assert [r["check"].split(", ")[1] for r in rows] == ["graphs emulate vs eager",
                                                         "compiled (code_predictor+talker) vs not compiled"]
    assert rows[1]["agreement"] == 1.0 and rows[1]["first_divergent_frame"] is None
    assert os.environ["VOICELANE_COMPILE"] == "on"
    # and the row can fail: a compiled Code Predictor that adds to its logits picks other codes
    real = CodePredictor._compiled_forward

    def skewed(self):
        forward = real(self)
        if forward is None:
            return None
        return lambda group, x, batch, cache: forward(group, x, batch, cache) + torch.arange(
            self.lm_head[0].weight.shape[0], dtype=torch.float32) * 1e3
    monkeypatch.setattr(CodePredictor, "_compiled_forward", skewed)
    torch._dynamo.reset()
    assert main(argv) == 0
    rows = json.loads((tmp_path / "gpu_check_kernels.json").read_text())["model_checks"]
    assert rows[1]["agreement"] < 1.0 and rows[1]["first_divergent_frame"] == 0
    torch._dynamo.reset()
