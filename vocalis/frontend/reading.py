"""What a model will read otherwise than written, as notes a caller can show (a server sends them with the audio).

`reading_warnings` runs the same normalisation and splitting as synthesis (`frontend.text`) and asks the
model's tokenizer what it changes in each piece: a skipped code block, a word in another script that an
English-only model reads transliterated. It raises `InputError` where synthesis would (empty text, say).
"""

from __future__ import annotations

from typing import Protocol

from vocalis.frontend.text import normalize_text


class Tokenizer(Protocol):
    def count(self, text: str) -> int: ...


def reading_warnings(text: str, tokenizer: Tokenizer, language: str = "auto") -> tuple[str, ...]:
    """Notes on what synthesising `text` with a model using `tokenizer` leaves unread or reads otherwise
    (empty when it reads everything as written); the same text gives the same notes."""
    if language == "auto":  # as `Frontend` normalises for a model that reads one language
        language = getattr(tokenizer, "language", language)
    result = normalize_text(text, language, token_len=tokenizer.count)
    notes = dict.fromkeys(result.notes)
    check = getattr(tokenizer, "warnings", None)
    if check is not None:
        for piece in result.pieces:
            notes.update(dict.fromkeys(check(piece)))
    return tuple(notes)
