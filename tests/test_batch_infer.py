"""`vocalis infer`: manifest parsing, sharding, resume and the summary; two real torchrun ranks on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from tiny_assets import make_tiny_model_dir, write_voice_like_wav

from vocalis.batch.infer import InferOptions, RankInfo, is_finished, merge_reports, run_batch, shard
from vocalis.cli import main
from vocalis.batch.manifest import read_manifest

REPO = Path(__file__).resolve().parents[1]
VALID_IDS = {"a1", "a2", "a3", "a4", "a7"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a shared 2-core machine: threads would only fight
    return env


def _write_manifest(folder: Path) -> Path:
    """Valid items of every kind (default voice, named voice, zero-shot jsonl and seed-tts-eval, cross-lingual)
    plus bad ones: unknown voice, missing prompt, invalid JSON, wrong field count, duplicate id."""
    lines = [
        '{"id": "a1", "text": "Hi."}',
        '{"id": "a2", "text": "Ok.", "voice": "default"}',
        '{"id": "a3", "text": "Yes.", "prompt_wav": "prompts/p.wav", "prompt_text": "hi there"}',
        "# a comment, then a blank line",
        "",
        '{"id": "a4", "text": "Go.", "prompt_wav": "prompts/p.wav"}',
        '{"id": "b1", "text": "No.", "voice": "nobody"}',
        '{"id": "b2", "text": "No.", "prompt_wav": "prompts/missing.wav"}',
        '{"id": "b3", "text": "No."',
        "b4|only|three fields",
        '{"id": "a1", "text": "Again."}',
        "a7|hi there|prompts/p.wav|Hey.",
    ]
    (folder / "prompts").mkdir(parents=True)
    write_voice_like_wav(folder / "prompts" / "p.wav", seconds=1.5)
    path = folder / "manifest.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- units ----------------------------------------------------------------------------------------------


def test_manifest_formats_and_bad_lines(tmp_path: Path) -> None:
    path = _write_manifest(tmp_path)
    (tmp_path / "seed.lst").write_text("x1|prompt words|../p.wav|target words|gt/x1.wav\n../bad|a|b|c\n")
    items = {i.line: i for i in read_manifest(path)}
    assert [i.id for i in items.values() if i.ok] == ["a1", "a2", "a3", "a4", "b1", "b2", "a7"]
    assert items[3].prompt_wav == tmp_path / "prompts" / "p.wav" and items[3].prompt_text == "hi there"
    assert items[2].voice == "default" and items[1].prompt_wav is None
    assert items[12].prompt_wav == tmp_path / "prompts" / "p.wav" and items[12].text == "Hey."
    assert "invalid JSON" in items[9].error and items[9].id == "b3"
    assert "4 or 5 fields" in items[10].error
    assert "duplicate id 'a1' (first on line 1)" in items[11].error
    seed = read_manifest(tmp_path / "seed.lst")
    assert seed[0].ok and seed[0].prompt_wav == tmp_path / ".." / "p.wav"
    assert seed[0].reference_wav == tmp_path / "gt" / "x1.wav" and seed[0].prompt_text == "prompt words"
    assert not seed[1].ok and "invalid id" in seed[1].error


def test_shards_are_disjoint_deterministic_and_complete(tmp_path: Path) -> None:
    items = read_manifest(_write_manifest(tmp_path))
    for world in (1, 2, 3, 5):
        shards = [shard(items, RankInfo(r, world, r)) for r in range(world)]
        lines = [i.line for s in shards for i in s]
        assert sorted(lines) == [i.line for i in items] and len(set(lines)) == len(lines)
        assert shards == [shard(items, RankInfo(r, world, r)) for r in range(world)]


def test_finished_means_a_readable_final_file(tmp_path: Path) -> None:
    good = write_voice_like_wav(tmp_path / "good.wav", seconds=0.2)
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "junk.wav").write_bytes(b"RIFF\x00garbage")
    (tmp_path / ".x.wav.abc.tmp").write_bytes(good.read_bytes())
    assert is_finished(good)
    assert not any(is_finished(tmp_path / n) for n in ("empty.wav", "junk.wav", "x.wav", "missing.wav"))


def test_merge_keeps_earlier_figures_of_skipped_ids() -> None:
    def result(i: str, status: str, seconds: float = 0.0, rank: int = 0) -> dict:
        return {"id": i, "line": int(i[1:]), "status": status, "rank": rank, "reason": "bad" if status == "failed" else "",
                "audio_seconds": seconds, "compute_seconds": seconds / 2, "first_chunk_seconds": None}

    reports = [{"rank": 0, "results": [result("a1", "done", 2.0), result("a2", "skipped")], "load_seconds": 1.0,
                "wall_seconds": 3.0, "model": "m", "sample_rate": 24000},
               {"rank": 1, "results": [result("a3", "failed", rank=1)], "load_seconds": 0.0, "wall_seconds": 0.1,
                "model": None, "sample_rate": None}]
    previous = {"items": {"a2": {"rank": 1, "audio_seconds": 4.0, "compute_seconds": 1.0, "rtf": 0.25}}}
    summary = merge_reports(reports, previous, {"world_size": 2})
    assert (summary["done"], summary["skipped"], summary["failed"]) == (1, 1, 1)
    assert summary["items"]["a2"]["rtf"] == 0.25 and summary["items"]["a1"]["rtf"] == pytest.approx(0.5)
    assert summary["rtf"] == pytest.approx(0.5) and summary["throughput_rtf"] == pytest.approx(1.5)
    assert summary["failures"] == [{"id": "a3", "line": 3, "rank": 1, "reason": "bad"}]


def test_cli_missing_manifest_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["infer", "--manifest", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"vocalis: error: manifest not found: {tmp_path}/nope.jsonl"]


# ---- real runs ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch")
    return {"model": make_tiny_model_dir(root / "model"), "manifest": _write_manifest(root / "data"),
            "out": root / "out"}


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


def test_two_ranks_write_every_file_once_then_a_rerun_resumes(job: dict[str, Path]) -> None:
    out = job["out"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "vocalis.cli", "infer", "--manifest", str(job["manifest"]), "--out", str(out), "--model", str(job["model"])]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(out)
    assert summary["world_size"] == 2 and summary["total"] == 10
    assert (summary["done"], summary["skipped"], summary["failed"]) == (len(VALID_IDS), 0, 5)
    # Each valid id was written by exactly one rank; both ranks worked; nothing else is left in the folder.
    assert set(summary["items"]) == VALID_IDS
    assert sorted(r["done"] for r in summary["ranks"]) == [2, 3]
    assert {item["rank"] for item in summary["items"].values()} == {0, 1}
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{i}.wav" for i in VALID_IDS] + ["summary.json"])
    for i in VALID_IDS:
        info = sf.info(str(out / f"{i}.wav"))
        assert info.samplerate == 24000
        assert info.frames / 24000 == pytest.approx(summary["items"][i]["audio_seconds"])
    reasons = {f["line"]: f["reason"] for f in summary["failures"]}
    assert "unknown voice 'nobody'" in reasons[7] and "audio file not found" in reasons[8]
    assert "invalid JSON" in reasons[9] and "4 or 5 fields" in reasons[10] and "duplicate id" in reasons[11]
    assert summary["audio_seconds"] > 0 and summary["rtf"] > 0

    # Rerun in one process: a3 deleted with a partial temporary left behind, a2 emptied; the rest are skipped.
    a3_bytes = (out / "a3.wav").read_bytes()
    a3_audio, _ = sf.read(str(out / "a3.wav"), dtype="int16")
    (out / "a3.wav").unlink()
    (out / ".a3.wav.k2j3h4.tmp").write_bytes(a3_bytes[: len(a3_bytes) // 2])
    (out / "a2.wav").write_bytes(b"")
    untouched = {i: (out / f"{i}.wav").stat().st_mtime_ns for i in ("a1", "a4", "a7")}
    rerun = subprocess.run(cmd[:1] + cmd[5:], env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    again = _summary(out)
    assert (again["world_size"], again["done"], again["skipped"], again["failed"]) == (1, 2, 3, 5)
    assert {i: (out / f"{i}.wav").stat().st_mtime_ns for i in untouched} == untouched
    assert not list(out.glob(".*.tmp"))
    # Seeds come from the id, not the rank: the redone file is the same audio the two-rank run wrote. Not
    # byte-equal: the rerun batches a3 with other items than the first run did, and rows of a different batch
    # may round differently in the last bit (a different seed would give other tokens and another length).
    redone, _ = sf.read(str(out / "a3.wav"), dtype="int16")
    assert redone.shape == a3_audio.shape
    diff = np.abs(redone.astype(np.int32) - a3_audio.astype(np.int32)).max()
    assert diff <= 0.01 * np.abs(a3_audio.astype(np.int32)).max()
    assert set(again["items"]) == VALID_IDS  # figures of skipped ids carried over for `vocalis eval`


def test_streaming_run_in_process_records_first_chunk(job: dict[str, Path], tmp_path: Path) -> None:
    manifest = tmp_path / "one.jsonl"
    manifest.write_text('{"id": "s1", "text": "Hi."}\n', encoding="utf-8")
    summary = run_batch(InferOptions(manifest, tmp_path / "out", str(job["model"]), stream=True, progress=False),
                        RankInfo())
    assert summary is not None and summary["done"] == 1 and summary["stream"] is True
    assert 0 < summary["items"]["s1"]["first_chunk_seconds"] <= summary["items"]["s1"]["compute_seconds"]
    assert is_finished(tmp_path / "out" / "s1.wav")


def test_model_flags_reach_the_engine(job: dict[str, Path], tmp_path: Path) -> None:
    """`vocalis infer --precision/--flow-steps/--final-chunk` load the ranks' engine as `vocalis serve` does."""
    manifest = tmp_path / "one.jsonl"
    manifest.write_text('{"id": "s1", "text": "Hi there."}\n', encoding="utf-8")
    runs = {"default": [], "steps": ["--flow-steps", "2", "--final-chunk", "causal"], "int8": ["--precision", "int8"]}
    audio, summaries = {}, {}
    for name, flags in runs.items():
        out = tmp_path / name
        argv = ["infer", "--manifest", str(manifest), "--out", str(out), "--model", str(job["model"]),
                "--no-progress", "--stream", *flags]
        assert main(argv) == 0
        audio[name], _ = sf.read(str(out / "s1.wav"), dtype="float32")
        summaries[name] = _summary(out)
    assert "precision fp32" in summaries["default"]["runtime"] and "precision int8" in summaries["int8"]["runtime"]
    assert (summaries["steps"]["flow_steps"], summaries["steps"]["final_chunk"]) == (2, "causal")
    # same seed, same fp32 LLM: the same tokens, so the same length; 2 Euler steps instead of 10: other samples
    assert audio["steps"].shape == audio["default"].shape and not np.allclose(audio["steps"], audio["default"])
