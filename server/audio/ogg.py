"""Streaming Ogg Opus muxer (RFC 7845 over RFC 3533), for the HTTP `opus` response format.

Page layout: page 0 holds only the OpusHead packet (BOS flag), page 1 only OpusTags, then audio pages. Each
`write()` call puts the packets it is given on one page (or more when they need over 255 lacing values), so the
bytes can be sent at once: give it the packets one encode() call produced (four per 80 ms chunk) for low page
overhead and no added latency. A page's granule position is the 48 kHz decoder-clock sample count through its
last packet (pre-skip included, as RFC 7845 defines it); the last page carries the EOS flag and may carry a
smaller granule position that trims the padding at the end (`end_granule`, e.g. OpusOutput.end_sample).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

_CRC_TABLE = []
for _i in range(256):
    _r = _i << 24
    for _ in range(8):
        _r = ((_r << 1) ^ 0x04C11DB7) if _r & 0x80000000 else (_r << 1)
    _CRC_TABLE.append(_r & 0xFFFFFFFF)
_CRC_TABLE = tuple(_CRC_TABLE)

_PAGE_HEADER = struct.Struct("<4sBBqIIIB")  # capture, version, type, granule, serial, seq, crc, n_segments

FLAG_BOS = 0x02
FLAG_EOS = 0x04


def ogg_crc(data: bytes) -> int:
    """Ogg's CRC-32: polynomial 0x04C11DB7, not reflected, initial value 0, no final xor."""
    crc = 0
    table = _CRC_TABLE
    for b in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[((crc >> 24) ^ b) & 0xFF]
    return crc


OPUS_TAGS = b"OpusTags" + struct.pack("<I", 9) + b"voicelane" + struct.pack("<I", 0)  # RFC 7845 5.2: no comments


def opus_packet_samples(packet: bytes) -> int:
    """Duration of an Opus packet in 48 kHz samples, from its TOC byte (RFC 6716 3.1)."""
    if not packet:
        raise ValueError("empty Opus packet")
    toc = packet[0]
    config = toc >> 3
    if config < 12:  # SILK: 10, 20, 40, 60 ms
        frame = (480, 960, 1920, 2880)[config & 3]
    elif config < 16:  # hybrid: 10, 20 ms
        frame = (480, 960)[config & 1]
    else:  # CELT: 2.5, 5, 10, 20 ms
        frame = (120, 240, 480, 960)[config & 3]
    code = toc & 3
    if code == 0:
        count = 1
    elif code in (1, 2):
        count = 2
    else:
        if len(packet) < 2:
            raise ValueError("Opus code-3 packet without a frame count byte")
        count = packet[1] & 0x3F
    return frame * count


class OggOpusWriter:
    """Streaming Ogg Opus muxer for one mono stream. Not thread-safe.

    headers() -> bytes: the OpusHead and OpusTags pages; send first (once).
    write(packets, last=False, end_granule=None) -> bytes: pages for these raw Opus packets (durations read from
        their TOC bytes). With last=True the final page gets the EOS flag and granule `end_granule` (when given:
        end trimming, at least the previous page's granule and at most the sum of durations). `write([],
        last=True)` closes a stream whose packets were all written already with an empty EOS page (whose granule
        can then only be the current one: pass the last packets with last=True to trim the end).
    """

    def __init__(self, pre_skip: int, *, input_sample_rate: int = 24000, serial: int | None = None) -> None:
        self.pre_skip = pre_skip
        self.input_sample_rate = input_sample_rate
        self.serial = int.from_bytes(os.urandom(4), "little") if serial is None else serial & 0xFFFFFFFF
        self._seq = 0
        self.granule = 0  # decoder-clock samples through the last packet written
        self._headers_done = False
        self.closed = False

    def _page(self, packets: list[bytes], granule: int, flags: int = 0) -> bytes:
        """The next page, holding whole packets (their lacing values must fit in 255 segments)."""
        lacing = bytearray()
        for p in packets:
            lacing += b"\xff" * (len(p) // 255) + bytes((len(p) % 255,))
        if len(lacing) > 255:
            raise ValueError("packets need more than 255 lacing values for one page")
        header = _PAGE_HEADER.pack(b"OggS", 0, flags, granule, self.serial, self._seq, 0, len(lacing))
        page = bytearray(header + lacing + b"".join(packets))
        struct.pack_into("<I", page, 22, ogg_crc(page))
        self._seq += 1
        return bytes(page)

    def headers(self) -> bytes:
        if self._headers_done:
            raise RuntimeError("headers() called twice")
        self._headers_done = True
        # the 19-byte OpusHead of RFC 7845 5.1: version 1, mono, no output gain, channel mapping family 0
        head = b"OpusHead" + struct.pack("<BBHIhB", 1, 1, self.pre_skip, self.input_sample_rate, 0, 0)
        return self._page([head], 0, FLAG_BOS) + self._page([OPUS_TAGS], 0)

    def write(self, packets: Iterable[bytes], *, last: bool = False, end_granule: int | None = None) -> bytes:
        if self.closed:
            raise RuntimeError("write() after the last page")
        out = b"" if self._headers_done else self.headers()
        pkts = [bytes(p) for p in packets]
        groups: list[list[bytes]] = []
        cur: list[bytes] = []
        lace = 0
        for p in pkts:
            n = len(p) // 255 + 1
            if cur and lace + n > 255:
                groups.append(cur)
                cur, lace = [], 0
            cur.append(p)
            lace += n
        if cur or last:
            groups.append(cur)
        durations = [sum(opus_packet_samples(p) for p in group) for group in groups]
        final = self.granule + sum(durations)
        if last and end_granule is not None:
            prev = final - (durations[-1] if durations else 0)
            if not prev <= end_granule <= final:
                raise ValueError(f"end_granule {end_granule} outside [{prev}, {final}]")
        pages = []
        for i, group in enumerate(groups):
            self.granule += durations[i]
            granule, flags = self.granule, 0
            if last and i == len(groups) - 1:
                flags = FLAG_EOS
                if end_granule is not None:
                    granule = end_granule
                self.closed = True
            pages.append(self._page(group, granule, flags))
        return out + b"".join(pages)
