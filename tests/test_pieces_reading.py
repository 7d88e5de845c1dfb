"""Text in pieces is read as whole text is (issue 55): markdown, numbers and words cut across pieces are
normalised per sentence, so a bi-stream's LLM reads what it would read of the text whole."""

from __future__ import annotations

import pytest

from vocalis.frontend.family import frontend_for
from vocalis.frontend.pieces import PieceReader
from vocalis.frontend.prompt import Frontend
from vocalis.model_dir import random_model

CASES = [  # LLM-style text cut where a stream cuts it
    ["## What", " changed\n\n- **Fast", "er** start-up for $3", ".50 each; 1,2", "34 units sold. Call",
     " me at 10:30. ", "Done"],
    ["| Item | Price |\n|---", "---|---|\n| Tea | $1", ".20 |\n\n", "That is *all*", ". Thanks!"],
    ["Run `pip", " install x`", " first.\n```py", "thon\nprint(1)\n```\n", "Then 2", "0% faster."],
    ["The pri", "ce is 1,000 dol", "lars. ", "Then 1000."],
]


@pytest.fixture(scope="module")
def frontend() -> Frontend:
    return frontend_for(random_model("tiny"))


@pytest.mark.parametrize("pieces", CASES)
def test_pieces_read_as_the_whole_text(frontend: Frontend, pieces: list[str]) -> None:
    reader = frontend.piece_reader()
    got = [i for p in pieces for i in reader.feed(p)] + reader.flush()
    whole = frontend._normalize("".join(pieces), "auto")
    assert got == frontend.tokenizer.encode(" ".join(whole))
    piecewise = [i for p in pieces for i in frontend.tokenizer.encode(p)]
    assert got != piecewise  # read piece by piece, it would say something else


def test_a_sentence_is_read_once_complete() -> None:
    read: list[str] = []
    reader = PieceReader(lambda t: read.append(t) or [t.strip()], lambda t: [len(t)], lambda: True)
    assert reader.feed("It costs $3") == [] and reader.feed(".50") == []  # "3." is no sentence end
    assert reader.feed(" today. And") == [len("It costs $3.50 today.")]
    assert reader.feed(" then") == [] and reader.flush() == [len(" And then")]
    assert read == ["It costs $3.50 today. ", "And then"]
    assert reader.feed("```\ncode. more\n") == [] and reader.feed("```\n\nok") == [len(" ```\ncode. more\n```")]
