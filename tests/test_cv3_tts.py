"""CosyVoice 3 end to end through `TTS` (the engine: `AsyncEngine` + `LLMEngine` + `CV3Token2WavEngine`) on the
compat_cv3 fixture with the bundled (small-vocabulary) Qwen tokenizer in its `CosyVoice-BlankEN/` (the fixture has
none; `cv3_support.make_cv3_model_dir`): every mode CV3 supports (zero-shot, cross-lingual, instruct, sft, voice
conversion) equals the batch-1 reference (CV3 frontend prompt -> `reference.cv3.generate` with the same seed ->
silent-token filter -> `reference.cv3.stream_token2wav`), streaming and not, and so does text in pieces
(`reference.cv3.generate_bistream`); the system prompt is added; what CV3 cannot do fails at once with
InputError."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from cv3_support import cv3_reference, make_cv3_model_dir, reference_audio
from tiny_assets import write_voice_like_wav

from vocalis.config import StreamConfig
from vocalis.engine.config import EngineConfig
from vocalis.engine.request import SamplingParams
from vocalis.errors import InputError
from vocalis.frontend.prompt_cv3 import CV3Frontend
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.frontend.voice import Voice
from vocalis.reference.cv3 import generate, stream_token2wav
from vocalis.reference.sampling import make_sampler
from vocalis.runtime.async_engine import AsyncEngine
from vocalis.token2wav.cv3.schedule import keep_token
from vocalis.tts import TTS

TEXT = "Hello there, how are you?"
SEED = 7


def _fixed(tokens: int) -> type[AsyncEngine]:
    class Fixed(AsyncEngine):  # a random LLM may stop after 2 ids: force a length to exercise the chunks
        def llm_params(self, text_ids: list[int]) -> SamplingParams:
            return dataclasses.replace(super().llm_params(text_ids), min_len=tokens, max_len=tokens,
                                       stop_all_masked=True)

    return Fixed


@pytest.fixture(scope="module")
def tts(cv3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from vocalis.model_dir import load_model

    model = load_model(make_cv3_model_dir(tmp_path_factory.mktemp("cv3") / "m", cv3_dir, long_spoken=False))
    t = TTS(model, EngineConfig(num_kv_blocks=64, block_size=8))
    t.engine_type = _fixed(50)
    yield t
    t.close()


@pytest.fixture(scope="module")
def ref(cv3_dir: Path) -> dict[str, torch.Tensor]:
    return cv3_reference(cv3_dir, "ref_stream")


def _voice(ref: dict[str, torch.Tensor], transcript: bool = True, speech: bool = True) -> Voice:
    ids = tuple(ref["prompt_token"][0].tolist()) if speech else ()
    mel = ref["prompt_feat"][0] if speech else torch.zeros(0, 80)
    text_ids = (9906, 1879, 13) if transcript else ()  # a transcript's ids (any ids: the fixture's table is full size)
    return Voice("v", "Hello world." if transcript else "", text_ids, ids, mel, ref["embedding"][0])


def _reference(tts: TTS, request: SynthesisRequest, tokens: int, stream: bool) -> list[np.ndarray]:
    fe, model = tts.frontend, tts.model
    prompt = fe.flow_prompt(request)
    if request.mode is Mode.VC:
        speech = list(request.source_speech_ids)
    else:
        (text_ids,) = fe.segments(request)
        pt, ps = fe.llm_prompt(request)
        gen = torch.Generator().manual_seed(SEED)
        ras, stops = make_sampler(model.config.sampling, gen), list(model.config.llm.stop_token_ids)

        def forced(scores: torch.Tensor, decoded: list[int]) -> int:  # what stop_all_masked does in the engine
            scores = scores.clone()
            scores[stops] = float("-inf")
            return ras(scores, decoded)

        speech, run = [], 0
        for t in generate(model.llm, text_ids, pt, ps, min_len=tokens, max_len=tokens, sample_fn=forced):
            keep, run = keep_token(t, run)
            if keep:
                speech.append(t)
    chunks = stream_token2wav(model.flow, model.hift, torch.tensor([speech]), prompt.speech_ids, prompt.mel,
                              prompt.embedding, StreamConfig(), streaming=stream)
    return [c[0].numpy() for c in chunks]


CASES = {
    "zero_shot": {},
    "cross_lingual": {"transcript": False},
    "sft": {"transcript": False, "speech": False},
}


@pytest.mark.parametrize("mode", [*CASES, "instruct"])
def test_modes_equal_the_reference(tts: TTS, ref, mode: str) -> None:
    voice = _voice(ref, **CASES.get(mode, {}))
    request = tts.request(TEXT, voice=voice, seed=SEED, text_frontend=False,
                          instruct="Speak slowly." if mode == "instruct" else None)
    assert request.mode.value == mode
    stream = mode == "zero_shot"
    got = [c.samples for c in tts.run(request, stream=stream)]
    want = _reference(tts, request, 50, stream)
    assert [len(g) for g in got] == [len(w) for w in want]
    assert len(got) == (2 if stream else 1)
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    print(f"[cv3 e2e] {mode}: max abs diff {worst:.3e}")
    assert worst <= 1e-4


def test_voice_conversion_equals_the_reference(tts: TTS, ref) -> None:
    request = SynthesisRequest(_voice(ref), Mode.VC, source_speech_ids=tuple(ref["token"][0, :60].tolist()), seed=1)
    got = [c.samples for c in tts.run(request, stream=True)]
    want = _reference(tts, request, 0, True)
    assert len(got) == len(want) == 2
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= 1e-4


def test_cv3_prompts_carry_the_system_part(tts: TTS, ref) -> None:
    fe = tts.frontend
    assert isinstance(fe, CV3Frontend)
    system = fe.system_ids()
    assert system[-1] == tts.model.tokenizer.endofprompt_id  # the small bundled vocabulary numbers it 1916
    assert tts.model.tokenizer.decode(system) == "You are a helpful assistant.<|endofprompt|>"
    zs = tts.request(TEXT, voice=_voice(ref), text_frontend=False)
    assert fe.llm_prompt(zs) == (system + [9906, 1879, 13], ref["prompt_token"][0].tolist())
    xl = tts.request(TEXT, voice=_voice(ref, transcript=False), text_frontend=False)
    assert fe.llm_prompt(xl) == (system, [])
    ins = tts.request(TEXT, voice=_voice(ref), instruct="Speak slowly.", text_frontend=False)
    pt, ps = fe.llm_prompt(ins)
    assert ps == [] and pt[-1] == tts.model.tokenizer.endofprompt_id and tts.model.tokenizer.decode(pt).startswith("You are a helpful assistant.")


PIECES = ["Hello there, ", "how are ", "you today? I am ", "fine, thanks."]


@pytest.mark.parametrize("mode", ["zero_shot", "sft"])
def test_text_in_pieces_equals_the_reference(tts: TTS, ref, mode: str) -> None:
    voice = _voice(ref, **CASES[mode])
    request = tts.request(iter(PIECES), voice=voice, seed=SEED)
    assert request.bistream and request.mode.value == mode
    got = [c.samples for c in tts.run(request, stream=True)]
    fe = tts.frontend
    assert fe.llm_prompt(request)[0][: len(fe.system_ids())] == fe.system_ids()
    want = reference_audio(tts, request, True, PIECES)
    assert [len(g) for g in got] == [len(w) for w in want] and len(want) >= 2, [len(w) for w in want]
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    print(f"[cv3 e2e] bistream {mode}: {sum(map(len, want))} samples, max abs diff {worst:.3e}")
    assert worst <= 1e-4


def test_what_cv3_cannot_do_fails_clearly(tts: TTS, ref, cv3_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="backend torch"):
        TTS.load(cv3_dir, backend="onnx")
    # this directory has no speech_tokenizer_v3.onnx / campplus.onnx (test_cv3_serve clones with tiny ones)
    with pytest.raises(InputError, match="speech_tokenizer_v3.onnx|campplus.onnx"):
        tts.add_voice("p", write_voice_like_wav(tmp_path / "p.wav", 1.0), "hello")
