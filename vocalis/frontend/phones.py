"""Phones in: the built-in model's text frontend (English, festival's CMU lexicon and letter-to-sound rules).

One function, `g2p`, turns text into phone symbols at training and at inference, the same way festival's
`cmu_us_slt_arctic_hts` voice (the built-in model's teacher) does for the text the corpus uses: tokens split on
white space, punctuation stripped off and kept, hyphenated tokens split, every word looked up in the festival CMU
lexicon (its addenda first, then the word as written, then lower-cased; homographs: the first entry), words not in
it through festival's CART letter-to-sound trees, and festival's post-lexical rule for a possessive `'s`. The
lexicon and trees ship as `vocalis/assets/builtin/` (built by `vocalis.corpus.festival_lexicon` from Debian's
`festlex-cmu`), so festival is needed to make the corpus, never to speak.

Symbols (`TEXT_SYMBOLS`, ids = positions): `<pad>`, `<unk>`, the word boundary `|`, punctuation `, . ? ! ; : -`,
then `UNITS`: `pau`, 24 consonants, 16 vowels x stress 0/1 (`ax0`, `ow1`). The 25 Hz speech labels of the built-in
model are (unit, begin/inside) pairs: `label_id(unit, inside) = 2 * UNITS.index(unit) + inside` (`NUM_LABELS`).
The official CosyVoice 2 model keeps its BPE text path; nothing here is used by it. A model reads phones when its
config says `text_frontend = "phones"`; the loader then gives it a `PhoneTokenizer` instead of the BPE files.
"""

from __future__ import annotations

import json
import lzma
import re
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from vocalis.frontend.romanize import LATIN_LETTERS, romanize

ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / "builtin"
VOWELS = ("aa", "ae", "ah", "ao", "aw", "ax", "ay", "eh", "er", "ey", "ih", "iy", "ow", "oy", "uh", "uw")
CONSONANTS = ("b", "ch", "d", "dh", "f", "g", "hh", "jh", "k", "l", "m", "n", "ng", "p", "r", "s", "sh", "t", "th",
              "v", "w", "y", "z", "zh")
PAUSE = "pau"
UNITS = (PAUSE, *CONSONANTS, *(f"{v}{s}" for v in VOWELS for s in (0, 1)))
WORD_BOUNDARY = "|"
PUNCTUATION = (",", ".", "?", "!", ";", ":", "-")
TEXT_SYMBOLS = ("<pad>", "<unk>", WORD_BOUNDARY, *PUNCTUATION, *UNITS)
TEXT_IDS = {s: i for i, s in enumerate(TEXT_SYMBOLS)}
UNIT_IDS = {u: i for i, u in enumerate(UNITS)}
NUM_TEXT_IDS = len(TEXT_SYMBOLS)
NUM_LABELS = 2 * len(UNITS)
UNK_ID = TEXT_IDS["<unk>"]

_PUNCT_CHARS = "\"'`.,:;!?(){}[]"  # festival's token.punctuation
_PRE_PUNCT = "\"'`({["  # festival's token.prepunctuation
_UNVOICED = {"p", "t", "k", "f", "th", "s", "sh", "ch", "hh"}
_DETERMINERS = {"a", "an", "the", "this", "that", "these", "those", "my", "your", "his", "her", "its", "our",
                "their", "no", "every", "each", "some", "any"}
_VERB_CONTEXT = {"to", "i", "you", "he", "she", "we", "they", "it", "will", "would", "can", "could", "should", "must",
                 "may", "might", "shall", "do", "does", "did", "not", "how", "what", "where", "why", "who", "when",
                 "that", "which"}
_SIBILANTS = {"s", "z", "sh", "zh", "ch", "jh"}  # fricatives/affricates at alveolar/palatal places


class Word(NamedTuple):
    text: str  # the word as looked up
    phones: tuple[str, ...]  # UNITS symbols
    punctuation: str  # punctuation that followed the token, e.g. "," or "?" ("" if none)


def label_id(unit: str, inside: bool) -> int:
    """Speech label of a 40 ms frame: `unit` begun in this frame (inside False) or continued from the last one."""
    return 2 * UNIT_IDS[unit] + int(inside)


def label_unit(label: int) -> tuple[str, bool]:
    """Inverse of `label_id`."""
    return UNITS[label // 2], bool(label % 2)


class Lexicon(Mapping[str, dict[str, tuple[str, ...]]]):
    """word -> {pos: phones} in file order (addenda first, as festival looks them up; a word's first entry per
    part of speech counts). A word's entries are held as their text lines and read on lookup: one string per
    word instead of a dict of tuples keeps the ~100k-word table at a fifth of the memory, and builds faster."""

    def __init__(self, lines: list[str]) -> None:
        raw: dict[str, str] = {}
        for line in lines:
            word, entry = line.split("\t", 1)  # entry: "pos\tphones"
            have = raw.get(word)
            raw[word] = entry if have is None else f"{have}\n{entry}"
        self._raw = raw

    def __getitem__(self, word: str) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        for entry in self._raw[word].split("\n"):
            pos, phones = entry.split("\t")
            out.setdefault(pos, tuple(phones.split()))
        return out

    def __contains__(self, word: object) -> bool:
        return word in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


@lru_cache(maxsize=1)
def _lexicon() -> Lexicon:
    return Lexicon(lzma.decompress((ASSET_DIR / "cmulex.txt.xz").read_bytes()).decode("utf-8").splitlines())


def _choose(entries: dict[str, tuple[str, ...]], previous: str) -> tuple[str, ...]:
    """A homograph's reading, standing in for festival's part-of-speech tagger: the noun after a determiner, the
    verb after a pronoun, modal, `to` or question word ("how does", "to record"), else the first entry."""
    if len(entries) > 1:
        if previous in _DETERMINERS and "n" in entries:
            return entries["n"]
        if previous in _VERB_CONTEXT and "v" in entries:
            return entries["v"]
    return next(iter(entries.values()))


@lru_cache(maxsize=1)
def _lts() -> dict[str, object]:
    return json.loads(lzma.decompress((ASSET_DIR / "cmults.json.xz").read_bytes()))


def letter_to_sound(word: str) -> tuple[str, ...]:
    """Festival's `lts_predict` over the CMU CART trees: lower-case letters a-z -> phones with vowel stress."""
    trees = _lts()
    letters = ["#", *word, "#"]
    out: list[str] = []
    for i in range(1, len(letters) - 1):
        node = trees.get(letters[i])
        if node is None:
            continue
        while isinstance(node, list):
            j = i + node[0]
            ctx = letters[j] if 0 <= j < len(letters) else "0"
            node = node[2] if ctx == node[1] else node[3]
        if node != "_epsilon_":
            out += str(node).split("-")
    return tuple(out)


def lookup(word: str, previous: str = "") -> tuple[str, ...]:
    """Phones of one word (`previous`: the word before it, lower-case, for homographs): the lexicon (as written,
    then lower-cased), else the letter-to-sound rules (letters only; festival gives other unknown words no phones)."""
    lex = _lexicon()
    for key in (word, word.lower()):
        if key in lex:
            return _choose(lex[key], previous)
    low = word.lower()
    return letter_to_sound(low) if re.fullmatch(r"[a-z]+", low) else ()


def _possessive(previous: tuple[str, ...]) -> tuple[str, ...]:
    """Festival's `postlex_apos_s_check`: 's -> ax0 z, devoiced after an unvoiced phone, schwa kept after sibilants."""
    last = previous[-1] if previous else ""
    z = "s" if last in _UNVOICED else "z"
    return ("ax0", z) if last in _SIBILANTS else (z,)


def words(text: str) -> list[Word]:
    """Text -> words with phones and the punctuation after them (festival's tokenisation, see module docstring)."""
    out: list[Word] = []
    for token in text.split():
        core = token.lstrip(_PRE_PUNCT)
        stripped = core.rstrip(_PUNCT_CHARS)
        trail = core[len(stripped):]
        punct = next((c for c in trail if c in PUNCTUATION), "")
        parts = [p for p in re.split(r"-+", stripped) if p]
        for k, part in enumerate(parts):
            tail = punct if k == len(parts) - 1 else ""
            phones = lookup(part, out[-1].text.lower() if out else "")
            if not phones and part.lower().endswith("'s") and len(part) > 2:  # possessive of an unlisted word
                base = lookup(part[:-2])
                phones = base + _possessive(base) if base else ()
            if phones:
                out.append(Word(part, phones, tail))
            elif tail and out:  # a word without phones keeps its punctuation on the previous word
                out[-1] = out[-1]._replace(punctuation=out[-1].punctuation or tail)
    return out


def g2p(text: str) -> list[str]:
    """Text -> TEXT_SYMBOLS: each word's phones, its punctuation, a `|` between words.

    >>> g2p("Hello, world.")
    ['hh', 'ax0', 'l', 'ow1', ',', '|', 'w', 'er1', 'l', 'd', '.']
    """
    out: list[str] = []
    for i, w in enumerate(words(text)):
        if i:
            out.append(WORD_BOUNDARY)
        out += w.phones
        if w.punctuation:
            out.append(w.punctuation)
    return out


def text_ids(text: str) -> list[int]:
    """Text -> ids of `TEXT_SYMBOLS` (the built-in model's text vocabulary)."""
    return [TEXT_IDS.get(s, UNK_ID) for s in g2p(text)]


# CosyVoice's control tags (special tokens of its BPE vocabulary): sounds and stress the phone set has no symbol for
CONTROL_TAG_RE = re.compile(r"\[(?:breath|noise|laughter|cough|clucking|accent|quick_breath|hissing|sigh|"
                            r"vocalized-noise|lipsmack|mn)\]|</?(?:strong|laughter)>|<\|[^<>|\s]+\|>")


class PhoneTokenizer:
    """The text tokenizer of a model whose `config.text_frontend` is "phones": `TextTokenizer`'s methods over
    `text_ids`. Text reaches it normalised (digits written out), as it reaches the BPE tokenizer."""

    endofprompt_id = None  # no instructions: the phone set has no `<|endofprompt|>`
    language = "en"  # the language its text is normalised as, whatever script a word is in

    def encode(self, text: str) -> list[int]:
        """Accented Latin letters read as their base letters ("Köln" as "Koln"); words in another script are
        transliterated (`romanize`: "привет" as "privet"), or left out where no Latin spelling exists; CosyVoice's
        control tags (`[laughter]`, `<strong>`) are left out, the words they mark kept."""
        return text_ids(self.readable(text))

    def readable(self, text: str) -> str:
        """What `encode` reads of `text`: ASCII text in Latin letters, control tags left out."""
        text = romanize(CONTROL_TAG_RE.sub(" ", text).translate(LATIN_LETTERS)).text
        return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")

    def spoken_words(self, text: str) -> list[Word]:
        """The words `encode(text)` spells, with their phones, in order (what a phone model's labels follow)."""
        return words(self.readable(text))

    def warnings(self, text: str) -> tuple[str, ...]:
        """What `encode(text)` reads otherwise than written (one note per control tag and per foreign word)."""
        tags = tuple(f"{tag!r} left out: this model has no control tags"
                     for tag in dict.fromkeys(m.group() for m in CONTROL_TAG_RE.finditer(text)))
        return tags + romanize(CONTROL_TAG_RE.sub(" ", text).translate(LATIN_LETTERS)).notes

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Symbols separated by spaces (`<pad>` dropped with `skip_special_tokens`)."""
        return " ".join(TEXT_SYMBOLS[i] for i in ids if not (skip_special_tokens and i == TEXT_IDS["<pad>"]))

    def count(self, text: str) -> int:
        """Phone ids of `text`: the length measure the sentence splitter uses."""
        return len(self.encode(text))

    def token_to_id(self, token: str) -> int | None:
        return TEXT_IDS.get(token)

    def __len__(self) -> int:
        return NUM_TEXT_IDS
