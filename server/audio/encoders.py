"""One output type per encoding: the model's trimmed float32 mono 24 kHz audio in, `AudioPacket`s out, for both
doors. The doors lay the packets out as their framing: binary frames or JSON messages on the WebSocket, raw,
WAV or Ogg bytes on HTTP (server.audio.containers).

Every output: encode(x) -> the packets ready now; flush() -> the rest at a segment end, the stream going on (Opus
pads under 9 ms of silence so every sample fed is decodable, PCM resampling emits its few-ms tail); close() -> the
rest at the context end, after which encode() raises. `clock_rate` is the clock of `start_sample` (the 48 kHz
decoder clock for Opus, else the output rate); `pre_skip` the Opus decoder's skip (0 otherwise); `audio_end_ms`
the listener-timeline end of the audio flushed so far, counting the silence flushes inserted, since it is heard.

These are plain synchronous objects, cheap per 80 ms chunk (well under a millisecond except Opus: about 0.2 ms
of one CPU core per 20 ms packet at complexity 10, 0.05 ms at 5, on a shared 2-core machine): run their calls in
a thread pool executor, one call at a time per object, in order, except where `cheap` says the call is a cast
(PCM at the model's rate): that costs less on the event loop than the two thread hops, each of which can wait for
the GIL under load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pcm import PCM_CONVERSIONS, Resampler, float_to_s16le

MODEL_RATE = 24000
_OPUS_SCALE = 48000 // MODEL_RATE  # Opus decoder-clock samples per input sample


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


class OpusUnavailableError(RuntimeError):
    """opuslib or the libopus shared library is missing."""


class OpusOutput(_Closable):
    """Raw 20 ms Opus packets (480 input samples) over opuslib (libopus through ctypes, which releases the GIL).

    Clocks. Opus always decodes at 48 kHz as far as timing goes. The encoder delays its input by its lookahead, so
    a decoder's output sample t (48 kHz) is input instant t - pre_skip; the client drops the first `pre_skip`
    decoded samples (docs/protocol.md 1.4, RFC 7845). `start_sample` is on the decoder clock: the first packet
    starts at 0 and each packet starts where the previous one ended (the RTP / Ogg convention), so the
    listener-timeline position of a packet's first sample is `start_sample - pre_skip`. `end_sample` is the
    decoder-clock position just after the last real sample flushed (an Ogg file's final granule).

    encode(x) returns the whole 20 ms packets now complete (a partial frame is held back). flush() emits everything
    held plus enough zeros to push the encoder's lookahead (6.5 ms) out, so every real sample fed so far is
    decodable; the stream goes on. Packets stay 20 ms: a flush inserts 6.5 to 26.5 ms of silence into the timeline
    (zeros that the listener hears; the next segment starts after them). Smaller Opus frames would pad less, but
    libopus at complexity >= 7 in VBR starves a 10/5/2.5 ms frame that follows 20 ms ones (3-byte packets,
    audible damage), so they are not used.

    Application: AUDIO (OPUS_APPLICATION_AUDIO). TTS output is finished audio for a listener, not a live
    microphone: AUDIO favours fidelity (and music-like prosody and breaths) over the VOIP mode's
    speech-intelligibility pre-processing; both have the same lookahead.
    """

    clock_rate = 48000
    cheap = False

    def __init__(self, bitrate: int = 32000, *, complexity: int = 10) -> None:
        if not 500 <= bitrate <= 512000:
            raise ValueError("Opus bitrate must be within 500..512000 bit/s")
        try:
            import opuslib  # imported lazily: only Opus streams need libopus
        except ImportError as exc:
            raise OpusUnavailableError("Opus output needs the Python package opuslib: pip install opuslib==3.0.1 "
                                       "(and the libopus library: apt-get install libopus0)") from exc
        except Exception as exc:  # opuslib raises a bare Exception when it cannot find libopus
            raise OpusUnavailableError(f"Opus output needs the libopus shared library, which was not found ({exc}); "
                                       "install it: apt-get install libopus0") from exc
        self._enc = opuslib.Encoder(MODEL_RATE, 1, "audio")
        self._enc.bitrate = bitrate
        self._enc.complexity = complexity
        self._enc.vbr = 1
        self.frame_size = MODEL_RATE // 50  # 20 ms
        self.lookahead = int(self._enc.lookahead)  # input-rate samples
        self.pre_skip = self.lookahead * _OPUS_SCALE  # 48 kHz units
        self._held = np.zeros(0, dtype=np.float32)
        self.samples_fed = 0  # input-rate samples given to libopus, padding included
        self._real_end = 0  # input clock, just after the last sample given to encode()
        self._next_start = 0  # decoder clock of the next packet
        self.end_sample = self.pre_skip

    @property
    def held(self) -> int:
        return len(self._held)

    def encode(self, x: np.ndarray) -> list[AudioPacket]:
        self._check_open("encode")
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if len(x) == 0:
            return []
        buf = np.concatenate((self._held, x)) if len(self._held) else x
        self._real_end = self.samples_fed + len(buf)
        fs = self.frame_size
        n_frames = len(buf) // fs
        packets = [self._encode_frame(buf[i * fs : (i + 1) * fs]) for i in range(n_frames)]
        self._held = buf[n_frames * fs :].copy()
        return packets

    def flush(self) -> list[AudioPacket]:
        self._check_open("flush")
        end48 = self._real_end * _OPUS_SCALE + self.pre_skip  # decoder clock, just after the last real sample
        if end48 <= self._next_start:
            return []  # every real sample is decodable already (nothing new since the last flush)
        need = self._real_end + self.lookahead - self.samples_fed  # input samples to feed now (> 0 here)
        fs = self.frame_size
        n_frames = -(-need // fs)
        buf = np.zeros(n_frames * fs, dtype=np.float32)
        buf[: len(self._held)] = self._held
        self._held = np.zeros(0, dtype=np.float32)
        packets = [self._encode_frame(buf[i * fs : (i + 1) * fs]) for i in range(n_frames)]
        self.end_sample = end48
        return packets

    def _encode_frame(self, frame: np.ndarray) -> AudioPacket:
        n = len(frame)
        data = self._enc.encode_float(np.ascontiguousarray(frame, dtype=np.float32).tobytes(), n)
        start = self._next_start
        self.samples_fed += n
        self._next_start += n * _OPUS_SCALE
        return AudioPacket(data, start, n * _OPUS_SCALE)

    @property
    def audio_end_ms(self) -> float:
        return max(0, self.end_sample - self.pre_skip) / 48.0


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
