"""Token2wav speed: the reference streaming path vs the batched, cached engine, per precision.

Random weights at a preset's shapes (default the 0.5B flow + HiFT; the LLM is not built), a fixed number of
random speech tokens per utterance (25 per second of audio), optionally a prompt. Every side runs in its own
process (fresh model, own peak RSS). All tokens are available from the start (as in voice conversion), so the
figures are token2wav alone. Times are wall and process CPU seconds; on a shared machine compare CPU seconds
(with --threads 1 they are pure work, no spin-waiting), since wall time depends on the other load. The engine
sides run with the serving engine's allocator settings (`kernels.heap.cap_mmap_threshold`, as `AsyncEngine`).

  reference: `vocalis.reference.token2wav.Token2Wav`, one stream (its streaming loop re-runs the flow over the
             whole prefix at every chunk); S streams are served one after another, so S x that time.
  engine:    `vocalis.token2wav.cv2.engine.Token2WavEngine` at each precision: one stream, then S streams stepped
             together; plus the mel/waveform error against an fp32 model on the same inputs.

    python benchmarks/bench_token2wav.py --seconds 10 --streams 8 --precisions fp32,bf16,int8 --json t2w.json

`--alternate R` runs the engine precisions in one process instead, R rounds in turn over models built once, each
round one stream per precision after a warm-up stream (the voice's prefix cached, as for a saved voice): on a
shared machine the medians of alternating rounds tell forms apart where separate processes' times drift.

A precision may name the estimator's and HiFT's forms instead of the CPU's default for them (`apply_backend`'s
flow_int8 / conv_int8 / hift_reduced), to measure which is faster on a CPU class: `int8:flow=bf16` (int8 with
the estimator's Linears in bf16, not fbgemm int8), `int8:convs=fp32` (the int8 estimator's conv blocks' convs left
fp32), `int8:hift=bf16` (HiFT's body convs in bf16), `bf16:hift=fp32`; `int8:kernels=off` runs the token2wav engine
on torch's ops instead of our native bf16 kernels (`Token2WavConfig.native_kernels`); `int8:workers=1` runs every
step's requests together on all threads instead of in parts on per-core workers (`Token2WavConfig.workers`).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from vocalis.backends.choice import apply_backend
from vocalis.bench.accuracy import errors, outputs
from vocalis.config import PRESETS, SAMPLE_RATE, TOKEN_RATE
from vocalis.kernels.heap import cap_mmap_threshold
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.reference.token2wav import FlowPrompt, Token2Wav
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine

log = logging.getLogger("bench_token2wav")


def build(preset: str, seed: int = 0) -> SimpleNamespace:
    config = PRESETS[preset]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        flow, hift = CausalMaskedDiffWithXvec(config.flow).eval(), HiFTGenerator(config.hift).eval()
    flow.requires_grad_(False)
    hift.requires_grad_(False)
    return SimpleNamespace(config=config, llm=nn.Module(), flow=flow, hift=hift)


def inputs(args: argparse.Namespace, index: int) -> tuple[FlowPrompt, list[int]]:
    g = torch.Generator().manual_seed(1000 + index)
    p = round(args.prompt_seconds * TOKEN_RATE)
    prompt = FlowPrompt(torch.randint(0, 6561, (1, p), generator=g, dtype=torch.int32),
                        torch.randn(1, 2 * p, 80, generator=g), torch.randn(1, 192, generator=g))
    if args.same_voice:  # every stream speaks with the first stream's voice (the prompt prefix is shared)
        prompt = inputs(argparse.Namespace(**{**vars(args), "same_voice": False}), 0)[0]
    return prompt, torch.randint(0, 6561, (round(args.seconds * TOKEN_RATE),), generator=g).tolist()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mib(field: str) -> float | None:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MiB; None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> float | None:
    """Restart the kernel's peak-RSS mark (VmHWM) at the current RSS (Linux: clear_refs 5); returns that RSS."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return None
    return _status_mib("VmRSS")


def run_reference(args: argparse.Namespace) -> dict[str, Any]:
    model = build(args.preset)
    t2w = Token2Wav(model.flow, model.hift)
    frames = [0]
    model.flow.decoder.estimator.register_forward_hook(
        lambda m, a, out: frames.__setitem__(0, frames[0] + out.shape[0] // 2 * out.shape[-1]))
    prompt, tokens = inputs(args, 0)
    ids = torch.tensor([tokens], dtype=torch.int32)
    state = t2w.new_state(prompt, torch.Generator().manual_seed(0))
    start, cpu0 = time.perf_counter(), time.process_time()
    chunk_times, chunk_cpu, samples = [], [], 0
    with torch.inference_mode():
        while t2w.ready(state, len(tokens)):
            samples += t2w.stream_step(state, ids).shape[1]
            chunk_times.append(time.perf_counter() - start)
            chunk_cpu.append(time.process_time() - cpu0)
        samples += t2w.finish(state, ids).shape[1]
    total, cpu = time.perf_counter() - start, time.process_time() - cpu0
    seconds = samples / SAMPLE_RATE
    one = {"streams": 1, "wall_s": total, "cpu_s": cpu, "audio_seconds": seconds, "rtf": total / seconds,
           "cpu_rtf": cpu / seconds, "first_chunk_s_mean": chunk_times[0] if chunk_times else total,
           "first_chunk_cpu_s_mean": chunk_cpu[0] if chunk_cpu else cpu, "chunk_cpu_s": chunk_cpu,
           "estimator_frames": frames[0]}
    many = {**one, "streams": args.streams, "wall_s": args.streams * total, "cpu_s": args.streams * cpu,
            "audio_seconds": args.streams * seconds, "audio_s_per_s": seconds / total,
            "audio_s_per_cpu_s": seconds / cpu, "first_chunk_s_max": args.streams * total,
            "estimator_frames": args.streams * frames[0],
            "note": "the reference serves streams one after another: S x one stream"}
    return {"side": "reference", "precision": "fp32", "one_stream": one, "multi_stream": many,
            "peak_rss_mib": peak_rss_mib()}


def _run_streams(engine: Token2WavEngine, args: argparse.Namespace, count: int) -> dict[str, Any]:
    states = []
    for i in range(count):
        prompt, tokens = inputs(args, i)
        s = engine.new_stream(f"r{i}", prompt, generator=torch.Generator().manual_seed(i))
        s.add_tokens(tokens)
        s.end_input()
        states.append(s)
    first: dict[str, float] = {}
    samples = 0
    first_cpu: dict[str, float] = {}
    peak_cache = peak_own = 0
    rss_before = reset_peak_rss()
    start, cpu0 = time.perf_counter(), time.process_time()
    steps = 0
    while not all(s.finished for s in states):
        for c in engine.step(states):
            first.setdefault(c.request_id, time.perf_counter() - start)
            first_cpu.setdefault(c.request_id, time.process_time() - cpu0)
            samples += c.samples.size
        steps += 1
        own = [s.cache_bytes() for s in states]
        peak_own = max(peak_own, max(own))
        peak_cache = max(peak_cache, sum(own) + engine.voice_cache_bytes())
    total, cpu = time.perf_counter() - start, time.process_time() - cpu0
    seconds = samples / SAMPLE_RATE
    peak = _status_mib("VmHWM")
    # RSS growth over the run per stream: the streams' caches, the voice prefix (first run only) and transients
    rss = {} if rss_before is None or peak is None else {
        "rss_before_mib": rss_before, "rss_peak_mib": peak, "rss_growth_per_stream_mib": (peak - rss_before) / count}
    return {**rss, "streams": count, "wall_s": total, "cpu_s": cpu, "audio_seconds": seconds, "rtf": total / seconds,
            "cpu_rtf": cpu / seconds, "audio_s_per_s": seconds / total, "audio_s_per_cpu_s": seconds / cpu,
            "first_chunk_s_mean": sum(first.values()) / len(first), "first_chunk_s_max": max(first.values()),
            "first_chunk_cpu_s_mean": sum(first_cpu.values()) / len(first_cpu), "steps": steps,
            "estimator_frames": sum(s.estimator_frames for s in states), "peak_cache_mib": peak_cache / 2**20,
            "peak_own_cache_mib_per_stream": peak_own / 2**20, "voice_cache_mib": engine.voice_cache_bytes() / 2**20,
            "cache_fallbacks": engine.stats.cache_fallbacks}


def parse_variant(spec: str) -> tuple[str, dict[str, bool], dict[str, Any]]:
    """'int8:flow=bf16:hift=bf16:kernels=off:workers=1' -> ('int8', {'flow_int8': False, 'hift_reduced': True},
    {'native_kernels': False, 'workers': 1}): the precision, `apply_backend`'s forms, and the token2wav engine's
    settings (`Token2WavConfig` fields)."""
    precision, *opts = spec.split(":")
    forms: dict[str, bool] = {}
    engine: dict[str, Any] = {"native_kernels": True}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key == "flow" and value in ("int8", "bf16"):
            forms["flow_int8"] = value == "int8"
        elif key == "convs" and value in ("int8", "fp32"):
            forms["conv_int8"] = value == "int8"
        elif key == "hift" and value in ("fp32", "bf16"):
            forms["hift_reduced"] = value == "bf16"
        elif key == "kernels" and value in ("on", "off"):
            engine["native_kernels"] = value == "on"
        elif key == "workers" and value.isdigit() and int(value) >= 1:
            engine["workers"] = int(value)
        else:
            raise SystemExit(f"{spec!r}: options are flow=int8|bf16 and convs=int8|fp32 (precision int8), "
                             "hift=fp32|bf16, kernels=on|off, workers=N")
    return precision, forms, engine


def engine_config(args: argparse.Namespace) -> Token2WavConfig:
    return Token2WavConfig(cache_dtype=None if args.cache_dtype == "none" else args.cache_dtype,
                           final_attention=args.final_attention, max_cache_mib=args.max_cache_mib)


def build_variant(args: argparse.Namespace, spec: str) -> tuple[SimpleNamespace, Any, str]:
    """A fresh model with `spec`'s precision and forms applied -> (model, its runtime, the precision)."""
    model = build(args.preset)
    precision, forms, _ = parse_variant(spec)
    return model, apply_backend(model, args.backend, precision, **forms), precision


def variant_config(args: argparse.Namespace, spec: str) -> Token2WavConfig:
    """The engine's config for `spec` (`kernels=off`: torch's ops instead of our native kernels; `workers=N`: a
    step's requests in N parts side by side, 1 off)."""
    return replace(engine_config(args), **parse_variant(spec)[2])


def run_engine(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    cap_mmap_threshold()  # the allocator as the serving engine runs it (`AsyncEngine`)
    model, runtime, precision = build_variant(args, spec)
    cfg = variant_config(args, spec)
    with torch.inference_mode():
        one = _run_streams(Token2WavEngine(model.flow, model.hift, cfg), args, 1)
        log.info("engine %s, 1 stream: %s", precision, one)
        many = _run_streams(Token2WavEngine(model.flow, model.hift, cfg), args, args.streams)
        log.info("engine %s, %d streams: %s", precision, args.streams, many)
    err: dict[str, float] = {}
    if precision != "fp32" or args.backend != "torch":
        err = errors(outputs(build(args.preset), llm=False), outputs(model, llm=False))
    return {"side": "engine", "precision": spec, "runtime": runtime.describe(), "one_stream": one,
            "multi_stream": many, "error_vs_fp32": err, "peak_rss_mib": peak_rss_mib()}


def run_alternating(args: argparse.Namespace) -> dict[str, Any]:
    """Every engine precision in this process, `args.alternate` rounds in turn; medians per precision."""
    import statistics

    specs = [q.strip() for q in args.precisions.split(",") if q.strip()]
    cap_mmap_threshold()  # the allocator as the serving engine runs it (`AsyncEngine`)
    engines = {}
    for spec in specs:
        model = build_variant(args, spec)[0]
        engines[spec] = Token2WavEngine(model.flow, model.hift, variant_config(args, spec))
    one = argparse.Namespace(**{**vars(args), "same_voice": True})
    runs: dict[str, list[dict[str, Any]]] = {spec: [] for spec in specs}
    with torch.inference_mode():
        for spec in specs:  # warm-up: the voice prefix, oneDNN's kernel choices
            _run_streams(engines[spec], one, 1)
        for r in range(args.alternate):
            for spec in (specs if r % 2 == 0 else specs[::-1]):
                runs[spec].append(_run_streams(engines[spec], one, 1))
    out = {}
    for spec, rs in runs.items():
        out[spec] = {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "cpu_s", "rtf", "first_chunk_s_mean")}
        out[spec]["rtf_range"] = [min(x["rtf"] for x in rs), max(x["rtf"] for x in rs)]
        print(f"{spec:<34} first chunk {out[spec]['first_chunk_s_mean']:6.2f} s   RTF {out[spec]['rtf']:5.2f} "
              f"({out[spec]['rtf_range'][0]:.2f}-{out[spec]['rtf_range'][1]:.2f})   CPU {out[spec]['cpu_s']:6.2f} s")
    return out


def side_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    result = run_reference(args) if args.side == "reference" else run_engine(args, args.side_precision)
    log.info("%s %s: %s", args.side, args.side_precision, json.dumps(result))
    Path(args.out).write_text(json.dumps(result, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cosyvoice2-0.5b")
    p.add_argument("--seconds", type=float, default=10.0, help="audio per utterance (25 tokens per second)")
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--precisions", default="fp32,bf16,int8")
    p.add_argument("--backend", default="torch")
    p.add_argument("--cache-dtype", default="bf16", help="engine K/V cache storage: bf16, fp16 or none (exact)")
    p.add_argument("--max-cache-mib", type=int, default=None, help="engine cache budget (default: 1/4 of RAM)")
    p.add_argument("--final-attention", default="causal")
    p.add_argument("--same-voice", action="store_true", help="all streams share one prompt (voice cache hits)")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--alternate", type=int, default=0, metavar="R",
                   help="engine precisions only, in one process, R rounds in turn (medians); see the module doc")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--side-precision", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.side:
        side_main(args)
        return 0
    if args.alternate:
        torch.set_num_threads(args.threads)
        result = run_alternating(args)
        if args.json:
            Path(args.json).write_text(json.dumps({"config": vars(args), "alternating": result}, indent=1))
        return 0
    sides = ([("reference", "fp32")] if not args.no_reference else []) + [
        ("engine", q.strip()) for q in args.precisions.split(",") if q.strip()]
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if not k.startswith("side")
                                         and k not in ("out", "json")}, "results": []}
    for side, precision in sides:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--side-precision", precision,
                   "--out", tmp.name]
            log.info("running %s %s", side, precision)
            subprocess.run(cmd, check=True)
            report["results"].append(json.loads(Path(tmp.name).read_text()))
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def table(report: dict[str, Any]) -> str:
    """CPU seconds are the comparable figures on a shared machine; wall seconds in brackets."""
    rows = [(f"{'side':<34}{'1 stream CPU-RTF (wall)':>26}{'first chunk CPU s (wall)':>26}"
             f"{'S streams CPU-RTF (wall)':>26}{'peak cache MiB':>16}{'RSS +MiB/stream':>17}{'RSS MiB':>9}"
             "  error vs fp32")]
    for r in report["results"]:
        one, many = r["one_stream"], r["multi_stream"]
        name = "reference fp32" if r["side"] == "reference" else "engine " + r["precision"]
        err = ", ".join(f"{k} {v:.1e}" for k, v in r.get("error_vs_fp32", {}).items()
                        if k in ("mel_max_rel", "wav_rel_rms"))
        rows.append(f"{name:<34}{one['cpu_rtf']:>17.2f} ({one['rtf']:5.2f})"
                    f"{one['first_chunk_cpu_s_mean']:>17.2f} ({one['first_chunk_s_mean']:5.1f})"
                    f"{many['cpu_rtf']:>17.2f} ({many['rtf']:5.2f}){many.get('peak_cache_mib', 0):>16.0f}"
                    f"{many.get('rss_growth_per_stream_mib', float('nan')):>17.0f}"
                    f"{r['peak_rss_mib']:>9.0f}  {err}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
