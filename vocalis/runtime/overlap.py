"""Token2wav steps beside the LLM steps: the engine loop hands each token2wav step to one worker thread and goes
on with LLM steps while it runs, instead of alternating the two.

Ownership: while a step is in flight the worker owns the token2wav engine and every stream state (the loop holds
the LLM's new ids in their jobs, `handle.TokenGate`, and settles the step before any message that touches a
stream); between steps the loop owns them again. So each engine has one owner at a time and no state is shared
mid-step. One worker per engine, not per request; the loop sleeps on its condition until the step's end wakes it
(no polling).

Cores (`OverlapConfig`): intra-op thread counts are per thread. While both run, the LLM's steps take
`llm_threads` and a token2wav step the rest; either alone takes all of them. A thread that drops to fewer
threads gives its OpenMP pool back (`kernels.threads.release_openmp_pool`): idle pools in two threads would make
libgomp cut every worker's spin-wait. On CUDA the worker runs its steps on a CUDA stream of its own, ordered after
the work queued before it, so a token2wav step never waits for a decode step to be read back nor stalls the next
one; the step's one host synchronisation is the audio it hands back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from vocalis.kernels.threads import release_openmp_pool, set_thread_count

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class OverlapConfig:
    """Whether and how the async engine runs token2wav steps beside its LLM steps.

    enabled: overlap the two (False: one after the other on the loop thread). Off by default: on a CPU the two
        sides then share the cores rather than each using all of them in turn, and whether that pays depends on
        the machine (`benchmarks/bench_engine_loop.py` measures it).
    llm_threads: intra-op threads of the LLM's steps while a token2wav step runs beside them; None: half of
        torch's count (at least 1). A token2wav step beside LLM steps takes the rest (at least 1).
    """

    enabled: bool = False
    llm_threads: int | None = None

    def __post_init__(self) -> None:
        if self.llm_threads is not None and self.llm_threads < 1:
            raise ValueError(f"llm_threads must be >= 1 (or None for half the threads), got {self.llm_threads}")

    def split(self, threads: int) -> tuple[int, int]:
        """(LLM threads, token2wav threads) while both run, out of `threads`."""
        llm = self.llm_threads if self.llm_threads is not None else max(1, threads // 2)
        llm = min(llm, threads)
        return llm, max(1, threads - llm)


class ThreadCount:
    """One thread's intra-op count, changed only when it differs (a change costs more than a small step)."""

    def __init__(self) -> None:
        self.now: int | None = None

    def use(self, device: torch.device, threads: int) -> None:
        if device.type != "cpu" or threads == self.now:
            return
        if self.now is not None and threads < self.now:
            release_openmp_pool()  # fewer threads: its idle pool would slow the other thread's ops
        set_thread_count(threads)
        self.now = threads


class Token2WavWorker(Generic[R]):
    """The thread that runs the loop's token2wav steps, one at a time; `wake` is called when a step ends."""

    def __init__(self, device: torch.device, wake: Callable[[], None]) -> None:
        self.device = device
        self._wake = wake
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vocalis-token2wav")
        self._threads = ThreadCount()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def launch(self, step: Callable[[], R], threads: int) -> Future[tuple[R, float]]:
        """Run `step` on the worker with `threads` intra-op threads; the future gives (its result, its seconds)."""
        future = self._pool.submit(self._run, step, threads)
        future.add_done_callback(lambda _: self._wake())
        return future

    def _run(self, step: Callable[[], R], threads: int) -> tuple[R, float]:
        self._threads.use(self.device, threads)
        start = time.perf_counter()
        if self._stream is None:
            out = step()
        else:
            # after what the loop queued before (its prompts, the ids the step reads), on its own stream after that
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
            with torch.cuda.stream(self._stream):
                out = step()
        return out, time.perf_counter() - start

    def close(self) -> None:
        self._pool.shutdown(wait=True)
