"""Text tokenization for the Talker: the checkpoint's Qwen2 byte-level BPE, whole and incremental.

`TextTokenizer` loads the checkpoint's tokenizer with the `tokenizers` library only (no transformers at run time):
from `tokenizer.json` when present, else from `vocab.json` + `merges.txt` with the Qwen2 pre-tokenizer (NFC, the
Qwen2 regex split, byte-level), which is what transformers' converter builds from those two files.

User text never produces a control token. `encode()` runs plain BPE with no added-token matching: a user who
types "<|im_start|>" or "<tts_pad>" gets the ids of those characters, never 151644 or 151671. (The official
package's processor would match them as added tokens; a server must not let caller text inject prompt
structure.) Control ids come from `token_id()` / the named properties, and the prompt helpers splice them in.

`IncrementalTokenizer` turns a stream of text pieces into committed ids, holding back only what later text could
still change (see its docstring). For any split of a string into pieces, the concatenated outputs of `feed()` and
`finish()` equal `encode()` of the whole string.
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from .tokenizer_files import QWEN2_PRETOKENIZE_REGEX

__all__ = ["IncrementalTokenizer", "TextTokenizer"]

# Characters the pre-tokenizer regex (Oniguruma, Unicode \s) treats as whitespace, widened with everything Python
# calls whitespace and a few former/pseudo spaces. Wider is safe: it only holds back more.
_EXTRA_SPACES = frozenset("\t\n\v\f\r \x85\xa0\u1680\u180e\u2028\u2029\u202f\u205f\u3000"
                          + "".join(chr(c) for c in range(0x2000, 0x200B)))


def _is_space(ch: str) -> bool:
    return ch in _EXTRA_SPACES or ch.isspace()


class TextTokenizer:
    """The Qwen2 text tokenizer of a checkpoint, without special-token matching in user text."""

    def __init__(self, tokenizer: Tokenizer, added_tokens: dict[str, int]):
        """`tokenizer` must have no added tokens registered (use `from_dir`/`from_tokenizer_json`)."""
        self._tok = tokenizer
        self._added = dict(added_tokens)
        self._added_by_id = {i: content for content, i in self._added.items()}
        self._model = tokenizer.model
        self._pre = tokenizer.pre_tokenizer
        self._norm = tokenizer.normalizer

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> TextTokenizer:
        """Load from a checkpoint directory: `tokenizer.json` if present, else `vocab.json` + `merges.txt`.

        Added tokens (ids for `token_id()`) come from tokenizer.json's `added_tokens` and/or tokenizer_config.json's
        `added_tokens_decoder` (and a legacy `added_tokens.json`).
        """
        root = Path(path)
        added = _read_added_tokens(root)
        tokenizer_json = root / "tokenizer.json"
        if tokenizer_json.is_file():
            tok, from_json = _tokenizer_without_added(tokenizer_json.read_text(encoding="utf-8"))
            added = {**from_json, **added}
        elif (root / "vocab.json").is_file() and (root / "merges.txt").is_file():
            tok = _tokenizer_from_vocab_merges(root / "vocab.json", root / "merges.txt")
        else:
            raise FileNotFoundError(f"{root}: no tokenizer.json and no vocab.json + merges.txt")
        return cls(tok, added)

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike) -> TextTokenizer:
        tok, added = _tokenizer_without_added(Path(path).read_text(encoding="utf-8"))
        return cls(tok, added)

    # ---------------------------------------------------------------- encoding
    def encode(self, text: str) -> list[int]:
        """BPE ids of `text` (NFC-normalized, Qwen2 pre-tokenizer). No special tokens are added or recognised."""
        if not text:
            return []
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ids; added-token ids decode to their content (e.g. "<|im_start|>")."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            content = self._added_by_id.get(i)
            if content is None:
                run.append(i)
                continue
            if run:
                out.append(self._tok.decode(run, skip_special_tokens=False))
                run = []
            out.append(content)
        if run:
            out.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(out)

    def incremental(self, max_pending_chars: int = 2048) -> IncrementalTokenizer:
        return IncrementalTokenizer(self, max_pending_chars=max_pending_chars)

    # ---------------------------------------------------------------- vocabulary
    @property
    def added_tokens(self) -> dict[str, int]:
        """{content: id} of the checkpoint's added tokens (151643.. in Qwen3-TTS)."""
        return dict(self._added)

    @property
    def regular_vocab_size(self) -> int:
        """Number of BPE tokens (151,643 for Qwen2): ids below this are regular tokens."""
        return self._tok.get_vocab_size(with_added_tokens=False)

    def token_id(self, content: str) -> int:
        """Id of an added/special token ("<|im_start|>") or of a single regular token in byte-level form ("Ċ")."""
        if content in self._added:
            return self._added[content]
        found = self._tok.token_to_id(content)
        if found is None:
            raise KeyError(f"no token {content!r} in this tokenizer")
        return found

    @property
    def im_start_id(self) -> int:
        return self.token_id("<|im_start|>")

    @property
    def im_end_id(self) -> int:
        return self.token_id("<|im_end|>")

    @property
    def tts_pad_id(self) -> int:
        return self.token_id("<tts_pad>")

    @property
    def tts_bos_id(self) -> int:
        return self.token_id("<tts_text_bos>")

    @property
    def tts_eos_id(self) -> int:
        return self.token_id("<tts_text_eod>")

    # ---------------------------------------------------------------- prompts (official formatting, docs/model.md 3.1)
    def assistant_prompt_ids(self, text: str) -> list[int]:
        """Ids of `"<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n"` as the official package
        tokenizes it (added tokens split the string; each piece is BPE'd on its own), except that `text` can never
        contain a control token. `[3:-5]` of the result is the text part only when `text` does not start with a
        line break (optionally after other whitespace): such a start merges with the role's "\\n".
        """
        im_start, im_end = self.im_start_id, self.im_end_id
        return [im_start, *self.encode("assistant\n" + text), im_end, *self.encode("\n"),
                im_start, *self.encode("assistant\n")]

    def instruct_prompt_ids(self, instruct: str) -> list[int]:
        """Ids of `"<|im_start|>user\\n{instruct}<|im_end|>\\n"` (the 1.7B style instruction)."""
        return [self.im_start_id, *self.encode("user\n" + instruct), self.im_end_id, *self.encode("\n")]

    # ---------------------------------------------------------------- internals used by IncrementalTokenizer
    def _normalize(self, text: str) -> str:
        return self._norm.normalize_str(text) if self._norm is not None else text

    def _pieces(self, normalized: str) -> list[tuple[str, tuple[int, int]]]:
        """Pre-token chunks of already-normalized text: (byte-level string, (start, end) char offsets)."""
        return self._pre.pre_tokenize_str(normalized)

    def _bpe(self, piece: str) -> list[int]:
        return [t.id for t in self._model.tokenize(piece)]


class IncrementalTokenizer:
    """Tokenizes one stream of text as it arrives (PROTOCOL 1.7).

    `feed(text)` returns the ids that are final now; `finish()` returns the rest and resets the stream, so one
    object can serve consecutive segments. Invariant: for every split of a string s into pieces,
    `feed(p1) + feed(p2) + ... + finish() == tokenizer.encode(s)` (while no held-back region exceeds
    `max_pending_chars`).

    What is held back, and why that is exactly enough. The uncommitted text is kept NFC-normalized; after each feed
    it is split with the checkpoint's pre-tokenizer and a prefix of its chunks is committed:
    - never the last chunk: more letters extend a word, a letter after "'" can make a contraction, more punctuation
      or newlines extend a punctuation run, more whitespace extends a whitespace run (this is also why a digit,
      always a chunk of its own, still waits for the next character);
    - nothing from the trailing whitespace run on: the pattern's `\\s*[\\r\\n]+` alternative reaches to the LAST
      line break of a whitespace run and `\\s+(?!\\S)` looks past the run's end, so a run touching the end of the
      text may still be re-split (" \\n " + "\\n" turns chunks " \\n"," " into one " \\n \\n"). A word that ends
      before trailing spaces is final: "hello " commits "hello";
    - every other chunk is final: each alternative of the Qwen2 pattern stops at a character that is already
      present (a non-letter after letters, a non-newline after a punctuation run, a non-space after a whitespace
      run); contractions read at most three characters, all inside the chunk and its successor;
    - a commit point must also be an NFC boundary: the next character must be a starter (combining class 0, not a
      mark, known to this Python's Unicode database) that does not compose with the previous one, so that later
      text cannot re-normalize committed characters (e.g. a combining accent or a Hangul jamo arriving next).
    Scripts without spaces (CJK) commit at punctuation ("你好，世界" commits "你好" once "，世" arrives).
    If the held-back text grows beyond `max_pending_chars` (pathological input: one endless word or whitespace
    run), all of it but its last chunk, or if it is a single chunk all of it, is committed to bound the work per
    feed; only then can the result differ from `encode()` of the whole text.
    """

    def __init__(self, tokenizer: TextTokenizer, max_pending_chars: int = 2048):
        self._t = tokenizer
        self._pending = ""
        self.max_pending_chars = max_pending_chars

    @property
    def pending_text(self) -> str:
        """The normalized text received but not yet committed."""
        return self._pending

    def feed(self, text: str) -> list[int]:
        if not text:
            return []
        self._pending = self._t._normalize(self._pending + text)
        return self._commit()

    def finish(self) -> list[int]:
        """Commit everything held back (flush or close) and start a fresh stream."""
        ids: list[int] = []
        if self._pending:
            for piece, _ in self._t._pieces(self._pending):
                ids.extend(self._t._bpe(piece))
        self._pending = ""
        return ids

    def reset(self) -> None:
        """Drop held-back text (cancel)."""
        self._pending = ""

    def _commit(self) -> list[int]:
        text = self._pending
        pieces = self._t._pieces(text)
        if len(pieces) < 2 and len(text) <= self.max_pending_chars:
            return []
        n = len(text)
        trailing = n
        while trailing > 0 and _is_space(text[trailing - 1]):
            trailing -= 1
        count = 0  # number of leading chunks that are final
        for _, (start, end) in pieces:
            if end >= n or start >= trailing:
                break
            count += 1
        while count > 0 and not self._nfc_boundary(text, pieces[count - 1][1][1]):
            count -= 1
        if count == 0 and n > self.max_pending_chars:
            count = len(pieces) - 1 if len(pieces) > 1 else len(pieces)
        if count == 0:
            return []
        ids: list[int] = []
        for piece, _ in pieces[:count]:
            ids.extend(self._t._bpe(piece))
        cut = pieces[count - 1][1][1]
        self._pending = text[cut:]
        return ids

    def _nfc_boundary(self, text: str, pos: int) -> bool:
        """Whether NFC of text[:pos] + anything == text[:pos] + NFC(anything starting with text[pos:])."""
        cur = text[pos]
        if unicodedata.combining(cur) or unicodedata.category(cur) in ("Mn", "Mc", "Me", "Cn", "Cs"):
            return False
        pair = text[pos - 1] + cur
        return self._t._normalize(pair) == pair


# -------------------------------------------------------------------- loading helpers
def _tokenizer_without_added(tokenizer_json: str) -> tuple[Tokenizer, dict[str, int]]:
    spec = json.loads(tokenizer_json)
    added = {entry["content"]: int(entry["id"]) for entry in spec.get("added_tokens") or []}
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec)), added


def _tokenizer_from_vocab_merges(vocab_path: Path, merges_path: Path) -> Tokenizer:
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    merges: list[tuple[str, str]] = []
    with open(merges_path, encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            line = line.rstrip("\r\n")
            if (index == 0 and line.startswith("#version")) or not line.strip():
                continue
            left, right = line.split()
            merges.append((left, right))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _read_added_tokens(root: Path) -> dict[str, int]:
    added: dict[str, int] = {}
    legacy = root / "added_tokens.json"
    if legacy.is_file():
        added.update({k: int(v) for k, v in json.loads(legacy.read_text(encoding="utf-8")).items()})
    config = root / "tokenizer_config.json"
    if config.is_file():
        decoder = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
        for key, entry in decoder.items():
            content = entry["content"] if isinstance(entry, dict) else str(entry)
            added[content] = int(key)
    return added
