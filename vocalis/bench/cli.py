"""`vocalis bench`: the engine against the reference path, side by side, with random weights at a preset's shapes.

Each side runs in its own process (so each has its own peak RSS and neither warms the other's caches): the
reference path (`Qwen2LM.generate`, `inference.token2wav.Token2Wav`, `Synthesizer` one request at a time, fp32)
and the engine at every requested precision. Reported: LLM prefill and decode tokens/s at each batch, the
machine's memory bandwidth (streaming-read probes interleaved with the batch-1 decode, see `bench.engine_side` /
`bench.bandwidth`), the decode limit it implies for the precision and the fraction reached, token2wav RTF,
end-to-end RTF and first-chunk latency (single-stream: medians of `e2e_repeats` requests on each side), audio
seconds per second at each concurrency (medians of `stream_repeats` batches), peak RSS; a JSON file and a PNG plot.

The reference path serves one request at a time, so its throughput at any concurrency is its single-stream
figure (measured once) and its LLM speed at any batch is its batch-1 speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vocalis.config import PRESETS
from vocalis.config.cv3 import CV3_PRESETS
from vocalis.errors import InputError
from vocalis.kernels.build import BUILD_ENV

log = logging.getLogger(__name__)

PARTS = ("llm", "token2wav", "e2e")  # as bench.scenario.PARTS (not imported here: it pulls in torch)
QUICK = {"batches": (1, 4), "concurrency": (1, 4), "decode_tokens": 6, "b1_decode_tokens": 8, "b1_segments": 2,
         "b1_warmup_tokens": 1, "e2e_repeats": 1, "tokens": 40, "prompt_tokens": 30, "text_words": 6}
TARGETS = {
    "decode_b1_fraction_of_limit": ">= 0.70",
    "first_chunk_vs_reference": "<= 0.333",
    "throughput_8_vs_reference": ">= 5",
    "int8_e2e_rtf_vs_fp32_reference": "<= 0.333",
}


def _side(kind: str, cfg: Any, precision: str | None) -> dict[str, Any]:
    """Run one side in a fresh interpreter; its result comes back as JSON through a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "side.json"
        cmd = [sys.executable, "-m", "vocalis.bench.cli", "--_side", kind, "--_config", json.dumps(cfg.to_json()),
               "--_out", str(out)] + (["--_precision", precision] if precision else [])
        start = time.perf_counter()
        proc = subprocess.run(cmd, check=False, stdin=subprocess.DEVNULL, env=_side_env())
        if proc.returncode != 0:
            raise RuntimeError(f"bench side {kind} {precision or ''} failed with exit code {proc.returncode}")
        result = json.loads(out.read_text())
        result["side_wall_s"] = time.perf_counter() - start
        return result


def _side_env() -> dict[str, str]:
    """The sides' environment: the caller's, so OpenMP waits as users get it (libgomp's default: a short spin,
    then sleep) unless OMP_WAIT_POLICY is set. Both sides get the same. (Earlier runs forced PASSIVE: a spinning
    worker held the core a descheduled sibling needed while training ran beside the bench, load ~3. With the
    machine quiet, and the engine's loop thread the only one holding an OpenMP pool (threads.release_openmp_pool),
    the default's spin is what makes back-to-back small ops fast.)"""
    return dict(os.environ)


def run(cfg: Any) -> dict[str, Any]:
    """cfg: a `bench.scenario.BenchConfig`."""
    import torch

    from vocalis.bench.bandwidth import measure_bandwidth

    load_before = os.getloadavg()
    bandwidth = measure_bandwidth()
    log.info("memory bandwidth (numpy copy, read+write): %.1f GB/s", bandwidth["copy_gbps"])
    # a shared machine runs in faster and slower periods: each round measures the sides back to back, so each
    # round's ratios compare work done close in time, and their medians over rounds are reported
    rounds = []
    for _ in range(cfg.rounds):
        sides = {"reference": _side("reference", cfg, None),
                 "engine": {p: _side("engine", cfg, p) for p in cfg.precisions}}
        rounds.append({**sides, "targets": targets(sides)})
    load_after = os.getloadavg()
    from vocalis.engine.config import EngineConfig

    report = {
        "machine": {"cpus": os.cpu_count(), "threads": cfg.threads, "torch": torch.__version__,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default (unset)"),
                    # torch's CPU tensors on transparent huge pages (the bandwidth probe's numpy buffer always is)
                    "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
                    "huge_pages": EngineConfig().with_env_overrides().huge_pages,
                    "processor": platform.processor() or platform.machine(), **bandwidth,
                    "device": cfg.device,
                    "device_name": torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else None,
                    # other processes share the cores: 1-minute load averages around the run, for context
                    "loadavg_before": load_before[0], "loadavg_after": load_after[0]},
        "config": cfg.to_json(),
        "reference": rounds[0]["reference"],  # the first round's figures (the table); every round's under "rounds"
        "engine": rounds[0]["engine"],
        "rounds": rounds,
        "targets": median_targets([r["targets"] for r in rounds]),
    }
    return report


def median_targets(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """Each target's median over the rounds that measured it (None where none did)."""
    out: dict[str, Any] = {"wanted": TARGETS}
    for key in per_round[0]:
        if key != "wanted":
            values = [r[key] for r in per_round if r[key] is not None]
            out[key] = statistics.median(values) if values else None
    return out


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as measured ratios of one round's sides (None where it did not measure what they
    need)."""
    ref, engines = report["reference"], report["engine"]
    out: dict[str, Any] = {"wanted": TARGETS}
    for p, eng in engines.items():
        b1 = eng.get("decode_b1")
        if b1:  # decode bytes/s over the median read probe interleaved with it (bench_bandwidth)
            out[f"decode_b1_fraction_of_limit[{p}]"] = b1["fraction_of_limit"]
        c1 = eng.get("e2e", {}).get("1")
        if c1:
            out[f"first_chunk_vs_reference[{p}]"] = c1["first_chunk_s"] / ref["e2e"]["first_chunk_s"]
        c8 = eng.get("e2e", {}).get("8")
        if c8:
            out[f"throughput_8_vs_reference[{p}]"] = c8["audio_s_per_s"] / ref["e2e"]["audio_s_per_s"]
    int8 = engines.get("int8", {}).get("e2e", {}).get("1")
    out["int8_e2e_rtf_vs_fp32_reference"] = int8["rtf"] / ref["e2e"]["rtf"] if int8 else None
    return out


def summary(report: dict[str, Any]) -> str:
    ref, engines = report["reference"], report["engine"]
    m = report["machine"]
    lines = [(f"memory bandwidth (numpy copy): {m['copy_gbps']:.1f} GB/s; threads {m['threads']}; "
              f"load average {m['loadavg_before']:.1f} before, {m['loadavg_after']:.1f} after")]
    if m.get("device_name"):
        lines.append(f"device: {m['device']} ({m['device_name']})")
    if report["config"].get("flow_steps") is not None:
        lines.append(f"engine: {report['config']['flow_steps']} Euler steps (the reference: the model's)")
    lines.append(f"{'':34}{'reference':>12}" + "".join(f"{'engine ' + p:>16}" for p in engines))

    def row(label: str, ref_value: float | None, values: list[Any], fmt: str = "{:.2f}") -> None:
        def cell(v: Any) -> str:
            return fmt.format(v) if v is not None else "-"

        lines.append(f"{label:34}{cell(ref_value):>12}" + "".join(f"{cell(v):>16}" for v in values))

    parts = report["config"].get("parts", PARTS)
    batches = report["config"]["batches"] if "llm" in parts else []
    for b in batches:
        row(f"LLM prefill tok/s, batch {b}", ref["llm"]["prefill_tps"] if b == 1 else None,
            [e["llm"][str(b)]["prefill_tps"] for e in engines.values()], "{:.1f}")
    for b in batches:
        row(f"LLM decode tok/s, batch {b}", ref["llm"]["decode_tps"] if b == 1 else None,
            [e["llm"][str(b)]["decode_tps"] for e in engines.values()])
    if "llm" in parts:
        _limit_rows(row, engines)
    if "token2wav" in parts:
        _token2wav_rows(row, ref, engines)
    if "e2e" in parts:
        _e2e_rows(row, ref, engines, report["config"]["concurrency"])
    row("peak RSS MiB", ref["peak_rss_mib"], [e["peak_rss_mib"] for e in engines.values()], "{:.0f}")
    rounds = report.get("rounds", [])
    if len(rounds) > 1:  # the table is the first round's; each round's ratios, then their medians
        lines[0] += f"; {len(rounds)} rounds (the table: round 1)"
        for i, r in enumerate(rounds, 1):
            lines.append(f"round {i}: " + _target_text(r["targets"]))
    lines.append(("targets (medians of the rounds): " if len(rounds) > 1 else "targets: ")
                 + _target_text(report["targets"]))
    return "\n".join(lines)


def _target_text(targets: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v:.3g}" for k, v in targets.items() if isinstance(v, float))


def _limit_rows(row: Any, engines: dict[str, Any]) -> None:
    """Batch 1 against the bandwidth limit: the probes' spread, the limit from their median, the fraction."""
    b1s = [e.get("decode_b1") for e in engines.values()]

    def spread(b1: dict[str, Any] | None, key: str, fmt: str) -> str | None:
        return "/".join(fmt.format(b1[key][k]) for k in ("min", "median", "max")) if b1 else None

    row("read GB/s probes min/med/max", None, [spread(b, "read_gbps_spread", "{:.0f}") for b in b1s], "{}")
    row("copy GB/s probes min/med/max", None, [spread(b, "copy_gbps_spread", "{:.0f}") for b in b1s], "{}")
    row("MB read per decode step", None, [b["bytes_per_token"] / 1e6 if b else None for b in b1s], "{:.0f}")
    row("decode limit tok/s (batch 1)", None, [e["decode_limit_tps"] for e in engines.values()])
    row("fraction of limit (batch 1)", None, [b["fraction_of_limit"] if b else None for b in b1s], "{:.3f}")
    row("  per segment min/med/max", None, [spread(b, "segment_fraction_spread", "{:.2f}") for b in b1s], "{}")
    row("  vs median copy probe", None, [b["fraction_of_copy_limit"] if b else None for b in b1s], "{:.3f}")


def _token2wav_rows(row: Any, ref: dict[str, Any], engines: dict[str, Any]) -> None:
    row("token2wav RTF, offline", ref["token2wav"]["offline_rtf"], [e["token2wav"]["offline_rtf"] for e in engines.values()])
    row("token2wav RTF, streaming", ref["token2wav"]["stream_rtf"], [e["token2wav"]["stream_rtf"] for e in engines.values()])


def _e2e_rows(row: Any, ref: dict[str, Any], engines: dict[str, Any], concurrency: list[int]) -> None:
    row("end-to-end RTF (1 stream)", ref["e2e"]["rtf"], [e["e2e"].get("1", {}).get("rtf") for e in engines.values()])
    for c in concurrency:
        row(f"first chunk s, {c} streams", ref["e2e"]["first_chunk_s"] if c == 1 else None,
            [e["e2e"][str(c)]["first_chunk_s"] for e in engines.values()])
    for c in concurrency:
        row(f"audio s per s, {c} streams", ref["e2e"]["audio_s_per_s"],
            [e["e2e"][str(c)]["audio_s_per_s"] for e in engines.values()])


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InputError("the bench plot needs matplotlib: pip install 'vocalis[bench]'") from exc
    ref, engines, cfg = report["reference"], report["engine"], report["config"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    for p, e in engines.items():
        ax.plot(cfg["batches"], [e["llm"][str(b)]["decode_tps"] for b in cfg["batches"]], "o-", label=f"engine {p}")
        ax.axhline(e["decode_limit_tps"], ls=":", lw=1, color=ax.lines[-1].get_color(),
                   label=f"bandwidth limit {p} (batch 1)")
    ax.axhline(ref["llm"]["decode_tps"], color="k", ls="--", label="reference (one at a time)")
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="LLM decode")
    ax.set_xticks(cfg["batches"], [str(b) for b in cfg["batches"]])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    ax = axes[0][1]
    for p, e in engines.items():
        ax.plot(cfg["concurrency"], [e["e2e"][str(c)]["audio_s_per_s"] for c in cfg["concurrency"]], "o-",
                label=f"engine {p}")
    ax.axhline(ref["e2e"]["audio_s_per_s"], color="k", ls="--", label="reference")
    ax.set(xlabel="concurrent streams", ylabel="audio seconds / second", title="throughput")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    for p, e in engines.items():
        ax.plot(cfg["concurrency"], [e["e2e"][str(c)]["first_chunk_s"] for c in cfg["concurrency"]], "o-",
                label=f"engine {p}")
    ax.axhline(ref["e2e"]["first_chunk_s"], color="k", ls="--", label="reference (1 stream)")
    ax.set(xlabel="concurrent streams", ylabel="seconds", title="first-chunk latency (mean)")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    names = ["reference"] + [f"engine {p}" for p in engines]
    rows = [ref] + list(engines.values())
    width = 0.25
    for k, (key, label) in enumerate((("offline_rtf", "token2wav offline"), ("stream_rtf", "token2wav stream"))):
        ax.bar([i + k * width for i in range(len(rows))], [r["token2wav"][key] for r in rows], width, label=label)
    ax.bar([i + 2 * width for i in range(len(rows))], [ref["e2e"]["rtf"]] + [e["e2e"].get("1", {}).get("rtf", 0)
           for e in engines.values()], width, label="end to end (1 stream)")
    ax.set_xticks([i + width for i in range(len(rows))], names, fontsize=8)
    ax.set(ylabel="RTF (lower is better)", title="real-time factor")
    ax.legend(fontsize=7)
    fig.suptitle(f"vocalis bench: {cfg['preset']}, random weights, {report['machine']['threads']} threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="cosyvoice2-0.5b", help="model shapes (random weights): cosyvoice2-0.5b, tiny, cosyvoice3-0.5b")
    p.add_argument("--precision", default="fp32", help="engine precisions, comma separated: fp32,bf16,int8")
    p.add_argument("--backend", default="torch", help="engine backend (see vocalis.backends.choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both sides run there)")
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2), help="torch threads per side")
    p.add_argument("--tokens", type=int, help="speech tokens per utterance (25 per second)")
    p.add_argument("--prompt-tokens", type=int,
                   help="speech tokens of the saved zero-shot voice's prompt (default 75 = 3 s; 1 = almost none)")
    p.add_argument("--batches", help="LLM batch sizes, comma separated (default 1,4,16)")
    p.add_argument("--concurrency", help="concurrent streams, comma separated (default 1,4,8,16)")
    p.add_argument("--max-streams", type=int, metavar="N",
                   help="the engine's cap on requests in flight; more queue (as `vocalis serve --max-streams`)")
    p.add_argument("--t2w-step", type=int, metavar="N",
                   help="the engine's requests per token2wav step (default: the device's, Token2WavConfig.max_batch)")
    p.add_argument("--t2w-workers", type=int, metavar="N",
                   help="threads sharing a token2wav step's requests, one core each (default: the CPU threads; 1: "
                        "every op of the step over all threads, Token2WavConfig.workers)")
    p.add_argument("--flow-steps", type=int, metavar="N",
                   help="the engine's Euler steps (`vocalis speak --flow-steps`; default the model's 10); the "
                        "reference side keeps the model's, so the ratios then compare the setting with the default")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"what to measure, comma separated: {', '.join(PARTS)} (e.g. --parts llm: LLM only, quick)")
    p.add_argument("--e2e-repeats", type=int,
                   help="single-stream end-to-end requests per side, their medians reported (default 3)")
    p.add_argument("--rounds", type=int,
                   help="run the reference side and then the engine sides this many times, ratios taken within each "
                        "round, their medians reported (default 1; a shared machine's slow spells then fall on both)")
    p.add_argument("--stream-repeats", type=int,
                   help="engine batches per concurrency above 1, their medians reported (default 1; each takes as "
                        "long as the batch, so 3 steadies the multi-stream figures on a noisy machine)")
    p.add_argument("--quick", action="store_true", help="a small subset: batches 1,4, streams 1,4, short utterances")
    p.add_argument("--shapes-from", metavar="DIR",
                   help="CosyVoice 3 presets: the shapes of this model directory's cosyvoice3.yaml (random weights)")
    p.add_argument("--json", default="vocalis-bench.json", help="JSON report path")
    p.add_argument("--plot", default="vocalis-bench.png", help="PNG plot path ('' for none)")


def config_from_args(args: argparse.Namespace) -> Any:
    from vocalis.bench.scenario import BenchConfig

    kw: dict[str, Any] = dict(QUICK) if args.quick else {}
    kw.update(preset=args.preset, backend=args.backend, threads=args.threads, device=args.device,
              precisions=tuple(p.strip() for p in args.precision.split(",") if p.strip()))
    kw["parts"] = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    if not kw["parts"] or set(kw["parts"]) - set(PARTS):
        raise InputError(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {args.parts!r}")
    if args.tokens is not None:
        kw["tokens"] = args.tokens
    if args.max_streams is not None:
        if args.max_streams < 1:
            raise InputError(f"--max-streams must be >= 1, got {args.max_streams}")
        kw["max_streams"] = args.max_streams
    if args.t2w_step is not None:
        if args.t2w_step < 1:
            raise InputError(f"--t2w-step must be >= 1, got {args.t2w_step}")
        kw["t2w_step"] = args.t2w_step
    if args.t2w_workers is not None:
        if args.t2w_workers < 1:
            raise InputError(f"--t2w-workers must be >= 1, got {args.t2w_workers}")
        kw["t2w_workers"] = args.t2w_workers
    if args.flow_steps is not None:
        if args.flow_steps < 1:
            raise InputError(f"--flow-steps must be >= 1, got {args.flow_steps}")
        kw["flow_steps"] = args.flow_steps
    if args.e2e_repeats is not None:
        kw["e2e_repeats"] = args.e2e_repeats
    if args.stream_repeats is not None:
        kw["stream_repeats"] = args.stream_repeats
    if args.rounds is not None:
        kw["rounds"] = args.rounds
    if args.prompt_tokens is not None:
        if args.prompt_tokens < 1:  # zero-shot needs prompt speech
            raise InputError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
        kw["prompt_tokens"] = args.prompt_tokens
    for name in ("batches", "concurrency"):
        value = getattr(args, name)
        if value:
            kw[name] = tuple(int(v) for v in value.split(","))
    if args.preset not in PRESETS and args.preset not in CV3_PRESETS:
        raise InputError(f"unknown preset {args.preset!r}; choose one of {', '.join([*PRESETS, *CV3_PRESETS])}")
    if args.device != "cpu" and args.device != "cuda" and not args.device.startswith("cuda:"):
        raise InputError(f"--device takes cpu, cuda or cuda:N, got {args.device!r}")
    if kw["precisions"] != ("fp32",) or args.backend != "torch" or args.device != "cpu":
        from vocalis.backends.choice import resolve

        # resolve "auto" and fail with a clear message now rather than from a side process
        kw["precisions"] = tuple(dict.fromkeys(resolve(args.backend, p, args.device)[1] for p in kw["precisions"]))
    if min(kw.get("tokens", 1), kw.get("e2e_repeats", 1), kw.get("stream_repeats", 1), kw.get("rounds", 1)) < 1 \
            or any(v < 1 for v in kw.get("batches", ()) + kw.get("concurrency", ())):
        raise InputError("--tokens, --e2e-repeats, --stream-repeats, --rounds, --batches and --concurrency must be "
                         "positive")
    return BenchConfig(**kw)


def add_bench_command(sub: Any) -> None:
    """Register `vocalis bench` on the CLI's subparsers (parser only; nothing heavy is imported)."""
    p = sub.add_parser("bench", help="engine vs reference path: LLM tok/s, RTF, first chunk, throughput, RSS")
    add_arguments(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # a measurement of our kernels, not of torch's ops while they compile in the background (the sides inherit it)
    os.environ.setdefault(BUILD_ENV, "wait")
    if cfg.preset in CV3_PRESETS:  # CosyVoice 3: one in-process run of its engine (bench/cv3.py)
        from vocalis.bench.cv3 import cv3_summary, run_cv3
        from vocalis.model_dir import read_cosyvoice3_config

        if args.shapes_from and not (Path(args.shapes_from) / "cosyvoice3.yaml").is_file():
            raise InputError(f"--shapes-from: no cosyvoice3.yaml in {args.shapes_from}")
        cv3 = run_cv3(cfg, read_cosyvoice3_config(Path(args.shapes_from)) if args.shapes_from else None)
        Path(args.json).write_text(json.dumps(cv3, indent=2))
        print(cv3_summary(cv3))
        return 0
    report = run(cfg)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(summary(report))
    if args.plot and set(cfg.parts) == set(PARTS):  # the plot shows every part
        plot(report, Path(args.plot))
    log.info("wrote %s%s", args.json, f" and {args.plot}" if args.plot and set(cfg.parts) == set(PARTS) else "")
    return 0


def _side_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--_side", required=True)
    parser.add_argument("--_config", required=True)
    parser.add_argument("--_out", required=True)
    parser.add_argument("--_precision")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from vocalis.bench.engine_side import run_engine
    from vocalis.bench.reference_side import run_reference
    from vocalis.bench.scenario import BenchConfig

    cfg = BenchConfig.from_json(json.loads(args._config))
    result = run_reference(cfg) if args._side == "reference" else run_engine(cfg, args._precision)
    Path(args._out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_side_main(sys.argv[1:]))
