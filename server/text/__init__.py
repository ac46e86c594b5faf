"""Text in (docs/protocol.md 1.7): LLM-text normalisation (normalize), then the tokenizer-facing pipeline with its
early-commit rule and the cutting of a whole text into segments (pipeline). The doors use only these names."""

from server.text.normalize import LlmTextNormalizer, normalize_llm_text
from server.text.pipeline import (
    TextPipeline,
    bench_frames,
    encode_segments,
    encode_whole,
    estimated_frames,
    segment_rule,
    split_sentences,
)

__all__ = ["LlmTextNormalizer", "TextPipeline", "bench_frames", "encode_segments", "encode_whole", "estimated_frames",
           "normalize_llm_text", "segment_rule", "split_sentences"]
