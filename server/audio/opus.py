"""Per-context Opus encoder over opuslib (libopus through ctypes).

Input: mono float32 at 24 kHz (any Opus input rate works: 8, 12, 16, 24 or 48 kHz). Output: raw Opus packets of
20 ms (480 input samples at 24 kHz), each with its place on the 48 kHz decoder clock.

Clocks. Opus always decodes at 48 kHz as far as timing goes. The encoder delays its input by its lookahead, so a
decoder's output sample t (48 kHz) is input instant t - pre_skip; the client drops the first `pre_skip` decoded
samples (docs/protocol.md 1.4, RFC 7845). `OpusPacket.start_sample` is on the decoder clock: the first packet starts
at 0 and each packet starts where the previous one ended (the RTP / Ogg convention), so the listener-timeline
position of a packet's first sample is `start_sample - pre_skip`.

Application: AUDIO (OPUS_APPLICATION_AUDIO). TTS output is finished audio for a listener, not a live microphone:
AUDIO favours fidelity (and music-like prosody and breaths) over the VOIP mode's speech-intelligibility
pre-processing; both have the same lookahead (6.5 ms).

Cost: about 0.2 ms of one CPU core per 20 ms packet at the default complexity 10 (measured on a shared 2-core
machine; complexity 5 is about 0.05 ms). Plain synchronous object: run it in a thread pool executor, one call at a
time per encoder (libopus calls release the GIL through ctypes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


class OpusUnavailableError(RuntimeError):
    """opuslib or the libopus shared library is missing."""


@dataclass(frozen=True, slots=True)
class OpusPacket:
    data: bytes
    start_sample: int  # on the 48 kHz decoder clock (includes pre_skip), first packet 0
    samples: int  # duration at 48 kHz
    real_samples: int  # how many of `samples`, from the start, are before the end of real audio (48 kHz)


class OpusStreamEncoder:
    """One Opus stream (one context). Not thread-safe; one call at a time.

    encode(x): buffers input; returns the whole 20 ms packets now complete (a partial frame is held back).
    flush(): segment end. Emits everything held plus enough zeros to push the encoder's lookahead (6.5 ms) out,
        so every real sample fed so far is decodable from the packets returned; the stream goes on. Packets stay
        20 ms: a flush inserts 6.5 to 26.5 ms of silence into the timeline (zeros that the listener hears; the
        next segment starts after them). Smaller Opus frames would pad less, but libopus at complexity >= 7 in
        VBR starves a 10/5/2.5 ms frame that follows 20 ms ones (3-byte packets, audible damage), so they are not
        used.
    finish(): flush() and close; later calls raise. The last packet's `real_samples` says where real audio ends
        (Ogg end trimming: `audio_end` is the final granule position).
    """

    def __init__(self, sample_rate: int = 24000, *, bitrate: int = 32000, complexity: int = 10) -> None:
        if sample_rate not in OPUS_RATES:
            raise ValueError(f"Opus input rate must be one of {OPUS_RATES}, not {sample_rate}")
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
        self._enc = opuslib.Encoder(sample_rate, 1, "audio")
        self._enc.bitrate = bitrate
        self._enc.complexity = complexity
        self._enc.vbr = 1
        self._scale = 48000 // sample_rate
        self.frame_size = sample_rate // 50  # 20 ms
        self.lookahead = int(self._enc.lookahead)  # input-rate samples
        self.pre_skip = self.lookahead * self._scale  # 48 kHz units
        self._held = np.zeros(0, dtype=np.float32)
        self.samples_fed = 0  # input-rate samples given to libopus, padding included
        self._real_end = 0  # input clock, just after the last sample given to encode()
        self.next_start_sample = 0  # decoder clock of the next packet
        self.audio_end = self.pre_skip  # decoder clock just after the last real sample flushed so far
        self._closed = False

    @property
    def held(self) -> int:
        return len(self._held)

    def encode(self, x: np.ndarray) -> list[OpusPacket]:
        if self._closed:
            raise RuntimeError("encode() after finish()")
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

    def flush(self) -> list[OpusPacket]:
        if self._closed:
            raise RuntimeError("flush() after finish()")
        end48 = self._real_end * self._scale + self.pre_skip  # decoder clock, just after the last real sample
        if end48 <= self.next_start_sample:
            return []  # every real sample is decodable already (nothing new since the last flush)
        need = self._real_end + self.lookahead - self.samples_fed  # input samples to feed now (> 0 here)
        fs = self.frame_size
        n_frames = -(-need // fs)
        buf = np.zeros(n_frames * fs, dtype=np.float32)
        buf[: len(self._held)] = self._held
        self._held = np.zeros(0, dtype=np.float32)
        packets = [self._encode_frame(buf[i * fs : (i + 1) * fs], end48=end48) for i in range(n_frames)]
        self.audio_end = end48
        return packets

    def finish(self) -> list[OpusPacket]:
        packets = self.flush()
        self._closed = True
        return packets

    def _encode_frame(self, frame: np.ndarray, end48: int | None = None) -> OpusPacket:
        n = len(frame)
        data = self._enc.encode_float(np.ascontiguousarray(frame, dtype=np.float32).tobytes(), n)
        start = self.next_start_sample
        dur = n * self._scale
        real = dur if end48 is None else max(0, min(dur, end48 - start))
        self.samples_fed += n
        self.next_start_sample += dur
        return OpusPacket(data=data, start_sample=start, samples=dur, real_samples=real)
