"""Codec kernels against their PyTorch references. On the CPU the Triton kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set before the first kernel is built); on a GPU the same tests run the compiled kernels."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.kernels import snake as sk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def constants(C: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    alpha = torch.randn(C, generator=gen) * 0.5
    beta = torch.randn(C, generator=gen) * 0.5
    return torch.exp(alpha).to(DEVICE), (1.0 / (torch.exp(beta) + 1e-9)).to(DEVICE)


@pytest.mark.parametrize("shape", [(1, 3, 1), (2, 5, 37), (3, 4, 1100)])
def test_snake_triton_equals_reference_fp32(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(DEVICE)
    freq, inv = constants(shape[1], gen)
    ref = sk.snake_reference(x, freq, inv)
    got = sk.snake_triton(x, freq, inv)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_snake_triton_writes_into_a_window_view():
    """The kernel reads a strided input and writes the new part of a conv window, leaving the history alone."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 6, 40, generator=gen).to(DEVICE)
    x = base[:, :, 5:25]  # batch/channel strides of the larger tensor, time stride 1
    freq, inv = constants(6, gen)
    win = torch.full((2, 6, 4 + 20), 7.0, device=DEVICE)
    sk.snake_triton(x, freq, inv, out=win[..., 4:])
    assert torch.all(win[..., :4] == 7.0)
    assert (win[..., 4:] - sk.snake_reference(x, freq, inv)).abs().max().item() < 1e-5


def test_snake_triton_bf16_rounds_once():
    """bf16 in and out, fp32 inside: within one bf16 ulp of the fp32 result (the interpreter truncates where the
    GPU rounds to nearest, so one ulp rather than half)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 8, 300, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    freq, inv = constants(8, gen)
    exact = sk.snake_reference(x.float(), freq.float(), inv.float())
    got = sk.snake_triton(x, freq.to(torch.bfloat16), inv.to(torch.bfloat16))
    ref16 = sk.snake_reference(x.float(), freq.to(torch.bfloat16).float(), inv.to(torch.bfloat16).float())
    assert got.dtype == torch.bfloat16
    ulp = ref16.abs() * 2.0**-7 + 1e-30
    assert torch.all((got.float() - ref16).abs() <= ulp)
    assert (got.float() - exact).abs().max().item() < 0.05  # constants rounded to bf16: a small, bounded shift


def test_snake_torch_path_equals_reference():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 7, 50, generator=gen) * 3
    alpha, beta = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    freq, inv = torch.exp(alpha), 1.0 / (torch.exp(beta) + 1e-9)
    ref = sk.snake_reference(x, freq, inv)
    assert (sk.snake_torch(x, freq, inv) - ref).abs().max().item() < 1e-5
    out = torch.empty(2, 7, 53)
    sk.snake_torch(x, freq, inv, out=out[..., 3:])
    assert (out[..., 3:] - ref).abs().max().item() < 1e-5


def test_snake_rejects_bad_shapes():
    x = torch.zeros(1, 4, 8, device=DEVICE)
    c = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="freq/inv_mag"):
        sk.snake_triton(x, torch.ones(3, device=DEVICE), c)
    with pytest.raises(ValueError, match="out has shape"):
        sk.snake_triton(x, c, c, out=torch.zeros(1, 4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="time stride"):
        sk.snake_triton(x.transpose(1, 2).contiguous().transpose(1, 2), c, c)


def test_kernels_status_says_what_runs():
    status = sk.kernels_status()
    assert set(status) == {"enabled", "reason"}
    if not torch.cuda.is_available():
        assert status == {"enabled": False, "reason": "no CUDA device: the PyTorch path runs on the CPU"}
    sk.set_triton_enabled(False)
    try:
        off = sk.kernels_status()
        assert off["enabled"] is False and "switched off" in off["reason"]
    finally:
        sk.set_triton_enabled(True)
