"""Leading-silence trimming at the start of each segment (docs/protocol.md 1.7).

The benchmark (docs/benchmarks/README.md 1) calls audio audible from the first of two consecutive 20 ms windows, stepped
every 10 ms, whose DC-removed RMS is above -45 dBFS (full scale = 1.0). Leading silence the server sends counts
against audible TTFA, so it is dropped; but nothing audible may ever be dropped. The detector here is strictly
more sensitive than the benchmark's:

- 20 ms windows stepped every 5 ms (half the benchmark's step), DC removed per window;
- ONE window is enough (the benchmark needs two consecutive ones);
- the threshold is -51 dBFS, 6 dB under the benchmark's. Any 20 ms window at any alignment lies inside the union
  of two of our windows, so its energy is at most twice (3 dB over) theirs: with the 6 dB margin, a benchmark
  window over -45 dBFS always makes one of ours fire.

When a window fires, the onset is refined to the sample: it is the first sample at which the energy accumulated
from the window's start (minus the DC of the silence before it) passes a tenth (-10 dB) of the threshold energy.
What lies before that is at most -61 dBFS spread over a window. The trimmer keeps everything from
`onset - preroll` on (clamped at the segment start) and passes all later audio through unchanged.

While it searches, it holds back at most preroll + window + hop (20 + 20 + 5 ms = 1080 samples at 24 kHz by
default) and drops the rest at once, so it adds at most that much latency and only before the onset.

The cap (`max_trim_ms`, default 2000 ms; None = no cap): the trimmer never drops more than that many samples
from a segment. Once it has proved that no onset exists before `max_trim + preroll`, it drops exactly
`max_trim` samples and passes everything after them through (a long deliberate pause is kept, shortened by the
cap). A segment that ends (`finish()`) without any onset is silence: it produces no audio at all when it was no
longer than the cap (all of it is counted in `dropped`), else only its part after the first `max_trim` samples.
The timeline stays right either way: `start_sample` counts the samples kept (docs/protocol.md 1.7), and `dropped`
says how many of the segment's samples were removed.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, dtype=np.float32)


class LeadingSilenceTrimmer:
    """Per-segment, streaming. Feed float32 mono chunks of any length with `process()`, call `finish()` at the end
    of the segment, then `reset()` (or make a new object) for the next segment. Not thread-safe: one call at a
    time per object. Callers read `dropped`, `onset`, `passing`, `received` and `held` (see reset())."""

    def __init__(
        self,
        sample_rate: int = 24000,
        *,
        preroll_ms: float = 20.0,
        threshold_dbfs: float = -51.0,
        window_ms: float = 20.0,
        hop_ms: float = 5.0,
        max_trim_ms: float | None = 2000.0,
        refine_db: float = -10.0,
    ) -> None:
        if sample_rate <= 0:
            raise ValueError("sample_rate must be positive")
        self.preroll = max(0, round(sample_rate * preroll_ms / 1000.0))
        self.window = max(1, round(sample_rate * window_ms / 1000.0))
        self.hop = max(1, round(sample_rate * hop_ms / 1000.0))
        if self.hop > self.window:
            raise ValueError("hop_ms must not exceed window_ms")
        self.max_trim = None if max_trim_ms is None else max(0, round(sample_rate * max_trim_ms / 1000.0))
        # Thresholds on the sum of squares (DC removed) over one window.
        self._thr_energy = self.window * 10.0 ** (threshold_dbfs / 10.0)
        self._refine_energy = self._thr_energy * 10.0 ** (refine_db / 10.0)
        self.reset()

    # ------------------------------------------------------------------ public

    def reset(self) -> None:
        """Forget everything: ready for a new segment."""
        self._buf = _EMPTY  # held samples, float32
        self._buf_start = 0  # segment index of _buf[0]
        self._next_win = 0  # segment index where the next unevaluated window starts
        self.received = 0  # samples received in this segment
        self.dropped = 0  # samples of this segment dropped so far
        self.onset: int | None = None  # the refined onset, counted from the segment's first sample
        self.passing = False  # audio passes through (onset found, cap reached, or finished)
        self._finished = False

    @property
    def held(self) -> int:
        """Samples held back now."""
        return len(self._buf)

    def process(self, chunk: np.ndarray) -> np.ndarray:
        """Feed the next samples of the segment; returns the samples to emit now (float32, possibly empty; once
        passing, the input itself as float32, uncopied when it already was float32)."""
        if self._finished:
            raise RuntimeError("process() after finish(); call reset() for the next segment")
        x = np.asarray(chunk, dtype=np.float32).reshape(-1)
        self.received += len(x)
        if self.passing:
            return x
        if len(x) == 0:
            return _EMPTY
        self._buf = np.concatenate((self._buf, x)) if len(self._buf) else x.copy()
        return self._search(final=False)

    def finish(self) -> np.ndarray:
        """End of the segment: returns what is still to be emitted (empty when the segment was all silent, up to
        the cap). After it, call reset() before the next segment."""
        if self._finished:
            return _EMPTY
        self._finished = True
        if self.passing:
            return _EMPTY
        out = self._search(final=True)
        if self.passing:
            return out
        # No onset anywhere: the segment is silence. Drop it (up to the cap).
        return self._pass_from(self.received if self.max_trim is None else min(self.received, self.max_trim))

    # ----------------------------------------------------------------- private

    def _search(self, final: bool) -> np.ndarray:
        win, hop = self.window, self.hop
        bs = self._buf_start
        end = bs + len(self._buf)  # one past the last received sample
        data = self._buf
        if final:
            # Windows running past the end see zeros (the listener hears silence after the segment).
            data = np.concatenate((data, np.zeros(win, dtype=np.float32)))
            last_start = end - 1  # every window that starts on a real sample
        else:
            last_start = end - win
        if last_start >= self._next_win:
            n_win = (last_start - self._next_win) // hop + 1
            off = self._next_win - bs
            seg = data[off : off + (n_win - 1) * hop + win].astype(np.float64)
            c1 = np.concatenate(([0.0], np.cumsum(seg)))
            c2 = np.concatenate(([0.0], np.cumsum(seg * seg)))
            starts = np.arange(n_win) * hop
            s1 = c1[starts + win] - c1[starts]
            s2 = c2[starts + win] - c2[starts]
            energy = s2 - s1 * s1 / win
            hits = np.flatnonzero(energy > self._thr_energy)
            if len(hits):
                w = self._next_win + int(hits[0]) * hop
                return self._found(w, data)
            self._next_win += n_win * hop
        # No onset before _next_win: everything before _next_win - preroll can go.
        drop_to = self._next_win - self.preroll
        if self.max_trim is not None and drop_to >= self.max_trim:
            return self._pass_from(self.max_trim)
        drop_to = min(drop_to, end)
        if drop_to > bs:
            self.dropped += drop_to - bs
            self._buf = self._buf[drop_to - bs :]
            self._buf_start = drop_to
        return _EMPTY

    def _found(self, w: int, data: np.ndarray) -> np.ndarray:
        off = w - self._buf_start
        seg = data[off : off + self.window].astype(np.float64)
        # The DC to remove is the silence level before the window (held samples, proven silent): the mean of
        # the firing window itself would be pulled by the onset and lend the silence energy it does not have.
        before = data[max(0, off - self.window) : off]
        if len(before):
            seg = seg - float(np.mean(before, dtype=np.float64))
        cum = np.cumsum(seg * seg)
        onset = w + int(np.argmax(cum > self._refine_energy))
        self.onset = onset
        keep_from = max(0, onset - self.preroll)
        if self.max_trim is not None:
            keep_from = min(keep_from, self.max_trim)
        return self._pass_from(keep_from)

    def _pass_from(self, keep_from: int) -> np.ndarray:
        bs = self._buf_start
        keep_from = min(max(keep_from, bs), bs + len(self._buf))
        out = self._buf[keep_from - bs :]
        self.dropped += keep_from - bs
        self._buf = _EMPTY
        self._buf_start = self.received
        self.passing = True
        return out
