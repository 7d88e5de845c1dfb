#!/usr/bin/env python3
"""Serving LoRA adapters: LLM decode tokens/s of one batch of concurrent requests, A/B interleaved in one process.

    python benchmarks/bench_adapters.py [--model DIR] [--requests 8] [--tokens 64] [--rank 16] [--rounds 3]

Rows (every request makes exactly --tokens speech ids, so each row does the same work):
  merged     one adapter folded into the weights (`TTS.load` with one adapter): the engine's fast paths
  banked-1   the same adapter kept apart in a bank (batched LoRA), every request naming it
  banked-2   two adapters in a bank, the requests alternating between them (multi-adapter serving)
  banked-0   the two-adapter bank, no request naming an adapter: the steps still run the fused decode step
  base-op    the base model with the fused decode step off (packed weights, one torch op at a time): the path
             a step with adapter rows takes, without the LoRA updates; against banked-2, what the updates cost
The adapters are random (rank --rank on q, k, v, o, gate, up, down), as trained ones cost the same. The ratio to
`merged` is printed per row; the median of --rounds rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from vocalis.adapters.batched import AdapterBank, bank_linears
from vocalis.adapters.lora_file import merge_adapter, random_adapter
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.model_dir import load_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")



def run(engine: LLMEngine, adapters: list[str | None], tokens: int) -> float:
    """Tokens/s of one batch: len(adapters) requests at once, each making exactly `tokens` speech ids."""
    reqs = []
    for i, adapter in enumerate(adapters):
        text = [5 + (i * 7 + j) % 40 for j in range(24)]
        params = engine.sampling_params(len(text), seed=i, min_len=tokens, max_len=tokens, stop_all_masked=True,
                                        follow_phones=False, stop_cycle_span=0)
        reqs.append(engine.make_request(text, params=params, adapter=adapter))
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    dt = time.perf_counter() - t0
    assert all(len(v) == tokens for v in out.values())
    return len(adapters) * tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the built-in model)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_model(args.model).llm.eval()
    a, b = (random_adapter(base, "a", args.rank, TARGETS, 1, scale=0.01),
            random_adapter(base, "b", args.rank, TARGETS, 2, scale=0.01))
    merged = copy.deepcopy(base)
    merge_adapter(merged, a)
    bank1, bank2 = copy.deepcopy(base), copy.deepcopy(base)
    bank_linears(bank1, AdapterBank([a]))
    bank_linears(bank2, AdapterBank([a, b]))
    cfg = EngineConfig(max_num_seqs=args.requests, enable_prefix_caching=False)
    n = args.requests
    rows = {
        "merged": (LLMEngine(merged, cfg), [None] * n),
        "banked-1": (LLMEngine(bank1, cfg), ["a"] * n),
        "banked-2": (LLMEngine(bank2, cfg), ["a", "b"] * (n // 2) + ["a"] * (n % 2)),
        "banked-0": (LLMEngine(bank2, cfg), [None] * n),
        "base-op": (LLMEngine(copy.deepcopy(base), EngineConfig(max_num_seqs=n, enable_prefix_caching=False,
                                                                fused_decode=())), [None] * n),
    }
    for engine, adapters in rows.values():  # warm-up
        run(engine, adapters, 4)
    speeds: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.rounds):  # interleaved: every row once per round
        for name, (engine, adapters) in rows.items():
            speeds[name].append(run(engine, adapters, args.tokens))
    ref = statistics.median(speeds["merged"])
    print(f"{n} concurrent requests x {args.tokens} tokens, rank {args.rank}, threads {torch.get_num_threads()}")
    print("| serving | tokens/s | x merged |")
    print("|---|---|---|")
    for name, s in speeds.items():
        med = statistics.median(s)
        print(f"| {name} | {med:.0f} | {med / ref:.2f} |")


if __name__ == "__main__":
    main()
