"""The load generator's account of the server's first audio (bench/server_first_audio.py): histogram differences
between two hand-written /metrics scrapes, whose counts, means and interpolated percentiles are known."""

from __future__ import annotations

import math

import pytest

from bench.server_first_audio import PHASES, Histogram, breakdown, client_ttfa, table, window_breakdown
from server.metrics import FIRST_AUDIO_PHASES

BOUNDS = (0.001, 0.002, 0.004, math.inf)


def exposition(series: dict[tuple[str, str], tuple[list[int], float]], ttfa: tuple[list[int], float]) -> str:
    """/metrics text: the phase histograms {(transport, phase): (count per bucket, sum)} and the http TTFA."""

    def rows(name: str, labels: str, counts: list[int], total: float) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip(BOUNDS, counts, strict=True):
            cumulative += n
            le = "+Inf" if math.isinf(bound) else repr(bound)
            out.append(f'{name}_bucket{{{labels}le="{le}"}} {cumulative}')
        plain = labels.rstrip(",")
        return out + [f"{name}_count{{{plain}}} {cumulative}", f"{name}_sum{{{plain}}} {total}"]

    lines = ["# HELP voicelane_ttfa_seconds TTFA", "# TYPE voicelane_ttfa_seconds histogram",
             *rows("voicelane_ttfa_seconds", 'transport="http",', *ttfa),
             "# HELP voicelane_first_audio_phase_seconds phases",
             "# TYPE voicelane_first_audio_phase_seconds histogram"]
    for (transport, phase), (counts, total) in series.items():
        lines += rows("voicelane_first_audio_phase_seconds", f'phase="{phase}",transport="{transport}",', counts, total)
    return "\n".join(lines) + "\n"


def test_quantiles_interpolate_inside_the_bucket_like_histogram_quantile():
    h = Histogram(BOUNDS, (0, 4, 10, 10), total=0.025, count=10)  # 4 in (1, 2] ms, 6 in (2, 4] ms
    assert h.quantile(0.5) == pytest.approx(0.002 + 0.002 * (5 - 4) / 6)
    assert h.quantile(0.95) == pytest.approx(0.002 + 0.002 * (9.5 - 4) / 6)
    assert h.quantile(0.4) == pytest.approx(0.002)  # rank 4 ends the (1, 2] ms bucket
    assert Histogram(BOUNDS, (1, 1, 1, 1), 0.0005, 1).quantile(0.5) == pytest.approx(0.0005)  # first bucket from 0
    assert Histogram(BOUNDS, (0, 0, 1, 3), 1.0, 3).quantile(0.95) == 0.004  # in +Inf: the largest finite bound
    assert math.isnan(Histogram(BOUNDS, (0, 0, 0, 0), 0.0, 0).quantile(0.5))


def test_breakdown_is_the_difference_of_the_two_scrapes():
    start = exposition({("http", "queue"): ([1, 0, 0, 0], 0.0005), ("ws", "queue"): ([0, 0, 0, 7], 9.0)},
                       ttfa=([0, 0, 1, 0], 0.003))
    end = exposition({("http", "queue"): ([1, 4, 6, 0], 0.0255), ("http", "server_in"): ([10, 0, 0, 0], 0.002),
                      ("ws", "queue"): ([0, 0, 0, 9], 19.0)},
                     ttfa=([0, 0, 11, 0], 0.033))
    client = client_ttfa([{"status": "ok", "audible_ttfa_ms": 12.0}, {"status": "ok", "audible_ttfa_ms": 2.0},
                          {"status": "ok", "audible_ttfa_ms": math.inf}, {"status": "refused"},
                          {"status": "cancelled", "audible_ttfa_ms": 1.0}])
    assert client == {"count": 3, "p50": 2.0, "mean": 5.0}  # the heard requests only: the server saw no others
    out = breakdown(start, end, "http", client)
    assert list(out["phases_ms"]) == ["server_in", "queue"]  # the server's order, the other transport left out
    queue = out["phases_ms"]["queue"]
    assert queue["count"] == 10 and queue["mean"] == pytest.approx(2.5)  # (25.5 - 0.5) ms / 10: the sums, exact
    assert queue["p50"] == pytest.approx(2 + 2 * (5 - 4) / 6)
    assert queue["p95"] == pytest.approx(2 + 2 * (9.5 - 4) / 6)
    assert out["phases_ms"]["server_in"]["p50"] == pytest.approx(0.5)  # never seen at the start: all of it counts
    ttfa = out["ttfa_ms"]
    assert ttfa["count"] == 10 and ttfa["mean"] == pytest.approx(3.0) and ttfa["p50"] == pytest.approx(3.0)
    assert out["client_minus_server_ms"] == {"p50": pytest.approx(-1.0), "mean": pytest.approx(2.0)}
    assert "queue" in table(out) and "= server TTFA" in table(out)


def test_a_failed_or_foreign_scrape_says_why():
    assert "refused" in window_breakdown(ConnectionRefusedError("refused"), "", "w1", {})["error"]
    assert "not taken" in window_breakdown("", None, "w2", {})["error"]
    out = window_breakdown("", "", "w2", {})
    assert out["transport"] == "ws" and "no voicelane_ttfa_seconds" in out["error"]
    assert "server first audio (ws)" in table(out)


def test_the_phase_order_is_the_servers():
    assert PHASES == FIRST_AUDIO_PHASES


def engine_scrape(steps: int, host_s: float, idle_per_bucket: list[int], idle_s: float, busy_s: float) -> str:
    """What the server's /metrics says of its engine loop at one moment (rendered by the server's own code)."""
    from engine import EngineStats, LoopStats, StageStats
    from server.metrics import ServerMetrics

    stats = EngineStats(contexts=0, requests=0, free_slots=1, waiting_first_audio=0, text_starved=0, queue_depth={},
                        pacing=False,
                        stages={"talker": StageStats(steps=steps, rows=steps, seconds=busy_s * 0.4,
                                                     histogram=[steps] + [0] * 10),
                                "codec": StageStats(steps=steps, rows=steps, seconds=busy_s * 0.6,
                                                    histogram=[steps] + [0] * 10)},
                        kv_cache_bytes=0, open_contexts=0,
                        loop=LoopStats(steps, host_s, idle_s, sum(idle_per_bucket), idle_per_bucket))
    return ServerMetrics().render(stats, {"model": "m", "random_weights": "true"}, {"ready": True})


def test_the_engine_loop_over_the_window_is_the_difference_of_its_counters():
    """Steps, host time per step, busy and idle device time and the idle gaps' distribution come from the counters'
    and histograms' differences between the two scrapes; a server without these series gives none."""
    start = engine_scrape(100, 0.05, [10, 0, 0, 0, 0, 0, 0, 0], 0.0002, busy_s=0.3)
    end = engine_scrape(300, 0.25, [110, 50, 40, 0, 0, 0, 0, 0], 0.0002 + 0.019, busy_s=0.9)
    nobody = {"count": 0, "p50": math.nan, "mean": math.nan}
    ttfa_start, ttfa_end = exposition({}, ([1, 0, 0, 0], 0.001)), exposition({}, ([2, 0, 0, 0], 0.002))
    out = breakdown(start + ttfa_start, end + ttfa_end, "http", nobody)
    loop = out["engine_loop"]
    assert loop["steps"] == 200 and loop["host_ms_per_step"] == pytest.approx(1.0)
    assert loop["busy_ms"] == pytest.approx(600.0) and loop["idle_ms"] == pytest.approx(19.0)
    assert loop["idle_share"] == pytest.approx(19.0 / 619.0)
    gaps = loop["idle_gap_ms"]
    assert gaps["count"] == 190 and gaps["mean"] == pytest.approx(0.1)
    assert gaps["p50"] == pytest.approx(0.05 * 95 / 100)  # inside the first bucket (0, 50 us]
    assert gaps["p95"] == pytest.approx(0.2 + 0.3 * (180.5 - 150) / 40)  # inside (200, 500] us
    assert "engine loop: 200 steps, host 1.00 ms a step; device idle between steps 3.1%" in table(out)
    assert breakdown(ttfa_start, ttfa_end, "http", nobody)["engine_loop"] is None
