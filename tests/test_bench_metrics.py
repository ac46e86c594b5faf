"""bench.metrics on synthetic signals and packet traces whose answers are known by construction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import metrics
from bench.metrics import Packet

SR = 24000
HOP, WIN = 240, 480


def tone(n: int, level_dbfs: float, freq: float = 1000.0, start: int = 0) -> np.ndarray:
    """A sine whose RMS is `level_dbfs` (re full scale 1.0); 1 kHz fills a 20 ms window with whole cycles."""
    amp = math.sqrt(2) * 10 ** (level_dbfs / 20)
    t = np.arange(n - start) / SR
    return np.concatenate([np.zeros(start), amp * np.sin(2 * np.pi * freq * t)])


def test_silence_then_tone_on_the_hop_grid_onset_within_10ms():
    start = 2400  # 100 ms, a multiple of the hop
    x = tone(SR, -20.0, start=start)
    onset = metrics.audible_onset(x)
    # the window [2160, 2640) is half tone (-23 dBFS) and the next one all tone: onset is the start of the first
    assert onset == start - HOP
    assert abs(onset - start) / SR * 1e3 <= 10.0


@pytest.mark.parametrize("start", list(range(2000, 2481, 37)))
def test_onset_is_on_the_hop_grid_and_within_one_window_before_the_sound(start):
    onset = metrics.audible_onset(tone(SR, -20.0, start=start))
    assert onset % HOP == 0
    assert start - WIN < onset <= start


def test_onset_of_a_quiet_tone_needs_more_of_the_window():
    # at -40 dBFS a window must hold > 10**-0.5 (31.6%) of tone to pass -45 dBFS, i.e. more than 151 samples
    start = 2400 + 100
    onset = metrics.audible_onset(tone(SR, -40.0, start=start))
    # window 2160 holds 2640 - 2500 = 140 samples (29%): below; window 2400 holds 380: above, and so is 2640
    assert onset == 2400


def test_threshold_minus_44_is_audible_minus_46_is_not():
    assert metrics.audible_onset(tone(SR, -44.0)) == 0
    assert metrics.audible_onset(tone(SR, -46.0)) is None
    # the same through int16 PCM (what the wire carries)
    pcm44 = np.round(tone(SR, -44.0) * 32768).astype(np.int16)
    pcm46 = np.round(tone(SR, -46.0) * 32768).astype(np.int16)
    assert metrics.audible_onset(pcm44) == 0
    assert metrics.audible_onset(pcm46) is None


def test_levels_are_rms_re_full_scale():
    _, db = metrics.window_levels_dbfs(tone(4800, -30.0))
    assert np.allclose(db, -30.0, atol=0.01)
    _, db_full = metrics.window_levels_dbfs(tone(4800, 0.0) / math.sqrt(2))  # full-scale sine: -3.01 dBFS
    assert np.allclose(db_full, -3.0103, atol=0.01)


def test_dc_offset_is_ignored():
    dc = np.full(SR, 0.25)  # -12 dBFS of pure DC
    assert metrics.audible_onset(dc) is None
    start = 3000
    assert metrics.audible_onset(dc + tone(SR, -30.0, start=start)) == metrics.audible_onset(
        tone(SR, -30.0, start=start))
    assert metrics.audible_onset(np.round((dc + tone(SR, -50.0)) * 32767).astype(np.int16)) is None


def test_a_single_loud_window_is_not_an_onset():
    x = np.zeros(SR)
    x[:100] = tone(100, -10.0)  # only inside window 0 (there is no window before it)
    assert metrics.audible_onset(x) is None
    x[SR - 100 :] = tone(100, -10.0)  # only inside the last complete window
    assert metrics.audible_onset(x) is None


def test_too_short_for_two_windows():
    assert metrics.audible_onset(tone(WIN + HOP - 1, -10.0)) is None
    assert metrics.audible_onset(tone(WIN + HOP, -10.0)) == 0
    assert metrics.audible_onset(np.zeros(0)) is None


def regular_packets(t0: float, count: int, n: int = 1920, early: float = 0.02) -> list[Packet]:
    """Packets of n samples, each arriving `early` seconds before it is due (the first at t0)."""
    return [Packet(t0 if k == 0 else t0 + k * n / SR - early, k * n, n) for k in range(count)]


def test_no_underruns_when_every_packet_is_early_or_exactly_on_time():
    pk = regular_packets(1.0, 12)
    pb = metrics.simulate_playback(pk)
    assert pb.underruns == 0 and pb.stall_s == 0.0
    on_time = [Packet(1.0 + k * 1920 / SR, k * 1920, 1920) for k in range(12)]  # arrival == due: not late
    assert metrics.simulate_playback(on_time).underruns == 0


def test_late_packets_are_counted_exactly_and_the_schedule_shifts():
    t0 = 1.0
    arrivals = {0: t0, 1: 1.06, 2: 1.14, 3: 1.22, 4: 1.30,
                5: t0 + 0.40 + 0.030,  # due 1.40: 30 ms late -> stall 30 ms, schedule +30 ms
                6: 1.45, 7: 1.54, 8: 1.62,  # due 1.51, 1.59, 1.67: early
                9: t0 + 0.72 + 0.050,  # due 1.75 after the shift: 20 ms late
                10: 1.80, 11: 1.90}
    pk = [Packet(arrivals[k], k * 1920, 1920) for k in range(12)]
    pb = metrics.simulate_playback(pk)
    assert pb.underruns == 2
    assert pb.stall_s == pytest.approx(0.050, abs=1e-9)
    assert pb.end == pytest.approx(t0 + 12 * 0.08 + 0.050, abs=1e-9)
    m = metrics.request_metrics(0.9, pk, np.zeros(12 * 1920), last_byte=1.95)
    assert m["underruns"] == 2 and m["stall_ms"] == pytest.approx(50.0, abs=1e-6)
    assert m["first_playable_ms"] == pytest.approx(100.0)
    assert m["e2e_ms"] == pytest.approx(1050.0)
    assert m["audible_ttfa_ms"] == math.inf  # all silence: never audible


def test_empty_packets_and_split_samples():
    chunks = [(1.0, 1), (1.1, 3), (1.2, 3), (1.3, 1), (1.4, 0)]
    pk = metrics.packets_from_byte_chunks(chunks)
    assert [(p.start, p.n) for p in pk] == [(0, 0), (0, 2), (2, 1), (3, 1), (4, 0)]
    assert metrics.first_playable_time(pk) == 1.1  # the first chunk completes no sample
    pb = metrics.simulate_playback(pk)
    assert pb.t0 == 1.1 and len(pb.packets) == 3
    assert metrics.simulate_playback([Packet(1.0, 0, 0)]) is None


def test_audible_ttfa_counts_leading_silence_and_stalls_on_the_playback_timeline():
    n = 1920
    samples = np.concatenate([np.zeros(2 * n), tone(4 * n, -20.0)])  # 160 ms of silence, then tone
    onset = metrics.audible_onset(samples)
    assert onset == 2 * n - HOP  # 150 ms
    dispatch, t0 = 10.0, 10.05
    pk = [Packet(t0, 0, n), Packet(t0 + 0.01, n, n), Packet(t0 + 0.02, 2 * n, n), Packet(t0 + 0.03, 3 * n, n),
          Packet(t0 + 0.04, 4 * n, n), Packet(t0 + 0.05, 5 * n, n)]
    m = metrics.request_metrics(dispatch, pk, samples)
    assert m["first_playable_ms"] == pytest.approx(50.0)
    assert m["onset_ms"] == pytest.approx(150.0)
    assert m["audible_ttfa_ms"] == pytest.approx(50.0 + 150.0)
    assert m["audible_arrival_ms"] == pytest.approx(50.0 + 10.0)  # the packet holding the onset came early
    # packet 1 (holding the onset at sample 3600) arrives 100 ms after it is due: playback stalls, onset later
    late = list(pk)
    late[1] = Packet(t0 + 0.08 + 0.1, n, n)
    late[2:] = [Packet(t0 + 0.19 + 0.01 * k, p.start, n) for k, p in enumerate(pk[2:])]
    m = metrics.request_metrics(dispatch, late, samples)
    assert m["underruns"] == 1 and m["stall_ms"] == pytest.approx(100.0)
    assert m["audible_ttfa_ms"] == pytest.approx(50.0 + 150.0 + 100.0)


def test_packets_after_a_barge_in_are_left_out():
    pk = [Packet(1.0 + 0.08 * k + (0.5 if k >= 3 else 0.0), k * 1920, 1920) for k in range(6)]
    assert metrics.simulate_playback(pk).underruns == 1
    assert metrics.simulate_playback(pk, until=1.3).underruns == 0


def test_percentiles_linear_and_infinite():
    v = list(range(1, 101))
    for q in (50, 95, 99):
        assert metrics.percentile(v, q) == pytest.approx(np.percentile(v, q))
    four = [1.0] * 96 + [math.inf] * 4
    five = [1.0] * 95 + [math.inf] * 5
    assert metrics.percentile(four, 95) == 1.0
    assert metrics.percentile(five, 95) == math.inf
    assert math.isnan(metrics.percentile([], 50))
    assert metrics.percentile([math.inf], 50) == math.inf


def _rec(status="ok", ttfa=10.0, fp=8.0, e2e=500.0, underruns=0, stall=0.0):
    return {"status": status, "audible_ttfa_ms": ttfa, "first_playable_ms": fp, "e2e_ms": e2e,
            "underruns": underruns, "stall_ms": stall, "audio_ms": 1000.0}


def test_summary_counts_refusals_as_infinite_latency_over_offered_requests():
    recs = [_rec(ttfa=float(i)) for i in range(95)] + [_rec("refused", None, None, None)] * 5
    s = metrics.summarize(recs, window_s=10.0)
    assert s["offered"] == 100 and s["ok"] == 95 and s["errors"] == 5
    assert s["errors_by_kind"] == {"refused": 5}
    assert s["latency_ms"]["audible_ttfa_ms"]["p95"] == math.inf
    assert s["latency_ms"]["audible_ttfa_ms"]["n_inf"] == 5
    assert s["latency_ms"]["audible_ttfa_ms"]["p50"] == pytest.approx(49.5)
    assert s["offered_rps"] == 10.0 and s["achieved_rps"] == 9.5
    assert not s["slo"]["pass"] and not s["slo"]["errors_ok"]


def test_summary_underruns_cancelled_and_slo():
    recs = [_rec(ttfa=20.0) for _ in range(8)] + [_rec(underruns=2, stall=35.0), _rec("cancelled", e2e=None)]
    s = metrics.summarize(recs, window_s=5.0)
    assert s["underrun_requests"] == 1 and s["underrun_packets"] == 2 and s["total_stall_ms"] == 35.0
    assert s["cancelled"] == 1 and s["errors"] == 0
    assert s["latency_ms"]["e2e_ms"]["n"] == 9  # a barge-in has no E2E
    assert s["latency_ms"]["audible_ttfa_ms"]["n"] == 10
    assert not s["slo"]["pass"] and s["slo"]["ttfa_ok"] and not s["slo"]["underruns_ok"]
    ok = metrics.summarize([_rec(ttfa=20.0) for _ in range(10)], window_s=5.0)
    assert ok["slo"]["pass"]
    slow = metrics.summarize([_rec(ttfa=60.0) for _ in range(10)], window_s=5.0)
    assert not slow["slo"]["pass"] and not slow["slo"]["ttfa_ok"]
    assert not metrics.summarize([], window_s=5.0)["slo"]["pass"]


def test_an_underrunning_request_keeps_its_playback_timeline_and_a_smooth_one_does_not():
    n = 1920  # 80 ms
    smooth = [Packet(1.0 + k * 0.05, k * n, n) for k in range(4)]
    assert "timeline_ms" not in metrics.request_metrics(0.99, smooth, last_byte=1.2)
    late = smooth[:1] + [Packet(1.2, n, n), Packet(1.21, 2 * n, n)]  # the second packet is due at 1.08
    got = metrics.request_metrics(0.99, late, last_byte=1.21)
    assert got["underruns"] == 1 and got["stall_ms"] == pytest.approx(120.0)
    assert got["timeline_ms"] == [[10.0, 10.0, 0.0, 80.0], [210.0, 210.0, 80.0, 80.0], [220.0, 290.0, 160.0, 80.0]]
