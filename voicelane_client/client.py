"""The async Python client of the voicelane WebSocket protocol (docs/protocol.md 1).

    import asyncio
    from voicelane_client import AudioPacket, ContextDone, VoicelaneClient

    async def main():
        async with await VoicelaneClient.connect("ws://127.0.0.1:8000/v1/tts/ws", api_key=None) as client:
            ctx = await client.create_context(voice="ryan", output_format="opus_48000_32")
            await ctx.speak(["Hello ", "there, ", "how ", "are ", "you?"])  # streams text, then closes
            async for event in ctx.events():
                if isinstance(event, AudioPacket):
                    play(event.payload)  # one raw Opus packet (or PCM bytes)
                elif isinstance(event, ContextDone):
                    print("done", event.reason, event.ttfa_ms)

    asyncio.run(main())

One reader task per connection routes every server message to its context (binary frames by `stream_id`, JSON by
`context_id`); each `Context` has its own ordered event stream ending with `ContextDone` or `ContextCancelled`.
Session-level messages (errors without a context, `session.draining`, warnings) go to `client.session_events()`.
Errors about a context never raise inside `events()`: they arrive as `ErrorEvent`s (a failed `create_context`
raises `VoicelaneError`). The tests, framework adapters and the load generator (through voicelane_client.recorder,
which records instead of queueing) build on this module.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from voicelane_wire import unpack_frame

SUBPROTOCOL = "voicelane.v1"


class VoicelaneError(Exception):
    """An `error` message (or a refused connection). Fields as in docs/protocol.md 1.2."""

    def __init__(self, msg: dict):
        super().__init__(f"{msg.get('code')}: {msg.get('message')}")
        self.raw = msg
        self.code: str = msg.get("code", "")
        self.message: str = msg.get("message", "")
        self.param: str | None = msg.get("param")
        self.context_id: str | None = msg.get("context_id")
        self.event_id: str | None = msg.get("event_id")
        self.fatal: bool = bool(msg.get("fatal"))
        self.retryable: bool = bool(msg.get("retryable"))


# ------------------------------------------------------------------------------------------------------- events


@dataclass
class AudioPacket:
    context_id: str
    seq: int
    start_sample: int  # stream clock: 48000 for Opus, else the PCM sample rate
    payload: bytes  # one raw Opus packet or whole PCM samples (empty on a bare `last` packet)
    first: bool
    last: bool
    segment_start: bool
    stream_id: int | None = None
    received_at: float = 0.0  # time.monotonic()
    start_ms: float | None = None  # JSON transport: as sent (start_sample is derived from it)


@dataclass
class Flushed:
    context_id: str
    flush_id: Any
    audio_end_ms: float
    raw: dict = field(default_factory=dict)


@dataclass
class ContextDone:
    context_id: str
    reason: str  # completed | max_frames | timeout | error
    audio_ms: float
    ttfa_ms: float | None
    raw: dict = field(default_factory=dict)


@dataclass
class ContextCancelled:
    context_id: str
    generated_ms: float
    sent_ms: float
    played_ms: float
    raw: dict = field(default_factory=dict)


@dataclass
class ErrorEvent:
    error: VoicelaneError

    @property
    def code(self) -> str:
        return self.error.code


@dataclass
class WarningEvent:
    code: str
    message: str
    raw: dict = field(default_factory=dict)


@dataclass
class SessionClosed:
    """The socket closed (last event of every stream still open)."""

    code: int | None
    reason: str


Event = AudioPacket | Flushed | ContextDone | ContextCancelled | ErrorEvent | WarningEvent | SessionClosed


# ------------------------------------------------------------------------------------------------------ context


@dataclass
class Utterance:
    """Everything one context produced (see Context.collect)."""

    packets: list[AudioPacket] = field(default_factory=list)
    flushed: list[Flushed] = field(default_factory=list)
    errors: list[VoicelaneError] = field(default_factory=list)
    warnings: list[WarningEvent] = field(default_factory=list)
    done: ContextDone | None = None
    cancelled: ContextCancelled | None = None
    closed: SessionClosed | None = None
    first_audio_at: float | None = None

    @property
    def payload(self) -> bytes:
        return b"".join(p.payload for p in self.packets)


class Context:
    """One stream of speech on a connection. Make it with `client.create_context()` (waits for
    `context.created`) or `client.context()` (created by its first text with the session defaults)."""

    def __init__(self, client: VoicelaneClient, context_id: str):
        self.client, self.id = client, context_id
        self.created: dict | None = None
        self.stream_id: int | None = None
        self.first_text_at: float | None = None
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._created_waiter: asyncio.Future | None = None
        self.ended = False

    # properties from context.created
    @property
    def seed(self) -> int | None:
        return (self.created or {}).get("seed")

    @property
    def trace_id(self) -> str | None:
        return (self.created or {}).get("trace_id")

    @property
    def output_format(self) -> dict:
        return (self.created or {}).get("output_format") or (self.client.session or {}).get("defaults", {}).get(
            "output_format", {})

    @property
    def pre_skip(self) -> int:
        return ((self.created or {}).get("opus") or {}).get("pre_skip", 0)

    # sending
    async def send_text(self, text: str, *, flush: bool = False, flush_id: Any = None) -> None:
        if self.first_text_at is None and text:
            self.first_text_at = time.monotonic()
        msg: dict[str, Any] = {"type": "text", "context_id": self.id, "text": text}
        if flush:
            msg["flush"] = True
        if flush_id is not None:
            msg["flush_id"] = flush_id
        await self.client.send(msg)

    async def flush(self, flush_id: Any = None) -> None:
        msg: dict[str, Any] = {"type": "flush", "context_id": self.id}
        if flush_id is not None:
            msg["flush_id"] = flush_id
        await self.client.send(msg)

    async def close(self) -> None:
        """No more text: the context finishes speaking and ends with `context.done`."""
        await self.client.send({"type": "context.close", "context_id": self.id})

    async def cancel(self, played_ms: float | None = None) -> None:
        """Barge-in: the server stops at once and answers `context.cancelled` (read it from events())."""
        msg: dict[str, Any] = {"type": "context.cancel", "context_id": self.id}
        if played_ms is not None:
            msg["played_ms"] = played_ms
        await self.client.send(msg)

    async def playback(self, played_ms: float, state: str = "playing", buffered_ms: float | None = None) -> None:
        msg: dict[str, Any] = {"type": "playback", "context_id": self.id, "played_ms": played_ms, "state": state}
        if buffered_ms is not None:
            msg["buffered_ms"] = buffered_ms
        await self.client.send(msg)

    async def speak(self, text: str | Iterable[str] | AsyncIterable[str], *, close: bool = True,
                    delay_s: float = 0.0) -> None:
        """Send text as it comes (a string, or an iterable / async iterable of pieces, e.g. LLM deltas), one
        `text` message per piece, optionally `delay_s` apart; then `context.close` (or nothing, close=False)."""
        if isinstance(text, str):
            text = [text]
        if isinstance(text, AsyncIterable):
            async for piece in text:
                await self.send_text(piece)
                if delay_s:
                    await asyncio.sleep(delay_s)
        else:
            for piece in text:
                await self.send_text(piece)
                if delay_s:
                    await asyncio.sleep(delay_s)
        if close:
            await self.close()

    # receiving
    def _push(self, event: Event) -> None:
        self._queue.put_nowait(event)

    async def next_event(self, timeout: float | None = None) -> Event:
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def events(self, timeout: float | None = None) -> AsyncIterator[Event]:
        """This context's events in order, up to and including its ContextDone / ContextCancelled (or
        SessionClosed). `timeout`: seconds to wait for each event (None: no limit)."""
        while True:
            ev = await asyncio.wait_for(self._queue.get(), timeout)
            yield ev
            if isinstance(ev, ContextDone | ContextCancelled | SessionClosed):
                self.ended = True
                return

    async def collect(self, timeout: float | None = 60.0) -> Utterance:
        """Read events until the context ends; everything in one Utterance."""
        u = Utterance()
        async for ev in self.events(timeout):
            if isinstance(ev, AudioPacket):
                if u.first_audio_at is None and ev.payload:
                    u.first_audio_at = ev.received_at
                u.packets.append(ev)
            elif isinstance(ev, Flushed):
                u.flushed.append(ev)
            elif isinstance(ev, ErrorEvent):
                u.errors.append(ev.error)
            elif isinstance(ev, WarningEvent):
                u.warnings.append(ev)
            elif isinstance(ev, ContextDone):
                u.done = ev
            elif isinstance(ev, ContextCancelled):
                u.cancelled = ev
            elif isinstance(ev, SessionClosed):
                u.closed = ev
        return u


# ------------------------------------------------------------------------------------------------------- client


class VoicelaneClient:
    def __init__(self, ws: ClientConnection, session: dict, clock=time.monotonic):
        self.ws = ws
        self.session = session
        self.clock = clock  # what each message's arrival is stamped with (AudioPacket.received_at)
        self.reader_failure: Exception | None = None
        self.contexts: dict[str, Context] = {}
        self._by_stream: dict[int, Context] = {}
        self._session_queue: asyncio.Queue[Event | dict] = asyncio.Queue()
        self._waiters: dict[str, asyncio.Future] = {}  # event_id -> future of the reply
        self._ids = itertools.count(1)
        self.close_code: int | None = None
        self.close_reason: str = ""
        self.closed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    # ------------------------------------------------------------------ connecting
    @classmethod
    async def connect(cls, url: str = "ws://127.0.0.1:8000/v1/tts/ws", *, api_key: str | None = None,
                      auth: str = "header", origin: str | None = None, open_timeout: float = 10.0,
                      clock=time.monotonic, **ws_kwargs: Any) -> VoicelaneClient:
        """Open a session. `auth`: how the key travels: "header" (Authorization: Bearer), "query" (?token=) or
        "subprotocol" (bearer.<key>, as browsers do). Raises VoicelaneError when the server refuses the session
        (its error, e.g. unauthorized, too_many_sessions) and ConnectionClosed-family errors for network trouble."""
        headers = dict(ws_kwargs.pop("additional_headers", {}) or {})
        subprotocols = [SUBPROTOCOL]
        if api_key is not None:
            if auth == "header":
                headers["Authorization"] = f"Bearer {api_key}"
            elif auth == "query":
                url += ("&" if "?" in url else "?") + "token=" + api_key
            elif auth == "subprotocol":
                subprotocols.append(f"bearer.{api_key}")
            else:
                raise ValueError(f"auth {auth!r}: header, query or subprotocol")
        ws_kwargs.setdefault("max_size", 4 * 1024 * 1024)
        ws_kwargs.setdefault("compression", None)
        ws = await connect(url, additional_headers=headers, subprotocols=subprotocols, origin=origin,
                           open_timeout=open_timeout, **ws_kwargs)
        try:
            first = json.loads(await asyncio.wait_for(ws.recv(), open_timeout))
        except ConnectionClosed as exc:
            raise VoicelaneError({"code": "closed", "message": f"closed before session.created: {exc}",
                                  "fatal": True}) from None
        if first.get("type") == "error":
            try:
                await asyncio.wait_for(ws.wait_closed(), 5)
            except asyncio.TimeoutError:
                await ws.close()
            err = VoicelaneError(first)
            err.close_code = ws.close_code  # type: ignore[attr-defined]
            raise err
        if first.get("type") != "session.created":
            await ws.close()
            raise VoicelaneError({"code": "protocol", "message": f"expected session.created, got {first}"})
        return cls(ws, first, clock=clock)

    async def __aenter__(self) -> VoicelaneClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ sending
    async def send(self, msg: dict) -> None:
        await self.ws.send(json.dumps(msg))

    def _event_id(self) -> str:
        return f"c{next(self._ids)}"

    async def _request(self, msg: dict, timeout: float = 30.0) -> dict:
        eid = msg.setdefault("event_id", self._event_id())
        fut = asyncio.get_running_loop().create_future()
        self._waiters[eid] = fut
        try:
            await self.send(msg)
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._waiters.pop(eid, None)
        if reply.get("type") == "error":
            raise VoicelaneError(reply)
        return reply

    def context(self, context_id: str | None = None) -> Context:
        """A handle for a context created implicitly by its first text (session defaults)."""
        cid = context_id or uuid.uuid4().hex[:12]
        ctx = self.contexts.get(cid)
        if ctx is None or ctx.ended:
            ctx = Context(self, cid)
            self.contexts[cid] = ctx
        return ctx

    async def create_context(self, context_id: str | None = None, *, timeout: float = 30.0,
                             **options: Any) -> Context:
        """`context.create` with the given options (voice, language, instructions, output_format,
        audio_transport, text_layout, text_normalization, sampling, max_frames, min_frames); waits for
        `context.created`; raises VoicelaneError if refused (overloaded, context_limit, unknown_voice, ...)."""
        ctx = Context(self, context_id or uuid.uuid4().hex[:12])
        self.contexts[ctx.id] = ctx
        msg = {"type": "context.create", "context_id": ctx.id}
        msg.update({k: v for k, v in options.items() if v is not None})
        try:
            await self._request(msg, timeout)
        except VoicelaneError:
            if self.contexts.get(ctx.id) is ctx:
                del self.contexts[ctx.id]
            raise
        return ctx

    async def update_session(self, defaults: dict, timeout: float = 30.0) -> dict:
        reply = await self._request({"type": "session.update", "defaults": defaults}, timeout)
        self.session = {**self.session, "defaults": reply["defaults"]}
        return reply["defaults"]

    async def ping(self, timeout: float = 30.0) -> float:
        """Round trip of a protocol `ping` (seconds)."""
        t0 = time.monotonic()
        await self._request({"type": "ping", "id": self._event_id()}, timeout)
        return time.monotonic() - t0

    async def cancel_all(self, played: dict[str, float] | None = None) -> None:
        msg: dict[str, Any] = {"type": "cancel_all"}
        if played:
            msg["played"] = played
        await self.send(msg)

    async def close(self, timeout: float = 10.0) -> int | None:
        """`session.close`: the server cancels every open context and closes with 1000. Returns the close code."""
        try:
            await self.send({"type": "session.close"})
            await asyncio.wait_for(self.closed.wait(), timeout)
        except (ConnectionClosed, asyncio.TimeoutError):
            pass
        await self.aclose()
        return self.close_code

    async def aclose(self) -> None:
        await self.ws.close()
        try:
            await asyncio.wait_for(self._reader, 5)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._reader.cancel()

    async def session_events(self, timeout: float | None = None) -> AsyncIterator[Event | dict]:
        """Messages that belong to no context: errors and warnings without a context_id, `session.draining`,
        `session.updated`, `pong`; ends with SessionClosed."""
        while True:
            ev = await asyncio.wait_for(self._session_queue.get(), timeout)
            yield ev
            if isinstance(ev, SessionClosed):
                return

    async def next_session_event(self, timeout: float | None = None) -> Event | dict:
        return await asyncio.wait_for(self._session_queue.get(), timeout)

    # ------------------------------------------------------------------ receiving
    async def _read(self) -> None:
        try:
            async for message in self.ws:
                now = self.clock()
                if isinstance(message, bytes):
                    self._on_binary(message, now)
                else:
                    self._on_json(json.loads(message), now)
        except ConnectionClosed:
            pass
        except Exception as exc:  # a message this client cannot read: kept for _on_closed, still raised
            self.reader_failure = exc
            raise
        finally:
            rcvd = getattr(self.ws.protocol, "close_rcvd", None)
            self.close_code = rcvd.code if rcvd is not None else self.ws.close_code
            self.close_reason = rcvd.reason if rcvd is not None else (self.ws.close_reason or "")
            self._on_closed()
            self.closed.set()

    def _on_closed(self) -> None:
        """The reader has stopped: every stream still open ends with SessionClosed, every request waiting fails."""
        closed = SessionClosed(self.close_code, self.close_reason)
        for ctx in self.contexts.values():
            if not ctx.ended:
                ctx._push(closed)
        self._session_queue.put_nowait(closed)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_result({"type": "error", "code": "closed", "message": "the session closed", "fatal": True})

    def _on_binary(self, data: bytes, now: float) -> None:
        header, payload = unpack_frame(data)
        ctx = self._by_stream.get(header.stream_id)
        if ctx is None:
            return
        ctx._push(AudioPacket(ctx.id, header.seq, header.start_sample, payload, header.first, header.last,
                              header.segment_start, header.stream_id, now))

    def _on_json(self, msg: dict, now: float) -> None:
        t = msg.get("type")
        eid = msg.get("event_id")
        cid = msg.get("context_id")
        ctx = self.contexts.get(cid) if cid is not None else None
        if t == "context.created":
            if ctx is None:  # created by a text from another handle: make one
                ctx = self.context(cid)
            ctx.created = msg
            ctx.stream_id = msg.get("stream_id")
            if ctx.stream_id is not None:
                self._by_stream[ctx.stream_id] = ctx
        if eid is not None and eid in self._waiters and t in ("context.created", "session.updated", "pong", "error"):
            fut = self._waiters[eid]
            if not fut.done():
                fut.set_result(msg)
        if t == "audio" and ctx is not None:
            fmt = ctx.output_format
            clock = 48000 if fmt.get("encoding") == "opus" else int(fmt.get("sample_rate", 24000))
            start_ms = float(msg.get("start_ms", 0.0))
            ctx._push(AudioPacket(ctx.id, msg["seq"], round(start_ms * clock / 1000.0),
                                  base64.b64decode(msg.get("data") or ""), bool(msg.get("first")),
                                  bool(msg.get("last")), bool(msg.get("segment_start")), None, now, start_ms))
            return
        event: Event | dict
        if t == "flushed":
            event = Flushed(cid, msg.get("flush_id"), msg.get("audio_end_ms", 0.0), msg)
        elif t == "context.done":
            event = ContextDone(cid, msg.get("reason", ""), msg.get("audio_ms", 0.0), msg.get("ttfa_ms"), msg)
        elif t == "context.cancelled":
            event = ContextCancelled(cid, msg.get("generated_ms", 0.0), msg.get("sent_ms", 0.0),
                                     msg.get("played_ms", 0.0), msg)
        elif t == "error":
            event = ErrorEvent(VoicelaneError(msg))
        elif t == "warning":
            event = WarningEvent(msg.get("code", ""), msg.get("message", ""), msg)
        elif t == "context.created":
            return
        else:
            event = msg
        if ctx is not None and not isinstance(event, dict):
            ctx._push(event)
        else:
            self._session_queue.put_nowait(event)


# ------------------------------------------------------------------------------------------------------- decoding


def decode_opus(packets: Iterable[AudioPacket], pre_skip: int = 312) -> np.ndarray:
    """int16 mono PCM at 48 kHz of a context's Opus packets (pre_skip dropped; empty `last` packets skipped).
    Needs opuslib and libopus."""
    import opuslib

    dec = opuslib.Decoder(48000, 1)
    out = [np.frombuffer(dec.decode(p.payload, 5760), dtype="<i2") for p in packets if p.payload]
    pcm = np.concatenate(out) if out else np.zeros(0, dtype=np.int16)
    return pcm[pre_skip:]


def decode_pcm(packets: Iterable[AudioPacket], encoding: str = "pcm_s16le") -> np.ndarray:
    """The samples of a context's PCM packets: int16 (pcm_s16le), float32 (pcm_f32le) or int16 (pcm_mulaw,
    expanded with G.711)."""
    data = b"".join(p.payload for p in packets)
    if encoding == "pcm_s16le":
        return np.frombuffer(data, dtype="<i2").copy()
    if encoding == "pcm_f32le":
        return np.frombuffer(data, dtype="<f4").copy()
    if encoding == "pcm_mulaw":
        u = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
        sign, exponent, mantissa = u & 0x80, (u >> 4) & 0x07, u & 0x0F
        magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
        return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)
    raise ValueError(f"unknown PCM encoding {encoding!r}")
