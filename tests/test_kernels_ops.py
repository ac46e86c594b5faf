"""Each Triton kernel against its plain PyTorch reference, run on the CPU by triton's interpreter: random shapes
and the edges (length 1, a full cache bucket, padded rows, right-padded prefill, views of a fused projection)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported (they import lazily)
pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("the kernel tests need TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from engine import kernels  # noqa: E402
from engine.kernels import attention as ka  # noqa: E402
from engine.kernels import norm  # noqa: E402
from engine.model.layers import rope_cos_sin, signed_sin  # noqa: E402

DTYPES = [torch.float32, torch.float16]  # the interpreter's bfloat16 is not rounded like the GPU's: GPU script


def _close(got, want, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 48), (2, 7, 1000)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(dtype, shape, with_residual):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    h, out = norm.add_rms_norm(x, residual, weight, 1e-6)
    h_ref, out_ref = norm.add_rms_norm_reference(x, residual, weight, 1e-6)
    assert h.shape == out.shape == x.shape and out.dtype == dtype
    assert torch.equal(h, h_ref)  # the sum is one rounding in both
    _close(out, out_ref, dtype)


def test_add_rms_norm_refuses_mixed_dtypes():
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="share one dtype"):
        norm.add_rms_norm(x, None, torch.ones(8, dtype=torch.float16), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2 * 16), (4, 3, 2 * 96), (2, 1, 2 * 1100)])  # 1100: two column blocks
def test_swiglu_matches_reference(dtype, shape):
    gate_up = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype)
    out = norm.swiglu(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    _close(out, norm.swiglu_reference(gate_up), dtype)


def test_swiglu_refuses_an_odd_width():
    with pytest.raises(ValueError, match="equal width"):
        norm.swiglu(torch.randn(2, 7))


def _layer_inputs(g, B, T, H, Hkv, D, dtype, positions):
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)  # views with the fused projection's strides
    weights = [(1 + 0.3 * torch.randn(D, generator=g)).to(dtype) for _ in range(2)]
    cos, sin = rope_cos_sin(positions, D, 1e6, dtype)
    return q, k, v, weights, cos, signed_sin(sin)


CASES = [  # B, T, H, Hkv, D, slots in the cache, cache length
    (1, 1, 4, 2, 32, 3, 40),  # a Talker decode step
    (3, 1, 8, 2, 16, 5, 24),  # G = 4
    (2, 2, 4, 4, 32, 2, 16),  # the Code Predictor's first forward (no grouping)
    (2, 9, 4, 2, 16, 4, 12),  # a prefill
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_qk_norm_rope_store_matches_reference(dtype, case):
    B, T, H, Hkv, D, S, L = case
    g = torch.Generator().manual_seed(B * 100 + T)
    slots = torch.randperm(S, generator=g)[:B]
    start = torch.randint(0, L - T + 1, (B, 1), generator=g)
    start[0] = L - T  # the last column of the bucket
    positions = start + torch.arange(T)
    q, k, v, (qw, kw), cos, sin = _layer_inputs(g, B, T, H, Hkv, D, dtype, positions)
    caches = [torch.randn(S, Hkv, L, D, generator=g).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q_out = ka.qk_norm_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, *caches, slots, positions)
    q_ref = ka.qk_norm_rope_store_reference(q, k, v, qw, kw, 1e-6, cos, sin, *ref_caches, slots, positions)
    assert q_out.shape == (B, T, H, D)
    _close(q_out, q_ref, dtype)
    _close(caches[0], ref_caches[0], dtype)  # whole caches: written where they should be and nowhere else
    assert torch.equal(caches[1], ref_caches[1])  # values are copied as they are


SHORT_CASES = [  # B, T, H, Hkv, D, slots, cache length: the Code Predictor's shapes, smaller heads
    (1, 2, 4, 2, 32, 3, 16),  # its first forward: positions 0 and 1
    (3, 1, 4, 2, 32, 5, 16),  # a later forward, rows at different positions
    (2, 1, 8, 2, 16, 2, 16),  # G = 4
    (2, 2, 4, 4, 16, 4, 64),  # no grouping, the largest cache it takes
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHORT_CASES)
def test_short_attention_equals_its_two_launches_and_the_reference(dtype, case):
    """One launch (norms, RoPE, the cache store and attention over a short cache) against qk_norm_rope_store then
    cache_attention, and against the PyTorch path: the same output and the same caches, written where they should
    be and nowhere else; columns past each row's position are never read."""
    B, T, H, Hkv, D, S, L = case
    g = torch.Generator().manual_seed(B * 10 + T + L)
    slots = torch.randperm(S, generator=g)[:B]
    start = torch.randint(0, L - T + 1, (B, 1), generator=g)
    start[0] = L - T  # the last column
    positions = start + torch.arange(T)
    q, k, v, (qw, kw), cos, sin = _layer_inputs(g, B, T, H, Hkv, D, dtype, positions)
    caches = [torch.randn(S, Hkv, L, D, generator=g).to(dtype) for _ in range(2)]
    two, ref = [c.clone() for c in caches], [c.clone() for c in caches]
    unread = [_poison_unread(c, slots, positions) for c in caches]  # NaN past each row's new columns
    got = ka.short_attention(q, k, v, qw, kw, 1e-6, cos, sin, *unread, slots, positions)
    rotated = ka.qk_norm_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, *two, slots, positions)
    want = ka.cache_attention(rotated, *two, slots, positions)
    rotated_ref = ka.qk_norm_rope_store_reference(q, k, v, qw, kw, 1e-6, cos, sin, *ref, slots, positions)
    reference = ka.cache_attention_reference(rotated_ref, *ref, slots, positions)
    assert got.shape == (B, T, H, D) and not got.isnan().any()
    _close(got, want, dtype)
    _close(got, reference, dtype)
    for ours, theirs in zip(unread, two, strict=True):  # the new columns as the two launches wrote them
        for b, slot in enumerate(slots.tolist()):
            cols = positions[b]
            _close(ours[slot, :, cols], theirs[slot, :, cols], dtype)


def test_short_attention_takes_short_caches_only_when_switched_on(monkeypatch):
    short, long = torch.zeros(4, 2, 16, 32), torch.zeros(4, 2, 65, 32)
    monkeypatch.delenv(ka.SHORT_ATTENTION_ENV, raising=False)
    assert not ka.short_attention_fits(short, 1, 4, None)  # off until measured on the H200
    monkeypatch.setenv(ka.SHORT_ATTENTION_ENV, "on")
    assert ka.short_attention_fits(short, 2, 4, None)
    assert not ka.short_attention_fits(long, 1, 4, None)  # the Talker's cache: two launches, split columns
    assert not ka.short_attention_fits(short, 2, 4, torch.ones(1, dtype=torch.int64))  # a right-padded prefill
    assert kernels.kernels_status()["short_attention"]["on"] is True
    monkeypatch.setenv(ka.SHORT_ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match="VOICELANE_SHORT_ATTENTION"):
        ka.short_attention_on()


def _attention_case(g, B, T, H, Hkv, D, S, L, dtype):
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    k_cache = torch.randn(S, Hkv, L, D, generator=g).to(dtype)
    v_cache = torch.randn(S, Hkv, L, D, generator=g).to(dtype)
    return q, k_cache, v_cache


def _poison_unread(cache, slots, positions):
    """Columns no query of a row may read (and rows no query reads) set to NaN: a kernel that reads them fails."""
    poisoned = torch.full_like(cache, float("nan"))
    for b, slot in enumerate(slots.tolist()):
        end = int(positions[b].max()) + 1
        poisoned[slot, :, :end] = cache[slot, :, :end]
    return poisoned


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("case", "splits"), [(c, 1) for c in CASES] + [(CASES[0], 4), (CASES[1], 3), (CASES[2], 2)])
def test_cache_attention_reads_only_each_rows_own_columns(dtype, case, splits):
    """splits > 1: the decode path that splits each row's columns over several programs (some of them empty)."""
    B, T, H, Hkv, D, S, L = case
    g = torch.Generator().manual_seed(B * 10 + T)
    q, k_cache, v_cache = _attention_case(g, B, T, H, Hkv, D, S, L, dtype)
    slots = torch.randperm(S, generator=g)[:B]
    start = torch.randint(0, L - T + 1, (B, 1), generator=g)
    start[0] = L - T  # a row that reads the full bucket
    if B > 1:
        start[1] = 0  # and one that reads from column 0 (length 1 when T = 1)
    positions = start + torch.arange(T)
    want = ka.cache_attention_reference(q, k_cache, v_cache, slots, positions)
    got = ka.cache_attention(q, _poison_unread(k_cache, slots, positions), _poison_unread(v_cache, slots, positions),
                             slots, positions, splits=splits)
    assert got.shape == (B, T, H, D) and torch.isfinite(got).all()
    _close(got, want, dtype)


@pytest.mark.parametrize("splits", [2, 3, 4])
def test_cache_attention_split_columns_merge_exactly(splits):
    """Long rows spread over several non-empty splits (blocks of 64 columns), a short row over one."""
    g = torch.Generator().manual_seed(splits)
    q, k_cache, v_cache = _attention_case(g, 3, 1, 4, 2, 32, 4, 300, torch.float32)
    slots = torch.tensor([3, 0, 1])
    positions = torch.tensor([[299], [130], [0]])
    want = ka.cache_attention_reference(q, k_cache, v_cache, slots, positions)
    _close(ka.cache_attention(q, k_cache, v_cache, slots, positions, splits=splits), want, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_attention_right_padded_prefill(dtype):
    B, T, H, Hkv, D, S, L = 3, 11, 4, 2, 32, 4, 16
    g = torch.Generator().manual_seed(5)
    q, k_cache, v_cache = _attention_case(g, B, T, H, Hkv, D, S, L, dtype)
    slots = torch.tensor([2, 0, 3])
    positions = torch.arange(T).expand(B, T)  # stride 0 across rows, as the runner builds it
    valid_len = torch.tensor([11, 1, 6])  # a full row, a one-token prompt, a padded one
    want = ka.cache_attention_reference(q, k_cache, v_cache, slots, positions, valid_len)
    got = ka.cache_attention(q, k_cache, v_cache, slots, positions, valid_len)
    _close(got, want, dtype)
    # Columns at or past a row's length never matter, whatever they hold.
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    for b, slot in enumerate(slots.tolist()):
        k_poisoned[slot, :, int(valid_len[b]):] = 1e4
        v_poisoned[slot, :, int(valid_len[b]):] = -1e4
    _close(ka.cache_attention(q, k_poisoned, v_poisoned, slots, positions, valid_len), want, dtype)


def test_cache_attention_padded_batch_rows_share_a_scratch_slot():
    """Rows that pad a batch to its graph bucket all point at one scratch slot; real rows are unaffected."""
    g = torch.Generator().manual_seed(9)
    q, k_cache, v_cache = _attention_case(g, 4, 1, 4, 2, 32, 5, 20, torch.float32)
    slots = torch.tensor([1, 3, 4, 4])
    positions = torch.tensor([[7], [0], [0], [0]])
    want = ka.cache_attention_reference(q, k_cache, v_cache, slots, positions)
    for splits in (1, 4):
        _close(ka.cache_attention(q, k_cache, v_cache, slots, positions, splits=splits), want, torch.float32)


def test_cache_attention_refuses_shapes_it_cannot_run():
    q = torch.randn(1, 1, 3, 32)
    cache = torch.randn(2, 2, 8, 32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ka.cache_attention(q, cache, cache, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="k/v caches differ"):
        ka.cache_attention(torch.randn(1, 1, 4, 32), cache, cache[:, :, :4], torch.zeros(1, dtype=torch.int64),
                           torch.zeros(1, 1, dtype=torch.int64))


def test_gpu_check_script_runs_its_kernel_checks_on_the_cpu(tmp_path):
    """The GPU check script's own logic (cases, error measure, table, JSON), at its smoke sizes."""
    import json

    from engine.tools.gpu_check_kernels import main

    assert main([str(tmp_path), "--smoke", "--no-model", "--model", "random:tiny"]) == 0
    rows = json.loads((tmp_path / "gpu_check_kernels.json").read_text())["kernels_checked"]
    assert {r["kernel"] for r in rows} == {"add_rms_norm", "swiglu", "qk_norm_rope_store", "cache_attention",
                                           "short_attention", "cp_forward", "cp_stream", "norm_linear"}
    one_kernel = [r for r in rows if r["kernel"] == "cp_forward"]
    assert one_kernel and all(r["persistent_equals_phased"] and r["barrier_timeouts"] == 0 for r in one_kernel)
    streamed = [r for r in rows if r["kernel"] == "cp_stream"]  # B1 with two tokens (B3's six rows are above 4)
    assert [r["shape"] for r in streamed] == ["B1 T2 from position 0"]
    assert streamed[0]["repeats_equal"] and streamed[0]["barrier_timeouts"] == 0
    assert all(r["ok"] and r["rel_err"] < 4e-3 for r in rows)


def test_gpu_check_script_can_check_cp_forward_alone(tmp_path):
    import json

    from engine.tools.gpu_check_kernels import main

    assert main([str(tmp_path), "--smoke", "--no-model", "--cp-forward-only", "--model", "random:tiny"]) == 0
    rows = json.loads((tmp_path / "gpu_check_kernels.json").read_text())["kernels_checked"]
    assert rows and {r["kernel"] for r in rows} == {"cp_forward", "cp_stream"}


def test_gpu_check_script_can_check_named_kernels_alone(tmp_path):
    import json

    from engine.tools.gpu_check_kernels import main

    assert main([str(tmp_path), "--smoke", "--no-model", "--kernels", "norm_linear", "--model", "random:tiny"]) == 0
    rows = json.loads((tmp_path / "gpu_check_kernels.json").read_text())["kernels_checked"]
    assert len(rows) == 2 * 3 * 2 * 2 and {r["kernel"] for r in rows} == {"norm_linear"}  # dtypes, rows, weights,
    assert all(r["ok"] for r in rows)  # with and without a residual


def test_gpu_check_script_can_check_graphs_against_eager_alone(tmp_path):
    """--graphs-only: greedy codes with (emulated) graphs against eager at each batch size, in one model load."""
    import json

    from engine.tools.gpu_check_kernels import main

    argv = [str(tmp_path), "--smoke", "--graphs-only", "--model", "random:tiny", "--batches", "1", "3", "--frames", "3"]
    assert main(argv) == 0
    record = json.loads((tmp_path / "gpu_check_kernels.json").read_text())
    assert record["kernels_checked"] == [] and [r["ok"] for r in record["model_checks"]] == [True, True]
    assert [r["check"].split(", ")[-1] for r in record["model_checks"]] == ["B1 x 3 frames", "B3 x 3 frames"]
    assert [r["first_divergent_frame"] for r in record["model_checks"]] == [None, None]


def test_graphs_check_can_tell_nondeterminism_from_a_systematic_difference(tmp_path):
    """--repeat-check runs each mode twice and reports whether it repeats itself; first_divergent_frame points at
    the first frame where any row differs."""
    import json

    from engine.tools.gpu_check_kernels import first_divergent_frame, main

    a = torch.zeros(2, 5, 16, dtype=torch.int64)
    b = a.clone()
    assert first_divergent_frame(a, b) is None
    b[1, 3, 15] = 7
    b[0, 4, 0] = 1
    assert first_divergent_frame(a, b) == 3
    argv = [str(tmp_path), "--smoke", "--graphs-only", "--repeat-check", "--model", "random:tiny", "--batches", "2",
            "--frames", "3"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "gpu_check_kernels.json").read_text())["model_checks"]
    assert [r["check"].split(",")[1].strip() for r in rows] == ["graphs emulate vs eager", "graphs off run twice",
                                                                 "graphs emulate run twice"]
    assert all(r["agreement"] == 1.0 and r["first_divergent_frame"] is None for r in rows)


def test_repeatability_reports_a_mode_that_differs_from_itself(monkeypatch):
    """A mode whose second run parts from its first (here: graphs, from frame 2) is reported so; the other not."""
    from engine.tools import gpu_check_kernels as check

    first = torch.zeros(1, 4, 16, dtype=torch.int64)
    drifted = first.clone()
    drifted[0, 2:, 0] = 5
    monkeypatch.setattr(check, "greedy_codes", lambda loaded, b, f, mode: first if mode == "off" else drifted)
    loaded = type("Loaded", (), {"dtype": torch.float32})()
    off, graphs = check.repeatability(loaded, 1, 4, first, first)
    assert off["agreement"] == 1.0 and off["first_divergent_frame"] is None
    assert graphs["agreement"] == 1 - 2 / 64 and graphs["first_divergent_frame"] == 2


def test_programmatic_dependent_launch_is_off_by_default_and_refused_where_it_cannot_run(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernels.PDL_ENV, raising=False)
    kernels.reset_pdl()
    try:
        assert kernels.launch_options(cpu) == {"GDC": False}
        reported = kernels.kernels_status()["pdl"]["cpu"]
        assert reported["enabled"] is False and reported["reason"].startswith("VOICELANE_PDL=off")
        with kernels.pdl_mode("on"), pytest.raises(kernels.KernelsUnavailable, match="VOICELANE_PDL=on"):
            kernels.pdl(cpu)  # asked for where it cannot run: an error, never a silent fallback
        monkeypatch.setenv(kernels.PDL_ENV, "sometimes")
        kernels.reset_pdl()
        with pytest.raises(ValueError, match="choose one of off, on"):
            kernels.pdl(cpu)
    finally:
        monkeypatch.delenv(kernels.PDL_ENV, raising=False)
        kernels.reset_pdl()


def test_programmatic_dependent_launch_for_named_parts_of_the_model_only(monkeypatch):
    gpu = torch.device("cuda", 0)  # decided without touching a GPU: an sm_90 outside triton's interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    on = {"GDC": True, "launch_pdl": True}
    try:
        with kernels.pdl_mode("code_predictor"):
            assert kernels.launch_options(gpu) == {"GDC": False}  # a kernel outside every part (the samplers)
            with kernels.model_part("talker"):
                assert kernels.launch_options(gpu) == {"GDC": False}
            with kernels.model_part("code_predictor"):
                assert kernels.launch_options(gpu) == on
            assert kernels.kernels_status()["pdl"]["cuda:0"]["parts"] == ["code_predictor"]
        with kernels.pdl_mode("talker,code_predictor"), kernels.model_part("talker"):
            assert kernels.launch_options(gpu) == on
        with kernels.pdl_mode("on"):
            assert kernels.launch_options(gpu) == on
            assert kernels.kernels_status()["pdl"]["cuda:0"]["parts"] == "all"
        with pytest.raises(ValueError, match="parts of the model"), kernels.pdl_mode("code_predictor,codec"):
            pass
        with pytest.raises(ValueError, match="one of talker, code_predictor"), kernels.model_part("codec"):
            pass
    finally:
        kernels.reset_pdl()


def test_programmatic_dependent_launch_trigger_is_chosen_reported_and_checked(monkeypatch):
    from engine.kernels.pdl import TRIGGER_ENV

    gpu = torch.device("cuda", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    try:
        for value, gdc in (("", 1), ("after_wait", 1), ("early", 2)):
            monkeypatch.setenv(TRIGGER_ENV, value)
            with kernels.pdl_mode("on"):
                assert kernels.launch_options(gpu) == {"GDC": gdc, "launch_pdl": True}
                reported = kernels.kernels_status()["pdl"]["cuda:0"]
                assert reported["trigger"] == (value or "after_wait")
                assert reported["reason"].endswith(f"trigger {value or 'after_wait'}")
        with kernels.pdl_mode("off"):  # the trigger means nothing without PDL
            assert kernels.launch_options(gpu) == {"GDC": False}
            assert kernels.kernels_status()["pdl"]["cuda:0"]["trigger"] is None
        monkeypatch.setenv(TRIGGER_ENV, "soon")
        with kernels.pdl_mode("on"), pytest.raises(ValueError, match="VOICELANE_PDL_TRIGGER='soon'"):
            kernels.launch_options(gpu)
    finally:
        kernels.reset_pdl()


def test_the_model_names_its_parts_around_their_launches(monkeypatch):
    from engine.kernels import norm
    from engine.kernels.pdl import _PART, _ROWS
    from engine.model.generate import Frame, GenerationRequest, generate
    from engine.model.prompt import build_prompt, resolve_voice
    from engine.model.random_model import build_random_model
    from engine.model.sampling_params import SamplingParams

    model = build_random_model("tiny", seed=5)
    parts, cp_rows = [], set()
    real = norm.launch_options

    def seen(device):
        parts.append(_PART.get())
        if _PART.get() == "code_predictor":
            cp_rows.add(_ROWS.get())
        return real(device)

    monkeypatch.setattr(norm, "launch_options", seen)
    voice = resolve_voice(model.config, "ryan", "english")
    text = list(range(1000, 1006))
    request = GenerationRequest(build_prompt(model.config, voice, text, "whole", None), text, "whole",
                                SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=2))
    with kernels.backend("triton"):
        frames = [e for e in generate(model.tts, [request]) if isinstance(e, Frame)]
    assert frames and set(parts) == {"talker", "code_predictor"}  # every norm launch inside one of the two
    assert cp_rows == {1}  # the Code Predictor says its batch's rows (the pipeline's condition)


def test_code_predictor_pipeline_covers_its_small_frames_only_and_is_refused_where_it_cannot_run(monkeypatch):
    from engine.kernels import linear
    from engine.kernels.pdl import FOLD_ENV, PIPELINE_BLOCK_K, PIPELINE_ENV, TALKER_PIPELINE_ENV

    gpu = torch.device("cuda", 0)  # decided without touching a GPU: an sm_90 outside triton's interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(linear, "_device_name", lambda device: "NVIDIA H200")  # its tuned entries are not used
    monkeypatch.setenv(linear.FORCE_ENV, "cublas")  # the pipeline overrides it inside its frames only
    monkeypatch.delenv(kernels.PDL_ENV, raising=False)
    early = {"GDC": 2, "launch_pdl": True}
    preload = dataclasses.replace(linear.DEFAULT_CONFIG, block_k=PIPELINE_BLOCK_K, preload=True)
    try:
        for value, covered, most in (("off", (), 0), ("8", (1, 8), 8), ("", (1, 8), 8), ("2", (1,), 2)):  # "": unset
            monkeypatch.setenv(PIPELINE_ENV, value)
            kernels.reset_pdl()
            for rows in (1, 8, 9, 64):
                with kernels.model_part("code_predictor", rows):
                    on = rows in covered
                    assert kernels.launch_options(gpu) == (early if on else {"GDC": False})
                    assert linear.choose(gpu, 1024, 2048, rows, False) == (preload if on else None)
                    for fold in ("on", "off"):  # the norms fold inside pipelined frames only, and when asked
                        monkeypatch.setenv(FOLD_ENV, fold)
                        assert kernels.folded_norms(gpu) == (on and fold == "on")
                    monkeypatch.setenv(FOLD_ENV, "sometimes")
                    with pytest.raises(ValueError, match=FOLD_ENV):
                        kernels.folded_norms(gpu)
                    monkeypatch.delenv(FOLD_ENV)
            for part, rows in (("talker", 1), ("code_predictor", None)):  # another part; rows not said
                with kernels.model_part(part, rows):
                    assert kernels.launch_options(gpu) == {"GDC": False}
                    assert linear.choose(gpu, 1024, 2048, 1, False) is None
            status = kernels.kernels_status()["pipeline"]
            assert status["code_predictor"]["rows"] == {"cuda:0": most}
            assert ("unset" in status["code_predictor"]["reason"]["cuda:0"]) == (value == "")
            assert status["talker"]["rows"] == {"cuda:0": 0} and "unset: off" in status["talker"]["reason"]["cuda:0"]
        monkeypatch.setenv(TALKER_PIPELINE_ENV, "4")  # the Talker's own switch, its steps of up to 4 rows
        kernels.reset_pdl()
        for rows in (1, 4, 5):
            with kernels.model_part("talker", rows):
                assert kernels.launch_options(gpu) == (early if rows <= 4 else {"GDC": False})
        monkeypatch.delenv(TALKER_PIPELINE_ENV)
        monkeypatch.delenv(PIPELINE_ENV)
        kernels.reset_pdl()
        with kernels.model_part("code_predictor", 1):  # unset where PDL cannot run: off, and it says why
            assert kernels.launch_options(torch.device("cpu")) == {"GDC": False}
            assert "off, not a CUDA device" in kernels.kernels_status()["pipeline"]["code_predictor"]["reason"]["cpu"]
        monkeypatch.setenv(PIPELINE_ENV, "8")
        kernels.reset_pdl()
        with kernels.model_part("code_predictor", 1), pytest.raises(kernels.KernelsUnavailable, match=PIPELINE_ENV):
            kernels.launch_options(torch.device("cpu"))  # asked for where PDL cannot run: an error
        for bad in ("65", "some", "-1"):
            monkeypatch.setenv(PIPELINE_ENV, bad)
            kernels.reset_pdl()
            with kernels.model_part("code_predictor", 1), pytest.raises(ValueError, match="the most rows"):
                kernels.launch_options(gpu)
    finally:
        monkeypatch.delenv(PIPELINE_ENV, raising=False)
        monkeypatch.delenv(TALKER_PIPELINE_ENV, raising=False)
        kernels.reset_pdl()


def test_folded_norms_speak_as_the_norm_kernels_and_take_two_launches_a_layer_fewer(monkeypatch):
    """A Code Predictor frame with its norms inside the projections (VOICELANE_PIPELINE_FOLD_NORMS, pipelined
    only) against the same frames with the norm kernels: the same codes (float32), fewer norm launches."""
    from engine.kernels import linear
    from engine.kernels.pdl import _PART
    from engine.model import layers
    from engine.model.generate import Frame, GenerationRequest, generate
    from engine.model.prompt import build_prompt, resolve_voice
    from engine.model.random_model import build_random_model
    from engine.model.sampling_params import SamplingParams

    model = build_random_model("tiny", seed=7)
    monkeypatch.setenv(linear.FORCE_ENV, "triton")  # every projection on the skinny kernel, as in a pipelined frame
    norms, folded = [], []
    real_norm, real_fold = norm.add_rms_norm, linear.skinny_norm_linear
    monkeypatch.setattr(norm, "add_rms_norm", lambda *a: norms.append(a[0].shape) or real_norm(*a))
    monkeypatch.setattr(linear, "skinny_norm_linear", lambda *a: folded.append(1) or real_fold(*a))
    voice = resolve_voice(model.config, "ryan", "english")
    text = list(range(1000, 1008))
    request = GenerationRequest(build_prompt(model.config, voice, text, "whole", None), text, "whole",
                                SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=2))
    runs = {}
    for fold in (False, True):  # as in production: the Code Predictor's frames only
        monkeypatch.setattr(layers.kernels, "folded_norms",
                            lambda device, fold=fold: fold and _PART.get() == "code_predictor")
        norms.clear()
        folded.clear()
        with kernels.backend("triton"):
            runs[fold] = [e.codes.tolist() for e in generate(model.tts, [request]) if isinstance(e, Frame)]
        runs[fold, "norms"], runs[fold, "folded"] = len(norms), len(folded)
    assert len(runs[True]) == 2 and runs[True] == runs[False]
    assert runs[False, "folded"] == 0 and runs[True, "folded"] > 0
    assert runs[False, "norms"] - runs[True, "norms"] == runs[True, "folded"]  # each fold is a norm launch fewer
    forwards = runs[True, "folded"] // (2 * model.tts.talker.code_predictor.model.cfg.num_layers)
    assert forwards == 2 * 15  # every Code Predictor forward of the 2 frames, and nothing else
