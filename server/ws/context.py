"""One context of a WebSocket session: its stream (server.stream.ContextStream) and the pump task that lays the
stream's packets out as binary frames or JSON `audio` messages, answers `flush` with `flushed`, and sends the
context's single end message. All it holds of its session is the outbox (server.ws.outbox.Outbox).

Per context the order is `context.created` < audio < `flushed`* < one of `context.done` / `context.cancelled`
(docs/protocol.md 1.2): everything goes through the session's one FIFO, the pump handles engine events in order,
and a cancelled context's unsent audio is purged before `context.cancelled` is queued.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from engine import ContextDone
from server.audio.encoders import MODEL_RATE, AudioPacket
from server.logs import context_logger, current_trace
from server.options import ContextOptions
from server.protocol import with_ids, ws_error
from server.stream import ContextStream
from server.ws.outbox import Outbox, OutItem, dumps
from voicelane_wire import pack_frame

if TYPE_CHECKING:
    from server.metrics import ServerMetrics


class WsContext:
    """One context's WebSocket side: its framing, flush replies, playback reports and end; the stream does the rest."""

    def __init__(self, out: Outbox, metrics: ServerMetrics, context_id: str, options: ContextOptions,
                 stream: ContextStream, stream_id: int):
        self.out, self.metrics, self.id, self.opts, self.stream = out, metrics, context_id, options, stream
        self.stream_id = stream_id
        self.ectx, self.audio, self.trace_id = stream.ectx, stream.audio, stream.trace_id
        self.log = context_logger(self.trace_id)
        self.created_at = time.monotonic()
        self.json_audio = options.audio_transport == "json"
        self.close_event_id: Any = None  # event_id of the context.close (echoed on context.done)
        self.ended = False  # done, cancelled or timed out: no more messages for it after its end message
        self.cancelled = False
        self.timeout_requested = False
        self.fault: str | None = None  # test hook "internal": the pump raises
        self.text_chars = 0
        self.first_text_at: float | None = None
        self.first_audio_sent_at: float | None = None
        self.ttfa_s: float | None = None  # first text (or the context's creation) to its first audio sent
        self.first_audio_phases: dict[str, float] = {}  # server.metrics.FIRST_AUDIO_PHASES, seconds, once sent
        self.last_activity = time.monotonic()
        # audio accounting
        self.seq = 0
        self.next_start = 0  # stream clock: where the next packet starts
        self.last_sent = False  # a packet with the `last` flag went out
        self.sent_end_ms = 0.0  # listener timeline end of the audio written to the socket
        self.played_ms: float | None = None  # the client's last playback report
        self.playback_state: str | None = None
        # flushes
        self.flush_count = 0
        self.segment_end_ms: dict[int, float] = {}
        self.flushes: deque[tuple[int, Any, Any]] = deque()  # (segment waited for, flush_id, event_id)
        self.task: asyncio.Task | None = None

    # ------------------------------------------------------------------ text side (receive task)
    def add_text(self, text: str) -> None:
        if text and self.first_text_at is None:
            self.first_text_at = time.monotonic()
        self.text_chars += len(text)
        self.last_activity = time.monotonic()
        self.stream.add_text(text)

    def flush(self, flush_id: Any, event_id: Any) -> None:
        seg = self.stream.flush()
        self.flush_count += 1
        self.flushes.append((seg, flush_id if flush_id is not None else self.flush_count, event_id))
        self.last_activity = time.monotonic()
        self.release_flushes()

    def release_flushes(self) -> None:
        while self.flushes and self.flushes[0][0] < self.stream.segments_done:
            seg, fid, eid = self.flushes.popleft()
            msg = {"type": "flushed", "context_id": self.id, "flush_id": fid,
                   "audio_end_ms": round(self.segment_end_ms.get(seg, 0.0), 3)}
            self.out.put(OutItem(dumps(with_ids(msg, event_id=eid)), owner=self, purgeable=True))

    def report_playback(self, played_ms: float, state: str, buffered_ms: float | None = None) -> None:
        """The client's listener timeline -> the engine's context timeline (which counts trimmed silence and not
        Opus flush padding): shift by their current difference."""
        if state == "underrun" and self.playback_state != "underrun":
            self.metrics.underruns.inc()
        self.playback_state = state
        self.played_ms = played_ms
        self.ectx.report_playback(max(0.0, played_ms + self.audio.engine_offset_ms), state, buffered_ms)

    # ------------------------------------------------------------------ pump (stream events -> socket)
    async def pump(self) -> None:
        current_trace.set(self.trace_id)
        try:
            async for ev in self.stream.events():
                if self.cancelled:
                    return
                if self.fault == "internal":
                    raise RuntimeError("injected server fault (test hook)")
                if ev.done is not None:
                    if ev.done.reason == "cancelled" and not self.timeout_requested:
                        return  # cancelled by the session: it has answered already
                    await self._finish(ev.done)
                    return
                self.last_activity = time.monotonic()
                if ev.segment_done is None:
                    self._send_packets(ev.packets)
                    continue
                seg = ev.segment_done.segment
                packets = ev.packets
                final = self.stream.input_closed and self.stream.final_segment == seg
                if final:
                    packets = packets + await self.stream.close_audio()
                    if self.cancelled:
                        return
                self._send_packets(packets, last=final)
                self.segment_end_ms[seg] = self.audio.audio_end_ms
                self.release_flushes()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a server fault ends this context only
            self.log.exception("context %s failed in the server", self.id)
            self.fail(f"server error while streaming this context: {type(exc).__name__}")

    def fail(self, message: str) -> None:
        """A server fault in this context: stop its engine work, answer `internal` and end it with reason error;
        the session and its other contexts go on."""
        if self.ended:
            return
        self._stop()
        self.out.send(ws_error("internal", message, context_id=self.id))
        self.end("error")

    def _send_packets(self, packets: list[AudioPacket], last: bool = False) -> None:
        if not packets and last and self.seq > 0 and not self.last_sent:
            packets = [AudioPacket(b"", self.next_start, 0)]
        for i, p in enumerate(packets):
            is_last = last and i == len(packets) - 1
            first = self.seq == 0
            if self.json_audio:
                msg = {"type": "audio", "context_id": self.id, "seq": self.seq,
                       "start_ms": round(p.start_sample * 1000.0 / self.audio.clock_rate, 3), "first": first,
                       "last": is_last, "segment_start": p.segment_start,
                       "data": base64.b64encode(p.payload).decode("ascii")}
                data: bytes | str = dumps(msg)
            else:
                data = pack_frame(self.stream_id, self.seq, p.start_sample, p.payload, first=first, last=is_last,
                                  segment_start=p.segment_start)
            end_ms = max(0.0, (p.start_sample + p.samples - self.audio.pre_skip) * 1000.0 / self.audio.clock_rate)
            audio_s = p.samples / self.audio.clock_rate
            self.out.put(OutItem(data, owner=self, audio_s=audio_s, purgeable=True,
                                 on_sent=lambda e=end_ms, s=audio_s: self._on_audio_sent(e, s)))
            self.seq += 1
            self.next_start = p.start_sample + p.samples
            if is_last:
                self.last_sent = True
        self.out.check_unsent()

    def _on_audio_sent(self, end_ms: float, audio_s: float) -> None:
        self.sent_end_ms = max(self.sent_end_ms, end_ms)
        self.metrics.audio_seconds.inc("ws", amount=audio_s)
        if self.first_audio_sent_at is None and audio_s > 0:
            self.first_audio_sent_at = time.monotonic()
            self.ttfa_s = self.first_audio_sent_at - (self.first_text_at or self.created_at)
            self.first_audio_phases = self.metrics.observe_first_audio(
                "ws", self.first_text_at or self.created_at, self.first_audio_sent_at, self.stream.first_audio,
                self.stream.first_packets_at, self.stream.text_handed_at)

    async def _finish(self, ev: ContextDone) -> None:
        """The engine ended the context (completed, max_frames, error) or the session timed it out."""
        reason = "timeout" if self.timeout_requested else ev.reason
        if reason == "error":
            code = "internal" if ev.error_code == "internal" else "synthesis_failed"  # as the HTTP door answers
            self.out.send(ws_error(code, f"synthesis failed: {ev.error_message or 'model error'}", context_id=self.id))
        if not self.last_sent:
            packets = await self.stream.close_audio()
            if self.cancelled:
                return
            self._send_packets(packets, last=True)
        self.end(reason)

    def end(self, reason: str) -> None:
        """Queue the context's end message, `context.done` with `reason` (once)."""
        if self.ended:
            return
        self.ended = True
        self.flushes.clear()

        def render() -> str:
            ttfa = None if self.ttfa_s is None else round(self.ttfa_s * 1000.0, 3)
            msg = {"type": "context.done", "context_id": self.id, "reason": reason,
                   "audio_ms": round(self.audio.audio_end_ms, 3), "ttfa_ms": ttfa,
                   # extensions (not in docs/protocol.md; clients ignore unknown fields)
                   "frames": self.stream.frames,
                   "trimmed_ms": round(self.audio.trimmed_samples * 1000.0 / MODEL_RATE, 3),
                   "codes_sha256": self.stream.codes.hexdigest()}
            return dumps(with_ids(msg, event_id=self.close_event_id))

        self.out.put(OutItem(render=render, owner=self))
        self.out.context_ended(self, reason)

    def cancel(self, played_ms: float | None, event_id: Any) -> None:
        """Barge-in: stop now, drop queued text and unsent audio, answer context.cancelled."""
        self.abandon()
        self.out.purge(self)
        self.flushes.clear()
        if played_ms is None:
            played_ms = self.played_ms
        if played_ms is None:  # no report: assume 1x playback since the first packet went out
            played_ms = 0.0
            if self.first_audio_sent_at is not None:
                played_ms = min(self.sent_end_ms, (time.monotonic() - self.first_audio_sent_at) * 1000.0)
        msg = {"type": "context.cancelled", "context_id": self.id,
               "generated_ms": round(self.stream.generated_samples * 1000.0 / MODEL_RATE, 3),
               "sent_ms": round(self.sent_end_ms, 3), "played_ms": round(played_ms, 3)}
        self.out.put(OutItem(dumps(with_ids(msg, event_id=event_id)), owner=self))
        self.out.context_ended(self, "cancelled")

    def abandon(self) -> None:
        """The session is going away: stop the engine work, send nothing."""
        self.cancelled = self.ended = True
        self._stop()

    def _stop(self) -> None:
        """The engine work and the pump stop (the pump may be the caller: it returns by itself)."""
        self.stream.cancel()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
