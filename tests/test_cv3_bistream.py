"""Bi-streaming for CosyVoice 3 (compat_cv3 fixture LLM): text pieces arriving while the engine decodes give
`reference.cv3.generate_bistream`'s ids, whatever the timing of the pieces and whatever else is in the batch;
the system part goes right after sos, without prompt speech a text block comes before the first decode, and the
fill / eos rules use CosyVoice 3's rows (fill V + 3, eos V + 1, every other extra id masked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vocalis.config import SamplingConfig
from vocalis.engine.bistream import BistreamInput
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import Request, SamplingParams
from vocalis.errors import InputError
from vocalis.reference.cv3 import generate_bistream
from vocalis.reference.sampling import make_greedy_sampler, make_sampler

PIECES = [[40, 41, 42], [43, 44, 45, 46, 47, 48, 49], [50], [51, 52, 53, 54, 55, 56], [57, 58], [59, 60, 61, 62, 63]]
SYSTEM = [1000, 1001, 1002, 151646]  # "You are a helpful assistant.<|endofprompt|>" stands in: any ids, then the marker
TRANSCRIPT = [300 + i for i in range(9)]
PROMPT_SPEECH = [11 + i for i in range(20)]  # two 5+15 blocks: the fill comes early


@pytest.fixture(scope="module")
def model(cv3_dir: Path):
    """A private copy: the engine packs the LLM's weights in place."""
    from vocalis.model_dir import load_model

    return load_model(cv3_dir)


def _engine(model) -> LLMEngine:
    return LLMEngine(model.llm, EngineConfig(block_size=4, max_num_batched_tokens=32, num_kv_blocks=256))


def _sink(got: list[int]):  # -> TokenSink
    return lambda r, tok, done: got.append(tok) if tok is not None else None


def _run(eng: LLMEngine, req: Request, pieces: list[list[int]], steps_between: int, others: tuple[Request, ...] = ()
         ) -> None:
    """Feed the pieces with `steps_between` engine steps after each, then end the text and finish."""
    eng.add_request(req)
    for r in others:
        eng.add_request(r)
    for piece in pieces:
        eng.add_text(req.request_id, piece)
        for _ in range(steps_between):
            eng.step()
    eng.end_text(req.request_id)
    while eng.has_work():
        eng.step()
    assert req.finished and not eng.has_unfinished()


PROMPTS = {"zero_shot": (SYSTEM + TRANSCRIPT, PROMPT_SPEECH), "no_prompt_speech": (SYSTEM, [])}


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("steps_between", [0, 1, 7, 40])
def test_greedy_bistream_equals_the_reference(model, prompt: str, steps_between: int) -> None:
    prompt_text, prompt_speech = PROMPTS[prompt]
    want = list(generate_bistream(model.llm, iter(PIECES), prompt_text, prompt_speech, max_len=60,
                                  sample_fn=make_greedy_sampler()))
    eng = _engine(model)
    got: list[int] = []
    req = eng.make_bistream_request(prompt_text, prompt_speech, SamplingParams(greedy=True), max_len=60,
                                    sink=_sink(got))
    # a unistream request shares the batch the whole time
    other = eng.make_request([7, 8, 9], SYSTEM, params=SamplingParams(greedy=True, min_len=70, max_len=70,
                                                                      stop_all_masked=True))
    _run(eng, req, PIECES, steps_between, (other,))
    assert got == want and len(want) > 15
    assert all(t < 300 for t in got)  # fill ids are never passed on
    assert other.num_output_tokens == 70
    assert eng.block_manager.num_free_blocks == 256


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_seeded_ras_bistream_equals_the_reference(model, prompt: str) -> None:
    prompt_text, prompt_speech = PROMPTS[prompt]
    gen = torch.Generator().manual_seed(5)
    want = list(generate_bistream(model.llm, iter(PIECES), prompt_text, prompt_speech, max_len=50,
                                  sample_fn=make_sampler(SamplingConfig(), gen)))
    eng = _engine(model)
    got: list[int] = []
    req = eng.make_bistream_request(prompt_text, prompt_speech, SamplingParams(seed=5), max_len=50, sink=_sink(got))
    _run(eng, req, PIECES, steps_between=3)
    assert got == want and len(want) > 15


def test_the_layout_fed(model) -> None:
    """What the engine feeds: sos + system part at once; the transcript laid out with the prompt speech; without
    prompt speech a text block before the first decode; at the end the rest of the text and the task id."""
    eng = _engine(model)
    off = eng.ids.text_offset
    req = eng.make_bistream_request(SYSTEM, [], SamplingParams(greedy=True), max_len=20)
    eng.add_request(req)
    eng.add_text(req.request_id, [40, 41, 42])  # fewer than 5 text ids: nothing to compute yet
    assert not eng.has_work() and req.token_ids == []
    eng.add_text(req.request_id, [43, 44])
    assert req.token_ids == [300, *(off + t for t in SYSTEM), *(off + t for t in range(40, 45))]
    eng.abort(req.request_id)

    state = BistreamInput(model.llm.config, SYSTEM + TRANSCRIPT, PROMPT_SPEECH)
    assert state.lm_input == [300, *(off + t for t in SYSTEM)] and state.text_cache == [off + t for t in TRANSCRIPT]
    state.push(list(range(40, 50)))
    fed = state.advance([])
    t = [off + i for i in (*TRANSCRIPT, *range(40, 50))]
    assert fed == [300, *(off + i for i in SYSTEM), *t[:5], *PROMPT_SPEECH[:15], *t[5:10], *PROMPT_SPEECH[15:]]
    assert state.forced(10) == 303  # the fill: 15 - 20 % 15 = 10 ids complete the second block
    assert set(state.masked_ids) == set(range(300, 500)) - {303}
    state.accept(303, 10)
    state.end()
    assert state.advance([0] * 10 + [303])[-1] == 302  # ... + the rest of the text + the task id
    assert set(state.masked_ids) == set(range(300, 500)) - {301}  # only eos may end it now


def test_without_the_system_part_is_an_input_error(model) -> None:
    with pytest.raises(InputError, match="endofprompt"):
        _engine(model).make_bistream_request([1, 2, 3], [])
    with pytest.raises(InputError, match="endofprompt"):
        next(generate_bistream(model.llm, iter(PIECES), [1, 2, 3]))


def test_text_ending_early_gives_the_unistream_layout(model) -> None:
    """Text shorter than one block and no prompt speech: nothing is decoded before the end, so the one prefill is
    [sos] + system + text + [task], the unistream layout: greedy ids equal the unistream reference decode."""
    from vocalis.reference.cv3 import generate

    want_bi = list(generate_bistream(model.llm, iter([[40, 41], [42]]), SYSTEM, max_len=30,
                                     sample_fn=make_greedy_sampler()))
    mask = [i for i in range(300, 500) if i != 301]

    def greedy_eos_only(scores: torch.Tensor, decoded: list[int]) -> int:
        scores = scores.clone()
        scores[mask] = float("-inf")
        return int(scores.argmax())

    want_uni = list(generate(model.llm, [40, 41, 42], SYSTEM, min_len=0, max_len=30, sample_fn=greedy_eos_only))
    assert want_bi == want_uni and len(want_bi) > 0
