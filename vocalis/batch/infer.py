"""Dataset-scale synthesis: a manifest -> one wav per id, across torchrun ranks, resumable.

    vocalis infer --manifest M --out DIR                                      # one process
    torchrun --nproc_per_node=4 -m vocalis.cli infer --manifest M --out DIR   # four ranks

- Sharding: rank r takes manifest items r, r + W, r + 2W, ... (W = WORLD_SIZE): disjoint and deterministic.
  A process group (gloo on CPU, nccl on GPU) is made only when W > 1, for the final barrier.
- Resume: an id is finished when `DIR/<id>.wav` exists and is readable audio. Files are written under a
  hidden temporary name and renamed into place, so a killed run never leaves a partial file that counts;
  stale temporaries are removed before the id is redone.
- Seeds: an item's seed is its own `seed`, else `--seed` + crc32(id), so the audio does not depend on W.
- Summary: each rank writes `DIR/.summary.rank<r>.json`; after a barrier rank 0 merges them into
  `DIR/summary.json` (counts, failures with reasons, audio seconds, RTF, per-item figures; per-item figures of
  ids skipped as finished are carried over from the previous summary).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist

from vocalis.audio_file import write_audio
from vocalis.batch.manifest import ManifestItem, read_manifest
from vocalis.errors import InputError, VocalisError
from vocalis.model_options import ModelOptions

log = logging.getLogger(__name__)

SUMMARY_NAME = "summary.json"
_VOICE_CACHE_SIZE = 32
_BARRIER_TIMEOUT = timedelta(hours=24)  # ranks finish their shards at different times; waiting is normal


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a torchrun job (rank 0 of 1 outside torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> RankInfo:
        try:
            info = cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                       int(os.environ.get("LOCAL_RANK", "0")))
        except ValueError as exc:
            raise InputError(f"bad torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK): {exc}") from None
        if not 0 <= info.rank < info.world_size:
            raise InputError(f"RANK={info.rank} is outside WORLD_SIZE={info.world_size}")
        return info


@dataclass(frozen=True)
class InferOptions:
    manifest: Path
    out_dir: Path
    model: str | None = None  # model directory; None: the built-in model
    stream: bool = False  # synthesise chunk by chunk (also records first-chunk latency)
    # device "auto": cuda:<LOCAL_RANK> when CUDA is available, else cpu
    load: ModelOptions = field(default_factory=lambda: ModelOptions(device="auto"))
    seed: int = 0
    progress: bool = True
    in_flight: int = 8  # items synthesised at once per rank (the engine batches them)


@dataclass
class ItemResult:
    id: str
    line: int
    status: str  # "done" | "skipped" | "failed"
    rank: int
    reason: str = ""
    audio_seconds: float = 0.0
    compute_seconds: float = 0.0
    first_chunk_seconds: float | None = None


@dataclass
class RankReport:
    rank: int
    results: list[ItemResult] = field(default_factory=list)
    load_seconds: float = 0.0
    wall_seconds: float = 0.0
    model: str | None = None
    runtime: str | None = None  # what the rank loaded: backend and precision as resolved, on which device
    sample_rate: int | None = None


def shard(items: list[ManifestItem], info: RankInfo) -> list[ManifestItem]:
    """Rank r's items: every W-th from position r (round robin keeps long and short items spread out)."""
    return items[info.rank :: info.world_size]


def output_path(out_dir: Path, item_id: str) -> Path:
    return out_dir / f"{item_id}.wav"


def is_finished(path: Path) -> bool:
    """A finished id has a readable, non-empty wav; anything else is redone."""
    try:
        return path.is_file() and sf.info(str(path)).frames > 0
    except (sf.SoundFileError, RuntimeError, OSError):
        return False


def item_seed(item: ManifestItem, base_seed: int) -> int:
    return item.seed if item.seed is not None else (base_seed + zlib.crc32(item.id.encode("utf-8"))) % 2**31


def _remove_stale_temporaries(out_dir: Path, item_id: str) -> None:
    # write_audio's temporary names: ".<id>.wav.<random>.tmp" (ids never contain glob characters).
    for stale in out_dir.glob(f".{item_id}.wav.*.tmp"):
        stale.unlink(missing_ok=True)


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class _Progress:
    """tqdm on rank 0 when installed, else one stderr line per item; silent on other ranks."""

    def __init__(self, total: int, initial: int, enabled: bool, label: str) -> None:
        self.total, self.count, self.enabled, self.label = total, initial, enabled, label
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=initial, desc=label, unit="utt", file=sys.stderr)

    def update(self, failed: int) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(failed=failed, refresh=False)
        elif self.enabled:
            print(f"{self.label}: {self.count}/{self.total} ({failed} failed)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Worker:
    """One rank's model and voice cache; several items are synthesised at once from a thread each (the engine
    batches their LLM and token2wav steps)."""

    def __init__(self, options: InferOptions, info: RankInfo) -> None:
        self.tts = options.load.load(options.model, local_rank=info.local_rank)
        if self.tts.model.kind == "random":
            log.warning("rank %d: no trained model given: the built-in RANDOM-weight model writes noise", info.rank)
        self.options = options
        self.voices: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._voices_lock = threading.Lock()

    def _voice(self, item: ManifestItem) -> Any:
        if item.prompt_wav is None:
            return item.voice  # a name (or None for the default voice)
        key = (str(item.prompt_wav), item.prompt_text, item.language)
        with self._voices_lock:
            if key in self.voices:
                self.voices.move_to_end(key)
                return self.voices[key]
        voice = self.tts.frontend.make_voice(item.prompt_wav, item.prompt_text, language=item.language)
        with self._voices_lock:
            self.voices[key] = voice
            if len(self.voices) > _VOICE_CACHE_SIZE:
                self.voices.popitem(last=False)
        return voice

    def synthesize(self, item: ManifestItem, result: ItemResult) -> np.ndarray:
        """Audio of `item`; fills the timing fields of `result`. Prompt features count as compute time."""
        start = time.perf_counter()
        kwargs: dict[str, Any] = {"voice": self._voice(item), "instruct": item.instruct or None, "speed": item.speed,
                                  "seed": item_seed(item, self.options.seed), "language": item.language}
        if self.options.stream:
            parts: list[np.ndarray] = []
            for chunk in self.tts.stream(item.text, **kwargs):
                if result.first_chunk_seconds is None:
                    result.first_chunk_seconds = time.perf_counter() - start
                parts.append(chunk.samples)
            audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        else:
            audio = self.tts.synthesize(item.text, **kwargs)
        result.compute_seconds = time.perf_counter() - start
        return audio


def _run_shard(options: InferOptions, info: RankInfo, items: list[ManifestItem]) -> RankReport:
    report = RankReport(info.rank)
    start = time.perf_counter()
    todo: list[ManifestItem] = []
    for item in items:
        if not item.ok:
            report.results.append(ItemResult(item.id, item.line, "failed", info.rank, reason=item.error or ""))
        elif is_finished(output_path(options.out_dir, item.id)):
            report.results.append(ItemResult(item.id, item.line, "skipped", info.rank))
        else:
            todo.append(item)
    skipped = sum(r.status == "skipped" for r in report.results)
    failed = len(report.results) - skipped
    log.info("rank %d/%d: %d items (%d finished, %d bad lines, %d to do)", info.rank, info.world_size, len(items),
             skipped, failed, len(todo))
    if not todo:  # nothing to synthesise: do not pay for loading the model
        report.wall_seconds = time.perf_counter() - start
        return report

    load_start = time.perf_counter()
    worker = _Worker(options, info)
    report.load_seconds = time.perf_counter() - load_start
    report.model, report.sample_rate = worker.tts.model.describe(), worker.tts.sample_rate
    report.runtime = worker.tts.runtime.describe()
    progress = _Progress(len(items), len(items) - len(todo), options.progress and info.rank == 0,
                         f"rank 0/{info.world_size}" if info.world_size > 1 else "infer")
    def process(item: ManifestItem) -> ItemResult:
        result = ItemResult(item.id, item.line, "done", info.rank)
        path = output_path(options.out_dir, item.id)
        try:
            _remove_stale_temporaries(options.out_dir, item.id)
            audio = worker.synthesize(item, result)
            if audio.size == 0:
                raise InputError("the model produced no audio")
            write_audio(path, audio, worker.tts.sample_rate)
            result.audio_seconds = audio.size / worker.tts.sample_rate
        except VocalisError as exc:
            result.status, result.reason = "failed", str(exc)
        except Exception as exc:  # one item's crash (a shape bug, OOM) must not end the whole dataset run
            log.debug("rank %d: %s failed", info.rank, item.id, exc_info=True)
            result.status, result.reason = "failed", f"{type(exc).__name__}: {exc}"
        return result

    try:
        with ThreadPoolExecutor(max_workers=max(1, options.in_flight), thread_name_prefix="vocalis-infer") as pool:
            futures = [pool.submit(process, item) for item in todo]
            for future in as_completed(futures):
                result = future.result()
                if result.status == "failed":
                    failed += 1
                    log.warning("rank %d: %s (line %d) failed: %s", info.rank, result.id, result.line, result.reason)
                progress.update(failed)
            report.results.extend(f.result() for f in futures)  # manifest order
    finally:
        progress.close()
        worker.tts.close()
    report.wall_seconds = time.perf_counter() - start
    return report


def _rank_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f".summary.rank{rank}.json"


def merge_reports(reports: list[dict[str, Any]], previous: dict[str, Any] | None, context: dict[str, Any]) -> dict:
    """Per-rank reports (as written by `_rank_file`) -> the summary.json object."""
    results = sorted((r for rep in reports for r in rep["results"]), key=lambda r: r["line"])
    done = [r for r in results if r["status"] == "done"]
    old_items = (previous or {}).get("items", {})
    items: dict[str, dict[str, Any]] = {}
    for r in results:
        if r["status"] == "done":
            items[r["id"]] = {k: r[k] for k in ("rank", "audio_seconds", "compute_seconds", "first_chunk_seconds")}
            items[r["id"]]["rtf"] = r["compute_seconds"] / max(r["audio_seconds"], 1e-9)
        elif r["status"] == "skipped" and r["id"] in old_items:
            items[r["id"]] = old_items[r["id"]]  # made by an earlier run: keep its figures for `vocalis eval`
    audio = sum(r["audio_seconds"] for r in done)
    compute = sum(r["compute_seconds"] for r in done)
    synth_wall = max((rep["wall_seconds"] for rep in reports), default=0.0)
    first = [r["first_chunk_seconds"] for r in done if r["first_chunk_seconds"] is not None]
    return {
        **context,
        "model": next((rep["model"] for rep in reports if rep["model"]), (previous or {}).get("model")),
        "runtime": next((rep["runtime"] for rep in reports if rep.get("runtime")), (previous or {}).get("runtime")),
        "sample_rate": next((rep["sample_rate"] for rep in reports if rep["sample_rate"]),
                            (previous or {}).get("sample_rate")),
        "total": len(results),
        "done": len(done),
        "skipped": sum(r["status"] == "skipped" for r in results),
        "failed": sum(r["status"] == "failed" for r in results),
        "failures": [{k: r[k] for k in ("id", "line", "rank", "reason")} for r in results if r["status"] == "failed"],
        "audio_seconds": audio,
        "compute_seconds": compute,
        "rtf": compute / audio if audio > 0 else None,  # per process: compute time / audio time
        "wall_seconds": synth_wall,
        "throughput_rtf": synth_wall / audio if audio > 0 else None,  # all ranks together, model load included
        "mean_first_chunk_seconds": float(np.mean(first)) if first else None,
        "ranks": [{"rank": rep["rank"], "load_seconds": rep["load_seconds"], "wall_seconds": rep["wall_seconds"],
                   **{s: sum(r["status"] == s for r in rep["results"]) for s in ("done", "skipped", "failed")}}
                  for rep in sorted(reports, key=lambda rep: rep["rank"])],
        "items": items,
    }


def _barrier(info: RankInfo) -> None:
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[info.local_rank])
    else:
        dist.barrier()


def _init_process_group(options: InferOptions, info: RankInfo) -> None:
    use_cuda = options.load.resolved_device(info.local_rank).startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=_BARRIER_TIMEOUT)


def run_batch(options: InferOptions, info: RankInfo | None = None) -> dict[str, Any] | None:
    """Synthesise this rank's shard; rank 0 returns the merged summary (other ranks return None)."""
    info = info or RankInfo.from_env()
    items = read_manifest(options.manifest)
    if not items:
        raise InputError(f"manifest {options.manifest} has no items")
    try:
        options.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create output folder {options.out_dir}: {exc}") from None
    distributed = info.world_size > 1
    if distributed:
        _init_process_group(options, info)
    try:
        report = _run_shard(options, info, shard(items, info))
        _write_json(_rank_file(options.out_dir, info.rank), asdict(report))
        if distributed:
            _barrier(info)
        if info.rank != 0:
            return None
        return _merge_on_rank0(options, info, len(items))
    finally:
        if distributed:
            dist.destroy_process_group()


def _merge_on_rank0(options: InferOptions, info: RankInfo, total: int) -> dict[str, Any]:
    rank_files = [_rank_file(options.out_dir, r) for r in range(info.world_size)]
    reports = [json.loads(p.read_text(encoding="utf-8")) for p in rank_files]
    summary_path = options.out_dir / SUMMARY_NAME
    previous = None
    if summary_path.is_file():
        try:
            previous = json.loads(summary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            log.warning("ignoring unreadable %s", summary_path)
    context = {"manifest": str(options.manifest), "out_dir": str(options.out_dir), "world_size": info.world_size,
               "stream": options.stream, "seed": options.seed, "precision": options.load.precision,
               "backend": options.load.backend, "flow_steps": options.load.flow_steps,
               "final_chunk": options.load.final_chunk}
    summary = merge_reports(reports, previous, context)
    if summary["total"] != total:  # every item must be accounted for by exactly one rank
        raise RuntimeError(f"merged {summary['total']} results for {total} manifest items")
    _write_json(summary_path, summary)
    for p in rank_files:
        p.unlink(missing_ok=True)
    return summary


def describe_summary(summary: dict[str, Any]) -> Iterator[str]:
    """Human-readable lines for the log."""
    rtf = summary["rtf"]
    yield (f"{summary['done']} done, {summary['skipped']} skipped (finished earlier), {summary['failed']} failed "
           f"of {summary['total']}; {summary['audio_seconds']:.1f} s of audio"
           + (f", RTF {rtf:.3f} per process, {summary['throughput_rtf']:.3f} all ranks" if rtf is not None else ""))
    yield f"summary: {Path(summary['out_dir']) / SUMMARY_NAME}"
    for failure in summary["failures"][:20]:
        yield f"failed {failure['id']} (line {failure['line']}): {failure['reason']}"
    if len(summary["failures"]) > 20:
        yield f"... and {len(summary['failures']) - 20} more failures (see summary.json)"
