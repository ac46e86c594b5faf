"""The binary audio frame header, as the server's audio modules have always imported it; it is defined once, in
voicelane_wire, with the clients that read it."""

from voicelane_wire import (
    FLAG_FIRST,
    FLAG_LAST,
    FLAG_SEGMENT_START,
    FRAME_VERSION,
    HEADER_SIZE,
    KIND_AUDIO,
    FrameHeader,
    make_flags,
    pack_frame,
    pack_header,
    unpack_frame,
)

__all__ = ["FLAG_FIRST", "FLAG_LAST", "FLAG_SEGMENT_START", "FRAME_VERSION", "HEADER_SIZE", "KIND_AUDIO",
           "FrameHeader", "make_flags", "pack_frame", "pack_header", "unpack_frame"]
