"""The HTTP front door under careless and hostile use (issue 10): Opus and SSE without streaming, lone surrogates
in every field and key, long input spoken whole, a dead engine failing liveness."""

from __future__ import annotations

import json
from types import SimpleNamespace

import opuslib
import pytest
from live_server import live_server
from starlette.testclient import TestClient
from test_server_http import ogg_packets, post

from server.app import create_app
from server.config import ServerConfig
from server.runtime import Runtime


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


def test_opus_whole_and_sse_whole(server):
    """Item 3: `response_format: opus` with `stream: false` (and with SSE) used to answer 500."""
    body = {"input": "Hello world, how are you today?", "response_format": "opus", "seed": 5}
    status, headers, whole = post(server, {**body, "stream": False})
    assert status == 200, whole
    assert headers["content-type"] == "audio/ogg" and int(headers["content-length"]) == len(whole)
    status, _, streamed = post(server, body)
    assert status == 200
    packets = ogg_packets(whole)[0]
    assert packets[0].startswith(b"OpusHead") and packets[1].startswith(b"OpusTags") and len(packets) > 2
    assert packets[2:] == ogg_packets(streamed)[0][2:]  # same seed, same audio packets (serials may differ)
    decoder = opuslib.Decoder(48000, 1)
    assert all(decoder.decode(p, 960) for p in packets[2:])
    status, headers, sse = post(server, {**body, "stream": False, "stream_format": "sse"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), sse
    events = [json.loads(line[6:]) for line in sse.decode().splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "speech.audio.done"


@pytest.mark.parametrize("raw, param", [
    ('{"input": "hi", "model": "tts-\\ud800"}', "model"),
    ('{"input": "hi", "sampling": {"temperature\\ud800": 1}}', "sampling"),
    ('{"input": "hi", "sampling": {"subtalker": {"x": "\\udfff"}}}', "sampling.subtalker.x"),
    ('{"input": "hi", "voice": {"\\ud800": 1}}', "voice"),
])
def test_lone_surrogates_anywhere_are_invalid_field(server, raw, param):
    """Item 5: `model` and `sampling` keys were accepted silently."""
    status, _, data = post(server, raw.encode())
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["code"] == "invalid_field" and err["param"] == param, err


# ------------------------------------------------------------------------------------------- liveness


class DeadEngine:
    """An engine whose loop thread has crashed (what Engine.readiness reports then)."""

    info = SimpleNamespace(name="dead", random_weights=True)

    def readiness(self) -> dict:
        return {"model_loaded": True, "warmed_up": True, "engine_running": False}

    def stop(self) -> None:
        pass


def test_dead_engine_fails_liveness():
    """Item 11: /health stayed 200 for ever after the engine thread died, so no liveness probe restarted it."""
    rt = Runtime(ServerConfig())
    client = TestClient(create_app(rt))
    loading = client.get("/health")
    assert loading.status_code == 200 and loading.json()["model_loaded"] is False  # loading is alive
    rt.engine = DeadEngine()
    dead = client.get("/health")
    assert dead.status_code == 503 and dead.json()["engine_running"] is False, dead.text
    assert client.get("/ready").status_code == 503

