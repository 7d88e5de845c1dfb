"""The async engine's admission queue: requests past `Token2WavConfig.max_streams` in flight wait here, in
submission order, before their LLM starts (loop-thread data, no locking).

Jobs reach the queue when their preparation (text and prompt features, on executor threads) finishes, which
need not be the order they were submitted in; they leave it by submission number (`Job.seq`), so a request
whose prompt took longer to prepare is not overtaken by one submitted after it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vocalis.runtime.handle import Job


class AdmissionQueue:
    """Jobs not started yet against a cap on jobs in flight (None: no cap)."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._jobs: dict[str, Job] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def ids(self) -> Iterator[str]:
        return iter(sorted(self._jobs, key=lambda i: self._jobs[i].seq))

    def offer(self, job: Job, in_flight: int) -> bool:
        """Queue `job` if it may not start now (True), else leave it to start (False). Nothing overtakes a job
        already waiting."""
        if self._jobs or (self.cap is not None and in_flight >= self.cap):
            self._jobs[job.job_id] = job
            return True
        return False

    def next(self, in_flight: int) -> Job | None:
        """The first-submitted waiting job, removed, if the cap has room for one more; else None."""
        if not self._jobs or (self.cap is not None and in_flight >= self.cap):
            return None
        return self._jobs.pop(min(self._jobs.values(), key=lambda j: j.seq).job_id)

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def pop(self, job_id: str) -> Job | None:
        return self._jobs.pop(job_id, None)
