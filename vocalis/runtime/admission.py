"""The async engine's admission queue: requests past `Token2WavConfig.max_streams` in flight wait here, in
arrival order, before their LLM starts (loop-thread data, no locking)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vocalis.runtime.handle import Job


class AdmissionQueue:
    """Jobs not started yet against a cap on jobs in flight (None: no cap)."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._jobs: dict[str, Job] = {}  # insertion order = arrival order

    def __len__(self) -> int:
        return len(self._jobs)

    def ids(self) -> Iterator[str]:
        return iter(list(self._jobs))

    def offer(self, job: Job, in_flight: int) -> bool:
        """Queue `job` if it may not start now (True), else leave it to start (False). Nothing overtakes a job
        already waiting."""
        if self._jobs or (self.cap is not None and in_flight >= self.cap):
            self._jobs[job.job_id] = job
            return True
        return False

    def next(self, in_flight: int) -> Job | None:
        """The oldest waiting job, removed, if the cap has room for one more; else None."""
        if not self._jobs or (self.cap is not None and in_flight >= self.cap):
            return None
        return self._jobs.pop(next(iter(self._jobs)))

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def pop(self, job_id: str) -> Job | None:
        return self._jobs.pop(job_id, None)
