"""Numbers, money and symbols read as words, for the cases wetext's grammars read wrong.

wetext reads most numeric forms well (dates, times, measures, percentages, ordinals, fractions, phone numbers
written 555-123-4567), but its English grammar loses the leading group of a comma-grouped number ("1,234" ->
"thousand two hundred ..."), reads every 1000-2099 as a year ("1000" -> "ten hundred"), reads money as decimals
("$3.50" -> "three point five dollars") and decades as seconds ("1990s"); its Chinese grammar splits "1,234" at
the comma. `english_numbers` rewrites exactly those forms (and a few symbols and abbreviations wetext leaves as
written) into words before wetext runs; everything else is left for wetext. A unit written after a number
rewritten here is spelled out here too, since wetext only expands a unit after digits.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ("", "thousand", "million", "billion", "trillion", "quadrillion", "quintillion", "sextillion",
           "septillion", "octillion", "nonillion", "decillion")
_DIGITS_RE = re.compile(r"\d+")


def _below_hundred(n: int) -> str:
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = []
    if hundreds:
        words.append(f"{_ONES[hundreds]} hundred")
    if rest:
        if hundreds:
            words.append("and")
        words.append(_below_hundred(rest))
    return " ".join(words)


def number_to_words(digits: str) -> str:
    """Spell a run of decimal digits: "123" -> "one hundred and twenty-three".

    Runs with a leading zero ("007") or longer than the scale table are read digit by digit.
    """
    if not digits or not digits.isdecimal():
        raise ValueError(f"not a digit run: {digits!r}")
    value = int(digits)
    if (len(digits) > 1 and int(digits[0]) == 0) or len(digits) > 3 * len(_SCALES):
        return read_digits(digits)
    if value == 0:
        return _ONES[0]
    groups = []
    scale = 0
    while value:
        value, group = divmod(value, 1000)
        if group:
            groups.append(_below_thousand(group) + (f" {_SCALES[scale]}" if scale else ""))
        scale += 1
    return " ".join(reversed(groups))


def read_digits(digits: str) -> str:
    """One word per digit: "4567" -> "four five six seven"."""
    return " ".join(_ONES[int(d)] for d in digits)


def spell_out_numbers(text: str) -> str:
    """Replace every run of digits in `text` by its English words."""
    return _DIGITS_RE.sub(lambda m: number_to_words(m.group()), text)


_ORDINAL_ENDINGS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                    "nine": "ninth", "twelve": "twelfth"}


def ordinal_words(digits: str) -> str:
    """"21" -> "twenty-first"."""
    words = number_to_words(str(int(digits)))
    head, sep, last = words.rpartition(" ")
    hyphen_head, hyphen, last = last.rpartition("-")
    if last in _ORDINAL_ENDINGS:
        last = _ORDINAL_ENDINGS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + hyphen_head + hyphen + last


def year_words(digits: str) -> str:
    """A year as said: "1999" -> "nineteen ninety-nine", "1905" -> "nineteen oh five", "2000" -> "two thousand",
    "2008" -> "two thousand eight", "1900" -> "nineteen hundred"."""
    value = int(digits)
    high, low = divmod(value, 100)
    if value % 1000 == 0 or (2000 <= value < 2010):
        return number_to_words(digits)
    if low == 0:
        return f"{_below_hundred(high)} hundred"
    if low < 10:
        return f"{_below_hundred(high)} oh {_ONES[low]}"
    return f"{_below_hundred(high)} {_below_hundred(low)}"


def decimal_words(integer: str, fraction: str) -> str:
    """"12", "05" -> "twelve point zero five" (digits after the point one by one)."""
    words = number_to_words(integer.replace(",", "") or "0")
    return f"{words} point {read_digits(fraction)}" if fraction else words


# ---------------------------------------------------------------------------------------------------
# English rewrites (before wetext)

# (name, plural) of the main unit, (name, plural) of the hundredth, or None where none is spoken
_CURRENCIES: dict[str, tuple[tuple[str, str], tuple[str, str] | None]] = {
    "$": (("dollar", "dollars"), ("cent", "cents")),
    "€": (("euro", "euros"), ("cent", "cents")),
    "£": (("pound", "pounds"), ("penny", "pence")),
    "¥": (("yen", "yen"), None),
    "₹": (("rupee", "rupees"), ("paisa", "paise")),
}
_MAGNITUDES = {"k": "thousand", "K": "thousand", "thousand": "thousand", "m": "million", "M": "million",
               "million": "million", "mn": "million", "b": "billion", "B": "billion", "bn": "billion",
               "billion": "billion", "t": "trillion", "T": "trillion", "tn": "trillion", "trillion": "trillion"}
# Units written after a number (singular, plural); wetext expands these itself after digits it reads.
_UNITS = {
    "km": ("kilometer", "kilometers"), "m": ("meter", "meters"), "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"), "mi": ("mile", "miles"), "ft": ("foot", "feet"),
    "kg": ("kilogram", "kilograms"),
    "g": ("gram", "grams"), "mg": ("milligram", "milligrams"), "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"),
    "oz": ("ounce", "ounces"), "l": ("liter", "liters"), "ml": ("milliliter", "milliliters"),
    "kb": ("kilobyte", "kilobytes"), "mb": ("megabyte", "megabytes"), "gb": ("gigabyte", "gigabytes"),
    "tb": ("terabyte", "terabytes"), "ms": ("millisecond", "milliseconds"), "s": ("second", "seconds"),
    "sec": ("second", "seconds"), "secs": ("second", "seconds"), "min": ("minute", "minutes"),
    "mins": ("minute", "minutes"), "h": ("hour", "hours"), "hr": ("hour", "hours"), "hrs": ("hour", "hours"),
    "mph": ("mile per hour", "miles per hour"), "km/h": ("kilometer per hour", "kilometers per hour"),
    "kw": ("kilowatt", "kilowatts"), "kwh": ("kilowatt hour", "kilowatt hours"), "w": ("watt", "watts"),
    "hz": ("hertz", "hertz"), "khz": ("kilohertz", "kilohertz"), "mhz": ("megahertz", "megahertz"),
    "ghz": ("gigahertz", "gigahertz"), "%": ("percent", "percent"), "°c": ("degree Celsius", "degrees Celsius"),
    "°f": ("degree Fahrenheit", "degrees Fahrenheit"),
}
_UNIT_RE = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
_AFTER = rf"(?:\s?(?P<unit>{_UNIT_RE})(?![\w/]))?"
_YEAR_CUES = {"in", "since", "by", "from", "until", "till", "to", "of", "year", "circa", "around", "before", "after",
              "during", "between", "summer", "winter", "spring", "autumn", "fall", "early", "late", "mid",
              "january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
              "november", "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov",
              "dec", "class", "vintage", "copyright", "©"}


_QUARTER_RE = re.compile(r"[qh][1-4]|fy")


def _with_unit(words: str, unit: str | None, plural: bool) -> str:
    if not unit:
        return words
    name = _UNITS[unit.lower()]
    return f"{words} {name[1] if plural else name[0]}"


def _money(m: re.Match[str]) -> str:
    (one, many), sub = _CURRENCIES[m["cur"]]
    integer, fraction = m["int"].replace(",", ""), m["frac"] or ""
    scale = m["scale"]
    if scale:  # "$1.2 million" -> "one point two million dollars"
        return f"{decimal_words(integer, fraction)} {_MAGNITUDES[scale]} {many}"
    if fraction and (sub is None or len(fraction) != 2):
        return f"{decimal_words(integer, fraction)} {many}"
    units = int(integer)
    cents = int(fraction) if fraction else 0
    parts = []
    if units or not cents:
        parts.append(f"{number_to_words(integer)} {one if units == 1 else many}")
    if cents and sub is not None:
        parts.append(f"{number_to_words(str(cents))} {sub[0] if cents == 1 else sub[1]}")
    return " and ".join(parts)


def _grouped(m: re.Match[str]) -> str:
    integer = m["int"].replace(",", "")
    words = decimal_words(integer, m["frac"] or "")
    return _with_unit(words, m["unit"], plural=integer != "1" or bool(m["frac"]))


def _magnitude(m: re.Match[str]) -> str:
    return f"{decimal_words(m['int'], m['frac'] or '')} {_MAGNITUDES[m['scale']]}"


def _decade(m: re.Match[str]) -> str:
    words = year_words(m["year"])
    if words.endswith("y"):
        return words[:-1] + "ies"
    return words + "s"


def _four_digits(m: re.Match[str]) -> str:
    digits = m["num"]
    before = m.string[: m.start()].split()
    previous = before[-1].lower().strip(".,'\"(") if before else ""
    unit = m["unit"]
    if len(before) >= 2 and previous.isdecimal() and before[-2].lower().strip(".,") in _YEAR_CUES and not unit:
        return m.group()  # a date ("March 5, 2024"): wetext's date grammar reads it whole
    if int(digits) <= 2099 and (previous in _YEAR_CUES or _QUARTER_RE.fullmatch(previous)) and not unit:
        return year_words(digits)
    return _with_unit(number_to_words(digits), unit, plural=True)


def _international_phone(m: re.Match[str]) -> str:
    groups = re.findall(r"\d+", m.group())
    return "plus " + ", ".join(read_digits(g) for g in groups)


def _local_phone(m: re.Match[str]) -> str:
    return f"{read_digits(m['a'])}, {read_digits(m['b'])}"


def _address(m: re.Match[str]) -> str:
    """A web or mail address as said: "example.com/docs" -> "example dot com slash docs" (no scheme, no "www")."""
    words = re.sub(r"[./@:?=&_]", lambda c: f" {_ADDRESS_MARKS[c.group()]} ", m["addr"])
    return re.sub(r"\s+", " ", words).strip()


_ADDRESS_MARKS = {".": "dot", "/": "slash", "@": "at", ":": "colon", "?": "question mark", "=": "equals",
                  "&": "and", "_": "underscore"}


def _keep_period(word: str) -> Callable[[re.Match[str]], str]:
    """An abbreviation's period ends the sentence too where the next word starts one (or nothing follows)."""
    def sub(m: re.Match[str]) -> str:
        rest = m.string[m.end():]
        ends = not rest.strip() or re.match(r"\s*(?:\n|[A-Z\"'(])", rest) is not None
        return word + ("." if ends else "")
    return sub


_NUM = r"(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d+))?"
_ENGLISH_RULES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"\b(?:https?://(?:www\.)?|www\.)(?P<addr>\S+?)/?(?=[.,;:!?)\]]*(?:\s|$))"), _address),
    (re.compile(r"(?<![\w.@/-])(?P<addr>[\w.+-]+@[\w-]+(?:\.[\w-]+)+|[a-z0-9-]+(?:\.[a-z0-9-]+)*\."
                r"(?:com|org|net|io|ai|dev|edu|gov|co|uk|de|app|info))(?![\w@/-]|\.\w)"), _address),
    (re.compile(r"(?<![\w.])-(?=[$€£¥₹]\d)"), "minus "),
    (re.compile(r"\bv(?=\d+\.\d)"), "version "),
    (re.compile(rf"(?<![\w.])(?P<cur>[$€£¥₹])\s?{_NUM}(?:\s?(?P<scale>thousand|million|billion|trillion|"
                r"[kKmMbBtT]n?)\b)?"), _money),
    (re.compile(r"(?<![\w.])\+\d{1,3}(?:[ -]\(?\d{1,4}\)?){2,5}(?![\w-])"), _international_phone),
    (re.compile(r"(?<![\w.,-])(?P<a>\d{3})-(?P<b>\d{4})(?![\w-])"), _local_phone),
    (re.compile(r"(?<![\d.,])(?P<int>\d+)(?:\.(?P<frac>\d+))?(?P<scale>[kMB]|bn)\b"), _magnitude),
    (re.compile(r"(?<![\d.,])(?P<int>\d{1,3}(?:,\d{3})+)(?:\.(?P<frac>\d+))?(?![\d,]\d)" + _AFTER), _grouped),
    (re.compile(r"(?<![\w.,'])(?P<year>1[1-9]\d0|20\d0)'?s\b"), _decade),
    (re.compile(r"(?<![\w.,:/+-])(?P<num>[12]\d{3})(?![\w.,:/-]\d|\d|-\d|/\d|:\d)" + _AFTER), _four_digits),
    (re.compile(r"(?<![\w#])#(?=\d)"), "number "),
    (re.compile(r"\b[Nn]o\.\s?(?=\d)"), "number "),
    (re.compile(r"(?<=\d)\+(?=[\s).,;!?]|$)"), " plus"),
    (re.compile(r"\b24/7\b"), "twenty-four seven"),
    (re.compile(r"(?<=\d)x\b"), " times"),
    (re.compile(r"(?<=\d)(?P<suf>st|nd|rd|th)-"), "\\g<suf> "),
    (re.compile(r"\s?×\s?"), " times "),
    (re.compile(r"≈\s?|~(?=\d)"), "about "),
    (re.compile(r"≥\s?"), "at least "),
    (re.compile(r"≤\s?"), "at most "),
    (re.compile(r"±\s?"), "plus or minus "),
    (re.compile(r"\be\.g\.(?=[\s,])"), "for example"),
    (re.compile(r"\bi\.e\.(?=[\s,])"), "that is"),
    (re.compile(r"\betc\."), _keep_period("et cetera")),
    (re.compile(r"\bvs\.(?=\s)"), "versus"),
    (re.compile(r"\bapprox\.(?=\s)"), "approximately"),
)


def english_numbers(text: str) -> str:
    """Rewrite, in English text, the numeric forms and symbols wetext reads wrong (see the module docstring):
    "$3.50" -> "three dollars and fifty cents", "1,234" -> "one thousand two hundred and thirty-four",
    "1000" -> "one thousand", "in 1905" -> "in nineteen oh five", "1990s" -> "nineteen nineties"."""
    for pattern, replacement in _ENGLISH_RULES:
        text = pattern.sub(replacement, text)
    return text


_ZH_GROUPED_RE = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d,]\d)")


def chinese_numbers(text: str) -> str:
    """Thousands separators dropped ("1,234" -> "1234"), so wetext reads the number whole."""
    return _ZH_GROUPED_RE.sub(lambda m: m.group().replace(",", ""), text)
