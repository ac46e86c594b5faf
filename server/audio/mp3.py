"""Streaming MP3 encoder over lameenc (LAME, prebuilt wheels on PyPI), for the HTTP `mp3` response format.

24 kHz mono input is MPEG-2 Layer III at 24 kHz: 576-sample frames (24 ms); default 64 kbit/s CBR (plenty for
speech at this rate; CBR keeps every frame self-contained, so a client can start decoding anywhere, and needs no
Xing header rewritten at the end). LAME holds back about one frame plus its lookahead: `encode()` returns what is
ready (often nothing for the first chunk) and `finish()` flushes the rest. Plain synchronous object: run it in a
thread pool executor, one call at a time per encoder.
"""

from __future__ import annotations

import numpy as np

from .pcm import float_to_s16

MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


class Mp3UnavailableError(RuntimeError):
    """The lameenc package is missing."""


class Mp3StreamEncoder:
    """float32 mono -> MP3 bytes. encode(x) -> bytes (possibly empty); finish() -> the last bytes; later calls
    raise."""

    def __init__(self, sample_rate: int = 24000, *, bitrate_kbps: int = 64, quality: int = 5) -> None:
        if sample_rate not in MP3_RATES:
            raise ValueError(f"MP3 sample rate must be one of {MP3_RATES}")
        try:
            import lameenc
        except ImportError as exc:
            raise Mp3UnavailableError("MP3 output needs the Python package lameenc: "
                                      "pip install lameenc==1.9.0") from exc
        enc = lameenc.Encoder()
        enc.set_in_sample_rate(sample_rate)
        enc.set_out_sample_rate(sample_rate)
        enc.set_channels(1)
        enc.set_bit_rate(bitrate_kbps)
        enc.set_quality(quality)  # 2 best .. 7 fastest
        self._enc = enc
        self._closed = False

    def encode(self, x: np.ndarray) -> bytes:
        if self._closed:
            raise RuntimeError("encode() after finish()")
        s = float_to_s16(x)
        if len(s) == 0:
            return b""
        return bytes(self._enc.encode(s.astype("<i2", copy=False).tobytes()))

    def finish(self) -> bytes:
        if self._closed:
            raise RuntimeError("finish() called twice")
        self._closed = True
        return bytes(self._enc.flush())
