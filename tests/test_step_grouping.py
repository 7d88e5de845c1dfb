"""The token2wav step-grouping policy (pure decisions, no models): who is grouped, bounded holds, no deadlock."""

from __future__ import annotations

import pytest

from vocalis.runtime.step_grouping import StepGrouping, StreamReadiness, plan_token2wav_step

POLICY = StepGrouping(max_wait_steps=4, max_wait_s=1.0)


def ready(key: str, steps: int = 0, seconds: float = 0.0) -> StreamReadiness:
    return StreamReadiness(key, True, waited_steps=steps, waited_s=seconds)


def pending(key: str, steps_to_ready: int | None) -> StreamReadiness:
    return StreamReadiness(key, False, steps_to_ready=steps_to_ready)


def test_nothing_ready_runs_nothing() -> None:
    assert plan_token2wav_step(POLICY, [pending("a", 1), pending("b", None)], llm_has_work=True) == []


def test_a_lone_ready_stream_runs_at_once() -> None:
    assert plan_token2wav_step(POLICY, [ready("a")], llm_has_work=True) == ["a"]


def test_ready_streams_wait_for_a_close_straggler_then_run_together() -> None:
    """5 ready one LLM step before 3 others (the 8-stream bench): hold once, then one step over all 8."""
    first = [ready(f"r{i}") for i in range(5)] + [pending(f"p{i}", 1) for i in range(3)]
    assert plan_token2wav_step(POLICY, first, llm_has_work=True) == []
    after = [ready(f"r{i}", steps=1) for i in range(5)] + [ready(f"p{i}") for i in range(3)]
    assert plan_token2wav_step(POLICY, after, llm_has_work=True) == [f"r{i}" for i in range(5)] + ["p0", "p1", "p2"]


def test_far_or_unknown_stragglers_are_not_waited_for() -> None:
    streams = [ready("a"), pending("far", 5), pending("queued", None)]
    assert plan_token2wav_step(POLICY, streams, llm_has_work=True) == ["a"]


def test_no_stream_waits_beyond_the_step_bound() -> None:
    """Simulate: a straggler whose estimate keeps slipping (e.g. preempted) never holds `a` past max_wait_steps."""
    waited = 0
    while plan_token2wav_step(POLICY, [ready("a", steps=waited), pending("b", 1)], llm_has_work=True) == []:
        waited += 1  # one LLM step ran
        assert waited <= POLICY.max_wait_steps
    assert waited == POLICY.max_wait_steps
    # a straggler that needs more steps than are left is not waited for at all
    assert plan_token2wav_step(POLICY, [ready("a", steps=2), pending("b", 3)], llm_has_work=True) == ["a"]
    assert plan_token2wav_step(POLICY, [ready("a", steps=2), pending("b", 2)], llm_has_work=True) == []


def test_no_stream_waits_beyond_the_time_bound() -> None:
    assert plan_token2wav_step(POLICY, [ready("a", seconds=1.5), pending("b", 1)], llm_has_work=True) == ["a"]
    # slow LLM steps: 3 steps of 0.4 s do not fit in 1 s
    assert plan_token2wav_step(POLICY, [ready("a"), pending("b", 3)], llm_has_work=True, llm_step_s=0.4) == ["a"]
    assert plan_token2wav_step(POLICY, [ready("a"), pending("b", 2)], llm_has_work=True, llm_step_s=0.4) == []


def test_without_llm_work_nothing_waits() -> None:
    """A stream whose LLM has finished (or a bi-stream waiting for text) is never held for an LLM step that
    cannot come: with no LLM work the ready streams run now."""
    streams = [ready("done_llm"), pending("waiting_for_text", 1)]
    assert plan_token2wav_step(POLICY, streams, llm_has_work=False) == ["done_llm"]


def test_disabled_policy_runs_whatever_is_ready() -> None:
    off = StepGrouping(enabled=False)
    assert plan_token2wav_step(off, [ready("a"), pending("b", 1)], llm_has_work=True) == ["a"]


def test_invalid_bounds_are_rejected() -> None:
    with pytest.raises(ValueError):
        StepGrouping(max_wait_steps=-1)
