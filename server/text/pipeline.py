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
"""

from __future__ import annotations

import unicodedata

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
        self.llm = normalization == "llm"
        self.tokens = tokenizer.incremental()
        self.words = 0  # whitespace-separated words of the current segment (normalised text)
        self.ids_in_segment = 0
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
        if self.llm and self.normalizer.holds_gap and _final_word_chunk(self.tokens.pending_text):
            ids += self.tokens.finish()
        self.ids_in_segment += len(ids)
        return ids

    def finish(self, closing: bool = True) -> tuple[list[int], int]:
        """The rest of the segment and its word count; the next feed starts a new segment. A flush (closing=False)
        keeps an open code fence open, so the rest of the code block is still dropped when it arrives."""
        ids = self._tokenize(self.normalizer.finish() if closing else self.normalizer.flush())
        ids += self.tokens.finish()
        words = self.words
        self.words = self.ids_in_segment = 0
        self._in_word = False
        return ids, words

    def reset(self) -> None:
        self.normalizer.reset()
        self.tokens.reset()
        self.words = self.ids_in_segment = 0
        self._in_word = False


def encode_whole(tokenizer: TextTokenizer, text: str, normalization: str = "llm") -> tuple[list[int], int]:
    """The ids and word count of a whole text as one segment (HTTP)."""
    p = TextPipeline(tokenizer, normalization)
    ids = p.feed(text)
    rest, words = p.finish()
    return ids + rest, words
