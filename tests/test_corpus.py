"""Synthetic corpus: template text, pinyin conversion, and a real (tiny) build with espeak-ng and festival."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import soundfile as sf
from system_deps import need_program, require

from vocalis.corpus.build import HELDOUT, MANIFEST, CorpusConfig, build, heldout_sentences, plan
from vocalis.corpus.text import LANGUAGES, sentences, zh_number
from vocalis.corpus.voices import festival_voices


def test_sentences_are_deterministic_varied_and_spoken_form():
    for lang in LANGUAGES:
        a, b = sentences(lang, 40, seed=3), sentences(lang, 40, seed=3)
        assert a == b and len(a) == 40
        assert len(set(a)) > 20, lang
        assert sentences(lang, 40, seed=4) != a
    en = sentences("en", 300, seed=0)
    assert not any(re.search(r"\d", s) for s in en), "numbers must be written as words"
    assert any(s.endswith("?") for s in en) and any(len(s.split()) > 15 for s in en)
    assert any(m in s for s in en for m in ("January", "March", "o'clock", "nineteen"))


def test_heldout_sentences_never_in_training_text():
    held = set(heldout_sentences(60))
    assert len(held) == 60
    assert not held & set(sentences("en", 2000, seed=0, exclude=held))


def test_zh_numbers_and_pinyin():
    assert [zh_number(n) for n in (0, 7, 10, 15, 20, 105, 1010, 2024, 10001, 100000)] == [
        "零", "七", "十", "十五", "二十", "一百零五", "一千零一十", "二千零二十四", "一万零一", "十万"]
    pytest.importorskip("pypinyin")
    from vocalis.corpus.voices import pinyin_text

    assert pinyin_text("你好吗？我很好。") == "ni3 hao3 ma5? wo3 hen3 hao3."


def test_plan_mixes_languages_and_speakers():
    planned = plan(CorpusConfig("unused", hours=0.25))
    langs = {p.voice.language for p in planned}
    assert langs == set(LANGUAGES)
    assert len({p.voice.speaker for p in planned}) >= 20
    assert len({p.utt for p in planned}) == len(planned)


def test_build_tiny_corpus_and_resume(tmp_path: Path):
    need_program("espeak-ng", "espeak-ng")
    need_program("text2wave", "festival")
    require(bool(festival_voices()), "a festival voice (apt-get install festvox-kallpc16k)")
    pytest.importorskip("pypinyin")
    from vocalis.train.manifest import read_manifest

    config = CorpusConfig(str(tmp_path), hours=0.012, workers=2, heldout=5,
                          espeak_speakers=(("en", 2), ("zh", 1), ("de", 1), ("fr", 1), ("es", 1)))
    summary = build(config)
    assert not summary["failed"]
    rows = [json.loads(line) for line in (tmp_path / MANIFEST).read_text(encoding="utf-8").splitlines()]
    assert len(rows) == summary["utterances"] >= 12
    assert {r["language"] for r in rows} == set(LANGUAGES)
    assert any(r["speaker"].startswith("fest-") for r in rows)
    for r in rows:
        info = sf.info(str(tmp_path / r["wav"]))
        assert info.duration > 0.3, r
    utts = read_manifest(tmp_path / MANIFEST)  # what `vocalis prepare` reads
    assert [u.text for u in utts] == [r["text"] for r in rows]
    assert len((tmp_path / HELDOUT).read_text(encoding="utf-8").splitlines()) == 5
    # resume: a deleted wav is made again, the others are left alone
    first = tmp_path / rows[0]["wav"]
    kept = tmp_path / rows[-1]["wav"]
    mtime = kept.stat().st_mtime_ns
    first.unlink()
    again = build(config)
    assert again["utterances"] == len(rows) and first.is_file() and kept.stat().st_mtime_ns == mtime
