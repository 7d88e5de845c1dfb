"""Which ready streams a token2wav step takes: the ones whose audio is due first.

A stream's next chunk is due when the audio already handed out to its caller runs out, counted from its first
chunk (a player starts there); a stream with no chunk yet is due from the moment it was submitted. A step
runs the streams due within the next few steps (earliest first); the others wait for a later step, which
still ends before their audio runs out. So at 8 streams a new request's first chunk does not wait behind other
streams' later chunks, whose callers still have seconds of audio to play. With nothing due soon, the LLM's steps
go first while it has work (a token2wav step would take the cores they run on, and a new request's first chunk
waits for its LLM); once it has none, every ready stream goes into one step.

When several chunks are overdue at once (requests that arrived together), one step over all of them makes each
wait for all; steps of k rows end one after another, and with a step costing f + c * rows seconds the mean wait
of n overdue chunks, (f + c k)(n / k + 1) / 2, is least at k = sqrt(f n / c): on a CPU, where a row costs about as
much as a step's fixed part, that is a few rows per step; on a GPU, where the fixed part dominates, all of them.
`StepCost` fits f and c to the engine's recent steps.

Pure Python over `StreamDue` records: the engine loop (`async_engine`) builds them and times its steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeadlineScheduling:
    """How the async engine picks a token2wav step's streams.

    enabled: by deadline (False: every ready stream, first chunks first).
    soon_steps: a chunk due within this many step times (a step over every ready stream) counts as due now: the
        margin for a later chunk costing more than the average row.
    split_overdue: overdue chunks in steps of the size that least delays them on average (`StepCost`), rather
        than all in one step.
    """

    enabled: bool = False  # on 2 CPU cores it measured no earlier first chunks at 8 streams, less throughput
    soon_steps: float = 3.0
    split_overdue: bool = True

    def __post_init__(self) -> None:
        if not self.soon_steps >= 0:
            raise ValueError(f"soon_steps must be >= 0, got {self.soon_steps}")


@dataclass(frozen=True, slots=True)
class StreamDue:
    """A ready stream and when its chunk is due (monotonic seconds; its submission time before its first chunk)."""

    key: str
    due: float


class StepCost:
    """Seconds of a token2wav step as f + c * rows, fitted (least squares) to the last `window` steps."""

    def __init__(self, window: int = 32) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, rows: int, seconds: float) -> None:
        if rows > 0:
            self._steps.append((rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(f, c): fixed seconds (>= 0) and seconds per row (> 0); None until steps of two widths were seen."""
        n = len(self._steps)
        if n < 2:
            return None
        mx = sum(r for r, _ in self._steps) / n
        my = sum(s for _, s in self._steps) / n
        sxx = sum((r - mx) ** 2 for r, _ in self._steps)
        if sxx == 0:
            return None
        c = sum((r - mx) * (s - my) for r, s in self._steps) / sxx
        if c <= 0:  # wider steps no dearer than narrow ones (a GPU): all fixed cost
            return max(my, 0.0), 0.0
        f = my - c * mx
        if f < 0:  # no fixed part within the noise: per row only, through the origin
            return 0.0, sum(r * s for r, s in self._steps) / sum(r * r for r, _ in self._steps)
        return f, c

    def seconds(self, rows: int) -> float:
        """Estimated seconds of a step over `rows` streams (0.0 before any step)."""
        fit = self.fit()
        if fit is not None:
            return fit[0] + fit[1] * rows
        if not self._steps:
            return 0.0
        return sum(s / r for r, s in self._steps) / len(self._steps) * rows  # one width seen: per row

    def best_rows(self, overdue: int) -> int:
        """Rows per step that least delay `overdue` equal chunks on average (all of them without a fit)."""
        fit = self.fit()
        if fit is None or overdue <= 1:
            return max(overdue, 1)
        f, c = fit
        if c == 0:
            return overdue
        k = math.sqrt(f * overdue / c)
        lo, hi = max(1, math.floor(k)), min(overdue, max(1, math.ceil(k)))

        def mean_wait(rows: int) -> float:  # exact for equal chunks: steps of `rows`, the last one shorter
            full, rest = divmod(overdue, rows)
            total, t = 0.0, 0.0
            for size in [rows] * full + ([rest] if rest else []):
                t += f + c * size
                total += t * size
            return total / overdue

        return min(range(lo, hi + 1), key=mean_wait)


def plan_by_deadline(policy: DeadlineScheduling, ready: Sequence[StreamDue], now: float, cost: StepCost,
                     llm_busy: bool = False, max_rows: int | None = None) -> list[str]:
    """Keys of the ready streams to run in the next token2wav step, earliest due first (`ready` kept in order
    when the policy is off); [] = none now (nothing is due soon and `llm_busy`: LLM steps go first).
    `max_rows`: the step's width cap (the token2wav engine's max_batch)."""
    if not policy.enabled:
        keys = [s.key for s in ready]
    else:
        order = sorted(ready, key=lambda s: s.due)  # stable: equal deadlines keep the caller's order
        horizon = now + policy.soon_steps * cost.seconds(len(order))
        soon = [s for s in order if s.due <= horizon]
        if not soon:  # nothing due soon: all of it in one step, once the LLM is out of work
            keys = [] if llm_busy else [s.key for s in order]
        else:
            overdue = sum(1 for s in soon if s.due <= now)
            rows = len(soon)
            if policy.split_overdue and overdue > 1:
                rows = cost.best_rows(overdue)
            keys = [s.key for s in soon[:rows]]
    return keys if max_rows is None else keys[:max_rows]
