"""The server on the engine against the reference's one-at-a-time threaded server: many streaming clients.

    python benchmarks/serve_bench.py [--preset cosyvoice2-0.5b|tiny] [--tokens 50] [--clients 32] [--requests 4]
                                  [--rounds 4] [--drop 0.25] [--backends threaded,engine] [--precision auto]

For each backend a real `vocalis serve` app (uvicorn on 127.0.0.1) runs in its own process with random weights at
the preset's shapes, every utterance forced to `--tokens` speech tokens (as `vocalis bench` does), one saved voice
with a 3 s prompt. `--clients` concurrent clients each send `--requests` streaming requests (OpenAI route, pcm) per
round, one after another; a `--drop` share of the requests is dropped by its client after the first chunk. Per
round: aggregate audio seconds per second (audio received by clients that kept listening / the round's wall
time), p50 / p95 first chunk, errors, the server's RSS once it is idle and its peak so far. After the last round,
once idle: the engine's KV-cache usage (from /metrics). The threaded server serves one request at a time, so its
rate does not depend on the load: `--threaded-requests` / `--threaded-rounds` measure it on less of it. Prints one
table and a JSON line per backend; `--json OUT` writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SAMPLE_RATE = 24000


# ---- the server side (a child process) ----------------------------------------------------------------------
def serve_side(args: argparse.Namespace) -> None:
    import torch
    import uvicorn

    from vocalis.bench.scenario import BenchConfig, bench_voice, build, fixed_length_engine, fixed_length_generate
    from vocalis.serve.app import create_app
    from vocalis.serve.config import ServeConfig
    from vocalis.tts import TTS

    cfg = BenchConfig(preset=args.preset, threads=args.threads, tokens=args.tokens)
    torch.set_num_threads(args.threads)
    precision = None if args._serve == "threaded" else args.precision
    model, runtime, described = build(cfg, precision)
    model.voices["bench"] = bench_voice(model, cfg)
    opts = {"max_queue": 4 * args.clients}
    if args._serve == "threaded":
        from vocalis.reference.threaded_backend import ReferenceTTS, ThreadedBackend

        tts = ReferenceTTS(model)
        tts.synth.generate = fixed_length_generate(model, cfg.tokens)  # type: ignore[method-assign]
        backend: Any = ThreadedBackend(tts, queue_timeout_s=3600.0, job_timeout_s=3600.0, **opts)
    else:
        from vocalis.serve.engine_backend import EngineBackend

        class BenchTTS(TTS):
            engine_type = fixed_length_engine(cfg.tokens)

        from vocalis.token2wav.config import Token2WavConfig

        final = "causal" if args._serve == "engine-causal" else "full"  # `vocalis serve --final-chunk`
        from vocalis.model_options import ModelOptions

        t2w = Token2WavConfig(final_attention=final, max_cache_mib=args.t2w_cache_mib, wait_for_cache=args.t2w_wait,
                              max_batch=args.t2w_step, workers=args.t2w_workers)
        cap = ModelOptions(max_streams=args.max_streams).streams_cap("cpu")  # as `vocalis serve`
        t2w = dataclasses.replace(t2w, max_streams=cap)
        backend = EngineBackend(BenchTTS(model, token2wav=t2w, runtime=runtime), **opts)
    print(f"server: {args._serve}: {described}" + ("" if args._serve == "threaded" else f", max_streams {cap}"),
          file=sys.stderr, flush=True)
    # throughput, not timeouts: no request is timed out however long it waits
    app = create_app(backend, ServeConfig(queue_timeout_s=3600.0, request_timeout_s=3600.0))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


# ---- the client side ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    """The process's resident memory now (VmRSS) or its peak so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _one(client: Any, url: str, text: str, drop: bool) -> dict[str, Any]:
    body = {"model": "vocalis", "input": text, "voice": "bench", "response_format": "pcm", "stream": True}
    start = time.perf_counter()
    first, nbytes = None, 0
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return {"error": f"{resp.status_code} {resp.text[:200]}"}
            async for part in resp.aiter_bytes():
                if part and first is None:
                    first = time.perf_counter() - start
                    if drop:
                        break  # leave after the first chunk: the server must abort and free what it held
                nbytes += len(part)
    except Exception as exc:  # noqa: BLE001 - every failure is counted, none ends the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"first_chunk_s": first, "audio_s": 0.0 if drop else nbytes / 2 / SAMPLE_RATE, "dropped": drop}


async def _round(url: str, args: argparse.Namespace, r: int, rng: random.Random) -> dict[str, Any]:
    import httpx

    from vocalis.bench.scenario import BenchConfig, bench_text

    cfg = BenchConfig(tokens=args.tokens)
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def user(c: int) -> list[dict[str, Any]]:
            out = []
            for k in range(args.requests):
                text = bench_text(cfg, 1 + (r * args.clients + c) * args.requests + k)
                out.append(await _one(client, url, text, rng.random() < args.drop))
            return out

        start = time.perf_counter()
        results = [x for per in await asyncio.gather(*[user(c) for c in range(args.clients)]) for x in per]
        wall = time.perf_counter() - start
    ok = [x for x in results if "error" not in x]
    firsts = sorted(x["first_chunk_s"] for x in ok if x["first_chunk_s"] is not None)
    errors = [x["error"] for x in results if "error" in x]
    return {"round": r, "wall_s": wall, "requests": len(results), "errors": len(errors), "error_samples": errors[:3],
            "dropped": sum(1 for x in ok if x["dropped"]), "audio_s": sum(x["audio_s"] for x in ok),
            "audio_s_per_s": sum(x["audio_s"] for x in ok) / wall,
            "first_chunk_p50_s": statistics.median(firsts) if firsts else None,
            "first_chunk_p95_s": firsts[min(len(firsts) - 1, int(0.95 * len(firsts)))] if firsts else None}


def _gauges(url: str) -> dict[str, float]:
    """The server's unlabelled /metrics values by name."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("vocalis_") and "{" not in name:
            out[name] = float(value)
    return out


def _wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until no job runs or waits (requests dropped by their clients finish aborting), then a moment more for the
    engine loop to find itself idle: RSS is compared between rounds at rest."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        g = _gauges(url)
        if g.get("vocalis_running_jobs", 0) == 0 and g.get("vocalis_queue_depth", 0) == 0:
            break
        time.sleep(0.2)
    time.sleep(0.5)


def run_backend(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, __file__, "--_serve", name, "--port", str(port), "--preset", args.preset,
           "--tokens", str(args.tokens), "--threads", str(args.threads), "--precision", args.precision,
           "--clients", str(args.clients)]
    if args.t2w_cache_mib is not None:
        cmd += ["--t2w-cache-mib", str(args.t2w_cache_mib)]
    if args.t2w_wait:
        cmd.append("--t2w-wait")
    if args.t2w_step is not None:
        cmd += ["--t2w-step", str(args.t2w_step)]
    if args.t2w_workers is not None:
        cmd += ["--t2w-workers", str(args.t2w_workers)]
    if args.max_streams is not None:
        cmd += ["--max-streams", str(args.max_streams)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the {name} server did not come up")
            time.sleep(0.5)
        if name == "threaded":
            # one request at a time: its rate does not depend on the load, so it may be measured on less of it
            args = dataclasses.replace(_Args(**vars(args)), requests=args.threaded_requests or args.requests,
                                       rounds=args.threaded_rounds or args.rounds)
        rng = random.Random(args.seed)
        # warm-up, not counted (first-use allocations, the voice's prefixes): one request per client unless --warmup
        warm = dataclasses.replace(_Args(**vars(args)), requests=1, drop=0.0,  # type: ignore[arg-type]
                                   clients=args.warmup if args.warmup is not None else args.clients)
        asyncio.run(_round(url, warm, -1, rng))
        rounds = []
        for r in range(args.rounds):
            row = asyncio.run(_round(url, args, r, rng))
            _wait_idle(url)
            row["rss_mib"] = _rss_mib(proc.pid)
            row["peak_rss_mib"] = _rss_mib(proc.pid, "VmHWM")
            rounds.append(row)
            print(f"{name} round {r}: {json.dumps(row)}", file=sys.stderr, flush=True)
        kv = _gauges(url).get("vocalis_kv_cache_usage")  # idle: _wait_idle after the last round
    finally:
        proc.terminate()
        proc.wait(60)
    rss = [r["rss_mib"] for r in rounds]
    return {"backend": name, "rounds": rounds, "kv_usage_idle": kv,
            "audio_s_per_s": statistics.median(r["audio_s_per_s"] for r in rounds),
            "first_chunk_p50_s": statistics.median(r["first_chunk_p50_s"] for r in rounds if r["first_chunk_p50_s"]),
            "first_chunk_p95_s": statistics.median(r["first_chunk_p95_s"] for r in rounds if r["first_chunk_p95_s"]),
            "errors": sum(r["errors"] for r in rounds),
            "rss_spread": (max(rss) - min(rss)) / min(rss) if rss else None,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rounds) if rounds else None,
            "requests": sum(r["requests"] for r in rounds)}


@dataclasses.dataclass
class _Args:
    preset: str
    tokens: int
    clients: int
    requests: int
    rounds: int
    drop: float
    backends: str
    precision: str
    threads: int
    t2w_cache_mib: int | None
    t2w_wait: bool
    t2w_step: int | None
    t2w_workers: int | None
    max_streams: int | None
    warmup: int | None
    threaded_requests: int | None
    threaded_rounds: int | None
    seed: int
    json: str | None
    port: int
    _serve: str | None


def main(argv: list[str] | None = None) -> int:
    from vocalis.model_options import at_least

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cosyvoice2-0.5b")
    p.add_argument("--tokens", type=int, default=50, help="speech tokens per utterance (50 = 2 s)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=4, help="requests per client per round, one after another")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--drop", type=float, default=0.25, help="share of requests dropped after the first chunk")
    p.add_argument("--backends", default="threaded,engine",
                   help="threaded, engine (the reference's final chunk, as `vocalis serve`), engine-causal "
                        "(`vocalis serve --final-chunk causal`), comma separated")
    p.add_argument("--precision", default="auto", help="the engine server's precision (threaded: fp32 reference)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--t2w-cache-mib", type=int, help="the engine server's token2wav cache budget (default: its own)")
    p.add_argument("--t2w-wait", action="store_true", help="new streams wait for token2wav cache room")
    p.add_argument("--t2w-step", type=at_least(1), help="the engine server's requests per token2wav step (default: "
                   "its own, `Token2WavConfig.max_batch`)")
    p.add_argument("--t2w-workers", type=at_least(1), help="threads sharing the engine server's token2wav steps, "
                   "one core each (default: its own, `Token2WavConfig.workers`; 1: off)")
    p.add_argument("--max-streams", type=int, help="the engine server's requests in flight (0: no cap; default: "
                   "`vocalis serve`'s)")
    p.add_argument("--warmup", type=int, help="concurrent requests of the uncounted warm-up (default: --clients; "
                   "the threaded server serves them one after another)")
    p.add_argument("--threaded-requests", type=int, help="requests per client per round for the threaded server "
                   "(default: --requests; it serves one request at a time, so its rate does not depend on the load)")
    p.add_argument("--threaded-rounds", type=int, help="rounds for the threaded server (default: --rounds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_serve", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.backends.split(",")) - {"threaded", "engine", "engine-causal"}
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}: choose from threaded, engine, engine-causal")
    if args._serve:
        serve_side(args)
        return 0
    results = [run_backend(name, args) for name in args.backends.split(",")]
    print(f"\n{args.clients} clients x {args.requests} requests x {args.rounds} rounds, {args.tokens} tokens each, "
          f"{args.drop:.0%} dropped after the first chunk, preset {args.preset}")
    print("| backend | requests | audio-s/s | first chunk p50 / p95 s | errors | idle RSS per round MiB | RSS spread "
          "| peak RSS MiB | KV usage idle |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        kv = "n/a" if r["kv_usage_idle"] is None else f"{r['kv_usage_idle']:.3f}"
        per_round = ", ".join(f"{x['rss_mib']:.0f}" for x in r["rounds"])
        print(f"| {r['backend']} | {r['requests']} | {r['audio_s_per_s']:.3g} | {r['first_chunk_p50_s']:.2f} / "
              f"{r['first_chunk_p95_s']:.2f} | {r['errors']} | {per_round} | {r['rss_spread']:+.1%} | "
              f"{r['peak_rss_mib']:.0f} | {kv} |")
    base = next((r for r in results if r["backend"] == "threaded"), None)
    for r in results:
        if base is not None and r is not base and base["audio_s_per_s"] > 0:
            print(f"{r['backend']} / threaded aggregate audio-s/s: {r['audio_s_per_s'] / base['audio_s_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
