"""Text that arrives in pieces (an LLM's stream on the WebSocket, a bi-stream) read as whole text is read.

A piece is rarely a sentence: "**Fast", "er** start-up for $3", ".50.". Read piece by piece, markup and numbers
would be read aloud or wrongly ("3" then ".50"), and a word cut in two would be two words. `PieceReader` keeps
the text until a sentence is complete (sentence-final punctuation followed by white space, or a blank line),
then normalises the complete part as `Frontend` normalises a whole text (markdown, numbers, transliteration, with
its notices) and gives its token ids; `flush` reads whatever is left (where the writer paused after a sentence
or a clause, and at the end). Text inside an open code fence or a table row is kept until the block closes, as
the markdown reader reads blocks whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from vocalis.errors import InputError

# after a sentence end (closing quotes/brackets allowed) and the white space after it; or after a blank line
_SENTENCE_DONE = re.compile(r"[.!?…][\"”’')\]]*\s+|[。！？；]+[\"”’'」』）)》】]*|\n[ \t]*\n\s*")


class PieceReader:
    """One bi-stream's text: `feed` each piece, `flush` where a cut is made and at the end; both give token ids."""

    def __init__(self, normalize: Callable[[str], list[str]], encode: Callable[[str], list[int]],
                 spaced: Callable[[], bool]) -> None:
        """normalize: text -> its normalised sentences (`Frontend`'s, with notices); encode: text -> token ids;
        spaced: whether parts read after the first are joined with a space (not for Chinese or Japanese)."""
        self._normalize, self._encode, self._spaced = normalize, encode, spaced
        self._text = ""
        self._started = False

    def feed(self, piece: str) -> list[int]:
        self._text += piece
        end = self._complete(self._text)
        if not end:
            return []
        done, self._text = self._text[:end], self._text[end:]
        return self._read(done)

    def flush(self) -> list[int]:
        done, self._text = self._text, ""
        return self._read(done)

    @staticmethod
    def _complete(text: str) -> int:
        """Length of the longest prefix of `text` that ends a sentence outside code fences and tables (0: none)."""
        end = 0
        for m in _SENTENCE_DONE.finditer(text):
            head = text[: m.end()]
            line = text[text.rfind("\n", 0, m.start()) + 1: m.start()]
            if head.count("```") % 2 == 0 and not line.lstrip().startswith("|"):
                end = m.end()
        return end

    def _read(self, text: str) -> list[int]:
        if not text.strip():
            return []
        try:
            spoken = " ".join(self._normalize(text))
        except InputError:  # only markup or punctuation (a table rule, a fence): nothing to say
            return []
        if self._started and self._spaced():
            spoken = " " + spoken
        ids = self._encode(spoken)
        self._started = self._started or bool(ids)
        return ids
