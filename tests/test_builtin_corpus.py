"""The built-in model's phone corpus: deterministic text recipe, festival alignment -> 25 Hz phone-state labels."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import soundfile as sf
from system_deps import need_festival, need_text_sources

from vocalis.corpus.alignment import (
    Segment,
    frame_bounds,
    frame_labels,
    label_units,
    num_frames,
    read_segments,
    reconcile,
)
from vocalis.errors import InputError
from vocalis.frontend.phones import NUM_LABELS, label_id


def test_every_segment_keeps_a_frame_and_the_last_ends_the_utterance() -> None:
    # a 10 ms and a 15 ms phone between longer ones: nearest-frame rounding would give them no frame
    segs = [Segment(0.20, "pau"), Segment(0.21, "t"), Segment(0.225, "ax0"), Segment(0.40, "s"), Segment(0.52, "pau")]
    bounds = frame_bounds(segs, 14)
    assert bounds[-1] == 14 and all(b - a >= 1 for a, b in zip([0, *bounds], bounds))
    labels = frame_labels(segs, 14)
    assert len(labels) == 14 and label_units(labels) == [s.unit for s in segs]
    assert labels[:6] == [label_id("pau", False)] + [label_id("pau", True)] * 4 + [label_id("t", False)]
    # squeezed at the end: the backward pass moves earlier bounds left
    assert frame_bounds([Segment(0.04, "pau"), Segment(0.05, "t"), Segment(0.06, "s")], 3) == [1, 2, 3]
    with pytest.raises(ValueError):
        frame_bounds(segs, 4)


def test_segment_files_round_to_the_5ms_grid_and_stress_vowels(tmp_path: Path) -> None:
    path = tmp_path / "a.segs"
    path.write_text("0.16500001 pau 0\n0.255 hh 0\n0.28499998 ax 0\n0.43000001 ow 1\n", encoding="utf-8")
    assert read_segments(path) == [Segment(0.165, "pau"), Segment(0.255, "hh"), Segment(0.285, "ax0"),
                                   Segment(0.43, "ow1")]
    path.write_text("0.1 h# 0\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not in the built-in phone set"):
        read_segments(path)


def test_the_recipe_is_deterministic_grows_by_prefix_and_never_holds_out_text() -> None:
    need_text_sources()
    from vocalis.corpus.sentences import heldout_wordnet, recipe, wordnet_examples

    small, big = recipe(300), recipe(1500)
    assert small == recipe(300) and big[:300] == small and recipe(300, seed=1) != small
    held = heldout_wordnet()
    assert len(held) == 50 and not set(held) & set(big) and set(held) <= set(wordnet_examples())
    wordnet = set(wordnet_examples())
    share = sum(s in wordnet for s in big) / len(big)
    assert 0.6 < share < 0.8 and len(set(big)) > 0.95 * len(big)


@pytest.fixture(scope="module")
def spoken(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, Path]]:
    need_festival("slt")
    from vocalis.corpus.phone_corpus import speak_batch

    out = tmp_path_factory.mktemp("slt")
    texts = ["Hello from Vocalis, the well-known read book; isn't it Smith's?", "A solidly built house.",
             "It was a quiet evening at the station.", "How does she get around without a car?",
             "Please call me at four two seven, or write to me."]
    items = [(t, out / f"u{i}.wav") for i, t in enumerate(texts)]
    speak_batch("slt", items)
    return items


def test_festival_alignment_gives_one_label_per_40ms_and_the_phone_order(spoken: list[tuple[str, Path]]) -> None:
    from vocalis.corpus.phone_corpus import utterance_record

    agree = 0
    for text, wav in spoken:
        assert wav.is_file() and wav.with_suffix(".segs").is_file()
        segments = read_segments(wav.with_suffix(".segs"))
        assert all(abs(s.end / 0.005 - round(s.end / 0.005)) < 1e-6 for s in segments)
        rec = utterance_record(wav.stem, text, wav)
        seconds = sf.info(str(wav)).duration
        assert rec["frames"] == num_frames(seconds) == int(seconds * 25 + 1e-6) == len(rec["labels"])
        assert all(0 <= x < NUM_LABELS for x in rec["labels"])  # type: ignore[union-attr]
        assert label_units(rec["labels"]) == [s.unit for s in segments]  # every phone >= 1 frame, same order
        agree += not rec["mismatch"]
    assert agree == len(spoken)  # the frontend predicts exactly the phones festival spoke


def test_festival_speaks_the_same_text_the_same_way(spoken: list[tuple[str, Path]], tmp_path: Path) -> None:
    from vocalis.corpus.phone_corpus import speak_batch

    text, first = spoken[1]
    again = tmp_path / "again.wav"
    speak_batch("slt", [(text, again)])
    assert again.read_bytes() == first.read_bytes()
    assert again.with_suffix(".segs").read_text() == first.with_suffix(".segs").read_text()


def test_a_voices_reductions_are_spelled_in_the_texts_phones() -> None:
    # "the purr": ked says dh ax0 p er1 r where the text has dh ah1 p er1
    segs = [Segment(0.1, "pau"), Segment(0.15, "dh"), Segment(0.2, "ax0"), Segment(0.3, "p"), Segment(0.45, "er1"),
            Segment(0.5, "r"), Segment(0.6, "pau")]
    spelled = reconcile(["dh", "ah1", "p", "er1"], segs)
    assert spelled == [Segment(0.1, "pau"), Segment(0.15, "dh"), Segment(0.2, "ah1"), Segment(0.3, "p"),
                       Segment(0.5, "er1"), Segment(0.6, "pau")]
    # an r the text has stays an r; the same sequence is returned unchanged
    assert reconcile(["dh", "ax0", "p", "er1", "r"], segs) == segs
    # anything else is a different utterance: a vowel for a consonant, schwa for a consonant, a phone too many/few
    assert reconcile(["dh", "ah1", "b", "er1"], segs) is None
    assert reconcile(["dh", "t", "p", "er1"], segs) is None
    assert reconcile(["dh", "ah1", "p"], segs) is None
    assert reconcile(["dh", "ah1", "p", "er1", "s"], segs) is None


@pytest.mark.parametrize("voice", ["kal", "ked"])
def test_diphone_voices_label_the_texts_phones(voice: str, tmp_path: Path) -> None:
    need_festival(voice)
    from vocalis.corpus.phone_corpus import speak_batch, utterance_record
    from vocalis.frontend.phones import PUNCTUATION, WORD_BOUNDARY, g2p

    texts = ["It was a quiet evening at the station.", "No silver bullet can make the world safe from terrorism.",
             "Cosmetic fenders on cars."]
    items = [(t, tmp_path / f"u{i}.wav") for i, t in enumerate(texts)]
    speak_batch(voice, items)
    reduced = 0
    for text, wav in items:
        segments = read_segments(wav.with_suffix(".segs"))
        predicted = [s for s in g2p(text) if s != WORD_BOUNDARY and s not in PUNCTUATION]
        reduced += [s.unit for s in segments if s.unit != "pau"] != predicted
        rec = utterance_record(wav.stem, text, wav)
        assert not rec["mismatch"] and len(rec["labels"]) == rec["frames"] == num_frames(sf.info(str(wav)).duration)
        assert [u for u in label_units(rec["labels"]) if u != "pau"] == predicted
    assert reduced  # the voice did reduce: the test exercised the spelling


def test_a_corpus_of_several_voices_speaks_every_sentence_in_each(tmp_path: Path) -> None:
    need_festival("slt", "kal")
    need_text_sources()
    import json

    from vocalis.corpus.phone_corpus import PhoneCorpusConfig, build

    summary = build(PhoneCorpusConfig(str(tmp_path), utterances=3, voices=("slt", "kal")))
    manifest = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    labels = {r["utt"]: r for r in map(json.loads, (tmp_path / "labels.jsonl").read_text().splitlines())}
    assert summary["voices"] == {"cmu_us_slt_arctic_hts": 3, "kal_diphone": 3} and summary["utterances"] == 6
    assert [r["speaker"] for r in manifest] == ["fest-slt"] * 3 + ["fest-kal"] * 3
    by_voice = {v: [r for r in manifest if r["speaker"] == f"fest-{v}"] for v in ("slt", "kal")}
    assert [r["text"] for r in by_voice["slt"]] == [r["text"] for r in by_voice["kal"]]
    for slt, kal in zip(by_voice["slt"], by_voice["kal"]):  # the same text: the same ids, labels of each voice
        assert labels[slt["utt"]]["text_ids"] == labels[kal["utt"]]["text_ids"]
        assert [u for u in label_units(labels[slt["utt"]]["labels"]) if u != "pau"] == \
            [u for u in label_units(labels[kal["utt"]]["labels"]) if u != "pau"]
        assert (tmp_path / kal["wav"]).is_file() and kal["wav"].startswith("wavs/kal/")
    with pytest.raises(InputError, match="unknown voices"):
        build(PhoneCorpusConfig(str(tmp_path), utterances=1, voices=("slt", "rms")))


def test_a_festival_that_cannot_speak_fails_the_corpus_with_its_complaint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # the real festival pointed at a data folder without its init file and voices (what an unpacked install with
    # the wrong paths does): every batch fails, and the corpus says why instead of writing an empty manifest
    festival = shutil.which("festival")
    need_festival("slt")
    need_text_sources()
    from vocalis.corpus.phone_corpus import PhoneCorpusConfig, build

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "festival").write_text(f'#!/bin/sh\nexec {festival} --datadir {tmp_path / "nowhere"} "$@"\n')
    (bin_dir / "festival").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(InputError, match="none of the 2 utterances"):
        build(PhoneCorpusConfig(str(tmp_path / "corpus"), utterances=2, voices=("slt",)))
    assert not (tmp_path / "corpus" / "manifest.jsonl").exists()
    assert "2 of 2 unwritten; festival exited" in caplog.text and "init.scm" in caplog.text  # festival's own words
