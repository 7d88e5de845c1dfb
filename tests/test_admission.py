"""AdmissionQueue: the async engine's queue of requests past `max_streams` in flight (pure Python)."""

from __future__ import annotations

from types import SimpleNamespace

from vocalis.runtime.admission import AdmissionQueue


def _job(name: str, seq: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(job_id=name, seq=seq if seq is not None else sum(map(ord, name)))


def test_jobs_wait_past_the_cap_and_start_oldest_first() -> None:
    q = AdmissionQueue(cap=2)
    assert not q.offer(_job("a"), in_flight=0) and not q.offer(_job("b"), in_flight=1)  # room: they start
    assert q.offer(_job("c"), in_flight=2) and q.offer(_job("d"), in_flight=2) and len(q) == 2
    assert q.next(in_flight=2) is None  # still full
    assert q.offer(_job("e"), in_flight=1)  # room for one, but c and d came first: nothing overtakes them
    assert q.pop("d").job_id == "d" and q.pop("d") is None  # a queued job aborted
    assert [q.next(in_flight=1).job_id, q.next(in_flight=1).job_id] == ["c", "e"]
    assert q.next(in_flight=0) is None and len(q) == 0


def test_no_cap_never_queues() -> None:
    q = AdmissionQueue(cap=None)
    assert not any(q.offer(_job(str(i)), in_flight=i) for i in range(100)) and len(q) == 0


def test_queued_jobs_leave_in_submission_order_not_arrival_order() -> None:
    """A job whose preparation finished late (arrives after later submissions) still goes first."""
    q = AdmissionQueue(cap=1)
    assert q.offer(_job("b", seq=2), in_flight=1) and q.offer(_job("c", seq=3), in_flight=1)
    assert q.offer(_job("a", seq=1), in_flight=1)
    assert list(q.ids()) == ["a", "b", "c"]
    assert [q.next(in_flight=0).job_id for _ in range(3)] == ["a", "b", "c"]
