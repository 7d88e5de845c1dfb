"""`vocalis prepare`: features, skipped files with reasons, resume, parallel workers, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from tiny_assets import make_tiny_model_dir, write_voice_like_wav

from vocalis.cli import main
from vocalis.train.f0 import yin_f0
from vocalis.train.features import FeatureConfig
from vocalis.train.prepare import PrepareConfig, prepare


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("prep") / "model")


def _corpus(d: Path) -> Path:
    wavs = d / "wavs"
    wavs.mkdir(parents=True)
    rows = []
    for i in range(5):
        p = write_voice_like_wav(wavs / f"good{i}.wav", seconds=1.0 + 0.25 * i, sr=(16000, 24000, 44100)[i % 3],
                                 channels=1 + i % 2, seed=i)
        rows.append({"wav": str(p), "text": f"good sentence {i}", "speaker": f"s{i % 2}", "language": "en"})
    (wavs / "garbage.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot audio at all")
    rows.append({"wav": str(wavs / "garbage.wav"), "text": "unreadable"})
    rows.append({"wav": str(wavs / "good0.wav"), "text": "   ", "utt": "blank"})
    write_voice_like_wav(wavs / "short.wav", seconds=0.2)
    rows.append({"wav": str(wavs / "short.wav"), "text": "too short"})
    write_voice_like_wav(wavs / "long.wav", seconds=3.5)
    rows.append({"wav": str(wavs / "long.wav"), "text": "too long"})
    sf.write(wavs / "silent.wav", np.zeros(24000, dtype=np.float32), 24000)
    rows.append({"wav": str(wavs / "silent.wav"), "text": "silent"})
    rows.append({"wav": str(wavs / "absent.wav"), "text": "missing file"})
    manifest = d / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return manifest


def test_prepare_skips_and_reports_broken_files_and_resumes(tmp_path: Path, model_dir: Path) -> None:
    manifest = _corpus(tmp_path)
    out = tmp_path / "out"
    config = PrepareConfig(str(manifest), str(out), str(model_dir), utts_per_shard=4,
                           features=FeatureConfig(max_seconds=3.0))
    summary = prepare(config)
    assert summary["utterances"] == 5 and summary["speakers"] == 2
    assert summary["hours"] == pytest.approx((1.0 + 1.25 + 1.5 + 1.75 + 2.0) / 3600, rel=1e-3)
    reasons = {Path(s["wav"]).name if s["utt"] != "blank" else "blank": s["reason"] for s in summary["skipped"]}
    assert reasons == {"garbage.wav": "unreadable", "blank": "empty text", "short.wav": "too short",
                       "long.wav": "too long", "silent.wav": "silent", "absent.wav": "missing"}
    assert json.loads((out / "summary.json").read_text())["skipped_by_reason"]["too long"] == 1

    shards = [Path(p) for p in (out / "data.list").read_text().split()]
    table = pq.read_table(shards[0])
    row = table.slice(0, 1).to_pylist()[0]
    frames = row["num_frames"]
    assert frames == 50 and len(row["mel"]) == frames * 80 and len(row["f0"]) == frames
    assert len(row["speech_token"]) == 25 and len(row["embedding"]) == 192 and row["text_token"]
    assert len(row["audio"]) == 2 * 24000  # int16 at 24 kHz
    voiced = np.asarray(row["f0"])[np.asarray(row["f0"]) > 0]
    assert voiced.size > 0.8 * frames and 100 < np.median(voiced) < 190  # the tone's F0 is 110..170 Hz

    # resume: nothing to redo; then a lost shard (no sidecar) is redone and only it
    before = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.parquet")}
    assert prepare(config)["utterances"] == 5
    (out / "shards" / "shard-000001.json").unlink()
    assert prepare(config)["utterances"] == 5
    after = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.parquet")}
    assert after["shard-000000.parquet"] == before["shard-000000.parquet"]
    assert after["shard-000001.parquet"] != before["shard-000001.parquet"]

    # another manifest into the same folder is refused
    other = tmp_path / "other.jsonl"
    other.write_text(manifest.read_text().splitlines()[0] + "\n")
    with pytest.raises(Exception, match="another manifest"):
        prepare(PrepareConfig(str(other), str(out), str(model_dir), utts_per_shard=4))


def test_prepare_cli_with_two_worker_processes_and_kaldi_dir(tmp_path: Path, model_dir: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    lines = []
    for i in range(4):
        write_voice_like_wav(kaldi / f"k{i}.wav", seconds=1.0, seed=i)
        lines.append((f"utt{i}", f"k{i}.wav", f"spoken words {i}", f"spk{i // 2}"))
    (kaldi / "wav.scp").write_text("".join(f"{u} {kaldi / w}\n" for u, w, _, _ in lines))
    (kaldi / "text").write_text("".join(f"{u} {t}\n" for u, _, t, _ in lines))
    (kaldi / "utt2spk").write_text("".join(f"{u} {s}\n" for u, _, _, s in lines))
    out = tmp_path / "out"
    rc = main(["prepare", str(kaldi), str(out), "--model", str(model_dir), "--utts-per-shard", "2", "--workers", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "prepared 4 utterances" in printed and "2 speakers" in printed
    assert len((out / "data.list").read_text().split()) == 2
    spk = json.loads((out / "spk2embedding.json").read_text())
    assert sorted(spk) == ["spk0", "spk1"] and len(spk["spk0"]) == 192

    assert main(["prepare", str(tmp_path / "nope.jsonl"), str(out), "--model", str(model_dir)]) == 2
    assert "manifest not found" in capsys.readouterr().err


def test_yin_f0_tracks_a_gliding_tone() -> None:
    sr = 24000
    t = np.arange(2 * sr) / sr
    f0 = 120 + 60 * t  # 120 -> 240 Hz
    wav = 0.3 * sum(np.sin(k * 2 * np.pi * np.cumsum(f0) / sr) / k for k in range(1, 4))
    wav[: sr // 4] = 0  # a silent start is unvoiced
    est = yin_f0(wav.astype(np.float32), sr)
    assert est.shape == (100,)
    centres = (np.arange(100) + 0.5) * 480 / sr
    ref = 120 + 60 * centres
    assert (est[:10] == 0).all()
    voiced = est > 0
    assert voiced[15:].all()
    assert np.max(np.abs(est[15:] - ref[15:]) / ref[15:]) < 0.02
