"""A `SynthesisRequest` made into the loop's `Job`: the frontend's work (sentences, LLM and flow prompts, the
request's generators) and one token2wav stream per sentence. Runs on an executor thread and touches no engine
state but the streams it creates. `start_sentence` starts a job's sentences' LLM requests, on the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vocalis.errors import InputError
from vocalis.frontend.prompt import Frontend
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.runtime.handle import Job, StreamHandle
from vocalis.runtime.text_pump import start_segment

if TYPE_CHECKING:
    from vocalis.runtime.async_engine import AsyncEngine
    from vocalis.token2wav.protocol import Token2Wav, Token2WavStream


def prepare_job(frontend: Frontend, token2wav: Token2Wav[Token2WavStream], request: SynthesisRequest,
                stream: bool, handle: StreamHandle) -> Job:
    """The job for `request`, under `handle`'s id; `stream`: chunk by chunk (False: each sentence in one piece)."""
    llm_gen, voc_gen = frontend.generators(request.seed)
    prompt = frontend.flow_prompt(request)
    if request.bistream:
        segments, llm_prompt = [], frontend.llm_prompt(request)
        _ = frontend.tokenizer  # a model without a text tokenizer fails here, with its message
    elif request.mode is Mode.VC:
        segments: list[list[int]] = []
        llm_prompt: tuple[list[int], list[int]] = ([], [])
    else:
        segments = frontend.segments(request)
        llm_prompt = frontend.llm_prompt(request)

    def new_state(i: int) -> Token2WavStream:
        return token2wav.new_stream(f"{handle.request_id}/{i}", prompt, streaming=stream, speed=request.speed,
                                    generator=voc_gen)

    states = [new_state(i) for i in range(max(1, len(segments)))]  # VC and bi-streams: one (more after cuts)
    if request.mode is Mode.VC:
        states[0].add_source_tokens(request.source_speech_ids)
        states[0].end_input()
    reader = frontend.piece_reader(request.language, request.text_frontend) if request.bistream else None
    return Job(handle.request_id, handle, segments, llm_prompt, states, llm_gen,
               text=request.text if request.bistream else None, reader=reader, new_state=new_state,
               adapter=request.adapter)


def start_sentence(engine: AsyncEngine, job: Job) -> None:
    """Start the job's next sentence's LLM request, if any (a bi-stream's one request at once). Loop thread."""
    if job.text is not None:
        if job.next_segment == 0 or (job.cut and job.early_text):  # the first sentence, or one after a cut
            start_segment(engine, job)
        return
    if job.next_segment >= len(job.segments):
        return
    i = job.next_segment
    job.next_segment += 1
    text_ids = job.segments[i]
    sink = job.token_sink(job.states[i])
    try:  # (an unknown adapter fails here: this job only)
        req = engine.llm.make_request(text_ids, *job.llm_prompt, engine.llm_params(text_ids),
                                      request_id=f"{job.job_id}/{i}", sink=sink, generator=job.llm_gen,
                                      adapter=job.adapter)
        job.llm_request = req
        engine.llm.add_request(req)
    except InputError as exc:
        engine.fail(job.job_id, exc)
