"""Text normalisation and sentence splitting for synthesis (CosyVoice 2 frontend rules on top of wetext).

Pipeline per request: validate -> pick the language (explicit, or detected once for the whole text) ->
wetext TN around protected control tags -> the language's post-processing rules -> split into pieces of
about 60-80 units (characters for zh/ja, BPE tokens for en) -> drop punctuation-only pieces.

Control tags (`[laughter]`, `<strong>`, `</strong>`, `<|endofprompt|>`, ...) are cut out before TN and put
back verbatim, so the FSTs never see (or mangle) them.
"""

from __future__ import annotations

import functools
import logging
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from vocalis.errors import InputError
from vocalis.frontend.markdown import markdown_to_speech
from vocalis.frontend.numbers import chinese_numbers, english_numbers, number_to_words, spell_out_numbers

__all__ = ["NormalizedText", "ends_sentence", "longest_sentence_tokens", "normalize", "normalize_text",
           "number_to_words", "spell_out_numbers", "split_paragraph"]

logger = logging.getLogger(__name__)

Language = Literal["zh", "en", "ja"]
LANGUAGES: tuple[str, ...] = ("zh", "en", "ja", "auto")
DEFAULT_MAX_CHARS = 20000

# split_paragraph thresholds of the official frontend (units: zh/ja characters, en BPE tokens).
TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20
CLAUSE_CHARS = 60  # a clause this long may be spoken before the rest of its sentence is written (`ends_sentence`)

# Sentence-final punctuation per language. The zh set is the official one; ja drops `、` (a comma in
# Japanese) and `.`; en is the official English set.
_SENTENCE_END: dict[str, str] = {
    "zh": "。？！；：、.?!;",
    "ja": "。？！；：?!;",
    "en": ".?!;:",
}
_COMMAS = "，,"
_END_MARK: dict[str, str] = {"zh": "。", "ja": "。", "en": "."}
# Closing quotes/brackets that belong to the sentence whose punctuation they follow.
_CLOSERS = "\"”’'」』）)》】"

# `<|...|>` specials, `<tag>`/`</tag>` markup and `[event]` markers; kept verbatim through TN.
_TAG_RE = re.compile(r"<\|[^<>|\s]+\|>|</?[A-Za-z_]+>|\[[A-Za-z_-]+\]")
# wetext returns `"` and backslash escaped with a backslash (en always, zh/ja when the FST runs), so these are
# kept out of TN like the tags.
_PROTECTED_RE = re.compile(_TAG_RE.pattern + r'|["\\]')
_PIPE_TAG_RE = re.compile(r"<\|[^<>|\s]+\|>")
_WHITESPACE_RE = re.compile(r"\s+")
_TRAILING_COMMAS_RE = re.compile(r"[，,、]+$")


@dataclass(frozen=True, slots=True)
class NormalizedText:
    """Result of `normalize_text`: the language used, the full normalised text, its synthesis pieces and notes on
    what was left unread (a skipped code block)."""

    language: Language
    text: str
    pieces: tuple[str, ...]
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------
# Validation and language choice


def check_text_length(text: str, max_chars: int = DEFAULT_MAX_CHARS) -> None:
    """Reject absurdly long input before any expensive processing."""
    if len(text) > max_chars:
        raise InputError(
            f"text is {len(text)} characters long; the limit is {max_chars}. Split it into smaller requests."
        )


def is_only_punctuation(text: str) -> bool:
    """True when `text` holds nothing but punctuation, symbols and whitespace (empty counts too)."""
    return all(ch.isspace() or unicodedata.category(ch)[0] in "PS" for ch in text)


def _is_kana(ch: str) -> bool:
    # U+30FB (katakana middle dot) also appears in Chinese names, so it is not taken as a Japanese cue.
    return (
        "\u3040" <= ch <= "\u309f"
        or ("\u30a0" <= ch <= "\u30ff" and ch != "\u30fb")
        or "\u31f0" <= ch <= "\u31ff"
        or "\uff66" <= ch <= "\uff9f"
    )


def _is_hanzi(ch: str) -> bool:
    return "\u4e00" <= ch <= "\u9fff"


def detect_language(text: str) -> Language:
    """Kana anywhere -> ja (Japanese mixes kanji and kana); else any CJK ideograph -> zh; else en."""
    has_hanzi = False
    for ch in _TAG_RE.sub(" ", text):
        if _is_kana(ch):
            return "ja"
        has_hanzi = has_hanzi or _is_hanzi(ch)
    return "zh" if has_hanzi else "en"


def resolve_language(language: str, text: str) -> Language:
    """Validate an explicit language or detect it for `language="auto"`."""
    if language == "auto":
        return detect_language(text)
    if language in ("zh", "en", "ja"):
        return language  # type: ignore[return-value]
    raise InputError(f"unknown language {language!r}; expected one of {', '.join(LANGUAGES)}")


# ---------------------------------------------------------------------------------------------------
# wetext TN with protected tags


@functools.cache
def _wetext_normalizer(language: Language):  # -> wetext.Normalizer
    from wetext import Normalizer  # imported lazily: loading the FST package is not import-time work

    # remove_erhua=False as in the official zh frontend.
    return Normalizer(lang=language, operator="tn", remove_erhua=False)


def _tn_segment(segment: str, language: Language) -> str:
    """TN of tag-free text, keeping its leading/trailing whitespace (wetext strips it)."""
    core = segment.strip()
    if not core:
        return segment
    lead = segment[: len(segment) - len(segment.lstrip())]
    trail = segment[len(segment.rstrip()) :]
    if language == "en":
        # wetext's English grammar fails on runs of whitespace; one space carries the same meaning.
        core = _WHITESPACE_RE.sub(" ", core)
        lead, trail = (" " if lead else ""), (" " if trail else "")
    return lead + _tn_or_raw(core, language) + trail


# Where text wetext cannot normalise is cut into smaller parts, coarsest first: at brackets (its English
# grammar fails on a digit next to `[`/`]`: "See [1] for details."), then at whitespace. Each part is
# normalised on its own; a word that still fails is kept as written.
_FALLBACK_CUTS = (re.compile(r"([\[\]{}<>|])"), re.compile(r"(\s+)"))


def _tn_or_raw(text: str, language: Language, level: int = 0) -> str:
    """wetext TN of `text`; where the FST runtime fails (it raises bare AssertionError/RuntimeError on odd
    input), the failing part alone falls back to the raw text, so speakable text is never rejected."""
    try:
        out = _wetext_normalizer(language).normalize(text)
        if out.strip() or is_only_punctuation(text):
            return out
        exc: Exception = ValueError("wetext returned nothing")  # it drops some text silently ("Visit a.com.")
    except Exception as error:  # noqa: BLE001  the failure is local to this text; the fallback below keeps it
        exc = error
    if level >= len(_FALLBACK_CUTS):
        logger.debug("text normalisation (%s) kept %r as written: %r", language, text[:60], exc)
        return text
    parts = _FALLBACK_CUTS[level].split(text)
    if len(parts) == 1:
        return _tn_or_raw(text, language, level + 1)
    # split() with a capturing group keeps the separators at the odd positions: they stay as written.
    return "".join(p if i % 2 else _keep_spaces(p, language, level + 1) for i, p in enumerate(parts))


def _keep_spaces(part: str, language: Language, level: int) -> str:
    core = part.strip()
    if not core:
        return part
    return part[: len(part) - len(part.lstrip())] + _tn_or_raw(core, language, level) + part[len(part.rstrip()) :]


def _tn_around_tags(text: str, language: Language) -> str:
    parts = []
    pos = 0
    for match in _PROTECTED_RE.finditer(text):
        parts.append(_tn_segment(text[pos : match.start()], language))
        parts.append(match.group())
        pos = match.end()
    parts.append(_tn_segment(text[pos:], language))
    return "".join(parts)


# ---------------------------------------------------------------------------------------------------
# Post-processing rules (official, section 2.3)


def replace_blank(text: str) -> str:
    """Keep a space only between two non-space ASCII characters (drops spaces around CJK text)."""
    out = []
    for i, ch in enumerate(text):
        if ch == " ":
            prev = text[i - 1] if i > 0 else " "
            nxt = text[i + 1] if i + 1 < len(text) else " "
            if not (prev.isascii() and prev != " " and nxt.isascii() and nxt != " "):
                continue
        out.append(ch)
    return "".join(out)


def _zh_rules(text: str) -> str:
    text = text.replace("\n", "")
    text = replace_blank(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。")
    text = text.replace(" - ", "，")
    for ch in "（）【】`":
        text = text.replace(ch, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS_RE.sub("。", text)


def _ja_rules(text: str) -> str:
    # No official Japanese path exists; reuse the zh layout rules that are not Chinese-specific.
    text = replace_blank(text.replace("\n", ""))
    return _TRAILING_COMMAS_RE.sub("。", text)


def apply_text_normalization(text: str, language: Language) -> str:
    """wetext TN (tags protected) followed by the language's post-processing rules; no splitting. The forms
    wetext reads wrong are rewritten first (`frontend.numbers`)."""
    text = text.strip()
    if language == "en":
        text = english_numbers(text)
    elif language == "zh":
        text = chinese_numbers(text)
    text = _tn_around_tags(text, language)
    if language == "zh":
        return _zh_rules(text)
    if language == "ja":
        return _ja_rules(text)
    return spell_out_numbers(text)


# ---------------------------------------------------------------------------------------------------
# Splitting


def _cut_sentences(text: str, ends: str) -> list[str]:
    """Cut after each run of sentence-final punctuation, attaching following closing quotes/brackets.

    Unlike the official loop, a run like `?!` or `...` stays whole instead of losing its later marks.
    """
    sentences = []
    start = 0
    i = 0
    while i < len(text):
        if text[i] in ends:
            j = i + 1
            while j < len(text) and (text[j] in ends or text[j] in _CLOSERS):
                j += 1
            sentences.append(text[start:j])
            start = i = j
        else:
            i += 1
    if start < len(text):
        sentences.append(text[start:])
    return sentences


_ANY_SENTENCE_END = "".join(dict.fromkeys("".join(_SENTENCE_END.values())))


def longest_sentence_tokens(text: str, count: Callable[[str], int]) -> int:
    """Tokens (by `count`) of the longest sentence of `text`, cut where synthesis cuts it, before normalisation.

    Synthesis prompts the LLM one piece of at most a few sentences at a time, so a bound on a prompt's length
    applies to this, not to the whole text (a long text is not one long prompt).
    """
    return max((count(s) for s in _cut_sentences(text, _ANY_SENTENCE_END) if s.strip()), default=0)


def ends_sentence(text: str, clause_chars: int = CLAUSE_CHARS) -> bool:
    """Whether `text` (what has come so far of a text written in pieces) ends a sentence, or a clause (a comma)
    at least `clause_chars` long: a point where speech may start without the text after it."""
    core = text.rstrip().rstrip(_CLOSERS)
    if not core:
        return False
    if core[-1] in _ANY_SENTENCE_END:
        return True
    return core[-1] in _COMMAS + "、" and len(text.strip()) >= clause_chars


def split_paragraph(
    text: str,
    language: Language,
    token_len: Callable[[str], int] | None = None,
    *,
    token_max_n: int = TOKEN_MAX_N,
    token_min_n: int = TOKEN_MIN_N,
    merge_len: int = MERGE_LEN,
    comma_split: bool = False,
) -> list[str]:
    """Split normalised text into synthesis pieces.

    Sentences are merged greedily: the buffer is flushed when adding the next sentence would exceed
    `token_max_n` and the buffer already exceeds `token_min_n`; a final leftover shorter than `merge_len`
    joins the previous piece. Length is counted in characters for zh/ja and with `token_len` (BPE tokens)
    for en. An end mark is appended when the text does not end in sentence punctuation. Pieces are
    whitespace-stripped; every character of the input lands in exactly one piece.
    """
    if language == "en":
        if token_len is None:
            raise ValueError("English splitting counts BPE tokens: pass token_len (e.g. TextTokenizer.count)")
        length: Callable[[str], int] = token_len
    else:
        length = len
    ends = _SENTENCE_END[language] + (_COMMAS if comma_split else "")
    text = text.strip()
    if not text:
        return []
    if text.rstrip(_CLOSERS)[-1:] not in tuple(ends):
        text += _END_MARK[language]

    pieces: list[str] = []
    current = ""
    for sentence in _cut_sentences(text, ends):
        if current and length(current + sentence) > token_max_n and length(current) > token_min_n:
            pieces.append(current)
            current = ""
        current += sentence
    if current:
        if pieces and length(current) < merge_len:
            pieces[-1] += current
        else:
            pieces.append(current)
    return [p.strip() for p in pieces if p.strip()]


# ---------------------------------------------------------------------------------------------------
# Entry point


def normalize_text(
    text: str,
    language: str = "auto",
    *,
    token_len: Callable[[str], int] | None = None,
    split: bool = True,
    text_frontend: bool = True,
    max_chars: int = DEFAULT_MAX_CHARS,
    markdown: bool = True,
) -> NormalizedText:
    """Normalise `text` and split it into synthesis pieces.

    `language` is "zh", "en", "ja" or "auto" (detected once for the whole text: kana -> ja, CJK
    ideographs -> zh, else en); the language used is returned. `token_len` counts BPE tokens and is
    required to split English. `split=False` returns the whole normalised text as the only piece (how the
    official frontend treats prompt text). `text_frontend=False` skips normalisation and splitting, as the
    official flag does. Text containing a `<|...|>` special (e.g. an instruction ending in
    `<|endofprompt|>`) is normalised around the tag but never split, like the official frontend. With
    `markdown` (and `split`: text to speak, not a prompt's transcript), markup is read as a reader would
    (`frontend.markdown`); what it leaves unread is in `notes`.

    Raises InputError for empty, punctuation-only or over-long text and for an unknown language.
    """
    if not isinstance(text, str):
        raise InputError(f"text must be a string, got {type(text).__name__}")
    check_text_length(text, max_chars)
    stripped = text.strip()
    if not stripped:
        raise InputError("text is empty: nothing to synthesise")
    if is_only_punctuation(stripped):
        raise InputError(f"text {stripped[:40]!r} holds only punctuation or symbols: nothing to synthesise")
    if not text_frontend:
        return NormalizedText(resolve_language(language, stripped), stripped, (stripped,))
    notes: tuple[str, ...] = ()
    if markdown and split:
        spoken = markdown_to_speech(stripped)
        if is_only_punctuation(spoken.text):
            raise InputError(f"text {stripped[:40]!r} has nothing to read aloud once its markup is left out")
        stripped, notes = spoken.text, spoken.notes
    lang = resolve_language(language, stripped)
    logger.debug("text language: %s (requested %s)", lang, language)
    normalized = apply_text_normalization(stripped, lang)
    if is_only_punctuation(normalized):
        raise InputError(f"text {stripped[:40]!r} normalises to nothing speakable ({normalized!r})")
    if not split or _PIPE_TAG_RE.search(normalized):
        pieces = [normalized]
    else:
        pieces = split_paragraph(normalized, lang, token_len)
    pieces = [p for p in pieces if not is_only_punctuation(p)]
    if not pieces:
        raise InputError(f"text {stripped[:40]!r} has no speakable sentence after normalisation")
    return NormalizedText(lang, normalized, tuple(pieces), notes)


def normalize(
    text: str,
    language: str = "auto",
    *,
    token_len: Callable[[str], int] | None = None,
    split: bool = True,
    text_frontend: bool = True,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> list[str]:
    """`normalize_text(...).pieces` as a list: the synthesis pieces only."""
    result = normalize_text(
        text, language, token_len=token_len, split=split, text_frontend=text_frontend, max_chars=max_chars
    )
    return list(result.pieces)
