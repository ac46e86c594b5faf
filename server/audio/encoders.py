"""One output type per encoding: the model's trimmed float32 mono 24 kHz audio in, `AudioPacket`s out, for both
doors. The doors lay the packets out as their framing: binary frames or JSON messages on the WebSocket, raw,
WAV or Ogg bytes on HTTP (server.audio.containers).

Every output: encode(x) -> the packets ready now; flush() -> the rest at a segment end, the stream going on (Opus
pads under 9 ms of silence so every sample fed is decodable, PCM resampling emits its few-ms tail); close() -> the
rest at the context end, after which encode() raises. `clock_rate` is the clock of `start_sample` (the 48 kHz
decoder clock for Opus, else the output rate); `pre_skip` the Opus decoder's skip (0 otherwise); `audio_end_ms`
the listener-timeline end of the audio flushed so far, counting the silence flushes inserted, since it is heard.

These are plain synchronous objects, cheap per 80 ms chunk (well under a millisecond except Opus, about 0.2 ms
per 20 ms packet): run their calls in a thread pool executor, one call at a time per object, in order, except
where `cheap` says the call is a cast (PCM at the model's rate): that costs less on the event loop than the two
thread hops, each of which can wait for the GIL under load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .opus import OpusStreamEncoder
from .pcm import PCM_CONVERSIONS, Resampler, float_to_s16le

MODEL_RATE = 24000


@dataclass(frozen=True, slots=True)
class AudioPacket:
    payload: bytes  # one raw Opus packet, whole PCM samples, or MP3 bytes
    start_sample: int  # on the output's clock_rate
    samples: int  # duration on the output's clock_rate
    segment_start: bool = False  # the first packet of a segment (the stream sets it, the encoders cannot know)


class _Closable:
    _closed = False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}() after close()")

    def close(self) -> list[AudioPacket]:
        packets = [] if self._closed else self.flush()  # type: ignore[attr-defined]
        self._closed = True
        return packets


class PcmOutput(_Closable):
    """s16le, f32le or mu-law at any rate (docs/protocol.md 1.4); the HTTP `pcm` and `wav` bodies are s16le at
    24 kHz. With resampling the output lags the input by the resampler's lookahead (under 4 ms): flush() emits
    that tail and resets the resampler for the next segment (segments are separate generations, their audio is
    not continuous anyway). `samples_out` counts the samples emitted since creation, on the output clock."""

    pre_skip = 0

    def __init__(self, encoding: str = "pcm_s16le", sample_rate: int = MODEL_RATE) -> None:
        if encoding not in PCM_CONVERSIONS:
            raise ValueError(f"unknown PCM encoding {encoding!r}; expected one of {tuple(PCM_CONVERSIONS)}")
        self._convert = PCM_CONVERSIONS[encoding]
        self._resampler = Resampler(MODEL_RATE, sample_rate)
        self.clock_rate = sample_rate
        self.cheap = self._resampler.identity  # no resampling: a cast of the samples
        self.samples_out = 0

    def _packets(self, y: np.ndarray) -> list[AudioPacket]:
        start = self.samples_out
        self.samples_out += len(y)
        return [AudioPacket(self._convert(y), start, len(y))] if len(y) else []

    def encode(self, x: np.ndarray) -> list[AudioPacket]:
        self._check_open("encode")
        return self._packets(self._resampler.process(x))

    def flush(self) -> list[AudioPacket]:
        self._check_open("flush")
        return self._packets(self._resampler.finish())

    @property
    def audio_end_ms(self) -> float:
        return self.samples_out * 1000.0 / self.clock_rate


class OpusOutput(_Closable):
    """Raw 20 ms Opus packets; `end_sample` is the decoder-clock position just after the last real sample flushed
    (an Ogg file's final granule)."""

    clock_rate = 48000
    cheap = False

    def __init__(self, bitrate: int = 32000, *, complexity: int = 10) -> None:
        self._opus = OpusStreamEncoder(MODEL_RATE, bitrate=bitrate, complexity=complexity)
        self.pre_skip = self._opus.pre_skip

    @staticmethod
    def _packets(packets) -> list[AudioPacket]:
        return [AudioPacket(p.data, p.start_sample, p.samples) for p in packets]

    def encode(self, x: np.ndarray) -> list[AudioPacket]:
        self._check_open("encode")
        return self._packets(self._opus.encode(x))

    def flush(self) -> list[AudioPacket]:
        self._check_open("flush")
        return self._packets(self._opus.flush())

    @property
    def end_sample(self) -> int:
        return self._opus.audio_end

    @property
    def audio_end_ms(self) -> float:
        return max(0, self._opus.audio_end - self.pre_skip) / 48.0


class Mp3UnavailableError(RuntimeError):
    """The lameenc package is missing."""


class Mp3Output(_Closable):
    """MP3 frames as LAME (lameenc, prebuilt wheels on PyPI) makes them, HTTP only. 24 kHz mono is MPEG-2 Layer
    III: 576-sample frames (24 ms); default 64 kbit/s CBR (plenty for speech at this rate; CBR keeps every frame
    self-contained, so a client can start decoding anywhere, and needs no Xing header rewritten at the end). LAME
    holds audio back (about one frame plus its lookahead) until close(), so a segment flush gives nothing and
    packet times count the input samples consumed (24 kHz)."""

    clock_rate = MODEL_RATE
    pre_skip = 0
    cheap = False

    def __init__(self, bitrate_kbps: int = 64, *, quality: int = 5) -> None:
        try:
            import lameenc
        except ImportError as exc:
            raise Mp3UnavailableError("MP3 output needs the Python package lameenc: "
                                      "pip install lameenc==1.9.0") from exc
        self._enc = lameenc.Encoder()
        self._enc.set_in_sample_rate(MODEL_RATE)
        self._enc.set_out_sample_rate(MODEL_RATE)
        self._enc.set_channels(1)
        self._enc.set_bit_rate(bitrate_kbps)
        self._enc.set_quality(quality)  # 2 best .. 7 fastest
        self._samples_in = 0

    def _packet(self, data: bytes, samples: int) -> list[AudioPacket]:
        start = self._samples_in
        self._samples_in += samples
        return [AudioPacket(data, start, samples)] if data else []

    def encode(self, x: np.ndarray) -> list[AudioPacket]:
        self._check_open("encode")
        s16 = float_to_s16le(x)
        return self._packet(bytes(self._enc.encode(s16)) if s16 else b"", len(x))

    def flush(self) -> list[AudioPacket]:
        return []

    def close(self) -> list[AudioPacket]:
        if self._closed:
            return []
        self._closed = True
        return self._packet(bytes(self._enc.flush()), 0)

    @property
    def audio_end_ms(self) -> float:
        return self._samples_in * 1000.0 / MODEL_RATE


AudioOutput = PcmOutput | OpusOutput | Mp3Output
