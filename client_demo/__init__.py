"""voicelane clients: the async Python client of the WebSocket protocol (client.py) and the browser demo (web/)."""

from client_demo.client import (
    AudioPacket,
    Context,
    ContextCancelled,
    ContextDone,
    ErrorEvent,
    Flushed,
    SessionClosed,
    Utterance,
    VoicelaneClient,
    VoicelaneError,
    WarningEvent,
    decode_opus,
    decode_pcm,
    parse_frame,
)

__all__ = [
    "AudioPacket",
    "Context",
    "ContextCancelled",
    "ContextDone",
    "ErrorEvent",
    "Flushed",
    "SessionClosed",
    "Utterance",
    "VoicelaneClient",
    "VoicelaneError",
    "WarningEvent",
    "decode_opus",
    "decode_pcm",
    "parse_frame",
]
