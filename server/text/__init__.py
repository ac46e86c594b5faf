"""Text in (docs/protocol.md 1.7): LLM-text normalisation (normalize), then the tokenizer-facing pipeline with its
early-commit rule and the cutting of a whole text into segments (pipeline). These are the names the doors use."""

from server.text.pipeline import TextPipeline, encode_segments, segment_rule

__all__ = ["TextPipeline", "encode_segments", "segment_rule"]
