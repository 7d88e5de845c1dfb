"""Text normalisation for scoring: both the reference text and the ASR output go through `normalize`.

Lower case, punctuation and symbols removed (apostrophes inside words kept: "don't"), hyphens split words,
and for English digits are spelled out the way they are read: "42" -> "forty two", "3.5" -> "three point five",
"1st" -> "first", "10%" -> "ten percent", "$5" -> "five dollars", "1999" -> "nineteen ninety nine".
Text with CJK characters is scored per character (`tokens`), as Chinese/Japanese WER usually is.
"""

from __future__ import annotations

import re
import unicodedata

_ONES = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_ORDINAL_SUFFIX = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                   "nine": "ninth", "twelve": "twelfth"}
_CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"  # kana, CJK, hangul
_CJK = re.compile(f"[{_CJK_RANGES}]")
_CJK_UNITS = re.compile(f"[{_CJK_RANGES}]|[^{_CJK_RANGES}]+")
_NUMBER = re.compile(
    r"(?P<currency>[$£€])?(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d+))?"
    r"(?P<ordinal>st|nd|rd|th)?(?P<percent>%)?(?![\w])"
)
_CURRENCY = {"$": ("dollar", "dollars"), "£": ("pound", "pounds"), "€": ("euro", "euros")}


def integer_words(n: int) -> str:
    """0 <= n < 10**15 in words: 1234 -> "one thousand two hundred thirty four"."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + integer_words(rest))
    if n >= 10**15:
        return " ".join(_ONES[int(d)] for d in str(n))
    for scale, name in _SCALES:
        if n >= scale:
            rest = n % scale
            return integer_words(n // scale) + " " + name + ("" if rest == 0 else " " + integer_words(rest))
    raise AssertionError(n)


def year_words(n: int) -> str:
    """1100-1999 and 2010-2099 read as years: 1999 -> "nineteen ninety nine", 1900 -> "nineteen hundred"."""
    high, low = divmod(n, 100)
    if low == 0:
        return integer_words(high) + " hundred"
    return integer_words(high) + " " + ("oh " + _ONES[low] if low < 10 else integer_words(low))


def ordinal_words(n: int) -> str:
    words = integer_words(n).split()
    last = words[-1]
    if last in _ORDINAL_SUFFIX:
        words[-1] = _ORDINAL_SUFFIX[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return " ".join(words)


def _spell_number(match: re.Match[str]) -> str:
    digits = match.group("int").replace(",", "")
    n = int(digits)
    frac, currency = match.group("frac"), match.group("currency")
    if match.group("ordinal") and frac is None:
        words = ordinal_words(n)
    elif frac is None and len(digits) == 4 and "," not in match.group("int") and not currency and (
        1100 <= n <= 1999 or 2010 <= n <= 2099
    ):
        words = year_words(n)
    elif len(digits) > 15 or (len(digits) > 1 and digits.startswith("0")):
        words = " ".join(_ONES[int(d)] for d in digits)  # codes, phone numbers: digit by digit
    else:
        words = integer_words(n)
    if frac is not None:
        words += " point " + " ".join(_ONES[int(d)] for d in frac)
    if match.group("percent"):
        words += " percent"
    if currency:
        singular, plural = _CURRENCY[currency]
        words += " " + (singular if n == 1 and frac is None else plural)
    return f" {words} "


def has_cjk(text: str) -> bool:
    return _CJK.search(text) is not None


def normalize(text: str, language: str = "auto") -> str:
    """Scoring form of `text`: lower case words separated by single spaces."""
    text = unicodedata.normalize("NFKC", text).casefold()
    english = language.startswith("en") or (language == "auto" and not has_cjk(text))
    if english:
        text = _NUMBER.sub(_spell_number, text)
    out: list[str] = []
    for i, ch in enumerate(text):
        cat = unicodedata.category(ch)
        if ch in "'’" and 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum():
            out.append("'")  # inside a word: "don't", "o'clock"
        elif cat[0] in "PSZC":
            out.append(" ")
        else:
            out.append(ch)
    return " ".join("".join(out).split())


def tokens(normalized: str) -> list[str]:
    """Scoring units: words, with each CJK character a unit of its own."""
    units: list[str] = []
    for word in normalized.split():
        if has_cjk(word):
            units.extend(_CJK_UNITS.findall(word))
        else:
            units.append(word)
    return units
