"""Qwen2 text-tokenizer files for checkpoints we build ourselves (random weights, tests, benchmarks).

A published Qwen3-TTS checkpoint ships the Qwen2 byte-level BPE tokenizer (`vocab.json`, `merges.txt`,
`tokenizer_config.json`). Its regular tokens are exactly the BPE of `qwen.tiktoken` (ids equal ranks), which the
`dashscope` wheel carries as a resource file. `write_tokenizer_files()` turns those ranks into the files a Qwen2
checkpoint holds, plus a `tokenizer.json` for the fast tokenizer, so that `transformers.AutoTokenizer`, the
official `qwen_tts` processor and our own `engine.text.tokenizer.TextTokenizer` all load them.

Only the resource file of dashscope is read; the package itself is never imported (it pulls a web stack).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
from functools import lru_cache
from pathlib import Path

__all__ = [
    "QWEN2_PRETOKENIZE_REGEX",
    "SPECIAL_TOKENS",
    "NUM_REGULAR_TOKENS",
    "bytes_to_unicode",
    "derive_merges",
    "find_qwen_tiktoken",
    "load_tiktoken_ranks",
    "tokenizer_json_dict",
    "write_tokenizer_files",
]

# The Qwen2 pre-tokenizer split (transformers' Qwen2 tokenizer and the published tokenizer.json use this pattern).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

NUM_REGULAR_TOKENS = 151_643

# (id, content, special). "special" follows the Qwen2.5/Qwen3 convention: tool/think/fim/repo markers are added
# tokens that are not special (they survive skip_special_tokens); the chat, vision and audio/TTS markers are special.
SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
    (151669, "<|audio_start|>", True),
    (151670, "<|audio_end|>", True),
    (151671, "<tts_pad>", True),
    (151672, "<tts_text_bos>", True),
    (151673, "<tts_text_eod>", True),
    (151674, "<tts_text_bos_single>", True),
    (151675, "<|audio_pad|>", True),
)

MODEL_MAX_LENGTH = 131072

_ENV_OVERRIDE = "VOICELANE_QWEN_TIKTOKEN"


def find_qwen_tiktoken() -> Path:
    """Path of `qwen.tiktoken` (the Qwen BPE ranks) inside the installed `dashscope` package.

    `$VOICELANE_QWEN_TIKTOKEN` overrides the lookup. The package is located with `importlib.util.find_spec`,
    which does not execute it.
    """
    override = os.environ.get(_ENV_OVERRIDE)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"${_ENV_OVERRIDE} points to {path}, which is not a file")
        return path
    fix = ("install it with `pip install --no-deps dashscope` (only its resource file "
           "dashscope/resources/qwen.tiktoken is read), or set $" + _ENV_OVERRIDE + " to a qwen.tiktoken file")
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("qwen.tiktoken not found: the `dashscope` package is not installed; " + fix)
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"qwen.tiktoken not found under {list(spec.submodule_search_locations)} (resources/qwen.tiktoken); " + fix
    )


def load_tiktoken_ranks(path: str | os.PathLike | None = None) -> dict[bytes, int]:
    """Read a `.tiktoken` file (lines `<base64 token> <rank>`) into {token bytes: rank}."""
    path = Path(path) if path is not None else find_qwen_tiktoken()
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as handle:
        for line in handle:
            if not line.strip():
                continue
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: every byte value -> one printable unicode character.

    Bytes that are printable Latin-1 characters map to themselves; the other 68 map, in byte order, to
    U+0100 onwards (so the space byte 0x20 becomes "Ġ" and the newline 0x0A becomes "Ċ").
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    mapping: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in kept:
            mapping[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(mapping.items()))


def _final_split(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """Byte-pair merge `token` using only merges whose result ranks below `max_rank` (tiktoken's algorithm)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank = max_rank
        best_index = -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank = rank
                best_index = i
        if best_index < 0:
            break
        parts[best_index:best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list that makes rank-ordered BPE reproduce tiktoken: one merge per multi-byte token, in rank order.

    For a token of rank r, byte-pair merging its bytes with the merges of rank < r stops at exactly two parts; that
    pair is the merge that creates the token. Single bytes are the base alphabet and need no merge.
    """
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        # Fast path: most tokens have a single split into two lower-ranked tokens, which must be the merge.
        candidates = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            lr, rr = ranks.get(left), ranks.get(right)
            if lr is not None and rr is not None and lr < rank and rr < rank:
                candidates.append((left, right))
                if len(candidates) > 1:
                    break
        if len(candidates) == 1:
            merges.append(candidates[0])
            continue
        parts = _final_split(token, ranks, rank)
        if len(parts) != 2:
            raise ValueError(f"token of rank {rank} ({token!r}) is not reachable by BPE from lower ranks: {parts}")
        merges.append((parts[0], parts[1]))
    return merges


@lru_cache(maxsize=2)
def _vocab_and_merges(path: str) -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    ranks = load_tiktoken_ranks(path)
    if len(ranks) != NUM_REGULAR_TOKENS or sorted(ranks.values()) != list(range(NUM_REGULAR_TOKENS)):
        raise ValueError(f"{path}: expected ranks 0..{NUM_REGULAR_TOKENS - 1}, found {len(ranks)} tokens")
    table = bytes_to_unicode()

    def to_unicode(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {to_unicode(token): rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])}
    merges = tuple((to_unicode(a), to_unicode(b)) for a, b in derive_merges(ranks))
    return vocab, merges


def _added_token_entry(content: str, special: bool) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


def tokenizer_json_dict(vocab: dict[str, int], merges: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> dict:
    """The fast-tokenizer description (`tokenizer.json`) of the Qwen2 tokenizer for the given vocab and merges."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, **_added_token_entry(content, special)} for i, content, special in SPECIAL_TOKENS],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX}, "behavior": "Isolated",
                 "invert": False},
                byte_level,
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for a, b in merges],
        },
    }


def tokenizer_config_dict() -> dict:
    """`tokenizer_config.json` as a Qwen2/Qwen3 checkpoint writes it (no chat template: prompts are built in code)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): _added_token_entry(content, special) for i, content, special in SPECIAL_TOKENS
        },
        "additional_special_tokens": [content for i, content, special in SPECIAL_TOKENS if special and i != 151643],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_files(
    out_dir: str | os.PathLike, tiktoken_path: str | os.PathLike | None = None
) -> dict[str, Path]:
    """Write `vocab.json`, `merges.txt`, `tokenizer_config.json` and `tokenizer.json` into `out_dir`.

    The regular tokens come from `qwen.tiktoken` (`tiktoken_path`, default `find_qwen_tiktoken()`); ids equal the
    tiktoken ranks, merges are derived so that BPE reproduces tiktoken exactly, and the 33 added tokens take their
    published ids 151643..151675. Derivation is cached per process. Returns {file name: path}.
    """
    source = str(Path(tiktoken_path) if tiktoken_path is not None else find_qwen_tiktoken())
    vocab, merges = _vocab_and_merges(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}

    def dump(name: str, text: str) -> None:
        path = out / name
        path.write_text(text, encoding="utf-8")
        written[name] = path

    dump("vocab.json", json.dumps(vocab, ensure_ascii=False, separators=(",", ":")))
    dump("merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    dump("tokenizer_config.json", json.dumps(tokenizer_config_dict(), ensure_ascii=False, indent=2) + "\n")
    dump("tokenizer.json", json.dumps(tokenizer_json_dict(vocab, merges), ensure_ascii=False, indent=None))
    return written
