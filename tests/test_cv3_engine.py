"""The LLM engine drives CosyVoice 3's `CosyVoice3LM` (compat_cv3 fixture): its prefill rows are the official
`lm_input`, greedy and seeded RAS decoding equal the reference decode (`reference.cv3.generate`) in each mode
(zero-shot, no prompt as cross-lingual / sft, instruct), batched equals alone, and the family rules hold (all 200
extra ids stop, min_len masks only sos, a bi-stream needs the system part)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cv3_support import ATOL, cv3_reference, max_diff

from vocalis.config import SamplingConfig
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.lm_family import family_of
from vocalis.engine.request import SamplingParams
from vocalis.errors import InputError
from vocalis.reference.cv3 import generate
from vocalis.reference.sampling import make_greedy_sampler, make_sampler

RUNS = ("", "noprompt_", "instruct_")


@pytest.fixture(scope="module")
def model(cv3_dir: Path):
    """A private copy: the engine packs the LLM's weights in place (same values, new storage)."""
    from vocalis.model_dir import load_model

    return load_model(cv3_dir)


@pytest.fixture(scope="module")
def ref(cv3_dir: Path) -> dict[str, torch.Tensor]:
    return cv3_reference(cv3_dir, "ref_llm")


def _inputs(ref: dict[str, torch.Tensor], run: str) -> tuple[list[int], list[int], list[int]]:
    if run == "":
        return ref["text"][0].tolist(), ref["prompt_text"][0].tolist(), ref["prompt_speech_token"][0].tolist()
    if run == "noprompt_":
        return ref["noprompt_text"][0].tolist(), [], []
    return ref["instruct_text"][0].tolist(), ref["instruct_prompt_text"][0].tolist(), []


def _engine(model, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = {"block_size": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 128}
    cfg.update(kw)
    return LLMEngine(model.llm, EngineConfig(**cfg))  # type: ignore[arg-type]


def test_family_rules(model) -> None:
    fam = family_of(model.llm)
    assert fam.name == "cosyvoice3" and fam.stop_ids == tuple(range(300, 500))
    assert fam.min_len_mask_id == 300  # sos, as the official decoder (eos 301 is not masked)
    assert (fam.ids.sos, fam.ids.task, fam.ids.text_offset) == (300, 302, 500)
    eng = _engine(model)
    assert eng.sampler.eos_id == 300 and eng.scheduler.stop_ids == frozenset(range(300, 500))
    with pytest.raises(InputError, match="endofprompt"):  # bi-streams start with the system part
        eng.make_bistream_request([1, 2], [3, 4])
    with pytest.raises(InputError, match="CosyVoice3LM"):
        family_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("run", RUNS)
def test_prefill_rows_are_the_official_lm_input(model, ref: dict[str, torch.Tensor], run: str) -> None:
    eng = _engine(model)
    ids = eng.ids.prompt(*_inputs(ref, run))
    with torch.inference_mode():
        emb = eng.runner.embed(torch.tensor(ids), all_speech=False)
    assert max_diff(f"{run}engine lm_input", emb[None], ref[f"{run}lm_input"]) <= ATOL


@pytest.mark.parametrize("run", RUNS)
def test_greedy_equals_the_official_tokens(model, ref: dict[str, torch.Tensor], run: str) -> None:
    """The fixture's 16 greedy ids with every stop id masked (the official run's forced length)."""
    eng = _engine(model)
    req = eng.make_request(*_inputs(ref, run), SamplingParams(greedy=True, min_len=16, max_len=16,
                                                              stop_all_masked=True))
    assert eng.generate([req])[req.request_id] == ref[f"{run}tokens"].tolist()


def test_batched_equals_alone_and_the_reference(model, ref: dict[str, torch.Tensor]) -> None:
    """All three modes together, two of each (one greedy, one seeded RAS), with chunked prefill and prefix hits:
    each equals the reference decode of that request alone (same seed -> same speech tokens)."""
    sampling = SamplingConfig()
    eng = _engine(model)
    reqs, want = [], []
    for k, run in enumerate(RUNS * 2):
        text, pt, ps = _inputs(ref, run)
        greedy = k < 3
        params = eng.sampling_params(len(text), sampling, seed=None if greedy else 100 + k,
                                     greedy=greedy, min_len=4, max_len=30)
        reqs.append(eng.make_request(text, pt, ps, params))
        if greedy:
            fn = make_greedy_sampler()
        else:
            gen = torch.Generator().manual_seed(100 + k)
            fn = make_sampler(sampling, gen)
        want.append(list(generate(model.llm, text, pt, ps, min_len=4, max_len=30, sample_fn=fn)))
    got = eng.generate(reqs)
    for k, r in enumerate(reqs):
        assert got[r.request_id] == want[k], f"request {k} ({RUNS[k % 3] or 'zero-shot'})"
    assert reqs[3].num_cached_tokens > 0  # the zero-shot prompt's [sos] + prompt text blocks were shared
    assert eng.block_manager.num_free_blocks == 128 and not eng.has_unfinished()
    alone = _engine(model)
    solo = alone.make_request(*_inputs(ref, RUNS[1]), reqs[4].params)
    assert alone.generate([solo])[solo.request_id] == got[reqs[4].request_id]


def test_default_bounds_and_stop(model, ref: dict[str, torch.Tensor]) -> None:
    """Default length bounds (2x / 20x the text ids) and natural stops: engine == reference for a few seeds."""
    eng = _engine(model, max_num_batched_tokens=64)
    text, pt, ps = _inputs(ref, "")
    sampling = SamplingConfig()
    reqs = [eng.make_request(text, pt, ps, eng.sampling_params(len(text), sampling, seed=s)) for s in range(3)]
    got = eng.generate(reqs)
    for s, r in enumerate(reqs):
        want = list(generate(model.llm, text, pt, ps, sample_fn=make_sampler(sampling, torch.Generator().manual_seed(s))))
        assert got[r.request_id] == want
        assert r.status.value == "stopped"
    # [official] before min_len only sos is masked: another of the 200 stop ids may end a request early
    assert min(len(v) for v in got.values()) < 2 * len(text)
