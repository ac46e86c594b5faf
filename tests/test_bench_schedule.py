"""Arrival schedules and the prompt set."""

from __future__ import annotations

import math

import numpy as np

from bench.prompts import SENTENCES, PromptStream, prompt_sequence, word_count
from bench.schedule import constant_schedule, make_schedule, poisson_schedule


def test_poisson_rate_and_exponential_gaps():
    rate, duration = 20.0, 500.0
    t = poisson_schedule(rate, duration, seed=0)
    n = t.size
    assert abs(n / duration - rate) / rate < 0.03  # 10,000 expected, sd 100 (1%)
    assert np.all(np.diff(t) > 0) and t[0] >= 0 and t[-1] < duration
    gaps = np.sort(np.diff(np.concatenate([[0.0], t])))
    assert abs(gaps.mean() - 1 / rate) / (1 / rate) < 0.03
    # Kolmogorov-Smirnov distance to Exp(rate), below the 1% critical value 1.63 / sqrt(n)
    cdf = 1.0 - np.exp(-rate * gaps)
    k = np.arange(1, gaps.size + 1)
    d = max(np.max(k / gaps.size - cdf), np.max(cdf - (k - 1) / gaps.size))
    assert d < 1.63 / math.sqrt(gaps.size)
    # counts per second are Poisson: variance / mean (index of dispersion) close to 1
    counts = np.bincount(t.astype(int), minlength=int(duration))
    assert 0.85 < counts.var() / counts.mean() < 1.15


def test_poisson_is_seeded():
    a, b = poisson_schedule(5, 60, seed=1), poisson_schedule(5, 60, seed=1)
    assert np.array_equal(a, b)
    assert not np.array_equal(a[:10], poisson_schedule(5, 60, seed=2)[:10])
    # a longer schedule of the same seed starts with the same arrivals (the window does not move them)
    assert np.array_equal(poisson_schedule(5, 120, seed=1)[: a.size], a)
    assert poisson_schedule(0, 60, seed=0).size == 0


def test_constant_schedule_is_exact():
    assert np.allclose(constant_schedule(10, 3), np.arange(30) / 10)
    assert np.allclose(constant_schedule(3, 1), [0, 1 / 3, 2 / 3])
    assert constant_schedule(2, 1.5).tolist() == [0.0, 0.5, 1.0]
    assert np.array_equal(make_schedule("constant", 4, 2, seed=9), constant_schedule(4, 2))


def test_prompt_set_properties():
    words = [word_count(s) for s in SENTENCES]
    assert len(SENTENCES) >= 200
    assert len(set(SENTENCES)) == len(SENTENCES)
    assert min(words) >= 8 and max(words) <= 25
    # mean speech of about 4-6 s at the 2.5 words/s that 5 frames per word gives
    assert 4.0 <= np.mean(words) / 2.5 <= 6.0
    for s in SENTENCES:
        assert s == s.strip() and "  " not in s and s.isascii()
        assert s[0].isupper() and s[-1] in ".?!"


def test_prompt_sequence_is_deterministic_and_balanced():
    a = prompt_sequence(0, 500)
    assert a == prompt_sequence(0, 500)
    assert a != prompt_sequence(1, 500)
    assert sorted(a[: len(SENTENCES)]) == sorted(SENTENCES)  # each pass uses every sentence once
    assert prompt_sequence(0, 10) == a[:10]
    stream = PromptStream(0)
    assert [stream.next() for _ in range(500)] == a
