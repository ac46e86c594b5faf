"""One context from text in to audio packets out, the same for both doors: its text pipeline, its engine context
and its audio stream (trim -> encode).

Text in: `add_text` (WebSocket: pieces as they come) or `add_segments` (HTTP: the whole text, already cut into
segments), then `flush` / `close_input`. Audio out: `events()` turns the engine's events into `StreamEvent`s, the
encoding run on the thread pool; `close_audio()` gives the output's last packets. A door only lays packets out
as its framing and answers its protocol's messages. Before a stream opens, both doors resolve the context's
options (server.options: voice, language, sampling; one Catalog) and its instruction ids (`instruction_ids`) with
the same functions, so a refusal reads the same on both.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine import AudioChunk, ContextDone, ContextSpec, SegmentDone
from server.audio.encoders import AudioPacket
from server.audio.stream import AudioStream
from server.options import ContextOptions
from server.protocol import ProtocolError
from server.text import TextPipeline

if TYPE_CHECKING:
    from engine import Engine, EngineContext, FirstAudioTimes, ModelInfo, TextTokenizer

ENGINE_CHECK_S = 2.0
NO_INSTRUCTIONS = ("instructions are not supported by this model (0.6B); drop 'instructions' or serve the 1.7B "
                   "CustomVoice checkpoint")


def instruction_ids(opts: ContextOptions, tokenizer: TextTokenizer, info: ModelInfo) -> list[int] | None:
    """The ids of the context's `instructions` as the engine takes them ("user\n" + the text), the same for both
    doors; None without instructions. A model that takes none (0.6B) refuses them: invalid_field, `instructions`."""
    if opts.instructions is None:
        return None
    if not info.supports_instructions:
        raise ProtocolError("invalid_field", NO_INSTRUCTIONS, "instructions")
    return tokenizer.encode("user\n" + opts.instructions)


@dataclass(frozen=True, slots=True)
class StreamEvent:
    packets: list[AudioPacket]  # audio to send now, in order (after a segment end: that segment's last)
    segment_done: SegmentDone | None = None  # a segment ended, its audio all in `packets`
    done: ContextDone | None = None  # the engine ended the context; nothing follows


class ContextStream:
    def __init__(self, engine_ctx: EngineContext, audio: AudioStream, executor: Executor | None,
                 text: TextPipeline | None = None, trace_id: str = ""):
        self.ectx, self.audio, self.executor, self.text, self.trace_id = engine_ctx, audio, executor, text, trace_id
        self.frames = 0
        self.codes = hashlib.sha256()
        self.generated_samples = 0  # engine audio received (model rate, untrimmed)
        self.input_closed = False
        self.last_segment = -1  # index of the last segment ended by a flush or the close
        self.final_segment: int | None = None
        self.segments_done = 0  # segments whose audio (and output flush) has been handed out
        self.first_audio: FirstAudioTimes | None = None  # the engine's record of the context's first audio
        self.first_packets_at: float | None = None  # when its first encoded packets were ready (time.monotonic())
        self.text_handed_at: float | None = None  # when its first text ids went to the engine (time.monotonic())

    @classmethod
    def open(cls, engine: Engine, opts: ContextOptions, instruction_ids: list[int] | None, audio: AudioStream,
             executor: Executor | None, tokenizer: TextTokenizer | None = None,
             pipelined: bool = False, realtime: bool = True) -> ContextStream:
        """Admission of a context opened with `opts` (the engine raises InvalidRequest / Overloaded; `pipelined`:
        with the engine in its own process, a refusal comes as the first event instead, ContextDone("refused"));
        with a tokenizer, the stream takes text (add_text), else whole segments of ids (add_segments).
        `realtime`: the client plays the audio as it comes (so the engine may pace it), not a whole file."""
        trace_id = uuid.uuid4().hex
        spec = ContextSpec(voice=opts.voice, language=opts.language, instruction_ids=instruction_ids,
                           text_layout=opts.text_layout, sampling=opts.sampling, trace_id=trace_id,
                           reports_onset=True, realtime=realtime)
        text = TextPipeline(tokenizer, opts.text_normalization) if tokenizer is not None else None
        ectx = engine.open_context_pipelined(spec) if pipelined else engine.open_context(spec)
        return cls(ectx, audio, executor, text, trace_id)

    # ------------------------------------------------------------------ text in
    def add_text(self, text: str) -> None:
        ids = self.text.feed(text)
        if ids:
            self._append(ids)

    def _append(self, ids: list[int]) -> None:
        if self.text_handed_at is None:  # before the call: an engine in this process takes the text inside it
            self.text_handed_at = time.monotonic()
        self.ectx.append_text(ids)

    def _end_segment(self, ids: list[int], words: int, closing: bool) -> None:
        """The segment's last ids to the engine, then its end (`closing`: the end of the input too)."""
        if ids:
            self._append(ids)
        seg = (self.ectx.close if closing else self.ectx.flush)(words)
        if seg is not None:
            self.last_segment = seg
        if closing:
            self.input_closed = True
            self.final_segment = self.last_segment if self.last_segment >= self.segments_done else None

    def flush(self) -> int:
        """Ends the segment; returns the index of the last segment ended so far."""
        self._end_segment(*self.text.finish(closing=False), closing=False)
        return self.last_segment

    def close_input(self) -> None:
        self._end_segment(*self.text.finish(), closing=True)

    def add_segments(self, segments: list[tuple[list[int], int]]) -> None:
        """Whole segments (ids, words); the last one closes the input."""
        for i, (ids, words) in enumerate(segments):
            self._end_segment(ids, words, closing=i == len(segments) - 1)

    # ------------------------------------------------------------------ audio out
    async def _run(self, fn, *args):
        if self.audio.cheap:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _engine_events(self, engine_running: Callable[[], bool] | None):
        """The engine context's events; with `engine_running`, raises if the engine stops while we wait (a dead
        engine never hangs a client). Without, they come straight through: one task less per event."""
        if engine_running is None:
            async for ev in self.ectx.events():
                yield ev
            return
        events = aiter(self.ectx.events())
        while True:
            task = asyncio.ensure_future(anext(events))
            try:
                while not (await asyncio.wait({task}, timeout=ENGINE_CHECK_S))[0]:
                    if not engine_running():
                        raise RuntimeError("the engine stopped")
            finally:
                task.cancel()  # nothing when it is done; when we are cancelled, the wait for the engine ends too
            try:
                yield task.result()
            except StopAsyncIteration:
                return

    async def events(self, engine_running: Callable[[], bool] | None = None) -> AsyncIterator[StreamEvent]:
        async for ev in self._engine_events(engine_running):
            if isinstance(ev, AudioChunk):
                self.generated_samples += len(ev.pcm)
                self.frames += int(ev.codes.shape[0])
                self.codes.update(ev.codes.astype("<i8", copy=False).tobytes())
                self.first_audio = self.first_audio or ev.first_audio
                packets = await self._run(self.audio.process, ev.pcm)
                if packets and self.first_packets_at is None:
                    self.first_packets_at = time.monotonic()
                if self.audio.onset_passed:  # the onset: the segment's first-audio priority ends
                    self.ectx.mark_audible(ev.segment, self.audio.segment_trimmed_s)
                yield StreamEvent(packets)
            elif isinstance(ev, SegmentDone):
                packets = await self._run(self.audio.end_segment)
                self.segments_done = ev.segment + 1
                yield StreamEvent(packets, segment_done=ev)
            elif isinstance(ev, ContextDone):
                yield StreamEvent([], done=ev)
                return

    async def end_open_segment(self) -> list[AudioPacket]:
        return await self._run(self.audio.end_open_segment)

    async def close_audio(self) -> list[AudioPacket]:
        return await self._run(self.audio.close)

    def cancel(self) -> None:
        self.ectx.cancel()
        if self.text is not None:
            self.text.reset()
