"""Where the built-in model's time and memory go, one part at a time, each an A/B in the same run.

    python benchmarks/bench_builtin_parts.py flow [--frames 420] [--rounds 4]
    python benchmarks/bench_builtin_parts.py lexicon
    python benchmarks/bench_builtin_parts.py threads [--rounds 2] [--precision fp32]

flow: the fp32 full-attention flow pass (10 Euler steps, CFG, one request of --frames mel frames) on the modules'
own forward against the incremental estimator's (`solver.solve_chunk(full_attention=True)`, what the engine runs),
interleaved, one intra-op thread; CPU seconds of the calling thread, the lowest of --rounds, and their largest
difference. lexicon: the frontend's word table, built in a fresh process: CPU seconds and resident MB it adds.
threads: one `TTS.synthesize` of a sentence in a fresh process per setting, OMP_NUM_THREADS=1 against torch's
default, interleaved: wall and process CPU seconds (a loaded machine shows what a descheduled worker thread costs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest."


def flow(frames: int, rounds: int) -> None:
    import torch

    from vocalis.model_dir import load_model
    from vocalis.token2wav.cv2.solver import TimeTerms, solve_chunk

    torch.set_num_threads(1)
    decoder = load_model(None).flow.eval().decoder
    est = decoder.estimator
    g = torch.Generator().manual_seed(0)
    mu, spks = torch.randn(1, 80, frames, generator=g), torch.randn(1, 80, generator=g)
    cond = torch.zeros(1, 80, frames)
    cond[:, :, : frames // 4] = torch.randn(1, 80, frames // 4, generator=g)  # a prompt's mel
    terms = TimeTerms(est)
    runs = {
        "modules": lambda: decoder(mu, torch.ones(1, 1, frames), spks, cond, n_timesteps=10, streaming=False),
        "incremental": lambda: solve_chunk(decoder, est, mu, spks, cond, [0], [frames], [[]], [False], 10, None,
                                           None, terms, full_attention=True),
    }
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        out = {name: run() for name, run in runs.items()}
        for i in range(rounds):
            for name in runs if i % 2 == 0 else reversed(list(runs)):
                start = time.thread_time()
                runs[name]()
                cpu[name].append(time.thread_time() - start)
    diff = float((out["modules"] - out["incremental"]).abs().max())
    best = {name: min(v) for name, v in cpu.items()}
    print(json.dumps({"frames": frames, **{f"{k}_cpu_s": round(v, 3) for k, v in best.items()},
                      "incremental_over_modules": round(best["incremental"] / best["modules"], 3),
                      "max_abs_diff": diff}))


def lexicon() -> None:
    code = ("import time\n"
            "def rss(): return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) / 1024\n"
            "from vocalis.frontend import phones\n"
            "r, c = rss(), time.process_time(); n = len(phones._lexicon())\n"
            "print(round(time.process_time() - c, 3), round(rss() - r, 1), n)\n")
    cpu, mb, words = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True).stdout.split()
    print(json.dumps({"build_cpu_s": float(cpu), "resident_mb": float(mb), "words": int(words)}))


_SYNTH = r"""
import json, sys, time
from vocalis import TTS
tts = TTS.load(precision=sys.argv[2])
tts.synthesize("Hi.", seed=0)
w, c = time.perf_counter(), time.process_time()
wav = tts.synthesize(sys.argv[1], seed=0)
print(json.dumps({"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c, "audio_s": len(wav) / 24000}))
tts.close()
"""


def threads(rounds: int, precision: str) -> None:
    for _ in range(rounds):
        for setting in ("1", None):
            env = dict(os.environ)
            env.pop("OMP_NUM_THREADS", None)
            if setting is not None:
                env["OMP_NUM_THREADS"] = setting
            done = subprocess.run([sys.executable, "-c", _SYNTH, TEXT, precision], env=env, check=True,
                                  capture_output=True, text=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({"threads": setting or "default", **{k: round(v, 2) for k, v in row.items()}}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("flow", "lexicon", "threads"))
    ap.add_argument("--frames", type=int, default=420)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args()
    if args.part == "flow":
        flow(args.frames, args.rounds or 4)
    elif args.part == "lexicon":
        lexicon()
    else:
        threads(args.rounds or 2, args.precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
