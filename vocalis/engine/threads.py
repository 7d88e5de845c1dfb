"""Intra-op thread control for small CPU work inside a step.

On CPU the engine's non-matmul work (attention over a few hundred keys, sampling over 6564 ids) is tiny;
forking it over torch's thread pool costs more than it does, and on a loaded machine a small parallel op
waits milliseconds for a descheduled worker (measured: a 2x7x64x72 bmm took 2-20 ms with 2 threads under
load, 7-40 us with 1). The big matmuls keep the configured thread count.
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
