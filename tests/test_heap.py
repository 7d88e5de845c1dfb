"""`HeapWatch`: under load (no idle moment), freed heap holes are given back once RSS outgrows the slack."""

from __future__ import annotations

import pytest

from vocalis.runtime.heap import HeapWatch, _malloc_trim, release_free_heap, rss_bytes

pytestmark = pytest.mark.skipif(_malloc_trim() is None or rss_bytes() is None,
                                reason="needs glibc's malloc_trim and /proc (Linux)")
MIB = 1 << 20


def _holes(mib: int) -> list[bytearray]:
    """Leave ~`mib` MiB of freed heap that glibc keeps: 64 KiB blocks (below the mmap threshold) interleaved with
    small blocks that stay alive, so no free memory sits at the top of the heap to be trimmed on its own."""
    big, small = [], []
    for _ in range(mib * 16):
        big.append(bytearray(64 * 1024))  # zero-filled: resident
        small.append(bytearray(2048))
    del big
    return small


def test_rss_grown_past_the_slack_is_released() -> None:
    release_free_heap()  # free memory an earlier test left resident would otherwise absorb the holes made here
    watch = HeapWatch(min_slack_bytes=64 * MIB, slack_fraction=0.0)
    assert watch.after_step() is False  # the first step sets the base
    keep = _holes(32)  # under the slack: nothing to do
    assert watch.after_step() is False and watch.releases == 0
    before = rss_bytes()
    keep += _holes(256)
    grown = rss_bytes()
    assert grown - before > 200 * MIB  # the holes are resident: glibc did not give them back by itself
    assert watch.after_step() is True and watch.releases == 1
    assert rss_bytes() < grown - 150 * MIB and watch.base == pytest.approx(rss_bytes(), abs=8 * MIB)
    assert watch.after_step() is False  # measured from the released size
    del keep
