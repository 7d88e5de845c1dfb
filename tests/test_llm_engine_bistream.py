"""Bi-streaming in the LLM engine: text pieces arriving while decoding give `Qwen2LM.generate_bistream`'s ids,
whatever the timing of the pieces and whatever else is in the batch."""

from __future__ import annotations

import pytest
import torch

from vocalis.config import PRESETS
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import Request, RequestStatus, SamplingParams
from vocalis.models.speech_lm import Qwen2LM
from vocalis.reference.decode import generate_bistream
from vocalis.reference.sampling import make_greedy_sampler, make_sampler

PIECES = [[40, 41, 42], [43, 44, 45, 46, 47, 48, 49], [50], [51, 52, 53, 54, 55, 56], [57, 58], [59, 60, 61, 62, 63]]
PROMPT_TEXT = [300 + i for i in range(9)]
PROMPT_SPEECH = [11 + i for i in range(20)]  # 20: the prompt speech spans two 5+15 blocks, the fill comes early


@pytest.fixture(scope="module")
def lm() -> Qwen2LM:
    torch.manual_seed(0)
    return Qwen2LM(PRESETS["tiny"].llm).eval().requires_grad_(False)


def _engine(lm: Qwen2LM) -> LLMEngine:
    return LLMEngine(lm, EngineConfig(block_size=4, max_num_batched_tokens=32, num_kv_blocks=512))


def _run(eng: LLMEngine, req: Request, got: list[int], steps_between: int, others: list[Request] = ()) -> None:  # type: ignore[assignment]
    """Feed the pieces with `steps_between` engine steps after each, then end the text and finish."""
    eng.add_request(req)
    for r in others:
        eng.add_request(r)
    for piece in PIECES:
        eng.add_text(req.request_id, piece)
        for _ in range(steps_between):
            eng.step()
    eng.end_text(req.request_id)
    while eng.has_work():
        eng.step()
    assert req.finished and not eng.has_unfinished()


def _sink(got: list[int]):  # -> TokenSink
    return lambda r, tok, done: got.append(tok) if tok is not None else None


@pytest.mark.parametrize("steps_between", [0, 1, 7, 40])
def test_greedy_bistream_equals_generate_bistream(lm: Qwen2LM, steps_between: int) -> None:
    want = list(generate_bistream(lm, iter(PIECES), PROMPT_TEXT, PROMPT_SPEECH, max_len=60,
                                     sample_fn=make_greedy_sampler()))
    eng = _engine(lm)
    got: list[int] = []
    req = eng.make_bistream_request(PROMPT_TEXT, PROMPT_SPEECH, SamplingParams(greedy=True), max_len=60,
                                    sink=_sink(got))
    # a unistream request shares the batch the whole time
    other = eng.make_request([7, 8, 9], params=SamplingParams(greedy=True, min_len=80, max_len=80))
    _run(eng, req, got, steps_between, [other])
    assert got == want and len(want) > 15
    assert other.num_output_tokens == 80
    assert eng.block_manager.num_free_blocks == 512


def test_seeded_ras_bistream_equals_reference(lm: Qwen2LM) -> None:
    gen = torch.Generator().manual_seed(5)
    want = list(generate_bistream(lm, iter(PIECES), PROMPT_TEXT, PROMPT_SPEECH, max_len=50,
                                     sample_fn=make_sampler(PRESETS["tiny"].sampling, gen)))
    eng = _engine(lm)
    got: list[int] = []
    req = eng.make_bistream_request(PROMPT_TEXT, PROMPT_SPEECH, SamplingParams(seed=5), max_len=50, sink=_sink(got))
    _run(eng, req, got, steps_between=3)
    assert got == want


def test_no_prompt_and_waiting_requests_do_not_spin(lm: Qwen2LM) -> None:
    eng = _engine(lm)
    got: list[int] = []
    req = eng.make_bistream_request(params=SamplingParams(greedy=True), max_len=30, sink=_sink(got))
    eng.add_request(req)
    eng.add_text(req.request_id, [1, 2])  # fewer than 5 text ids: nothing to compute yet
    assert eng.has_unfinished() and not eng.has_work()
    for piece in PIECES:
        eng.add_text(req.request_id, piece)
    eng.end_text(req.request_id)
    while eng.has_work():
        eng.step()
    want_with_lead = list(generate_bistream(lm, iter([[1, 2], *PIECES]), max_len=30, sample_fn=make_greedy_sampler()))
    assert got == want_with_lead and len(got) > 10  # the lead piece counts as a piece, as in the reference loop


def test_abort_waiting_bistream(lm: Qwen2LM) -> None:
    eng = _engine(lm)
    req = eng.make_bistream_request(PROMPT_TEXT, PROMPT_SPEECH, SamplingParams(greedy=True))
    eng.add_request(req)
    eng.add_text(req.request_id, PIECES[0])
    assert eng.abort(req.request_id) and req.status is RequestStatus.FINISHED_ABORTED
    eng.add_text(req.request_id, PIECES[1])  # late text for a finished request is dropped
    assert not eng.has_unfinished() and eng.block_manager.num_free_blocks == 512
