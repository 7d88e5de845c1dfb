"""The reference side of `vocalis bench` (its own process): the reference path's LLM decode, token2wav and end to
end on the bench scenario (`bench.scenario`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from vocalis.bench.scenario import (
    REPEAT_SALT,
    BenchConfig,
    bench_text,
    bench_voice,
    build,
    device_generator,
    fixed_length_generate,
    forced_sampler,
    medians,
    peak_rss_mib,
    sync_device,
)
from vocalis.config import TOKEN_RATE
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.frontend.voice import Voice
from vocalis.model_dir import LoadedModel
from vocalis.reference.decode import generate
from vocalis.reference.synthesizer import Synthesizer
from vocalis.reference.token2wav import Token2Wav

log = logging.getLogger(__name__)


def run_reference(cfg: BenchConfig) -> dict[str, Any]:
    model, _, runtime = build(cfg, None)
    voice = bench_voice(model, cfg)
    synth = Synthesizer(model)
    text_ids = model.tokenizer.encode(bench_text(cfg, 0))  # type: ignore[union-attr]
    out: dict[str, Any] = {"runtime": runtime}
    if "llm" in cfg.parts:
        out["llm"] = _reference_llm(cfg, model, voice, text_ids)
    if "token2wav" in cfg.parts:
        out["token2wav"] = _reference_token2wav(cfg, model, voice, synth)
    if "e2e" in cfg.parts:
        out["e2e"] = _reference_e2e(cfg, model, voice, synth)
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def _reference_llm(cfg: BenchConfig, model: LoadedModel, voice: Voice, text_ids: list[int]) -> dict[str, Any]:
    lm, stops = model.llm, model.config.llm.stop_token_ids
    n = cfg.decode_tokens + 1
    _drain(generate(lm, text_ids[:3], max_len=2, min_len=2, sample_fn=forced_sampler(model.config.sampling, None,
                                                                                     stops)))  # warm-up
    gen = device_generator(cfg, 0)
    it = generate(lm, text_ids, voice.prompt_text_ids, voice.prompt_speech_ids, min_len=n, max_len=n,
                     sample_fn=forced_sampler(model.config.sampling, gen, stops))
    start = time.perf_counter()
    next(it)
    first = time.perf_counter()
    rest = _drain(it)
    end = time.perf_counter()
    prompt_len = 2 + len(text_ids) + len(voice.prompt_text_ids) + len(voice.prompt_speech_ids)
    out = {"prompt_len": prompt_len, "prefill_tps": prompt_len / (first - start), "decode_tps": rest / (end - first)}
    log.info("reference LLM: %s", out)
    return out


def _reference_token2wav(cfg: BenchConfig, model: LoadedModel, voice: Voice, synth: Any) -> dict[str, Any]:
    t2w = Token2Wav(model.flow, model.hift)
    prompt = synth.flow_prompt(SynthesisRequest(voice, Mode.ZERO_SHOT, "x"))
    tokens = torch.randint(0, model.config.llm.speech_token_size, (1, cfg.tokens),
                           generator=torch.Generator().manual_seed(1), dtype=torch.int32).to(cfg.device)
    seconds = cfg.tokens / TOKEN_RATE
    sync_device(cfg)
    start = time.perf_counter()
    t2w.offline(tokens, prompt, generator=device_generator(cfg, 2))
    sync_device(cfg)
    offline = time.perf_counter() - start
    start = time.perf_counter()
    state = t2w.new_state(prompt, device_generator(cfg, 2))
    for i in range(1, cfg.tokens + 1):
        if t2w.ready(state, i):
            t2w.stream_step(state, tokens[:, :i])
    t2w.finish(state, tokens)
    sync_device(cfg)
    out = {"offline_rtf": offline / seconds, "stream_rtf": (time.perf_counter() - start) / seconds}
    log.info("reference token2wav: %s", out)
    return out


def _reference_e2e(cfg: BenchConfig, model: LoadedModel, voice: Voice, synth: Any) -> dict[str, Any]:
    synth.generate = fixed_length_generate(model, cfg.tokens)  # the real Synthesizer, its LLM forced to a count
    runs = []
    try:
        for r in range(cfg.e2e_repeats):  # a new text each time, as the engine's repeats (its prefix cache)
            request = SynthesisRequest(voice, Mode.ZERO_SHOT, bench_text(cfg, 1 + REPEAT_SALT * r), seed=0,
                                       text_frontend=False)
            start = time.perf_counter()
            first_chunk, audio = None, 0.0
            for chunk in synth.run(request, stream=True):
                first_chunk = first_chunk or time.perf_counter() - start
                audio += chunk.duration
            wall = time.perf_counter() - start
            runs.append({"first_chunk_s": first_chunk, "rtf": wall / audio, "audio_s": audio, "wall_s": wall,
                         "audio_s_per_s": audio / wall})
            log.info("reference end to end: %s", runs[-1])
    finally:
        del synth.generate
    return medians(runs)



def _drain(it: Iterator[int]) -> int:
    return sum(1 for _ in it)
