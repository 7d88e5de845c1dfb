"""Grouping token2wav steps: when to run the batched token2wav step, and over which streams.

A token2wav step has a large fixed cost (the flow estimator's and HiFT's weights are streamed once per step, per-step
Python over every layer), so one step over 8 streams costs far less than two steps over 5 and 3. An LLM step is cheap
next to it, and the LLM steps run anyway: moving some of them ahead of a token2wav step
wastes no work, it only delays the streams already ready by those LLM steps.

The policy ("hold for stragglers"): when some streams have a chunk ready and other streams will be ready within a few
LLM steps (their token count is close to their next hop threshold, or their LLM request is about to finish), keep
running LLM steps until those are ready too, then run one token2wav step over all of them. The hold is bounded: no
ready stream waits more than `max_wait_steps` LLM steps or `max_wait_s` seconds, and only streams whose estimated
arrival fits in what is left of both bounds are waited for. Nothing waits when the LLM has no work (no stream can
get closer; a bi-stream waiting for its text, for instance) or when no other stream is close, so a lone stream's
chunks are never delayed.

The decision (`plan_token2wav_step`) is pure Python over `StreamReadiness` records, so it is tested without models;
`readiness` builds the records from the engine loop's jobs (their stream states and LLM requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepGrouping:
    """How the async engine groups streams into token2wav steps.

    enabled: hold ready streams for nearly-ready ones (False: a token2wav step whenever any stream is ready, the
        previous behaviour).
    max_wait_steps: most LLM steps a ready stream is held back.
    max_wait_s: most seconds a ready stream is held back (a slow LLM step, e.g. fp32 at large batch, counts fully).
    """

    enabled: bool = True
    max_wait_steps: int = 8
    max_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_wait_steps < 0 or self.max_wait_s < 0:
            raise ValueError(f"max_wait_steps and max_wait_s must be >= 0, got {self.max_wait_steps}, "
                             f"{self.max_wait_s}")


@dataclass(frozen=True, slots=True)
class StreamReadiness:
    """One stream's standing before a token2wav step.

    key: the caller's name for the stream.
    ready: it has a chunk (or its final chunk) ready now.
    steps_to_ready: not ready: LLM steps until it will be, at most (None: unknown or not coming from LLM steps —
        its request is queued, preempted, or a bi-stream waiting for text). Unused when ready.
    waited_steps / waited_s: ready: LLM steps run / seconds passed since it became ready.
    """

    key: str
    ready: bool
    steps_to_ready: int | None = None
    waited_steps: int = 0
    waited_s: float = 0.0


def plan_token2wav_step(policy: StepGrouping, streams: Sequence[StreamReadiness], llm_has_work: bool,
                        llm_step_s: float = 0.0) -> list[str]:
    """Keys of the streams to run in a token2wav step now, in the given order; [] = none now (nothing is ready, or
    the ready ones are held for a nearly-ready stream: run an LLM step first).

    llm_step_s: recent seconds per LLM step, to tell whether a straggler arrives within `max_wait_s`.
    """
    ready = [s for s in streams if s.ready]
    if not ready:
        return []
    run_now = [s.key for s in ready]
    if not policy.enabled or not llm_has_work:
        return run_now  # [no deadlock] with no LLM step to run, no stream can get closer
    steps_left = policy.max_wait_steps - max(s.waited_steps for s in ready)
    seconds_left = policy.max_wait_s - max(s.waited_s for s in ready)
    for s in streams:
        if s.ready or s.steps_to_ready is None or s.steps_to_ready < 1:
            continue
        if s.steps_to_ready <= steps_left and s.steps_to_ready * llm_step_s <= seconds_left:
            return []  # [hold] a straggler arrives within the bound: one step for all of them later
    return run_now
