"""Giving freed heap memory back to the operating system when the engine goes idle (`release_free_heap`).

Why: glibc's malloc keeps what a thread frees in that thread's arena and returns to the system only the free
memory at the top of each heap. A serving burst allocates tensors of many sizes from several threads (the engine
loop, torch's OpenMP workers, the server's threads), so the freed memory it leaves is mostly holes, and the
process's RSS creeps up from burst to burst although nothing is kept (the count of Python objects stays the same;
a `malloc_trim` after each burst levels it off; docs/benchmarks.md). `AsyncEngine` calls this once each time its
loop runs out of work.
Under sustained load the loop never goes idle, and a few batched token2wav steps of many streams can leave
several times their live memory in holes, enough for the kernel to kill the process; `HeapWatch` releases after
a step once RSS has grown by more than its slack since the last release.
Trimming alone is not enough under a long burst: glibc raises its mmap threshold each time a block it had mmapped
is freed (up to 32 MiB), after which every tensor up to that size comes from the arenas, and large decode and
token2wav steps leave holes faster than a trim per step gives back. `cap_mmap_threshold` fixes the threshold at
4 MiB once, when the engine starts: larger tensors are then mapped and unmapped whole (the same load then peaks at
about half the memory). Fixing it also stops glibc raising its trim threshold, which would stay at 128 KiB and
hand back the heap's top after nearly every free only for the next step to fault it in again, so that is set too
(128 MiB). A lower mmap threshold holds RSS lower still but maps so many of a step's tensors that token2wav runs
slower. `MALLOC_MMAP_THRESHOLD_` or
`MALLOC_TRIM_THRESHOLD_` in the environment is the user's choice and wins.
Elsewhere than glibc (musl, macOS) there is nothing to call and it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the process already runs on
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD_BYTES = 4 << 20  # blocks at least this large are mapped on their own and unmapped when freed
TRIM_THRESHOLD_BYTES = 128 << 20  # free memory at a heap's top kept for the next step before it is handed back


@functools.cache
def cap_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES, trim: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` and its trim threshold at `trim` for this process (once; the
    thresholds no longer rise as mapped blocks are freed); True when set. Does nothing where either is set in the
    environment, or where the C library has no `mallopt`."""
    if not sys.platform.startswith("linux") or {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_TRIM_THRESHOLD, trim) == 1 and mallopt(_M_MMAP_THRESHOLD, threshold) == 1


def release_free_heap() -> bool:
    """Return the heap's free memory to the system (every arena, not only the tops of the heaps); True when the C
    library could be asked. Costs milliseconds: call it when idle, not per step."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def rss_bytes() -> int | None:
    """This process's resident set size (Linux; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


class HeapWatch:
    """The engine loop's heap releases: `release()` when it runs out of work, and `after_step()` after a step,
    which releases when RSS has grown by more than the slack since the last release (at least `min_slack_bytes`,
    else `slack_fraction` of the RSS then): a bounded overshoot for the cost of a /proc read per step and a
    `malloc_trim` (its cost grows with the memory freed) only when the holes are large."""

    def __init__(self, min_slack_bytes: int = 1 << 30, slack_fraction: float = 0.25) -> None:
        self.min_slack_bytes = min_slack_bytes
        self.slack_fraction = slack_fraction
        self.base: int | None = None  # RSS after the last release (None: measured at the next step)
        self.releases = 0  # by after_step

    def release(self) -> bool:
        """Release now; True when the C library could be asked. The next step measures from the released size."""
        self.base = None
        return release_free_heap()

    def after_step(self) -> bool:
        """True when it released."""
        if _malloc_trim() is None:
            return False
        rss = rss_bytes()
        if rss is None:
            return False
        if self.base is None or rss < self.base:
            self.base = rss
            return False
        if rss - self.base <= max(self.min_slack_bytes, int(self.slack_fraction * self.base)):
            return False
        self.release()
        self.base = rss_bytes()
        self.releases += 1
        return True
