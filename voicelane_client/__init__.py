"""The Python client of the voicelane WebSocket protocol (docs/protocol.md 1): `client` for applications and tests,
`recorder` for the load generator. The frame header they read is voicelane_wire's, the one the server writes."""

from voicelane_client.client import (
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
]
