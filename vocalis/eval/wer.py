"""Word and character error rates by Levenshtein alignment (substitutions, deletions, insertions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vocalis.eval.text_norm import normalize, tokens


@dataclass(frozen=True)
class EditCounts:
    """Alignment of a hypothesis against a reference of `ref_len` units."""

    substitutions: int = 0
    deletions: int = 0
    insertions: int = 0
    ref_len: int = 0

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def rate(self) -> float:
        """errors / reference length; an empty reference scores 0 if the hypothesis is empty too, else 1."""
        if self.ref_len == 0:
            return 0.0 if self.errors == 0 else 1.0
        return self.errors / self.ref_len

    def to_json(self) -> dict[str, int]:
        return {"substitutions": self.substitutions, "deletions": self.deletions, "insertions": self.insertions,
                "ref_len": self.ref_len}

    def __add__(self, other: EditCounts) -> EditCounts:
        return EditCounts(self.substitutions + other.substitutions, self.deletions + other.deletions,
                          self.insertions + other.insertions, self.ref_len + other.ref_len)


def edit_counts(ref: Sequence[str], hyp: Sequence[str]) -> EditCounts:
    """Minimum-edit alignment of `hyp` to `ref`; ties prefer substitutions (the usual WER convention).

    O(len(ref) * len(hyp)) time, two rows of memory; each cell holds (errors, subs, dels, ins).
    """
    prev = [(j, 0, 0, j) for j in range(len(hyp) + 1)]  # empty ref: j insertions
    for i in range(1, len(ref) + 1):
        cur = [(i, 0, i, 0)]  # empty hyp: i deletions
        for j in range(1, len(hyp) + 1):
            if ref[i - 1] == hyp[j - 1]:
                cur.append(prev[j - 1])
                continue
            e, s, d, n = prev[j - 1]
            best = (e + 1, s + 1, d, n)
            e, s, d, n = prev[j]
            if e + 1 < best[0]:
                best = (e + 1, s, d + 1, n)
            e, s, d, n = cur[j - 1]
            if e + 1 < best[0]:
                best = (e + 1, s, d, n + 1)
            cur.append(best)
        prev = cur
    _, s, d, n = prev[-1]
    return EditCounts(s, d, n, len(ref))


def word_counts(reference: str, hypothesis: str, language: str = "auto") -> EditCounts:
    """Word edits after normalisation (CJK text: one unit per character)."""
    return edit_counts(tokens(normalize(reference, language)), tokens(normalize(hypothesis, language)))


def char_counts(reference: str, hypothesis: str, language: str = "auto") -> EditCounts:
    """Character edits after normalisation, spaces removed."""
    ref = normalize(reference, language).replace(" ", "")
    hyp = normalize(hypothesis, language).replace(" ", "")
    return edit_counts(list(ref), list(hyp))


def wer(reference: str, hypothesis: str, language: str = "auto") -> float:
    return word_counts(reference, hypothesis, language).rate


def cer(reference: str, hypothesis: str, language: str = "auto") -> float:
    return char_counts(reference, hypothesis, language).rate
