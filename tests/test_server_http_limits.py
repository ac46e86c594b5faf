"""HTTP limits: the per-client rate limit (429 rate_limited) and the bound on audio a slow HTTP reader leaves
unsent (the server closes instead of buffering)."""

from __future__ import annotations

import json

import pytest
from live_server import http_get, start_server

from server.ratelimit import RateLimiter

KEY = "key-one"


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_token_bucket_per_client():
    clock = FakeClock()
    limiter = RateLimiter(rps=2.0, burst=3, clock=clock)
    a, b = limiter.client_id("secret", None), limiter.client_id(None, "10.0.0.9")
    assert "secret" not in a
    assert [limiter.acquire(a) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    wait = limiter.acquire(a)
    assert wait == pytest.approx(0.5)  # the next token comes at 2 per second
    assert limiter.acquire(b) == 0.0  # another client has its own bucket
    clock.t += 0.5
    assert limiter.acquire(a) == 0.0
    assert RateLimiter(0, 1).acquire(a) == 0.0 and not RateLimiter(0, 1).enabled
    assert RateLimiter.retry_after(0.2) == "1" and RateLimiter.retry_after(2.1) == "3"


def _post(port: int, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/audio/speech", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def test_rate_limit_answers_429_with_retry_after(tiny_checkpoint):
    server = start_server(tiny_checkpoint, ["--rate-limit-rps", "0.2", "--rate-limit-burst", "2",
                                            "--bench-frames-per-word", "1"])
    try:
        body = {"model": "x", "input": "Hi there.", "voice": "ryan", "response_format": "pcm", "stream": False}
        assert _post(server.port, body)[0] == 200
        assert _post(server.port, body)[0] == 200
        status, headers, payload = _post(server.port, body)
        assert status == 429, payload
        err = json.loads(payload)["error"]
        assert err["code"] == "rate_limited" and err["type"] == "rate_limit_error"
        assert int(headers["retry-after"]) >= 1
        _, _, metrics = http_get(server.http_url + "/metrics")
        assert any("rate_limited" in line and line.startswith("voicelane_") for line in metrics.decode().splitlines())
    finally:
        server.stop()


def test_slow_http_reader_is_cut_off():
    """A client that stops reading a streaming response: once more than max_unsent_audio_s of audio waits unsent,
    the server ends the response and cancels the engine context instead of buffering without bound."""
    import asyncio
    from types import SimpleNamespace

    import numpy as np

    from engine import AudioChunk
    from engine.model.sampling_params import SamplingParams
    from server.audio import AudioStream, open_audio_file
    from server.config import Limits, ServerConfig
    from server.http.openai_api import SpeechRequest, SpeechStream
    from server.runtime import Runtime
    from server.stream import ContextStream

    class SlowClientContext:  # the engine side: audio keeps coming, the client's socket never drains
        ended = False
        cancelled = False
        backlog_samples = 0

        async def events(self):
            for i in range(1000):
                self.backlog_samples += 1920 * 4  # what the engine queued meanwhile
                yield AudioChunk(np.full(1920, 0.1, np.float32), i * 1920, 0, i, np.zeros((1, 16), np.int64))

        def cancel(self):
            self.cancelled = True

        def mark_audible(self, segment, trimmed_s=0.0):
            pass

    async def never_disconnects():
        await asyncio.sleep(3600)

    sent = []

    async def stalled_send(message):
        sent.append(message["type"])
        if message["type"] == "http.response.body" and len(sent) > 2:
            await asyncio.sleep(3600)  # the transport's buffer is full: send waits for the client

    async def main():
        rt = Runtime(ServerConfig(limits=Limits(max_unsent_audio_s=0.5)))
        req = SpeechRequest("hi", SimpleNamespace(sampling=SamplingParams(seed=1)), "pcm", True, "audio")
        ectx = SlowClientContext()
        file = open_audio_file("pcm")
        context = ContextStream(ectx, AudioStream(file.output, segment_flush=False), None, trace_id="trace-slow")
        stream = SpeechStream(rt, req, context, file, 1, 0.0)
        await asyncio.wait_for(stream({"type": "http"}, never_disconnects, stalled_send), timeout=30)
        return stream, ectx, rt

    stream, ectx, rt = asyncio.run(main())
    assert stream.reason == "slow_reader" and ectx.cancelled
    assert ectx.backlog_samples > 0.5 * 24000
    assert rt.metrics.slow_readers.get() == 1
