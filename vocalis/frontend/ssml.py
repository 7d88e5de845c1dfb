"""A subset of SSML, for callers that ask for it explicitly: what to say, how fast, and where to pause.

`parse_ssml` turns a `<speak>` document into `SsmlPart`s: text to say (the frontend then reads it as any text), its
speaking rate, and the silence after it. Supported: `<speak>`, `<p>` and `<s>` (a sentence each; a paragraph
pauses after), `<break time="500ms"|"2s">` or `strength=`, `<prosody rate="slow"|"80%"|"1.2">`, `<say-as
interpret-as="characters|spell-out|cardinal|number|ordinal|digits|date|telephone">` (English readings; a date as
`format="ymd|mdy|dmy"`), `<sub alias="...">`, and `<emphasis>` (CosyVoice's `<strong>`, which a model without it
leaves out). Other elements are read as their text. `render_ssml` says the parts and joins them with the pauses.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vocalis.errors import InputError
from vocalis.frontend.numbers import number_to_words, ordinal_words, read_digits, year_words
from vocalis.frontend.request import MAX_SPEED, MIN_SPEED

MAX_BREAK_S = 10.0
MAX_TOTAL_BREAK_S = 60.0  # all of a document's pauses: silence costs memory like speech
PARAGRAPH_PAUSE_S = 0.5
_STRENGTHS = {"none": 0.0, "x-weak": 0.1, "weak": 0.2, "medium": 0.4, "strong": 0.7, "x-strong": 1.2}
_RATES = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.25, "x-fast": 1.5}
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_END = ".?!;:。？！；：…"


@dataclass(frozen=True, slots=True)
class SsmlPart:
    """Text to say at `rate` (the synthesis speed), then `pause_s` seconds of silence."""

    text: str
    rate: float = 1.0
    pause_s: float = 0.0


def _seconds(value: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*", value)
    if m is None:
        raise InputError(f"SSML break time {value!r} is not like '500ms' or '1.5s'")
    seconds = float(m[1]) / (1000.0 if m[2] == "ms" else 1.0)
    if seconds > MAX_BREAK_S:
        raise InputError(f"SSML break time {value!r} is over the {MAX_BREAK_S:g} s limit")
    return seconds


def _rate(value: str, outer: float) -> float:
    value = value.strip().lower()
    if value in _RATES:
        rate = _RATES[value]
    elif m := re.fullmatch(r"(\d+(?:\.\d+)?)%", value):
        rate = float(m[1]) / 100.0
    elif re.fullmatch(r"\d+(?:\.\d+)?", value):
        rate = float(value)
    else:
        raise InputError(f"SSML prosody rate {value!r} is not x-slow..x-fast, a percentage or a number")
    if not MIN_SPEED <= rate * outer <= MAX_SPEED:
        raise InputError(f"SSML prosody rate {value!r} gives speed {rate * outer:g}; it must be between "
                         f"{MIN_SPEED} and {MAX_SPEED}")
    return rate * outer


def _date(text: str, fmt: str) -> str:
    numbers = re.findall(r"\d+", text)
    order = {"ymd": "ymd", "mdy": "mdy", "dmy": "dmy"}.get(fmt.lower()[:3], "ymd")
    if len(numbers) != 3:
        raise InputError(f"SSML date {text!r} is not three numbers ({order})")
    parts = dict(zip(order, numbers))
    month, day = int(parts["m"]), int(parts["d"])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        raise InputError(f"SSML date {text!r} has no month {month} / day {day} ({order})")
    return f"{_MONTHS[month - 1]} {ordinal_words(str(day))}, {year_words(parts['y'])}"


def say_as(text: str, interpret_as: str, fmt: str = "") -> str:
    """`<say-as>`'s reading of `text` in English."""
    kind = interpret_as.strip().lower()
    core = text.strip()
    if kind in ("characters", "spell-out", "verbatim"):
        return " ".join(ch for ch in core if not ch.isspace())
    if kind in ("cardinal", "number", "ordinal", "digits"):
        digits = core.replace(",", "")
        if not digits.isdecimal():
            raise InputError(f"SSML say-as {kind} needs digits, got {core!r}")
        if kind == "ordinal":
            return ordinal_words(digits)
        return read_digits(digits) if kind == "digits" else number_to_words(str(int(digits)))
    if kind == "date":
        return _date(core, fmt)
    if kind == "telephone":
        groups = re.findall(r"\d+", core)
        if not groups:
            raise InputError(f"SSML say-as telephone needs digits, got {core!r}")
        return ("plus " if core.startswith("+") else "") + ", ".join(read_digits(g) for g in groups)
    raise InputError(f"SSML say-as interpret-as {interpret_as!r} is not one of characters, spell-out, cardinal, "
                     "number, ordinal, digits, date, telephone")


class _Builder:
    def __init__(self) -> None:
        self.parts: list[SsmlPart] = []
        self.text: list[str] = []
        self.rate = 1.0

    def say(self, text: str, rate: float) -> None:
        if not text.strip():
            if text and self.text:
                self.text.append(" ")
            return
        if rate != self.rate and "".join(self.text).strip():
            self.flush(0.0)
        self.rate = rate
        self.text.append(text)

    def end_sentence(self) -> None:
        said = "".join(self.text).rstrip()
        if said:
            self.text = [said + ("" if said[-1] in _END else ".") + " "]

    def flush(self, pause_s: float) -> None:
        said = re.sub(r"\s+([,.;:!?])", r"\1", re.sub(r"\s+", " ", "".join(self.text))).strip()
        if said:
            self.parts.append(SsmlPart(said, self.rate))
        if pause_s > 0:
            if not self.parts:
                self.parts.append(SsmlPart("", self.rate, 0.0))
            last = self.parts[-1]
            self.parts[-1] = SsmlPart(last.text, last.rate, last.pause_s + pause_s)
        self.text = []


def _walk(node: ET.Element, out: _Builder, rate: float) -> None:
    tag = node.tag.rsplit("}", 1)[-1].lower()  # namespaces ("{http://www.w3.org/2001/10/synthesis}speak") dropped
    if tag == "break":
        strength = node.get("strength", "medium")
        if node.get("time") is not None:
            pause = _seconds(node.get("time", ""))
        elif strength in _STRENGTHS:
            pause = _STRENGTHS[strength]
        else:
            raise InputError(f"SSML break strength {strength!r} is not one of {', '.join(_STRENGTHS)}")
        if pause >= _STRENGTHS["medium"]:
            out.end_sentence()
        out.flush(pause)
    elif tag == "say-as":
        out.say(" " + say_as("".join(node.itertext()), node.get("interpret-as", ""), node.get("format", "")) + " ",
                rate)
    elif tag == "sub":
        out.say(" " + node.get("alias", "".join(node.itertext())) + " ", rate)
    else:
        if tag == "prosody" and node.get("rate") is not None:
            rate = _rate(node.get("rate", ""), rate)
        if tag == "emphasis":
            out.say("<strong>", rate)
        out.say(node.text or "", rate)
        for child in node:
            _walk(child, out, rate)
            out.say(child.tail or "", rate)
        if tag == "emphasis":
            out.say("</strong>", rate)
        if tag in ("s", "p"):
            out.end_sentence()
        if tag == "p":
            out.flush(PARAGRAPH_PAUSE_S)


def parse_ssml(ssml: str) -> tuple[SsmlPart, ...]:
    """A `<speak>` document -> the parts to say (see the module docstring); InputError for malformed or
    unsupported markup, or for nothing to say."""
    if re.search(r"<!(?:DOCTYPE|ENTITY)", ssml, re.IGNORECASE):
        raise InputError("SSML may not declare a DOCTYPE or entities")
    try:
        root = ET.fromstring(ssml.strip())
    except ET.ParseError as exc:
        raise InputError(f"SSML is not well-formed XML: {exc}") from None
    if root.tag.rsplit("}", 1)[-1].lower() != "speak":
        raise InputError(f"SSML must have <speak> as its root element, not <{root.tag}>")
    out = _Builder()
    _walk(root, out, 1.0)
    out.flush(0.0)
    parts = [p for p in out.parts if p.text or p.pause_s]
    if sum(p.pause_s for p in parts) > MAX_TOTAL_BREAK_S:
        raise InputError(f"SSML pauses add up to over the {MAX_TOTAL_BREAK_S:g} s limit")
    if not any(p.text for p in parts):
        raise InputError("the SSML has no text to say")
    return tuple(parts)


def render_ssml(parts: tuple[SsmlPart, ...], speak: Callable[[str, float], np.ndarray],
                sample_rate: int) -> np.ndarray:
    """The parts said (`speak(text, rate)` -> (N,) float32 audio) and joined with their pauses: (N,) float32."""
    audio: list[np.ndarray] = []
    for part in parts:
        if part.text:
            audio.append(np.asarray(speak(part.text, part.rate), dtype=np.float32))
        if part.pause_s:
            audio.append(np.zeros(round(part.pause_s * sample_rate), dtype=np.float32))
    return np.concatenate(audio) if audio else np.zeros(0, dtype=np.float32)
