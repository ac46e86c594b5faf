"""The HTTP door (docs/protocol.md 2): the OpenAI-shaped speech, voices and models endpoints."""
