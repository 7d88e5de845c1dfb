"""The engine loop's token2wav side: which streams the next step takes (the grouping policy says when,
`step_grouping`; deadlines say which, `deadlines`), and running it: inline after an LLM step, or on the overlap
worker beside the LLM's steps (`overlap`). Engine loop thread only."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from vocalis.runtime.deadlines import DeadlineScheduling, StepCost, StreamDue, plan_by_deadline
from vocalis.runtime.handle import Job, TokenGate
from vocalis.runtime.overlap import OverlapConfig, ThreadCount, Token2WavWorker
from vocalis.runtime.readiness import readiness
from vocalis.runtime.step_grouping import StepGrouping, plan_token2wav_step
from vocalis.token2wav.protocol import Token2Wav, Token2WavChunk, Token2WavStream

if TYPE_CHECKING:
    from vocalis.backends.vllm.engine import VLLMEngine
    from vocalis.engine.llm_engine import LLMEngine

Ready = list[tuple[Job, Token2WavStream]]
Delivered = list[tuple[Job, Token2WavChunk]]


class Token2WavSteps:
    """Plans and runs the token2wav steps of one engine loop; `gate` is the one its jobs' token sinks read."""

    def __init__(self, token2wav: Token2Wav[Token2WavStream], device: torch.device, overlap: OverlapConfig,
                 grouping: StepGrouping, deadlines: DeadlineScheduling, wake: Callable[[], None]) -> None:
        self.token2wav = token2wav
        self.device = device
        self.overlap = overlap
        self.grouping = grouping
        self.deadlines = deadlines
        self.cost = StepCost()
        self.gate = TokenGate()
        self._wake = wake
        self.threads = torch.get_num_threads()  # the loop's intra-op threads: the two sides share them
        self.worker: Token2WavWorker[list[Token2WavChunk]] | None = None
        self._llm_threads = ThreadCount()
        self._flight: tuple[Future[tuple[list[Token2WavChunk], float]], Ready] | None = None

    # ---- lifecycle (the engine's start and its loop's end) ------------------------------------------------
    def open(self) -> None:
        if self.overlap.enabled and self.worker is None:
            self.worker = Token2WavWorker(self.device, self._wake)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    @property
    def overlapped(self) -> bool:
        return self.worker is not None

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def waiting(self) -> bool:
        """A step is in flight and has not ended yet."""
        return self._flight is not None and not self._flight[0].done()

    # ---- planning -----------------------------------------------------------------------------------------
    def plan(self, jobs: list[Job], llm: LLMEngine | VLLMEngine, num_llm_steps: int, llm_step_s: float) -> Ready:
        """The jobs (with their emitting stream) to vocode now, in the order the step takes them: [] while none is
        ready, or while the grouping policy holds the ready ones for a job a few LLM steps from its own chunk."""
        now = time.monotonic()
        views, ready = readiness(jobs, llm, self.token2wav, num_llm_steps, now)
        if not ready:
            return []
        keys = plan_token2wav_step(self.grouping, views, llm.has_work(), llm_step_s)
        # without deadlines: first chunks first, then by submission
        keys.sort(key=lambda k: (ready[k][1].chunks_done > 0, ready[k][0].submitted))
        due = [StreamDue(k, ready[k][0].due()) for k in keys]
        chosen = plan_by_deadline(self.deadlines, due, now, self.cost, llm.has_work())
        if any(self.token2wav.starts_cache(ready[k][1]) for k in chosen):
            # [memory] whether a new stream starts its caches is the cache budget's call, made over every ready
            # stream (with none beside it, it would start one over the budget): the others go too, by deadline
            chosen += [s.key for s in sorted(due, key=lambda s: s.due) if s.key not in chosen]
        return [ready[k] for k in chosen]

    # ---- running ------------------------------------------------------------------------------------------
    def start(self, ready: Ready, llm_busy: bool) -> Delivered | None:
        """Run a step over `ready`: inline, returning its chunks with their jobs; or launched on the worker
        (None; `collect` gives them). `llm_busy`: LLM steps go on beside it (new streams may wait for token2wav
        cache room rather than recompute, `Token2Wav.step`'s hold_new; the step gets its share of the threads)."""
        states = [s for _, s in ready]

        def step() -> list[Token2WavChunk]:
            return self.token2wav.step(states, hold_new=llm_busy)

        if self.worker is None:
            start = time.perf_counter()
            chunks = step()
            self._record(len(chunks), time.perf_counter() - start)
            return _pairs(ready, chunks)
        threads = self.overlap.split(self.threads)[1] if llm_busy else self.threads
        self.gate.closed = True  # [ownership] the worker's streams take no ids until the step is collected
        self._flight = (self.worker.launch(step, threads), ready)
        return None

    def collect(self, jobs: Iterable[Job]) -> Delivered:
        """Wait for the step in flight, if any; feed the ids held back meanwhile to `jobs`' streams; the step's
        chunks with their jobs. The step's error, if it raised one, is raised here (the gate open again)."""
        if self._flight is None:
            return []
        future, ready = self._flight
        self._flight = None
        try:
            chunks, seconds = future.result()
        finally:
            self.gate.closed = False
            for job in jobs:
                job.release_held()
        self._record(len(chunks), seconds)
        return _pairs(ready, chunks)

    def before_llm_step(self) -> None:
        """The LLM step's share of the threads: all of them, or `llm_threads` while a token2wav step runs."""
        if self.worker is not None:
            share = self.overlap.split(self.threads)[0] if self._flight is not None else self.threads
            self._llm_threads.use(self.device, share)

    def _record(self, rows: int, seconds: float) -> None:
        self.cost.add(rows, seconds)


def _pairs(ready: Ready, chunks: list[Token2WavChunk]) -> Delivered:
    by_state = {s.request_id: job for job, s in ready}
    return [(by_state[c.request_id], c) for c in chunks]
