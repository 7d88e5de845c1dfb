"""The SSML subset: parts (text, rate, pause) written out for each element, bad markup as one clear error, and the
built-in model saying a document with its pauses."""

from __future__ import annotations

import numpy as np
import pytest

from vocalis.errors import InputError
from vocalis.frontend.ssml import SsmlPart, parse_ssml, render_ssml


@pytest.mark.parametrize(("ssml", "parts"), [
    ("<speak>Hello there.</speak>", [SsmlPart("Hello there.")]),
    ('<speak>Hello <break time="500ms"/> world.</speak>', [SsmlPart("Hello.", 1.0, 0.5), SsmlPart("world.")]),
    ('<speak>One<break time="1.5s"/>two</speak>', [SsmlPart("One.", 1.0, 1.5), SsmlPart("two")]),
    ('<speak>a, <break strength="weak"/>b</speak>', [SsmlPart("a,", 1.0, 0.2), SsmlPart("b")]),
    ("<speak><p><s>First sentence</s><s>Second one</s></p><p>New paragraph</p></speak>",
     [SsmlPart("First sentence. Second one.", 1.0, 0.5), SsmlPart("New paragraph.", 1.0, 0.5)]),
    ('<speak>Normal <prosody rate="slow">slow words</prosody> and back.</speak>',
     [SsmlPart("Normal"), SsmlPart("slow words", 0.75), SsmlPart("and back.")]),
    ('<speak><prosody rate="150%">quick <prosody rate="x-slow">then slower</prosody></prosody></speak>',
     [SsmlPart("quick", 1.5), SsmlPart("then slower", 0.75)]),
    (('<speak>Spell <say-as interpret-as="characters">ABC</say-as>, count <say-as interpret-as="cardinal">1,234'
     '</say-as>, the <say-as interpret-as="ordinal">3</say-as> time.</speak>'),
     [SsmlPart("Spell A B C, count one thousand two hundred and thirty-four, the third time.")]),
    (('<speak>On <say-as interpret-as="date" format="mdy">12/25/2024</say-as>, or <say-as interpret-as="date">'
     '1905-03-01</say-as>.</speak>'),
     [SsmlPart("On December twenty-fifth, twenty twenty-four, or March first, nineteen oh five.")]),
    (('<speak>Call <say-as interpret-as="telephone">+1 555 123 4567</say-as>, code <say-as interpret-as="digits">'
     '007</say-as>.</speak>'),
     [SsmlPart("Call plus one, five five five, one two three, four five six seven, code zero zero seven.")]),
    ('<speak><sub alias="World Wide Web Consortium">W3C</sub> is <emphasis>great</emphasis>.</speak>',
     [SsmlPart("World Wide Web Consortium is <strong>great</strong>.")]),
    ('<speak xmlns="http://www.w3.org/2001/10/synthesis" version="1.0">Fish &amp; chips.</speak>',
     [SsmlPart("Fish & chips.")]),
])
def test_parts(ssml: str, parts: list[SsmlPart]) -> None:
    assert list(parse_ssml(ssml)) == parts


@pytest.mark.parametrize(("ssml", "message"), [
    ("<speak>unclosed", "not well-formed"),
    ("<say>Hello</say>", "<speak> as its root"),
    ('<!DOCTYPE speak [<!ENTITY x "y">]><speak>&x;</speak>', "DOCTYPE"),
    ('<speak>a<break time="forever"/></speak>', "break time"),
    ('<speak>a<break time="60s"/></speak>', "10 s limit"),
    ('<speak>a<break strength="huge"/></speak>', "break strength"),
    ('<speak><prosody rate="warp">a</prosody></speak>', "prosody rate"),
    ('<speak><prosody rate="900%">a</prosody></speak>', "between"),
    ('<speak><say-as interpret-as="cardinal">many</say-as></speak>', "needs digits"),
    ('<speak><say-as interpret-as="date">2024-13-01</say-as></speak>', "no month 13"),
    ('<speak><say-as interpret-as="currency">5</say-as></speak>', "interpret-as"),
    ('<speak><break time="1s"/></speak>', "no text"),
])
def test_bad_ssml_is_one_clear_error(ssml: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        parse_ssml(ssml)


def test_the_builtin_model_says_a_document_with_its_pauses() -> None:
    """Each part said at its rate, the pauses exact silence between them: the render equals the parts said one
    by one and joined."""
    from vocalis import TTS

    parts = parse_ssml('<speak>Hello there.<break time="400ms"/><prosody rate="fast">Goodbye now.</prosody></speak>')
    assert parts == (SsmlPart("Hello there.", 1.0, 0.4), SsmlPart("Goodbye now.", 1.25))
    with TTS.load() as tts:
        def speak(text: str, rate: float) -> np.ndarray:
            return tts.synthesize(text, speed=rate, seed=3)

        audio = render_ssml(parts, speak, tts.sample_rate)
        first, second = speak("Hello there.", 1.0), speak("Goodbye now.", 1.25)
    gap = round(0.4 * tts.sample_rate)
    assert len(audio) == len(first) + gap + len(second)
    np.testing.assert_allclose(audio[:len(first)], first, atol=1e-5)
    assert not audio[len(first):len(first) + gap].any()
    np.testing.assert_allclose(audio[len(first) + gap:], second, atol=1e-5)


def test_a_document_of_many_pauses_is_refused() -> None:
    with pytest.raises(InputError, match="add up"):
        parse_ssml("<speak>hi" + '<break time="10s"/>' * 7 + "</speak>")
