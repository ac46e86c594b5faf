"""Streaming normalisation of LLM output into speakable text (PROTOCOL 1.7, `text_normalization`).

`LlmTextNormalizer("llm")` removes what a voice should not read out, while text streams in:

- fenced code blocks (``` or ~~~, 3+ at a line start, any indentation) are dropped with their content; a stream
  that ends inside a fence drops the rest;
- inline code keeps its inner text ("run `pip install`" -> "run pip install"): voice agents mention commands and
  identifiers by name, and the backticks are never spoken; inside a code span nothing else is markup;
- emphasis markers `**` `*` `__` `_` `~~` (and runs like `***`) are removed, their text kept. A delimiter run counts
  as markup by CommonMark's flanking rules, looked at locally (runs are not paired, so an unmatched marker is
  dropped as well). Kept literally: a run with whitespace on both sides ("2 * 3", "a ~~ b"), `_` inside a word
  (snake_case, file_name.py), a single `*` between digits or parentheses, even across spaces ("2*3", "2 *3",
  "(a+b)*(c+d)"), a single `~` ("~5 min"). Best effort: "a*b" between letters is read as emphasis and loses the `*`;
  "__init__" outside backticks loses its underscores;
- line starts: `#`..`######` headings (and a heading's closing `#`s), `>` quotes (nested), bullets `-` `*` `+`
  (with a task box `[ ]`/`[x]`), ordered markers `1.` `1)`, and thematic breaks / setext underlines (`---`,
  `***`, `___`, `===`) are removed;
- `[text](url "title")` keeps `text` (itself normalised); images `![alt](url)` are dropped whole; reference links,
  footnotes and other brackets stay as written; bare URLs (`http://`, `https://`, `www.`) pass through untouched
  (no markup is interpreted inside them); `<https://...>` autolinks keep the URL;
- HTML: tags of known HTML elements (`<b>`, `</div>`, `<br/>`, `<a href=...>`) and comments are removed (block
  tags leave a space); `a < b`, `<3`, `x<y` stay; common entities (`&amp;`, `&lt;`, `&#39;`, `&nbsp;`) are decoded;
  backslash escapes (`\\*`) give the literal character;
- emoji and pictographs are dropped: the emoji blocks U+1F000-1FBFF (incl. regional-indicator flags and skin
  tones), misc symbols and dingbats U+2600-27BF, geometric shapes U+25A0-25FF (used as bullets), U+2B00-2BFF and
  the remaining emoji code points, variation selectors, keycap U+20E3, tag characters (subdivision flags), and a
  zero-width joiner that follows an emoji (a ZWJ elsewhere, e.g. in Indic scripts, is kept);
- invisible format characters (zero-width space, BOM, soft hyphen, bidi controls) and control characters are
  dropped; CR LF / CR become LF;
- whitespace: runs of spaces/tabs become one space, any run containing line breaks becomes one "\\n", leading and
  trailing whitespace of the stream is dropped; where removed content (emoji, image, comment) leaves a space before
  closing punctuation the space goes ("Great job 🎉!" -> "Great job!"), and where it sat between two words with no
  space, one is put in ("I❤️NY" -> "I NY").

Ordinary punctuation, apostrophes, digits and every script are kept as written.

Streaming: `feed(chunk)` returns the text that is final now; `finish()` returns the rest and resets the state (the
context's text is complete); `flush()` does the same at a segment end inside a context that goes on, except that
an open fenced code block stays open (its rest is dropped in the next segment; a closing fence split by the flush
still closes it). Text is held back only while a construct is undecided (a delimiter run at
the chunk end, an open `[`, `<`, `&`, a line start, a possible URL, and whitespace until the next visible
character), so the concatenated output is the same for every chunking of the input. Look-ahead is bounded: a link
text must close within 300 characters on its line, a tag within 500, a comment within 5000 characters.

`LlmTextNormalizer("none")` passes text through untouched (`feed` returns its input, `finish` returns "").
"""

from __future__ import annotations

import html
import re
import unicodedata

__all__ = ["LlmTextNormalizer", "normalize_llm_text"]

# Internal: "content was removed here" (emoji, image, comment, code block), so that a space it leaves before closing
# punctuation goes. Removed delimiters (emphasis, backticks, brackets) leave no mark. Input NULs never get here.
_MARK = "\x00"

_HTML_INLINE = frozenset(
    "a abbr b bdi bdo big cite code data del dfn em font i ins kbd mark q rp rt ruby s samp small span strike "
    "strong sub sup time tt u var wbr".split()
)
_HTML_BLOCK = frozenset(
    "address article aside blockquote br caption center col colgroup dd details dialog div dl dt fieldset "
    "figcaption figure footer form h1 h2 h3 h4 h5 h6 header hr img li main nav ol p picture pre section source "
    "summary table tbody td tfoot th thead tr ul video audio iframe input button label select option textarea "
    "html head body title meta link style script".split()
)
_HTML_TAGS = _HTML_INLINE | _HTML_BLOCK
_AUTOLINK_SCHEMES = ("http", "https", "mailto", "ftp")
_TAG_NAME_PREFIXES = frozenset(name[:k] for name in (*_HTML_TAGS, *_AUTOLINK_SCHEMES) for k in range(1, len(name) + 1))
_ENTITY_FULL = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")
_ENTITY_PARTIAL = re.compile(r"&(?:#[0-9]{0,7}|#[xX][0-9a-fA-F]{0,6}|[A-Za-z][A-Za-z0-9]{0,31})?\Z")
_URL_STARTS = ("http://", "https://", "www.")
_CLOSING_PUNCT = frozenset(".,!?;:)]}…。，、！？；：）」』】")
_INVISIBLE = frozenset(
    [0x00AD, 0x200B, 0x200E, 0x200F, 0x2060, 0x2061, 0x2062, 0x2063, 0x2064, 0xFEFF,
     *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
)
_EMOJI_RANGES = (
    (0x1F000, 0x1FBFF),  # mahjong/cards, enclosed alphanumerics (flags), pictographs, emoticons, transport, ...
    (0x2600, 0x27BF),  # misc symbols, dingbats
    (0x25A0, 0x25FF),  # geometric shapes
    (0x2B00, 0x2BFF),  # misc symbols and arrows (⭐ ⬛ ⬅ ...)
    (0x231A, 0x231B), (0x2328, 0x2328), (0x23CF, 0x23CF), (0x23E9, 0x23F3), (0x23F8, 0x23FA),
    (0x2934, 0x2935), (0x3030, 0x3030), (0x303D, 0x303D), (0x3297, 0x3297), (0x3299, 0x3299),
    (0xFE00, 0xFE0F),  # variation selectors
    (0x20E3, 0x20E3),  # combining enclosing keycap
    (0xE0020, 0xE007F),  # tags (subdivision flags)
    (0xE0100, 0xE01EF),  # variation selectors supplement
)
_NEED = object()  # a step needs more input to decide
_FAIL = object()  # a construct is not what it looked like


def _is_emoji(ch: str) -> bool:
    cp = ord(ch)
    if cp < 0x20E3:
        return False
    return any(lo <= cp <= hi for lo, hi in _EMOJI_RANGES)


def _is_ws(ch: str) -> bool:
    return ch == "" or ch.isspace()


def _is_punct(ch: str) -> bool:
    return ch != "" and unicodedata.category(ch)[0] in "PS"


def _is_alnum(ch: str) -> bool:
    return ch != "" and (ch.isalnum() or ch == "_")


def normalize_llm_text(text: str) -> str:
    """Whole-text form of `LlmTextNormalizer("llm")`."""
    normalizer = LlmTextNormalizer()
    return normalizer.feed(text) + normalizer.finish()


class _Whitespace:
    """Last stage: collapses whitespace and removal marks; emits a character once the next visible one is known."""

    def __init__(self) -> None:
        self.started = False
        self.gap_space = False
        self.gap_newline = False
        self.gap_mark = False
        self.last = ""
        self.out: list[str] = []

    def push(self, ch: str) -> None:
        if ch == _MARK:
            self.gap_mark = True
        elif ch in "\n\u2028\u2029":
            self.gap_newline = True
        elif ch.isspace():
            self.gap_space = True
        else:
            if self.started:
                if self.gap_newline:
                    self.out.append("\n")
                elif self.gap_space and not (self.gap_mark and ch in _CLOSING_PUNCT):
                    self.out.append(" ")
                elif self.gap_mark and not self.gap_space and self.last.isalnum() and ch.isalnum():
                    self.out.append(" ")  # "I❤️NY" -> "I NY"
            self.out.append(ch)
            self.last = ch
            self.started = True
            self.gap_space = self.gap_newline = self.gap_mark = False

    def push_run(self, text: str) -> None:
        """push() of each character of a plain run (no removal mark): its words go out whole."""
        for word in _WORDS_AND_GAPS.findall(text):
            self.push(word[0])
            if len(word) > 1:
                if word[0].isspace():
                    for ch in word[1:]:
                        self.push(ch)
                else:  # after a visible character with no gap, push() would only append
                    self.out.append(word[1:])
                    self.last = word[-1]

    def take(self) -> str:
        text = "".join(self.out)
        self.out.clear()
        return text


class LlmTextNormalizer:
    """Streaming markdown/emoji clean-up of LLM text; see the module docstring for the exact rules."""

    def __init__(self, mode: str = "llm"):
        if mode not in ("llm", "none"):
            raise ValueError(f"text_normalization must be 'llm' or 'none', not {mode!r}")
        self.mode = mode
        self.reset()

    def reset(self) -> None:
        """Drop held-back text and state (cancel; also the start of a segment)."""
        self._buf = ""
        self._pos = 0
        self._state = "line"  # "line" (at a line start), "inline", "fence"
        self._fence: tuple[str, int] = ("`", 3)
        self._code = 0  # backtick count of the open inline code span, 0 outside
        self._heading = False
        self._prev = ""  # last input character consumed on this line ("" = line start)
        self._prev_visible = ""  # last non-space input character on this line
        self._prev_emoji = False
        self._ws = _Whitespace()

    # ------------------------------------------------------------------ public
    def feed(self, text: str) -> str:
        if self.mode == "none":
            return text
        if text:
            self._buf = self._buf[self._pos:] + text
            self._pos = 0
            self._run(eof=False)
        return self._ws.take()

    def finish(self) -> str:
        """Everything still held back, as the end of the text; then a fresh state (next segment)."""
        return self._end(keep_fence=False)

    def flush(self) -> str:
        """End of a segment in a context that goes on (a `flush` message): like `finish()`, except that an open
        fenced code block stays open, so the rest of the block, arriving in the next segment, is still dropped."""
        return self._end(keep_fence=True)

    def _end(self, keep_fence: bool) -> str:
        if self.mode == "none":
            return ""
        self._buf, self._pos = self._buf[self._pos:], 0
        self._run(eof=False)
        in_fence = keep_fence and self._state == "fence"
        if not in_fence:
            self._run(eof=True)
        out, rest, fence = self._ws.take(), self._buf[self._pos:], self._fence
        self.reset()
        if in_fence:
            self._state, self._fence, self._buf = "fence", fence, rest
        return out

    @property
    def holds_gap(self) -> bool:
        """The whitespace after a word is held back, waiting for the next visible character: whatever comes out
        next starts with a space, a line break or closing punctuation (or is nothing, at the end), never a
        letter."""
        ws = self._ws
        return not ws.out and ws.started and (ws.gap_space or ws.gap_newline)

    # ------------------------------------------------------------------ driver
    def _run(self, eof: bool) -> None:
        steps = {"line": self._line_start, "fence": self._fence_line, "inline": self._inline}
        while self._pos < len(self._buf):
            if steps[self._state](eof) is _NEED:
                return

    def _emit(self, text: str) -> None:
        for ch in text:
            self._ws.push(ch)

    def _take(self, count: int, text: str = "") -> None:
        """Advance over `count` input characters (tracking the flanking context) and emit `text` in their place;
        None, so that a step can end with `return self._take(...)`."""
        taken = self._buf[self._pos:self._pos + count]
        if taken:
            self._prev = taken[-1]
            visible = taken.rstrip()  # str.rstrip() strips exactly what str.isspace() calls space
            if visible:
                self._prev_visible = visible[-1]
        self._pos += count
        self._emit(text)

    def _newline(self, count: int) -> None:
        self._pos += count
        self._emit("\n")
        self._state = "line"
        self._code = 0
        self._heading = False
        self._prev = self._prev_visible = ""
        self._prev_emoji = False

    # ------------------------------------------------------------------ block level
    def _line_start(self, eof: bool):
        buf, n = self._buf, len(self._buf)
        j = _skip_spaces(buf, self._pos)
        if j == n:
            if not eof:
                return _NEED
            self._pos = n
            return None
        c = buf[j]
        if c in "`~":
            run = _run_length(buf, j, c)
            if j + run == n and not eof:
                return _NEED
            if run >= 3:
                nl = buf.find("\n", j)
                if nl < 0 and not eof:
                    return _NEED
                end = nl if nl >= 0 else n
                if not (c == "`" and "`" in buf[j + run:end]):
                    self._fence = (c, run)
                    self._state = "fence"
                    self._pos = end + 1 if nl >= 0 else n
                    self._emit(_MARK)
                    return None
        if c in "-*_=":
            k, count = j, 0
            while k < n and (buf[k] == c or buf[k] in " \t"):
                count += buf[k] == c
                k += 1
            if k == n and not eof:
                return _NEED
            if (k == n or buf[k] in "\r\n") and count >= 3:
                return self._inline_from(k)  # the line break itself is handled inline
        if c == "#":
            run = _run_length(buf, j, "#")
            if j + run == n and not eof:
                return _NEED
            if run <= 6 and (j + run == n or buf[j + run] in " \t\r\n"):
                self._heading = True
                return self._inline_from(j + run)
        elif c == ">":
            self._pos = j + 1
            return None  # still at a line start: quotes nest, and may hold lists or headings
        elif c in "-*+":
            if j + 1 == n and not eof:
                return _NEED
            if j + 1 == n or buf[j + 1] in " \t\r\n":
                k = _skip_spaces(buf, j + 1)
                if k == n and not eof:
                    return _NEED  # a task box may follow
                box = buf[k:k + 4]
                if k < n and buf[k] == "[":
                    if len(box) < 4 and not eof and _is_task_box_prefix(box):
                        return _NEED
                    if _is_task_box(box) or (len(box) == 3 and eof and _is_task_box(box + " ")):
                        k += 3
                return self._inline_from(k)
        elif c.isdigit() and c.isascii():
            k = j
            while k < n and buf[k].isascii() and buf[k].isdigit():
                k += 1
            if k == n and not eof:
                return _NEED
            if k - j <= 9 and k < n and buf[k] in ".)":
                if k + 1 == n and not eof:
                    return _NEED
                if k + 1 == n or buf[k + 1] in " \t\r\n":
                    return self._inline_from(k + 1)
        return self._inline_from(self._pos)

    def _inline_from(self, pos: int) -> None:
        """The line's block markers (if any) end before `pos`: the rest of the line is inline text."""
        self._pos = pos
        self._state = "inline"

    def _fence_line(self, eof: bool):
        buf, i = self._buf, self._pos
        nl = buf.find("\n", i)
        if nl < 0 and not eof:
            return _NEED
        end = nl if nl >= 0 else len(buf)
        line = buf[i:end].strip(" \t\r")
        char, length = self._fence
        if len(line) >= length and line == char * len(line):
            self._state = "line"
            self._emit("\n")
        self._pos = end + 1 if nl >= 0 else end
        return None

    # ------------------------------------------------------------------ inline level
    def _inline(self, eof: bool):
        buf, i, n = self._buf, self._pos, len(self._buf)
        c = buf[i]
        if c == "\n":
            self._newline(1)
            return None
        if c == "\r":
            if i + 1 == n and not eof:
                return _NEED
            self._newline(2 if i + 1 < n and buf[i + 1] == "\n" else 1)
            return None
        if ord(c) in _INVISIBLE or (unicodedata.category(c) == "Cc" and not c.isspace()):
            self._pos += 1
            return None
        if _is_emoji(c):
            self._prev_emoji = True
            return self._take(1, _MARK)
        if c == "\u200d" and self._prev_emoji:
            return self._take(1)
        self._prev_emoji = False
        if c == "`":
            run = _run_length(buf, i, "`")
            if i + run == n and not eof:
                return _NEED
            if not self._code:
                self._code = run
            elif run == self._code:
                self._code = 0
            return self._take(run)
        if self._code:
            return self._take(1, c)
        if c == "\\":
            if i + 1 == n and not eof:
                return _NEED
            nxt = buf[i + 1] if i + 1 < n else ""
            if nxt and nxt.isascii() and _is_punct(nxt):
                return self._take(2, nxt)
            return self._take(1, c)
        if c in "*_~":
            return self._delimiter(c, eof)
        if c == "#" and self._heading:
            return self._closing_hashes(eof)
        if c == "!":
            if i + 1 == n and not eof:
                return _NEED
            if i + 1 < n and buf[i + 1] == "[":
                found = _parse_link(buf, i + 1, eof)
                if found is _NEED:
                    return _NEED
                if found is not _FAIL:
                    return self._take(found[0] - i, _MARK)
            return self._take(1, c)
        if c == "[":
            found = _parse_link(buf, i, eof)
            if found is _NEED:
                return _NEED
            if found is _FAIL:
                return self._take(1, c)
            end, text = found
            # The link text takes the link's place and is normalised like any text.
            self._buf = text + buf[end:]
            self._pos = 0
            return None
        if c == "<":
            return self._angle(eof)
        if c == "&":
            tail = buf[i:i + 40]
            match = _ENTITY_FULL.match(tail)
            if match:
                decoded = html.unescape(match.group(0))
                if decoded != match.group(0):
                    return self._take(match.end(), decoded)
            elif not eof and n - i < 40 and _ENTITY_PARTIAL.match(tail):
                return _NEED
            return self._take(1, c)
        if c in "hHwW" and not _is_alnum(self._prev):
            return self._url(eof)
        # Plain text: take the run up to the next character that could start something (one regex match, not a
        # Python step per character: this loop is most of a request's text time).
        k = _PLAIN_RUN.match(buf, i + 1).end()
        self._take(k - i)
        self._ws.push_run(buf[i:k])
        return None

    def _delimiter(self, c: str, eof: bool):
        buf, i, n = self._buf, self._pos, len(self._buf)
        run = _run_length(buf, i, c)
        if i + run == n and not eof:
            return _NEED
        nxt = buf[i + run] if i + run < n else ""
        prv = self._prev
        left = not _is_ws(nxt) and (not _is_punct(nxt) or _is_ws(prv) or _is_punct(prv))
        right = not _is_ws(prv) and (not _is_punct(prv) or _is_ws(nxt) or _is_punct(nxt))
        if c == "_":
            markup = (left and (not right or _is_punct(prv))) or (right and (not left or _is_punct(nxt)))
        elif c == "~":
            markup = run >= 2 and (left or right)
        else:
            markup = left or right
            if markup and run <= 2:
                k = _skip_spaces(buf, i + run)
                if k == n and not eof:
                    return _NEED
                after = buf[k] if k < n else ""
                before = self._prev_visible
                if (before.isdigit() or before == ")") and (after.isdigit() or after == "("):
                    markup = False  # multiplication or power: 2*3, 2 *3, (a)*(b), 2**8
        return self._take(run, "" if markup else c * run)

    def _closing_hashes(self, eof: bool):
        buf, i, n = self._buf, self._pos, len(self._buf)
        k = _skip_spaces(buf, i + _run_length(buf, i, "#"))
        if k == n and not eof:
            return _NEED
        if _is_ws(self._prev) and (k == n or buf[k] in "\r\n"):
            return self._take(k - i)
        run = _run_length(buf, i, "#")
        return self._take(run, "#" * run)

    def _angle(self, eof: bool):
        buf, i = self._buf, self._pos
        found = _parse_angle(buf, i, eof)
        if found is _NEED:
            return _NEED
        if found is _FAIL:
            return self._take(1, "<")
        end, kind, payload = found
        return self._take(end - i, {"autolink": payload, "block": " ", "drop": _MARK}.get(kind, ""))  # mark: ""

    def _url(self, eof: bool):
        buf, i, n = self._buf, self._pos, len(self._buf)
        head = buf[i:i + 8].lower()
        start = next((s for s in _URL_STARTS if head.startswith(s)), None)
        if start is None:
            if not eof and n - i < 8 and any(s.startswith(head) for s in _URL_STARTS):
                return _NEED
            return self._take(1, buf[i])
        k = i + len(start)
        while k < n and not (buf[k].isspace() or buf[k] in '<>"`*' or _is_emoji(buf[k])
                             or unicodedata.category(buf[k]) == "Cc"):
            k += 1
        if k == n and not eof:
            return _NEED
        return self._take(k - i, buf[i:k])


# ---------------------------------------------------------------------- helpers
_SPECIAL = frozenset("\n\r`\\*_~#![<&")


def _plain_run_pattern() -> re.Pattern:
    """A run of characters that `_plain` passes, as one regex: never special, emoji, a ZWJ, invisible or a control
    character; h/H/w/W only after a word character (re's \\w is str.isalnum() or "_", _is_alnum's test)."""
    def char(cp: int) -> str:
        return re.escape(chr(cp))

    never = [char(ord(c)) for c in sorted(_SPECIAL | set("hHwW\u200d"))]
    never += [f"{char(lo)}-{char(hi)}" for lo, hi in ((0x00, 0x1F), (0x7F, 0x9F), *_EMOJI_RANGES)]
    never += [char(cp) for cp in sorted(_INVISIBLE)]
    return re.compile(f"(?:[^{''.join(never)}]|(?<=\\w)[hHwW])*")


_PLAIN_RUN = _plain_run_pattern()
_WORDS_AND_GAPS = re.compile(r"\S+|\s+")


def _plain(ch: str, before: str) -> bool:
    """Whether `ch` (following `before`) can be emitted as plain text without a closer look: the readable rule that
    _PLAIN_RUN implements (tests/test_text_normalize.py holds them equal on every code point)."""
    if ch in _SPECIAL or _is_emoji(ch) or ch == "\u200d":
        return False
    if ch in "hHwW" and not _is_alnum(before):
        return False
    return not (ord(ch) in _INVISIBLE or unicodedata.category(ch) == "Cc")


def _run_length(buf: str, i: int, ch: str) -> int:
    k = i
    while k < len(buf) and buf[k] == ch:
        k += 1
    return k - i


def _is_task_box(box: str) -> bool:
    return len(box) == 4 and box[0] == "[" and box[1] in " xX" and box[2] == "]" and box[3] in " \t\r\n"


def _is_task_box_prefix(box: str) -> bool:
    """Whether a short `box` ("[", "[x", "[x]") can still become a task box."""
    return (box[:1] == "[" and (len(box) < 2 or box[1] in " xX") and (len(box) < 3 or box[2] == "]")
            and len(box) < 4)


def _parse_link(buf: str, i: int, eof: bool):
    """`[text](dest "title")` starting at buf[i] == "[": (end, text), _FAIL or _NEED."""
    n = len(buf)
    more = _FAIL if eof else _NEED
    k = i + 1
    while True:
        if k == n:
            return more
        ch = buf[k]
        if ch == "]":
            break
        if ch in "[\r\n" or k - i > 300:
            return _FAIL
        k += 1
    text = buf[i + 1:k]
    k += 1
    if k == n:
        return more
    if buf[k] != "(":
        return _FAIL
    k = _skip_spaces(buf, k + 1)
    if k == n:
        return more
    if buf[k] == "<":
        k += 1
        while k < n and buf[k] not in ">\r\n<":
            k += 1
        if k == n:
            return more
        if buf[k] != ">":
            return _FAIL
        k += 1
    else:
        depth = 0
        start = k
        while k < n:
            ch = buf[k]
            if ch.isspace() or (ch == ")" and depth == 0):
                break
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
            k += 1
            if k - start > 2000:
                return _FAIL
        if k == n:
            return more
    spaced = k
    k = _skip_spaces(buf, k)
    if k == n:
        return more
    if buf[k] in "\"'(" and k > spaced:
        closer = ")" if buf[k] == "(" else buf[k]
        k += 1
        while k < n and buf[k] != closer and buf[k] not in "\r\n":
            k += 1
        if k == n:
            return more
        if buf[k] != closer:
            return _FAIL
        k = _skip_spaces(buf, k + 1)
        if k == n:
            return more
    if buf[k] != ")":
        return _FAIL
    return k + 1, text


def _skip_spaces(buf: str, k: int) -> int:
    while k < len(buf) and buf[k] in " \t":
        k += 1
    return k


def _parse_angle(buf: str, i: int, eof: bool):
    """At "<": (end, kind, payload) for a comment/tag/autolink, _FAIL or _NEED. kind: drop (comment), mark (inline
    tag), block (block tag), autolink."""
    n = len(buf)
    more = _FAIL if eof else _NEED
    head = buf[i:i + 4]
    if "<!--".startswith(head) and len(head) < 4:
        return more
    if head == "<!--":
        end = buf.find("-->", i + 4)
        if end >= 0 and end - i <= 5000:
            return end + 3, "drop", ""
        return more if end < 0 and n - i <= 5000 else _FAIL
    k = i + 1
    closing = k < n and buf[k] == "/"
    if closing:
        k += 1
    start = k
    while k < n and buf[k].isascii() and buf[k].isalnum():
        k += 1
    name = buf[start:k].lower()
    if k == n:
        if not name and not eof:
            return _NEED
        return more if name in _TAG_NAME_PREFIXES else _FAIL
    if not name:
        return _FAIL
    if buf[k] == ":" and not closing and name in _AUTOLINK_SCHEMES:
        end = k + 1
        while end < n and not buf[end].isspace() and buf[end] not in "<>":
            end += 1
        if end == n:
            return more if end - i <= 2000 else _FAIL
        if buf[end] != ">" or end == k + 1:
            return _FAIL
        return end + 1, "autolink", buf[i + 1:end]
    if name not in _HTML_TAGS:
        return _FAIL
    end = _scan_tag_rest(buf, k, i + 500)
    if end is _NEED:
        return more
    if end is _FAIL:
        return _FAIL
    return end, ("mark" if name in _HTML_INLINE else "block"), ""


def _scan_tag_rest(buf: str, k: int, limit: int):
    """After a tag name: attributes `name=value` (values required, so prose like "a<b and c>d" is no tag), an
    optional "/", then ">". Returns the index after ">", _FAIL, or _NEED when the text ends while still valid."""
    n = len(buf)
    while True:
        if k > limit:
            return _FAIL
        if k == n:
            return _NEED
        ch = buf[k]
        if ch == ">":
            return k + 1
        if ch == "/":
            if k + 1 == n:
                return _NEED
            return k + 2 if buf[k + 1] == ">" else _FAIL
        if ch not in " \t":
            return _FAIL
        k = _skip_spaces(buf, k)
        if k == n:
            return _NEED
        if buf[k] in ">/":
            continue
        start = k
        while k < n and (buf[k].isascii() and (buf[k].isalnum() or buf[k] in "-_:.")):
            k += 1
        if k == n:
            return _NEED
        if k == start:
            return _FAIL
        k = _skip_spaces(buf, k)
        if k == n:
            return _NEED
        if buf[k] != "=":
            return _FAIL
        k = _skip_spaces(buf, k + 1)
        if k == n:
            return _NEED
        if buf[k] in "\"'":
            close = buf.find(buf[k], k + 1)
            newline = buf.find("\n", k + 1)
            if close < 0:
                return _NEED if newline < 0 and n <= limit else _FAIL
            if 0 <= newline < close:
                return _FAIL
            k = close + 1
        else:
            start = k
            while k < n and not buf[k].isspace() and buf[k] not in "\"'=<>`":
                k += 1
            if k == start:
                return _FAIL
