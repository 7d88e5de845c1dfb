"""The phone model's prompt tokenizer (`FrameLabeller`, `vocalis train labeller`): on clips whose 25 Hz frames are
tones of three pitches, labelled by pitch, the loss goes down and the labels it writes for a clip follow its tones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soxr

from vocalis.config import PHONE_LABELS, SAMPLE_RATE
from vocalis.frontend.audio import whisper_log_mel
from vocalis.models.speech_tokenizer.labeller import FrameLabeller, labeller_config
from vocalis.train.checkpointing import checkpoint_path, load_checkpoint
from vocalis.train.config import load_config
from vocalis.train.prepare import write_shard
from vocalis.train.run import train

FRAME = SAMPLE_RATE // 25  # samples per 25 Hz label frame
PITCHES = {3: 220.0, 40: 660.0, 90: 1760.0}  # label -> tone


def _clip(labels: list[int]) -> np.ndarray:
    t = np.arange(FRAME) / SAMPLE_RATE
    return np.concatenate([0.4 * np.sin(2 * np.pi * PITCHES[lab] * t) for lab in labels]).astype(np.float32)


def _labels(rng: np.random.Generator, n: int) -> list[int]:
    runs = []
    while len(runs) < n:  # runs of 2-5 frames, as phones last
        runs += [int(rng.choice(list(PITCHES)))] * int(rng.integers(2, 6))
    return runs[:n]


def _shards(directory: Path, count: int, audio: bool = True) -> Path:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        labels = _labels(rng, int(rng.integers(30, 50)))
        pcm = (_clip(labels) * 32767).astype("<i2").tobytes() if audio else b""
        frames = 2 * len(labels)
        rows.append({"utt": f"u{i}", "wav": f"u{i}.wav", "text": "a", "speaker": "s", "language": "en",
                     "duration": frames / 50, "text_token": [5, 6, 7], "speech_token": labels,
                     "embedding": [0.0] * 192, "num_frames": frames, "mel": np.zeros(frames * 80, np.float32).tolist(),
                     "f0": [0.0] * frames, "audio": pcm})
    (directory / "shards").mkdir(parents=True)
    write_shard(rows, directory / "shards" / "shard-000000.parquet")
    (directory / "data.list").write_text(str(directory / "shards" / "shard-000000.parquet") + "\n")
    return directory


def test_labeller_learns_frame_labels(tmp_path: Path) -> None:
    data = _shards(tmp_path / "data", 12)
    out = tmp_path / "run"
    cfg = load_config(None, [f"data.train=[{data}]", f"trainer.out_dir={out}", "trainer.max_epochs=0",
                             "trainer.max_steps=30", "trainer.log_every=1", "trainer.num_threads=1",
                             "scheduler.name=constant", "scheduler.warmup_steps=0", "optim.lr=3e-3",
                             "data.max_frames_in_batch=400", "labeller.preset=tiny"], task="labeller")
    train(cfg)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log]
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses

    model = FrameLabeller(labeller_config("tiny", PHONE_LABELS))
    model.load_state_dict(load_checkpoint(checkpoint_path(out, 30))["models"]["labeller"])
    truth = _labels(np.random.default_rng(7), 40)  # a clip it never saw
    wav16 = soxr.resample(_clip(truth), SAMPLE_RATE, 16000)
    (got,) = model.tokenize_mels([whisper_log_mel(wav16)])
    n = min(len(got), len(truth))
    assert n >= len(truth) - 1
    inner = [i for i in range(1, n - 1) if truth[i - 1] == truth[i] == truth[i + 1]]  # frames away from a tone change
    assert np.mean([got[i] == truth[i] for i in inner]) >= 0.9


def test_labeller_data_without_audio_is_an_input_error(tmp_path: Path) -> None:
    from vocalis.errors import InputError
    from vocalis.train.data import DataConfig, ShardDataset, resolve_shards

    data = _shards(tmp_path / "data", 2, audio=False)
    with pytest.raises(InputError, match="no audio"):
        next(iter(ShardDataset(resolve_shards([str(data)]), DataConfig(), "labeller")))
