"""Simulated clients: seeded Poisson arrivals speaking the benchmark's sentences, whole text or word by word.

The i-th arrival speaks bench.prompts' i-th sentence of the seed (the load generator's sequence). Text becomes
token ids by a stand-in rule (one id per word plus one per punctuation mark): the scheduler only counts ids (the
dual layout reads one per frame), it never decodes them.
"""

from __future__ import annotations

from dataclasses import dataclass

TEXT_ID_BASE = 1000  # any ordinary text-token ids
PUNCTUATION = ",.?!:;"


@dataclass(frozen=True)
class Arrival:
    """One request of the workload."""

    index: int
    at: float  # dispatch time (s): the whole text (whole), or the first word (streamed)
    words: list[list[int]]  # token ids per word
    mode: str  # "whole" (one request, whole layout) or "streamed" (dual layout, one word every word_interval_s)
    silent_frames: int = 0  # leading frames the model makes silent (real weights: breath, pause) before speech

    @property
    def word_count(self) -> int:
        return len(self.words)


def word_ids(sentence: str) -> list[list[int]]:
    """Stand-in tokenisation: a word is one id, each trailing punctuation mark one more."""
    out = []
    for i, word in enumerate(sentence.split()):
        marks = sum(1 for ch in word if ch in PUNCTUATION)
        out.append([TEXT_ID_BASE + i] + [TEXT_ID_BASE - 1] * marks)
    return out


def poisson_workload(rps: float, duration_s: float, seed: int = 0, mode: str = "whole",
                     silent_frames: int = 0) -> list[Arrival]:
    """Open-loop Poisson arrivals at `rps` over [0, duration_s) with the benchmark's prompt sequence."""
    if mode not in ("whole", "streamed"):
        raise ValueError(f"mode {mode!r}; use 'whole' or 'streamed'")
    from bench.prompts import prompt_sequence
    from bench.schedule import poisson_schedule

    times = poisson_schedule(rps, duration_s, seed)
    sentences = prompt_sequence(seed, len(times))
    return [Arrival(i, float(t), word_ids(s), mode, silent_frames)
            for i, (t, s) in enumerate(zip(times, sentences, strict=True))]
