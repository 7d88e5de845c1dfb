"""RateMeter: the /metrics tokens-per-second figure over a sliding window."""

from __future__ import annotations

import pytest

from vocalis.runtime import rate
from vocalis.runtime.rate import RateMeter


def test_rate_over_the_window_and_zero_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(rate.time, "monotonic", lambda: now[0])
    meter = RateMeter(window_s=5.0)
    assert meter.rate() == 0.0
    for _ in range(20):  # 30 tokens every half second for 10 s, then 20 a step for 2 s
        now[0] += 0.5
        meter.add(30)
    for _ in range(4):
        now[0] += 0.5
        meter.add(20)
    assert meter.total == 20 * 30 + 4 * 20
    # from the last sample before the 5 s window (106.5 s) to now (112 s): the 30s at 107-110 s and the 20s
    assert meter.rate() == pytest.approx((7 * 30 + 4 * 20) / 5.5)
    now[0] += 5.01  # nothing new inside the window
    assert meter.rate() == 0.0
