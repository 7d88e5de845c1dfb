"""The measurements behind `vocalis bench`, one side per process: the reference path, or the engine at one
precision. Random weights at a preset's shapes; every utterance is forced to a fixed speech-token count
(min_len = max_len, all stop ids masked), so no trained model is needed and both sides do the same work.

The scenario is a saved zero-shot voice (a prompt of `prompt_tokens` speech tokens with its transcript), the
common cloning case; every request speaks `tokens` speech tokens (25 per second of audio).

The LLM's batch-1 decode is also set against its memory-bandwidth limit: `b1_decode_tokens` steps in
`b1_segments` timed segments, a streaming-read bandwidth probe (in a separate process, same thread count) before
each segment and after the last; the fraction is the decode's bytes/s (weights + the row's K/V per step) over the
median probe. Why and how: `vocalis.bench.bandwidth`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vocalis.bench.bandwidth import copy_gbps
from vocalis.config import TOKEN_RATE, SamplingConfig, SpeechLMConfig
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.frontend.voice import Voice
from vocalis.model_dir import LoadedModel, random_model
from vocalis.models.speech_lm import Qwen2LM
from vocalis.reference.decode import generate
from vocalis.reference.sampling import make_sampler

log = logging.getLogger(__name__)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright", "birds",
         "sing", "near", "old", "river", "banks")


PARTS = ("llm", "token2wav", "e2e")
REPEAT_SALT = 1000  # text salt step between repeated end-to-end requests (distinct texts, same length)


@dataclass(frozen=True)
class BenchConfig:
    preset: str = "cosyvoice2-0.5b"
    precisions: tuple[str, ...] = ("fp32",)
    backend: str = "torch"
    threads: int = 2
    batches: tuple[int, ...] = (1, 4, 16)
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    decode_tokens: int = 16  # decode steps timed per LLM measurement at batch > 1
    b1_decode_tokens: int = 64  # batch-1 decode steps timed against the bandwidth limit (bench_bandwidth)
    b1_segments: int = 4  # ... in this many segments, a bandwidth probe before each and after the last
    b1_warmup_tokens: int = 4  # untimed batch-1 decode steps first (the first steps after prefill ran slower)
    e2e_repeats: int = 3  # single-stream end-to-end requests per side; their medians are reported (one varies ~10 %)
    tokens: int = 75  # speech tokens per utterance (3 s)
    prompt_tokens: int = 75  # the voice's prompt speech (3 s)
    text_words: int = 12
    seed: int = 0
    parts: tuple[str, ...] = ("llm", "token2wav", "e2e")  # what each side measures (PARTS)
    device: str = "cpu"  # both sides run there ("cuda": the decode limit comes from the GPU's memory bandwidth)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchConfig:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def peak_rss_mib() -> float:
    """This process's peak resident memory. VmHWM (Linux) starts afresh at exec; ru_maxrss would include the
    parent's resident size at fork time."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """numpy copy bandwidth, bytes read + written per second (the STREAM "copy" convention), 1 and 2 threads;
    best of `repeats` (the machine's figure for the report header; the decode limit uses `bench_bandwidth`'s probes)."""
    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    one, two = (max(copy_gbps(a, b, threads) for _ in range(repeats)) for threads in (1, 2))
    return {"copy_gbps_1_thread": one, "copy_gbps_2_threads": two, "copy_gbps": max(one, two)}


def llm_bytes_per_token(config: SpeechLMConfig, precision: str) -> int:
    """Weight bytes one decode step reads: the Qwen2 layers' Linear weights and biases and the speech head at the
    precision's width, the norms in fp32 (not the embedding tables: a step reads one row). Counted on a meta-device
    model, since a quantised module no longer lists its weights as parameters. (int8's per-channel scales and
    offsets, 8 bytes per output channel, are left out: under 0.2 % of its weight bytes.)"""
    per = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}[precision]
    with torch.device("meta"):
        llm = Qwen2LM(config)
    linear = sum(p.numel() for n, p in llm.qwen.layers.named_parameters() if "layernorm" not in n)
    linear += sum(p.numel() for p in llm.llm_decoder.parameters())
    norms = sum(p.numel() for n, p in llm.qwen.named_parameters() if "norm" in n)
    return linear * per + norms * 4


def kv_bytes_per_position(config: SpeechLMConfig, precision: str) -> int:
    """K/V cache bytes a decode step reads per context position: every layer's keys and values. The engine's
    cache has the model's activation dtype (fp32 for fp32 and int8, 16-bit for bf16/fp16)."""
    q = config.qwen
    width = 2 if precision in ("bf16", "fp16") else 4
    return q.num_hidden_layers * 2 * q.num_key_value_heads * q.head_dim * width


# ---- inputs -----------------------------------------------------------------------------------------------
def bench_voice(model: LoadedModel, cfg: BenchConfig) -> Voice:
    g = torch.Generator().manual_seed(cfg.seed + 7)
    n = cfg.prompt_tokens
    speech = torch.randint(0, model.config.llm.speech_token_size, (n,), generator=g).tolist()
    mel = torch.randn(2 * n, model.config.flow.output_size, generator=g) - 5.0
    assert model.tokenizer is not None
    text_ids = tuple(model.tokenizer.encode("this is the voice prompt speaking clearly"))
    return Voice("bench", "this is the voice prompt speaking clearly", text_ids, tuple(speech), mel,
                 torch.randn(model.config.spk_embed_dim, generator=g))


def bench_text(cfg: BenchConfig, salt: int) -> str:
    return " ".join(WORDS[(salt * 5 + i) % len(WORDS)] for i in range(cfg.text_words)) + "."


def forced_sampler(sampling: SamplingConfig, generator: torch.Generator | None, stop_ids: Sequence[int]):
    """RAS with every stop id masked: with min_len = max_len the reference decodes exactly that many ids."""
    ras = make_sampler(sampling, generator)
    stops = list(stop_ids)

    def sample(scores: torch.Tensor, decoded: Sequence[int]) -> int:
        scores = scores.clone()
        scores[stops] = float("-inf")
        return ras(scores, decoded)

    return sample


def build(cfg: BenchConfig, precision: str | None) -> tuple[LoadedModel, str]:
    torch.set_num_threads(cfg.threads)
    model = random_model(cfg.preset, seed=cfg.seed).to(cfg.device)
    if precision is None:
        return model, f"reference path, fp32 torch, {cfg.device}"
    if precision == "fp32" and cfg.backend == "torch":
        return model, f"backend torch, precision fp32, {cfg.device}"
    from vocalis.runtime.backends import apply_backend

    return model, apply_backend(model, cfg.backend, precision, cfg.device).describe()


def _generator(cfg: BenchConfig, seed: int) -> torch.Generator:
    """A seeded generator on the bench's device (sampling and the vocoder's noise draw there)."""
    return torch.Generator(device=cfg.device).manual_seed(seed)


def _sync(cfg: BenchConfig) -> None:
    """Wait for queued GPU work before reading a clock (CPU work is synchronous)."""
    if torch.device(cfg.device).type == "cuda":
        torch.cuda.synchronize(cfg.device)


# ---- the reference path -------------------------------------------------------------------------------------
def run_reference(cfg: BenchConfig) -> dict[str, Any]:
    from vocalis.reference.synthesizer import Synthesizer

    model, runtime = build(cfg, None)
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
    gen = _generator(cfg, 0)
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
    from vocalis.reference.token2wav import Token2Wav

    t2w = Token2Wav(model.flow, model.hift)
    prompt = synth.flow_prompt(SynthesisRequest(voice, Mode.ZERO_SHOT, "x"))
    tokens = torch.randint(0, model.config.llm.speech_token_size, (1, cfg.tokens),
                           generator=torch.Generator().manual_seed(1), dtype=torch.int32).to(cfg.device)
    seconds = cfg.tokens / TOKEN_RATE
    _sync(cfg)
    start = time.perf_counter()
    t2w.offline(tokens, prompt, generator=_generator(cfg, 2))
    _sync(cfg)
    offline = time.perf_counter() - start
    start = time.perf_counter()
    state = t2w.new_state(prompt, _generator(cfg, 2))
    for i in range(1, cfg.tokens + 1):
        if t2w.ready(state, i):
            t2w.stream_step(state, tokens[:, :i])
    t2w.finish(state, tokens)
    _sync(cfg)
    out = {"offline_rtf": offline / seconds, "stream_rtf": (time.perf_counter() - start) / seconds}
    log.info("reference token2wav: %s", out)
    return out


def fixed_length_generate(model: LoadedModel, tokens: int) -> Callable[..., Iterator[int]]:
    """A `Synthesizer.generate` that decodes exactly `tokens` ids per sentence (RAS with the stop ids masked)."""
    stops = model.config.llm.stop_token_ids

    def fixed(text_ids: list[int], prompt_text_ids: list[int], prompt_speech_ids: list[int],
              sampling: SamplingConfig, generator: torch.Generator) -> Iterator[int]:
        return generate(model.llm, text_ids, prompt_text_ids, prompt_speech_ids, min_len=tokens, max_len=tokens,
                        sample_fn=forced_sampler(sampling, generator, stops))

    return fixed


def fixed_length_engine(tokens: int) -> type[Any]:
    """An `AsyncEngine` whose requests decode exactly `tokens` ids per sentence (every stop id masked)."""
    from vocalis.engine.request import SamplingParams
    from vocalis.runtime.async_engine import AsyncEngine

    class FixedLengthEngine(AsyncEngine):
        def llm_params(self, text_ids: list[int]) -> SamplingParams:
            base = super().llm_params(text_ids)
            return dataclasses.replace(base, min_len=tokens, max_len=tokens, stop_all_masked=True)

    return FixedLengthEngine


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
    return _medians(runs)


def _medians(runs: list[dict[str, float]]) -> dict[str, Any]:
    """The median of every figure over repeated runs, and the runs themselves under "runs"."""
    out: dict[str, Any] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    out["runs"] = runs
    return out


def _drain(it: Iterator[int]) -> int:
    return sum(1 for _ in it)


# ---- the engine -------------------------------------------------------------------------------------------------
def run_engine(cfg: BenchConfig, precision: str) -> dict[str, Any]:
    model, runtime = build(cfg, precision)
    voice = bench_voice(model, cfg)
    out: dict[str, Any] = {"runtime": runtime, "bytes_per_token": llm_bytes_per_token(model.config.llm, precision)}
    if "llm" in cfg.parts:
        out.update(_engine_llm(cfg, model, voice, precision, out["bytes_per_token"]))
    if "token2wav" in cfg.parts:
        out["token2wav"] = _engine_token2wav(cfg, model, voice, precision)
    if "e2e" in cfg.parts:
        out["e2e"] = asyncio.run(_engine_e2e(cfg, model, voice))
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def _engine_llm(cfg: BenchConfig, model: LoadedModel, voice: Voice, precision: str,
                bytes_per_token: int) -> dict[str, Any]:
    from vocalis.bench.bandwidth import probe_for, spread
    from vocalis.engine.config import EngineConfig
    from vocalis.engine.request import SamplingParams
    from vocalis.runtime.backends import make_llm_engine

    tok = model.tokenizer
    assert tok is not None
    out: dict[str, Any] = {"llm": {}}
    # ours, or vLLM's worker with the vllm backend (make_llm_engine reads the model's runtime)
    eng = make_llm_engine(model, EngineConfig(enable_prefix_caching=False, max_num_seqs=max(cfg.batches)))
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
    from vocalis.bench.bandwidth import decode_fraction, probe_for, spread

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
    from vocalis.token2wav.engine import Token2WavEngine

    t2w = Token2WavEngine(model.flow, model.hift)
    prompt = _flow_prompt(model, voice)
    tokens = torch.randint(0, model.config.llm.speech_token_size, (cfg.tokens,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    seconds = cfg.tokens / TOKEN_RATE
    _t2w_run(cfg, t2w, prompt, tokens[:30], True)  # warm-up; also caches the voice's prompt prefix (a saved voice)
    offline = _t2w_run(cfg, t2w, prompt, tokens, False)
    stream = _t2w_run(cfg, t2w, prompt, tokens, True)
    out = {"offline_rtf": offline / seconds, "stream_rtf": stream / seconds}
    log.info("engine %s token2wav: %s", precision, out)
    return out


def _flow_prompt(model: LoadedModel, voice: Voice):  # -> FlowPrompt
    from vocalis.reference.synthesizer import Synthesizer

    return Synthesizer(model).flow_prompt(SynthesisRequest(voice, Mode.ZERO_SHOT, "x"))


def _t2w_run(cfg: BenchConfig, t2w: Any, prompt: Any, tokens: list[int], streaming: bool) -> float:
    _sync(cfg)
    start = time.perf_counter()
    state = t2w.new_stream("bench", prompt, streaming=streaming, generator=_generator(cfg, 2))
    state.add_tokens(tokens)
    state.end_input()
    while not state.finished:
        t2w.step([state])
    _sync(cfg)
    return time.perf_counter() - start


async def _engine_e2e(cfg: BenchConfig, model: LoadedModel, voice: Voice) -> dict[str, Any]:
    from vocalis.engine.config import EngineConfig
    from vocalis.runtime.backends import make_llm_engine
    from vocalis.token2wav.engine import Token2WavEngine

    FixedLengthEngine = fixed_length_engine(cfg.tokens)

    top = max(cfg.concurrency)
    engine = FixedLengthEngine(model, make_llm_engine(model, EngineConfig(max_num_seqs=max(top, 1))),
                               Token2WavEngine(model.flow, model.hift))  # the engines' defaults otherwise
    results: dict[str, Any] = {}
    with engine:
        for c in cfg.concurrency:
            # a warm-up (text path, caches) at this concurrency first: the first step of a new size pays the
            # allocator's first-use page faults (1.4-1.7 M minor faults in a first 8-stream token2wav step, ~0.1 M
            # in the next), which the reference's median of repeated runs leaves out too
            await _engine_batch(engine, voice, cfg, c, salt=100)
            runs = []
            # repeated as the reference's single-stream figures, each with new texts: a repeated text would find
            # its whole prompt in the LLM's prefix cache and skip the prefill the reference pays
            for r in range(cfg.e2e_repeats if c == 1 else 1):
                runs.append(await _engine_batch(engine, voice, cfg, c, salt=c + REPEAT_SALT * r))
                log.info("engine end to end, %d streams: %s", c, runs[-1])
            results[str(c)] = _medians(runs)
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
