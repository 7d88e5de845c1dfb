"""Markdown as a reader would say it: the text of LLM output without its markup.

Parsed with markdown-it-py (CommonMark plus tables and strikethrough); indented code blocks are off, since plain
text indented by four spaces is far more common in what is spoken than code. Each block (heading, paragraph, list
item, table row, quote) becomes a sentence of its own, ended with a full stop when it has no end punctuation, so
the splitter and the model pause where a reader would. Emphasis, heading marks, list bullets, link targets and
struck-out text are not read; a link reads as its text, an image as its alt text, inline code as its content, a
table row as its cells in order. Fenced code blocks, rules and HTML markup are skipped (a skipped code block is
noted; text that is only code is read as written); CosyVoice's control tags (`<strong>`, `[laughter]`,
`<|endofprompt|>`) pass through unchanged.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass

_END_PUNCT = ".?!;:。？！；：…"
_CLOSERS = "\"”’'」』）)》】"
_SPECIAL_END_RE = re.compile(r"<\|[^<>|\s]+\|>$")
_CJK_RE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
# markup worth parsing: emphasis, headings, lists, quotes, tables, code, links, rules, HTML
_MARKUP_RE = re.compile(r"[*_`#|>\[~<]|^\s*(?:[-+]|\d+[.)])\s|^\s*(?:-{3,}|={3,})\s*$", re.MULTILINE)
_CONTROL_TAG_RE = re.compile(r"</?(?:strong|breath|laughter)>|<\|[^<>|\s]+\|>", re.IGNORECASE)
_LINE_BREAK_TAG_RE = re.compile(r"<br\s*/?>", re.IGNORECASE)
_HTML_TAG_RE = re.compile(r"</?[A-Za-z][^<>]*>")
# What counts as markup where a "<" stands: an HTML tag LLMs write (with name="value" attributes or none) or a
# control tag; any other "<" is text ("if a<b and c>d"), escaped so the parser keeps it
_TAG_AT_RE = re.compile(r"<(?:/?(?:a|b|i|u|s|em|strong|code|pre|br|hr|p|div|span|sub|sup|del|ins|mark|small|kbd|"
                        r"h[1-6]|ul|ol|li|table|thead|tbody|tr|td|th|blockquote|img|breath|laughter)"
                        r"(?:\s+[\w:-]+\s*=\s*(?:\"[^\"]*\"|'[^']*'|[^\s\"'<>]+))*\s*/?>|\|[^<>|\s]+\|>)",
                        re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Spoken:
    """`markdown_to_speech`'s result: the text to read and what was left out (one note per kind)."""

    text: str
    notes: tuple[str, ...] = ()


@functools.cache
def _parser():  # -> markdown_it.MarkdownIt
    from markdown_it import MarkdownIt  # imported lazily: no work at import

    return MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"]).disable("code")


def is_silent(text: str) -> bool:
    """Nothing but punctuation, symbols and white space."""
    return all(ch.isspace() or unicodedata.category(ch)[0] in "PS" for ch in text)


def looks_like_markdown(text: str) -> bool:
    """Whether `text` holds anything markdown could mean; plain text is returned as it is, unparsed."""
    return _MARKUP_RE.search(text) is not None


def _end(sentence: str) -> str:
    """The sentence with end punctuation (a closing quote or bracket may follow it; a trailing `<|...|>` special
    stays last)."""
    sentence = sentence.strip()
    if not sentence or sentence.rstrip(_CLOSERS)[-1:] in tuple(_END_PUNCT) or _SPECIAL_END_RE.search(sentence):
        return sentence
    return sentence + ("。" if _CJK_RE.match(sentence[-1]) else ".")


def _escape_stray_angles(text: str) -> str:
    head, *rest = text.split("<")
    return head + "".join(("<" if _TAG_AT_RE.match("<" + piece) else "&lt;") + piece for piece in rest)


def _html(raw: str) -> str:
    """HTML read as its text: control tags kept, `<br>` a space, any other tag dropped."""
    raw = _LINE_BREAK_TAG_RE.sub(" ", raw)
    return _HTML_TAG_RE.sub(lambda m: m.group() if _CONTROL_TAG_RE.fullmatch(m.group()) else "", raw)


def _inline(token) -> str:  # token: markdown_it.token.Token of type "inline"
    out: list[str] = []
    struck = 0  # inside ~~struck-out~~ text, which is not read
    for child in token.children or ():
        kind = child.type
        struck += (kind == "s_open") - (kind == "s_close")
        if struck:
            continue
        if kind in ("text", "code_inline"):
            out.append(child.content)
        elif kind in ("softbreak", "hardbreak"):
            out.append(" ")
        elif kind == "image":
            out.append(child.content)  # the alt text
        elif kind == "html_inline":
            out.append(_html(child.content))
    return re.sub(r"[ \t]+", " ", "".join(out)).strip()


def markdown_to_speech(text: str) -> Spoken:
    """`text` (markdown or plain) -> what a reader would say, one block a sentence (see the module docstring)."""
    if not looks_like_markdown(text):
        return Spoken(text)
    sentences: list[str] = []
    notes: list[str] = []
    row: list[str] = []
    code: list[str] = []
    ordered: list[int] = []  # item counts of the open ordered lists (a one-item "list" keeps its number)
    tokens = _parser().parse(_escape_stray_angles(text))
    for i, token in enumerate(tokens):
        kind = token.type
        if kind == "inline":
            content = _inline(token)
            if tokens[i - 1].type in ("th_open", "td_open"):
                row.append(content)
            elif content:
                prefix = ""
                if ordered and ordered[-1] == 1 and tokens[i - 2].type == "list_item_open":
                    prefix = f"{tokens[i - 2].info}{tokens[i - 2].markup} "
                sentences.append(_end(prefix + content))
        elif kind == "ordered_list_open":
            ordered.append(_count_items(tokens, i))
        elif kind == "ordered_list_close":
            ordered.pop()
        elif kind == "tr_close":
            cells = [c for c in row if c]
            if cells:
                sentences.append(_end(", ".join(c.rstrip(_END_PUNCT) for c in cells)))
            row = []
        elif kind in ("fence", "code_block"):
            code.append(token.content.strip())
            if "a code block was not read" not in notes:
                notes.append("a code block was not read")
        elif kind == "html_block":
            content = _html(token.content).strip()
            if content:
                sentences.append(_end(content))
    if not any(not is_silent(s) for s in sentences) and any(code):
        return Spoken("\n".join(code), ("the text is only code: it is read as written",))
    return Spoken("\n".join(sentences), tuple(notes))


def _count_items(tokens: list, start: int) -> int:  # list[markdown_it.token.Token]
    """Items of the ordered list opened at `tokens[start]` (its own, not nested lists')."""
    depth, items = 0, 0
    for token in tokens[start:]:
        if token.type in ("ordered_list_open", "bullet_list_open"):
            depth += 1
        elif token.type in ("ordered_list_close", "bullet_list_close"):
            depth -= 1
            if depth == 0:
                break
        elif token.type == "list_item_open" and depth == 1:
            items += 1
    return items
