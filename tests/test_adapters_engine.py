"""Per-request LoRA adapters in the engine: a batch mixing two adapters and the base model gives every request what
it gets alone and what the merged model gives, in prefill and decode; the prefix cache never shares K/V across
adapters; an unknown adapter is one error line; `TTS.load` with several adapters serves each per request."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from serve_support import make_quick_tiny_model_dir

from vocalis.adapters.batched import AdapterBank, bank_linears
from vocalis.adapters.lora_file import (
    LoraAdapter,
    merge_adapter,
    random_adapter,
    save_adapter,
)
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.errors import InputError
from vocalis.model_dir import load_model, random_model

TEXTS = ([5, 9, 17, 3, 22, 8], [11, 4, 30, 2], [7, 7, 19, 25, 6, 13, 14])



def _engine(llm: torch.nn.Module, **kw: object) -> LLMEngine:
    return LLMEngine(llm, EngineConfig(max_num_batched_tokens=16, kv_cache_bytes=8 << 20, **kw))  # chunked prefill


def _run(engine: LLMEngine, jobs: list[tuple[list[int], str | None, int]]) -> list[list[int]]:
    reqs = [engine.make_request(text, params=engine.sampling_params(len(text), seed=seed, max_len=12),
                                request_id=f"r{i}", adapter=adapter) for i, (text, adapter, seed) in enumerate(jobs)]
    out = engine.generate(reqs)
    return [out[r.request_id] for r in reqs]


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, LoraAdapter, LoraAdapter]:
    torch.manual_seed(0)
    llm = random_model().llm.eval()
    a = random_adapter(llm, "a", 2, ("q_proj", "v_proj", "down_proj"), 1)
    b = random_adapter(llm, "b", 4, ("q_proj", "o_proj", "gate_proj", "llm_decoder"), 2)
    return llm, a, b


def _banked(llm: torch.nn.Module, *adapters: LoraAdapter) -> torch.nn.Module:
    m = copy.deepcopy(llm)
    bank_linears(m, AdapterBank(list(adapters)))
    return m


def _merged(llm: torch.nn.Module, adapter: LoraAdapter | None) -> torch.nn.Module:
    m = copy.deepcopy(llm)
    if adapter is not None:
        merge_adapter(m, adapter)
    return m


def test_engine_batch_of_two_adapters_and_base_equals_each_alone_and_merged(models) -> None:
    llm, a, b = models
    banked = _banked(llm, a, b)
    engine = _engine(banked)
    assert engine.adapters == ("a", "b") and engine.runner.adapter_bank is not None
    jobs = [(TEXTS[0], "a", 1), (TEXTS[1], "b", 2), (TEXTS[2], None, 3), (TEXTS[0], "b", 4), (TEXTS[1], None, 5)]
    together = _run(engine, jobs)
    by_adapter = {"a": a, "b": b, None: None}
    for job, got in zip(jobs, together):
        alone = _run(_engine(banked), [job])[0]  # the same bank, the request alone
        merged = _run(_engine(_merged(llm, by_adapter[job[1]])), [(job[0], None, job[2])])[0]  # the merged model
        assert got == alone == merged, job
        assert len(got) > 3
    # the adapters matter: the same text and seed under a, b and the base model give three different sequences
    outs = _run(_engine(banked), [(TEXTS[0], "a", 7), (TEXTS[0], "b", 7), (TEXTS[0], None, 7)])
    assert outs[0] != outs[1] and outs[0] != outs[2] and outs[1] != outs[2]


def test_prefix_cache_is_not_shared_across_adapters(models) -> None:
    llm, a, b = models
    engine = _engine(_banked(llm, a, b))
    text = list(range(3, 3 + 40))  # 40 text ids: two whole 16-position blocks of prompt
    hits = []
    for adapter in ("a", "b", None, "a", None):
        _run(engine, [(text, adapter, 0)])
        hits.append(engine.block_manager.num_prefix_hits)
    # a, b and the base model each compute the prompt; only the second a and the second base request reuse theirs
    assert hits[0] == hits[1] == hits[2] == 0
    assert hits[3] > 0 and hits[4] > hits[3]


def test_unknown_adapter_is_one_error_line(models) -> None:
    llm, a, b = models
    engine = _engine(_banked(llm, a, b))
    with pytest.raises(InputError, match="unknown adapter 'c' \\(loaded: a, b\\)"):
        engine.make_request(TEXTS[0], adapter="c")
    with pytest.raises(InputError, match="unknown adapter 'a' \\(loaded: none\\)"):
        _engine(copy.deepcopy(llm)).make_request(TEXTS[0], adapter="a")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_quick_tiny_model_dir(tmp_path_factory.mktemp("adapters_engine") / "model")
    base = load_model(d).llm
    save_adapter(random_adapter(base, "a", 2, ("q_proj", "v_proj"), 3), d / "adapters" / "a")
    save_adapter(random_adapter(base, "b", 4, ("o_proj", "llm_decoder"), 4), d / "adapters" / "b")
    return d


def test_tts_serves_several_adapters_per_request(model_dir: Path) -> None:
    from vocalis.tts import TTS

    with TTS.load(model_dir, adapters={"a": "a", "b": "b"}) as tts:
        assert tts.adapters == ("a", "b") and tts.adapters_banked
        got = {ad: tts.synthesize("hello there.", seed=3, adapter=ad) for ad in ("a", "b", None)}
        with pytest.raises(InputError, match="unknown adapter 'c'"):
            tts.synthesize("hello there.", seed=3, adapter="c")
    for ad in ("a", "b"):
        with TTS.load(model_dir, adapters={ad: ad}) as merged:  # one adapter: merged into the weights
            assert not merged.adapters_banked
            np.testing.assert_allclose(got[ad], merged.synthesize("hello there.", seed=3), atol=1e-4)
    with TTS.load(model_dir) as base:
        np.testing.assert_allclose(got[None], base.synthesize("hello there.", seed=3), atol=1e-4)
    assert not np.array_equal(got["a"], got["b"])


def test_server_chooses_the_adapter_per_request(tmp_path: Path) -> None:
    """A real server on loopback: the `adapter` field (or the voice's adapter) picks the LoRA adapter; an unknown
    one is a 400 with one line."""
    import httpx
    from serve_support import decode_audio, serve

    from vocalis.tts import TTS

    d = make_quick_tiny_model_dir(tmp_path / "model")
    base = load_model(d).llm
    for name, seed in (("a", 5), ("b", 6)):
        save_adapter(random_adapter(base, name, 2, ("q_proj", "v_proj", "o_proj"), seed), d / "adapters" / name)
    with TTS.load(d, adapters={"a": "a", "b": "b"}) as tts:
        voice = tts.voices[0]
        expected = {ad: tts.synthesize("Hello there.", voice=voice, seed=11, adapter=ad) for ad in ("a", "b", None)}
        assert not np.allclose(expected["a"], expected["b"], atol=1e-3)
        with serve(tts, voice_adapters={voice: "b"}) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
            def speak(**body: object) -> httpx.Response:
                return client.post("/v1/audio/speech", json={"input": "Hello there.", "voice": voice, "seed": 11,
                                                             "response_format": "wav", "stream": False, **body})

            for body, want in (({"adapter": "a"}, "a"), ({}, "b")):  # no field: the voice's adapter
                r = speak(**body)
                assert r.status_code == 200, r.text
                np.testing.assert_allclose(decode_audio("wav", r.content), expected[want], atol=2e-4)
            sft = client.post("/inference_sft", data={"tts_text": "Hello there.", "spk_id": voice, "seed": "11"})
            assert sft.status_code == 200, sft.text  # the CosyVoice routes speak with the voice's adapter too
            np.testing.assert_allclose(decode_audio("pcm", sft.content), np.clip(expected["b"], -1, 1), atol=2e-4)
            r = speak(adapter="nope")
            assert r.status_code == 400
            assert r.json()["error"]["message"] == "unknown adapter 'nope' (loaded: a, b)"
