"""The whole model on the fused Triton path (forced on the CPU, run by triton's interpreter) against its PyTorch
path: the same greedy codes and close logits; and the switch that picks the path."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("linear", ["cublas", "triton"])  # F.linear, or the skinny kernel for every decode GEMM
def test_greedy_codes_identical_on_both_paths(model, linear, monkeypatch):
    monkeypatch.setenv("VOICELANE_LINEAR", linear)
    with kernels.backend("torch"):
        reference = _greedy(model, 2)
    with kernels.backend("triton"):
        fused = _greedy(model, 2)
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
