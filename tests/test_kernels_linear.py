"""The skinny linear kernel against F.linear on the CPU (triton's interpreter): every launch shape it can take
(one or more K slices, tensor-core or CUDA-core products, SwiGLU folded in), ragged edges, and the table that
decides where it runs."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported (they import lazily)
pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("the kernel tests need TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from engine import kernels  # noqa: E402
from engine.kernels import linear as kl  # noqa: E402
from engine.model.layers import dense  # noqa: E402

CONFIGS = [kl.LinearConfig(16, 32, 1, True, 4, 2), kl.LinearConfig(32, 64, 3, True, 4, 3),
           kl.LinearConfig(16, 32, 4, False, 4, 2), kl.LinearConfig(16, 32, 1, True, 4, 2, preload=True),
           kl.LinearConfig(16, 256, 1, False, 4, 2, preload=True)]


@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}dot{int(c.dot)}pre{int(c.preload)}")
@pytest.mark.parametrize("rows,N,K", [(1, 48, 96), (3, 40, 100), (17, 64, 130), (64, 24, 64)])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_linear_matches_reference(config, rows, N, K, swiglu, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + N + K)
    x = (2 * torch.randn(rows, 2 * K if swiglu else K, generator=g)).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    got = kl.skinny_linear(x, w, config, swiglu)
    want = kl.reference(x.double(), w.double(), swiglu)
    assert got.shape == (rows, N) and got.dtype == dtype
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < (1e-6 if dtype == torch.float32 else 2e-3), err
    assert int(kl._TICKETS[("cpu", -(-N // config.block_n), None)].abs().sum()) == 0  # left ready for a replay


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[3], kl.LinearConfig(16, 64, 1, True, 4, 2, True)],
                         ids=["n16k32", "n32k64s3", "n16k32pre", "n16k64pre"])
@pytest.mark.parametrize("rows,N,K", [(1, 48, 96), (3, 40, 100), (8, 64, 128)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_prologue_equals_add_rms_norm_then_the_product(config, rows, N, K, with_residual, dtype):
    from engine.kernels.norm import add_rms_norm

    g = torch.Generator().manual_seed(rows * 100 + N + K)
    x = torch.randn(2, rows, K, generator=g).to(dtype)[:, :rows]
    residual = torch.randn(2, rows, K, generator=g).to(dtype) if with_residual else None
    norm_w, w = (1 + torch.randn(K, generator=g) / 4).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    h, y = kl.skinny_norm_linear(x, kl.NormPrologue(residual, norm_w, 1e-6), w, config)
    h_apart, normed = add_rms_norm(x, residual, norm_w, 1e-6)  # the two kernels it replaces
    assert h.shape == x.shape and y.shape == (2, rows, N) and y.dtype == dtype
    assert torch.equal(h, h_apart)  # every element of the sum written, rounded as the norm kernel rounds it
    assert (h is x) == (residual is None)
    # the product of the normed rows, as the kernel without the prologue computes it (the rows' sums of squares
    # may add in another order: one rounding of the normed value apart at most)
    torch.testing.assert_close(y, kl.skinny_linear(normed, w, config), rtol=1e-5 if dtype == torch.float32 else 4e-3,
                               atol=1e-4 if dtype == torch.float32 else 2e-2)
    want = kl.reference(normed.double(), w.double())
    assert float((y.double() - want).abs().max() / want.abs().max()) < (1e-6 if dtype == torch.float32 else 2e-3)


def test_norm_linear_takes_one_launch_where_the_kernel_runs_and_two_where_cublas_does(monkeypatch):
    from engine.kernels import norm

    launches = []
    monkeypatch.setattr(norm, "add_rms_norm", lambda *a: launches.append("norm") or norm.add_rms_norm_reference(*a))
    x, r, nw, w = torch.randn(2, 64), torch.randn(2, 64), torch.rand(64) + 0.5, torch.randn(24, 64)
    for force, want in (("triton", []), ("cublas", ["norm"])):
        monkeypatch.setenv(kl.FORCE_ENV, force)
        launches.clear()
        h, y = kl.norm_linear(x, r, nw, 1e-6, w)
        assert launches == want
        h_ref, normed = norm.add_rms_norm_reference(x, r, nw, 1e-6)
        torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
        torch.testing.assert_close(y, torch.nn.functional.linear(normed, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="norm's weight"):
        kl.skinny_norm_linear(x, kl.NormPrologue(r, torch.ones(63), 1e-6), w)
    with pytest.raises(ValueError, match="residual"):
        kl.skinny_norm_linear(x, kl.NormPrologue(r[:1], nw, 1e-6), w)


def test_split_sums_are_deterministic_and_leading_dims_kept():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 3, 256, generator=g), torch.randn(40, 256, generator=g)
    config = kl.LinearConfig(16, 32, 8, True, 4, 2)
    first = kl.skinny_linear(x, w, config)
    assert first.shape == (2, 3, 40)
    assert torch.equal(first, kl.skinny_linear(x, w, config))
    torch.testing.assert_close(first, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def test_skinny_linear_refuses_bad_shapes():
    with pytest.raises(ValueError, match="columns"):
        kl.skinny_linear(torch.randn(2, 10), torch.randn(4, 12))
    with pytest.raises(ValueError, match="at most 64"):
        kl.skinny_linear(torch.randn(65, 8), torch.randn(4, 8))


def test_table_decides_per_gpu_shape_and_bucket(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    config, slower = kl.LinearConfig(16, 32, 2, True, 4, 2), kl.LinearConfig(32, 64, 1, True, 4, 3)
    table = {"cpu": {kl.entry_key(40, 64, False, 3): {"use": "skinny", "skinny": kl.config_dict(config)},
                     kl.entry_key(40, 64, False, 1): {"use": "cublas", "skinny": kl.config_dict(slower)},
                     kl.entry_key(40, 64, False, 2): {"use": "cublas", "skinny": None}},
             "Some Other GPU": {kl.entry_key(40, 64, False, 16): {"use": "skinny", "skinny": kl.config_dict(config)}}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(kl.TABLE_ENV, str(path))
    monkeypatch.delenv(kl.FORCE_ENV, raising=False)
    kl.reload_table()
    try:
        assert kl.choose(cpu, 40, 64, 3, False) == config
        assert kl.choose(cpu, 40, 64, 4, False) == config  # rows 3 and 4 share the bucket 4
        assert kl.choose(cpu, 40, 64, 1, False) is None  # cuBLAS measured faster
        assert kl.choose(cpu, 40, 64, 16, False) is None  # tuned on another GPU only
        assert kl.choose(cpu, 40, 64, 3, True) is None  # another shape
        assert kl.choose(cpu, 40, 64, 65, False) is None  # prefill rows: cuBLAS
        assert kl.choose(cpu, 40, 64, 3, False, torch.float32) is None  # measured in bfloat16 only
        monkeypatch.setenv(kl.FORCE_ENV, "triton")  # the kernel everywhere: its tuned config where there is one
        assert kl.choose(cpu, 40, 64, 16, False) == kl.DEFAULT_CONFIG
        assert kl.choose(cpu, 40, 64, 1, False) == slower
        assert kl.choose(cpu, 40, 64, 2, False) == kl.DEFAULT_CONFIG
        assert kl.choose(cpu, 40, 64, 3, False) == config
        monkeypatch.setenv(kl.PRELOAD_ENV, "128")  # every skinny launch one K block of 128 a program, preloaded
        assert kl.choose(cpu, 40, 64, 3, False) == kl.LinearConfig(16, 128, 2, True, 4, 2, preload=True)
        for bad in ("100", "8", "yes"):
            monkeypatch.setenv(kl.PRELOAD_ENV, bad)
            with pytest.raises(ValueError, match=kl.PRELOAD_ENV):
                kl.choose(cpu, 40, 64, 3, False)
        monkeypatch.setenv(kl.PRELOAD_ENV, "off")
        assert kl.choose(cpu, 40, 64, 3, False) == config
        monkeypatch.setenv(kl.FORCE_ENV, "cublas")
        monkeypatch.setenv(kl.PRELOAD_ENV, "128")
        assert kl.choose(cpu, 40, 64, 3, False) is None  # preload changes the kernel's shape, not where it runs
        assert kl.kernels_status()["skinny_linear_tuned_for"] == {"cpu": 1, "Some Other GPU": 1}
    finally:
        monkeypatch.delenv(kl.TABLE_ENV)
        kl.reload_table()


def test_dense_takes_the_kernel_on_the_triton_path(monkeypatch):
    calls = []
    real = kl.skinny_linear
    monkeypatch.setattr(kl, "skinny_linear", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    monkeypatch.setenv(kl.FORCE_ENV, "triton")
    x, w = torch.randn(2, 2 * 64), torch.randn(24, 64)
    with kernels.backend("triton"):
        got = dense(x, w, swiglu=True)
    assert calls == [kl.DEFAULT_CONFIG]
    with kernels.backend("torch"):
        torch.testing.assert_close(got, dense(x, w, swiglu=True), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1  # the PyTorch path never launches it


def test_tuner_smoke_writes_a_table_of_every_shape(tmp_path):
    from engine.tools.tune_linear import main, shapes

    assert main([str(tmp_path), "--smoke"]) == 0
    record = json.loads((tmp_path / "linear_tune.json").read_text())
    table = json.loads((tmp_path / "linear_table.json").read_text())["cpu"]
    distinct = {(N, K, sw) for _, N, K, sw in shapes("tiny")}
    assert len(record["rows"]) == 2 * len(distinct) and record["failures"] == 0
    assert set(table) == {kl.entry_key(N, K, sw, r) for N, K, sw in distinct for r in (1, 3)}
    assert all(e == {"use": "cublas", "skinny": None} for e in table.values())  # --smoke times nothing
    assert all(c["ok"] for row in record["rows"] for c in row["candidates"])


def test_table_rebuilt_from_a_tune_record_keeps_every_choice(tmp_path):
    """--from writes the committed table again from the H200 measurements it was made from: the same choices, and
    the fastest kernel config kept where cuBLAS won."""
    from pathlib import Path

    from engine.tools.tune_linear import main

    root = Path(__file__).parents[1]
    assert main([str(tmp_path), "--from", str(root / "docs/benchmarks/h200/linear_tune_a906b83.json")]) == 0
    rebuilt = json.loads((tmp_path / "linear_table.json").read_text())
    assert rebuilt == json.loads((root / "engine/kernels/linear_table.json").read_text())
    entries = rebuilt["NVIDIA H200"]
    assert sum(e["use"] == "skinny" for e in entries.values()) == 16
    assert all(e["skinny"] is not None for e in entries.values())


def test_shapes_of_the_1p7b_model():
    from engine.tools.tune_linear import shapes

    got = {name: (N, K, sw) for name, N, K, sw in shapes("1.7b")}
    assert got["talker.gate_up"] == (12288, 2048, False) and got["talker.down"] == (2048, 6144, True)
    assert got["cp.qkv"] == (4096, 1024, False) and got["cp.head"] == (2048, 1024, False)


def test_each_lane_has_its_own_split_k_tickets():
    """Two lanes' launches run at once on the GPU: the tickets that order a split-K reduction are per lane."""
    from engine.kernels.lanes import on_lane

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 256, generator=g), torch.randn(40, 256, generator=g)
    config = kl.LinearConfig(16, 32, 8, True, 4, 2)
    blocks = -(-40 // config.block_n)
    with on_lane("first"):
        first = kl.skinny_linear(x, w, config)
    main = kl.skinny_linear(x, w, config)
    assert torch.equal(first, main)
    tickets = {key[2]: t for key, t in kl._TICKETS.items() if key[:2] == ("cpu", blocks)}
    assert {"first", None} <= set(tickets) and tickets["first"].data_ptr() != tickets[None].data_ptr()
