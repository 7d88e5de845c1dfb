"""The async engine's loop variants against each other, interleaved in one process on `vocalis bench`'s end-to-end
scenario (random weights, a saved 3 s voice, fixed-length utterances, every request submitted at once): serial
(LLM step, then token2wav step), overlapped (token2wav steps on a worker thread beside the LLM steps,
`runtime.overlap`), each with or without deadline scheduling (`runtime.deadlines`). The variants share one model, one
LLM engine and one token2wav engine; rounds alternate their order; medians per variant and ratios against the first.

    python benchmarks/bench_engine_loop.py --threads 2 --tokens 50 --concurrency 1,8 --precision int8 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import numpy as np

from vocalis.backends.choice import make_llm_engine
from vocalis.bench.engine_side import _engine_batch
from vocalis.bench.scenario import BenchConfig, bench_voice, build, fixed_length_engine, peak_rss_mib
from vocalis.engine.config import EngineConfig
from vocalis.runtime.deadlines import DeadlineScheduling
from vocalis.runtime.overlap import OverlapConfig
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine

DEADLINES = DeadlineScheduling(enabled=True)
# later chunks by deadline, overdue ones (new streams' first chunks) in steps as wide as the engine takes
DEADLINES_WHOLE = DeadlineScheduling(enabled=True, split_overdue=False)
VARIANTS = {
    "serial": (OverlapConfig(enabled=False), DeadlineScheduling(enabled=False)),
    "serial+deadlines": (OverlapConfig(enabled=False), DEADLINES),
    "serial+deadlines-whole": (OverlapConfig(enabled=False), DEADLINES_WHOLE),
    "overlap": (OverlapConfig(enabled=True), DeadlineScheduling(enabled=False)),
    "overlap+deadlines": (OverlapConfig(enabled=True), DEADLINES),
}
KEYS = ("first_chunk_s", "audio_s_per_s", "wall_s")


async def measure(cfg: BenchConfig, precision: str, names: list[str], rounds: int) -> dict[str, dict[int, Any]]:
    model, runtime, described = build(cfg, precision)
    print(described, flush=True)
    voice = bench_voice(model, cfg)
    llm = make_llm_engine(model, EngineConfig(max_num_seqs=max(cfg.concurrency)), runtime)
    t2w = Token2WavEngine(model.flow, model.hift, Token2WavConfig(workers=cfg.t2w_workers))
    engine_type = fixed_length_engine(cfg.tokens)
    runs: dict[str, dict[int, list[dict[str, float]]]] = {n: {c: [] for c in cfg.concurrency} for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            overlap, deadlines = VARIANTS[n]
            with engine_type(model, llm, t2w, overlap=overlap, deadlines=deadlines) as eng:
                for c in cfg.concurrency:
                    if r == 0 and n == names[0]:  # first-use page faults and caches, once: the engines are shared
                        await _engine_batch(eng, voice, cfg, c, salt=100)
                    runs[n][c].append(await _engine_batch(eng, voice, cfg, c, salt=1000 * (r + 1) + c))
                    print(r, n, c, {k: round(runs[n][c][-1][k], 3) for k in KEYS}, flush=True)
    return {n: {c: {k: float(np.median([x[k] for x in by_c[c]])) for k in KEYS} for c in by_c}
            for n, by_c in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cosyvoice2-0.5b")
    p.add_argument("--precision", default="int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=50)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--t2w-workers", type=int, default=None)
    p.add_argument("--variants", default="serial,overlap,serial+deadlines,overlap+deadlines")
    p.add_argument("--json", default="")
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    conc = tuple(int(c) for c in args.concurrency.split(","))
    cfg = BenchConfig(preset=args.preset, precisions=(args.precision,), threads=args.threads, tokens=args.tokens,
                      concurrency=conc, parts=("e2e",), t2w_workers=args.t2w_workers)
    result = asyncio.run(measure(cfg, args.precision, names, args.rounds))
    base = result[names[0]]
    for n in names:
        for c in conc:
            v = result[n][c]
            print(f"{n:>18} @{c}: first chunk {v['first_chunk_s']:.2f} s ({v['first_chunk_s'] / base[c]['first_chunk_s']:.2f}"
                  f"x {names[0]}), audio s/s {v['audio_s_per_s']:.3f} ({v['audio_s_per_s'] / base[c]['audio_s_per_s']:.2f}x)")
        if len(conc) > 1:
            print(f"{n:>18}: first chunk @{conc[-1]} / @{conc[0]} = "
                  f"{result[n][conc[-1]]['first_chunk_s'] / result[n][conc[0]]['first_chunk_s']:.2f}")
    print(f"peak RSS {peak_rss_mib():.0f} MiB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
