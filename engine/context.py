"""The server's handle on one open context, for an engine in this process (engine/engine.py) or in a process of its
own (engine/remote.py). No torch here: with the engine in its own process the server never imports it.

A context talks to its engine through two calls: `submit(op, cid, *args)`, a scheduler operation by name (one of
OPS), and `inject_fault(cid, kind, at_frame)`. Events come back on the event loop through `_push`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Protocol

from engine.api import ContextClosed, ContextSpec, InvalidRequest
from engine.config import EngineConfig
from engine.types import AudioChunk, ContextDone, EngineEvent

PLAYBACK_STATES = ("buffering", "playing", "underrun", "finished")
# the scheduler operations a context may ask for (Engine.submit maps each onto the scheduler)
OPS = ("append_text", "end_segment", "close", "cancel", "playback", "mark_audible")


class ContextHost(Protocol):
    """What a context needs of its engine."""

    config: EngineConfig

    def submit(self, op: str, cid: int, *args) -> None: ...

    def inject_fault(self, cid: int, kind: str, at_frame: int) -> None: ...


class EngineContext:
    """One open context (one stream of speech), made by the engine's open_context on the event loop."""

    def __init__(self, engine: ContextHost, cid: int, spec: ContextSpec, loop: asyncio.AbstractEventLoop | None):
        """`loop`: where its events are read (None for the engine process's own record of a context)."""
        self.engine, self.cid, self.spec = engine, cid, spec
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._loop = loop
        self.closed = False  # no more text
        self.ended = False  # ContextDone was delivered
        self.backlog_samples = 0  # audio delivered to the queue but not yet read by events(): a slow reader's debt
        self.segment_tokens = 0  # text tokens of the open segment
        self.segments_ended = 0  # segments with text ended so far: the next one's index, as the scheduler numbers
        self.audible_segment = -1  # the last segment reported audible (one scheduler call per segment)
        # prompt positions besides the text (engine/model/prompt.py): the wrapped instruction, the role (3), the
        # codec tags with the speaker (at most 6), then tts_eos and the codec_bos position (2)
        instruction = len(spec.instruction_ids) + 3 if spec.instruction_ids else 0
        self.prompt_overhead = instruction + 3 + 6 + 2

    @property
    def seed(self) -> int:
        return self.spec.sampling.seed

    def _op(self, op: str, *args) -> None:
        if self.ended:
            raise ContextClosed("the context has ended")
        self.engine.submit(op, self.cid, *args)

    def append_text(self, ids: list[int]) -> None:
        if self.closed:
            raise ContextClosed("text after context.close")
        if not ids:
            return
        if self.spec.text_layout == "whole":  # the whole segment goes into the prompt: refuse what cannot fit
            limit = self.engine.config.max_prompt_tokens - self.prompt_overhead
            if self.segment_tokens + len(ids) > limit:
                raise InvalidRequest("text_too_long", f"a whole-text segment may hold {limit} tokens (this one would "
                                     f"reach {self.segment_tokens + len(ids)}); flush earlier, use text_layout "
                                     "'dual', or raise --max-prompt-tokens", "text")
        self._op("append_text", list(ids))
        self.segment_tokens += len(ids)

    def _end_segment(self, op: str, words: int | None) -> int | None:
        # Numbered here rather than asked of the scheduler, so that an engine in another process needs no round
        # trip: the scheduler numbers the segments that have text, in order, and drops an empty one.
        self._op(op, words)
        if not self.segment_tokens:
            return None
        self.segment_tokens = 0
        self.segments_ended += 1
        return self.segments_ended - 1

    def flush(self, words: int | None = None) -> int | None:
        """End the current segment. Returns its index, or None if there was no text since the last flush."""
        if self.closed:
            raise ContextClosed("flush after context.close")
        return self._end_segment("end_segment", words)

    def close(self, words: int | None = None) -> int | None:
        if self.closed:
            raise ContextClosed("context.close twice")
        self.closed = True
        return self._end_segment("close", words)

    def cancel(self) -> None:
        if not self.ended:
            self.engine.submit("cancel", self.cid)

    def report_playback(self, played_ms: float, state: str, buffered_ms: float | None = None) -> None:
        """Where the listener is: played_ms on the context timeline, the player's state and, if the client knows
        it, how much audio its buffer holds (more exact than delivered - played, which counts audio in flight)."""
        if state not in PLAYBACK_STATES:
            raise InvalidRequest("invalid_field", f"state {state!r}; one of {PLAYBACK_STATES}", "state")
        if not self.ended:
            buffered = None if buffered_ms is None else float(buffered_ms)
            self.engine.submit("playback", self.cid, float(played_ms), state, buffered)

    def mark_audible(self, segment: int, trimmed_s: float = 0.0) -> None:
        """The consumer's leading-silence trimmer found this segment's audible onset after dropping `trimmed_s` of
        its audio: the segment leaves the first-audio class (spec.reports_onset), and the engine's playback clock
        counts that silence as never played. Cheap to call for every chunk after the onset."""
        if segment > self.audible_segment and not self.ended:
            self.audible_segment = segment
            self.engine.submit("mark_audible", self.cid, segment, float(trimmed_s))

    def inject_fault(self, kind: str, at_frame: int = 0) -> None:
        """Test hook: make this context's model step fail ("exception") or produce NaN logits ("nan")."""
        self.engine.inject_fault(self.cid, kind, at_frame)

    async def events(self) -> AsyncIterator[EngineEvent]:
        while True:
            event = await self._queue.get()
            if isinstance(event, AudioChunk):
                self.backlog_samples -= len(event.pcm)
            yield event
            if isinstance(event, ContextDone):
                return

    def hand_over(self, events: list[EngineEvent], handed: float) -> None:
        """From any thread: queue events on the context's event loop."""
        self._loop.call_soon_threadsafe(self._push, events, handed)

    def _push(self, events: list[EngineEvent], handed: float | None = None) -> None:
        """On the event loop: queue events the engine handed over at `handed` (time.monotonic(), which every
        process on the machine shares)."""
        received = time.monotonic()
        for e in events:
            if isinstance(e, AudioChunk):
                self.backlog_samples += len(e.pcm)
                if e.first_audio is not None:  # a segment's first audio: its trip to the loop is part of its TTFA
                    e = replace(e, first_audio=replace(e.first_audio, handed=handed, received=received))
            self._queue.put_nowait(e)
