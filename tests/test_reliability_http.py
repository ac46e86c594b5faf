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

from engine import FastPath, Readiness
from server.app import create_app
from server.config import ServerConfig
from server.runtime import Runtime
from server.text.pipeline import bench_frames, encode_segments, encode_whole, estimated_frames, split_sentences


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
    """An engine whose loop thread has crashed (what Engine.running and Engine.readiness report then)."""

    info = SimpleNamespace(name="dead", random_weights=True)

    def running(self) -> bool:
        return False

    def readiness(self) -> Readiness:
        off = FastPath(False, "dead")
        return Readiness(model_loaded=True, warmed_up=True, engine_running=False, device="cpu", dtype="float32",
                         cuda_graphs=off, triton_kernels=off, random_weights=True)

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



# ------------------------------------------------------------------------------------------- long input


def test_split_sentences_keeps_every_character_within_the_budget(tiny_checkpoint):
    from engine.text.tokenizer import TextTokenizer

    text = ("First sentence here. Second one, longer than the first?  Yes!\nA line break; then " + "z" * 70 +
            " and CJK 你好。世界！再见。 The end.")
    for budget in (8, 20, 64, 1000):
        pieces = split_sentences(text, budget)
        assert "".join(pieces) == text
        assert all(estimated_frames(p) <= budget for p in pieces), budget
    assert split_sentences(text, 1000) == [text]
    assert split_sentences("One. Two. Three.", 10) == ["One. Two. ", "Three."]
    tok = TextTokenizer.from_dir(tiny_checkpoint)
    short = "Hello world, how are you today?"
    assert encode_segments(tok, short, "llm", 64) == [encode_whole(tok, short, "llm")]
    ids = [i for seg, _ in encode_segments(tok, text, "none", 20) for i in seg]
    assert len(ids) >= len(encode_whole(tok, text, "none")[0]) - 2  # nothing lost at the cuts


def test_bench_length_mode_counts_segment_frames_exactly():
    """In the benchmark length mode a segment makes N frames per word: a sentence that fits one segment stays
    whole (the guess of one frame per character would cut it and change its codes against the WebSocket door),
    and a longer text is cut into pieces of at most the budget."""
    frames = bench_frames(2)
    sentence = "The quick brown fox jumps over the lazy dog, again."  # 10 words, 20 frames, 51 characters
    assert split_sentences(sentence, 32, frames) == [sentence]
    assert len(split_sentences(sentence, 32)) == 2
    words = " ".join(f"w{i}" for i in range(40))
    pieces = split_sentences(words, 32, frames)
    assert "".join(pieces) == words and len(pieces) == 3 and all(frames(p) <= 32 for p in pieces)


def test_long_input_is_spoken_whole(server):
    """Item 6: a long request was cut at max_frames (64 frames here: 32 words) with status 200. Now it is spoken
    in segments, each with its own frame budget: 50 words at 2 frames per word make 100 frames."""
    text = " ".join(f"word{i}." if i % 9 == 8 else f"word{i}" for i in range(50))
    status, headers, data = post(server, {"input": text, "response_format": "pcm", "stream": False, "seed": 3})
    assert status == 200, data
    assert headers["x-finish-reason"] == "completed" and headers["x-frames"] == "100", headers
