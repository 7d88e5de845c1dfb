"""Runaway detection for one request's speech ids: a degenerate loop that repeats a short cycle of ids.

Pure Python, no tensors: the scheduler pushes each appended id and ends the request when the watch fires.
Kept incremental (one counter per candidate period) so that each id costs O(max_period), not a rescan.
"""

from __future__ import annotations

# Longest cycle (speech ids, 25 per second) taken for a loop: a stuck syllable or a silence pattern fits in it
CYCLE_MAX_PERIOD = 16


class CycleWatch:
    """Fires when the last `span` ids all equal the id `p` places earlier, for some period p <= max_period,
    i.e. the tail is one cycle of at most max_period ids repeated for `span` ids after its first occurrence."""

    __slots__ = ("max_period", "runs", "span")

    def __init__(self, span: int, max_period: int = CYCLE_MAX_PERIOD) -> None:
        if span < 1 or max_period < 1:
            raise ValueError(f"need span >= 1 and max_period >= 1, got {span}, {max_period}")
        self.span = span
        self.max_period = max_period
        self.runs = [0] * max_period  # runs[p - 1]: how many latest ids equal the id p places before them

    def push(self, ids: list[int]) -> int | None:
        """`ids` with its newest id just appended -> the shortest period whose repeat reached `span`, else None."""
        n = len(ids) - 1
        tok = ids[n]
        fired = None
        for p in range(1, self.max_period + 1):
            if n >= p and ids[n - p] == tok:
                self.runs[p - 1] += 1
                if fired is None and self.runs[p - 1] >= self.span:
                    fired = p
            else:
                self.runs[p - 1] = 0
        return fired
