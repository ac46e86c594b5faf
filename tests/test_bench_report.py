"""Report files, the capacity search rule, the plot and the table (no server)."""

from __future__ import annotations

import math

from bench import metrics
from bench.capacity import capacity_of, next_rate
from bench.plot import plot
from bench.report import environment, load_report, write_report
from bench.table import markdown


def _point(rps: float, p95: float, workload="w1") -> dict:
    recs = [{"status": "ok", "audible_ttfa_ms": p95, "first_playable_ms": p95 / 2, "e2e_ms": 4000.0,
             "underruns": 0, "stall_ms": 0.0, "audio_ms": 4000.0} for _ in range(20)]
    if math.isinf(p95):
        recs = [{"status": "refused"} for _ in range(20)]
    s = metrics.summarize(recs, 10.0)
    s["peak_in_flight"] = 3
    return {"config": {"workload": workload, "rps": rps}, "summary": s}


def test_report_round_trip_keeps_infinity(tmp_path):
    rep = {"kind": "loadgen", **environment("bench.loadgen"), "points": [_point(5, 20.0), _point(50, math.inf)]}
    path = write_report(rep, tmp_path / "r.json")
    assert "Infinity" not in path.read_text()
    back = load_report(path)
    assert back["points"][1]["summary"]["latency_ms"]["audible_ttfa_ms"]["p95"] == math.inf
    assert back["command"].startswith("python -m bench.loadgen")
    assert "commit" in back and "gpu" in back


def _search(capacity: float, **kw) -> tuple[float, list[float]]:
    args = dict(start=10, factor=2, max_rps=400, min_rps=0.25, resolution=0.1, min_step=1.0) | kw
    passed, failed, tried = [], [], []
    while (r := next_rate(passed, failed, **args)) is not None:
        assert r not in tried
        tried.append(r)
        (passed if r <= capacity else failed).append(r)
    return (max(passed) if passed else 0.0), tried


def test_capacity_search_brackets_then_bisects():
    cap, tried = _search(37.0)
    assert tried[:3] == [10, 20, 40]
    assert 37.0 * 0.9 <= cap <= 37.0
    assert len(tried) <= 8


def test_capacity_search_goes_down_and_stops_at_the_limits():
    cap, tried = _search(3.0)
    assert tried[:3] == [10, 5, 2.5] and 2.5 <= cap <= 3.0
    assert _search(1000.0)[0] == 400  # capped at --max-rps
    assert _search(0.0)[0] == 0.0


def test_capacity_of_points():
    assert capacity_of([_point(10, 20.0), _point(20, 30.0), _point(40, 80.0)]) == 20
    assert capacity_of([_point(10, 80.0)]) == 0.0


def test_plot_and_table(tmp_path):
    reports = [{"kind": "loadgen", "commit": "abc", "gpu": None,
                "points": [_point(1, 12.0), _point(10, 20.0), _point(20, 60.0), _point(40, math.inf)]},
               {"kind": "capacity", "search": {"workload": "w1"}, "capacity_rps": 10.0, "done": True,
                "points": [_point(5, 11.0, "w2")]}]
    baseline = {"points": [{"summary": {**_point(0, 6000.0)["summary"], "ms_per_frame": {"p50": 150.0},
                                        "rtf": {"p50": 1.9}}}]}
    out = plot(reports, str(tmp_path / "p.png"), baseline)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out
    md = markdown(reports, baseline)
    assert md.count("| W1 |") == 4 and md.count("| W2 |") == 1
    assert "inf" in md and "Capacity at SLO (W1): **10 RPS**" in md and "Official qwen-tts" in md


def test_a_copy_without_git_history_names_its_commit(monkeypatch):
    from bench.report import git_info

    monkeypatch.delenv("VOICELANE_COMMIT", raising=False)
    from_git = git_info()
    assert from_git["commit"] and "commit_from" not in from_git
    monkeypatch.setenv("VOICELANE_COMMIT", "8a80ad4")
    assert git_info() == {"commit": "8a80ad4", "dirty": None, "commit_from": "VOICELANE_COMMIT"}
