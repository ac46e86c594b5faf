"""Seeded open-loop arrival schedules.

Arrival times are offsets in seconds from the start of a run, drawn before the run starts and independent of how
fast the server answers (open loop). The schedule and the prompt sequence come from separate random streams of the
same seed, so the i-th request speaks the same sentence at every rate.
"""

from __future__ import annotations

import numpy as np

STREAM_SCHEDULE, STREAM_PROMPTS, STREAM_WORKLOAD = 1, 2, 3


def rng(seed: int, stream: int) -> np.random.Generator:
    """An independent generator per (seed, purpose)."""
    return np.random.default_rng([int(seed), int(stream)])


def poisson_schedule(rate: float, duration: float, seed: int) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` per second on [0, duration): exponential gaps, the first one
    measured from 0."""
    if rate <= 0 or duration <= 0:
        return np.zeros(0)
    g = rng(seed, STREAM_SCHEDULE)
    out, t, chunk = [], 0.0, max(16, int(rate * duration * 1.2) + 16)
    while True:
        gaps = g.exponential(1.0 / rate, chunk)
        times = t + np.cumsum(gaps)
        inside = times[times < duration]
        out.append(inside)
        if inside.size < times.size:
            break
        t = float(times[-1])
    return np.concatenate(out)


def constant_schedule(rate: float, duration: float) -> np.ndarray:
    """Evenly spaced arrivals k / rate for k = 0, 1, ... while below `duration`."""
    if rate <= 0 or duration <= 0:
        return np.zeros(0)
    n = int(np.ceil(duration * rate - 1e-9))
    times = np.arange(n, dtype=np.float64) / rate
    return times[times < duration]


def make_schedule(kind: str, rate: float, duration: float, seed: int) -> np.ndarray:
    if kind == "poisson":
        return poisson_schedule(rate, duration, seed)
    if kind == "constant":
        return constant_schedule(rate, duration)
    raise ValueError(f"unknown arrival process {kind!r} (poisson or constant)")
