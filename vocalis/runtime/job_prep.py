"""A `SynthesisRequest` made into the loop's `Job`: the frontend's work (sentences, LLM and flow prompts, the
request's generators) and one token2wav stream per sentence. Runs on an executor thread and touches no engine
state but the streams it creates."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vocalis.frontend.prompt import Frontend
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.runtime.handle import Job, StreamHandle

if TYPE_CHECKING:
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
               text=request.text if request.bistream else None, reader=reader, new_state=new_state)
