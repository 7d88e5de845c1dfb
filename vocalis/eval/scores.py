"""What one recording scores (`Scores`) and one manifest item's result (`UtteranceResult`), as the runner fills
them and the report aggregates them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vocalis.eval.wer import EditCounts


@dataclass
class Scores:
    """What one recording scores. Rates are None when not measured."""

    hypothesis: str | None = None
    word_edits: EditCounts | None = None
    char_edits: EditCounts | None = None
    similarity: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def wer(self) -> float | None:
        return self.word_edits.rate if self.word_edits else None

    @property
    def cer(self) -> float | None:
        return self.char_edits.rate if self.char_edits else None


@dataclass
class UtteranceResult:
    id: str
    text: str
    status: str  # "scored" | "missing" | "unreadable"
    duration: float | None = None
    rtf: float | None = None
    output: Scores = field(default_factory=Scores)
    baseline: Scores | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        def scores(s: Scores | None) -> dict[str, Any] | None:
            if s is None:
                return None
            return {"hypothesis": s.hypothesis, "wer": s.wer, "cer": s.cer, "similarity": s.similarity,
                    "word_edits": s.word_edits and s.word_edits.to_json(),
                    "char_edits": s.char_edits and s.char_edits.to_json(), "errors": s.errors}

        return {"id": self.id, "text": self.text, "status": self.status, "reason": self.reason,
                "duration": self.duration, "rtf": self.rtf, **scores(self.output),  # type: ignore[dict-item]
                "baseline": scores(self.baseline)}
