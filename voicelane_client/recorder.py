"""The client as the load generator uses it: a `VoicelaneClient` whose reader records instead of queueing.

It keeps what the benchmark's metrics need and nothing else: the arrival time, `start_sample` and PCM of every
binary audio frame of a context, and the arrival of its `context.created`, `context.done`, `context.cancelled` or
error. Arrivals are stamped by the client's reader as the websockets library hands each message over, on
`time.perf_counter` (the load generator's clock), and no per-context queue sits between the socket and the record.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field

from websockets.asyncio.client import connect

from voicelane_client.client import VoicelaneClient
from voicelane_wire import FLAG_LAST, unpack_frame

# websockets >= 15 reads proxy settings from the environment; the benchmark talks to loopback directly.
_NO_PROXY = {"proxy": None} if "proxy" in inspect.signature(connect.__init__).parameters else {}


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


class RecordingSession(VoicelaneClient):
    """One WebSocket session; traces are registered (`open_context`) before their `context.create` is sent."""

    def __init__(self, ws, session: dict, clock=time.perf_counter):
        self.traces: dict[str, ContextTrace] = {}
        self.traces_by_stream: dict[int, ContextTrace] = {}
        self.stray = 0  # messages for no known context
        super().__init__(ws, session, clock=clock)

    @classmethod
    async def open(cls, url: str, api_key: str | None = None, timeout: float = 30.0,
                   clock=time.perf_counter) -> RecordingSession:
        # No size limit and patient pings: a loaded server may be slow to answer, and that is what is measured.
        return await cls.connect(url, api_key=api_key, open_timeout=timeout, clock=clock, max_size=None,
                                 compression=None, ping_interval=20, ping_timeout=60, close_timeout=5, **_NO_PROXY)

    @property
    def hello(self) -> dict:
        return self.session

    @property
    def limits(self) -> dict:
        return self.session.get("limits", {})

    @property
    def frames_per_word(self) -> int:
        return int(self.session.get("bench_frames_per_word") or 0)

    def open_context(self, context_id: str) -> ContextTrace:
        trace = ContextTrace(context_id)
        self.traces[context_id] = trace
        return trace

    def active(self) -> int:
        return sum(1 for c in self.traces.values() if not c.finished.is_set())

    def forget(self, context_id: str) -> None:
        trace = self.traces.pop(context_id, None)
        if trace is not None and trace.stream_id is not None:
            self.traces_by_stream.pop(trace.stream_id, None)

    async def close(self) -> None:
        """Ask for `session.close` and close the socket at once: the benchmark does not wait for the server's
        goodbye (VoicelaneClient.close does)."""
        if not self.closed.is_set():
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

    # ------------------------------------------------------------------ the reader's hooks
    def _on_closed(self) -> None:
        reason = (f"reader failed: {self.reader_failure!r}" if self.reader_failure is not None
                  else f"closed {self.close_code}")
        t = self.clock()
        for trace in self.traces.values():
            if not trace.finished.is_set():
                trace.error = trace.error or {"code": "socket_closed", "message": reason}
                trace.finish(t)

    def _on_binary(self, data: bytes, now: float) -> None:
        header, payload = unpack_frame(data)
        trace = self.traces_by_stream.get(header.stream_id)
        if trace is None:
            self.stray += 1
            return
        trace.packets.append((now, header.seq, header.start_sample, len(payload), header.flags))
        trace.pcm += payload
        if payload:
            trace.first_audio.set()
        if header.flags & FLAG_LAST:
            trace.last_flag_at = now

    def _on_json(self, msg: dict, now: float) -> None:
        kind = msg.get("type")
        trace = self.traces.get(msg.get("context_id") or "")
        if trace is None:
            if kind not in ("pong", "session.updated", "warning", "session.draining"):
                self.stray += 1
            return
        if kind == "context.created":
            trace.created_at, trace.created = now, msg
            trace.stream_id = int(msg["stream_id"])
            self.traces_by_stream[trace.stream_id] = trace
        elif kind == "context.done":
            trace.done = msg
            trace.finish(now)
        elif kind == "context.cancelled":
            trace.cancelled = msg
            trace.finish(now)
        elif kind == "error":
            trace.error = trace.error or msg
            if msg.get("code") != "synthesis_failed":  # that one is followed by context.done{reason: error}
                trace.finish(now)


class SessionPool:
    """Persistent sessions reused across requests (a voice agent keeps its socket open); each holds at most
    `per_socket` contexts at a time. Opening a socket happens before dispatch, so it is not in the latencies."""

    def __init__(self, url: str, per_socket: int = 1, api_key: str | None = None, clock=time.perf_counter):
        self.url, self.per_socket, self.api_key, self.clock = url, max(1, per_socket), api_key, clock
        self.sessions: list[RecordingSession] = []
        self.load: dict[int, int] = {}
        self.opened = 0

    async def acquire(self) -> RecordingSession:
        for s in self.sessions:
            if not s.closed.is_set() and self.load[id(s)] < self.per_socket:
                self.load[id(s)] += 1
                return s
        s = await RecordingSession.open(self.url, self.api_key, clock=self.clock)
        self.opened += 1
        self.sessions.append(s)
        self.load[id(s)] = 1
        return s

    def release(self, s: RecordingSession) -> None:
        self.load[id(s)] = max(0, self.load.get(id(s), 1) - 1)
        if s.closed.is_set() and s in self.sessions:
            self.sessions.remove(s)
            self.load.pop(id(s), None)

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sessions), return_exceptions=True)
        self.sessions.clear()
