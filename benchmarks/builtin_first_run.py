"""The built-in model as a new user meets it: `vocalis speak` wall time (process start to written file), import +
load, first audio of `TTS.stream`, synthesis RTF and peak RSS, each the median of --rounds.

    python benchmarks/builtin_first_run.py [--rounds 3] [--text "..."] [--fresh-kernels]

--fresh-kernels also times one `vocalis speak` with an empty kernel cache (a new TORCH_EXTENSIONS_DIR under the temp
folder, left there): the first run on a new machine, the kernels compiling beside it. Run on a quiet machine; the figures go to
docs/benchmarks.md with the machine's description.
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

# one process: import + load, then a stream and a whole synthesis; prints one JSON line
_MEASURE = r"""
import json, sys, time
start = time.perf_counter()
from vocalis import TTS
tts = TTS.load()
tts.synthesize("Hi.", seed=0)  # the engine's threads and first-call set-up, as a server's first request pays them
loaded = time.perf_counter() - start
text = sys.argv[1]
t = time.perf_counter(); first = None; n = 0
for chunk in tts.stream(text, seed=0):
    first = time.perf_counter() - t if first is None else first
    n += len(chunk.samples)
t = time.perf_counter(); wav = tts.synthesize(text, seed=0); whole = time.perf_counter() - t
hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) // 1024
print(json.dumps({"import_load_warmup_s": loaded, "stream_first_audio_s": first, "rtf": whole / (len(wav) / 24000),
                  "audio_s": len(wav) / 24000, "peak_rss_mb": hwm}))
tts.close()
"""


def speak_wall(text: str, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "vocalis", "speak", text, "-o", os.path.join(tmp, "o.wav")], env=env,
                       check=True, capture_output=True)
        return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--fresh-kernels", action="store_true", help="also one speak with an empty kernel cache")
    args = ap.parse_args()
    env = dict(os.environ)
    out: dict[str, float] = {}
    if args.fresh_kernels:  # the cache stays: the kernels go on compiling into it after the speak has ended
        cache = tempfile.mkdtemp(prefix="vocalis-kernels-")
        out["first_speak_fresh_kernels_s"] = speak_wall(args.text, {**env, "TORCH_EXTENSIONS_DIR": cache})
    speaks = [speak_wall(args.text, env) for _ in range(args.rounds)]
    runs = [json.loads(subprocess.run([sys.executable, "-c", _MEASURE, args.text], env=env, check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
            for _ in range(args.rounds)]
    out["speak_wall_s"] = statistics.median(speaks)
    for key in runs[0]:
        out[key] = statistics.median(r[key] for r in runs)
    print(json.dumps({k: round(v, 3) for k, v in out.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
