"""`vocalis prepare`: manifest -> sharded Parquet of precomputed training features.

Utterance i goes to shard i // utts_per_shard, so a rerun over the same manifest and settings maps every
utterance to the same shard; a shard is done once its `.json` sidecar exists (written after the `.parquet`,
both renamed into place), and done shards are skipped. Workers are separate processes, each loading the frontend
models once. The end summary counts hours, utterances and speakers and lists every
skipped file with its reason; it is printed and saved as `summary.json`, beside `data.list` (the shard
paths) and `spk2embedding.json` (per-speaker mean x-vectors).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vocalis.errors import InputError
from vocalis.train.features import FeatureConfig, Featurizer, Skip
from vocalis.train.manifest import Utterance, read_manifest

log = logging.getLogger(__name__)

SHARD_DIR = "shards"
DATA_LIST = "data.list"
SUMMARY = "summary.json"
META = "prepare.json"
SPK2EMB = "spk2embedding.json"


@dataclass(frozen=True, slots=True)
class PrepareConfig:
    manifest: str
    out_dir: str
    model_dir: str
    utts_per_shard: int = 1000
    num_workers: int = 1  # 1 = in this process
    speech_tokenizer: str | None = None  # our own tokenizer (speech_tokenizer.safetensors) instead of the ONNX one
    features: FeatureConfig = dataclasses.field(default_factory=FeatureConfig)


def parquet_schema():  # -> pyarrow.Schema
    import pyarrow as pa

    return pa.schema([
        ("utt", pa.string()), ("wav", pa.string()), ("text", pa.string()), ("speaker", pa.string()),
        ("language", pa.string()), ("duration", pa.float32()),
        ("text_token", pa.list_(pa.int32())), ("speech_token", pa.list_(pa.int32())),
        ("embedding", pa.list_(pa.float32())), ("num_frames", pa.int32()),
        ("mel", pa.list_(pa.float32())),  # (num_frames * 80,) row-major
        ("f0", pa.list_(pa.float32())),  # (num_frames,)
        ("audio", pa.binary()),  # int16 little-endian PCM at 24 kHz
    ])


def write_shard(rows: list[dict[str, Any]], path: Path) -> None:
    """Rows (as `Featurizer` returns them) -> one Parquet file, written beside and renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=64, compression="zstd")
    os.replace(tmp, path)


def _write_json(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


# ---- worker side ---------------------------------------------------------------------------------------

_featurizer: Featurizer | None = None
_counter: Any = None


def _init_worker(model_dir: str, features: FeatureConfig, speech_tokenizer: str | None, counter: Any) -> None:
    global _featurizer, _counter
    import torch

    torch.set_num_threads(1)  # one process per core; intra-op threads would oversubscribe
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    tokenizer = None
    if speech_tokenizer is not None and features.speech_tokens:
        from vocalis.frontend.speech_tokenizer import TorchSpeechTokenizer

        tokenizer = TorchSpeechTokenizer.load(speech_tokenizer)
    _featurizer = Featurizer(model_dir, features, tokenizer)
    _counter = counter


def _process_shard(index: int, utts: list[Utterance], shard_dir: Path) -> dict[str, Any]:
    """Featurize one shard's utterances; write `shard-%06d.parquet` (if any row) and its `.json` sidecar."""
    assert _featurizer is not None
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    spk_sum: dict[str, list[float]] = {}
    spk_count: Counter[str] = Counter()
    for utt in utts:
        try:
            row = _featurizer(utt)
        except Skip as skip:
            skipped.append({"utt": utt.utt, "wav": utt.wav, "reason": skip.reason, "detail": str(skip)})
        except Exception as exc:  # one bad file must not end a long run; it is reported like any skip
            log.exception("unexpected error on %s", utt.wav)
            skipped.append({"utt": utt.utt, "wav": utt.wav, "reason": "error", "detail": f"{type(exc).__name__}: {exc}"})
        else:
            rows.append(row)
            prev = spk_sum.get(utt.speaker)
            spk_sum[utt.speaker] = (row["embedding"] if prev is None else np.asarray(prev) + row["embedding"]).tolist()
            spk_count[utt.speaker] += 1
        if _counter is not None:
            with _counter.get_lock():
                _counter.value += 1
    name = f"shard-{index:06d}"
    if rows:
        write_shard(rows, shard_dir / f"{name}.parquet")
    stats = {
        "shard": index,
        "parquet": f"{name}.parquet" if rows else None,
        "utterances": len(rows),
        "seconds": float(sum(r["duration"] for r in rows)),
        "frames": int(sum(r["num_frames"] for r in rows)),
        "speakers": {s: {"count": spk_count[s], "embedding_sum": spk_sum[s]} for s in spk_count},
        "skipped": skipped,
    }
    _write_json(stats, shard_dir / f"{name}.json")
    return stats


def _run_shard(args: tuple[int, list[Utterance], Path]) -> dict[str, Any]:
    return _process_shard(*args)


# ---- orchestration -------------------------------------------------------------------------------------


def _digest(utts: list[Utterance], config: PrepareConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(config.features), sort_keys=True).encode())
    h.update(f"{config.utts_per_shard} {config.speech_tokenizer}".encode())
    for u in utts:
        h.update(json.dumps(dataclasses.astuple(u)).encode())
    return h.hexdigest()


class _Progress:
    """A one-line progress bar on a terminal; a line every 10 % otherwise (logs, CI)."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.start_done, self.start = max(total, 1), done, time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last_decile = -1

    def update(self, done: int) -> None:
        elapsed = time.monotonic() - self.start
        rate = (done - self.start_done) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        frac = done / self.total
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = f"[{bar}] {done}/{self.total} utterances, {rate:.1f}/s, ETA {eta:.0f} s"
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def prepare(config: PrepareConfig) -> dict[str, Any]:
    """Run (or resume) preparation; returns the summary dict (also written to `summary.json`)."""
    if config.utts_per_shard < 1 or config.num_workers < 1:
        raise InputError("utts_per_shard and num_workers must be at least 1")
    utts = read_manifest(config.manifest)
    if not utts:
        raise InputError(f"manifest {config.manifest} lists no utterances")
    out = Path(config.out_dir)
    shard_dir = out / SHARD_DIR
    shard_dir.mkdir(parents=True, exist_ok=True)
    digest = _digest(utts, config)
    meta_path = out / META
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("digest") != digest:
            raise InputError(
                f"{out} was prepared from another manifest or other settings; use a new output directory "
                "(or delete it to start over)"
            )
    else:
        _write_json({"digest": digest, "manifest": str(config.manifest), "model_dir": str(config.model_dir),
                     "utts_per_shard": config.utts_per_shard, "features": dataclasses.asdict(config.features)},
                    meta_path)

    n = config.utts_per_shard
    shards = [(i, utts[i * n : (i + 1) * n]) for i in range(-(-len(utts) // n))]
    todo = [(i, u) for i, u in shards if not (shard_dir / f"shard-{i:06d}.json").is_file()]
    done_utts = len(utts) - sum(len(u) for _, u in todo)
    if len(todo) < len(shards):
        log.info("resuming: %d of %d shards already done", len(shards) - len(todo), len(shards))
    progress = _Progress(len(utts), done_utts)
    start = time.monotonic()
    if todo:
        if config.num_workers == 1:
            _init_worker(config.model_dir, config.features, config.speech_tokenizer, None)
            for i, (index, group) in enumerate(todo):
                _process_shard(index, group, shard_dir)
                progress.update(done_utts + sum(len(g) for _, g in todo[: i + 1]))
        else:
            # fork: workers start in milliseconds with the modules already imported (as DataLoader workers do);
            # each builds its own ONNX sessions after the fork.
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            counter = ctx.Value("l", 0)
            workers = min(config.num_workers, len(todo))
            init_args = (config.model_dir, config.features, config.speech_tokenizer, counter)
            with ctx.Pool(workers, _init_worker, init_args) as pool:
                pending = pool.map_async(_run_shard, [(i, g, shard_dir) for i, g in todo], chunksize=1)
                while not pending.ready():
                    pending.wait(0.5)
                    progress.update(done_utts + counter.value)
                pending.get()  # re-raise a worker failure (e.g. a model that does not load)
                progress.update(done_utts + counter.value)
        progress.close()
    summary = _summarize(out, [i for i, _ in shards], time.monotonic() - start)
    log.info(format_summary(summary))
    return summary


def _summarize(out: Path, indices: list[int], elapsed: float) -> dict[str, Any]:
    shard_dir = out / SHARD_DIR
    seconds, utterances, frames = 0.0, 0, 0
    parquets: list[str] = []
    skipped: list[dict[str, str]] = []
    speakers: dict[str, tuple[int, np.ndarray]] = {}
    for i in indices:
        stats = json.loads((shard_dir / f"shard-{i:06d}.json").read_text(encoding="utf-8"))
        seconds += stats["seconds"]
        utterances += stats["utterances"]
        frames += stats["frames"]
        skipped += stats["skipped"]
        if stats["parquet"]:
            parquets.append(str((shard_dir / stats["parquet"]).resolve()))
        for spk, s in stats["speakers"].items():
            count, total = speakers.get(spk, (0, 0.0))
            speakers[spk] = (count + s["count"], total + np.asarray(s["embedding_sum"], dtype=np.float64))
    (out / DATA_LIST).write_text("".join(p + "\n" for p in parquets), encoding="utf-8")
    _write_json({spk: (total / count).astype(np.float32).tolist() for spk, (count, total) in speakers.items()},
                out / SPK2EMB)
    summary = {
        "hours": seconds / 3600.0,
        "utterances": utterances,
        "speakers": len(speakers),
        "mel_frames": frames,
        "shards": len(parquets),
        "skipped": skipped,
        "skipped_by_reason": dict(Counter(s["reason"] for s in skipped)),
        "elapsed_seconds": elapsed,
        "data_list": str((out / DATA_LIST).resolve()),
    }
    _write_json(summary, out / SUMMARY)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        (f"prepared {summary['utterances']} utterances, {summary['hours']:.3f} h, {summary['speakers']} speakers "
         f"in {summary['shards']} shards ({summary['data_list']})"),
    ]
    if summary["skipped"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(summary["skipped_by_reason"].items()))
        lines.append(f"skipped {len(summary['skipped'])} files ({reasons}):")
        lines += [f"  {s['wav']}: {s['reason']} ({s['detail']})" for s in summary["skipped"]]
    return "\n".join(lines)
