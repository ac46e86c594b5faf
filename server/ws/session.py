"""`GET /v1/tts/ws`: one session per WebSocket (docs/protocol.md 1).

Per socket: one receive task (parses client messages in order and hands each to its handler in HANDLERS; engine
calls are cheap and never block; between messages, at most CHECK_S apart, it checks the session's deadlines: idle
timeouts, draining, a dead engine), one emit task (writes the outbox to the socket), and one pump task per context
(stream events -> frames; encoding runs in the thread pool). The deadlines live with the receive task because it
never waits on the client for long (a message, or CHECK_S), where the emit task may wait on a socket nobody
reads. Contexts hold only the outbox: what they tell the session (an overflow, their end) comes through it.

Every bad input is a typed, non-fatal error that names its context; only session-level failures close the socket
(4001 unauthorized, 4003 origin, 4008 idle, 4009 slow reader, 4029 too many sessions, 1001 draining, 1011
internal; 1007 and 1009 come from the WebSocket layer itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine import EngineError
from server.audio.encoders import OpusOutput, PcmOutput
from server.audio.stream import AudioStream
from server.auth import bearer_token, query_token, subprotocol_token
from server.metrics import phases_text
from server.options import resolve_context_options
from server.protocol import (
    CLIENT_TYPES,
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    ERRORS,
    PLAYBACK_STATES,
    PROTOCOL_VERSION,
    SUBPROTOCOL,
    ProtocolError,
    as_protocol_error,
    check_unicode,
    get_bool,
    get_flush_id,
    get_id,
    get_number,
    get_object,
    get_str,
    is_unicode,
    is_valid_id,
    parse_envelope,
    parse_json_object,
    parse_played_map,
    with_ids,
    ws_error,
    ws_warning,
)
from server.ratelimit import RateLimiter
from server.runtime import Runtime
from server.stream import ContextStream, instruction_ids
from server.ws.context import WsContext
from server.ws.outbox import Outbox, OutItem, dumps

log = logging.getLogger("voicelane.gateway")
ENDED_IDS_KEPT = 4096  # ids of ended contexts remembered per socket (context_closed vs unknown_context)
CHECK_S = 0.25  # the session's deadlines are checked this often
CLOSE_GRACE_S = 5.0
FAULT_KINDS = ("exception", "nan", "internal")


class WsSession:
    """One WebSocket: its tasks, its outbox, its contexts, and the handler of every client message type."""

    def __init__(self, runtime: Runtime, websocket: WebSocket):
        self.runtime, self.ws = runtime, websocket
        self.id = uuid.uuid4().hex[:16]
        self.limits = runtime.limits
        self.defaults = runtime.defaults
        self.out = Outbox(self.limits, runtime.metrics, on_overflow=self._slow_reader,
                          on_context_ended=self._context_ended)
        self.contexts: dict[str, WsContext] = {}
        self.ended_ids: OrderedDict[str, None] = OrderedDict()
        self._stream_ids = itertools.count(1)
        self.last_client_activity = time.monotonic()
        self.close_code: int | None = None
        self.finished = asyncio.Event()
        self.draining_sent = False
        self._next_check = time.monotonic() + CHECK_S

    # ------------------------------------------------------------------ output
    @property
    def ending(self) -> bool:
        return self.out.closed

    def error(self, exc: ProtocolError, *, context_id: str | None = None, event_id: Any = None) -> None:
        self.out.send(ws_error(exc.code, exc.message, context_id=exc.context_id or context_id, event_id=event_id,
                               param=exc.param))

    def _slow_reader(self, what: str, reason: str, message: str) -> None:
        """A client that does not read ends with 4009 before what waits for it passes either bound."""
        log.warning("session %s: %s: slow reader, closing with 4009", self.id, what)
        self.end(ERRORS["slow_reader"].close_code, reason, error=ws_error("slow_reader", message), immediate=True)

    def end(self, code: int, reason: str, *, error: dict | None = None, immediate: bool = False) -> None:
        """Close the session: queue (or, when `immediate`, put first after dropping everything queued) an
        optional error and the close. Open contexts are cancelled in the engine without messages."""
        if self.ending:
            return
        self.out.closed = True
        self.close_code = code
        self._abandon_all()
        if immediate:
            self.out.purge()
            self.out.put(OutItem(close=(code, reason)), front=True)
            if error is not None:
                self.out.put(OutItem(dumps(error)), front=True)
        else:
            if error is not None:
                self.out.send(error)
            self.out.put(OutItem(close=(code, reason)))
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S if not immediate else 2 * CLOSE_GRACE_S,
                                              self.finished.set)

    async def emit(self) -> None:
        """The emit task: the outbox, in order, to the socket."""
        try:
            while True:
                item = await self.out.get()
                if item.close is not None:
                    try:
                        await self.ws.close(item.close[0], item.close[1][:120])
                    finally:
                        self.finished.set()
                    return
                data = self._wire(item)
                if data is None:
                    continue
                try:
                    await (self.ws.send_bytes if isinstance(data, bytes) else self.ws.send_text)(data)
                finally:
                    self.out.sent(item)
                if item.on_sent is not None:
                    item.on_sent()
        except (WebSocketDisconnect, RuntimeError, OSError, ConnectionError) as exc:
            log.debug("session %s: emit stopped: %s", self.id, exc)
        except Exception:  # noqa: BLE001
            log.exception("session %s: emit task failed", self.id)
        finally:
            self.finished.set()

    def _wire(self, item: OutItem) -> bytes | str | None:
        """The bytes or text of one queued message, or None when it cannot be written (a render that fails, text
        that is not valid Unicode): that message is dropped, its context ends with `internal`, and the socket and
        every other context go on."""
        try:
            data = item.data if item.render is None else item.render()
            if isinstance(data, str) and not is_unicode(data):
                raise ValueError("the message is not valid Unicode")
            return data
        except Exception as exc:  # noqa: BLE001 - one bad message must never end the session
            self.out.sent(item)
            log.exception("session %s: an outgoing message could not be written; dropped", self.id)
            owner = item.owner
            cid = owner.id if owner is not None and is_valid_id(owner.id) else None
            if owner is not None and not owner.ended:
                owner.fail(f"an outgoing message could not be written ({type(exc).__name__})")
            else:
                self.out.send(ws_error("internal", f"server error: an outgoing message could not be written "
                                       f"({type(exc).__name__}) and was dropped", context_id=cid))
            return None

    # ------------------------------------------------------------------ life cycle
    async def run(self) -> None:
        rt = self.runtime
        rt.sessions.add(self)
        rt.metrics.sessions.inc()
        emit = asyncio.create_task(self.emit(), name=f"ws-emit-{self.id}")
        recv = asyncio.create_task(self._receive(), name=f"ws-recv-{self.id}")
        self.out.send(self._session_created())
        if rt.draining:
            self.on_drain(max(0.0, (rt.drain_deadline or time.monotonic()) - time.monotonic()))
        try:
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({recv, finished}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            if recv.done() and not recv.cancelled() and recv.exception() is not None and not self.ending:
                log.error("session %s: receive task failed", self.id, exc_info=recv.exception())
                self.end(CLOSE_INTERNAL, "internal error",
                         error=ws_error("internal", "server error: the session ends", fatal=True))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.finished.wait(), CLOSE_GRACE_S * 2)
        finally:
            self._abandon_all()
            recv.cancel()
            if not emit.done():
                if self.ending and not self.finished.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.finished.wait(), CLOSE_GRACE_S)
                if not emit.done():  # still writing: the client does not read, and a close would wait on it
                    emit.cancel()
                    abort_transport(self.ws, self.id)
            rt.sessions.discard(self)
            rt.metrics.sessions.dec()
            rt.metrics.sessions_total.inc(str(self.close_code or "client"))
            log.info("session %s closed (%s)", self.id, self.close_code or "by the client")

    def _abandon_all(self) -> None:
        for ctx in list(self.contexts.values()):
            ctx.abandon()
            self._context_ended(ctx, "abandoned")

    def _session_created(self) -> dict:
        rt = self.runtime
        info = rt.info
        limits = {k: v for k, v in asdict(self.limits).items() if k != "message_burst"} | {"max_frames": rt.max_frames}
        return {"type": "session.created", "session_id": self.id, "protocol": PROTOCOL_VERSION, "model": info.name,
                "limits": limits, "defaults": self.defaults.to_dict(rt.sampling_base),
                "voices": [{"name": v.name, "languages": list(v.languages)} for v in info.voices],
                "languages": list(info.languages),
                "bench_frames_per_word": rt.config.engine.scheduler.bench_frames_per_word,
                "random_weights": info.random_weights, "supports_instructions": info.supports_instructions}

    def on_drain(self, deadline_s: float) -> None:
        if not self.draining_sent and not self.ending:
            self.draining_sent = True
            self.out.send({"type": "session.draining", "deadline_s": round(deadline_s, 3)})

    def _check_deadlines(self) -> None:
        """Once CHECK_S has passed since the last check (the receive task calls this between messages and while
        it waits for one): a dead engine, idle contexts, draining, an idle session."""
        now = time.monotonic()
        if self.ending or now < self._next_check:
            return
        self._next_check = now + CHECK_S
        rt = self.runtime
        if not rt.engine_running():
            for ctx in list(self.contexts.values()):
                if not ctx.ended:
                    ctx.abandon()
                    self.out.send(ws_error("internal", "the engine stopped", context_id=ctx.id))
            self.end(CLOSE_INTERNAL, "engine stopped",
                     error=ws_error("internal", "the engine stopped; reconnect later", fatal=True))
            return
        for ctx in list(self.contexts.values()):
            if (not ctx.stream.input_closed and not ctx.timeout_requested and not ctx.ended
                    and now - ctx.last_activity > self.limits.context_idle_timeout_s):
                ctx.log.info("context %s idle for %.0f s: ending with reason timeout", ctx.id,
                             self.limits.context_idle_timeout_s)
                ctx.timeout_requested = True
                ctx.ectx.cancel()
        if rt.draining:
            if not self.contexts:
                self.end(CLOSE_GOING_AWAY, "server draining")
                return
            if rt.drain_deadline is not None and now > rt.drain_deadline:
                log.warning("session %s: drain deadline: cancelling %d context(s) still open", self.id,
                            len(self.contexts))
                for ctx in list(self.contexts.values()):
                    ctx.cancel(None, None)
                self.end(CLOSE_GOING_AWAY, "server draining: deadline passed",
                         error=ws_error("overloaded", "the server's drain deadline passed: its open contexts were "
                                        "cancelled; reconnect to another server", fatal=True))
                return
        elif not self.contexts and now - self.last_client_activity > self.limits.idle_timeout_s:
            log.info("session %s idle for %.0f s: closing with 4008", self.id, self.limits.idle_timeout_s)
            self.end(ERRORS["idle_timeout"].close_code, "idle timeout",
                     error=ws_error("idle_timeout", f"no message for {self.limits.idle_timeout_s:g} s"))

    # ------------------------------------------------------------------ input
    async def _receive(self) -> None:
        """The receive task: client messages, paced and in order, to their handlers."""
        pace = RateLimiter(self.limits.max_messages_per_s, self.limits.message_burst)
        paced = False
        while True:
            # yield between messages (a queued message is returned without suspending), so one socket's burst
            # never holds the event loop; past the rate, wait for the next token (the client is paced by TCP)
            await asyncio.sleep(0)
            self._check_deadlines()  # due ones: a client that never pauses has its deadlines checked too
            while (wait := pace.acquire(self.id)) > 0:
                if not paced:
                    paced = True
                    self.runtime.metrics.rejections.inc("ws", "message_rate")
                    log.info("session %s: over %g messages/s: pacing its messages", self.id, pace.rps)
                await asyncio.sleep(wait)
            message = await self._next_message()
            if message["type"] == "websocket.disconnect":
                if self.close_code is None:
                    self.close_code = disconnect_code(self.ws, message.get("code"))
                    if self.close_code == 1009:
                        self.runtime.metrics.rejections.inc("ws", "message_too_big")
                return
            if self.ending:
                continue
            self.last_client_activity = time.monotonic()
            self.handle(message.get("text"))
            if self.ending:
                # a session.close: let the emit task write what is queued and the close
                await self.finished.wait()
                return

    async def _next_message(self) -> dict:
        """The socket's next message; while none comes, the session's deadlines every CHECK_S. The receive is
        waited on, never cancelled, between checks (a message is never lost to a timeout)."""
        receive = asyncio.ensure_future(self.ws.receive())
        try:
            while True:  # until the next deadline check; once the session ends nothing is checked: no timeout
                timeout = None if self.ending else max(0.0, self._next_check - time.monotonic())
                if (await asyncio.wait({receive}, timeout=timeout))[0]:
                    return receive.result()
                self._check_deadlines()
        finally:
            receive.cancel()  # nothing when it is done; when this task is cancelled, the receive ends with it

    # ------------------------------------------------------------------ messages
    def handle(self, text: str | None) -> None:
        """One client message (None: a binary frame) to the handler of its type; a failure answers an error."""
        obj: dict = {}
        try:
            if text is None:
                raise ProtocolError("invalid_json", "binary frames are not accepted; send JSON text frames")
            obj = parse_json_object(text)
            check_unicode(obj)
            msg_type, event_id = parse_envelope(obj)
            HANDLERS[msg_type](self, obj, event_id)
        except (ProtocolError, EngineError) as exc:
            self.error(as_protocol_error(exc), **_echoable_ids(obj))
        except Exception as exc:  # noqa: BLE001 - a server fault answers `internal`; the socket survives
            log.exception("session %s: internal error handling %r", self.id, obj.get("type"))
            self.out.send(ws_error("internal", f"server error: {type(exc).__name__}", **_echoable_ids(obj)))

    def _reply(self, msg: dict, event_id: Any) -> None:
        self.out.send(with_ids(msg, event_id=event_id))

    def _lookup(self, body: dict, *, for_text: bool = False, ended_ok: bool = False,
                input_param: str | None = None) -> WsContext | None:
        """The open context named by `context_id`. An ended one is context_closed (None with `ended_ok`); an unknown
        one is unknown_context (None with `for_text`: the text creates it); with `input_param`, one whose input is
        closed is context_closed naming that param."""
        cid = get_id(body, "context_id")
        ctx = self.contexts.get(cid)
        if ctx is not None and input_param and ctx.stream.input_closed:
            raise ProtocolError("context_closed", f"context {cid!r} is closed (context.close was sent)", input_param)
        if ctx is not None or (ended_ok and cid in self.ended_ids):
            return ctx
        if cid in self.ended_ids:
            raise ProtocolError("context_closed", f"context {cid!r} has ended", "context_id", context_id=cid)
        if for_text:
            return None
        raise ProtocolError("unknown_context", f"no context {cid!r} on this socket (create it with "
                            "context.create or a first text)", "context_id", context_id=cid)

    # ------------------------------------------------------------------ handlers
    def on_ping(self, body: dict, event_id: Any) -> None:
        self._reply({"type": "pong", "id": body.get("id")}, event_id)

    def on_session_update(self, body: dict, event_id: Any) -> None:
        rt = self.runtime
        try:
            self.defaults = self.defaults.updated(body.get("defaults"), rt.catalog, rt.sampling_base)
        except ProtocolError as exc:  # docs/protocol.md 1.1: an invalid session.update is refused whole, invalid_field
            raise ProtocolError("invalid_field", exc.message, exc.param or "defaults") from None
        self._reply({"type": "session.updated", "defaults": self.defaults.to_dict(rt.sampling_base)}, event_id)

    def on_session_close(self, body: dict, event_id: Any) -> None:
        for ctx in list(self.contexts.values()):
            ctx.cancel(None, event_id)
        self.end(CLOSE_NORMAL, "session.close")

    def on_context_create(self, body: dict, event_id: Any) -> None:
        cid = get_id(body, "context_id")
        if cid in self.contexts:
            raise ProtocolError("duplicate_context", f"context {cid!r} is already open", "context_id", context_id=cid)
        if cid in self.ended_ids:
            raise ProtocolError("context_closed", f"context {cid!r} has ended; use a new id", "context_id",
                                context_id=cid)
        self._create(cid, body, event_id)

    def _create(self, cid: str, body: dict, event_id: Any) -> WsContext:
        rt = self.runtime
        try:
            opts = resolve_context_options(body, self.defaults, rt.catalog, rt.sampling_base,
                                           max_frames_limit=rt.max_frames,
                                           max_instruction_chars=self.limits.max_text_chars_per_message,
                                           draw_seed=rt.draw_seed)
            spec = get_object(body, "test_fault") if rt.config.test_hooks else None  # test hook: (kind, at_frame)
            fault = None if spec is None else (
                get_str(spec, "kind", required=True, choices=FAULT_KINDS, param="test_fault.kind"),
                int(get_number(spec, "at_frame", minimum=0, param="test_fault.at_frame") or 0))
            if rt.draining:
                raise ProtocolError("overloaded", "the server is draining: open new contexts on another server")
            if len(self.contexts) >= self.limits.max_contexts:
                rt.metrics.rejections.inc("ws", "context_limit")
                raise ProtocolError("context_limit", f"{self.limits.max_contexts} contexts are open on this socket "
                                    "(limits.max_contexts); close or cancel one first")
            instructions = instruction_ids(opts, rt.tokenizer, rt.info)
            fmt = opts.output_format
            try:
                output = OpusOutput(fmt.bitrate, complexity=rt.config.opus_complexity) if fmt.is_opus else \
                    PcmOutput(fmt.encoding, fmt.sample_rate)
            except RuntimeError as exc:  # codec library missing
                raise ProtocolError("unsupported_format", str(exc), "output_format") from None
            stream = ContextStream.open(rt.engine, opts, instructions, AudioStream(output, segment_flush=True),
                                        rt.executor, rt.tokenizer)  # InvalidRequest / Overloaded
        except (ProtocolError, EngineError) as exc:
            err = as_protocol_error(exc)
            err.context_id = cid
            if err.code == "overloaded":
                rt.metrics.rejections.inc("ws", "overloaded")
            raise err from None
        ctx = self.contexts[cid] = WsContext(self.out, rt.metrics, cid, opts, stream,
                                             next(self._stream_ids) & 0xFFFFFFFF)
        rt.metrics.active_contexts.inc("ws")
        if fault is not None:
            if fault[0] == "internal":
                ctx.fault = "internal"
            else:
                ctx.ectx.inject_fault(fault[0], fault[1])
        created: dict[str, Any] = {"type": "context.created", "context_id": cid, "stream_id": ctx.stream_id,
                                   "trace_id": ctx.trace_id, "seed": opts.sampling.seed,
                                   "output_format": opts.output_format.to_dict()}
        if opts.output_format.is_opus:
            created["opus"] = {"pre_skip": ctx.audio.pre_skip, "input_sample_rate": 24000}
        self._reply(created, event_id)
        ctx.task = asyncio.create_task(ctx.pump(), name=f"ws-ctx-{ctx.trace_id}")
        ctx.log.info("context %s created on session %s: voice %s, language %s, %s via %s, seed %d, layout %s",
                     cid, self.id, opts.voice, opts.language, opts.output_format.encoding, opts.audio_transport,
                     opts.sampling.seed, opts.text_layout)
        return ctx

    def on_text(self, body: dict, event_id: Any) -> None:
        text = get_str(body, "text", required=True)
        flush = get_bool(body, "flush")
        flush_id = get_flush_id(body)
        if len(text) > self.limits.max_text_chars_per_message:
            raise ProtocolError("text_too_long", f"{len(text)} characters in one message; limit "
                                f"{self.limits.max_text_chars_per_message} (limits.max_text_chars_per_message)",
                                "text")
        ctx = self._lookup(body, for_text=True, input_param="text")
        if ctx is None:
            ctx = self._create(get_id(body, "context_id"), {}, event_id)
        if ctx.text_chars + len(text) > self.limits.max_text_chars_per_context:
            raise ProtocolError("text_too_long", f"context {ctx.id!r} would pass "
                                f"{self.limits.max_text_chars_per_context} characters "
                                "(limits.max_text_chars_per_context)", "text")
        ctx.add_text(text)
        if flush:
            ctx.flush(flush_id, event_id)

    def on_flush(self, body: dict, event_id: Any) -> None:
        flush_id = get_flush_id(body)
        self._lookup(body, input_param="context_id").flush(flush_id, event_id)

    def on_context_close(self, body: dict, event_id: Any) -> None:
        ctx = self._lookup(body, input_param="context_id")
        ctx.close_event_id = event_id
        ctx.stream.close_input()

    def on_context_cancel(self, body: dict, event_id: Any) -> None:
        played = get_number(body, "played_ms", minimum=0)
        ctx = self._lookup(body, ended_ok=True)
        if ctx is None:
            cid = body["context_id"]
            self.out.send(ws_warning("context_not_active", f"context {cid!r} has already ended", context_id=cid,
                                     event_id=event_id))
            return
        ctx.cancel(played, event_id)
        ctx.log.info("context %s cancelled by the client", ctx.id)

    def on_cancel_all(self, body: dict, event_id: Any) -> None:
        played = parse_played_map(body.get("played"))
        for cid, ctx in list(self.contexts.items()):
            ctx.cancel(played.get(cid), event_id)
            ctx.log.info("context %s cancelled by cancel_all", cid)

    def on_playback(self, body: dict, event_id: Any) -> None:
        played = get_number(body, "played_ms", required=True, minimum=0)
        state = get_str(body, "state", required=True, choices=PLAYBACK_STATES)
        buffered = get_number(body, "buffered_ms", minimum=0)
        ctx = self._lookup(body, ended_ok=True)
        if ctx is None:
            return  # a late report for an ended context is accepted silently
        self.runtime.metrics.playback_reports.inc(state)
        ctx.report_playback(played, state, buffered)

    # ------------------------------------------------------------------ bookkeeping
    def _context_ended(self, ctx: WsContext, reason: str) -> None:
        if self.contexts.get(ctx.id) is not ctx:
            return
        del self.contexts[ctx.id]
        self.ended_ids[ctx.id] = None
        while len(self.ended_ids) > ENDED_IDS_KEPT:
            self.ended_ids.popitem(last=False)
        self.last_client_activity = max(self.last_client_activity, time.monotonic())
        m = self.runtime.metrics
        m.active_contexts.dec("ws")
        m.contexts.inc("ws", reason)
        ctx.log.info("context %s ended: %s (frames %d, generated %.0f ms, sent %.0f ms)%s", ctx.id, reason,
                     ctx.stream.frames, ctx.stream.generated_samples / 24.0, ctx.sent_end_ms,
                     phases_text(ctx.first_audio_phases))


def _echoable_ids(obj: dict) -> dict:
    """The message's event_id and context_id that its error may echo: valid ids only (a lone surrogate cannot be
    written as UTF-8)."""
    return {k: obj[k] for k in ("event_id", "context_id") if is_valid_id(obj.get(k))}


# What each client message does (docs/protocol.md 1.1): the handler of type `context.create` is
# WsSession.on_context_create, and so on for every type of server.protocol.CLIENT_TYPES.
HANDLERS: dict[str, Callable[[WsSession, dict, Any], None]] = {
    t: getattr(WsSession, "on_" + t.replace(".", "_")) for t in CLIENT_TYPES}


def _uvicorn_protocol(ws: WebSocket):
    return getattr(getattr(ws, "_receive", None), "__self__", None)


def disconnect_code(ws: WebSocket, code: int | None) -> int | None:
    """The close code of a client that went away. uvicorn reports a connection lost after the handshake as 1005
    (a close frame without a code) whether or not a close frame came; without one it was an abnormal closure,
    1006 (RFC 6455 7.1.5), which is what the metrics must count."""
    if code != 1005:
        return code
    conn = getattr(_uvicorn_protocol(ws), "conn", None)
    if conn is not None and hasattr(conn, "close_rcvd") and conn.close_rcvd is None:
        return 1006
    return code


def abort_transport(ws: WebSocket, session_id: str) -> None:
    """Drop the TCP connection of a client that does not read. A graceful close would flush the transport's
    buffer first, which such a client never lets happen, so its file descriptor would stay open. Reaches the
    uvicorn protocol behind the ASGI `receive` callable; where there is none, the server's own close applies."""
    transport = getattr(_uvicorn_protocol(ws), "transport", None)
    if transport is not None and hasattr(transport, "abort"):
        log.info("session %s: the client does not read: connection aborted", session_id)
        transport.abort()
    else:
        log.warning("session %s: the client does not read, and its transport cannot be aborted", session_id)


# ---------------------------------------------------------------------------------------------------- endpoint


async def websocket_endpoint(websocket: WebSocket) -> None:
    rt: Runtime = websocket.app.state.runtime
    offered = websocket.scope.get("subprotocols") or []
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)

    async def refuse(code: str, message: str, close_code: int | None = None) -> None:
        """A fatal error, then the close: with the code's own close code (ERRORS) unless another is given."""
        rt.metrics.rejections.inc("ws", code)
        rt.metrics.errors.inc("ws", code)
        try:
            await websocket.send_text(dumps(ws_error(code, message, fatal=True)))
            await websocket.close(close_code or ERRORS[code].close_code, message[:120])
        except (RuntimeError, OSError, WebSocketDisconnect):
            pass

    headers = websocket.headers
    if not rt.origins.allows(headers.get("origin"), headers.get("host")):
        return await refuse("origin_not_allowed", "this browser origin is not allowed (--allowed-origins)")
    if rt.keys.enabled:
        key = bearer_token(headers) or query_token(websocket.scope.get("query_string", b"")) or \
            subprotocol_token(offered)
        if not rt.keys.check(key):
            return await refuse("unauthorized", "a valid API key is required: Authorization: Bearer <key>, "
                                "?token=<key> or the subprotocol bearer.<key>")
    if rt.engine is None:
        return await refuse("not_ready", "the model is still loading; retry shortly")
    if rt.draining:
        return await refuse("overloaded", "the server is draining; connect to another server", CLOSE_GOING_AWAY)
    if rt.config.max_sessions and len(rt.sessions) >= rt.config.max_sessions:
        return await refuse("too_many_sessions", f"{rt.config.max_sessions} sessions are open (--max-sessions)")
    await WsSession(rt, websocket).run()
