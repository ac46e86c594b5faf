"""Per-context audio stages: leading-silence trimming per segment, then one encoder for the whole context.

`WsAudioStream` (WebSocket packets) and `HttpAudioStream` (HTTP body bytes) follow the same segment life cycle
(docs/protocol.md 1.7): `process(pcm)` for every engine chunk, `end_segment()` when the engine says a segment is done
(trimmer.finish() -> encode -> encoder flush, then the trimmer is reset for the next segment), `close()` at the
end of the context. All methods are synchronous and cheap: the gateway runs them in a thread pool executor, one
call at a time per object, in order.

The listener timeline (what `start_sample`, `flushed.audio_end_ms` and `context.done.audio_ms` count) is the
encoder's: trimmed samples never reach it (docs/protocol.md 1.7: `start_sample` counts from the first sample kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .formats import MODEL_RATE, OggOpusHttpEncoder, WsAudioEncoder, make_http_encoder
from .trim import LeadingSilenceTrimmer


@dataclass(frozen=True, slots=True)
class StreamPacket:
    payload: bytes
    start_sample: int  # stream clock (48 kHz for Opus, else the PCM rate)
    samples: int  # duration on the stream clock
    segment_start: bool  # first packet of a segment


class WsAudioStream:
    def __init__(self, encoding: str = "pcm_s16le", sample_rate: int = MODEL_RATE, *, bitrate: int = 32000,
                 opus_complexity: int = 10, preroll_ms: float = 20.0):
        self.encoder = WsAudioEncoder(encoding, sample_rate, bitrate=bitrate, opus_complexity=opus_complexity)
        self.trimmer = LeadingSilenceTrimmer(MODEL_RATE, preroll_ms=preroll_ms)
        self.clock_rate = self.encoder.clock_rate
        self.pre_skip = self.encoder.pre_skip
        self.trimmed_samples = 0  # model-rate samples dropped as leading silence, all segments
        self.kept_samples = 0  # model-rate samples handed to the encoder
        self._padding_ms = 0.0  # silence the encoder's segment flushes added to the listener timeline
        self._segment_start = True
        self._closed = False

    def _packets(self, wire) -> list[StreamPacket]:
        out = []
        for p in wire:
            out.append(StreamPacket(p.payload, p.start_sample, p.samples, self._segment_start))
            self._segment_start = False
        return out

    def process(self, pcm: np.ndarray) -> list[StreamPacket]:
        kept = self.trimmer.process(pcm)
        if not len(kept):
            return []
        self.kept_samples += len(kept)
        return self._packets(self.encoder.encode(kept))

    def end_segment(self) -> list[StreamPacket]:
        tail = self.trimmer.finish()
        self.trimmed_samples += self.trimmer.dropped
        packets = []
        if len(tail):
            self.kept_samples += len(tail)
            packets = self._packets(self.encoder.encode(tail))
        packets += self._packets(self.encoder.flush())
        self.trimmer.reset()
        self._segment_start = True
        self._padding_ms = max(0.0, self.encoder.audio_end_ms - self.encoded_ms)
        return packets

    def close(self) -> list[StreamPacket]:
        """The end of the context: whatever the trimmer and the encoder still hold (a segment left open by a
        timeout or an error is ended here)."""
        if self._closed:
            return []
        packets = self.end_segment() if self.trimmer.received else []
        packets += self._packets(self.encoder.close())
        self._closed = True
        return packets

    @property
    def audio_end_ms(self) -> float:
        """End of the audio produced so far on the listener timeline (flush padding included)."""
        return self.encoder.audio_end_ms

    @property
    def encoded_ms(self) -> float:
        """Model-rate audio handed to the encoder so far (ms)."""
        return self.kept_samples * 1000.0 / MODEL_RATE

    @property
    def engine_offset_ms(self) -> float:
        """Engine timeline minus listener timeline at the stream's current end: the engine's timeline holds the
        trimmed silence, the listener's holds the flush padding."""
        trimmed = self.trimmed_samples + self.trimmer.dropped
        return trimmed * 1000.0 / MODEL_RATE - self._padding_ms


class HttpAudioStream:
    """An HTTP body: header() first, then process/end_segment per engine event, then finish()."""

    def __init__(self, response_format: str, *, opus_complexity: int = 10, preroll_ms: float = 20.0):
        if response_format == "opus":
            self.encoder = OggOpusHttpEncoder(complexity=opus_complexity)
        else:
            self.encoder = make_http_encoder(response_format)
        self.content_type = self.encoder.content_type
        self.trimmer = LeadingSilenceTrimmer(MODEL_RATE, preroll_ms=preroll_ms)
        self.trimmed_samples = 0
        self.kept_samples = 0

    def header(self) -> bytes:
        return self.encoder.header()

    def process(self, pcm: np.ndarray) -> bytes:
        kept = self.trimmer.process(pcm)
        if not len(kept):
            return b""
        self.kept_samples += len(kept)
        return self.encoder.encode(kept)

    def end_segment(self) -> bytes:
        tail = self.trimmer.finish()
        self.trimmed_samples += self.trimmer.dropped
        self.trimmer.reset()
        if not len(tail):
            return b""
        self.kept_samples += len(tail)
        return self.encoder.encode(tail)

    def finish(self) -> bytes:
        out = self.end_segment() if self.trimmer.received else b""
        return out + self.encoder.finish()

    @property
    def audio_ms(self) -> float:
        return self.kept_samples * 1000.0 / MODEL_RATE
