"""Hostile input on one WebSocket while another context of the same socket speaks: every echoed string is checked
where it enters (a lone surrogate is `invalid_field`, never echoed), and one message that cannot be written drops
that message and its context only (issue 10, item 1)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine
from live_server import Raw, collect, live_server, run, speak_ctx

from server.config import ServerConfig
from server.metrics import ServerMetrics
from server.protocol import ProtocolError, check_unicode, lone_surrogate_path, parse_played_map
from server.runtime import Runtime
from server.ws.outbox import OutItem
from server.ws.session import WsSession

BAD = "bad\ud800id"  # what the JSON escape "\ud800" decodes to


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


def test_lone_surrogate_paths():
    assert lone_surrogate_path({"a": "fine", "b": [1, {"c": "ok"}]}) is None
    assert lone_surrogate_path({"context_id": BAD}) == "context_id"
    assert lone_surrogate_path({"played": {BAD: 1}}) == "played"
    assert lone_surrogate_path({"sampling": {"x": [0, BAD]}}) == "sampling.x[1]"
    assert lone_surrogate_path({BAD: 1}) == "(message)"
    with pytest.raises(ProtocolError) as e:
        check_unicode({"model": BAD})
    assert e.value.code == "invalid_field" and e.value.param == "model"
    with pytest.raises(ProtocolError) as e:
        parse_played_map({BAD: 5})
    assert e.value.param == "played" and "\ud800" not in e.value.message
    assert e.value.message.encode("utf-8")


SURROGATE_CASES = [
    # (raw JSON text, the param the error must name)
    ('{"type": "context.create", "context_id": "bad\\ud800id"}', "context_id"),
    ('{"type": "text", "context_id": "bad\\ud800id", "text": "hello"}', "context_id"),
    ('{"type": "context.cancel", "context_id": "bad\\ud800id"}', "context_id"),
    ('{"type": "ping", "event_id": "bad\\ud800id"}', "event_id"),
    ('{"type": "ping", "id": "bad\\ud800id"}', "id"),
    ('{"type": "ping", "id": {"nested": ["x", "bad\\ud800"]}}', "id.nested[1]"),
    ('{"type": "cancel_all", "played": {"bad\\ud800id": 10}}', "played"),
    ('{"type": "context.create", "context_id": "c", "sampling": {"bad\\ud800": 1}}', "sampling"),
    ('{"type": "unheard\\ud800", "event_id": "e"}', "type"),
]


def test_lone_surrogates_are_refused_and_the_socket_keeps_speaking(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "keeper", [f"w{i} " for i in range(6)], close=False)
        for text, param in SURROGATE_CASES:
            await raw.send(text)
            msgs = await raw.recv_until(lambda m: m.get("type") == "error")
            err = msgs[-1]
            assert err["code"] == "invalid_field" and err["param"] == param, (text, err)
            assert "context_id" not in err or err["context_id"] == "c", err
            assert json.dumps(err, ensure_ascii=False).encode("utf-8")  # everything echoed is valid Unicode
        # the ping still answers, and the context opened before all that completes whole
        await raw.send({"type": "ping", "id": 7, "event_id": "p"})
        pong = await raw.expect("pong")
        assert pong["id"] == 7 and pong["event_id"] == "p"
        await raw.send({"type": "context.close", "context_id": "keeper"})
        got = await collect(raw, "keeper", created["stream_id"])
        assert got["end"]["type"] == "context.done" and got["end"]["reason"] == "completed", got["end"]
        assert got["packets"] and got["packets"][-1]["flags"] & 0x02  # the last packet carries the `last` flag
        await raw.close()

    run(go())


def test_max_frames_one_needs_no_min_frames(server):
    """Item 2: the default min_frames (2) refused an explicit, valid max_frames of 1."""

    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "one", ["hello ", "there"], create={"max_frames": 1})
        got = await collect(raw, "one", created["stream_id"])
        assert got["end"]["reason"] == "max_frames" and got["end"]["frames"] == 1, got["end"]
        await raw.send({"type": "context.create", "context_id": "two", "max_frames": 1, "min_frames": 2})
        err = await raw.error("invalid_field")  # an explicit contradiction is still refused
        assert err["context_id"] == "two" and err["param"] == "min_frames", err
        await raw.close()

    run(go())


# -------------------------------------------------------------------------------- the emit path never dies


class FakeSocket:
    """Writes like a WebSocket transport: text must encode as UTF-8."""

    def __init__(self):
        self.sent: list[str | bytes] = []
        self.closed: tuple[int, str] | None = None

    async def send_text(self, data: str) -> None:
        data.encode("utf-8")
        self.sent.append(data)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


class FakeContext:
    def __init__(self, cid: str):
        self.id, self.ended, self.failures = cid, False, []

    def fail(self, message: str) -> None:
        self.failures.append(message)
        self.ended = True


def test_one_unwritable_message_drops_only_that_context():
    async def go():
        runtime = SimpleNamespace(limits=ServerConfig().limits, defaults=None, metrics=ServerMetrics())
        ws = FakeSocket()
        session = WsSession(runtime, ws)
        broken, other = FakeContext("broken"), FakeContext("other")
        session.out.put(OutItem('{"n":1}', owner=other))
        session.out.put(OutItem('{"n":"\ud800"}', owner=broken))  # cannot be written as UTF-8

        def render_fails() -> str:
            raise KeyError("a render that fails")

        session.out.put(OutItem(render=render_fails, owner=other))
        session.out.put(OutItem(b"\x00audio", owner=other))
        session.out.put(OutItem('{"orphan":"\udfff"}'))  # no context: only an `internal` error replaces it
        emit = asyncio.create_task(session.emit())
        await asyncio.sleep(0.2)
        session.out.put(OutItem(close=(1000, "bye")))
        await asyncio.wait_for(emit, 5)
        return ws, broken, other
    ws, broken, other = asyncio.run(go())
    assert ws.sent[0] == '{"n":1}' and ws.sent[1] == b"\x00audio"
    error = json.loads(ws.sent[2])
    assert error["type"] == "error" and error["code"] == "internal" and "context_id" not in error
    assert len(ws.sent) == 3
    assert broken.failures and other.failures  # each context whose message failed was ended (by its fail())
    assert ws.closed == (1000, "bye")  # the emit task lived on to the close


class FloodingSocket(FakeSocket):
    """A client that never pauses: a ping is always waiting to be received."""

    async def receive(self) -> dict:
        return {"type": "websocket.receive", "text": '{"type":"ping"}'}


def test_a_client_that_never_pauses_still_meets_the_sessions_deadlines():
    """The receive task checks the session's deadlines (idle timeouts, draining, a dead engine) between messages
    too, not only while it waits for one: a flood of messages must not keep a session open on a dead engine."""
    async def go():
        rt = Runtime(ServerConfig(), FakeEngine(running=False), SimpleNamespace())
        ws = FloodingSocket()
        await asyncio.wait_for(WsSession(rt, ws).run(), 10)
        return ws
    ws = asyncio.run(go())
    assert ws.closed is not None and ws.closed[0] == 1011, ws.closed
    errors = [json.loads(m) for m in ws.sent if isinstance(m, str) and '"error"' in m]
    assert errors and errors[-1]["code"] == "internal" and "engine stopped" in errors[-1]["message"]
