"""Text of one context on its way to token ids (docs/protocol.md 1.7): LLM-text normalisation, then the incremental
tokenizer, segment by segment.

`feed(text)` returns the ids that are final now; `finish()` (flush or close) returns the rest of the segment and
its whitespace-separated word count (benchmark length mode), and starts the next segment. For every split of a
segment's text into pieces, the ids are those of the whole text at once: the normaliser and the incremental
tokenizer both keep that invariant, so the WebSocket (word by word) and HTTP (whole text) give the same ids.

One latency refinement keeps that invariant: the normaliser holds back the whitespace after a word until it sees
the next visible character, which would leave the word itself as the tokenizer's undecided last chunk for one
more message. When the normaliser holds exactly such a pending gap, whatever it emits next is a space, a line
break or closing punctuation (or nothing at the end) - never a letter - so a pending chunk that is one run of
letters (optionally after one leading non-letter, e.g. " world") or one digit is already final. It is committed
then: "Hello " gives the ids of "Hello" at once, as the tokenizer alone would.

A whole text (HTTP) is cut into segments at sentence ends where it can (encode_segments): each segment has its own
frame budget (max_frames), so long input is spoken whole.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

from engine import TextTokenizer
from server.text.normalize import LlmTextNormalizer


def _final_word_chunk(s: str) -> bool:
    """Is `s` one pre-token chunk of letters (Qwen2 `[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`) or one digit (`\\p{N}`)?"""
    if not s:
        return False
    if len(s) == 1 and unicodedata.category(s)[0] == "N":
        return True
    head = s[0]
    if head.isalpha():
        body = s
    elif head in "\r\n'" or unicodedata.category(head)[0] in "NLM" or head.isspace() and head != " ":
        return False  # "'" could open a contraction chunk; other whitespace could join a whitespace run
    else:
        body = s[1:]
    return bool(body) and all(c.isalpha() for c in body)


class TextPipeline:
    def __init__(self, tokenizer: TextTokenizer, normalization: str = "llm"):
        self.normalizer = LlmTextNormalizer(normalization)
        self.tokens = tokenizer.incremental()
        self.words = 0  # whitespace-separated words of the current segment (normalised text)
        self._in_word = False

    def _tokenize(self, text: str) -> list[int]:
        for ch in text:
            if ch.isspace():
                self._in_word = False
            elif not self._in_word:
                self._in_word = True
                self.words += 1
        return self.tokens.feed(text) if text else []

    def feed(self, text: str) -> list[int]:
        ids = self._tokenize(self.normalizer.feed(text))
        if self.normalizer.holds_gap and _final_word_chunk(self.tokens.pending_text):  # never in mode "none"
            ids += self.tokens.finish()
        return ids

    def finish(self, closing: bool = True) -> tuple[list[int], int]:
        """The rest of the segment and its word count; the next feed starts a new segment. A flush (closing=False)
        keeps an open code fence open, so the rest of the code block is still dropped when it arrives."""
        ids = self._tokenize(self.normalizer.finish() if closing else self.normalizer.flush())
        ids += self.tokens.finish()
        words = self.words
        self.words = 0
        self._in_word = False
        return ids, words

    def reset(self) -> None:
        self.normalizer.reset()
        self.tokens.reset()
        self.words = 0
        self._in_word = False


def encode_whole(tokenizer: TextTokenizer, text: str, normalization: str = "llm") -> tuple[list[int], int]:
    """The ids and word count of a whole text as one segment (HTTP)."""
    p = TextPipeline(tokenizer, normalization)
    ids = p.feed(text)
    rest, words = p.finish()
    return ids + rest, words


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
