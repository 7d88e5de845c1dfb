"""Giving freed heap memory back to the operating system when the engine goes idle (`release_free_heap`).

Why: glibc's malloc keeps what a thread frees in that thread's arena and returns to the system only the free
memory at the top of each heap. A serving burst allocates tensors of many sizes from several threads (the engine
loop, torch's OpenMP workers, the server's threads), so the freed memory it leaves is mostly holes, and the
process's RSS creeps up from burst to burst although nothing is kept (the count of Python objects stays the same;
a `malloc_trim` after each burst levels it off; docs/benchmarks.md). `AsyncEngine` calls this once each time its
loop runs out of work.
Elsewhere than glibc (musl, macOS) there is nothing to call and it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
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


def release_free_heap() -> bool:
    """Return the heap's free memory to the system (every arena, not only the tops of the heaps); True when the C
    library could be asked. Costs milliseconds: call it when idle, not per step."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
