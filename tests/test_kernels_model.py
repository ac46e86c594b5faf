"""The whole model on the fused Triton path (forced on the CPU, run by triton's interpreter) against its PyTorch
path: the same greedy codes and close logits; and the switch that picks the path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported (they import lazily)
pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("forcing the Triton path on the CPU needs TRITON_INTERPRET=1", allow_module_level=True)

from engine import kernels  # noqa: E402
from engine.model.generate import Frame, GenerationRequest, generate  # noqa: E402
from engine.model.prompt import build_prompt, resolve_voice  # noqa: E402
from engine.model.random_model import build_random_model  # noqa: E402
from engine.model.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return build_random_model("tiny", seed=4)


def _requests(model, frames: int) -> list[GenerationRequest]:
    voice = resolve_voice(model.config, "ryan", "english")
    out = []
    for i, n in enumerate((3, 10)):  # two prompt lengths: a right-padded batched prefill
        text = list(range(1000 + 7 * i, 1000 + 7 * i + n))
        out.append(GenerationRequest(build_prompt(model.config, voice, text, "whole", None), text, "whole",
                                     SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=frames)))
    return out


def _greedy(model, frames: int) -> dict[int, torch.Tensor]:
    codes: dict[int, list] = {}
    for event in generate(model.tts, _requests(model, frames)):
        if isinstance(event, Frame):
            codes.setdefault(event.request, []).append(event.codes)
    return {r: torch.stack(c) for r, c in codes.items()}


@pytest.mark.parametrize(("linear", "short", "cp_forward"),
                         [("cublas", "off", "off"), ("triton", "off", "off"), ("cublas", "on", "off"),
                          ("cublas", "off", "persistent"), ("cublas", "off", "streamed")])
def test_greedy_codes_identical_on_both_paths(model, linear, short, cp_forward, monkeypatch):
    """linear: F.linear, or the skinny kernel for every decode GEMM; short: the Code Predictor's attention in one
    launch a layer (short_attention) or two; cp_forward: each Code Predictor forward in one kernel."""
    monkeypatch.setenv("VOICELANE_LINEAR", linear)
    monkeypatch.setenv("VOICELANE_SHORT_ATTENTION", short)
    monkeypatch.setenv("VOICELANE_CP_FORWARD", cp_forward)
    from engine.kernels import cp_forward as one_kernel
    from engine.kernels import cp_stream

    launched = []
    real, real_streamed = one_kernel.cp_forward, cp_stream.stream_forward
    monkeypatch.setattr(one_kernel, "cp_forward", lambda *a, **kw: launched.append(a[10]) or real(*a, **kw))
    monkeypatch.setattr(cp_stream, "stream_forward",
                        lambda *a, **kw: launched.append("streamed") or real_streamed(*a, **kw))
    with kernels.backend("torch"):
        reference = _greedy(model, 2)
    with kernels.backend("triton"):
        fused = _greedy(model, 2)
    # 2 frames of 15 forwards for each of the 2 requests (one batch of two rows): 30 one-kernel forwards, or none
    assert launched == ([cp_forward] * 30 if cp_forward != "off" else [])
    assert reference.keys() == fused.keys() == {0, 1}
    for r in reference:
        assert reference[r].shape == (2, 16)
        assert torch.equal(fused[r], reference[r]), r


def test_prefill_and_decode_logits_close_on_both_paths(model):
    talker = model.tts.talker
    g = torch.Generator().manual_seed(1)
    B, L = 2, 7
    x = torch.randn(B, L, talker.cfg.stack.hidden_size, generator=g)
    length = torch.tensor([7, 4])
    positions = torch.arange(L).expand(B, L)
    slots = torch.tensor([2, 0])
    step = torch.randn(B, 1, talker.cfg.stack.hidden_size, generator=g)
    outputs = {}
    for name in ("torch", "triton"):
        cache = talker.new_cache(3, 16, "cpu", torch.float32)
        with kernels.backend(name), torch.inference_mode():
            _, prefill = talker(x, slots, positions, cache, L, last=length - 1, valid_len=length)
            hidden, decode = talker(step, slots, length[:, None], cache, L + 1, last=torch.zeros(B, dtype=torch.int64))
        outputs[name] = (prefill, decode, hidden)
    for ours, reference in zip(outputs["triton"], outputs["torch"], strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_the_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert not kernels.use_triton(cpu)  # CI: the PyTorch path unless asked
    monkeypatch.setenv(kernels.ENV, "triton")
    assert kernels.use_triton(cpu)
    with kernels.backend("torch"):
        assert not kernels.use_triton(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(kernels.KernelsUnavailable, match="TRITON_INTERPRET=1"):
        kernels.use_triton(cpu)
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(ValueError, match="VOICELANE_KERNELS='fast'"):
        kernels.use_triton(cpu)
    monkeypatch.setenv(kernels.ENV, "auto")
    status = kernels.kernels_status()
    assert status["cuda_kernels"] == "triton" and status["triton_error"] is None and status["triton"]


@pytest.mark.parametrize("suffix", [1, 40])
def test_prefill_after_a_cached_prefix_on_both_paths(model, suffix):
    """A prefill that starts at a nonzero position over cache columns already there (a cached prefix copied in,
    engine/runner.py _load_prefixes) gives the logits and cache columns of the whole prompt's prefill, on the
    PyTorch path and on the Triton kernels: one position (the dual layout), and enough positions for several
    row blocks of the attention kernel. Rows start at different positions."""
    talker = model.tts.talker
    g = torch.Generator().manual_seed(3)
    prefix = torch.tensor([6, 3])
    length = prefix + torch.tensor([suffix, max(1, suffix - 2)])
    B, L = 2, int(length.max())
    x = torch.randn(B, L, talker.cfg.stack.hidden_size, generator=g)
    T = int((length - prefix).max())
    rest = torch.zeros(B, T, x.shape[-1])
    for b in range(B):
        rest[b, : length[b] - prefix[b]] = x[b, prefix[b] : length[b]]
    whole_slots, cached_slots = torch.tensor([0, 1]), torch.tensor([2, 3])
    for name in ("torch", "triton"):
        cache = talker.new_cache(4, L + 8, "cpu", torch.float32)
        with kernels.backend(name), torch.inference_mode():
            _, whole = talker(x, whole_slots, torch.arange(L).expand(B, L), cache, L, last=length - 1,
                              valid_len=length)
            for b in range(B):  # what the prefix cache copies in: the prefix's columns, nothing after them
                cache.k[:, cached_slots[b], :, : prefix[b]] = cache.k[:, whole_slots[b], :, : prefix[b]]
                cache.v[:, cached_slots[b], :, : prefix[b]] = cache.v[:, whole_slots[b], :, : prefix[b]]
            positions = prefix[:, None] + torch.arange(T)
            _, after_prefix = talker(rest, cached_slots, positions, cache, int(prefix.max()) + T,
                                     last=length - prefix - 1, valid_len=length)
        torch.testing.assert_close(after_prefix, whole, rtol=1e-5, atol=1e-5)
        for b in range(B):
            torch.testing.assert_close(cache.k[:, cached_slots[b], :, : length[b]],
                                       cache.k[:, whole_slots[b], :, : length[b]], rtol=1e-5, atol=1e-5)


def test_engine_codes_with_and_without_the_prefix_cache_on_the_triton_path(model):
    """The engine on the Triton kernels: the cached prefix's prefill gives the codes of the whole prompt's."""
    from test_prefix_cache import CASES, run_cases

    from engine.config import EngineConfig, SchedulerConfig
    from engine.engine import Engine

    cases = [c[:4] + (c[4].with_overrides(max_frames=2),) for c in (CASES[0], CASES[3])]

    def codes(entries: int, runs: list):
        sched = SchedulerConfig(max_slots=2, admission_load=1e6, admission_first_audio_s=0)
        engine = Engine(model, EngineConfig(scheduler=sched, max_frames=4, max_prompt_tokens=64,
                                            prefix_cache_entries=entries))
        engine.start()
        try:
            return run_cases(engine, runs, together=False), engine.stats().prefix_cache
        finally:
            engine.stop()

    with kernels.backend("triton"):
        cached, stats = codes(256, cases * 2)  # the second of each: its prefix copied in, one position run
        plain, _ = codes(0, cases)
    assert stats.hits == 2 and stats.misses == 2
    for a, b in zip(cached, plain * 2, strict=True):
        assert a.shape == (2, 16) and np.array_equal(a, b)
