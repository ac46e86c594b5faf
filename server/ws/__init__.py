"""The WebSocket door (docs/protocol.md 1): the session (receive task, emit task, handler table), its contexts and
their outbox."""
