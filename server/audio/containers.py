"""The HTTP `response_format`s as files around an output's packets (docs/protocol.md 2): `pcm` and `mp3` are the
packets' bytes, `wav` puts a streaming header (sizes 0xFFFFFFFF) first, `opus` is Ogg Opus (RFC 7845): two header
pages, then one page per call that has packets, and the last packets on the EOS page with the end-trimmed granule.
"""

from __future__ import annotations

import struct

from .encoders import MODEL_RATE, AudioOutput, AudioPacket, Mp3Output, OpusOutput, PcmOutput
from .ogg import OggOpusWriter

HTTP_FORMATS = ("mp3", "pcm", "wav", "opus")
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "wav": "audio/wav", "pcm": "audio/pcm"}
UNKNOWN_SIZE = 0xFFFFFFFF


def wav_header(sample_rate: int = 24000, *, num_samples: int | None = None) -> bytes:
    """The canonical 44-byte header of a 16-bit mono PCM WAV (RIFF) file. num_samples=None: the streaming header of
    docs/protocol.md 2, RIFF and data sizes 0xFFFFFFFF (length unknown); else exact sizes for that many samples."""
    if num_samples is None:
        riff_size = data_size = UNKNOWN_SIZE
    else:
        data_size = num_samples * 2
        if data_size + 36 > UNKNOWN_SIZE - 1:
            raise ValueError("too many samples for a RIFF WAV file")
        riff_size = 36 + data_size
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)  # PCM, mono, 2 bytes a sample
    return b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + b"fmt " + fmt + b"data" + struct.pack("<I", data_size)


class AudioFile:
    """header() once first, body(packets) for every batch of packets, end(packets) once with the output's last
    ones. Each returns the bytes to send (possibly empty)."""

    def __init__(self, response_format: str, output: AudioOutput) -> None:
        self.content_type = CONTENT_TYPES[response_format]
        self.output = output

    def header(self) -> bytes:
        return b""

    def body(self, packets: list[AudioPacket]) -> bytes:
        return b"".join(p.payload for p in packets)

    def end(self, packets: list[AudioPacket]) -> bytes:
        return self.body(packets)

    def whole(self, header: bytes, body: bytes) -> bytes:
        """The file in one piece: `header` (from header(), taken before any audio) and all the body bytes."""
        return header + body


class WavFile(AudioFile):
    def header(self) -> bytes:
        return wav_header(MODEL_RATE)

    def whole(self, header: bytes, body: bytes) -> bytes:
        return wav_header(MODEL_RATE, num_samples=len(body) // 2) + body  # exact sizes: the length is known


class OggOpusFile(AudioFile):
    output: OpusOutput

    def __init__(self, output: OpusOutput, *, serial: int | None = None) -> None:
        super().__init__("opus", output)
        self.writer = OggOpusWriter(output.pre_skip, input_sample_rate=MODEL_RATE, serial=serial)

    def header(self) -> bytes:
        return self.writer.headers()

    def body(self, packets: list[AudioPacket]) -> bytes:
        return self.writer.write([p.payload for p in packets]) if packets else b""

    def end(self, packets: list[AudioPacket]) -> bytes:
        return self.writer.write([p.payload for p in packets], last=True, end_granule=self.output.end_sample)


def open_audio_file(response_format: str, *, opus_complexity: int = 10) -> AudioFile:
    """`response_format` is one of HTTP_FORMATS; ValueError otherwise. Raises OpusUnavailableError or
    Mp3UnavailableError (RuntimeError) when the codec library is missing."""
    if response_format == "pcm":
        return AudioFile("pcm", PcmOutput())
    if response_format == "wav":
        return WavFile("wav", PcmOutput())
    if response_format == "opus":
        return OggOpusFile(OpusOutput(complexity=opus_complexity))
    if response_format == "mp3":
        return AudioFile("mp3", Mp3Output())
    raise ValueError(f"unknown response_format {response_format!r}; expected one of {HTTP_FORMATS}")
