"""How close each job is to its next token2wav chunk: the `StreamReadiness` records the grouping policy
(`step_grouping.plan_token2wav_step`) decides over, read from the jobs' stream states and LLM requests. Engine loop
thread only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vocalis.engine.request import RequestStatus
from vocalis.runtime.handle import Job
from vocalis.runtime.step_grouping import StreamReadiness
from vocalis.token2wav.protocol import Token2Wav, Token2WavStream

if TYPE_CHECKING:
    from vocalis.backends.vllm.engine import VLLMEngine
    from vocalis.engine.llm_engine import LLMEngine


def vocodable(token2wav: Token2Wav[Token2WavStream], job: Job) -> Token2WavStream | None:
    """The job's emitting stream when the token2wav engine has work for it now, else None."""
    if job.emitting >= len(job.states):
        return None  # a bi-stream waiting for its next sentence's text
    s = job.states[job.emitting]
    return s if token2wav.next_work(s) is not None else None


def steps_to_ready(job: Job, llm: LLMEngine | VLLMEngine, token2wav: Token2Wav[Token2WavStream]
                   ) -> int | None:
    """About how many LLM steps until the job's emitting stream has a chunk ready (None: unknown)."""
    if job.emitting >= len(job.states):
        return None  # a bi-stream waiting for its next sentence's text
    s = job.states[job.emitting]
    req = job.llm_request
    if s.input_done or s.finished or req is None or job.next_segment - 1 != job.emitting:
        return None  # its tokens do not come from the running LLM request
    if req.bistream is not None or req.status is not RequestStatus.RUNNING:
        return None  # a bi-stream's speech ids depend on its text arriving; a queued request has no step yet
    # positions to compute before its next id: 1 when decoding; a prefill yields its first id on its last chunk
    to_compute = max(req.num_tokens - req.num_computed_tokens, 1)
    prefill_steps = -(-to_compute // llm.config.max_num_batched_tokens) - 1
    to_end = max(req.params.max_len - req.num_output_tokens, 1)  # the request ends by then: its final chunk
    if not s.streaming:
        return prefill_steps + to_end
    return prefill_steps + max(1, min(token2wav.tokens_short(s), to_end))


def readiness(jobs: list[Job], llm: LLMEngine | VLLMEngine, token2wav: Token2Wav[Token2WavStream],
              num_llm_steps: int, now: float) -> tuple[list[StreamReadiness], dict[str, tuple[Job, Token2WavStream]]]:
    """One record per job, and the jobs (with their emitting stream) that could be vocoded now, by job id. A job
    becoming ready is stamped with the LLM step count and `now` (`Job.ready_since`), which its wait is counted
    from."""
    views: list[StreamReadiness] = []
    ready: dict[str, tuple[Job, Token2WavStream]] = {}
    for job in jobs:
        s = vocodable(token2wav, job)
        if s is not None:
            if job.ready_since is None:
                job.ready_since = (num_llm_steps, now)
            steps, at = job.ready_since
            ready[job.job_id] = (job, s)
            views.append(StreamReadiness(job.job_id, True, waited_steps=num_llm_steps - steps, waited_s=now - at))
        else:
            views.append(StreamReadiness(job.job_id, False, steps_to_ready=steps_to_ready(job, llm, token2wav)))
    return views, ready
