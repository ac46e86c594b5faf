"""A minimal client of the voicelane WebSocket protocol (docs/protocol.md 1), for the load generator only.

It records what the metrics need and nothing else: the arrival time, `start_sample` and PCM of every binary audio
frame of a context, and the arrival of its `context.created`, `context.done`, `context.cancelled` or error.
Timestamps are taken in the reader task as each message is handed over by the websockets library.
(The project's async client, client_demo/client.py, did not exist when this was written; this file keeps the
benchmark independent of it.)
"""

from __future__ import annotations

import asyncio
import inspect
import json
import struct
import time
from dataclasses import dataclass, field

import websockets
from websockets.asyncio.client import connect

HEADER = struct.Struct(">BBHIII")  # version, kind, flags, stream_id, seq, start_sample
FLAG_FIRST, FLAG_LAST, FLAG_SEGMENT = 1, 2, 4
# websockets >= 15 reads proxy settings from the environment; the benchmark talks to loopback directly.
_NO_PROXY = {"proxy": None} if "proxy" in inspect.signature(connect.__init__).parameters else {}


def parse_frame(data: bytes) -> tuple[int, int, int, int, int, int, bytes]:
    """(version, kind, flags, stream_id, seq, start_sample, payload) of one binary audio frame."""
    if len(data) < HEADER.size:
        raise ValueError(f"binary frame of {len(data)} bytes is shorter than the 16-byte header")
    return (*HEADER.unpack_from(data), data[HEADER.size:])


def build_frame(flags: int, stream_id: int, seq: int, start_sample: int, payload: bytes) -> bytes:
    """The inverse of parse_frame (used by tests and fake servers)."""
    return HEADER.pack(1, 1, flags, stream_id, seq, start_sample) + payload


@dataclass
class ContextTrace:
    context_id: str
    stream_id: int | None = None
    created_at: float | None = None
    created: dict | None = None
    packets: list = field(default_factory=list)  # (arrival, seq, start_sample, payload bytes, flags)
    pcm: bytearray = field(default_factory=bytearray)
    last_flag_at: float | None = None
    ended_at: float | None = None
    done: dict | None = None
    cancelled: dict | None = None
    error: dict | None = None
    first_audio: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def finish(self, t: float) -> None:
        if self.ended_at is None:
            self.ended_at = t
        self.finished.set()


class Session:
    """One WebSocket session; contexts are registered before their `context.create` is sent."""

    def __init__(self, ws, hello: dict, clock=time.perf_counter):
        self.ws = ws
        self.hello = hello
        self.clock = clock
        self.contexts: dict[str, ContextTrace] = {}
        self.by_stream: dict[int, ContextTrace] = {}
        self.closed = False
        self.close_reason: str | None = None
        self.stray = 0  # messages for no known context
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, url: str, api_key: str | None = None, timeout: float = 30.0, clock=time.perf_counter):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        ws = await connect(url, additional_headers=headers, max_size=None, compression=None, open_timeout=timeout,
                           ping_interval=20, ping_timeout=60, close_timeout=5, **_NO_PROXY)
        raw = await asyncio.wait_for(ws.recv(), timeout)
        hello = json.loads(raw)
        if hello.get("type") != "session.created":
            await ws.close()
            raise RuntimeError(f"expected session.created, got {str(raw)[:200]}")
        return cls(ws, hello, clock)

    @property
    def limits(self) -> dict:
        return self.hello.get("limits", {})

    @property
    def frames_per_word(self) -> int:
        return int(self.hello.get("bench_frames_per_word") or 0)

    def open_context(self, context_id: str) -> ContextTrace:
        ctx = ContextTrace(context_id)
        self.contexts[context_id] = ctx
        return ctx

    def active(self) -> int:
        return sum(1 for c in self.contexts.values() if not c.finished.is_set())

    def forget(self, context_id: str) -> None:
        ctx = self.contexts.pop(context_id, None)
        if ctx is not None and ctx.stream_id is not None:
            self.by_stream.pop(ctx.stream_id, None)

    async def send(self, msg: dict) -> None:
        await self.ws.send(json.dumps(msg))

    async def close(self) -> None:
        if not self.closed:
            try:
                await self.send({"type": "session.close"})
            except Exception:
                pass
        try:
            await asyncio.wait_for(self.ws.close(), 5)
        except Exception:
            pass
        self._reader.cancel()
        try:
            await self._reader
        except BaseException:
            pass

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                t = self.clock()
                if isinstance(msg, bytes):
                    self._on_audio(t, msg)
                else:
                    self._on_json(t, json.loads(msg))
            self.close_reason = f"closed {self.ws.close_code}"
        except websockets.ConnectionClosed as e:
            self.close_reason = f"closed {e.code}"
        except Exception as e:  # a protocol violation ends the session
            self.close_reason = f"reader failed: {e!r}"
        finally:
            self.closed = True
            t = self.clock()
            for ctx in self.contexts.values():
                if not ctx.finished.is_set():
                    ctx.error = ctx.error or {"code": "socket_closed", "message": self.close_reason}
                    ctx.finish(t)

    def _on_audio(self, t: float, data: bytes) -> None:
        _version, kind, flags, stream_id, seq, start, payload = parse_frame(data)
        ctx = self.by_stream.get(stream_id)
        if ctx is None or kind != 1:
            self.stray += 1
            return
        ctx.packets.append((t, seq, start, len(payload), flags))
        ctx.pcm += payload
        if payload:
            ctx.first_audio.set()
        if flags & FLAG_LAST:
            ctx.last_flag_at = t

    def _on_json(self, t: float, msg: dict) -> None:
        kind = msg.get("type")
        ctx = self.contexts.get(msg.get("context_id") or "")
        if ctx is None:
            if kind not in ("pong", "session.updated", "warning", "session.draining"):
                self.stray += 1
            return
        if kind == "context.created":
            ctx.created_at, ctx.created = t, msg
            ctx.stream_id = int(msg["stream_id"])
            self.by_stream[ctx.stream_id] = ctx
        elif kind == "context.done":
            ctx.done = msg
            ctx.finish(t)
        elif kind == "context.cancelled":
            ctx.cancelled = msg
            ctx.finish(t)
        elif kind == "error":
            ctx.error = ctx.error or msg
            if msg.get("code") != "synthesis_failed":  # that one is followed by context.done{reason: error}
                ctx.finish(t)


class SessionPool:
    """Persistent sessions reused across requests (a voice agent keeps its socket open); each holds at most
    `per_socket` contexts at a time. Opening a socket happens before dispatch, so it is not in the latencies."""

    def __init__(self, url: str, per_socket: int = 1, api_key: str | None = None, clock=time.perf_counter):
        self.url, self.per_socket, self.api_key, self.clock = url, max(1, per_socket), api_key, clock
        self.sessions: list[Session] = []
        self.load: dict[int, int] = {}
        self.opened = 0

    async def acquire(self) -> Session:
        for s in self.sessions:
            if not s.closed and self.load[id(s)] < self.per_socket:
                self.load[id(s)] += 1
                return s
        s = await Session.open(self.url, self.api_key, clock=self.clock)
        self.opened += 1
        self.sessions.append(s)
        self.load[id(s)] = 1
        return s

    def release(self, s: Session) -> None:
        self.load[id(s)] = max(0, self.load.get(id(s), 1) - 1)
        if s.closed and s in self.sessions:
            self.sessions.remove(s)
            self.load.pop(id(s), None)

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sessions), return_exceptions=True)
        self.sessions.clear()
