"""CTC targets of the speech tokenizer: text -> units (characters, romanised characters or espeak-ng phonemes)
-> symbol ids.

Id 0 is the CTC blank and id 1 stands for any unit missing from the table. Word boundaries are the unit
`|`, so the table works for scripts with and without spaces.
"""

from __future__ import annotations

import collections
import logging
import re
import shutil
import subprocess
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import regex

from vocalis.errors import InputError

logger = logging.getLogger(__name__)

BLANK = "<blank>"
UNK = "<unk>"
WORD_BOUNDARY = "|"
BLANK_ID = 0
UNK_ID = 1
Unit = Literal["char", "latin", "phoneme"]
UNITS = ("char", "latin", "phoneme")

# ISO 639-1 code -> espeak-ng voice. Mandarin via Hanzi is read wrongly by espeak-ng: convert to pinyin
# first and use "cmn-latn-pinyin".
ESPEAK_VOICES = {
    "en": "en-us", "zh": "cmn", "de": "de", "fr": "fr-fr", "es": "es", "it": "it", "pt": "pt",
    "ru": "ru", "ja": "ja", "ko": "ko", "nl": "nl", "pl": "pl", "tr": "tr", "vi": "vi",
}  # fmt: skip

_PUNCTUATION = regex.compile(r"[^\p{L}\p{M}\p{N}]+")  # anything but letters, marks and digits
_STRESS = str.maketrans("", "", "ˈˌ")
_HAN = regex.compile(r"\p{Han}")
_LANGUAGE_SWITCH = re.compile(r"\([a-z-]+\)")  # espeak-ng marks "(en)" when it switches voice mid-text


def char_units(text: str) -> list[str]:
    """Text -> lower-cased letters/digits with `|` between words; punctuation dropped, NFKC-normalised."""
    return _word_units(text, None)


def _word_units(text: str, spell: Callable[[str], str] | None) -> list[str]:
    """The characters of each word of `text` (as `spell` writes the word, if given), `|` between words."""
    words = _PUNCTUATION.split(unicodedata.normalize("NFKC", text).lower())
    units: list[str] = []
    for word in filter(None, words):
        if units:
            units.append(WORD_BOUNDARY)
        units.extend(spell(word) if spell is not None else word)
    return units


def latin_units(text: str) -> list[str]:
    """`char_units` with Han characters romanised first: numbered-tone pinyin letters (`pypinyin`).

    A few dozen letters and five tone digits instead of thousands of rare Hanzi classes: the CTC targets of
    Mandarin then share units with the Latin-script languages, and every Hanzi's sound is learnable from data
    a few hours long. Words are the text's (a Hanzi run stays one word).
    """
    if not _HAN.search(text):
        return char_units(text)
    try:
        from pypinyin import Style, lazy_pinyin
    except ImportError as exc:
        raise InputError("romanised targets of Chinese text need pypinyin (pip install pypinyin)") from exc

    def spell(word: str) -> str:
        if not _HAN.search(word):
            return word
        return "".join(lazy_pinyin(word, style=Style.TONE3, neutral_tone_with_five=True))

    return _word_units(text, spell)


class EspeakPhonemizer:
    """Text -> IPA phonemes from the `espeak-ng` program (`--ipa`), stress marks removed, `|` between words.

    One process per text: espeak-ng splits its output at clause breaks, so batching lines through one
    process cannot be mapped back reliably.
    """

    def __init__(self, voice: str = "en-us", executable: str = "espeak-ng", timeout_s: float = 30.0) -> None:
        path = shutil.which(executable)
        if path is None:
            raise InputError(
                f"phoneme targets need the {executable!r} program; install it (apt-get install espeak-ng) "
                "or use character targets"
            )
        self.executable = path
        self.voice = voice
        self.timeout_s = timeout_s

    def __call__(self, text: str) -> list[str]:
        # Text goes through stdin (a leading '-' would be read as an option); newlines would split it.
        proc = subprocess.run(
            [self.executable, "-q", "--ipa", "--sep=_", "-v", self.voice],
            input=" ".join(text.split()),
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            check=False,
        )
        if proc.returncode != 0:
            raise InputError(f"espeak-ng failed for voice {self.voice!r}: {proc.stderr.strip() or proc.returncode}")
        units: list[str] = []
        for word in _LANGUAGE_SWITCH.sub("", proc.stdout).translate(_STRESS).split():
            phones = [p for p in word.split("_") if p]
            if phones:
                if units:
                    units.append(WORD_BOUNDARY)
                units.extend(phones)
        return units


class SymbolTable:
    """Units <-> ids for CTC. `symbols[0]` is the blank, `symbols[1]` the unknown unit."""

    def __init__(self, symbols: Sequence[str], unit: Unit = "char", espeak_voice: str | None = None) -> None:
        if list(symbols[:2]) != [BLANK, UNK]:
            raise ValueError(f"a symbol table starts with {BLANK!r}, {UNK!r}; got {list(symbols[:2])}")
        if len(set(symbols)) != len(symbols):
            raise ValueError("symbol table has duplicate symbols")
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        self.symbols = tuple(symbols)
        self.unit: Unit = unit
        self.espeak_voice = espeak_voice
        self._ids = {s: i for i, s in enumerate(self.symbols)}
        self._phonemizers: dict[str, EspeakPhonemizer] = {}

    def __len__(self) -> int:
        return len(self.symbols)

    @classmethod
    def build(
        cls,
        unit_sequences: Iterable[Sequence[str]],
        unit: Unit = "char",
        *,
        min_count: int = 1,
        espeak_voice: str | None = None,
    ) -> SymbolTable:
        """Table of every unit seen at least `min_count` times, most frequent first (ties by unit)."""
        counts: collections.Counter[str] = collections.Counter()
        for seq in unit_sequences:
            counts.update(seq)
        for reserved in (BLANK, UNK):
            counts.pop(reserved, None)
        kept = sorted((u for u, n in counts.items() if n >= min_count), key=lambda u: (-counts[u], u))
        logger.info("symbol table: %d %s units kept of %d seen", len(kept), unit, len(counts))
        return cls([BLANK, UNK, *kept], unit, espeak_voice)

    @classmethod
    def from_texts(
        cls, texts: Iterable[str], unit: Unit = "char", *, min_count: int = 1, espeak_voice: str | None = None
    ) -> SymbolTable:
        """Build from raw transcripts, turned into units the way `text_units` does."""
        probe = cls([BLANK, UNK], unit, espeak_voice)
        return cls.build((probe.text_units(t) for t in texts), unit, min_count=min_count, espeak_voice=espeak_voice)

    def text_units(self, text: str, language: str | None = None) -> list[str]:
        """Units of `text`: characters, or phonemes with the espeak-ng voice of `language` (else the table's)."""
        if self.unit == "char":
            return char_units(text)
        if self.unit == "latin":
            return latin_units(text)
        voice = ESPEAK_VOICES.get(language, language) if language else (self.espeak_voice or "en-us")
        if voice not in self._phonemizers:
            self._phonemizers[voice] = EspeakPhonemizer(voice)
        return self._phonemizers[voice](text)

    def encode(self, units: Sequence[str]) -> list[int]:
        """Units -> ids; units not in the table map to the unknown id 1."""
        return [self._ids.get(u, UNK_ID) for u in units]

    def encode_text(self, text: str, language: str | None = None) -> list[int]:
        return self.encode(self.text_units(text, language))

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.symbols[i] for i in ids]

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "espeak_voice": self.espeak_voice, "symbols": list(self.symbols)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SymbolTable:
        return cls(data["symbols"], data.get("unit", "char"), data.get("espeak_voice"))
