"""OpenMP pool control: releasing a thread's pool ends its worker threads, and the next parallel op makes them again;
`CoreWorkers` run their parts side by side, each on one intra-op thread, leaving every other thread's count alone."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from vocalis.kernels import fp32_attention
from vocalis.kernels.threads import CoreWorkers, release_openmp_pool


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


def test_core_workers_run_parts_side_by_side_on_one_thread_each() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        workers = CoreWorkers(2)
        both = threading.Barrier(2, timeout=10)

        def part(n: int) -> tuple[int, str, float]:
            both.wait()  # returns only while the other part runs too
            return torch.get_num_threads(), threading.current_thread().name, float(torch.ones(n).exp().sum())

        results = workers.map(part, [1000, 2000])
        assert [r[0] for r in results] == [1, 1]
        assert len({r[1] for r in results}) == 2 and all(r[1].startswith("vocalis-core") for r in results)
        assert [r[2] for r in results] == pytest.approx([1000 * np.e, 2000 * np.e])
        assert torch.get_num_threads() == 2  # the caller keeps its count...
        later: list[int] = []
        fresh = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        fresh.start()
        fresh.join()
        assert later == [2]  # ...and so does a thread started afterwards

        def failing(n: int) -> int:
            if n == 1:
                raise ValueError("part 1 failed")
            return n

        with pytest.raises(ValueError, match="part 1 failed"):
            workers.map(failing, [0, 1])
        assert workers.map(failing, [2, 3]) == [2, 3]  # the workers outlive a failed part
        workers.close()
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not fp32_attention.available(), reason="needs the native kernels")
def test_core_workers_stay_on_one_thread_through_our_native_kernels() -> None:
    """Our native kernels hold their own copy of ATen's once-per-thread intra-op set-up: a worker's first parallel
    op in them must not put the worker back on the process's thread count (every part after it would then split
    its ops over all cores again, the parts' threads oversubscribing them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        workers = CoreWorkers(2)
        q, k = torch.randn(2, 8, 64, 64), torch.randn(2, 8, 128, 64)

        def part(_: int) -> int:
            fp32_attention.attend(q, k, k, None)  # parallel over batch x heads inside the kernel
            return torch.get_num_threads()

        assert workers.map(part, [0, 1]) == [1, 1]
        assert workers.map(part, [0, 1]) == [1, 1]
        workers.close()
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="Linux, 2+ CPUs")
def test_loading_thread_keeps_no_pool(tmp_path) -> None:
    """`TTS.load` gives the loading thread's pool back: the engine's loop may be started by another thread (the
    first to synthesise), and an idle pool beside the loop's halved a CPU stream's speed for good."""
    from tiny_assets import make_tiny_model_dir

    from vocalis.tts import TTS

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _parallel_op()  # this thread's pool, as loading a model makes it
        tts = TTS.load(model_dir)
        after_load = _threads()
        release_openmp_pool()  # nothing is left to give back: the count stays
        time.sleep(0.2)
        assert _threads() == after_load
        _parallel_op()  # while a pool made after the load is given back
        with_pool = _threads()
        release_openmp_pool()
        assert _threads_settle_at(with_pool - 1) == with_pool - 1
        tts.close()
    finally:
        torch.set_num_threads(before)
