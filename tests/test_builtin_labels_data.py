"""Phone-label shards for the built-in model's flow and LLM (`vocalis.train.phone_labels`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vocalis.errors import InputError
from vocalis.frontend.phones import NUM_LABELS, text_ids
from vocalis.train.data import DataConfig, ShardDataset, resolve_shards
from vocalis.train.phone_labels import attach_labels
from vocalis.train.prepare import write_shard


def _row(utt: str, frames: int) -> dict[str, object]:
    return {"utt": utt, "wav": f"{utt}.wav", "text": "A quiet room.", "speaker": "fest-slt", "language": "en",
            "duration": frames / 50, "text_token": [5, 6, 7], "speech_token": [], "embedding": [0.0] * 192,
            "num_frames": frames, "mel": np.zeros(frames * 80, np.float32).tolist(),
            "f0": [0.0] * frames, "audio": b"\0\0" * 480 * frames}


def _write_labels(path: Path, labels: dict[str, list[int]]) -> None:
    """The corpus's labels.jsonl for `labels` (utt -> 25 Hz labels), every utterance reading "A quiet room."."""
    path.write_text("".join(json.dumps({"utt": u, "frames": len(v), "text_ids": text_ids("A quiet room."),
                                        "labels": v}) + "\n" for u, v in labels.items()))


def test_labels_replace_the_ids_and_reach_the_flow_batches(tmp_path: Path) -> None:
    prep = tmp_path / "prep"
    (prep / "shards").mkdir(parents=True)
    write_shard([_row("a", 61), _row("b", 40), _row("c", 50)], prep / "shards" / "shard-000000.parquet")
    (prep / "data.list").write_text(str(prep / "shards" / "shard-000000.parquet") + "\n")
    rng = np.random.default_rng(0)
    labels = {"a": rng.integers(0, NUM_LABELS, 30).tolist(), "b": rng.integers(0, NUM_LABELS, 25).tolist()}
    _write_labels(tmp_path / "labels.jsonl", labels)
    summary = attach_labels(prep, tmp_path / "labels.jsonl", tmp_path / "out")
    # b: 25 labels need 50 mel frames, it has 40; c: no labels
    assert summary == {"utterances": 1, "dropped": 2, "shards": 1}
    ds = ShardDataset(resolve_shards([str(tmp_path / "out")]), DataConfig(min_frames=1, shuffle_buffer=0,
                                                                         sort_buffer=0), "flow")
    batch = next(iter(ds))
    assert batch.utts == ("a",) and batch.speech_token[0].tolist() == labels["a"]
    assert batch.mel.shape == (1, 60, 80)  # 2 mel frames per 25 Hz label
    llm = next(iter(ShardDataset(resolve_shards([str(tmp_path / "out")]), DataConfig(min_frames=1), "llm")))
    assert llm.text_token[0].tolist() == text_ids("A quiet room.")
    assert batch.embedding.shape == (1, 192)  # as prepared

    # the flow's x-vector size: zeros (no speaker encoder) are resized, real embeddings are never
    summary = attach_labels(prep, tmp_path / "labels.jsonl", tmp_path / "out256", embedding_dim=256)
    assert summary["embedding_dim"] == 256
    batch = next(iter(ShardDataset(resolve_shards([str(tmp_path / "out256")]), DataConfig(min_frames=1), "flow")))
    assert batch.embedding.shape == (1, 256) and not batch.embedding.any()
    real = _row("a", 61) | {"embedding": [0.5] * 192}
    write_shard([real], prep / "shards" / "shard-000000.parquet")
    with pytest.raises(InputError, match="256-d"):
        attach_labels(prep, tmp_path / "labels.jsonl", tmp_path / "bad", embedding_dim=256)


def test_flow_mel_shards_pair_the_flows_mel_with_the_teachers_audio(tmp_path: Path) -> None:
    import torch

    from vocalis.config import PRESETS
    from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
    from vocalis.train.flow_mels import flow_mel_shards, labels_to_mel

    prep = tmp_path / "prep"
    (prep / "shards").mkdir(parents=True)
    rng = np.random.default_rng(1)
    audio = rng.integers(-3000, 3000, 480 * 61, dtype=np.int16)
    write_shard([_row("a", 61) | {"audio": audio.astype("<i2").tobytes(), "f0": np.arange(61.0).tolist()},
                 _row("b", 40), _row("c", 61) | {"audio": b""}], prep / "shards" / "shard-000000.parquet")
    (prep / "data.list").write_text(str(prep / "shards" / "shard-000000.parquet") + "\n")
    labels = {u: rng.integers(0, NUM_LABELS, 30).tolist() for u in ("a", "b", "c")}
    _write_labels(tmp_path / "labels.jsonl", labels)
    attach_labels(prep, tmp_path / "labels.jsonl", tmp_path / "labelled", keep_audio=True)
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec(PRESETS["tiny-phones"].flow).eval()
    # b: too short for its labels (dropped by attach_labels); c: no audio to learn from
    assert flow_mel_shards(tmp_path / "labelled", flow, tmp_path / "out") == {"utterances": 1, "dropped": 1,
                                                                              "shards": 1}
    ds = ShardDataset(resolve_shards([str(tmp_path / "out")]), DataConfig(min_frames=1, shuffle_buffer=0,
                                                                         sort_buffer=0, segment_frames=80), "hift")
    batch = next(iter(ds))
    mel = labels_to_mel(flow, labels["a"])  # (60, 80): 2 frames a label, the 61st teacher frame cut
    assert mel.shape == (60, 80) and mel.abs().sum() > 0
    torch.testing.assert_close(batch.mel[0, :60], mel)
    assert batch.f0[0, :60].tolist() == list(range(60))
    np.testing.assert_array_equal(batch.audio[0, : 60 * 480].numpy(), audio[: 60 * 480] / np.float32(32767.0))
    assert not batch.audio[0, 60 * 480:].any()  # padded to the segment, not the teacher's 61st frame


def test_flow_mels_continue_each_speakers_prompt_and_take_n_shards_of_each(tmp_path: Path) -> None:
    """A multi-voice flow's tuning mels: every utterance continues its own speaker's prompt (a speaker without one
    stays unprompted), and `shards_per_speaker` keeps the first N shards of each speaker."""
    import torch

    from vocalis.config import PRESETS
    from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
    from vocalis.train.flow_mels import flow_mel_shards, labels_to_mel

    prep = tmp_path / "prep"
    (prep / "shards").mkdir(parents=True)
    rng = np.random.default_rng(2)
    utts = {"s1": "fest-slt", "s2": "fest-slt", "k1": "fest-kal"}
    for n, (utt, speaker) in enumerate(utts.items()):
        write_shard([_row(utt, 40) | {"speaker": speaker}], prep / "shards" / f"shard-{n:06d}.parquet")
    (prep / "data.list").write_text("".join(f"{prep / 'shards' / f'shard-{n:06d}.parquet'}\n" for n in range(3)))
    labels = {u: rng.integers(0, NUM_LABELS, 20).tolist() for u in utts}
    _write_labels(tmp_path / "labels.jsonl", labels)
    attach_labels(prep, tmp_path / "labels.jsonl", tmp_path / "labelled", keep_audio=True)
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec(PRESETS["tiny-phones"].flow).eval()
    prompt = (rng.integers(0, NUM_LABELS, 10).tolist(), torch.randn(20, 80))
    summary = flow_mel_shards(tmp_path / "labelled", flow, tmp_path / "out", {"fest-kal": prompt},
                              shards_per_speaker=1)
    assert summary == {"utterances": 2, "dropped": 0, "shards": 2}  # s2: slt's second shard
    import pyarrow.parquet as pq

    mels = {r["utt"]: torch.tensor(r["mel"]).reshape(-1, 80) for shard in resolve_shards([str(tmp_path / "out")])
            for r in pq.read_table(shard, columns=["utt", "mel"]).to_pylist()}
    assert set(mels) == {"s1", "k1"}
    torch.testing.assert_close(mels["s1"], labels_to_mel(flow, labels["s1"]))
    prompted = labels_to_mel(flow, labels["k1"], prompt)
    assert prompted.shape == (40, 80) and not torch.allclose(prompted, labels_to_mel(flow, labels["k1"]))
    torch.testing.assert_close(mels["k1"], prompted)
