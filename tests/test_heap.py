"""`HeapWatch`: under load (no idle moment), freed heap holes are given back once RSS outgrows the slack.

Runs in a fresh interpreter: in a long test session the heap already holds free memory of every size, which the
holes made here would only refill instead of adding to RSS."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vocalis.kernels.heap import _malloc_trim, rss_bytes

pytestmark = pytest.mark.skipif(_malloc_trim() is None or rss_bytes() is None,
                                reason="needs glibc's malloc_trim and /proc (Linux)")

SCRIPT = r'''
from vocalis.kernels.heap import HeapWatch, rss_bytes

MIB = 1 << 20


def holes(mib):
    """Leave ~mib MiB of freed heap that glibc keeps: 64 KiB blocks (below the mmap threshold) interleaved with
    small blocks that stay alive, so no free memory sits at the top of the heap to be trimmed on its own."""
    big, small = [], []
    for _ in range(mib * 16):
        big.append(bytearray(64 * 1024))  # zero-filled: resident
        small.append(bytearray(2048))
    del big
    return small


watch = HeapWatch(min_slack_bytes=64 * MIB, slack_fraction=0.0)
assert watch.after_step() is False  # the first step sets the base
keep = holes(32)  # under the slack: nothing to do
assert watch.after_step() is False and watch.releases == 0
before = rss_bytes()
keep += holes(256)
grown = rss_bytes()
assert grown - before > 200 * MIB, (before, grown)  # the holes are resident: glibc did not give them back itself
assert watch.after_step() is True and watch.releases == 1
after = rss_bytes()
assert after < grown - 150 * MIB and abs(watch.base - after) < 8 * MIB, (grown, after, watch.base)
assert watch.after_step() is False  # measured from the released size
print("ok")
'''


def test_rss_grown_past_the_slack_is_released() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
