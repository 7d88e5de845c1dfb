"""Deadlines of submitted jobs, as timers on the event loop: each fires when it expires, whatever the backend is
doing, and ends the job through its handle's public surface (`abort()`, async iteration), so the same rules
hold for any backend with `ThreadedBackend`'s surface.

- queue timeout: a job not started `queue_timeout_s` after it was submitted -> `Overloaded` (503);
- run timeout: a job running longer than `run_timeout_s` -> `JobTimeout` (504);
- shutdown: after SIGTERM a grace period runs; when it is over, every job still watched ends with `Overloaded`
  (503 where no audio was sent yet; a stream already under way is cut).

"Started" is the handle's `started` time when it has one (monotonic seconds, as `JobHandle` keeps it), else the
first item's arrival. The consumer reads items through `JobWatch.next` (or `async for`), which returns the
deadline's error as soon as it fires instead of waiting for the backend's next chunk, and never hands over an item
that came after the run deadline (on a busy event loop the timer may run after the item).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from vocalis.errors import VocalisError
from vocalis.serve.errors import JobTimeout, Overloaded

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

    def _add(self, watch: JobWatch) -> None:
        if self.expired:
            watch.fire(Overloaded("the server is shutting down; retry on another instance"))
        self._watches.add(watch)

    def _discard(self, watch: JobWatch) -> None:
        self._watches.discard(watch)


class JobWatch:
    """The deadlines of one job handle. Use `next()` / `async for` to read its items and `close()` when done."""

    def __init__(self, handle: Any, *, queue_timeout_s: float, run_timeout_s: float,
                 shutdown: Shutdown | None = None, wait_for_input: bool = False) -> None:
        self.handle = handle
        self.queue_timeout_s = queue_timeout_s
        self.run_timeout_s = run_timeout_s
        self.fired: VocalisError | None = None
        self._loop = asyncio.get_running_loop()
        self._wake: asyncio.Future[None] = self._loop.create_future()
        # A job fed text over time (WebSocket) cannot start before its first piece, and a backend may not count
        # it as started until then: its queue clock starts at `input_arrived`.
        self._submitted: float | None = None if wait_for_input else (getattr(handle, "submitted", None)
                                                                     or time.monotonic())
        self._first_item: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._shutdown = shutdown
        self._closed = False
        if shutdown is not None:
            shutdown._add(self)
        self._watch_queue()

    # ---- timers ------------------------------------------------------------------------------------------
    def _started(self) -> float | None:
        started = getattr(self.handle, "started", None)
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

    def _arm(self, delay_s: float, callback: Any) -> None:
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
        log.info("job %s: %s", getattr(self.handle, "id", "?"), exc)
        self.handle.abort()
        if not self._wake.done():
            self._wake.set_result(None)
        self._stop_timers()

    def _stop_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._shutdown is not None:
            self._shutdown._discard(self)

    def close(self) -> None:
        """No more deadlines for this job (it ended, or its reader left)."""
        self._closed = True
        self._stop_timers()

    # ---- reading -----------------------------------------------------------------------------------------
    async def next(self) -> Any:
        """The handle's next item; the deadline's error as soon as one fires; StopAsyncIteration at the end."""
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
            except BaseException:
                self.close()
                raise
            if self._first_item is None:
                self._first_item = time.monotonic()
            return item
        task.cancel()
        task.add_done_callback(retrieve)
        assert self.fired is not None
        raise self.fired

    def __aiter__(self) -> JobWatch:
        return self

    async def __anext__(self) -> Any:
        return await self.next()
