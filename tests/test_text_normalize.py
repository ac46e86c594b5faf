"""LLM-output normalisation (PROTOCOL 1.7): rules, and the same result for every chunking."""

from __future__ import annotations

import random

import pytest

from server.text.normalize import LlmTextNormalizer, normalize_llm_text

CASES = [
    # emphasis
    ("Some **bold** and *italic* and __b__ and _i_ and ~~strike~~ text.",
     "Some bold and italic and b and i and strike text."),
    ("**Note:** this is ***very*** important.", "Note: this is very important."),
    ("word**bold**word", "wordboldword"),
    # kept: multiplication, snake_case, lone markers, approximations
    ("2 * 3 = 6, 2*3, 2 *3, (a+b)*(c+d), 2**8", "2 * 3 = 6, 2*3, 2 *3, (a+b)*(c+d), 2**8"),
    ("snake_case_name and file_name.py and CONSTANT_VALUE", "snake_case_name and file_name.py and CONSTANT_VALUE"),
    ("a _ b, ~5 minutes, x ~~ y", "a _ b, ~5 minutes, x ~~ y"),
    ("Don't stop; it's John's \"quote\" — ok?", "Don't stop; it's John's \"quote\" — ok?"),
    # inline code keeps its text, literally
    ("Run `pip install foo` now.", "Run pip install foo now."),
    ("The `__init__` method, ``a ` b``.", "The __init__ method, a b."),  # backticks are never read
    # fences
    ("Here is code:\n```python\nprint('hi')\nx = 2 * 3\n```\nDone.", "Here is code:\nDone."),
    ("Before\n~~~\ncode\n~~~~\nAfter", "Before\nAfter"),
    ("  ```js\n  let a = 1;\n  ```\nIndented fence.", "Indented fence."),
    ("Text\n```\nunclosed code block", "Text"),
    ("Inline ```triple``` code", "Inline triple code"),
    # block markup
    ("# Title\n## Sub ##\n###### Six\nC# is #1", "Title\nSub\nSix\nC# is #1"),
    ("#hashtag stays", "#hashtag stays"),
    ("> quoted\n>> nested\n> - quoted item", "quoted\nnested\nquoted item"),
    ("- one\n- two\n* three\n+ four\n1. five\n2) six\n10. ten", "one\ntwo\nthree\nfour\nfive\nsix\nten"),
    ("- [ ] todo\n- [x] done", "todo\ndone"),
    ("Intro\n---\n***\n___\n* * *\nEnd", "Intro\nEnd"),
    ("Title\n=====\nBody", "Title\nBody"),
    ("-5 degrees, +3 points, 3.14 is pi, 2024 was good", "-5 degrees, +3 points, 3.14 is pi, 2024 was good"),
    # links, images, URLs
    ("See [the docs](https://example.com/a_(b) \"Title\") here.", "See the docs here."),
    ("Look ![diagram](img.png) below.", "Look below."),
    ("[**Bold link**](x) and [ref][1] and [not a link] (x)", "Bold link and [ref][1] and [not a link] (x)"),
    ("Visit https://example.com/some_path__x?a=1&b=2 or www.example.org/~user today.",
     "Visit https://example.com/some_path__x?a=1&b=2 or www.example.org/~user today."),
    ("<https://auto.link/x> here", "https://auto.link/x here"),
    # HTML
    ("<b>bold</b> and <i class=\"x\">it</i><br/>next<p>para</p>", "bold and it next para"),
    ("a < b, x<y, <3, if a<b and c>d, <notatag>", "a < b, x<y, <3, if a<b and c>d, <notatag>"),
    ("Hidden <!-- comment\nover lines --> gone", "Hidden gone"),
    ("&amp; &lt;tag&gt; &#39;q&#39; &quot;x&quot; AT&T &unknown;", "& <tag> 'q' \"x\" AT&T &unknown;"),
    ("Escaped \\*stars\\* and \\_under\\_ and C:\\path", "Escaped *stars* and _under_ and C:\\path"),
    # emoji
    ("Great job 🎉! Family 👨‍👩‍👧 flag 🇺🇸 🏴󠁧󠁢󠁥󠁮󠁧󠁿 thumbs 👍🏽 heart ❤️ keycap 1️⃣ ✅ done ⭐",
     "Great job! Family flag thumbs heart keycap 1 done"),
    ("🚀 Launch", "Launch"),
    ("I❤️NY, Hi😀!", "I NY, Hi!"),
    ("C = `.../x` and `../a` (see `b`).", "C = .../x and ../a (see b)."),
    ("你好，**世界**！😀", "你好，世界！"),
    ("Hindi क्‍ष keeps its ZWJ", "Hindi क्\u200dष keeps its ZWJ"),
    # whitespace and invisibles
    ("Multiple   spaces\tand\n\n\n\nparagraphs  \n  indented", "Multiple spaces and\nparagraphs\nindented"),
    ("  \n\n  leading and trailing  \n\n ", "leading and trailing"),
    ("zero\u200bwidth\ufeff soft\u00adhyphen \x00nul\x07bell", "zerowidth softhyphen nulbell"),
    ("crlf\r\nline\rbreaks", "crlf\nline\nbreaks"),
    ("", ""),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_cases(text, expected):
    assert normalize_llm_text(text) == expected


def test_none_mode_passes_through():
    normalizer = LlmTextNormalizer("none")
    text = "**bold** `code` 😀 [a](b)\n```\nx\n```  "
    assert normalizer.feed(text[:7]) + normalizer.feed(text[7:]) + normalizer.finish() == text
    with pytest.raises(ValueError):
        LlmTextNormalizer("markdown")


def test_finish_resets_for_next_segment():
    normalizer = LlmTextNormalizer()
    assert normalizer.feed("Intro\n```\ncode ") == "Intro"
    assert normalizer.finish() == ""
    assert normalizer.feed("**Next** segment") == "Next segment"
    assert normalizer.finish() == ""


def test_flush_keeps_an_open_code_fence():
    normalizer = LlmTextNormalizer()
    assert normalizer.feed("Look:\n```py\nx = 1") + normalizer.flush() == "Look:"
    assert normalizer.feed("\ny = 2\n``") + normalizer.flush() == ""  # still inside the fence
    assert normalizer.feed("`\n**Done** now") + normalizer.flush() == "Done now"
    assert normalizer.feed("*Next* segment ") + normalizer.flush() == "Next segment"
    assert normalizer.feed(" again!") + normalizer.finish() == "again!"
    assert LlmTextNormalizer("none").flush() == ""


def test_streams_with_little_hold_back():
    normalizer = LlmTextNormalizer()
    emitted = [normalizer.feed(p) for p in ["Sure", "!", " Here", " is", " **", "bold", "**", " text", " [", "a",
                                            " link", "](", "http://x", ")", ".", "\n", "-", " item"]]
    assert emitted[0] == "Sure"
    assert emitted[2] == "! Here"  # "!" waits one character: it could open an image
    assert emitted[5] == " bold"
    assert emitted[9] == emitted[10] == "" and emitted[13] == " a link"
    assert "".join(emitted) + normalizer.finish() == "Sure! Here is bold text a link.\nitem"


ATOMS = ["a", "b", "h", "w", "x", "word", "snake_case", "你好", "é", "\u0301", "2", "3", "12", " ", "  ", "\t", "\n",
         "\n\n", "\r\n", "\r", "*", "**", "***", "_", "__", "~", "~~", "`", "``", "```", "~~~", "#", "## ", ">", "> ",
         "- ", "+ ", "* ", "1. ", "2)", "---", "===", "[", "]", "(", ")", "![", "](", "[x]", "[ ] ", "<", "</", "<b>",
         "</b>", "<br/>", "<a href=\"x\">", "<!--", "-->", "&", "&amp;", "&#39;", "&lt", "\\", "http://x.y/a_b",
         "https://", "www.", "😀", "👍🏽", "\u200d", "\ufe0f", "🇺", "🇸", "❤", "!", "?", ".", ",", ":", ";", "'", "\"",
         "\x00", "\u200b", "\xa0"]


def test_chunking_invariance():
    rng = random.Random(20240601)
    texts = [text for text, _ in CASES]
    texts += ["".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 30))) for _ in range(4000)]
    for text in texts:
        whole = normalize_llm_text(text)
        assert "\x00" not in whole and not whole.startswith((" ", "\n")) and not whole.endswith((" ", "\n"))
        splits = [list(text)]
        for _ in range(2):
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 6))))
            splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
        for parts in splits:
            normalizer = LlmTextNormalizer()
            streamed = "".join(normalizer.feed(part) for part in parts) + normalizer.finish()
            assert streamed == whole, (text, parts)


def test_holds_gap_only_while_the_space_after_a_word_waits():
    """The pipeline's early commit rests on this: after a word and its space, nothing but whitespace or closing
    punctuation can come out next."""
    n = LlmTextNormalizer("llm")
    assert not n.holds_gap  # nothing seen yet
    n.feed("Hello")
    assert not n.holds_gap  # the word may go on
    n.feed(" ")
    assert n.holds_gap
    n.feed("n")  # (not "w": that may open "www.", which is held back whole)
    assert not n.holds_gap
    n.feed("\n")
    assert n.holds_gap
    assert not LlmTextNormalizer("none").holds_gap


def test_plain_run_regex_is_the_plain_rule_on_every_code_point():
    """The normaliser takes plain text a regex match at a time (_PLAIN_RUN); _plain is the rule, per character.
    Every code point, after a word character and after a space (which decides h/H/w/W, a URL's possible start)."""
    from server.text import normalize as n

    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        for before in ("a", " "):
            assert (n._PLAIN_RUN.match(before + ch, 1).end() == 2) == n._plain(ch, before), (hex(cp), before)
