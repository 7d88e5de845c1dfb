"""The engine side of `vocalis bench` (its own process, one precision): the LLM engine's prefill and decode at each
batch size, the token2wav engine, and end to end through `AsyncEngine`, on the bench scenario (`bench.scenario`).

The LLM's batch-1 decode is also set against its memory-bandwidth limit: `b1_decode_tokens` steps in
`b1_segments` timed segments, a streaming-read bandwidth probe (in a separate process, same thread count) before
each segment and after the last; the fraction is the decode's bytes/s (weights + the row's K/V per step) over the
median probe. Why and how: `vocalis.bench.bandwidth`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vocalis.backends.choice import make_llm_engine
from vocalis.bench.bandwidth import decode_fraction, probe_for, spread
from vocalis.bench.decode_bytes import kv_bytes_per_position, llm_bytes_per_token
from vocalis.bench.scenario import (
    REPEAT_SALT,
    BenchConfig,
    bench_text,
    bench_voice,
    build,
    device_generator,
    fixed_length_engine,
    medians,
    peak_gpu_mib,
    peak_rss_mib,
    sync_device,
)
from vocalis.config import TOKEN_RATE
from vocalis.engine.config import EngineConfig
from vocalis.engine.request import SamplingParams
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.frontend.voice import Voice
from vocalis.model_dir import LoadedModel
from vocalis.reference.synthesizer import Synthesizer
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine

if TYPE_CHECKING:
    from vocalis.backends.choice import Runtime

log = logging.getLogger(__name__)


def run_engine(cfg: BenchConfig, precision: str) -> dict[str, Any]:
    model, runtime, described = build(cfg, precision)
    voice = bench_voice(model, cfg)
    out: dict[str, Any] = {"runtime": described, "bytes_per_token": llm_bytes_per_token(model.config.llm, precision)}
    if "llm" in cfg.parts:
        out.update(_engine_llm(cfg, model, runtime, voice, precision, out["bytes_per_token"]))
    if "token2wav" in cfg.parts:
        out["token2wav"] = _engine_token2wav(cfg, model, voice, precision)
    if "e2e" in cfg.parts:
        out["e2e"] = asyncio.run(_engine_e2e(cfg, model, runtime, voice))
    out["peak_rss_mib"] = peak_rss_mib()
    out["peak_gpu_mib"] = peak_gpu_mib(cfg.device)
    return out


def _engine_llm(cfg: BenchConfig, model: LoadedModel, runtime: Runtime | None, voice: Voice, precision: str,
                bytes_per_token: int) -> dict[str, Any]:
    tok = model.tokenizer
    assert tok is not None
    out: dict[str, Any] = {"llm": {}}
    # ours, or vLLM's worker with the vllm backend
    eng = make_llm_engine(model, EngineConfig(enable_prefix_caching=False, max_num_seqs=max(cfg.batches)), runtime)
    eng.generate([eng.make_request([5, 6], params=SamplingParams(min_len=2, max_len=2))])  # warm-up
    kv = kv_bytes_per_position(model.config.llm, precision)
    for b in cfg.batches:
        n = (cfg.b1_warmup_tokens + cfg.b1_decode_tokens if b == 1 else cfg.decode_tokens) + 1
        reqs = [eng.make_request(tok.encode(bench_text(cfg, i)), voice.prompt_text_ids, voice.prompt_speech_ids,
                                 SamplingParams(seed=i, min_len=n, max_len=n, stop_all_masked=True))
                for i in range(b)]
        start = time.perf_counter()
        for r in reqs:
            eng.add_request(r)
        while any(r.num_output_tokens == 0 for r in reqs):
            eng.step()
        first = time.perf_counter()
        prefill_tps = sum(r.num_prompt_tokens for r in reqs) / (first - start)
        if b == 1:
            out["decode_b1"] = _b1_against_bandwidth(cfg, eng, reqs[0], bytes_per_token, kv)
            out["llm"]["1"] = {"prefill_tps": prefill_tps, "decode_tps": out["decode_b1"]["decode_tps"]}
            log.info("engine %s LLM batch 1: %s", precision, out["decode_b1"])
            continue
        # [fair count] a request whose prefill ended early may already have decoded while others prefilled:
        # count only the ids sampled from here on, by steps that are decode steps for every row
        done_before = sum(r.num_output_tokens for r in reqs)
        while eng.has_unfinished():
            eng.step()
        end = time.perf_counter()
        out["llm"][str(b)] = {"prefill_tps": prefill_tps, "decode_tps": (b * n - done_before) / (end - first)}
        log.info("engine %s LLM batch %d: %s", precision, b, out["llm"][str(b)])
    del eng
    if "decode_b1" in out:  # the limit and fraction come from the interleaved batch-1 measurement
        d = out["decode_b1"]
        out["bandwidth_gbps"], out["decode_limit_tps"] = d["bandwidth_gbps"], d["decode_limit_tps"]
    else:  # no batch 1 asked for: the limit from probes alone, no fraction
        with probe_for(cfg.device, cfg.threads) as probe:
            reads = [probe.measure()["read_gbps"] for _ in range(3)]
        out["bandwidth_gbps"] = spread(reads)["median"]
        out["decode_limit_tps"] = out["bandwidth_gbps"] * 1e9 / bytes_per_token
    return out


def _b1_against_bandwidth(cfg: BenchConfig, eng: Any, req: Any, weight_bytes: int, kv_bytes: int) -> dict[str, Any]:
    """Decode `req` (alone in `eng`, its prefill done) in `cfg.b1_segments` timed segments with a bandwidth probe
    before each and after the last (see bench_bandwidth), after `cfg.b1_warmup_tokens` untimed steps (steady
    state: in the first segment right after prefill both precisions ran ~10-20 % slower). A step's bytes: the
    weights plus the K/V of the row's context at that step (its mean over the segment)."""
    total = cfg.b1_decode_tokens
    sizes = [total // cfg.b1_segments + (i < total % cfg.b1_segments) for i in range(cfg.b1_segments)]
    sizes = [s for s in sizes if s > 0]
    segments: list[tuple[int, float]] = []
    step_bytes: list[float] = []
    while req.num_output_tokens < 1 + cfg.b1_warmup_tokens:
        eng.step()
    with probe_for(cfg.device, cfg.threads) as probe:
        for size in sizes:
            probe.measure()
            before = req.num_output_tokens
            context = req.num_prompt_tokens + before  # positions the next step's attention reads (incl. its own)
            start = time.perf_counter()
            while req.num_output_tokens < before + size:
                eng.step()
            seconds = time.perf_counter() - start
            done = req.num_output_tokens - before
            segments.append((done, seconds))
            step_bytes.append(weight_bytes + kv_bytes * (context + (done - 1) / 2))
        probe.measure()
        samples = probe.samples
    while eng.has_unfinished():
        eng.step()
    reads = [s["read_gbps"] for s in samples]
    copies = [s["copy_gbps"] for s in samples]
    out = decode_fraction(segments, reads, step_bytes)
    out.update(weight_bytes=weight_bytes, kv_bytes_per_position=kv_bytes, probe_threads=cfg.threads,
               read_gbps=reads, read_gbps_spread=spread(reads), copy_gbps=copies, copy_gbps_spread=spread(copies),
               fraction_of_copy_limit=out["decode_gbps"] / spread(copies)["median"])
    return out


def _engine_token2wav(cfg: BenchConfig, model: LoadedModel, voice: Voice, precision: str) -> dict[str, Any]:
    t2w = Token2WavEngine(model.flow, model.hift, Token2WavConfig(flow_steps=cfg.flow_steps))
    prompt = _flow_prompt(model, voice)
    tokens = torch.randint(0, model.config.llm.speech_token_size, (cfg.tokens,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    seconds = cfg.tokens / TOKEN_RATE
    _t2w_run(cfg, t2w, prompt, tokens[:30], True)  # warm-up; also caches the voice's prompt prefix (a saved voice)
    offline = _t2w_run(cfg, t2w, prompt, tokens, False)
    stream = _t2w_run(cfg, t2w, prompt, tokens, True)
    # frames x Euler steps through the estimator, warm-up included (what `flow_steps` scales)
    out = {"offline_rtf": offline / seconds, "stream_rtf": stream / seconds,
           "estimator_frames": t2w.stats.estimator_frames}
    log.info("engine %s token2wav: %s", precision, out)
    return out


def _flow_prompt(model: LoadedModel, voice: Voice):  # -> FlowPrompt
    return Synthesizer(model).flow_prompt(SynthesisRequest(voice, Mode.ZERO_SHOT, "x"))


def _t2w_run(cfg: BenchConfig, t2w: Any, prompt: Any, tokens: list[int], streaming: bool) -> float:
    sync_device(cfg)
    start = time.perf_counter()
    state = t2w.new_stream("bench", prompt, streaming=streaming, generator=device_generator(cfg, 2))
    state.add_tokens(tokens)
    state.end_input()
    while not state.finished:
        t2w.step([state])
    sync_device(cfg)
    return time.perf_counter() - start


async def _engine_e2e(cfg: BenchConfig, model: LoadedModel, runtime: Runtime | None, voice: Voice) -> dict[str, Any]:
    FixedLengthEngine = fixed_length_engine(cfg.tokens)

    top = max(cfg.concurrency)
    t2w = Token2WavConfig(max_streams=cfg.max_streams, max_batch=cfg.t2w_step, workers=cfg.t2w_workers,
                          flow_steps=cfg.flow_steps)
    engine = FixedLengthEngine(model, make_llm_engine(model, EngineConfig(max_num_seqs=max(top, 1)), runtime),
                               Token2WavEngine(model.flow, model.hift, t2w))
    # the engines' defaults otherwise
    results: dict[str, Any] = {}
    with engine:
        for c in cfg.concurrency:
            # a warm-up (text path, caches) at this concurrency first: the first step of a new size pays the
            # allocator's first-use page faults (1.4-1.7 M minor faults in a first 8-stream token2wav step, ~0.1 M
            # in the next), which the reference's median of repeated runs leaves out too
            await _engine_batch(engine, voice, cfg, c, salt=100)
            runs = []
            # repeated (single-stream as the reference's figures), each with new texts: a repeated text would find
            # its whole prompt in the LLM's prefix cache and skip the prefill the reference pays
            for r in range(cfg.e2e_repeats if c == 1 else cfg.stream_repeats):
                runs.append(await _engine_batch(engine, voice, cfg, c, salt=c + REPEAT_SALT * r))
                log.info("engine end to end, %d streams: %s", c, runs[-1])
            results[str(c)] = medians(runs)
    return results


async def _engine_batch(engine: Any, voice: Voice, cfg: BenchConfig, c: int, salt: int) -> dict[str, float]:
    requests = [SynthesisRequest(voice, Mode.ZERO_SHOT, bench_text(cfg, salt + i), seed=i, text_frontend=False)
                for i in range(c)]
    start = time.perf_counter()
    handles = [engine.submit(r, stream=True) for r in requests]

    async def consume(h: Any) -> tuple[float, float, float]:
        first, audio = None, 0.0
        async for chunk in h:
            first = first or time.perf_counter() - start
            audio += chunk.duration
        return first or 0.0, audio, time.perf_counter() - start

    done = await asyncio.gather(*[consume(h) for h in handles])
    wall = max(d[2] for d in done)
    audio = sum(d[1] for d in done)
    firsts = [d[0] for d in done]
    return {"first_chunk_s": float(np.mean(firsts)), "first_chunk_max_s": max(firsts), "audio_s": audio,
            "wall_s": wall, "audio_s_per_s": audio / wall, "rtf": wall / (audio / c),
            "peak_rss_mib_so_far": peak_rss_mib()}
