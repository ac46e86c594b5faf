"""The wire format of a binary WebSocket audio frame (docs/protocol.md 1.3): its 16-byte header, packed and
unpacked in one place for the server, the Python client and the bench (the browser page has its own, in
client_demo/web/protocol.js). Standard library only, so each of them can import it without the others' dependencies.

Layout, big-endian::

    0  u8   version = 1
    1  u8   kind = 1 (audio)
    2  u16  flags: bit 0 first packet of the context, bit 1 last packet, bit 2 first packet of a segment
    4  u32  stream_id
    8  u32  seq, per context from 0
    12 u32  start_sample, at the stream's clock rate (48000 for Opus, the PCM rate otherwise)
    16 ...  payload: one raw Opus packet, or whole PCM samples (may be empty on a last packet)

`seq` and `start_sample` are written modulo 2**32 (like RTP timestamps): a 48 kHz clock wraps after 24.8 hours.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

FRAME_VERSION = 1
KIND_AUDIO = 1
HEADER_SIZE = 16

FLAG_FIRST = 1 << 0
FLAG_LAST = 1 << 1
FLAG_SEGMENT_START = 1 << 2

_HEADER = struct.Struct(">BBHIII")
_U32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class FrameHeader:
    stream_id: int
    seq: int
    start_sample: int
    flags: int = 0
    version: int = FRAME_VERSION
    kind: int = KIND_AUDIO

    @property
    def first(self) -> bool:
        return bool(self.flags & FLAG_FIRST)

    @property
    def last(self) -> bool:
        return bool(self.flags & FLAG_LAST)

    @property
    def segment_start(self) -> bool:
        return bool(self.flags & FLAG_SEGMENT_START)


def make_flags(*, first: bool = False, last: bool = False, segment_start: bool = False) -> int:
    return (FLAG_FIRST if first else 0) | (FLAG_LAST if last else 0) | (FLAG_SEGMENT_START if segment_start else 0)


def pack_header(
    stream_id: int,
    seq: int,
    start_sample: int,
    *,
    first: bool = False,
    last: bool = False,
    segment_start: bool = False,
) -> bytes:
    """The 16 header bytes. `stream_id` must fit in a u32; `seq` and `start_sample` wrap modulo 2**32."""
    if not 0 <= stream_id <= _U32:
        raise ValueError(f"stream_id out of u32 range: {stream_id}")
    if seq < 0 or start_sample < 0:
        raise ValueError("seq and start_sample must be non-negative")
    flags = make_flags(first=first, last=last, segment_start=segment_start)
    return _HEADER.pack(FRAME_VERSION, KIND_AUDIO, flags, stream_id, seq & _U32, start_sample & _U32)


def pack_frame(
    stream_id: int,
    seq: int,
    start_sample: int,
    payload: bytes | bytearray | memoryview = b"",
    *,
    first: bool = False,
    last: bool = False,
    segment_start: bool = False,
) -> bytes:
    """Header + payload as one bytes object, ready for one WebSocket binary message."""
    header = pack_header(stream_id, seq, start_sample, first=first, last=last, segment_start=segment_start)
    return header + bytes(payload)


def unpack_frame(data: bytes | bytearray | memoryview) -> tuple[FrameHeader, bytes]:
    """Split a binary message into its header and payload. Raises ValueError for a short message, an unknown
    version or a kind other than audio."""
    if len(data) < HEADER_SIZE:
        raise ValueError(f"audio frame shorter than its {HEADER_SIZE}-byte header: {len(data)} bytes")
    version, kind, flags, stream_id, seq, start_sample = _HEADER.unpack_from(data, 0)
    if version != FRAME_VERSION:
        raise ValueError(f"unknown audio frame version {version}")
    if kind != KIND_AUDIO:
        raise ValueError(f"unknown audio frame kind {kind}")
    return FrameHeader(stream_id, seq, start_sample, flags, version, kind), bytes(data[HEADER_SIZE:])
