#!/usr/bin/env python3
"""Training throughput: samples/s and frames/s of each trainer at two sizes, fp32 vs bf16, 1 vs 2 ranks.

Each cell is a real `vocalis train` run (torchrun for 2 ranks) on a synthetic corpus written straight to
Parquet (random text/speech ids, mel/F0/audio of generated tones), so no frontend model is needed. The first
log window (start-up, allocator warm-up) is dropped; the cell reports the median of the remaining windows.
Sizes: `tiny` and the `builtin` preset (medium: the built-in model's shapes, ~12x tiny's LLM). Each rank uses
--threads-per-rank intra-op threads (default 1, as torchrun sets), so "2 ranks" means twice the cores.

    python benchmarks/bench_train.py --out /tmp/bench_train            # all 32 cells
    python benchmarks/bench_train.py --tasks llm flow --sizes tiny --steps 8
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
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

TASKS = ("llm", "flow", "hift", "tokenizer")
SIZES = ("tiny", "builtin")
# per task: batch budget (the task's length unit) and task-specific settings
TASK_SETTINGS = {
    "llm": ["data.max_frames_in_batch=2400"],
    "flow": ["data.max_frames_in_batch=1600"],
    "hift": ["data.segment_frames=51", "data.max_frames_in_batch=204"],  # 4 official segments of 24480 samples
    "tokenizer": ["data.max_frames_in_batch=1600"],
}
SIZE_SETTINGS = {
    "tiny": {"hift": ["hift.period_channels=[16,32,64,64,64]", "hift.spec_channels=16"], "tokenizer": ["tokenizer.preset=tiny"]},
    "builtin": {"hift": [], "tokenizer": ["tokenizer.preset=builtin"]},
}


def synthetic_corpus(directory: Path, preset: str, n: int = 48, seed: int = 0) -> Path:
    """n utterances of 2-5 s: random ids in the preset's vocabularies, real mel/F0/audio of generated tones."""
    from tiny_assets import write_voice_like_wav

    from vocalis.config import PRESETS
    from vocalis.frontend.audio import prompt_mel
    from vocalis.train.f0 import yin_f0
    from vocalis.train.prepare import write_shard

    cfg = PRESETS[preset]
    rng = np.random.default_rng(seed)
    shard_dir = directory / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        seconds = float(rng.uniform(2.0, 5.0))
        wav_path = write_voice_like_wav(directory / f"tone{i}.wav", seconds=seconds, seed=i)
        import soundfile as sf

        wav, _ = sf.read(wav_path, dtype="float32")
        mel = prompt_mel(wav).numpy()
        n_tok = mel.shape[0] // 2
        n_text = max(2, int(seconds * 4))
        text = " ".join(f"w{j}" for j in range(n_text))
        rows.append({
            "utt": f"s{i}", "wav": str(wav_path), "text": text, "speaker": f"spk{i % 4}", "language": "en",
            "duration": seconds, "text_token": rng.integers(0, 4000, n_text).astype(np.int32),
            "speech_token": rng.integers(0, cfg.llm.speech_token_size, n_tok).astype(np.int32),
            "embedding": rng.standard_normal(cfg.spk_embed_dim).astype(np.float32), "num_frames": mel.shape[0],
            "mel": mel.reshape(-1), "f0": yin_f0(wav, num_frames=mel.shape[0]),
            "audio": (np.clip(wav, -1, 1) * 32767).astype("<i2").tobytes(),
        })
    for k in range(0, n, 12):
        write_shard(rows[k : k + 12], shard_dir / f"shard-{k // 12:06d}.parquet")
    (directory / "data.list").write_text("".join(f"{p}\n" for p in sorted(shard_dir.glob("*.parquet"))))
    return directory


def run_cell(task: str, size: str, precision: str, ranks: int, corpus: Path, out: Path, steps: int,
             per_rank_threads: int) -> dict:
    settings = [
        f"model.preset={size}", f"trainer.precision={precision}", "trainer.max_epochs=0", "trainer.log_every=2",
        "trainer.save_every=100000", "trainer.tensorboard=false", f"trainer.num_threads={per_rank_threads}",
        "scheduler.name=constant", "scheduler.warmup_steps=0", "data.shuffle_buffer=16", "data.sort_buffer=8",
        *TASK_SETTINGS[task], *SIZE_SETTINGS[size].get(task, []),
    ]
    launcher = [sys.executable, "-m", "vocalis"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m", "vocalis"]
    cmd = [*launcher, "train", task, "--data", str(corpus), "--out", str(out), "--max-steps", str(steps),
           "--device", "cpu", *[a for s in settings for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(per_rank_threads)}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steady = records[1:] or records
    return {
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
        "frames_per_s": statistics.median(r["frames_per_s"] for r in steady),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per cell (first 2 are warm-up)")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--json", type=Path, help="write all results here")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_train_"))
    print(f"# work folder {work}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    corpora = {size: synthetic_corpus(work / f"corpus-{size}", size) for size in args.sizes}
    results = []
    print(f"{'task':<10}{'size':<9}{'prec':<6}{'ranks':>5}{'samples/s':>12}{'frames/s':>12}{'wall s':>9}", flush=True)
    for task in args.tasks:
        for size in args.sizes:
            for precision in args.precisions:
                for ranks in args.ranks:
                    out = work / f"{task}-{size}-{precision}-{ranks}"
                    cell = run_cell(task, size, precision, ranks, corpora[size], out, args.steps,
                                    args.threads_per_rank)
                    results.append({"task": task, "size": size, "precision": precision, "ranks": ranks, **cell})
                    if "error" in cell:
                        print(f"{task:<10}{size:<9}{precision:<6}{ranks:>5}  error: {cell['error']}", flush=True)
                    else:
                        print(f"{task:<10}{size:<9}{precision:<6}{ranks:>5}{cell['samples_per_s']:>12.2f}"
                              f"{cell['frames_per_s']:>12.1f}{cell['wall_s']:>9.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
