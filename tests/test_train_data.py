"""Dataset pipeline, schedules and configuration of the trainer (no training)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from train_corpus import prepared_corpus

from vocalis.errors import InputError
from vocalis.train.config import load_config
from vocalis.train.data import DataConfig, ShardDataset, make_loader, resolve_shards
from vocalis.train.schedulers import SchedulerConfig, lr_factor


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return resolve_shards([str(prepared_corpus(tmp_path_factory.mktemp("data"), n=12))])


def _utts(ds: ShardDataset) -> list[tuple[str, ...]]:
    return [b.utts for b in make_loader(ds)]


def test_batches_respect_the_frame_budget_and_are_padded(shards: list[Path]) -> None:
    config = DataConfig(max_frames_in_batch=250, shuffle_buffer=5, sort_buffer=4)
    for task in ("llm", "flow"):
        batches = list(ShardDataset(shards, config, task))
        assert sum(b.size for b in batches) == 12
        for b in batches:
            if task == "llm":
                lengths = b.text_token_len + b.speech_token_len + 2
                assert int(lengths.max()) * b.size <= 250 or b.size == 1
                assert b.text_token.shape == (b.size, int(b.text_token_len.max()))
                assert b.num_frames == int(lengths.sum())
            else:
                assert b.mel.shape == (b.size, 2 * b.speech_token.shape[1], 80)  # 2 mel frames per token
                assert torch.equal(b.mel_len, 2 * b.speech_token_len)
                assert b.mel.shape[1] * b.size <= 250 or b.size == 1
                assert b.embedding.shape == (b.size, 192)
                row = int(b.mel_len.argmin())
                assert (b.mel[row, int(b.mel_len[row]):] == 0).all()


def test_order_is_a_function_of_seed_epoch_and_rank(shards: list[Path]) -> None:
    config = DataConfig(max_frames_in_batch=200, shuffle_buffer=6, sort_buffer=0, seed=3)
    ds = ShardDataset(shards, config, "llm")
    first = _utts(ds)
    assert _utts(ds) == first  # same epoch: same batches
    ds.set_epoch(1)
    assert _utts(ds) != first
    ds.set_epoch(0)
    assert _utts(ds) == first
    other_seed = ShardDataset(shards, DataConfig(max_frames_in_batch=200, shuffle_buffer=6, sort_buffer=0, seed=4), "llm")
    assert _utts(other_seed) != first


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_and_workers_read_disjoint_parts(shards: list[Path], num_workers: int) -> None:
    config = DataConfig(max_frames_in_batch=200, shuffle_buffer=3, num_workers=num_workers)
    seen = []
    for rank in range(2):
        seen.append([u for b in _utts(ShardDataset(shards, config, "llm", rank, 2)) for u in b])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(f"u{i}" for i in range(12))
    # fewer shards than readers: every n-th row instead of whole shards, still disjoint and complete
    many = [u for r in range(4) for b in _utts(ShardDataset(shards[:1], config, "llm", r, 4)) for u in b]
    assert sorted(many) == sorted(f"u{i}" for i in range(4)) and len(set(many)) == len(many)


def test_filters_and_hift_segments(shards: list[Path]) -> None:
    only_short = DataConfig(max_frames=55, max_frames_in_batch=1000)  # 1.0 s clips are 50 frames, the rest >= 60
    kept = [u for b in ShardDataset(shards, only_short, "llm") for u in b.utts]
    assert kept and all(int(u[1:]) % 4 == 0 for u in kept)
    assert not list(ShardDataset(shards, DataConfig(max_text_tokens=2), "llm"))
    seg = DataConfig(segment_frames=20, max_frames_in_batch=100)
    b = next(iter(ShardDataset(shards, seg, "hift")))
    assert b.mel.shape == (b.size, 20, 80) and b.f0.shape == (b.size, 20) and b.audio.shape == (b.size, 20 * 480)


def test_schedules() -> None:
    warm = SchedulerConfig("warmup", warmup_steps=4)
    assert [round(lr_factor(warm, s), 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, round(math.sqrt(4 / 5), 4),
                                                                 round(math.sqrt(4 / 6), 4)]
    noam = SchedulerConfig("noam_hold", warmup_steps=2, hold_steps=3)
    factors = [lr_factor(noam, s) for s in range(8)]
    assert factors[:5] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert factors[5] == pytest.approx(math.sqrt(2 / 2)) and factors[7] == pytest.approx(math.sqrt(2 / 4))
    assert all(lr_factor(SchedulerConfig("constant", warmup_steps=0), s) == 1.0 for s in range(5))
    with pytest.raises(ValueError, match="unknown scheduler"):
        SchedulerConfig("cosine")


def test_config_files_and_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[trainer]\nmax_steps = 7\nprecision = "bf16"\n[optim]\nlr = 2e-4\n[data]\ntrain = ["a", "b"]\n')
    c = load_config(toml, ["optim.lr=1e-4", "data.max_frames_in_batch=500"], task="flow")
    assert (c.task, c.trainer.max_steps, c.trainer.precision, c.optim.lr) == ("flow", 7, "bf16", 1e-4)
    assert c.data.train == ("a", "b") and c.data.max_frames_in_batch == 500
    yaml = tmp_path / "c.yaml"
    yaml.write_text("trainer:\n  accum_grad: 4\nscheduler:\n  name: noam_hold\n  hold_steps: 10\n")
    assert load_config(yaml).scheduler.hold_steps == 10
    with pytest.raises(InputError, match=r"unknown keys \['max_step'\]"):
        load_config(None, ["trainer.max_step=3"])
    with pytest.raises(InputError, match="precision must be one of"):
        load_config(None, ["trainer.precision=fp8"])
    with pytest.raises(InputError, match="expected int"):
        load_config(None, ["trainer.accum_grad=two"])


def test_train_cli_reports_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vocalis.cli import main

    assert main(["train", "llm", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vocalis: error: training data not found")
    assert main(["train", "flow", "--set", "trainer.bogus=1"]) == 2
    assert "unknown keys ['bogus']" in capsys.readouterr().err


def test_llm_pairs_join_two_utterances_of_one_speaker(shards: list[Path]) -> None:
    """data.pair_prob: an LLM example may be two utterances of one speaker back to back (texts, then speech ids), as
    a zero-shot prompt precedes the text at inference; every utterance is still read once; 0 changes nothing."""
    base = DataConfig(shuffle_buffer=0, sort_buffer=0, min_frames=1)
    alone = {e.utt: e for e in ShardDataset(shards, base, "llm").examples()}
    paired = list(ShardDataset(shards, DataConfig(shuffle_buffer=0, sort_buffer=0, min_frames=1, pair_prob=1.0),
                               "llm").examples())
    joined = [e for e in paired if "+" in e.utt]
    assert joined and sorted(u for e in paired for u in e.utt.split("+")) == sorted(alone)
    for e in joined:
        a, b = (alone[u] for u in e.utt.split("+"))
        assert a.speaker == b.speaker == e.speaker
        assert e.text_token.tolist() == a.text_token.tolist() + b.text_token.tolist()
        assert e.speech_token.tolist() == a.speech_token.tolist() + b.speech_token.tolist()
        assert e.length == len(e.text_token) + len(e.speech_token) + 2
    zero = [e.utt for e in ShardDataset(shards, DataConfig(shuffle_buffer=0, sort_buffer=0, min_frames=1,
                                                           pair_prob=0.0), "llm").examples()]
    assert zero == list(alone)
    with pytest.raises(ValueError, match="pair_prob"):
        DataConfig(pair_prob=1.5)
