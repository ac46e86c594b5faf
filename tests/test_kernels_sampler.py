"""The fused Triton sampler against the PyTorch reference (engine.model.sampling.choose), run on the CPU by
Triton's interpreter: same token ids for greedy and sampled rows, mixed settings in one batch, and the edges."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported: @triton.jit reads it then

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import engine.kernels.sampler as ks  # noqa: E402
from engine.model import sampling  # noqa: E402
from engine.model.sampling import SamplerRows, TalkerRules, _hash_bits, choose, process_talker_logits  # noqa: E402

if not isinstance(ks._sample_rows, InterpretedFunction):  # imported earlier in this process without the flag
    ks = importlib.reload(ks)


def _rows(gen: torch.Generator, B: int, V: int) -> tuple[SamplerRows, torch.Tensor]:
    """Mixed per-row settings: greedy beside sampled, top-k off / 1 / small / V and beyond, top-p on and off."""
    temperature = torch.tensor([0.0, 0.9, 1.0, 0.3, 1.7])[torch.randint(0, 5, (B,), generator=gen)]
    top_k = torch.tensor([0, 1, 2, 50, V - 1, V, V + 7])[torch.randint(0, 7, (B,), generator=gen)].clamp(min=0)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.05])[torch.randint(0, 5, (B,), generator=gen)]
    seed = torch.randint(0, 2**62, (B,), generator=gen)
    counter = torch.randint(0, 2**20, (B,), generator=gen)
    return SamplerRows(temperature, top_k, top_p, seed), counter


def _same(B: int, temperature=1.0, top_k=0, top_p=1.0, seed=0) -> SamplerRows:
    return SamplerRows(torch.full((B,), float(temperature)), torch.full((B,), top_k, dtype=torch.int64),
                       torch.full((B,), float(top_p)), torch.full((B,), seed, dtype=torch.int64))


def _kernel(logits, rows: SamplerRows, counter, talker: TalkerRules | None = None):
    return ks.fused_sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.seed, counter,
                           talker.as_tuple() if talker is not None else None)


@pytest.mark.parametrize("B,V,dtype,seed", [(12, 2048, torch.float32, 0), (8, 3072, torch.bfloat16, 1),
                                            (9, 37, torch.float32, 2), (3, 1, torch.float32, 3),
                                            (10, 300, torch.float16, 4)])
def test_same_ids_as_the_reference(B, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=gen) * 3).to(dtype)
    logits[0, : V // 3] = float("-inf")  # masked columns, as code-0 suppression makes
    rows, counter = _rows(gen, B, V)
    got = _kernel(logits, rows, counter)
    assert torch.equal(got, choose(logits.float(), rows, counter))


def test_rows_settings_side_by_side():
    """top_p < 1 next to top_p = 1 and greedy next to sampled, on identical logits: every row as if alone."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 512, generator=gen).repeat(6, 1)
    rows = SamplerRows(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.7, 0.7]), torch.tensor([0, 0, 0, 20, 20, 1]),
                       torch.tensor([0.3, 1.0, 0.3, 0.6, 1.0, 0.2]), torch.full((6,), 9))
    counter = torch.full((6,), 4)
    together = _kernel(logits, rows, counter)
    for i in range(6):
        one = SamplerRows(*(t[i : i + 1] for t in (rows.temperature, rows.top_k, rows.top_p, rows.seed)))
        assert int(_kernel(logits[i : i + 1], one, counter[i : i + 1])) == int(together[i])
    assert torch.equal(together, choose(logits, rows, counter))
    assert int(together[2]) == int(logits[0].argmax())


def test_samples_stay_inside_top_k_and_top_p():
    n = 100
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(6)).repeat(n, 1)
    counter = torch.arange(n)
    k5 = _same(n, top_k=5, seed=3)
    picks = _kernel(logits, k5, counter)
    assert set(picks.tolist()) <= set(logits[0].topk(5).indices.tolist()) and len(set(picks.tolist())) > 1
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    allowed = set(order[(torch.cumsum(probs[order], 0) - probs[order]) < 0.5].tolist())
    p5 = _same(n, top_p=0.5, seed=3)
    picks = _kernel(logits, p5, counter)
    assert set(picks.tolist()) <= allowed and len(set(picks.tolist())) > 1


def test_ties_at_the_kth_value_and_at_the_top():
    """Equal scores: top-k keeps every tie of the k-th value, greedy and the noise argmax take the first column."""
    n = 16
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 2.0, 2.0, 0.0, 3.0]]).repeat(n, 1)
    counter = torch.arange(n)
    for k, p, t in ((4, 1.0, 1.0), (1, 1.0, 1.0), (2, 0.4, 0.5), (0, 1.0, 0.0)):
        rows = _same(n, temperature=t, top_k=k, top_p=p, seed=21)
        assert torch.equal(_kernel(logits, rows, counter), choose(logits, rows, counter))


def test_talker_rules_folded_in():
    gen = torch.Generator().manual_seed(7)
    B, V, eos = 10, 3072, 2150
    logits = torch.randn(B, V, generator=gen) * 4
    seen = torch.rand(B, V, generator=gen) < 0.05
    seen[:, :50] = True  # penalised tokens among the best ones
    logits[:, :50] += 6
    penalty = torch.tensor([1.05, 1.3, 2.0, 0.8, 1.0] * 2)
    allow_eos = torch.tensor([True, False] * 5)
    suppress = torch.zeros(V, dtype=torch.bool)
    suppress[-1024:] = True
    suppress[eos] = False
    logits[:, eos] = 30.0  # EOS would win wherever it is allowed
    rules = TalkerRules(seen, penalty, allow_eos, suppress, eos)
    rows, counter = _rows(gen, B, V)
    got = _kernel(logits, rows, counter, rules)
    ref = choose(process_talker_logits(logits, seen, penalty, allow_eos, suppress, eos), rows, counter)
    assert torch.equal(got, ref)
    assert not bool(suppress[got].any()) and bool((got[~allow_eos] != eos).all())


def test_nan_logits_never_chosen_and_neighbours_unaffected():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 256, generator=gen)
    rows = SamplerRows(torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.8]), torch.tensor([0, 0, 50, 0, 3, 50]),
                       torch.tensor([1.0, 0.7, 1.0, 1.0, 1.0, 1.0]), torch.arange(6))
    counter = torch.arange(6)
    clean = _kernel(logits, rows, counter)
    poisoned = logits.clone()
    poisoned[1, ::3] = float("nan")
    poisoned[2, int(clean[2])] = float("nan")
    poisoned[3] = float("nan")  # a whole row: still an id inside the vocabulary
    got = _kernel(poisoned, rows, counter)
    assert torch.equal(got[[0, 4, 5]], clean[[0, 4, 5]])
    assert int(got[1]) % 3 != 0 and int(got[2]) != int(clean[2]) and 0 <= int(got[3]) < 256
    assert not bool(torch.isnan(poisoned[[1, 2], got[[1, 2]]]).any())


def test_fully_masked_row_takes_column_zero_like_the_reference():
    logits = torch.full((3, 100), float("-inf"))
    rows = SamplerRows(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 10, 0]), torch.tensor([1.0, 1.0, 0.5]),
                       torch.zeros(3, dtype=torch.int64))
    counter = torch.zeros(3, dtype=torch.int64)
    assert _kernel(logits, rows, counter).tolist() == choose(logits, rows, counter).tolist() == [0, 0, 0]


def _draw_near_one(vocab: int) -> tuple[int, int]:
    """(counter, column) of seed 1's largest 32-bit draw over 12000 counters: one float32 would round to 1.0."""
    best, where = -1, (0, 0)
    for start in range(0, 12000, 2000):
        bits = _hash_bits(torch.ones(2000, dtype=torch.int64), torch.arange(start, start + 2000), vocab)
        flat = int(bits.argmax())
        if int(bits.view(-1)[flat]) > best:
            best, where = int(bits.view(-1)[flat]), (start + flat // vocab, flat % vocab)
    assert best >= 2**32 - 128
    return where


def test_a_draw_that_float32_would_round_to_one_stays_finite():
    """The noise is float64 in the kernel too: a float32 uniform of 1.0 would give +inf noise, and that column
    would win even from far below (or turn a masked column into NaN)."""
    vocab = 3072
    counter, col = _draw_near_one(vocab)
    logits = torch.zeros(2, vocab)
    logits[0, col] = -30.0  # loses with its true noise (about 22.2); +inf noise would pick it
    logits[1, col] = float("-inf")
    rows = _same(2, seed=1)
    counters = torch.full((2,), counter)
    got = _kernel(logits, rows, counters)
    assert torch.equal(got, choose(logits, rows, counters)) and bool((got != col).all())


def test_bad_inputs_raise_a_typed_error():
    logits = torch.randn(2, 16)
    rows = _same(2)
    counter = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ks.SamplerInputError, match="top_k"):
        ks.fused_sample(logits, rows.temperature, rows.top_k.int(), rows.top_p, rows.seed, counter)
    with pytest.raises(ks.SamplerInputError, match="logits"):
        ks.fused_sample(logits.t(), rows.temperature, rows.top_k, rows.top_p, rows.seed, counter)
    with pytest.raises(ks.SamplerInputError, match="counter"):
        ks.fused_sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.seed, counter[:1])
    assert ks.kernels_status()["fused_sampler"] is True


def test_model_draws_through_the_kernel_equal_the_reference(tiny_model, monkeypatch):
    """The model's own call sites (Talker code 0 with its rules, the Code Predictor's 15 draws per frame with
    strided counters) give the same codes through the kernel as through the reference."""
    model = tiny_model.tts
    gen = torch.Generator().manual_seed(9)
    B, H = 3, model.cfg.talker.stack.hidden_size
    hidden = torch.randn(B, H, generator=gen)
    code0 = torch.randint(0, 2048, (B,), generator=gen)
    rows = SamplerRows(torch.tensor([0.0, 0.9, 1.3]), torch.tensor([0, 50, 0]), torch.tensor([1.0, 1.0, 0.8]),
                       torch.tensor([5, 6, 2**50]))
    frame = torch.tensor([0, 3, 700])
    vocab = model.cfg.talker.stack.vocab_size
    talker_logits = torch.randn(B, vocab, generator=gen)
    seen = torch.rand(B, vocab, generator=gen) < 0.1
    talker_args = (talker_logits, rows, torch.full((B,), 1.1), seen, torch.tensor([True, False, True]), frame)
    with torch.no_grad():
        ref_rest, _ = model.codes_1_to_15(hidden, code0, rows, frame)
        ref_code0 = model.choose_code0(*talker_args)
        monkeypatch.setattr(sampling, "fused_for", lambda device: True)
        rest, _ = model.codes_1_to_15(hidden, code0, rows, frame)
        got_code0 = model.choose_code0(*talker_args)
    assert torch.equal(rest, ref_rest) and torch.equal(got_code0, ref_code0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs for real (the lead runs it)")
def test_gpu_check_script_imports_and_refuses_without_a_gpu(tmp_path):
    from engine.tools import gpu_check_sampler

    assert gpu_check_sampler.main([str(tmp_path)]) == 2


@triton.jit
def _kth_probe(key_ptr, out_ptr, n, k, BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    valid = cols < n
    key = tl.load(key_ptr + cols, mask=valid, other=0).to(tl.uint32, bitcast=True)
    tl.store(out_ptr, ks._kth_largest_key(key, valid, k, DIGIT_BITS).to(tl.int32, bitcast=True))


def _kth(keys: list[int], k: int, digit_bits: int) -> int:
    block = max(16, 1 << (len(keys) - 1).bit_length())
    padded = keys + [0xFFFFFFFF] * (block - len(keys))  # padding must never count: it is the largest key
    signed = torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in padded], dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    _kth_probe[(1,)](signed, out, len(keys), k, BLOCK=block, DIGIT_BITS=digit_bits)
    return int(out) & 0xFFFFFFFF


@pytest.mark.parametrize("digit_bits", [2, 4, 8])
def test_radix_select_finds_the_kth_largest_key_whatever_its_stopping_pass(digit_bits):
    """The select stops early when the k-th is the smallest or largest of its tied keys, or runs every pass:
    random keys, heavy duplicates, all equal, keys differing only in the lowest bits, k = 1 and k = n."""
    gen = torch.Generator().manual_seed(digit_bits)
    cases = [
        torch.randint(0, 2**32, (300,), generator=gen, dtype=torch.int64).tolist(),
        (torch.randint(0, 4, (200,), generator=gen) * 0x01010101 + 0x80000000).tolist(),
        [0xC0000000] * 37,
        (0xBF800000 + torch.randint(0, 8, (64,), generator=gen)).tolist(),
        [0x12345678],
    ]
    for keys in cases:
        ordered = sorted(keys, reverse=True)
        for k in sorted({min(2, len(keys)), 1, len(keys) // 3 + 1, max(len(keys) - 1, 1), len(keys)}):
            assert _kth(keys, k, digit_bits) == ordered[k - 1], (len(keys), k)


@pytest.mark.parametrize("digit_bits,num_warps", [(2, 4), (8, 4), (4, 8)])
def test_every_launch_variant_draws_the_reference_ids(digit_bits, num_warps):
    gen = torch.Generator().manual_seed(30 + digit_bits)
    B, V = 10, 2048
    logits = (torch.randn(B, V, generator=gen) * 3).to(torch.bfloat16)
    logits[:3] = logits[:3].round()  # many ties at the k-th value
    rows, counter = _rows(gen, B, V)
    got = ks.launch(logits, rows.temperature, rows.top_k, rows.top_p, rows.seed, counter, None,
                    ks.scratch(B, V, logits.device), digit_bits=digit_bits, num_warps=num_warps)
    assert torch.equal(got, choose(logits.float(), rows, counter))


def test_gpu_check_variant_sweep_checks_ids_on_the_cpu(monkeypatch):
    """The GPU check's variant sweep (timed only on CUDA) compares every variant's ids; here it runs, and fails on
    a variant that draws other ids."""
    from engine.tools import gpu_check_sampler as check

    rows, failures = check.graph_timings(torch.device("cpu"), shapes=((2048, 2),), scales=(0.64,))
    assert failures == [] and len(rows) == 2 * len(check.VARIANTS) and all(r["ids_ok"] for r in rows)
    real_launch = ks.launch

    def off_by_one(*args, digit_bits=None, num_warps=None):
        ids = real_launch(*args, digit_bits=digit_bits, num_warps=num_warps)
        return (ids + 1) % 2048 if digit_bits == 2 else ids

    monkeypatch.setattr(check.kernel, "launch", off_by_one)
    _, failures = check.graph_timings(torch.device("cpu"), shapes=((2048, 2),), scales=(0.64,))
    assert failures and all("bits 2" in f for f in failures)
