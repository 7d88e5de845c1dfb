"""OpenMP pool control: releasing a thread's pool ends its worker threads, and the next parallel op makes them again."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from vocalis.kernels.threads import release_openmp_pool


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _threads_settle_at(expected: int, timeout_s: float = 5.0) -> int:
    """The thread count once it reaches `expected` (or the last count seen after `timeout_s`): a released libgomp
    worker is told to exit and leaves /proc/self/task a moment later, not before `omp_pause_resource_all` returns."""
    deadline = time.monotonic() + timeout_s
    while (count := _threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def _parallel_op() -> None:
    torch.ones(4_000_000).exp_()  # elementwise over 4M values: torch splits it over its OpenMP pool


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="Linux, 2+ CPUs")
def test_release_ends_only_the_calling_threads_workers() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results: dict[str, int] = {}

        def other() -> None:  # a second thread with a pool of its own, alive while the main thread releases
            torch.set_num_threads(2)
            _parallel_op()
            ready.set()
            done.wait()
            results["before_release"] = _threads()
            results["released"] = int(release_openmp_pool())
            results["after_release"] = _threads_settle_at(results["before_release"] - 1)

        ready, done = threading.Event(), threading.Event()
        _parallel_op()  # the main thread's pool: one worker besides itself
        worker = threading.Thread(target=other)
        worker.start()
        ready.wait()
        with_both = _threads()
        assert release_openmp_pool()
        # the main thread's worker ended; the other thread's pool is intact
        assert _threads_settle_at(with_both - 1) == with_both - 1
        done.set()
        worker.join()
        assert results["released"] == 1
        assert results["after_release"] == results["before_release"] - 1
        _parallel_op()  # a new pool for the main thread
        # main + its new worker; the other thread and its worker are gone
        assert _threads_settle_at(with_both - 2) == with_both - 2
    finally:
        torch.set_num_threads(before)
