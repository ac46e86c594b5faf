"""The load generator against a live CPU server on the tiny checkpoint, for a few seconds (W1 and W2).

The shared "default" test server (tests/live_server.py) runs with --bench-frames-per-word 2 and admission off,
so every request is admitted and each segment is exactly 2 frames (160 ms) per word, at most --max-frames 64.
Only plumbing and bookkeeping are asserted: the CPU is shared, so no latency is bounded here.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from live_server import live_server

from bench.loadgen import PointConfig, probe_server, run_point
from bench.prompts import SENTENCES
from bench.server_first_audio import PHASES


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


def _cfg(url: str, workload: str) -> PointConfig:
    # constant arrivals at 0, 1, 2, 3 s; the window [0.5, 2.5) measures the two at 1 s and 2 s
    return PointConfig(url=url, workload=workload, rps=1.0, arrival="constant", warmup=0.5, window=2.0, seed=0,
                       drain_timeout=120.0, request_timeout=120.0, max_words=9, records="all", cooldown=False)


def _check(point: dict, frames_per_word: int, max_frames: int = 64) -> None:
    s = point["summary"]
    measured = [r for r in point["requests"] if r["phase"] == "measured"]
    assert s["offered"] == len(measured) == 2
    assert s["errors"] == 0, [r.get("error") for r in measured]
    for r in measured:
        assert r["status"] == "ok"
        assert SENTENCES[r["prompt"]].split() and r["words"] <= 9
        frames = min(frames_per_word * r["words"], max_frames)
        # exact length in benchmark mode, less any leading silence the server trims
        assert 0 < r["audio_ms"] <= frames * 80.0
        assert 0 < r["first_playable_ms"] <= r["e2e_ms"]
        assert math.isfinite(r["audible_ttfa_ms"]) and r["audible_ttfa_ms"] >= r["first_playable_ms"]
        assert r["underruns"] >= 0 and r["stall_ms"] >= 0.0
    lat = s["latency_ms"]
    assert lat["audible_ttfa_ms"]["n"] == 2 and lat["audible_ttfa_ms"]["n_inf"] == 0
    assert s["peak_in_flight"] >= 1
    # the server's /metrics over the window: the contexts whose first audio went out in it, phase by phase
    server = point["server_first_audio"]
    assert "error" not in server, server
    assert server["ttfa_ms"]["count"] >= 1 and list(server["phases_ms"]) == list(PHASES)
    assert {p["count"] for p in server["phases_ms"].values()} == {server["ttfa_ms"]["count"]}
    assert sum(p["mean"] for p in server["phases_ms"].values()) == pytest.approx(server["ttfa_ms"]["mean"], abs=0.01)
    loop = server["engine_loop"]  # the engine loop over the window: steps ran, host time; no CUDA idle gaps here
    assert loop["steps"] > 0 and loop["host_ms_per_step"] > 0 and loop["busy_ms"] > 0
    assert loop["idle_gap_ms"]["count"] == 0


def test_live_w1_http(server):
    async def go():
        info = await probe_server(server.http_url)
        return info, await run_point(_cfg(server.http_url, "w1"))

    info, point = asyncio.run(go())
    assert info["/ready"]["ready"] is True
    fpw = info["session"]["bench_frames_per_word"]
    assert fpw == 2
    _check(point, fpw)
    assert all(r["http_status"] == 200 for r in point["requests"] if r["phase"] == "measured")


def test_live_w2_websocket(server):
    point = asyncio.run(run_point(_cfg(server.http_url, "w2"), frames_per_word=2))
    _check(point, 2)
    for r in point["requests"]:
        if r["phase"] == "measured":
            assert r["done_reason"] == "completed"
            assert r["timeline_gaps"] == 0
    assert point["client"]["sessions_opened"] >= 1
