"""A counter's recent rate (e.g. generated tokens per second), read from any thread."""

from __future__ import annotations

import collections
import time


class RateMeter:
    """Running total plus its rate over the last `window_s` seconds. `add` runs on one thread (the engine loop);
    `rate` may run on others: it reads a snapshot of the samples."""

    def __init__(self, window_s: float = 5.0, samples: int = 256) -> None:
        self.window_s = window_s
        self.total = 0
        self._samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=samples)

    def add(self, n: int) -> None:
        self.total += n
        self._samples.append((time.monotonic(), self.total))

    def rate(self) -> float:
        """Per second over the window: from the last sample before it (or its first) to the newest; 0 when idle."""
        samples = list(self._samples)
        now = time.monotonic()
        recent = [(at, n) for at, n in samples if now - at <= self.window_s]
        if not recent:
            return 0.0
        older = [(at, n) for at, n in samples if now - at > self.window_s]
        base_at, base_n = older[-1] if older else recent[0]
        span = now - base_at
        return (recent[-1][1] - base_n) / span if span > 0 else 0.0
