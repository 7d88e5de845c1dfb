"""The token2wav deadline policy (`runtime.deadlines`) as pure Python: which ready streams a step takes, and the
step-cost fit that sizes steps of overdue chunks."""

from __future__ import annotations

import pytest

from vocalis.runtime.deadlines import DeadlineScheduling, StepCost, StreamDue, plan_by_deadline

ON = DeadlineScheduling(enabled=True)


def _cost(f: float, c: float, rows: tuple[int, ...] = (1, 2, 4, 8)) -> StepCost:
    cost = StepCost()
    for r in rows:
        cost.add(r, f + c * r)
    return cost


def test_the_fit_recovers_fixed_and_per_row_seconds() -> None:
    f, c = _cost(0.2, 0.5).fit()  # type: ignore[misc]
    assert f == pytest.approx(0.2) and c == pytest.approx(0.5)
    assert _cost(0.2, 0.5).seconds(3) == pytest.approx(1.7)
    assert StepCost().fit() is None and StepCost().seconds(4) == 0.0
    one_width = _cost(0.0, 0.5, rows=(4, 4))
    assert one_width.fit() is None and one_width.seconds(2) == pytest.approx(1.0)  # per row from what was seen
    assert _cost(1.0, 0.0).fit() == (pytest.approx(1.0), 0.0)  # a GPU: width costs nothing


def test_overdue_chunks_are_split_only_where_rows_cost_more_than_a_step() -> None:
    # per-row dominated (a CPU): one row at a time gives the least mean wait of 8 equal chunks
    assert _cost(0.0, 1.0).best_rows(8) == 1
    # f = c: k = sqrt(8) ~ 2.8; the exact mean wait picks between 2 and 3
    k = _cost(1.0, 1.0).best_rows(8)
    assert k in (2, 3)
    waits = {}
    for rows in (1, 2, 3, 4, 8):
        t, total = 0.0, 0.0
        left = 8
        while left:
            size = min(rows, left)
            t += 1.0 + size
            total += t * size
            left -= size
        waits[rows] = total / 8
    assert waits[k] == min(waits.values())
    # fixed-cost dominated (a GPU): all in one step; no fit yet: all in one step (the old behaviour)
    assert _cost(1.0, 0.0).best_rows(8) == 8
    assert StepCost().best_rows(8) == 8


def test_a_new_streams_first_chunk_goes_before_later_chunks_not_yet_due() -> None:
    now = 100.0
    cost = _cost(0.0, 0.1)  # a step over 3 rows: 0.3 s; "soon" = within 0.6 s
    ready = [StreamDue("old-a", now + 3.0), StreamDue("new", now - 0.05), StreamDue("old-b", now + 1.5)]
    assert plan_by_deadline(ON, ready, now, cost) == ["new"]
    # a later chunk about to run dry goes with it, earliest first
    ready.append(StreamDue("old-c", now + 0.4))
    assert plan_by_deadline(ON, ready, now, cost) == ["new", "old-c"]
    # nothing due soon: LLM steps first while it has work; then every ready stream in one step, earliest first
    later = [StreamDue("x", now + 5.0), StreamDue("y", now + 2.0)]
    assert plan_by_deadline(ON, later, now, cost, llm_busy=True) == []
    assert plan_by_deadline(ON, later, now, cost) == ["y", "x"]
    assert plan_by_deadline(ON, [*later, StreamDue("z", now)], now, cost, llm_busy=True) == ["z"]


def test_overdue_first_chunks_in_steps_sized_by_the_cost_fit() -> None:
    now = 10.0
    ready = [StreamDue(f"s{i}", now - 1.0 + i * 0.01) for i in range(8)]  # 8 requests that arrived together
    assert plan_by_deadline(ON, ready, now, _cost(0.0, 1.0)) == ["s0"]  # submission order
    assert plan_by_deadline(ON, ready, now, _cost(1.0, 0.0)) == [f"s{i}" for i in range(8)]
    no_split = DeadlineScheduling(enabled=True, split_overdue=False)
    assert plan_by_deadline(no_split, ready, now, _cost(0.0, 1.0)) == [f"s{i}" for i in range(8)]


def test_off_keeps_the_callers_order_and_the_width_cap_applies() -> None:
    now = 0.0
    ready = [StreamDue("a", 5.0), StreamDue("b", -1.0), StreamDue("c", 0.0)]
    assert plan_by_deadline(DeadlineScheduling(enabled=False), ready, now, _cost(0.0, 1.0)) == ["a", "b", "c"]
    assert plan_by_deadline(DeadlineScheduling(enabled=False), ready, now, StepCost(), max_rows=2) == ["a", "b"]
    with pytest.raises(ValueError, match="soon_steps"):
        DeadlineScheduling(soon_steps=-1.0)
