"""PCM conversions: float32 -> s16le / f32le / G.711 mu-law, and a streaming-exact polyphase resampler.

All functions take float32 mono numpy arrays in [-1, 1] (values outside are clipped; NaN becomes 0).
"""

from __future__ import annotations

import math

import numpy as np

S16_SCALE = 32767.0

_EMPTY_F32 = np.zeros(0, dtype=np.float32)


# ----------------------------------------------------------------------------------------------- s16 / f32


def float_to_s16(x: np.ndarray) -> np.ndarray:
    """float -> int16: clip to [-1, 1], scale by 32767, round half to even. 1.0 -> 32767, -1.0 -> -32767;
    NaN -> 0."""
    y = np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0)
    np.nan_to_num(y, copy=False, nan=0.0)
    y *= np.float32(S16_SCALE)
    return np.rint(y).astype(np.int16)


def float_to_s16le(x: np.ndarray) -> bytes:
    return float_to_s16(x).astype("<i2", copy=False).tobytes()


def float_to_f32le(x: np.ndarray) -> bytes:
    """float32 little-endian, passed through unclipped except that NaN becomes 0."""
    y = np.asarray(x, dtype="<f4")
    if np.isnan(y).any():
        y = np.nan_to_num(y, nan=0.0)
    return y.tobytes()


def s16_to_float(s: np.ndarray | bytes) -> np.ndarray:
    """int16 (array or s16le bytes) -> float32, dividing by 32767 (the inverse of float_to_s16)."""
    a = np.frombuffer(s, dtype="<i2") if isinstance(s, bytes | bytearray | memoryview) else np.asarray(s)
    return (a.astype(np.float32) / np.float32(S16_SCALE)).astype(np.float32)


# ---------------------------------------------------------------------------------------------- G.711 mu-law

_MULAW_BIAS = 0x84
_MULAW_CLIP = 32635
# exponent = index of the highest set bit of (magnitude + bias) >> 7, for values 1..255
_MULAW_EXP = np.array([0] + [i.bit_length() - 1 for i in range(1, 256)], dtype=np.int32)


def s16_to_mulaw(s: np.ndarray) -> np.ndarray:
    """int16 -> G.711 mu-law bytes (uint8), the classic biased 16-bit algorithm (0 -> 0xFF, 32767 -> 0x80,
    -32768 -> 0x00)."""
    x = np.asarray(s).astype(np.int32)
    sign = np.where(x < 0, 0x80, 0).astype(np.int32)
    mag = np.minimum(np.abs(x), _MULAW_CLIP) + _MULAW_BIAS
    exponent = _MULAW_EXP[mag >> 7]
    mantissa = (mag >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def mulaw_to_s16(u: np.ndarray | bytes) -> np.ndarray:
    """G.711 mu-law bytes -> int16 (0xFF -> 0, 0x80 -> 32124, 0x00 -> -32124)."""
    a = np.frombuffer(u, dtype=np.uint8) if isinstance(u, bytes | bytearray | memoryview) else np.asarray(u)
    v = (~a.astype(np.int32)) & 0xFF
    exponent = (v >> 4) & 0x07
    mantissa = v & 0x0F
    mag = (((mantissa << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(v & 0x80, -mag, mag).astype(np.int16)


def float_to_mulaw(x: np.ndarray) -> bytes:
    return s16_to_mulaw(float_to_s16(x)).tobytes()


# ------------------------------------------------------------------------------------------------ resampler


def _kaiser_lowpass(up_rate: int, f_pass: float, f_stop: float, atten_db: float, gain: float) -> np.ndarray:
    """Odd-length linear-phase Kaiser-windowed sinc low-pass at `up_rate`, DC gain `gain`."""
    dw = 2.0 * math.pi * (f_stop - f_pass) / up_rate
    n_taps = int(math.ceil((atten_db - 7.95) / (2.285 * dw))) + 1
    n_taps |= 1
    if atten_db > 50:
        beta = 0.1102 * (atten_db - 8.7)
    elif atten_db >= 21:
        beta = 0.5842 * (atten_db - 21) ** 0.4 + 0.07886 * (atten_db - 21)
    else:
        beta = 0.0
    fc = 0.5 * (f_pass + f_stop) / up_rate  # cycles per sample
    t = np.arange(n_taps) - (n_taps - 1) / 2.0
    h = 2.0 * fc * np.sinc(2.0 * fc * t) * np.kaiser(n_taps, beta)
    return h * (gain / h.sum())


class Resampler:
    """Streaming rational resampler (upsample by L, linear-phase FIR low-pass, downsample by M), numpy only.

    The filter is centred (zero delay): output sample n is at time n / out_rate, the same instant as input
    sample n * in_rate / out_rate. To compute it the resampler needs `lookahead` input samples after that
    instant, so `process()` returns what it can and holds back a few ms; `finish()` treats the input as followed
    by zeros and returns the rest. The whole stream gives ceil(n_in * out_rate / in_rate) samples, and chunked
    input gives exactly (bit for bit) the same output as the whole signal at once. After `finish()` the object
    is reset and takes a new stream.

    Defaults: passband to 0.85 x the output Nyquist (6.8 kHz at 16 kHz, 3.4 kHz at 8 kHz), stopband from the
    output Nyquist, 70 dB attenuation.
    """

    def __init__(
        self, in_rate: int = 24000, out_rate: int = 16000, *, pass_fraction: float = 0.85, atten_db: float = 70.0
    ) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError("sample rates must be positive")
        g = math.gcd(in_rate, out_rate)
        self.up, self.down = out_rate // g, in_rate // g
        self.identity = self.up == self.down == 1
        if not self.identity:
            nyq = min(in_rate, out_rate) / 2.0
            h = _kaiser_lowpass(in_rate * self.up, pass_fraction * nyq, nyq, atten_db, float(self.up))
            self._delay = (len(h) - 1) // 2  # at the upsampled rate
            self._phases = [h[p :: self.up].copy() for p in range(self.up)]
            self._span = max(len(ph) for ph in self._phases)  # input samples one output reads
            self.lookahead = -(-self._delay // self.up)  # input samples needed after an output's instant
        else:
            self.lookahead = 0
        self.reset()

    def reset(self) -> None:
        self.samples_in = 0
        self.samples_out = 0
        if not self.identity:
            self._buf = np.zeros(self._span - 1, dtype=np.float64)
            self._buf_start = -(self._span - 1)  # input index of _buf[0]; negative indices read as zeros

    def _base(self, n: int) -> int:
        return (n * self.down + self._delay) // self.up

    def process(self, x: np.ndarray) -> np.ndarray:
        """Feed input samples; returns the output samples now computable (float32)."""
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if self.identity:
            self.samples_in += len(x)
            self.samples_out += len(x)
            return x
        if len(x):
            self._buf = np.concatenate((self._buf, x.astype(np.float64)))
            self.samples_in += len(x)
        # outputs n with base(n) <= samples_in - 1
        n_end = (self.samples_in * self.up - 1 - self._delay) // self.down + 1
        return self._run(max(n_end, self.samples_out))

    def finish(self) -> np.ndarray:
        """End of the stream: the remaining output (input padded with zeros). Resets the resampler."""
        if self.identity:
            self.reset()
            return _EMPTY_F32
        n_end = -(-self.samples_in * self.up // self.down)
        if n_end > self.samples_out:
            need = self._base(n_end - 1) + 1 - (self._buf_start + len(self._buf))
            if need > 0:
                self._buf = np.concatenate((self._buf, np.zeros(need)))
        out = self._run(n_end)
        self.reset()
        return out

    def _run(self, n_end: int) -> np.ndarray:
        n0 = self.samples_out
        count = n_end - n0
        if count <= 0:
            return _EMPTY_F32
        y = np.empty(count, dtype=np.float64)
        buf, bs, step = self._buf, self._buf_start, self.down
        for r in range(min(self.up, count)):
            n = n0 + r
            cnt = (count - r + self.up - 1) // self.up
            phase = self._phases[(n * self.down + self._delay) % self.up]
            b0 = self._base(n) - bs
            acc = np.zeros(cnt, dtype=np.float64)
            tmp = np.empty(cnt, dtype=np.float64)
            stop_extra = step * (cnt - 1) + 1
            # Fixed tap order per output: chunked and whole-signal runs give bit-identical results.
            for m, gm in enumerate(phase):
                s = b0 - m
                np.multiply(buf[s : s + stop_extra : step], gm, out=tmp)
                acc += tmp
            y[r :: self.up] = acc
        self.samples_out = n_end
        keep_from = self._base(n_end) - (self._span - 1)
        if keep_from > bs:
            cut = min(keep_from - bs, len(buf))
            self._buf = buf[cut:]
            self._buf_start = bs + cut
        return y.astype(np.float32)


# encoding -> the conversion from float32 (server.audio.encoders.PcmOutput)
PCM_CONVERSIONS = {"pcm_s16le": float_to_s16le, "pcm_f32le": float_to_f32le, "pcm_mulaw": float_to_mulaw}
