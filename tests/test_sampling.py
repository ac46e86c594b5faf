"""Device-side sampling: processors, top-k / top-p, seeds independent of the batch, greedy."""

from __future__ import annotations

import pytest
import torch

from engine.model.presets import GENERATION_CONFIG
from engine.model.sampling import (
    SamplerRows,
    _hash_bits,
    choose,
    gumbel_noise,
    process_talker_logits,
    uniform_noise,
)
from engine.model.sampling_params import SamplingError, SamplingParams


def rows(B, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    return SamplerRows(torch.full((B,), float(temperature)), torch.full((B,), top_k, dtype=torch.int64),
                       torch.full((B,), float(top_p)), torch.full((B,), seed, dtype=torch.int64))


def test_greedy_is_argmax():
    logits = torch.randn(5, 300)
    assert torch.equal(choose(logits, rows(5, temperature=0.0), torch.zeros(5, dtype=torch.int64)),
                       logits.argmax(-1))


def test_samples_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    counter = torch.arange(4000)
    picks = choose(logits, rows(4000, temperature=1.0, seed=11), counter)
    freq = torch.bincount(picks, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    hot = choose(logits, rows(4000, temperature=0.5, seed=11), counter)
    assert (hot == 0).float().mean() > freq[0] + 0.1  # lower temperature concentrates mass


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.randn(1, 50).repeat(2000, 1)
    counter = torch.arange(2000)
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(choose(logits, rows(2000, top_k=5, seed=3), counter).tolist()) <= top5
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    mass_above = torch.cumsum(probs[order], 0) - probs[order]
    allowed = set(order[mass_above < 0.6].tolist())
    got = set(choose(logits, rows(2000, top_p=0.6, seed=3), counter).tolist())
    assert got <= allowed and len(got) > 1


def test_seeded_draws_do_not_depend_on_batch_neighbours():
    logits = torch.randn(6, 100)
    seeds = torch.tensor([1, 2, 3, 4, 5, 6])
    counter = torch.tensor([0, 5, 9, 9, 2, 7])
    full = choose(logits, SamplerRows(torch.ones(6), torch.zeros(6, dtype=torch.int64), torch.ones(6), seeds), counter)
    for i in range(6):
        alone = choose(logits[i : i + 1], SamplerRows(torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1),
                                                       seeds[i : i + 1]), counter[i : i + 1])
        assert alone.item() == full[i].item()
    a = uniform_noise(torch.tensor([1]), torch.tensor([0]), 64)
    b = uniform_noise(torch.tensor([2]), torch.tensor([0]), 64)
    assert not torch.equal(a, b) and 0 < float(a.min()) and float(a.max()) < 1


def test_talker_processors():
    logits = torch.tensor([[2.0, -2.0, 1.0, 5.0, 4.0]])
    seen = torch.tensor([[True, True, False, False, False]])
    suppress = torch.tensor([False, False, False, True, False])
    out = process_talker_logits(logits, seen, torch.tensor([2.0]), torch.tensor([False]), suppress, eos_id=4)
    assert out[0, 0] == 1.0 and out[0, 1] == -4.0 and out[0, 2] == 1.0  # penalty: /2 if > 0, x2 if < 0
    assert out[0, 3] == float("-inf") and out[0, 4] == float("-inf")  # suppressed; EOS before min_frames
    allowed = process_talker_logits(logits, seen, torch.tensor([2.0]), torch.tensor([True]), suppress, eos_id=4)
    assert allowed[0, 4] == 4.0


def test_sampling_params_defaults_and_validation():
    p = SamplingParams.from_generation_config(GENERATION_CONFIG)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.sub_temperature) == (0.9, 50, 1.0, 1.05, 0.9)
    assert p.with_overrides(temperature=0.0).sub_temperature == 0.0  # temperature 0: greedy for both
    greedy = SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.7})
    assert greedy.temperature == 0.0 and greedy.sub_temperature == 0.0
    with pytest.raises(SamplingError, match="top_p"):
        p.with_overrides(top_p=1.5)
    with pytest.raises(SamplingError, match="min_frames"):
        p.with_overrides(min_frames=10, max_frames=5)
    with pytest.raises(SamplingError, match="unknown"):
        p.with_overrides(nucleus=0.3)


def test_gumbel_noise_is_finite_even_for_the_extreme_draws():
    """About one uniform draw in 3e7 is within float32 rounding of 1.0; its Gumbel value must stay finite, or a
    masked (-inf) logit becomes NaN and argmax picks that masked token (this crashed the codec on the GPU)."""
    vocab, rows_n = 3072, 12000  # 3.7e7 draws: one seed, many counters (Talker steps)
    seed, counters = torch.full((rows_n,), 1), torch.arange(rows_n)
    bits = _hash_bits(seed, counters, vocab)
    flat = int(bits.argmax())
    row, col = divmod(flat, vocab)
    assert int(bits[row, col]) >= 2**32 - 128  # a draw that float32 rounds to 1.0 ...
    u = uniform_noise(seed[row : row + 1], counters[row : row + 1], vocab)
    assert float(u[0, col]) < 1.0 and float(u[0, col].float()) == 1.0  # ... so a float32 Gumbel would be +inf
    g = gumbel_noise(seed, counters, vocab)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    # That column masked, as a suppressed code-0 id is: it must never be chosen.
    logits = torch.randn(1, vocab)
    logits[0, col] = float("-inf")
    sampler = SamplerRows(torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1), seed[row : row + 1])
    assert int(choose(logits, sampler, counters[row : row + 1])) != col


def test_noise_for_many_counters_at_once_equals_one_counter_at_a_time():
    seed = torch.tensor([3, 2**40 + 5])
    counters = torch.tensor([[17, 18, 19], [33, 34, 35]])
    together = gumbel_noise(seed, counters, 257)
    assert together.shape == (2, 3, 257)
    for g in range(3):
        assert torch.equal(together[:, g], gumbel_noise(seed, counters[:, g], 257))
