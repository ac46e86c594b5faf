"""Leading-silence trimmer: nothing audible is cut, the pre-roll is kept, chunking does not matter."""

import numpy as np
import pytest

from server.audio import LeadingSilenceTrimmer

SR = 24000
MS = SR // 1000  # samples per ms
PREROLL = 20 * MS
WIN = 20 * MS


def tone(n, freq=440.0, dbfs=-6.0, phase=0.0):
    amp = np.sqrt(2.0) * 10 ** (dbfs / 20.0)  # RMS of the sine = dbfs
    return (amp * np.sin(2 * np.pi * freq * np.arange(n) / SR + phase)).astype(np.float32)


def window_dbfs_all_offsets(x):
    """DC-removed RMS (dBFS) of every 20 ms window, at every sample offset."""
    x = x.astype(np.float64)
    if len(x) < WIN:
        x = np.concatenate([x, np.zeros(WIN - len(x))])
    c1 = np.concatenate([[0.0], np.cumsum(x)])
    c2 = np.concatenate([[0.0], np.cumsum(x * x)])
    s1 = c1[WIN:] - c1[:-WIN]
    s2 = c2[WIN:] - c2[:-WIN]
    var = np.maximum(s2 - s1 * s1 / WIN, 1e-30) / WIN
    return 10 * np.log10(var)


def benchmark_onset(x, threshold_dbfs=-45.0):
    """docs/benchmarks/README.md 1: 20 ms windows stepped 10 ms from the first sample, DC removed, above -45 dBFS in two
    consecutive windows; the onset is the first one's start. None when nothing is audible."""
    db = window_dbfs_all_offsets(x)[:: 10 * MS]
    above = db > threshold_dbfs
    for i in range(len(above) - 1):
        if above[i] and above[i + 1]:
            return i * 10 * MS
    return None


def run(trimmer, x, chunks):
    """Feed x in the given chunk sizes (cycled); returns output and the largest hold-back seen while searching."""
    out, i, k, max_held = [], 0, 0, 0
    while i < len(x):
        n = chunks[k % len(chunks)]
        out.append(trimmer.process(x[i : i + n]))
        if not trimmer.passing:
            max_held = max(max_held, trimmer.held)
        i += n
        k += 1
    out.append(trimmer.finish())
    return np.concatenate(out), max_held


CHUNKINGS = [[1920], [480], [1], [7], [160, 1921, 33], [2000, 1, 3000], [100000]]


def check_no_audible_cut(x, dropped):
    """Everything dropped is far from audible: every 20 ms window inside it is under -55 dBFS."""
    if dropped >= WIN:
        assert window_dbfs_all_offsets(x[:dropped]).max() < -55.0


@pytest.mark.parametrize("chunks", CHUNKINGS)
@pytest.mark.parametrize("start_ms", [0, 5, 20, 37.3, 250])
def test_silence_then_tone(chunks, start_ms):
    start = int(start_ms * MS)
    x = np.concatenate([np.zeros(start, np.float32), tone(int(0.12 * SR))])
    tr = LeadingSilenceTrimmer(SR)
    y, max_held = run(tr, x, chunks)
    # only a prefix is dropped; everything after it passes unchanged
    assert tr.dropped == len(x) - len(y)
    np.testing.assert_array_equal(y, x[tr.dropped :])
    # the pre-roll before the tone is kept, within 1 ms; the tone is kept whole
    expected = max(0, start - PREROLL)
    assert abs(tr.dropped - expected) <= MS, (tr.dropped, expected)
    assert tr.dropped <= start
    check_no_audible_cut(x, tr.dropped)
    # the benchmark sees the tone's onset in the output at or before where the tone starts
    onset = benchmark_onset(y)
    assert onset is not None and onset <= start - tr.dropped
    # hold back no more than pre-roll + window + hop while searching
    assert max_held <= PREROLL + WIN + 5 * MS


@pytest.mark.parametrize("level", [-40.0, -44.0])
@pytest.mark.parametrize("chunks", [[1920], [480], [13, 700]])
def test_quiet_audible_start_is_not_cut(level, chunks):
    start = int(0.3 * SR)
    quiet = tone(int(0.1 * SR), freq=200.0, dbfs=level)
    x = np.concatenate([np.zeros(start, np.float32), quiet, tone(int(0.1 * SR))])
    assert benchmark_onset(x[start - 20 * MS :]) is not None  # the quiet part alone is audible by the benchmark
    tr = LeadingSilenceTrimmer(SR)
    y, _ = run(tr, x, chunks)
    assert start - PREROLL - MS <= tr.dropped <= start - PREROLL + MS
    np.testing.assert_array_equal(y, x[tr.dropped :])
    check_no_audible_cut(x, tr.dropped)


def test_noise_floor_and_dc_offset_are_trimmed():
    rng = np.random.default_rng(7)
    start = int(0.4 * SR)
    noise = (rng.standard_normal(start) * 10 ** (-70 / 20)).astype(np.float32)  # -70 dBFS floor
    x = np.concatenate([noise + np.float32(0.05), tone(SR // 10) + np.float32(0.05)])  # DC 0.05 throughout
    tr = LeadingSilenceTrimmer(SR)
    y, _ = run(tr, x, [1920])
    assert abs(tr.dropped - (start - PREROLL)) <= MS
    np.testing.assert_array_equal(y, x[tr.dropped :])


@pytest.mark.parametrize("chunks", [[1920], [480], [5]])
def test_chunking_invariance(chunks):
    rng = np.random.default_rng(3)
    start = int(0.173 * SR)
    x = np.concatenate([np.zeros(start, np.float32), (rng.standard_normal(SR // 5) * 0.1).astype(np.float32)])
    ref = LeadingSilenceTrimmer(SR)
    y_ref, _ = run(ref, x, [len(x)])
    tr = LeadingSilenceTrimmer(SR)
    y, _ = run(tr, x, chunks)
    assert tr.dropped == ref.dropped and tr.onset == ref.onset
    np.testing.assert_array_equal(y, y_ref)


def test_all_silent_segment_produces_nothing():
    tr = LeadingSilenceTrimmer(SR)
    x = np.zeros(int(0.5 * SR), np.float32)
    y, _ = run(tr, x, [1920])
    assert len(y) == 0 and tr.dropped == len(x) and tr.onset is None


def test_cap_limits_what_is_dropped():
    tr = LeadingSilenceTrimmer(SR, max_trim_ms=100)
    silence = np.zeros(int(0.3 * SR), np.float32)
    y, _ = run(tr, silence, [1920])
    assert tr.dropped == 100 * MS and len(y) == len(silence) - 100 * MS
    tr.reset()
    x = np.concatenate([silence, tone(SR // 10)])
    y, _ = run(tr, x, [480])
    assert tr.dropped == 100 * MS
    np.testing.assert_array_equal(y, x[100 * MS :])
    # no cap: a long silence is dropped whole
    tr = LeadingSilenceTrimmer(SR, max_trim_ms=None)
    x = np.concatenate([np.zeros(3 * SR, np.float32), tone(SR // 10)])
    y, _ = run(tr, x, [1920])
    assert abs(tr.dropped - (3 * SR - PREROLL)) <= MS


def test_short_click_at_segment_end_is_kept():
    start = int(0.2 * SR)
    x = np.concatenate([np.zeros(start, np.float32), tone(5 * MS, freq=1000.0, dbfs=-10.0)])
    tr = LeadingSilenceTrimmer(SR)
    y, _ = run(tr, x, [1920])
    assert abs(tr.dropped - (start - PREROLL)) <= MS
    np.testing.assert_array_equal(y, x[tr.dropped :])


def test_reset_and_pass_through_after_onset():
    tr = LeadingSilenceTrimmer(SR)
    x = np.concatenate([np.zeros(SR // 10, np.float32), tone(SR // 10)])
    y1, _ = run(tr, x, [1920])
    later = np.zeros(1000, np.float32)
    with pytest.raises(RuntimeError):
        tr.process(later)
    tr.reset()
    assert tr.dropped == 0 and not tr.passing and tr.onset is None
    y2, _ = run(tr, x, [1920])
    np.testing.assert_array_equal(y1, y2)
    # once passing, silence later in the segment is passed through untouched
    tr.reset()
    out = tr.process(x)
    assert tr.passing
    np.testing.assert_array_equal(tr.process(later), later)
    assert len(out) == len(x) - tr.dropped


def test_random_bursts_near_threshold_never_cut():
    """Bursts of 5-60 ms at -56..-38 dBFS at random places: every 20 ms window (any alignment) inside what was
    dropped stays at most -48 dBFS (the 6 dB margin less the 3 dB of an unaligned window), below the benchmark's
    -45, and what is kept is the input's exact suffix."""
    rng = np.random.default_rng(11)
    for _ in range(60):
        n = int(0.5 * SR)
        x = (rng.standard_normal(n) * 10 ** (-80 / 20)).astype(np.float32)
        for _ in range(rng.integers(1, 4)):
            length = int(rng.integers(5, 61)) * MS
            pos = int(rng.integers(0, n - length))
            x[pos : pos + length] += tone(
                length,
                freq=float(rng.uniform(80, 4000)),
                dbfs=float(rng.uniform(-56, -38)),
                phase=float(rng.uniform(0, 6.3)),
            )
        tr = LeadingSilenceTrimmer(SR)
        y, _ = run(tr, x, [int(rng.integers(1, 2500))])
        np.testing.assert_array_equal(y, x[tr.dropped :])
        if tr.dropped >= WIN:
            assert window_dbfs_all_offsets(x[: tr.dropped]).max() <= -48.0
