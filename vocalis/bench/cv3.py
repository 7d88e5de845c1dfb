"""`vocalis bench --preset cosyvoice3-0.5b`: the CosyVoice 3 engine at a preset's shapes with random weights.

In one process (the CosyVoice 2 bench's side processes compare against its reference path; here the reference is
timed at batch 1 only): the LLM engine's prefill and decode tok/s at each batch size against the batch-1 reference
decode (`reference.cv3.generate`), the CV3 token2wav engine's first chunk and RTF for one stream (after a warm-up
that caches the voice's prompt prefix, as for a saved voice) against the reference `stream_token2wav`, and end
to end (`AsyncEngine`) first chunk and RTF at each concurrency. Every utterance is forced to `tokens` speech ids
(every stop id masked), so random weights decode a fixed length.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import torch

from vocalis.backends.choice import apply_backend
from vocalis.bench.scenario import BenchConfig, peak_gpu_mib, peak_rss_mib
from vocalis.config import TOKEN_RATE, StreamConfig
from vocalis.config.cv3 import CV3_PRESETS, CosyVoice3Config
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import SamplingParams
from vocalis.frontend.prompt import FlowPrompt
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.frontend.tokenizer import TextTokenizer
from vocalis.frontend.voice import Voice
from vocalis.model_dir import BUNDLED_TOKENIZER, CV3_KIND, LoadedModel, build_cv3_modules
from vocalis.reference.cv3 import generate, stream_token2wav
from vocalis.runtime.async_engine import AsyncEngine
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv3 import CV3Token2WavEngine

log = logging.getLogger(__name__)


def random_cv3_model(config: CosyVoice3Config, seed: int = 0) -> LoadedModel:
    """The three CV3 networks at `config`'s shapes, random weights, with the bundled (small) text tokenizer."""
    torch.manual_seed(seed)
    llm, flow, hift = build_cv3_modules(config)
    for m in (llm, flow, hift):
        m.eval().requires_grad_(False)
    return LoadedModel(config, llm, flow, hift, TextTokenizer.from_dir(BUNDLED_TOKENIZER, family=CV3_KIND),  # type: ignore[arg-type]
                       kind=CV3_KIND)


def _voice(model: LoadedModel, cfg: BenchConfig) -> Voice:
    gen = torch.Generator().manual_seed(cfg.seed)
    n, v = cfg.prompt_tokens, model.config.llm.speech_token_size
    return Voice("bench", "prompt", tuple(range(100, 110)), tuple(torch.randint(0, v, (n,), generator=gen).tolist()),
                 torch.randn(2 * n, 80, generator=gen) * 0.5, torch.randn(192, generator=gen))


def _text_ids(model: LoadedModel, cfg: BenchConfig, salt: int) -> list[int]:
    return [200 + (salt * 7 + i) % 1500 for i in range(cfg.text_words * 2)]


def _params(n: int) -> SamplingParams:
    return SamplingParams(seed=0, min_len=n, max_len=n, stop_all_masked=True)


def _llm(cfg: BenchConfig, model: LoadedModel, voice: Voice) -> dict[str, Any]:
    eng = LLMEngine(model.llm, EngineConfig(max_num_seqs=max(cfg.batches)))
    out: dict[str, Any] = {}
    for b in cfg.batches:
        reqs = [eng.make_request(_text_ids(model, cfg, k), voice.prompt_text_ids, voice.prompt_speech_ids,
                                 _params(cfg.decode_tokens + 1)) for k in range(b)]
        for r in reqs:
            eng.add_request(r)
        start = time.perf_counter()
        while any(r.num_output_tokens == 0 for r in reqs):  # prefill (chunked) until every request has its first id
            eng.step()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        while eng.has_work():
            eng.step()
        decode = time.perf_counter() - start
        out[f"b{b}"] = {"prefill_s": prefill, "decode_tok_s": b * cfg.decode_tokens / decode}
    n = cfg.decode_tokens + 1
    start = time.perf_counter()
    first = None
    stops = list(model.config.llm.stop_token_ids)

    def forced(scores: torch.Tensor, decoded: list[int]) -> int:
        scores = scores.clone()
        scores[stops] = float("-inf")
        return int(scores.argmax())

    for i, _ in enumerate(generate(model.llm, _text_ids(model, cfg, 0), voice.prompt_text_ids,
                                   voice.prompt_speech_ids, min_len=n, max_len=n, sample_fn=forced)):
        if i == 0:
            first = time.perf_counter()
    assert first is not None
    out["reference_b1"] = {"prefill_s": first - start, "decode_tok_s": cfg.decode_tokens / (time.perf_counter() - first)}
    return out


def _token2wav(cfg: BenchConfig, model: LoadedModel, voice: Voice) -> dict[str, Any]:
    prompt = FlowPrompt(torch.tensor([voice.prompt_speech_ids]), voice.prompt_mel[None], voice.embedding[None])
    tokens = torch.randint(0, model.config.llm.speech_token_size, (1, cfg.tokens), generator=torch.Generator())
    audio_s = cfg.tokens / TOKEN_RATE
    t2w = CV3Token2WavEngine(model.flow, model.hift, Token2WavConfig(flow_steps=cfg.flow_steps))

    def run(ids: list[int]) -> tuple[float, float]:
        s = t2w.new_stream("bench", prompt)
        s.add_source_tokens(ids)
        s.end_input()
        start, first = time.perf_counter(), None
        while not s.finished:
            t2w.step([s])
            first = first or time.perf_counter() - start
        return first or 0.0, time.perf_counter() - start

    run(tokens[0, :30].tolist())  # warm-up; also computes the voice's prompt prefix (a saved voice)
    first, wall = run(tokens[0].tolist())
    engine = {"first_chunk_s": first, "rtf": wall / audio_s}
    start, first = time.perf_counter(), None
    for _ in stream_token2wav(model.flow, model.hift, tokens, prompt.speech_ids, prompt.mel, prompt.embedding,
                              StreamConfig()):
        first = first or time.perf_counter() - start
    return {"engine": engine, "reference": {"first_chunk_s": first, "rtf": (time.perf_counter() - start) / audio_s}}


async def _e2e(cfg: BenchConfig, model: LoadedModel, voice: Voice) -> dict[str, Any]:
    tokens = cfg.tokens

    class Fixed(AsyncEngine):
        def llm_params(self, text_ids: list[int]) -> SamplingParams:
            return dataclasses.replace(super().llm_params(text_ids), min_len=tokens, max_len=tokens,
                                       stop_all_masked=True)

    out: dict[str, Any] = {}
    t2w = Token2WavConfig(flow_steps=cfg.flow_steps)
    with Fixed.from_model(model, EngineConfig(max_num_seqs=max(cfg.concurrency)), t2w) as engine:
        for c in cfg.concurrency:
            reqs = [SynthesisRequest(voice, Mode.ZERO_SHOT, " ".join(["word"] * cfg.text_words) + f" {k}.", seed=k,
                                     text_frontend=False) for k in range(c)]
            start = time.perf_counter()

            async def one(req: SynthesisRequest) -> tuple[float, float]:
                first, samples = None, 0
                async for chunk in engine.submit(req):
                    first = first or time.perf_counter() - start
                    samples += len(chunk.samples)
                return first or 0.0, samples / model.config.sample_rate

            results = await asyncio.gather(*(one(r) for r in reqs))
            wall = time.perf_counter() - start
            out[f"c{c}"] = {"first_chunk_s": max(f for f, _ in results), "rtf": wall / sum(a for _, a in results),
                            "audio_s_per_s": sum(a for _, a in results) / wall}
    return out


def run_cv3(cfg: BenchConfig, config: CosyVoice3Config | None = None) -> dict[str, Any]:
    """The CV3 report: {"llm": ..., "token2wav": ..., "e2e": ...} for the parts asked. config overrides the preset's
    shapes (tests use tiny ones)."""
    torch.set_num_threads(cfg.threads)
    model = random_cv3_model(config or CV3_PRESETS[cfg.preset], cfg.seed).to(cfg.device)
    precision = cfg.precisions[0]
    apply_backend(model, cfg.backend, precision, cfg.device)
    voice = _voice(model, cfg)
    report: dict[str, Any] = {"config": cfg.to_json(), "precision": precision}
    if "llm" in cfg.parts:
        report["llm"] = _llm(cfg, model, voice)
    if "token2wav" in cfg.parts:
        report["token2wav"] = _token2wav(cfg, model, voice)
    if "e2e" in cfg.parts:
        report["e2e"] = asyncio.run(_e2e(cfg, model, voice))
    report["peak_rss_mib"] = peak_rss_mib()
    report["peak_gpu_mib"] = peak_gpu_mib(cfg.device)
    return report


def cv3_summary(report: dict[str, Any]) -> str:
    lines = [f"vocalis bench (CosyVoice 3, {report['config']['preset']}, {report['precision']}, random weights)"]
    for part in ("llm", "token2wav", "e2e"):
        for key, row in report.get(part, {}).items():
            if isinstance(row, dict):
                lines.append(f"  {part:9s} {key:12s} " + "  ".join(
                    f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, (int, float))))
    lines.append(f"  peak RSS {report['peak_rss_mib']:.0f} MiB")
    return "\n".join(lines)
