"""A whole text (HTTP) cut into segments the engine speaks one after another, at sentence ends where it can: a
segment has its own frame budget (max_frames), so long input is spoken whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from engine import TextTokenizer
from server.text.pipeline import TextPipeline

# A sentence ends at . ! ? ; or a line break followed by whitespace, or right after CJK full stops.
_SENTENCE_END = re.compile(r"(?<=[.!?;…\n])\s+|(?<=[。！？；])")
_WIDE = re.compile(r"[\u1100-\u11ff\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")


def estimated_frames(text: str) -> int:
    """A generous guess of the frames a text takes to speak (12.5 frames/s): a CJK or Hangul character about
    3 (4-5 per second are spoken), anything else about 1 (about 15 per second)."""
    wide = len(_WIDE.findall(text))
    return 3 * wide + (len(text) - wide)


def bench_frames(frames_per_word: int) -> Callable[[str], int]:
    """The exact frames of a text in the benchmark length mode (N per word), instead of a guess."""
    return lambda text: frames_per_word * len(text.split())


def split_sentences(text: str, budget: int, frames_of: Callable[[str], int] = estimated_frames) -> list[str]:
    """`text` cut into pieces of at most `budget` frames by `frames_of`, at sentence ends where possible, else at
    spaces, else anywhere; joined back they give `text` exactly."""
    pieces: list[str] = []
    for sentence in (s for s in _split_keep(text, _SENTENCE_END) if s):
        if frames_of(sentence) <= budget:
            pieces.append(sentence)
            continue
        for word in _split_keep(sentence, re.compile(r"(?<=\s)(?=\S)")):
            while frames_of(word) > budget and estimated_frames(word) > budget:
                cut = max(1, _prefix_within(word, budget))
                pieces.append(word[:cut])
                word = word[cut:]
            pieces.append(word)
    out: list[str] = []
    for piece in pieces:  # pack whole pieces into segments
        if out and frames_of(out[-1]) + frames_of(piece) <= budget:
            out[-1] += piece
        else:
            out.append(piece)
    return out


def _split_keep(text: str, pattern: re.Pattern) -> list[str]:
    """Split after each match, keeping every character (the separators stay at the end of their piece)."""
    out, start = [], 0
    for m in pattern.finditer(text):
        if m.end() > start:
            out.append(text[start:m.end()])
            start = m.end()
    out.append(text[start:])
    return out


def _prefix_within(word: str, budget: int) -> int:
    n = 0
    for i, ch in enumerate(word):
        n += estimated_frames(ch)
        if n > budget:
            return i
    return len(word)


def encode_segments(tokenizer: TextTokenizer, text: str, normalization: str, budget: int,
                    frames_of: Callable[[str], int] = estimated_frames) -> list[tuple[list[int], int]]:
    """A long text as consecutive segments (ids, words) of at most `budget` estimated frames each, on one text
    pipeline with a flush between them - what a WebSocket client does when it flushes at sentence ends. A text
    within the budget is one segment, exactly encode_whole's."""
    pieces = split_sentences(text, budget, frames_of)
    p = TextPipeline(tokenizer, normalization)
    out = []
    for i, piece in enumerate(pieces):
        ids = p.feed(piece)
        rest, words = p.finish(closing=i == len(pieces) - 1)
        if ids or rest:
            out.append((ids + rest, words))
    return out


def segment_rule(max_frames: int, bench_frames_per_word: int) -> tuple[int, Callable[[str], int]]:
    """Frames of text per segment and how to count them, so that long input is spoken whole (each segment has
    its own max_frames): half the frames a segment may make by a generous guess, with room for slow speech; in
    the benchmark length mode a segment's frames are exact (N per word), so the whole budget is usable and text
    that fits one segment is one segment, as on the WebSocket door."""
    if bench_frames_per_word:
        return max(bench_frames_per_word, max_frames), bench_frames(bench_frames_per_word)
    return max(8, max_frames // 2), estimated_frames
