"""Every error code of docs/protocol.md 1.5 provoked on one socket, which survives them all; the WebSocket-layer
closes (1007 invalid UTF-8, 1009 message too big)."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine
from live_server import Raw, collect, live_server, run, speak_ctx


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


@pytest.fixture(scope="module")
def strict(tiny_checkpoint):
    return live_server(tiny_checkpoint, "strict")


STRICT_HEADERS = {"Authorization": "Bearer key-one"}


def check(err: dict, code: str, *, context_id=None, event_id=None, param=None, retryable=False):
    assert err["type"] == "error" and err["code"] == code, err
    assert err["fatal"] is False and err["retryable"] is retryable, err
    assert isinstance(err["message"], str) and err["message"]
    if context_id is not None:
        assert err.get("context_id") == context_id, err
    if event_id is not None:
        assert err.get("event_id") == event_id, err
    if param is not None:
        assert err.get("param") == param, err


def test_every_error_code_and_the_socket_survives(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        seen = set()

        async def expect(msg, code, **kw):
            await raw.send(msg)
            err = await raw.error(code)
            check(err, code, **kw)
            seen.add(code)
            return err

        # invalid_json: bad JSON, JSON that is not an object, a binary frame
        await expect("{not json", "invalid_json")
        await expect("[1, 2]", "invalid_json")
        await expect('{"type": "ping", "x": NaN}', "invalid_json")
        await expect("[" * 5000 + "]" * 5000, "invalid_json")
        await expect(b"\x01\x02binary", "invalid_json")
        # unknown_type
        await expect({"type": "speak", "event_id": "u"}, "unknown_type", event_id="u", param="type")
        # invalid_field
        await expect({"text": "no type"}, "invalid_field", param="type")
        await expect({"type": "text", "context_id": 5, "text": "x"}, "invalid_field", param="context_id")
        await expect({"type": "text", "context_id": "x" * 129, "text": "x"}, "invalid_field", param="context_id")
        await expect({"type": "context.create", "context_id": "t", "sampling": {"temperature": -1}},
                     "invalid_field", context_id="t", param="sampling.temperature")
        await expect({"type": "context.create", "context_id": "t", "sampling": {"top_k": "many"}},
                     "invalid_field", param="sampling.top_k")
        await expect({"type": "context.create", "context_id": "t", "max_frames": 100000}, "invalid_field",
                     param="max_frames")
        await expect({"type": "context.create", "context_id": "t", "text_layout": "sideways"}, "invalid_field",
                     param="text_layout")
        await expect({"type": "text", "context_id": "t2", "text": 42}, "invalid_field", param="text")
        await expect({"type": "flush", "context_id": "t2", "flush_id": 1.5}, "invalid_field", param="flush_id")
        await expect({"type": "cancel_all", "played": {"a": "x"}}, "invalid_field", param="played")
        # unknown_context: flush, close, cancel and playback never create a context
        for t in ("flush", "context.close", "context.cancel"):
            await expect({"type": t, "context_id": "ghost", "event_id": t}, "unknown_context", context_id="ghost",
                         event_id=t)
        await expect({"type": "playback", "context_id": "ghost", "played_ms": 1, "state": "playing"},
                     "unknown_context")
        # duplicate_context / context_closed
        created = await speak_ctx(raw, "d", [], close=False)
        await expect({"type": "context.create", "context_id": "d"}, "duplicate_context", context_id="d")
        await raw.send({"type": "text", "context_id": "d", "text": "hello"})
        await raw.send({"type": "context.close", "context_id": "d"})
        for msg in ({"type": "text", "context_id": "d", "text": "more"}, {"type": "flush", "context_id": "d"},
                    {"type": "context.close", "context_id": "d"}):
            await expect(msg, "context_closed", context_id="d")
        got = await collect(raw, "d", created["stream_id"])
        assert got["end"]["reason"] == "completed"
        for msg in ({"type": "context.create", "context_id": "d"}, {"type": "text", "context_id": "d", "text": "x"},
                    {"type": "flush", "context_id": "d"}, {"type": "context.close", "context_id": "d"}):
            await expect(msg, "context_closed", context_id="d")
        # text_too_long (per message)
        await expect({"type": "text", "context_id": "long", "text": "a" * 4097}, "text_too_long",
                     context_id="long")
        # unsupported_format
        for fmt in ("aac", {"encoding": "opus", "sample_rate": 24000}, {"encoding": "pcm_s16le", "sample_rate": 44100},
                    {"encoding": "pcm_mulaw", "sample_rate": 16000}, {"encoding": "opus", "bitrate": 1000000},
                    {"encoding": "flac"}):
            await expect({"type": "context.create", "context_id": "fmt", "output_format": fmt}, "unsupported_format",
                         context_id="fmt")
        # unknown_voice / unknown_language
        await expect({"type": "context.create", "context_id": "v", "voice": "alloy"}, "unknown_voice",
                     param="voice")
        await expect({"type": "context.create", "context_id": "v", "language": "xx"}, "unknown_language",
                     param="language")
        # context_limit: 8 open contexts per socket
        for i in range(8):
            await speak_ctx(raw, f"lim{i}", [], close=False)
        await expect({"type": "context.create", "context_id": "lim8"}, "context_limit", context_id="lim8")
        await expect({"type": "text", "context_id": "lim8", "text": "implicit"}, "context_limit")
        await raw.send({"type": "cancel_all"})
        for _ in range(8):
            await raw.expect("context.cancelled")
        # the refused id never existed: it can be created now
        created = await speak_ctx(raw, "lim8", ["ok"])
        assert (await collect(raw, "lim8", created["stream_id"]))["end"]["reason"] == "completed"
        # synthesis_failed (test hook: the model step fails) -> context.done{reason: error}
        for kind in ("exception", "nan"):
            cid = f"fail-{kind}"
            created = await speak_ctx(raw, cid, ["some ", "words ", "here"],
                                      create={"test_fault": {"kind": kind, "at_frame": 2}})
            got = await collect(raw, cid, created["stream_id"])
            errors = [m for m in got["json"] if m["type"] == "error"]
            assert len(errors) == 1
            check(errors[0], "synthesis_failed", context_id=cid)
            assert got["end"]["type"] == "context.done" and got["end"]["reason"] == "error"
            assert got["json"].index(errors[0]) < got["json"].index(got["end"])
            seen.add("synthesis_failed")
        # internal (test hook: a server fault while streaming) -> that context ends, the socket stays
        created = await speak_ctx(raw, "boom", ["a ", "b"], create={"test_fault": {"kind": "internal"}})
        got = await collect(raw, "boom", created["stream_id"])
        errors = [m for m in got["json"] if m["type"] == "error"]
        check(errors[0], "internal", context_id="boom")
        assert got["end"]["reason"] == "error"
        seen.add("internal")
        # after all that, the socket still works
        created = await speak_ctx(raw, "fine", ["all ", "good"])
        got = await collect(raw, "fine", created["stream_id"])
        assert got["end"]["reason"] == "completed" and got["packets"]
        assert seen >= {"invalid_json", "unknown_type", "invalid_field", "unknown_context", "context_closed",
                        "duplicate_context", "context_limit", "text_too_long", "unsupported_format", "unknown_voice",
                        "unknown_language", "synthesis_failed", "internal"}
        await raw.close()

    run(go())


def test_overloaded_and_per_context_text_limit(strict):
    """The strict server has 3 engine slots: the 4th context is refused `overloaded` (retryable) and never
    existed. Its per-context text limit is 400 characters."""

    async def go():
        raw = await Raw.open(strict.ws_url, headers=STRICT_HEADERS)
        for i in range(3):
            await speak_ctx(raw, f"o{i}", [], close=False)
        await raw.send({"type": "context.create", "context_id": "o3", "event_id": "ov"})
        err = await raw.error("overloaded")
        check(err, "overloaded", context_id="o3", event_id="ov", retryable=True)
        await raw.send({"type": "context.cancel", "context_id": "o0"})
        await raw.expect("context.cancelled", context_id="o0")
        await speak_ctx(raw, "o3", [], close=False)  # the refused id is free; a slot is free again
        for _ in range(2):
            await raw.send({"type": "text", "context_id": "o1", "text": "x" * 190})
        await raw.send({"type": "text", "context_id": "o1", "text": "y" * 30})
        check(await raw.error("text_too_long"), "text_too_long", context_id="o1")
        await raw.send({"type": "text", "context_id": "o1", "text": "z" * 201})
        check(await raw.error("text_too_long"), "text_too_long", context_id="o1")
        await raw.send({"type": "cancel_all"})
        for _ in range(3):
            await raw.expect("context.cancelled")
        await raw.close()

    run(go())


def test_message_too_big_closes_1009(strict):
    async def go():
        raw = await Raw.open(strict.ws_url, headers=STRICT_HEADERS)
        await raw.send({"type": "text", "context_id": "big", "text": "a" * 5000})  # over 4096 bytes
        code, _ = await raw.closed(10)
        assert code == 1009

    run(go())


def test_invalid_utf8_closes_1007(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        await raw.ws.send(b'{"type": "ping", "id": "\xff\xfe"}', text=True)
        code, _ = await raw.closed(10)
        assert code == 1007

    run(go())


def test_lone_surrogates_are_invalid_field(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        await raw.send('{"type": "text", "context_id": "s", "text": "bad \\ud800 text"}')
        check(await raw.error("invalid_field"), "invalid_field", param="text")
        await raw.send({"type": "ping", "id": 1})
        await raw.expect("pong")
        await asyncio.sleep(0)
        await raw.close()

    run(go())


# ------------------------------------------------------------------------------------------- one text for both doors


def test_instructions_on_a_model_without_them_are_refused_alike_by_both_doors(tiny_checkpoint):
    """Both doors build a context's instruction ids with one function (server.stream.instruction_ids): one error,
    one text, the same param, whichever door the request came in by."""
    import json

    from starlette.testclient import TestClient

    from engine import TextTokenizer
    from server.app import create_app
    from server.config import ServerConfig
    from server.runtime import Runtime
    from server.stream import NO_INSTRUCTIONS

    rt = Runtime(ServerConfig(), FakeEngine(supports_instructions=False), TextTokenizer.from_dir(tiny_checkpoint))
    with TestClient(create_app(rt)) as client:
        r = client.post("/v1/audio/speech", json={"input": "Hello there.", "instructions": "Speak warmly.",
                                                  "response_format": "pcm"})
        assert r.status_code == 400, r.text
        http = r.json()["error"]
        with client.websocket_connect("/v1/tts/ws") as ws:
            assert json.loads(ws.receive_text())["type"] == "session.created"
            ws.send_text(json.dumps({"type": "context.create", "context_id": "c", "instructions": "Speak warmly."}))
            wire = json.loads(ws.receive_text())
    check(wire, "invalid_field", context_id="c", param="instructions")
    assert http["code"] == "invalid_field" and http["param"] == "instructions"
    assert wire["message"] == http["message"] == NO_INSTRUCTIONS
