"""Intra-op thread control for small CPU work inside a step.

The sampler's work (a sort and a few softmaxes over 6564 ids per row) is tiny; forking it over torch's
thread pool costs more than it does, and on a loaded machine a small parallel op waits milliseconds for a
descheduled worker. It runs once per step. (Not per layer, around attention: with passive OpenMP waiting every
switch re-forms the thread team.)

The switch has its own price: right after a parallel region (a decode step) the two set_num_threads calls cost
more than a single row's work, which never forks (every op of it is one row of < 32768 elements, torch's grain).
Callers skip it there.

`release_openmp_pool` is about the other side of the same pool: see its doc. `CoreWorkers` splits work the other
way: whole independent parts (requests) on threads of their own, one core each.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from vocalis.kernels import build

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep nothing


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


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool, if it has one (libgomp's `omp_pause_resource_all`); returns
    whether it could ask. The next parallel op of this thread builds a new pool, so calling it costs nothing
    but that.

    Why: each thread that runs parallel torch ops gets a pool of its own, and libgomp counts the threads of every
    pool: while they outnumber the CPUs it cuts each worker's spin-wait between parallel regions to a few spins,
    so every op of the engine's loop thread waits for a sleeping worker to wake. The thread that loaded the model
    holds such an idle pool; once it is released the loop thread's steps run as fast as in the loading thread
    itself. (With OMP_WAIT_POLICY=PASSIVE nobody spins and both are slow.)
    """
    pause = _omp_pause()
    if pause is None:
        return False
    pause(_OMP_PAUSE_SOFT)
    return True


@functools.cache
def _omp_pause() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the OpenMP runtime torch loaded (libgomp on Linux wheels), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            libs = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(libs):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    log.debug("no libgomp with omp_pause_resource_all loaded: OpenMP pools are left as they are")
    return None


class CoreWorkers:
    """`count` threads that each run torch's CPU ops on themselves alone (one intra-op thread each), for work made
    of independent parts: `map` runs the parts side by side, one per core, instead of one after another with
    every op split over the cores.

    Why: an op split over the cores ends when its slowest share does, so every op waits at a barrier for the
    other threads, and the Python between ops runs on one core while the others spin. On a machine whose cores
    run at different speeds (hybrid P/E cores, a busy SMT sibling, a shared VM) the slowest core paces every op.
    Parts on cores of their own wait for nobody until the last part ends, and one part's Python overlaps the
    other's arithmetic (torch and our kernels release the GIL).

    torch's intra-op thread count is per thread (OpenMP's, MKL's and oneDNN's are read from the calling thread),
    but `torch.set_num_threads` also sets the count a thread started later begins with; that default is put back
    once the workers are set up, so only they run single-threaded."""

    def __init__(self, count: int) -> None:
        if count < 2:
            raise ValueError(f"CoreWorkers needs at least 2 threads, got {count}")
        self.pid = os.getpid()  # a forked child has none of these threads: it needs workers of its own
        threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(count, thread_name_prefix="vocalis-core")
        ready = threading.Barrier(count, timeout=60)

        def one_thread(_: int) -> None:
            torch.get_num_threads()  # the thread's lazy intra-op set-up runs now, not later over our count
            _native_set_up()  # and our native kernels' own copy of it
            torch.set_num_threads(1)
            ready.wait()  # every worker holds one set-up task: each of the `count` threads is set

        list(self._pool.map(one_thread, range(count)))
        torch.set_num_threads(threads)

    def map(self, fn: Callable[[T], R], parts: Sequence[T]) -> list[R]:
        """[fn(part) for part in parts], the parts on the workers side by side (at most `count` at once); an
        exception in any part is raised here once every part has ended."""
        futures = [self._pool.submit(_on_worker, fn, part) for part in parts]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False)


_worker = threading.local()  # per worker thread: whether our native kernels' thread set-up has run in it


def set_thread_count(threads: int) -> None:
    """Set the calling thread's intra-op thread count after its lazy once-per-thread set-ups (ATen's, and our native
    kernels' own copy of it) have run: either would otherwise put the process default back over it on its first
    parallel op. For a long-lived thread that changes its count (the async engine's token2wav worker)."""
    torch.get_num_threads()
    if build.settled():
        _native_thread_setup()
    torch.set_num_threads(threads)


def _native_set_up() -> None:
    """Our kernels' thread set-up in this worker, once they are loaded (a background build may finish after the
    workers start: the first task after that runs it)."""
    if not getattr(_worker, "native", False) and build.settled():
        _native_thread_setup()
        torch.set_num_threads(1)
        _worker.native = True


def _on_worker(fn: Callable[[T], R], part: T) -> R:
    _native_set_up()
    return fn(part)


def _native_thread_setup() -> None:
    """ATen's once-per-thread intra-op set-up as our native kernels hold it (their own copy of the flag: module.cpp,
    `init_threads`), run in the calling thread; nothing where they do not run."""
    ext = build.extension()  # builds them on first use, as the step's first attention call would
    if ext is not None:
        ext.init_threads()
