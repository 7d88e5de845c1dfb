"""Words in other scripts written in Latin letters, for a model that reads English only.

A model whose text frontend is an English lexicon (the built-in model) cannot say "改善" or "привет"; rather than
refuse the whole text, each run of letters from another script is transliterated with anyascii ("привет" ->
"privet", "改善" -> "gai shan"), so the model says something close, and a note says so. A run anyascii has no
letters for is left out, and noted. Letters with a Latin base ("é", "ß") are not foreign: the tokenizer reads
them as their base letters.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

MAX_NOTES = 8  # distinct words noted; more are counted in one last note

# Latin letters without a decomposition into ASCII ones
LATIN_LETTERS = str.maketrans({"ß": "ss", "æ": "ae", "Æ": "Ae", "œ": "oe", "Œ": "Oe", "ø": "o", "Ø": "O", "ð": "th",
                               "Ð": "Th", "þ": "th", "Þ": "Th", "ł": "l", "Ł": "L", "đ": "d", "Đ": "D"})
# a syllable boundary in anyascii's output for syllabic scripts ("GaiShan", "HanGugEo")
_HUMP_RE = re.compile(r"(?<=[a-z])(?=[A-Z])")


@dataclass(frozen=True, slots=True)
class Romanized:
    """`romanize`'s result: the text with foreign words in Latin letters, and a note per word changed."""

    text: str
    notes: tuple[str, ...] = ()


def is_foreign_letter(ch: str) -> bool:
    """A letter (or a mark on one) with no ASCII base letter: another script than Latin."""
    if not (ch.isalpha() or unicodedata.category(ch).startswith("M")):
        return False
    return not unicodedata.normalize("NFKD", ch.translate(LATIN_LETTERS)).encode("ascii", "ignore")


def _foreign_runs(text: str) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start = None
    for i, ch in enumerate(text):
        if is_foreign_letter(ch):
            start = i if start is None else start
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(text)))
    return runs


def transliterate(word: str) -> str:
    """A foreign word in Latin letters ("改善" -> "gai shan"); "" when anyascii has no letters for it."""
    from anyascii import anyascii  # imported lazily: its tables load on first use

    latin = _HUMP_RE.sub(" ", anyascii(word))
    latin = re.sub(r"[^A-Za-z' ]+", " ", latin).strip()
    return re.sub(r"\s+", " ", latin).lower()


def romanize(text: str) -> Romanized:
    """Every run of foreign letters in `text` transliterated (spaced from the letters around it), or left out."""
    runs = _foreign_runs(text)
    if not runs:
        return Romanized(text)
    out: list[str] = []
    notes: dict[str, str] = {}
    pos = 0
    for start, end in runs:
        word = text[start:end]
        latin = transliterate(word)
        out.append(text[pos:start])
        if latin:
            if start and text[start - 1].isalnum():
                out.append(" ")
            out.append(latin)
            if text[end:end + 1].isalnum():
                out.append(" ")
            notes.setdefault(word, f"{word!r} read as {latin!r}: this model reads English only")
        else:
            notes.setdefault(word, f"{word!r} left out: this model reads English only")
        pos = end
    out.append(text[pos:])
    kept = list(notes.values())
    if len(kept) > MAX_NOTES:
        kept = kept[:MAX_NOTES] + [f"{len(kept) - MAX_NOTES} more words in other scripts read as Latin letters"]
    return Romanized("".join(out), tuple(kept))
