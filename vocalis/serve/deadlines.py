"""A submitted job as the server serves it (`JobWatch`): its deadlines, as timers on the event loop, and what it
reports to the metrics. Each deadline fires when it expires, whatever the backend is doing, and ends the job
through its handle's public surface (`abort()`, async iteration), so the same rules hold for every `Backend`.

- queue timeout: a job not started `queue_timeout_s` after it was submitted -> `Overloaded` (503);
- run timeout: a job running longer than `run_timeout_s` -> `JobTimeout` (504);
- shutdown: after SIGTERM a grace period runs; when it is over, every job still watched ends with `Overloaded`
  (503 where no audio was sent yet; a stream already under way is cut).

"Started" is the handle's `started` time when it has one (monotonic seconds), else the first item's arrival. The
consumer reads items through `JobWatch.next` (or `async for`), which returns the deadline's error as soon as it
fires instead of waiting for the backend's next chunk, and never hands over an item that came after the run
deadline (on a busy event loop the timer may run after the item). An engine that stopped (`EngineClosed`: the
server is shutting down) reads as `Overloaded`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from vocalis.errors import VocalisError
from vocalis.frontend.request import AudioChunk
from vocalis.runtime.handle import EngineClosed
from vocalis.serve.backend import JobHandle
from vocalis.serve.errors import Aborted, JobTimeout, Overloaded
from vocalis.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)
POLL_S = 0.1  # how often a queued job is looked at: whether it started (the run timer then takes over)


def retrieve(task: asyncio.Future[Any]) -> None:
    """Done callback for a task given up on: take its outcome, so asyncio does not log it as never retrieved
    (a handle's `__anext__` may end with `Aborted` after the cancel that the abort caused)."""
    if not task.cancelled():
        task.exception()


class Shutdown:
    """The server's drain state. `begin(grace_s)` refuses new work at once and, after the grace, ends every job
    still watched."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = False
        self._watches: set[JobWatch] = set()

    def begin(self, grace_s: float) -> None:
        """Called on the event loop when the server starts shutting down (idempotent)."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: %d job(s) in flight get %.3g s to finish", len(self._watches), grace_s)
        asyncio.get_running_loop().call_later(grace_s, self._expire)

    def check_open(self) -> None:
        if self.draining:
            raise Overloaded("the server is shutting down; retry on another instance")

    def _expire(self) -> None:
        self.expired = True
        if self._watches:
            log.info("shutdown grace over: ending %d job(s)", len(self._watches))
        for watch in list(self._watches):
            watch.fire(Overloaded("the server is shutting down and this request had not finished; retry shortly"))

    def watch(self, watch: JobWatch) -> None:
        """Have the drain end `watch`'s job when the grace is over (at once when it is already over)."""
        if self.expired:
            watch.fire(Overloaded("the server is shutting down; retry on another instance"))
        self._watches.add(watch)

    def unwatch(self, watch: JobWatch) -> None:
        self._watches.discard(watch)


class JobWatch:
    """One job handle under the server's deadlines. Read its chunks with `next()` / `async for`; `close()` when done.

    With `metrics`, it also reports the job under `route`: its first chunk's latency (from `t0`, a perf_counter
    time; a WebSocket sets it when the first text arrives), the audio sent as an active stream, the audio seconds
    and real-time factor of a job that ran to its end, or its abort by a reader that left early. Failures are
    counted by whoever answers the client (the route's error answer, the stream's cut).
    """

    def __init__(self, handle: JobHandle, *, queue_timeout_s: float, run_timeout_s: float,
                 shutdown: Shutdown | None = None, wait_for_input: bool = False, metrics: ServeMetrics | None = None,
                 route: str = "", t0: float | None = None) -> None:
        self.handle = handle
        self.queue_timeout_s = queue_timeout_s
        self.run_timeout_s = run_timeout_s
        self.fired: VocalisError | None = None
        self._loop = asyncio.get_running_loop()
        self._wake: asyncio.Future[None] = self._loop.create_future()
        # A job fed text over time (WebSocket) cannot start before its first piece, and a backend may not count
        # it as started until then: its queue clock starts at `input_arrived`.
        self._submitted: float | None = None if wait_for_input else handle.submitted
        self._first_item: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._shutdown = shutdown
        self._closed = False
        self.metrics = metrics
        self.route = route
        self.t0 = t0
        self.first_chunk_latency = 0.0
        self.audio_samples = 0
        self.sample_rate = 0
        self._outcome: str | None = None  # "finished" | "failed"
        if shutdown is not None:
            shutdown.watch(self)
        self._watch_queue()

    # ---- timers ------------------------------------------------------------------------------------------
    def _started(self) -> float | None:
        started = self.handle.started
        return started if started is not None else self._first_item

    def _watch_queue(self) -> None:
        if self._closed or self.fired is not None:
            return
        started = self._started()
        now = time.monotonic()
        if started is not None:
            self._arm(started + self.run_timeout_s - now, self._run_expired)
        elif self._submitted is None:  # waiting for the client's first text: not queued yet
            self._arm(POLL_S, self._watch_queue)
        elif now - self._submitted >= self.queue_timeout_s:
            self.fire(Overloaded(f"the request waited {self.queue_timeout_s:g} s in the queue without starting; "
                                 "retry shortly"))
        else:
            self._arm(min(POLL_S, self._submitted + self.queue_timeout_s - now), self._watch_queue)

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        if math.isinf(delay_s):
            return
        self._timer = self._loop.call_later(max(0.0, delay_s), callback)

    def _run_over(self) -> bool:
        """Whether the job has been running for its run timeout by the clock, whether or not its timer ran."""
        started = self._started()
        return started is not None and time.monotonic() - started >= self.run_timeout_s

    def _run_expired(self) -> None:
        self.fire(JobTimeout(f"synthesis took longer than {self.run_timeout_s:g} s"))

    def input_arrived(self) -> None:
        """The first text of a `wait_for_input` job came: from now on it is waiting for the backend."""
        if self._submitted is None:
            self._submitted = time.monotonic()

    def fire(self, exc: VocalisError) -> None:
        """End the job now with `exc` (a deadline passed): abort it and wake its reader."""
        if self._closed or self.fired is not None:
            return
        self.fired = exc
        log.info("job %s: %s", self.handle.id, exc)
        self.handle.abort()
        if not self._wake.done():
            self._wake.set_result(None)
        self._stop_timers()

    def _stop_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._shutdown is not None:
            self._shutdown.unwatch(self)

    def close(self) -> None:
        """No more deadlines for this job (it ended, or its reader left); a job not read to its end is aborted."""
        if self._closed:
            return
        self._closed = True
        self._stop_timers()
        if self._outcome is None:
            self.handle.abort()
        if self.metrics is None:
            return
        if self._first_item is None:
            return  # nothing was sent: the route's answer (or its client's leaving) is counted where it is made
        self.metrics.active_streams.dec()
        if self._outcome is None and self.fired is None:
            self.metrics.aborted.inc()
            log.info("job %s ended early (client gone); aborted", self.handle.id)

    # ---- reading -----------------------------------------------------------------------------------------
    async def next(self) -> AudioChunk:
        """The handle's next chunk; the deadline's error as soon as one fires; StopAsyncIteration at the end."""
        if self.fired is not None:
            raise self.fired
        task = asyncio.ensure_future(self.handle.__anext__())
        try:
            await asyncio.wait({task, self._wake}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the reader was cancelled (client gone, server stopping)
            task.cancel()
            task.add_done_callback(retrieve)
            raise
        if self.fired is None and self._run_over():  # a busy loop can run the timer after the item came
            self._run_expired()
        if task.done() and self.fired is None:  # an item (or the end, or the job's own error) came in time
            try:
                item = task.result()
            except StopAsyncIteration:
                self._ended("finished")
                raise
            except EngineClosed as exc:  # the engine stops only when the server does
                self._ended("failed", Overloaded(f"the server is shutting down ({exc}); retry shortly"))
                raise Overloaded(f"the server is shutting down ({exc}); retry shortly") from None
            except BaseException as exc:
                self._ended("failed", exc)
                raise
            self._count(item)
            return item
        task.cancel()
        task.add_done_callback(retrieve)
        assert self.fired is not None
        self._ended("failed", self.fired)
        raise self.fired

    def __aiter__(self) -> JobWatch:
        return self

    async def __anext__(self) -> AudioChunk:
        return await self.next()

    # ---- accounting --------------------------------------------------------------------------------------
    def _count(self, chunk: AudioChunk) -> None:
        if self._first_item is None:
            self._first_item = time.monotonic()
            self.sample_rate = chunk.sample_rate
            if self.t0 is not None:
                self.first_chunk_latency = time.perf_counter() - self.t0
            if self.metrics is not None:
                self.metrics.first_chunk.labels(self.route).observe(self.first_chunk_latency)
                self.metrics.active_streams.inc()
        self.audio_samples += len(chunk.samples)

    def _ended(self, outcome: str, error: BaseException | None = None) -> None:
        if self._outcome is not None:
            return
        self._outcome = outcome
        self.close()
        if isinstance(error, VocalisError) and not isinstance(error, Aborted) and self._first_item is not None:
            # before the first chunk the route's answer tells it (and counts it); after it, the log does
            log.warning("stream %s failed after %d samples: %s", self.handle.id, self.audio_samples, error)
        if self.metrics is not None and outcome == "finished":
            seconds = self.seconds
            self.metrics.audio_seconds.inc(seconds)
            if seconds > 0:
                self.metrics.rtf.labels(self.route).observe(self.busy_s / seconds)

    @property
    def seconds(self) -> float:
        return self.audio_samples / self.sample_rate if self.sample_rate else 0.0

    @property
    def busy_s(self) -> float:
        h = self.handle
        return (h.finished or time.monotonic()) - (h.started or h.submitted)

    @property
    def stats(self) -> dict[str, Any]:
        seconds = self.seconds
        return {"audio_seconds": round(seconds, 3), "rtf": round(self.busy_s / seconds, 4) if seconds else 0.0}
