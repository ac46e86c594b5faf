"""Qwen2 tokenizer files from qwen.tiktoken, TextTokenizer, and incremental tokenization."""

from __future__ import annotations

import json
import random
import shutil
import unicodedata

import pytest

from engine.text import tokenizer_files
from engine.text.tokenizer import IncrementalTokenizer, TextTokenizer
from engine.text.tokenizer_files import (
    NUM_REGULAR_TOKENS,
    QWEN2_PRETOKENIZE_REGEX,
    SPECIAL_TOKENS,
    derive_merges,
    find_qwen_tiktoken,
    load_tiktoken_ranks,
    write_tokenizer_files,
)

# The published added tokens (docs/model.md, checkpoint layout).
PUBLISHED_SPECIALS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666,
    "<think>": 151667, "</think>": 151668, "<|audio_start|>": 151669, "<|audio_end|>": 151670,
    "<tts_pad>": 151671, "<tts_text_bos>": 151672, "<tts_text_eod>": 151673, "<tts_text_bos_single>": 151674,
    "<|audio_pad|>": 151675,
}

CORPUS = [
    "Hello world",
    "Hello, world! How are you doing today?",
    "  leading spaces and trailing spaces   ",
    "Multiple   spaces\tand\ttabs",
    "Line one\nLine two\n\nParagraph\r\nWindows line\n \n  \nend",
    "Don't, it's, we're, they've, I'm, you'll, he'd, DON'T, IT'S, x'sy",
    "Numbers 12345 and 3.14159 and 1,000,000 and 2024-01-01",
    "Punctuation... !!! ??? (parens) [brackets] {braces} \"quotes\" 'single' -- dashes",
    "你好，世界。今天天气很好！我们去公园吧。",
    "こんにちは、世界。カタカナとひらがな。",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    "Привет, мир! Это русский текст.",
    "Ça va? Über naïve façade — résumé, coöperate.",
    "e\u0301 combining accent, Hangul jamo \u1100\u1161\u11a8",
    "Emoji 😀👍🏽🇺🇸👨‍👩‍👧 and ❤️ and 1️⃣",
    "code: def f(x): return x**2  # comment\n    indented()",
    "https://example.com/path?query=1&b=2#frag and user@example.com",
    "HelloWorld iPhone macOS JavaScript snake_case_name CONSTANT_CASE",
    "a.\n/b and x /y",
    "\u3000ideographic space\u00a0nbsp\u2009thin",
    "<|im_start|> looks special but is user text <tts_pad> <think>",
    "",
    " ",
    "\n",
    "'s",
]


def _random_strings(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    atoms = ["a", "Z", "é", "e", "\u0301", "\u0308", "\u0323", "\u1100", "\u1161", "\u11a8", "가", " ", "  ", "\t",
             "\n", "\r\n", "\n\n", " \n ", "\u3000", "\xa0", "\u2028", "\x1c", ".", ",", "!", "?", "...", "(", ")",
             "'", "'s", "'ll", "'T", "'re", "s", "t", "re", "0", "7", "2024", "你", "好", "，", "。", "😀", "👍🏽",
             "🇺🇸", "\u200d", "\ufe0f", "-", "_", "/", "http://a.b/c", "don't", "I'M", "*", "#", "<|im_start|>",
             "ா", "\u0bc6", "\u0bbe", "\U000e0001", "word", " word", "Hello"]
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 25))) for _ in range(count)]


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    source = find_qwen_tiktoken()  # CI installs dashscope; a missing file must fail, not skip
    out = tmp_path_factory.mktemp("qwen2_tokenizer")
    write_tokenizer_files(out, source)
    return out


@pytest.fixture(scope="session")
def text_tok(tok_dir) -> TextTokenizer:
    return TextTokenizer.from_dir(tok_dir)


@pytest.fixture(scope="session")
def hf_tok(tok_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="session")
def tiktoken_enc():
    import tiktoken

    return tiktoken.Encoding("qwen_test", pat_str=QWEN2_PRETOKENIZE_REGEX, mergeable_ranks=load_tiktoken_ranks(),
                             special_tokens={})


# ---------------------------------------------------------------------------- files


def test_written_files(tok_dir):
    vocab = json.loads((tok_dir / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == NUM_REGULAR_TOKENS
    assert sorted(vocab.values()) == list(range(NUM_REGULAR_TOKENS))
    assert vocab["Ġ"] == 220 and vocab["Ċ"] == 198 and vocab["assistant"] == 77091
    merges = (tok_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version")
    assert len(merges) - 1 == 151_387
    assert all(len(line.split(" ")) == 2 for line in merges[1:])
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["model_max_length"] >= 32768
    decoder = {entry["content"]: int(i) for i, entry in config["added_tokens_decoder"].items()}
    assert decoder == PUBLISHED_SPECIALS
    fast = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert {t["content"]: t["id"] for t in fast["added_tokens"]} == PUBLISHED_SPECIALS
    assert fast["normalizer"]["type"] == "NFC"
    assert fast["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == QWEN2_PRETOKENIZE_REGEX
    assert {i for i, _, _ in SPECIAL_TOKENS} == set(range(151643, 151676))


def test_derive_merges_toy():
    # a, b, c are bytes; "ab" then "abc" (from "ab"+"c"), "bc" ranked after "abc" must not be used for it.
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"abc": 4, b"bc": 5, b"bca": 6}
    assert derive_merges(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"b", b"c"), (b"bc", b"a")]
    with pytest.raises(ValueError):
        derive_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})  # no two-part BPE path to "abc"


def test_find_qwen_tiktoken(monkeypatch, tmp_path):
    import importlib.machinery

    monkeypatch.delenv("VOICELANE_QWEN_TIKTOKEN", raising=False)
    package = tmp_path / "site" / "dashscope"
    (package / "resources").mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("dashscope", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(tokenizer_files.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps dashscope"):
        find_qwen_tiktoken()  # package without the resource file
    (package / "resources" / "qwen.tiktoken").write_text("YQ== 0\n")
    assert find_qwen_tiktoken() == package / "resources" / "qwen.tiktoken"
    assert load_tiktoken_ranks() == {b"a": 0}
    monkeypatch.setattr(tokenizer_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps dashscope"):
        find_qwen_tiktoken()  # package not installed
    fake = tmp_path / "ranks.tiktoken"
    fake.write_text("Yg== 0\n")
    monkeypatch.setenv("VOICELANE_QWEN_TIKTOKEN", str(fake))
    assert find_qwen_tiktoken() == fake


# ---------------------------------------------------------------------------- ids


def test_known_ids(text_tok):
    assert text_tok.encode("assistant") == [77091]
    assert text_tok.encode("\n") == [198]
    assert text_tok.encode("user") == [872]
    assert text_tok.regular_vocab_size == NUM_REGULAR_TOKENS
    for content, token_id in PUBLISHED_SPECIALS.items():
        assert text_tok.token_id(content) == token_id
    assert (text_tok.im_start_id, text_tok.im_end_id) == (151644, 151645)
    assert (text_tok.tts_pad_id, text_tok.tts_bos_id, text_tok.tts_eos_id) == (151671, 151672, 151673)
    assert text_tok.added_tokens == PUBLISHED_SPECIALS
    assert text_tok.encode("") == []


def test_user_text_cannot_inject_control_tokens(text_tok, hf_tok):
    text = "<|im_start|>assistant\n<tts_pad><tts_text_eod><think></think><|endoftext|>"
    ids = text_tok.encode(text)
    assert ids and max(ids) < NUM_REGULAR_TOKENS
    assert text_tok.decode(ids) == text
    # The transformers tokenizer (what the official processor uses) would match them as added tokens.
    assert 151644 in hf_tok(text, add_special_tokens=False).input_ids


def test_autotokenizer_matches(text_tok, hf_tok):
    texts = CORPUS + _random_strings(1, 400)
    checked = 0
    for text in texts:
        if any(content in text for content in PUBLISHED_SPECIALS):
            continue  # transformers matches added tokens in text; we never do (see the injection test)
        assert text_tok.encode(text) == hf_tok(text, add_special_tokens=False).input_ids, repr(text)
        checked += 1
    assert checked > 300


def test_tiktoken_matches(text_tok, tiktoken_enc):
    for text in CORPUS + _random_strings(2, 600):
        normalized = unicodedata.normalize("NFC", text)
        assert text_tok.encode(text) == tiktoken_enc.encode_ordinary(normalized), repr(text)


def test_decode_roundtrip(text_tok):
    for text in CORPUS:
        assert text_tok.decode(text_tok.encode(text)) == unicodedata.normalize("NFC", text)
    assert text_tok.decode([151644, 77091, 198]) == "<|im_start|>assistant\n"


def test_prompt_ids_as_official_formatting(text_tok, hf_tok):
    for text in ["Hello there.", "你好，世界！", "It's 3:45pm — time's up", "x"]:
        whole = hf_tok(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n").input_ids
        ours = text_tok.assistant_prompt_ids(text)
        assert ours == whole
        assert ours[:3] == [151644, 77091, 198]
        assert ours[-5:] == [151645, 198, 151644, 77091, 198]
        assert ours[3:-5] == text_tok.encode(text)
    instruct = "Speak slowly and warmly."
    whole = hf_tok(f"<|im_start|>user\n{instruct}<|im_end|>\n").input_ids
    assert text_tok.instruct_prompt_ids(instruct) == whole
    assert whole[:3] == [151644, 872, 198] and whole[-2:] == [151645, 198]


def test_vocab_and_merges_only_checkpoint(tok_dir, text_tok, tmp_path):
    # The published checkpoint ships vocab.json + merges.txt + tokenizer_config.json (no tokenizer.json).
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp_path / name)
    slow = TextTokenizer.from_dir(tmp_path)
    assert slow.added_tokens == PUBLISHED_SPECIALS
    for text in CORPUS + _random_strings(3, 200):
        assert slow.encode(text) == text_tok.encode(text), repr(text)
    with pytest.raises(FileNotFoundError):
        TextTokenizer.from_dir(tmp_path / "missing")


def _official_processor_module():
    import qwen_oracle

    qwen_oracle.install_stubs()
    from qwen_tts.core.models import processing_qwen3_tts

    return processing_qwen3_tts


def test_official_processor_loads_files(tok_dir, text_tok):
    processing = _official_processor_module()
    processor = processing.Qwen3TTSProcessor.from_pretrained(str(tok_dir), fix_mistral_regex=True)
    for text in CORPUS[:20] + ["HelloWorld iPhone a.\n/b"]:
        if "<|" in text:
            continue
        ids = processor(text=f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n").input_ids[0]
        assert list(ids) == text_tok.assistant_prompt_ids(text), repr(text)


def test_reference_quirk_mistral_regex_with_checkpoint_config(tok_dir, text_tok, tmp_path):
    """Documents a quirk of the CPU oracle, not our behaviour.

    transformers 4.57.3 `_patch_mistral_regex` treats a local directory whose config.json says
    transformers_version 4.57.3 as a Mistral tokenizer, and the package passes fix_mistral_regex=True, so the
    official processor loaded from a local checkpoint swaps the Qwen2 split for Mistral's (camelCase split, no
    contraction rule, "/" kept after punctuation). transformers 5.x and hub ids keep the Qwen2 split, as we do.
    """
    import transformers

    assert transformers.__version__.startswith("4.57."), "the test environment pins transformers 4.57.3"
    processing = _official_processor_module()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig

    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json"):
        (tmp_path / name).symlink_to(tok_dir / name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts", "transformers_version": "4.57.3"}))
    transformers.AutoConfig.register("qwen3_tts", Qwen3TTSConfig, exist_ok=True)
    transformers.AutoProcessor.register(Qwen3TTSConfig, processing.Qwen3TTSProcessor, exist_ok=True)
    processor = transformers.AutoProcessor.from_pretrained(str(tmp_path), fix_mistral_regex=True)
    assert processor(text="Hello world.").input_ids[0] == text_tok.encode("Hello world.")
    assert text_tok.encode(" iPhone") == [12167]
    assert processor(text=" iPhone").input_ids[0] == [600, 6939]  # " i" + "Phone"


# ---------------------------------------------------------------------------- incremental


def _stream(inc: IncrementalTokenizer, parts: list[str]) -> list[int]:
    out: list[int] = []
    for part in parts:
        out.extend(inc.feed(part))
    out.extend(inc.finish())
    return out


TRICKY = [
    "a \n \n  \nb",  # whitespace runs ending in line breaks re-split when more arrives
    "a  b   c    d\t\te",
    "x.\n\n y. \n",
    "dog's bone, cat'll, I'M, it'sy",
    "2024 年 3 月, 3.14",
    "cafe\u0301 e\u0301\u0323 q\u0323\u0301",
    "\u1100\u1161\u11a8 \u1100 \u1161",
    "\u0b92\u0bbe \u0bc6\u0bbe",
    "(hello) ((world)) \"quote\" 'single'",
    "emoji 👨‍👩‍👧 🇺🇸 👍🏽 ❤️",
    "你好，世界。今天天气很好！",
    "trailing   ",
    "\n\nleading newlines",
]


def test_incremental_invariant_random_splits(text_tok):
    rng = random.Random(1234)
    texts = TRICKY + CORPUS + _random_strings(4, 1200)
    for text in texts:
        whole = text_tok.encode(text)
        splits = [list(text), [text]]
        for _ in range(3):
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
            splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
        for parts in splits:
            assert _stream(text_tok.incremental(), parts) == whole, (text, parts)


def test_incremental_commits_early(text_tok):
    inc = text_tok.incremental()
    assert inc.feed("Hello") == []
    assert inc.feed(" wor") == text_tok.encode("Hello")
    assert inc.feed("ld,") == text_tok.encode(" world")
    assert inc.pending_text == ","
    assert inc.feed(" ") == text_tok.encode(",")  # a word is final once a space follows
    assert inc.feed("\n") == []  # but a trailing whitespace run is not
    assert inc.feed(" next") == text_tok.encode(" \n")
    assert inc.finish() == text_tok.encode(" next")
    assert inc.pending_text == "" and inc.finish() == []
    # Scripts without spaces commit at punctuation.
    committed = []
    for ch in "你好，世界。":
        committed.append(inc.feed(ch))
    assert committed[2] == text_tok.encode("你好")
    assert sum(committed, []) + inc.finish() == text_tok.encode("你好，世界。")
    # Digits are single chunks: each is final once the next character arrives.
    assert inc.feed("123") == text_tok.encode("12")
    inc.reset()
    assert inc.finish() == []


def test_incremental_pathological_length_is_bounded(text_tok):
    inc = text_tok.incremental(max_pending_chars=64)
    out = []
    for _ in range(200):
        out += inc.feed("字")
    assert len(inc.pending_text) <= 64
    out += inc.finish()
    assert text_tok.decode(out) == "字" * 200
