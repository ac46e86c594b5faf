"""WAV (RIFF, 16-bit PCM) headers and a file writer.

- `wav_header(sample_rate)` with no length is the streaming header of docs/protocol.md 2: RIFF and data sizes are
  0xFFFFFFFF (length unknown); PCM s16le follows.
- `wav_header(sample_rate, num_samples=n)` is an exact header for n samples.
- `WavWriter` writes a .wav file incrementally and fixes the sizes when closed (for the CLI).
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

import numpy as np

from .pcm import float_to_s16

UNKNOWN_SIZE = 0xFFFFFFFF


def wav_header(
    sample_rate: int = 24000, *, num_samples: int | None = None, channels: int = 1, bits_per_sample: int = 16
) -> bytes:
    """The canonical 44-byte PCM WAV header. num_samples=None: streaming, RIFF and data sizes 0xFFFFFFFF."""
    block_align = channels * bits_per_sample // 8
    if num_samples is None:
        riff_size = data_size = UNKNOWN_SIZE
    else:
        data_size = num_samples * block_align
        if data_size + 36 > UNKNOWN_SIZE - 1:
            raise ValueError("too many samples for a RIFF WAV file")
        riff_size = 36 + data_size
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, bits_per_sample)
        + b"data"
        + struct.pack("<I", data_size)
    )


def _to_s16(samples: np.ndarray) -> np.ndarray:
    a = np.asarray(samples)
    return a.astype("<i2", copy=False) if a.dtype == np.int16 else float_to_s16(a)


class WavWriter:
    """16-bit mono WAV file written incrementally; sizes are correct after close() (the file must be seekable).
    Accepts float32 (converted like pcm_s16le) or int16 chunks. Usable as a context manager."""

    def __init__(self, target: str | os.PathLike | BinaryIO, sample_rate: int = 24000) -> None:
        if isinstance(target, str | os.PathLike):
            self._f: BinaryIO = open(target, "wb")
            self._own = True
        else:
            self._f = target
            self._own = False
        self.sample_rate = sample_rate
        self.samples = 0
        self._start = self._f.tell()
        self._f.write(wav_header(sample_rate, num_samples=0))
        self.closed = False

    def write(self, samples: np.ndarray) -> None:
        s = _to_s16(samples)
        self._f.write(s.tobytes())
        self.samples += len(s)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        end = self._f.tell()
        self._f.seek(self._start)
        self._f.write(wav_header(self.sample_rate, num_samples=self.samples))
        self._f.seek(end)
        if self._own:
            self._f.close()
        else:
            self._f.flush()

    def __enter__(self) -> WavWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_wav(target: str | os.PathLike | BinaryIO, samples: np.ndarray, sample_rate: int = 24000) -> None:
    """Write a whole 16-bit mono WAV file."""
    with WavWriter(target, sample_rate) as w:
        w.write(samples)
