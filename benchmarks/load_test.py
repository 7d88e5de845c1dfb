#!/usr/bin/env python
"""Load test for `vocalis serve` on this machine: C concurrent streaming clients x R requests each.

By default it starts the server itself (`python -m vocalis serve` on 127.0.0.1, a free port) so it can read the
server's RSS from /proc; `--url` targets a running server instead (loopback only; `--pid` for its RSS).
Prints errors by kind, p50/p95/max first-chunk latency, request latency, throughput, and the server's RSS
after warm-up, after each round and at the end (flat memory = no per-request leak).

    python benchmarks/load_test.py --model DIR --clients 32 --requests 8 [--abort-fraction 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

TEXTS = [
    "Hello there.", "How are you today?", "The weather is nice.", "Thanks for calling.", "Please hold on.",
    "Your order has shipped.", "See you tomorrow.", "That sounds great!", "Let me check.", "One moment, please.",
]


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        sys.exit(f"load_test: refusing {url}: only loopback servers (127.0.0.1, ::1, localhost) are load-tested")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vocalis", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-queue", str(max(64, 2 * args.clients)), "--voices-dir", args.voices_dir]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"load_test: the server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("load_test: the server did not start within 120 s")


async def one_request(client: httpx.AsyncClient, rng: random.Random, abort: bool, stats: dict) -> None:
    body = {"model": "tts-1", "input": rng.choice(TEXTS), "voice": rng.choice(["alloy", "nova", "echo"]),
            "response_format": "pcm", "seed": rng.randrange(1 << 30)}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                stats["errors"][f"http {r.status_code}"] += 1
                return
            first = None
            n = 0
            async for data in r.aiter_raw():
                if first is None:
                    first = time.perf_counter() - t0
                    if abort:  # leave mid-stream: the server must abort the job and free its state
                        stats["aborted"] += 1
                        stats["first"].append(first)
                        return
                n += len(data)
        if n == 0 or n % 2:
            stats["errors"]["bad body"] += 1
            return
        stats["first"].append(first)
        stats["total"].append(time.perf_counter() - t0)
        stats["audio_s"] += n / 2 / 24000
    except httpx.HTTPError as exc:
        stats["errors"][type(exc).__name__] += 1


async def round_(url: str, clients: int, requests: int, abort_fraction: float, seed: int, stats: dict) -> None:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            for _ in range(requests):
                await one_request(client, rng, rng.random() < abort_fraction, stats)

        await asyncio.gather(*(worker(i) for i in range(clients)))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory for the server this script starts")
    p.add_argument("--url", help="target a running loopback server instead of starting one")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, for RSS")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=8, help="requests per client per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--abort-fraction", type=float, default=0.0, help="share of requests left after the first chunk")
    p.add_argument("--threads", type=int, default=0, help="server torch threads")
    p.add_argument("--voices-dir", default="/tmp/vocalis-load-test-voices")
    args = p.parse_args()
    if not (1 <= args.clients <= 256 and 1 <= args.requests <= 1000 and 1 <= args.rounds <= 20):
        sys.exit("load_test: keep it bounded: clients 1-256, requests 1-1000, rounds 1-20")

    proc = None
    if args.url:
        check_loopback(args.url)
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        httpx.post(url + "/v1/audio/speech", json={"input": "Warm up.", "response_format": "pcm"}, timeout=300)
        rss = [("after warm-up", rss_mb(pid))]
        stats: dict = {"first": [], "total": [], "errors": collections.Counter(), "aborted": 0, "audio_s": 0.0}
        t0 = time.perf_counter()
        for r in range(args.rounds):
            asyncio.run(round_(url, args.clients, args.requests, args.abort_fraction, r, stats))
            rss.append((f"after round {r + 1}", rss_mb(pid)))
        wall = time.perf_counter() - t0
        time.sleep(1.0)
        health = httpx.get(url + "/health", timeout=10).json()
        rss.append(("end (idle)", rss_mb(pid)))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    total = args.clients * args.requests * args.rounds
    errors = sum(stats["errors"].values())
    print(f"server: {url}  model: {health.get('model')}  cpus: {os.cpu_count()}")
    print(f"requests: {total} ({args.clients} clients x {args.requests} x {args.rounds} rounds), "
          f"completed {len(stats['total'])}, aborted on purpose {stats['aborted']}, errors {errors} "
          f"{dict(stats['errors']) if errors else ''}")
    print(f"first-chunk latency: p50 {pct(stats['first'], 50):.3f} s  p95 {pct(stats['first'], 95):.3f} s  "
          f"max {max(stats['first'], default=float('nan')):.3f} s")
    print(f"request latency:     p50 {pct(stats['total'], 50):.3f} s  p95 {pct(stats['total'], 95):.3f} s")
    print(f"throughput: {total / wall:.2f} req/s, {stats['audio_s'] / wall:.2f} s of audio per s; wall {wall:.1f} s")
    print("server RSS (MB): " + ", ".join(f"{k} {v:.1f}" if v is not None else f"{k} n/a" for k, v in rss))
    print(f"after the run: queue_depth {health.get('queue_depth')}, running {health.get('running')}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
