"""One object per output stream for the gateway: WebSocket packets (docs/protocol.md 1.3/1.4) and HTTP bodies
(docs/protocol.md 2). Input is always the model's float32 mono audio at 24 kHz, after leading-silence trimming.

All of these are plain synchronous objects, cheap per 80 ms chunk (well under a millisecond except Opus, about
0.2 ms per 20 ms packet): run their calls in a thread pool executor, never on the event loop, and one call at a
time per object, in order (await each call before submitting the next for the same stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .mp3 import Mp3StreamEncoder
from .ogg import OggOpusWriter
from .opus import OpusStreamEncoder
from .pcm import PcmEncoder, float_to_s16le
from .wav import wav_header

MODEL_RATE = 24000


# ------------------------------------------------------------------------------------------------ WebSocket


@dataclass(frozen=True, slots=True)
class WirePacket:
    payload: bytes  # one raw Opus packet, or whole PCM samples
    start_sample: int  # for the frame header: on the stream clock (48 kHz Opus decoder clock, else PCM rate)
    samples: int  # duration on the stream clock


class WsAudioEncoder:
    """encode(x) -> packets ready now; flush() -> the rest at a segment end (the stream goes on; Opus pads under
    9 ms of silence, PCM resampling emits its few-ms tail); close() -> the rest at the context end.

    clock_rate: 48000 for Opus, else the PCM rate. pre_skip: Opus pre-skip (48 kHz), 0 for PCM.
    audio_end_ms: the listener-timeline end (ms) of all audio flushed so far (for `flushed.audio_end_ms`);
    it counts the silence flushes inserted, since the listener hears it.
    """

    def __init__(
        self,
        encoding: str = "pcm_s16le",
        sample_rate: int = MODEL_RATE,
        *,
        bitrate: int = 32000,
        opus_complexity: int = 10,
    ) -> None:
        self.encoding = encoding
        if encoding == "opus":
            self._opus: OpusStreamEncoder | None = OpusStreamEncoder(
                MODEL_RATE, bitrate=bitrate, complexity=opus_complexity
            )
            self._pcm: PcmEncoder | None = None
            self.clock_rate = 48000
            self.pre_skip = self._opus.pre_skip
        else:
            self._opus = None
            self._pcm = PcmEncoder(encoding, sample_rate, input_rate=MODEL_RATE)
            self.clock_rate = sample_rate
            self.pre_skip = 0
        self._closed = False

    def _opus_packets(self, packets) -> list[WirePacket]:
        return [WirePacket(p.data, p.start_sample, p.samples) for p in packets]

    def _pcm_packet(self, data: bytes, start: int) -> list[WirePacket]:
        if not data:
            return []
        assert self._pcm is not None
        return [WirePacket(data, start, len(data) // self._pcm.bytes_per_sample)]

    def encode(self, x: np.ndarray) -> list[WirePacket]:
        if self._closed:
            raise RuntimeError("encode() after close()")
        if self._opus is not None:
            return self._opus_packets(self._opus.encode(x))
        assert self._pcm is not None
        start = self._pcm.samples_out
        return self._pcm_packet(self._pcm.encode(x), start)

    def flush(self) -> list[WirePacket]:
        if self._closed:
            raise RuntimeError("flush() after close()")
        if self._opus is not None:
            return self._opus_packets(self._opus.flush())
        assert self._pcm is not None
        start = self._pcm.samples_out
        return self._pcm_packet(self._pcm.finish(), start)

    def close(self) -> list[WirePacket]:
        packets = [] if self._closed else self.flush()
        self._closed = True
        return packets

    @property
    def audio_end_ms(self) -> float:
        if self._opus is not None:
            return max(0, self._opus.audio_end - self.pre_skip) / 48.0
        assert self._pcm is not None
        return self._pcm.samples_out * 1000.0 / self.clock_rate


# ----------------------------------------------------------------------------------------------------- HTTP

HTTP_FORMATS = ("mp3", "opus", "wav", "pcm")
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "wav": "audio/wav", "pcm": "audio/pcm"}


class HttpAudioEncoder:
    """An HTTP response body in one format: header() once first (b"" for pcm and mp3), then encode(x) per chunk,
    then finish() once. Each returns bytes to send (possibly empty)."""

    content_type = "application/octet-stream"

    def header(self) -> bytes:
        return b""

    def encode(self, x: np.ndarray) -> bytes:
        raise NotImplementedError

    def finish(self) -> bytes:
        return b""


class PcmHttpEncoder(HttpAudioEncoder):
    """Raw s16le 24 kHz mono (`audio/pcm`, header `x-sample-rate: 24000`)."""

    content_type = "audio/pcm"

    def encode(self, x: np.ndarray) -> bytes:
        return float_to_s16le(x)


class WavHttpEncoder(PcmHttpEncoder):
    """Streaming WAV: a 44-byte header with RIFF and data sizes 0xFFFFFFFF, then s16le PCM."""

    content_type = "audio/wav"

    def __init__(self, sample_rate: int = MODEL_RATE) -> None:
        self.sample_rate = sample_rate

    def header(self) -> bytes:
        return wav_header(self.sample_rate)


class OggOpusHttpEncoder(HttpAudioEncoder):
    """Ogg Opus: the two header pages, then one page per encode() call that completed packets; finish() writes
    the last packets on the EOS page with the end-trimmed granule position."""

    content_type = "audio/ogg"

    def __init__(self, bitrate: int = 32000, *, complexity: int = 10, serial: int | None = None) -> None:
        self.encoder = OpusStreamEncoder(MODEL_RATE, bitrate=bitrate, complexity=complexity)
        self.writer = OggOpusWriter(self.encoder.pre_skip, input_sample_rate=MODEL_RATE, serial=serial)

    def header(self) -> bytes:
        return self.writer.headers()

    def encode(self, x: np.ndarray) -> bytes:
        packets = self.encoder.encode(x)
        return self.writer.write([p.data for p in packets]) if packets else b""

    def finish(self) -> bytes:
        packets = self.encoder.finish()
        return self.writer.write([p.data for p in packets], last=True, end_granule=self.encoder.audio_end)


class Mp3HttpEncoder(HttpAudioEncoder):
    content_type = "audio/mpeg"

    def __init__(self, bitrate_kbps: int = 64) -> None:
        self.encoder = Mp3StreamEncoder(MODEL_RATE, bitrate_kbps=bitrate_kbps)

    def encode(self, x: np.ndarray) -> bytes:
        return self.encoder.encode(x)

    def finish(self) -> bytes:
        return self.encoder.finish()


def make_http_encoder(
    response_format: str, *, opus_bitrate: int = 32000, mp3_bitrate_kbps: int = 64
) -> HttpAudioEncoder:
    """`response_format` is one of HTTP_FORMATS; ValueError otherwise. Raises OpusUnavailableError or
    Mp3UnavailableError (RuntimeError) when the codec library is missing."""
    if response_format == "pcm":
        return PcmHttpEncoder()
    if response_format == "wav":
        return WavHttpEncoder()
    if response_format == "opus":
        return OggOpusHttpEncoder(opus_bitrate)
    if response_format == "mp3":
        return Mp3HttpEncoder(mp3_bitrate_kbps)
    raise ValueError(f"unknown response_format {response_format!r}; expected one of {HTTP_FORMATS}")
