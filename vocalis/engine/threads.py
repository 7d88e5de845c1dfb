"""Intra-op thread control for small CPU work inside a step.

The sampler's work (a sort and a few softmaxes over 6564 ids per row) is tiny; forking it over torch's
thread pool costs more than it does, and on a loaded machine a small parallel op waits milliseconds for a
descheduled worker (measured: a 16x6564 sort took 8-13 ms with 2 threads under load). It runs once per step.
(Switching per layer, around attention, measured slower: with passive OpenMP waiting every switch re-forms
the thread team.)

The switch has its own price: right after a parallel region (a decode step) the two set_num_threads calls took
~0.3 ms (measured: a batch-1 sampler call 0.6 ms with the switch, 0.3 ms without, after a 2-thread op), more
than a single row's work, which never forks (every op of it is one row of < 32768 elements, torch's grain).
Callers skip it there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def single_thread(device: torch.device) -> Iterator[None]:
    """Run the enclosed torch CPU ops on the calling thread only (no-op off CPU or when already 1 thread)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
