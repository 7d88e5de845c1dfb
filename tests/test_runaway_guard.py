"""Runaway guard: a sentence whose LLM falls into a repeating cycle of speech ids stops, the reason recorded on the
request, logged and counted in the server's /metrics; a request that does not loop is unaffected."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import httpx
import pytest
import torch
from serve_support import LogLines, quick_tts, serve

from vocalis.config import PRESETS
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import Request, RequestStatus
from vocalis.engine.runaway import CycleWatch
from vocalis.engine.sampler import Sampler
from vocalis.models.speech_lm import Qwen2LM

TEXT_A = [40, 41, 42, 43, 44, 45]
TEXT_B = [50, 51, 52, 53]


class CycleAfter:
    """The engine's own sampler, except that the rows of the chosen requests draw `cycle` over and over once they
    have `after` ids: a sampler stuck in a loop (the model and the engine around it run as usual)."""

    def __init__(self, sampler: Sampler, cycle: Sequence[int], after: int, chosen: set[str] | None = None) -> None:
        self.sampler, self.cycle, self.after, self.chosen = sampler, list(cycle), after, chosen

    def __call__(self, logp: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        out = self.sampler(logp, requests)
        for i, r in enumerate(requests):
            n = r.num_output_tokens
            if (self.chosen is None or r.request_id in self.chosen) and n >= self.after:
                out[i] = self.cycle[(n - self.after) % len(self.cycle)]
        return out


@pytest.fixture(scope="module")
def lm() -> Qwen2LM:
    torch.manual_seed(0)
    return Qwen2LM(PRESETS["tiny"].llm).eval().requires_grad_(False)


def _engine(lm: Qwen2LM) -> LLMEngine:
    return LLMEngine(lm, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=256))


def _pushes(ids: Sequence[int], span: int, **kw: int) -> list[int | None]:
    """What a fresh watch answers for each id of `ids` pushed in turn."""
    watch, seen, out = CycleWatch(span, **kw), [], []
    for t in ids:
        seen.append(t)
        out.append(watch.push(seen))
    return out


def test_cycle_watch_fires_after_span_repeats_of_a_short_cycle() -> None:
    fired = _pushes([1, 2, 3, 4] + [7, 8, 9] * 5, span=9)
    # the cycle starts after id 4; ids from the second 7 on repeat the one 3 earlier; the 9th such id fires
    assert fired.index(3) == 4 + 3 + 9 - 1 and set(fired[:15]) == {None}
    assert set(_pushes(range(40), span=9)) == {None}  # no repeats
    assert _pushes([5] * 10, span=9) == [None] * 9 + [1]  # one id held: period 1 after 1 + 9 ids
    assert set(_pushes([1, 2, 3] * 6, span=5, max_period=2)) == {None}  # period 3 > max_period


def test_a_looping_request_stops_with_its_reason_and_the_other_is_unaffected(lm: Qwen2LM, caplog) -> None:
    span = 30
    eng = _engine(lm)
    params = eng.sampling_params(len(TEXT_A), seed=3, min_len=0, max_len=400, stop_cycle_span=span)
    a = eng.make_request(TEXT_A, params=params, request_id="a")
    b = eng.make_request(TEXT_B, params=eng.sampling_params(len(TEXT_B), seed=4, stop_cycle_span=span),
                         request_id="b")
    eng.sampler = CycleAfter(eng.sampler, [7, 8, 9], after=10, chosen={"a"})  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="vocalis.engine.scheduler"):
        out = eng.generate([a, b])
    assert a.status is RequestStatus.FINISHED_CYCLE
    assert len(out["a"]) == 10 + 3 + span and out["a"][-6:] == [7, 8, 9] * 2
    assert any("request a: stopped a runaway" in m and "cycle of 3" in m for m in caplog.messages)
    assert eng.block_manager.num_free_blocks == 256  # its KV blocks went back

    # b, alone, without the guard, with its real sampler: the same ids and the same ending
    alone = _engine(lm)
    b0 = alone.make_request(TEXT_B, params=alone.sampling_params(len(TEXT_B), seed=4, stop_cycle_span=0))
    assert alone.generate([b0])[b0.request_id] == out["b"] and b0.status is b.status


def test_the_default_guard_leaves_a_non_looping_request_as_it_was(lm: Qwen2LM) -> None:
    """The model's default span (5 s of one repeated cycle) does not touch a request that does not loop: the same
    ids as with the guard off, to the length bound."""
    outs = []
    for span in (None, 0):
        eng = _engine(lm)
        over = {} if span is None else {"stop_cycle_span": span}
        text = list(range(60, 80))  # a length bound of 400 ids, past the default span
        r = eng.make_request(text, params=eng.sampling_params(len(text), seed=7, **over))
        assert (r.cycle_watch is not None) == (span is None) and r.params.max_len > 125
        outs.append((eng.generate([r])[r.request_id], r.status))
    assert outs[0] == outs[1] and len(outs[0][0]) > 125


def test_the_server_counts_runaway_stops_in_metrics(tmp_path_factory) -> None:
    tts = quick_tts(tmp_path_factory)
    llm = tts.engine.llm
    real = llm.sampler
    llm.sampler = CycleAfter(real, [5, 6], after=0)  # every sentence loops from its first id
    logs = LogLines()
    logging.getLogger("vocalis.engine.scheduler").addHandler(logs)
    text = ("This one sentence runs on and on with many words in it so that its length bound stays far above "
            "the five seconds of repeated speech ids that stop a loop")
    try:
        with serve(tts) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
            r = client.post("/v1/audio/speech", json={"model": "vocalis", "input": text, "response_format": "wav"})
            assert r.status_code == 200 and len(r.content) > 44
            deadline = time.monotonic() + 10
            while 'vocalis_llm_runaway_stops_total{reason="cycle"} 1.0' not in (m := client.get("/metrics").text):
                assert time.monotonic() < deadline, m
                time.sleep(0.05)
            assert 'vocalis_llm_runaway_stops_total{reason="length"} 0.0' in m
    finally:
        llm.sampler = real
        logging.getLogger("vocalis.engine.scheduler").removeHandler(logs)
    assert any("stopped a runaway" in line and "cycle of 2" in line for line in logs.lines), logs.lines
