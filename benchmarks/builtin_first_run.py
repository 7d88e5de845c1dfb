"""The built-in model as a new user meets it: `vocalis speak` wall time (process start to written file), import +
load, first audio of `TTS.stream`, synthesis RTF, peak RSS, and 8 concurrent streams against 8 in a row, each the
median of --rounds and printed against its target.

    python benchmarks/builtin_first_run.py [--rounds 3] [--text "..."] [--precision fp32] [--threads N]
                                           [--fresh-kernels] [--json OUT]

--precision / --threads: what `vocalis speak` and the measuring process run with (--threads sets OMP_NUM_THREADS,
torch's intra-op threads; unset, torch's default); running the command once per setting, interleaved, is the A/B.
--fresh-kernels also times one `vocalis speak` with an empty kernel cache (a new TORCH_EXTENSIONS_DIR under the
temp folder, left there): the first run on a new machine, the kernels compiling beside it.
The concurrency figure streams "Good morning, how are you?" 8 times at once from 8 threads through one `TTS`
(the engine batches them), against the same 8 one after another: the ratio of the two wall times.
Run on a quiet machine (`nice` where others work); the figures go to docs/benchmarks.md with the machine's
description and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest."
SHORT = "Good morning, how are you?"

# the warm targets on 2 cores: (figure, bound); every figure is "at most"
TARGETS = {
    "speak_wall_s": 1.0,
    "import_load_s": 0.5,
    "stream_first_audio_s": 0.3,
    "rtf": 0.1,
    "peak_rss_mb": 300,
    "concurrent_8_over_serial_8": 0.5,
}

# one process: import + load, a warm-up, then a stream, a whole synthesis and the concurrency pair; one JSON line
_MEASURE = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
start = time.perf_counter()
from vocalis import TTS
tts = TTS.load(precision=sys.argv[3])
loaded = time.perf_counter() - start
tts.synthesize("Hi.", seed=0)  # the engine's threads and first-call set-up, as a server's first request pays them
warm = time.perf_counter() - start
text, short = sys.argv[1], sys.argv[2]
t = time.perf_counter(); first = None; n = 0
for chunk in tts.stream(text, seed=0):
    first = time.perf_counter() - t if first is None else first
    n += len(chunk.samples)
t = time.perf_counter(); wav = tts.synthesize(text, seed=0); whole = time.perf_counter() - t
def drain(i):
    return sum(len(c.samples) for c in tts.stream(short, seed=i))
t = time.perf_counter(); [drain(i) for i in range(8)]; serial = time.perf_counter() - t
with ThreadPoolExecutor(8) as pool:
    t = time.perf_counter(); list(pool.map(drain, range(8))); together = time.perf_counter() - t
hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) // 1024
print(json.dumps({"import_load_s": loaded, "import_load_warmup_s": warm, "stream_first_audio_s": first,
                  "rtf": whole / (len(wav) / 24000), "audio_s": len(wav) / 24000, "peak_rss_mb": hwm,
                  "serial_8_s": serial, "concurrent_8_s": together, "concurrent_8_over_serial_8": together / serial}))
tts.close()
"""


def speak_wall(text: str, precision: str, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "vocalis", "speak", text, "-o", os.path.join(tmp, "o.wav"),
                        "--precision", precision], env=env, check=True, capture_output=True)
        return time.perf_counter() - start


def measure(text: str, precision: str, env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _MEASURE, text, SHORT, precision], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--precision", default="fp32", help="as `vocalis speak --precision` (default fp32)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (OMP_NUM_THREADS)")
    ap.add_argument("--fresh-kernels", action="store_true", help="also one speak with an empty kernel cache")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    out: dict[str, float] = {}
    if args.fresh_kernels:  # the cache stays: the kernels go on compiling into it after the speak has ended
        cache = tempfile.mkdtemp(prefix="vocalis-kernels-")
        out["first_speak_fresh_kernels_s"] = speak_wall(args.text, args.precision, {**env, "TORCH_EXTENSIONS_DIR": cache})
    speaks, runs = [], []
    for _ in range(args.rounds):  # the two kinds of run interleaved: a change in the machine's load hits both
        speaks.append(speak_wall(args.text, args.precision, env))
        runs.append(measure(args.text, args.precision, env))
    out["speak_wall_s"] = statistics.median(speaks)
    for key in runs[0]:
        out[key] = statistics.median(r[key] for r in runs)
    print(f"built-in model, precision {args.precision}, threads {args.threads or 'default'}, "
          f"{args.rounds} rounds (medians)")
    for key, value in out.items():
        bound = TARGETS.get(key)
        verdict = "" if bound is None else f"  target <= {bound}: {'met' if value <= bound else 'NOT met'}"
        print(f"  {key:28s} {value:9.3f}{verdict}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"precision": args.precision, "threads": args.threads, **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
