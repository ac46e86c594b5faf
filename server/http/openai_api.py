"""The HTTP front door (docs/protocol.md 2): `POST /v1/audio/speech` in the OpenAI shape, `GET /v1/audio/voices`,
`GET /v1/models`.

The request's whole text is one segment of one context, on the same text pipeline, sampling settings and audio
stages as the WebSocket (same seed and text: the same codes). Errors are `{"error": {message, type, param, code}}`
with the status of the protocol's error table; 503s carry Retry-After. The response streams as audio is made
(or, with `stream: false`, comes whole); when the client goes away the context is cancelled at once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from engine import SAMPLE_RATE, ContextDone, EngineError
from server.audio.containers import HTTP_FORMATS, AudioFile, open_audio_file
from server.audio.stream import AudioStream
from server.auth import bearer_token
from server.logs import context_logger, current_trace
from server.metrics import phases_text
from server.options import LAYOUTS, SAMPLING_FIELDS, ContextOptions, resolve_context_options
from server.protocol import (
    ERRORS,
    ProtocolError,
    as_protocol_error,
    check_unicode,
    get_bool,
    get_number,
    get_object,
    get_str,
    http_error_body,
    parse_json_object,
)
from server.runtime import Runtime
from server.stream import ContextStream, instruction_ids
from server.text import encode_segments, segment_rule

log = logging.getLogger("voicelane.http")
STREAM_FORMATS = ("audio", "sse")
TOP_LEVEL_SAMPLING = (*SAMPLING_FIELDS, "subtalker")
RETRY_AFTER_S = "1"
BACKLOG_CHECK_S = 0.2


def sse_event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def sse_audio(data: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})


def error_response(code: str, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = ERRORS[code]
    h = dict(headers or {})
    if kind.http_status in (503, 429) and "Retry-After" not in h:
        h["Retry-After"] = RETRY_AFTER_S
    if kind.http_status == 401:
        h["WWW-Authenticate"] = 'Bearer realm="voicelane"'
    return JSONResponse(http_error_body(code, message, param), status_code=kind.http_status, headers=h)


def refusal(request: Request, rt: Runtime) -> JSONResponse | None:
    """The answer to a request this server does not take (a browser origin or an API key it refuses, a model still
    loading), or None."""
    if not rt.origins.allows(request.headers.get("origin"), request.headers.get("host")):
        rt.metrics.rejections.inc("http", "origin_not_allowed")
        return error_response("origin_not_allowed", "this browser origin is not allowed (--allowed-origins)")
    if rt.keys.enabled and not rt.keys.check(bearer_token(request.headers)):
        rt.metrics.rejections.inc("http", "unauthorized")
        return error_response("unauthorized", "a valid API key is required: Authorization: Bearer <key>")
    if rt.engine is None:
        return error_response("overloaded", "the model is still loading; retry shortly")
    return None


@dataclass(frozen=True)
class SpeechRequest:
    text: str
    options: ContextOptions
    response_format: str
    stream: bool
    stream_format: str


def parse_speech(obj: dict, rt: Runtime) -> SpeechRequest:
    check_unicode(obj)  # every field and key, `model` and `sampling` keys included
    text = get_str(obj, "input", required=True)
    if not text.strip():
        raise ProtocolError("invalid_field", "'input' is empty", "input")
    if len(text) > rt.limits.max_text_chars_per_context:
        raise ProtocolError("text_too_long", f"'input' has {len(text)} characters; limit "
                            f"{rt.limits.max_text_chars_per_context}", "input")
    get_str(obj, "model")  # any model name: this server has one
    fmt = get_str(obj, "response_format") or "mp3"
    if fmt not in HTTP_FORMATS:
        raise ProtocolError("unsupported_format", f"response_format {fmt!r}; one of {', '.join(HTTP_FORMATS)}",
                            "response_format")
    speed = get_number(obj, "speed")
    if speed is not None and speed != 1.0:
        raise ProtocolError("invalid_field", f"speed {speed:g}: only 1.0 is supported", "speed")
    stream = get_bool(obj, "stream")
    stream_format = get_str(obj, "stream_format", choices=STREAM_FORMATS) or "audio"
    layout = get_str(obj, "text_layout", choices=LAYOUTS)
    nsm = get_bool(obj, "non_streaming_mode")
    if nsm is not None:
        implied = "whole" if nsm else "dual"
        if layout is not None and layout != implied:
            raise ProtocolError("invalid_field", f"non_streaming_mode={str(nsm).lower()} contradicts text_layout "
                                f"{layout!r}", "non_streaming_mode")
        layout = implied
    sampling = dict(get_object(obj, "sampling") or {})
    for name in TOP_LEVEL_SAMPLING:
        if name in obj and obj[name] is not None:
            if name in sampling:
                raise ProtocolError("invalid_field", f"'{name}' is given both at the top level and in 'sampling'",
                                    name)
            sampling[name] = obj[name]
    ctx_fields = {k: obj[k] for k in ("voice", "language", "instructions", "text_normalization", "max_frames",
                                      "min_frames") if obj.get(k) is not None}
    ctx_fields |= {"text_layout": layout, "sampling": sampling}
    opts = resolve_context_options(ctx_fields, rt.defaults, rt.catalog, rt.sampling_base,
                                   max_frames_limit=rt.max_frames,
                                   max_instruction_chars=rt.limits.max_text_chars_per_message,
                                   draw_seed=rt.draw_seed)
    return SpeechRequest(text, opts, fmt, True if stream is None else stream, stream_format)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, at most `limit` bytes, whole within `timeout_s` (a slow or never-ending body is 408)."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ProtocolError("text_too_long", f"request body over {limit} bytes")
                chunks.append(chunk)
    except ClientDisconnect:  # an aborted upload: nobody to answer, nothing worth an ERROR traceback
        log.info("client left during its request body (%d bytes read)", size)
        raise ProtocolError("invalid_json", "the request body ended early: the client disconnected") from None
    except TimeoutError:
        raise ProtocolError("request_timeout", f"the request body did not arrive within {timeout_s:g} s "
                            "(--http-body-timeout-s)") from None
    return b"".join(chunks)


async def speech(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    t0 = time.monotonic()
    if (refused := refusal(request, rt)) is not None:
        return refused
    if rt.draining:
        rt.metrics.rejections.inc("http", "draining")
        return error_response("overloaded", "the server is draining; send the request to another server")
    limiter = rt.rate_limiter
    if limiter.enabled:
        key = bearer_token(request.headers) if rt.keys.enabled else None
        wait = limiter.acquire(limiter.client_id(key, request.client.host if request.client else None))
        if wait > 0:
            rt.metrics.rejections.inc("http", "rate_limited")
            return error_response("rate_limited", f"over {limiter.rps:g} requests/s (burst {limiter.burst}); retry "
                                  f"in {wait:.1f} s", headers={"Retry-After": limiter.retry_after(wait)})
    stream = None
    try:
        obj = parse_json_object(await read_body(request, rt.config.http_max_body_bytes,
                                                rt.config.http_body_timeout_s))
        req = parse_speech(obj, rt)
        segments = encode_segments(rt.tokenizer, req.text, req.options.text_normalization,
                                   *segment_rule(rt.sampling_base.max_frames,
                                                 rt.config.engine.scheduler.bench_frames_per_word))
        n_tokens = sum(len(ids) for ids, _ in segments)
        if not n_tokens:
            raise ProtocolError("invalid_field", "'input' has nothing to speak after text normalisation", "input")
        instructions = instruction_ids(req.options, rt.tokenizer, rt.info)
        try:
            file = open_audio_file(req.response_format, opus_complexity=rt.config.opus_complexity)
        except RuntimeError as exc:
            raise ProtocolError("unsupported_format", str(exc), "response_format") from None
        fault = obj.get("test_fault") if rt.config.test_hooks else None
        # pipelined and coalesced: the engine in its own process takes the open, the text and the close in one
        # write; a refusal is then the stream's first event, answered with the same status (the response starts with
        # the first audio)
        with rt.engine.coalesced():
            stream = ContextStream.open(rt.engine, req.options, instructions,
                                        AudioStream(file.output, segment_flush=False), rt.executor, pipelined=True,
                                        realtime=req.stream)
            if isinstance(fault, dict) and fault.get("kind") in ("exception", "nan"):  # test hook
                stream.ectx.inject_fault(fault["kind"], int(fault.get("at_frame") or 0))
            stream.add_segments(segments)  # EngineError, e.g. whole-layout text longer than the prompt may be
    except (ProtocolError, EngineError) as exc:
        err = as_protocol_error(exc)
        rt.metrics.errors.inc("http", err.code)
        if stream is not None:
            stream.cancel()
        elif err.code in ("overloaded", "text_too_long"):  # refused before a context opened
            rt.metrics.rejections.inc("http", err.code)
        return error_response(err.code, err.message, err.param)
    context_logger(stream.trace_id).info(
        "speech request: %d characters, %d tokens in %d segment(s), voice %s, %s%s, seed %d", len(req.text), n_tokens,
        len(segments), req.options.voice, req.response_format, " (sse)" if req.stream_format == "sse" else "",
        req.options.sampling.seed)
    return SpeechStream(rt, req, stream, file, n_tokens, t0)


async def _no_receive():
    return {"type": "http.disconnect"}


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SpeechStream(Response):
    """The response body, made as the engine produces audio; the engine context is cancelled if the client
    leaves or anything fails."""

    def __init__(self, rt: Runtime, req: SpeechRequest, stream: ContextStream, file: AudioFile, n_tokens: int,
                 t0: float):
        self.rt, self.req, self.stream, self.file, self.n_tokens, self.t0 = rt, req, stream, file, n_tokens, t0
        self.ectx, self.audio, self.trace_id = stream.ectx, stream.audio, stream.trace_id
        self.log = context_logger(self.trace_id)
        self.first_sent = False
        self.first_audio_phases: dict[str, float] = {}  # server.metrics.FIRST_AUDIO_PHASES, seconds, once sent
        self.started = False  # response headers sent
        self.reason = "cancelled"
        self.segment_cut = False  # a segment ended at max_frames
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        rt = self.rt
        self.scope = scope
        current_trace.set(self.trace_id)
        rt.http_streams += 1
        rt.metrics.active_contexts.inc("http")
        watcher = asyncio.create_task(_wait_disconnect(receive))
        backlog = asyncio.create_task(self._watch_backlog())
        worker = asyncio.create_task(self._run(send))
        drain = asyncio.create_task(rt.drain_expired.wait())
        try:
            done, _ = await asyncio.wait({watcher, backlog, worker, drain}, return_when=asyncio.FIRST_COMPLETED)
            if worker not in done:
                if drain in done and watcher not in done:
                    self.log.warning("drain deadline: cutting this stream after %d frames", self.stream.frames)
                    self.reason = "drained"
                elif backlog in done:
                    self.log.warning("slow reader: over %g s of audio waited to be sent; closing",
                                     rt.limits.max_unsent_audio_s)
                    self.reason = "slow_reader"
                    rt.metrics.slow_readers.inc()
                else:
                    self.log.info("client went away: cancelling")
                    self.reason = "client_gone"
                worker.cancel()
                try:
                    await worker
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
                if self.reason == "drained":
                    await self._end_drained(send)
            else:
                exc = worker.exception()
                if exc is not None and not isinstance(exc, OSError | ConnectionError):
                    self.log.error("speech stream failed: %r", exc)
                    self.reason = "error"
                    if not self.started:
                        await self._send_error(send, "internal", f"synthesis stopped: {exc}")
        finally:
            for task in (watcher, backlog, drain):
                task.cancel()
            if not self.ectx.ended:
                self.ectx.cancel()
            rt.http_streams -= 1
            rt.metrics.active_contexts.dec("http")
            rt.metrics.contexts.inc("http", self.reason)
            self.log.info("speech request ended: %s, %d frames, %.0f ms of audio in %.0f ms%s", self.reason,
                          self.stream.frames, self.audio.encoded_ms, (time.monotonic() - self.t0) * 1000,
                          phases_text(self.first_audio_phases))

    async def _send_error(self, send, code: str, message: str, param: str | None = None) -> None:
        """An error status instead of the audio (nothing of the response has been sent)."""
        self.rt.metrics.errors.inc("http", code)
        await error_response(code, message, param)(self.scope, _no_receive, send)

    async def _refused(self, send, ev: ContextDone) -> None:
        """Admission said no after a pipelined open: the answer a refusal at the door gives (speech(), above)."""
        self.reason = "refused"
        code = ev.error_code if ev.error_code in ERRORS else "internal"  # as as_protocol_error reads an error
        if code in ("overloaded", "text_too_long"):
            self.rt.metrics.rejections.inc("http", code)
        await self._send_error(send, code, ev.error_message or "refused", ev.error_param)

    async def _synthesis_failed(self, send, ev: ContextDone) -> None:
        self.reason = "error"
        code = "internal" if ev.error_code == "internal" else "synthesis_failed"  # as the WebSocket door answers
        await self._send_error(send, code, f"synthesis failed: {ev.error_message or 'model error'}")

    async def _end_drained(self, send) -> None:
        """The drain deadline cut this request: a response not yet begun is a retryable 503; one under way ends
        cleanly (the chunked body is terminated), an SSE one with its done event, reason `drained`."""
        if not self.started:
            return await self._send_error(send, "overloaded", "the server is draining and its deadline passed before "
                                          "this request finished; retry on another server")
        tail = sse_event(self._sse_done()) if self.req.stream_format == "sse" else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _watch_backlog(self) -> None:
        """Returns when audio made for this request waits unsent longer than max_unsent_audio_s: the client
        reads too slowly, and the server never buffers without bound."""
        limit = self.rt.limits.max_unsent_audio_s * SAMPLE_RATE
        while self.ectx.backlog_samples <= limit:
            await asyncio.sleep(BACKLOG_CHECK_S)

    def _sse_done(self) -> dict:
        return {"type": "speech.audio.done",
                "usage": {"input_tokens": self.n_tokens, "output_tokens": self.stream.frames,
                          "total_tokens": self.n_tokens + self.stream.frames},
                "reason": self.reason, "seed": self.req.options.sampling.seed, "frames": self.stream.frames,
                "audio_ms": round(self.audio.encoded_ms, 3), "codes_sha256": self.stream.codes.hexdigest()}

    def _headers(self, content_type: str) -> list[tuple[bytes, bytes]]:
        h = {"content-type": content_type, "cache-control": "no-store", "x-seed": str(self.req.options.sampling.seed),
             "x-trace-id": self.trace_id}
        if self.req.response_format in ("pcm", "wav"):
            h["x-sample-rate"] = "24000"
        return [(k.encode(), v.encode()) for k, v in h.items()]

    async def _events(self):
        """(body bytes, the engine's ContextDone or None) as the stream makes audio."""
        async for ev in self.stream.events(engine_running=self.rt.engine_running):
            if ev.done is not None:
                if ev.done.reason in ("error", "refused"):
                    yield b"", ev.done
                    return
                tail = self.file.body(await self.stream.end_open_segment())
                yield tail + self.file.end(await self.stream.close_audio()), ev.done
                return
            if ev.segment_done is not None and ev.segment_done.reason == "max_frames":
                self.segment_cut = True  # a segment cut short: the response says so even if later ones end
            yield self.file.body(ev.packets), None

    def _finish_reason(self, done: ContextDone | None) -> str:
        reason = done.reason if done is not None else "completed"
        return "max_frames" if reason == "completed" and self.segment_cut else reason

    def _note_audio(self, data: bytes) -> None:
        if data and not self.first_sent:
            self.first_sent = True
            self.first_audio_phases = self.rt.metrics.observe_first_audio(
                "http", self.t0, time.monotonic(), self.stream.first_audio, self.stream.first_packets_at,
                self.stream.text_handed_at)

    async def _start(self, send, content_type: str) -> None:
        if not self.started:
            self.started = True
            await send({"type": "http.response.start", "status": 200, "headers": self._headers(content_type)})

    async def _run(self, send) -> None:
        if not self.req.stream:
            return await self._whole(send)
        sse = self.req.stream_format == "sse"
        content_type = "text/event-stream" if sse else self.file.content_type
        pending = self.file.header()
        done_ev: ContextDone | None = None
        async for data, ev in self._events():
            if ev is not None and ev.reason == "refused":  # always the first event: nothing sent yet
                return await self._refused(send, ev)
            if ev is not None and ev.reason == "error":
                if not self.started:  # nothing sent yet: a proper error status
                    return await self._synthesis_failed(send, ev)
                self.reason = "error"
                self.log.error("synthesis failed mid-stream: %s", ev.error_message)
                err = http_error_body(ev.error_code or "synthesis_failed", "synthesis failed mid-stream")
                tail = sse_event({"type": "error", **err}) if sse else b""
                return await send({"type": "http.response.body", "body": tail, "more_body": False})
            done_ev = ev or done_ev
            data = pending + data
            if data:
                pending = b""
                await self._start(send, content_type)
                self._note_audio(data)
                await send({"type": "http.response.body", "body": sse_audio(data) if sse else data, "more_body": True})
        self.reason = self._finish_reason(done_ev)
        self.rt.metrics.audio_seconds.inc("http", amount=self.audio.encoded_ms / 1000.0)
        await self._start(send, content_type)
        tail = sse_event(self._sse_done()) if sse else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _whole(self, send) -> None:
        head = self.file.header()  # before any audio: Ogg writes its header pages first, once
        parts: list[bytes] = []
        done_ev = None
        async for data, ev in self._events():
            if ev is not None and ev.reason == "refused":
                return await self._refused(send, ev)
            if ev is not None and ev.reason == "error":
                return await self._synthesis_failed(send, ev)
            parts.append(data)
            done_ev = ev or done_ev
        self.reason = self._finish_reason(done_ev)
        body = self.file.whole(head, b"".join(parts))
        self.rt.metrics.audio_seconds.inc("http", amount=self.audio.encoded_ms / 1000.0)
        headers = self._headers(self.file.content_type) + [
            (b"content-length", str(len(body)).encode()), (b"x-codes-sha256", self.stream.codes.hexdigest().encode()),
            (b"x-frames", str(self.stream.frames).encode()), (b"x-audio-ms", f"{self.audio.encoded_ms:.3f}".encode()),
            (b"x-finish-reason", self.reason.encode())]
        if self.req.stream_format == "sse":
            body = sse_audio(body) + sse_event(self._sse_done())
            headers = self._headers("text/event-stream") + [(b"content-length", str(len(body)).encode())]
        self._note_audio(body)
        self.started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def voices(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    if (refused := refusal(request, rt)) is not None:
        return refused
    info = rt.info
    return JSONResponse({"object": "list", "model": info.name, "default_voice": rt.defaults.voice,
                         "voices": [{"name": v.name, "id": v.name, "languages": list(v.languages)}
                                    for v in info.voices],
                         "languages": list(info.languages), "supports_instructions": info.supports_instructions})


async def models(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    if (refused := refusal(request, rt)) is not None:
        return refused
    info = rt.info
    return JSONResponse({"object": "list", "data": [{
        "id": info.name, "object": "model", "created": int(rt.started_at), "owned_by": "voicelane",
        "model_size": info.model_size, "random_weights": info.random_weights, "sample_rate": info.sample_rate,
        "voices": [v.name for v in info.voices], "languages": list(info.languages)}]})
