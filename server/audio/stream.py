"""The audio stages of one context: leading-silence trimming per segment, then one output for the whole context.

The segment life cycle (docs/protocol.md 1.7): `process(pcm)` for every engine chunk, `end_segment()` when the
engine says a segment is done (the trimmer's tail is encoded, the trimmer reset for the next segment and, with
`segment_flush`, the output flushed so everything so far is decodable: the WebSocket's `flushed` promises that; a
file has no use for the padding), `close()` at the end of the context. All methods are synchronous and cheap: run
them in a thread pool executor, one call at a time per object, in order (or inline where `cheap`: see
server/audio/encoders.py).

The listener timeline (what `start_sample`, `flushed.audio_end_ms` and `context.done.audio_ms` count) is the
output's: trimmed samples never reach it (docs/protocol.md 1.7: `start_sample` counts from the first sample kept).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .encoders import MODEL_RATE, AudioOutput, AudioPacket
from .trim import LeadingSilenceTrimmer


class AudioStream:
    def __init__(self, output: AudioOutput, *, segment_flush: bool, preroll_ms: float = 20.0):
        self.output = output
        self.segment_flush = segment_flush
        self.trimmer = LeadingSilenceTrimmer(MODEL_RATE, preroll_ms=preroll_ms)
        self.clock_rate = output.clock_rate
        self.pre_skip = output.pre_skip
        self.trimmed_samples = 0  # model-rate samples dropped as leading silence, all segments
        self.kept_samples = 0  # model-rate samples handed to the output
        self._padding_ms = 0.0  # silence the output's segment flushes added to the listener timeline
        self._segment_start = True
        self._closed = False
        self.cheap = output.cheap  # trimming (a few numpy passes) and a cast: cheaper inline than on a thread

    def _mark(self, packets: list[AudioPacket]) -> list[AudioPacket]:
        if packets and self._segment_start:
            packets[0] = dataclasses.replace(packets[0], segment_start=True)
            self._segment_start = False
        return packets

    def _encode(self, kept: np.ndarray) -> list[AudioPacket]:
        if not len(kept):
            return []
        self.kept_samples += len(kept)
        return self._mark(self.output.encode(kept))

    def process(self, pcm: np.ndarray) -> list[AudioPacket]:
        return self._encode(self.trimmer.process(pcm))

    @property
    def segment_trimmed_s(self) -> float:
        """Leading silence of the current segment dropped so far (seconds): all of it, once the onset has passed."""
        return self.trimmer.dropped / MODEL_RATE

    @property
    def onset_passed(self) -> bool:
        """The segment's audio has begun (its leading silence is over)."""
        return self.trimmer.passing

    def end_segment(self) -> list[AudioPacket]:
        tail = self.trimmer.finish()
        self.trimmed_samples += self.trimmer.dropped
        packets = self._encode(tail)
        self.trimmer.reset()
        if self.segment_flush:
            packets += self._mark(self.output.flush())
            self._padding_ms = max(0.0, self.output.audio_end_ms - self.encoded_ms)
        self._segment_start = True
        return packets

    def end_open_segment(self) -> list[AudioPacket]:
        """end_segment() for a segment the engine did not end (a timeout or an error); nothing otherwise."""
        return self.end_segment() if self.trimmer.received else []

    def close(self) -> list[AudioPacket]:
        """The end of the context: whatever the trimmer and the output still hold."""
        if self._closed:
            return []
        packets = self.end_open_segment() + self._mark(self.output.close())
        self._closed = True
        return packets

    @property
    def audio_end_ms(self) -> float:
        """End of the audio produced so far on the listener timeline (flush padding included)."""
        return self.output.audio_end_ms

    @property
    def encoded_ms(self) -> float:
        """Model-rate audio handed to the output so far (ms)."""
        return self.kept_samples * 1000.0 / MODEL_RATE

    @property
    def engine_offset_ms(self) -> float:
        """Engine timeline minus listener timeline at the stream's current end: the engine's timeline holds the
        trimmed silence, the listener's holds the flush padding."""
        trimmed = self.trimmed_samples + self.trimmer.dropped
        return trimmed * 1000.0 / MODEL_RATE - self._padding_ms
