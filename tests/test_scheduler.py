"""Scheduler policy without a model: token budget, chunked prefill, preemption order, abort."""

from __future__ import annotations

from vocalis.engine.block_manager import BlockManager
from vocalis.engine.request import Request, RequestStatus, SamplingParams
from vocalis.engine.scheduler import Scheduler

STOP = 999


def _sched(num_blocks: int = 64, block_size: int = 4, max_seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_seqs, budget, stop_ids=[STOP])


def _req(n: int, max_len: int = 100, rid: str | None = None) -> Request:
    return Request(list(range(1, n + 1)), SamplingParams(max_len=max_len), request_id=rid)


def _run(s: Scheduler, next_id: int = 7) -> list[tuple[Request, int]]:
    """One step as the engine does it, sampling `next_id` for every request that samples."""
    out = s.schedule()
    s.update(out, [next_id] * len(out.sampled))
    return out.scheduled


def test_budget_and_chunked_prefill() -> None:
    s = _sched(budget=10)
    a, b = _req(14, rid="a"), _req(3, rid="b")
    s.add(a)
    s.add(b)
    step1 = s.schedule()
    assert [(r.request_id, n) for r, n in step1.scheduled] == [("a", 10)]  # a takes the whole budget
    assert step1.sampled == []  # a's prefill is not finished: nothing sampled
    s.update(step1, [])
    step2 = s.schedule()
    # a continues with its last 4 positions and samples; b is admitted with what is left
    assert [(r.request_id, n) for r, n in step2.scheduled] == [("a", 4), ("b", 3)]
    assert step2.sampled == [a, b]
    s.update(step2, [7, 8])
    assert a.output_ids == [7] and b.output_ids == [8]
    step3 = s.schedule()
    assert [(r.request_id, n) for r, n in step3.scheduled] == [("a", 1), ("b", 1)]  # decodes
    assert step3.num_batched_tokens == 2


def test_max_num_seqs_limits_admission() -> None:
    s = _sched(max_seqs=2)
    reqs = [_req(2, rid=str(i)) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["0", "1"]
    assert reqs[2].status is RequestStatus.WAITING


def test_stop_and_max_len_finish_and_free() -> None:
    s = _sched()
    a, b = _req(3, rid="a"), _req(3, max_len=2, rid="b")
    s.add(a)
    s.add(b)
    out = s.schedule()
    events = s.update(out, [STOP, 5])
    assert events == [(a, None), (b, 5)]
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_ids == [] and a.block_table == []
    _run(s, 6)
    assert b.status is RequestStatus.FINISHED_LENGTH and b.output_ids == [5, 6]
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 64


def test_preemption_takes_latest_admitted_and_recomputes() -> None:
    s = _sched(num_blocks=4, block_size=2, budget=16)
    a = _req(3, rid="a")
    b = Request([10, 11, 12], SamplingParams(max_len=100), request_id="b")
    s.add(a)
    s.add(b)
    _run(s)  # prefill: 3 positions each = 2 blocks each, all 4 blocks taken
    _run(s)  # position 3 still fits in each second block
    assert s.block_manager.num_free_blocks == 0
    out = s.schedule()  # a needs a 3rd block: b (admitted last) is preempted
    assert out.preempted == [b]
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b and b.num_preemptions == 1
    s.update(out, [7])
    # a took b's tail block; b's head block [10, 11] is still cached when b comes back
    s.abort("a")
    out = s.schedule()
    assert out.scheduled == [(b, 3)] and out.sampled == [b]
    assert b.num_cached_tokens == 2 and b.token_ids == [10, 11, 12, 7, 7]


def test_preempting_itself_when_alone() -> None:
    s = _sched(num_blocks=2, block_size=2, budget=16)
    a, b = _req(3, rid="a"), _req(1, rid="b")
    s.add(a)
    _run(s)
    _run(s)  # a: 4 positions computed = 2 blocks, cache full
    s.add(b)
    out = s.schedule()  # a cannot grow and is the only running request: it preempts itself
    assert out.preempted == [a] and out.scheduled == []
    assert list(s.waiting) == [a, b]


def test_abort_frees_blocks_at_once() -> None:
    s = _sched()
    a, b = _req(10, rid="a"), _req(10, rid="b")
    s.add(a)
    s.add(b)
    _run(s)
    held = s.block_manager.num_free_blocks
    assert s.abort("a") is a
    assert a.status is RequestStatus.FINISHED_ABORTED and a.block_table == []
    assert s.block_manager.num_free_blocks == held + 3
    assert s.abort("a") is None and s.abort("nope") is None
    c = _req(2, rid="c")
    s.add(c)
    assert s.abort("c") is c and not s.waiting  # a waiting request is removed too
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["b"]
