"""What each client message does on a WebSocket session (docs/protocol.md 1.1): validation, the context state rules
(unknown / open / closed / ended), limits, and opening engine contexts. Mixed into WsSession (server/gateway.py),
which owns the socket, the outgoing FIFO and the tasks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine import EngineError, Overloaded
from server.audio.encoders import OpusOutput, PcmOutput
from server.audio.stream import AudioStream
from server.options import ContextOptions, resolve_context_options
from server.protocol import (
    CLOSE_NORMAL,
    ERRORS,
    PLAYBACK_STATES,
    ProtocolError,
    check_unicode,
    get_bool,
    get_flush_id,
    get_id,
    get_number,
    get_str,
    is_valid_id,
    parse_envelope,
    parse_played_map,
    ws_error,
    ws_warning,
)
from server.stream import ContextStream
from server.ws_context import WsContext

log = logging.getLogger("voicelane.gateway")
FAULT_KINDS = ("exception", "nan", "internal")


class MessageHandlers:
    """The `on_<type>` handler of every client message type. Handlers run on the receive task, in message order,
    and never block: engine calls only change scheduler state."""

    def handle(self, obj: dict) -> None:
        # only ids that are valid may be echoed on the error (a lone surrogate cannot be written as UTF-8)
        event_id = obj.get("event_id") if is_valid_id(obj.get("event_id")) else None
        context_id = obj.get("context_id") if is_valid_id(obj.get("context_id")) else None
        try:
            check_unicode(obj)
            env = parse_envelope(obj)
            getattr(self, "on_" + env.type.replace(".", "_"))(env.body, env.event_id)
        except ProtocolError as exc:
            self.error(exc, context_id=context_id, event_id=event_id)
        except EngineError as exc:
            code = exc.code if exc.code in ERRORS else "internal"
            self.send(ws_error(code, str(exc), context_id=context_id, event_id=event_id, param=exc.param))
        except Exception as exc:  # noqa: BLE001 - a server fault answers `internal`; the socket survives
            log.exception("session %s: internal error handling %r", self.id, obj.get("type"))
            self.send(ws_error("internal", f"server error: {type(exc).__name__}", context_id=context_id,
                               event_id=event_id))

    def _reply(self, msg: dict, event_id: Any) -> None:
        if event_id is not None:
            msg["event_id"] = event_id
        self.send(msg)

    def _lookup(self, body: dict, *, for_text: bool = False) -> WsContext | None:
        """The open context named by `context_id`; ProtocolError for ended / unknown ones (None: unknown and
        `for_text`, which creates it)."""
        cid = get_id(body, "context_id")
        ctx = self.contexts.get(cid)
        if ctx is not None:
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
            fault = self._fault(body)
            if rt.draining:
                raise ProtocolError("overloaded", "the server is draining: open new contexts on another server")
            if len(self.contexts) >= self.limits.max_contexts:
                rt.metrics.rejections.inc("ws", "context_limit")
                raise ProtocolError("context_limit", f"{self.limits.max_contexts} contexts are open on this socket "
                                    "(limits.max_contexts); close or cancel one first")
            ctx = self._open(cid, opts)
        except ProtocolError as exc:
            exc.context_id = cid
            if exc.code == "overloaded":
                rt.metrics.rejections.inc("ws", "overloaded")
            raise
        except EngineError as exc:
            if isinstance(exc, Overloaded):
                rt.metrics.rejections.inc("ws", "overloaded")
            raise ProtocolError(exc.code if exc.code in ERRORS else "internal", str(exc), exc.param,
                                context_id=cid) from None
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

    def _fault(self, body: dict) -> tuple[str, int] | None:
        spec = body.get("test_fault")
        if spec is None or not self.runtime.config.test_hooks:
            return None
        if not isinstance(spec, dict):
            raise ProtocolError("invalid_field", "'test_fault' must be an object", "test_fault")
        kind = get_str(spec, "kind", required=True, choices=FAULT_KINDS, param="test_fault.kind")
        at = int(get_number(spec, "at_frame", minimum=0, param="test_fault.at_frame") or 0)
        return kind, at

    def _open(self, cid: str, opts: ContextOptions) -> WsContext:
        rt = self.runtime
        instruction_ids = None
        if opts.instructions is not None:
            if not rt.info.supports_instructions:
                raise ProtocolError("invalid_field", "instructions are not supported by this model (0.6B); drop "
                                    "'instructions' or serve the 1.7B CustomVoice checkpoint", "instructions")
            instruction_ids = rt.tokenizer.encode("user\n" + opts.instructions)
        fmt = opts.output_format
        try:
            output = OpusOutput(fmt.bitrate, complexity=rt.config.opus_complexity) if fmt.is_opus else \
                PcmOutput(fmt.encoding, fmt.sample_rate)
        except RuntimeError as exc:  # codec library missing
            raise ProtocolError("unsupported_format", str(exc), "output_format") from None
        stream = ContextStream.open(rt.engine, opts, instruction_ids, AudioStream(output, segment_flush=True),
                                    rt.executor, rt.tokenizer)  # InvalidRequest / Overloaded
        ctx = WsContext(self, cid, opts, stream, next(self._stream_ids) & 0xFFFFFFFF)
        self.contexts[cid] = ctx
        self.ended_ids.pop(cid, None)
        rt.metrics.active_contexts.inc("ws")
        return ctx

    def on_text(self, body: dict, event_id: Any) -> None:
        text = body.get("text")
        if not isinstance(text, str):
            raise ProtocolError("invalid_field", "'text' must be a string", "text")
        get_str(body, "text")  # valid Unicode
        flush = get_bool(body, "flush")
        flush_id = get_flush_id(body)
        if len(text) > self.limits.max_text_chars_per_message:
            raise ProtocolError("text_too_long", f"{len(text)} characters in one message; limit "
                                f"{self.limits.max_text_chars_per_message} (limits.max_text_chars_per_message)",
                                "text")
        ctx = self._lookup(body, for_text=True)
        if ctx is None:
            ctx = self._create(get_id(body, "context_id"), {}, event_id)
        if ctx.input_closed:
            raise ProtocolError("context_closed", f"context {ctx.id!r} is closed (context.close was sent)", "text")
        if ctx.text_chars + len(text) > self.limits.max_text_chars_per_context:
            raise ProtocolError("text_too_long", f"context {ctx.id!r} would pass "
                                f"{self.limits.max_text_chars_per_context} characters "
                                "(limits.max_text_chars_per_context)", "text")
        ctx.add_text(text)
        if flush:
            ctx.flush(flush_id, event_id)

    def on_flush(self, body: dict, event_id: Any) -> None:
        flush_id = get_flush_id(body)
        ctx = self._lookup(body)
        if ctx.input_closed:
            raise ProtocolError("context_closed", f"context {ctx.id!r} is closed (context.close was sent)",
                                "context_id")
        ctx.flush(flush_id, event_id)

    def on_context_close(self, body: dict, event_id: Any) -> None:
        ctx = self._lookup(body)
        if ctx.input_closed:
            raise ProtocolError("context_closed", f"context {ctx.id!r} is already closed", "context_id")
        ctx.close_event_id = event_id
        ctx.close_input()

    def on_context_cancel(self, body: dict, event_id: Any) -> None:
        played = get_number(body, "played_ms", minimum=0)
        cid = get_id(body, "context_id")
        ctx = self.contexts.get(cid)
        if ctx is None:
            if cid in self.ended_ids:
                self.send(ws_warning("context_not_active", f"context {cid!r} has already ended", context_id=cid,
                                     event_id=event_id))
                return
            raise ProtocolError("unknown_context", f"no context {cid!r} on this socket", "context_id")
        ctx.cancel(played, event_id)
        ctx.log.info("context %s cancelled by the client", cid)

    def on_cancel_all(self, body: dict, event_id: Any) -> None:
        played = parse_played_map(body.get("played"))
        for cid, ctx in list(self.contexts.items()):
            ctx.cancel(played.get(cid), event_id)
            ctx.log.info("context %s cancelled by cancel_all", cid)

    def on_playback(self, body: dict, event_id: Any) -> None:
        played = get_number(body, "played_ms", required=True, minimum=0)
        state = get_str(body, "state", required=True, choices=PLAYBACK_STATES)
        buffered = get_number(body, "buffered_ms", minimum=0)
        cid = get_id(body, "context_id")
        ctx = self.contexts.get(cid)
        if ctx is None:
            if cid in self.ended_ids:
                return  # a late report for an ended context is accepted silently
            raise ProtocolError("unknown_context", f"no context {cid!r} on this socket", "context_id")
        self.runtime.metrics.playback_reports.inc(state)
        ctx.report_playback(played, state, buffered)
