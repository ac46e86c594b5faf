"""The official-package baseline on the tiny checkpoint (CPU): lengths match the benchmark mode, one request at a
time, first audio only with the whole utterance."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def official_server(tiny_checkpoint):
    from bench.baseline_official import OfficialTTS, start_server

    tts = OfficialTTS(tiny_checkpoint, "cpu", "float32", attn="sdpa", frames_per_word=1)
    srv = start_server(tts, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{srv.server_address[1]}", tts
    srv.shutdown()


def test_official_lengths_follow_frames_per_word(official_server):
    _url, tts = official_server
    pcm, info = tts.synthesize("one two three four five six")
    assert info["frames"] == info["frames_requested"] == 6
    assert pcm.dtype.str == "<i2" and len(pcm) == 6 * 1920
    assert pcm.std() > 0


def test_official_closed_loop_measurement(official_server):
    from bench.baseline_official import measure
    from bench.prompts import prompt_sequence

    url, _tts = official_server
    point = asyncio.run(measure(url, n=2, seed=3, warmup=0))
    texts = prompt_sequence(3, 2)
    recs = point["requests"]
    assert [r["status"] for r in recs] == ["ok", "ok"]
    for r, text in zip(recs, texts, strict=True):
        assert r["frames"] == len(text.split())  # 1 frame per word here, as 5 per word on the GPU
        assert r["audio_ms"] == 80.0 * r["frames"]
        assert 0 < r["first_playable_ms"] <= r["e2e_ms"]
        assert r["underruns"] == 0  # the whole utterance arrives at once
    s = point["summary"]
    assert s["offered"] == 2 and s["errors"] == 0 and s["peak_in_flight"] == 1
    assert s["ms_per_frame"]["p50"] > 0
