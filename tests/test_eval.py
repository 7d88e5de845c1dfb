"""`vocalis eval`: text normalisation, edit distance, the ASR plug-in hook, and real scoring of real speech.

The speech cases are synthesised with two Debian voices (festival's kal_diphone as the "teacher", espeak-ng as a
different speaker); they need espeak-ng, festival, pocketsphinx and resemblyzer (installed by .ci/run) and are
skipped with the reason outside CI when one is missing.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from system_deps import need_program, require
from tiny_assets import write_frontend_onnx, write_voice_like_wav

from vocalis.cli import main
from vocalis.errors import InputError
from vocalis.eval.asr import load_transcriber
from vocalis.eval.runner import EvalOptions, evaluate
from vocalis.eval.text_norm import normalize, tokens
from vocalis.eval.wer import EditCounts, cer, edit_counts, wer

SENTENCES = [
    "The birch canoe slid on the smooth planks.",  # the prompt
    "Glue the sheet to the dark blue background.",
    "These days a chicken leg is a rare dish.",
]


# ---- units ----------------------------------------------------------------------------------------------


def test_normalize_spells_numbers_and_drops_punctuation() -> None:
    assert normalize("Hello, World! It's 42.") == "hello world it's forty two"
    assert normalize("In 1999 I paid $5 for 10% of 1,250,000 things") == (
        "in nineteen ninety nine i paid five dollars for ten percent of one million two hundred fifty thousand things")
    assert normalize("the 21st time, 3.14, 2005, twenty-one o'clock") == (
        "the twenty first time three point one four two thousand five twenty one o'clock")
    assert normalize("Call 007 now…") == "call zero zero seven now"
    assert normalize("你好，世界！ABC 123") == "你好 世界 abc 123"  # CJK: digits left alone
    assert tokens(normalize("你好，世界 ok")) == ["你", "好", "世", "界", "ok"]


def test_edit_counts_and_rates() -> None:
    assert edit_counts(["a", "b", "c", "d"], ["a", "x", "c", "d", "e"]) == EditCounts(1, 0, 1, 4)
    assert edit_counts(["a", "b", "c"], ["b", "c"]) == EditCounts(0, 1, 0, 3)
    assert edit_counts([], []).rate == 0.0 and edit_counts([], ["x"]).rate == 1.0
    assert wer("The cat sat.", "the cat sat") == 0.0
    assert wer("The cat sat on 2 mats.", "the cat sat on two hats") == pytest.approx(1 / 6)
    assert cer("abcd", "abed") == pytest.approx(0.25)
    assert wer("你好世界", "你好世") == pytest.approx(0.25)  # per character for CJK


def test_asr_spec_errors_are_input_errors() -> None:
    assert load_transcriber("none") is None
    for spec, message in (("whisper", "use 'pocketsphinx'"), ("no_such_module_xyz:f", "cannot import"),
                          ("os:no_such_factory", "has no attribute")):
        with pytest.raises(InputError, match=message):
            load_transcriber(spec)


def test_plugged_in_transcriber_scores_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--asr module:factory`: the factory gets the language; WER, missing files, RTF and the files written."""
    (tmp_path / "my_asr.py").write_text(
        "def factory(language):\n"
        "    assert language == 'en'\n"
        "    return lambda wav, sample_rate: 'the cat sat on two hats' if wav.size > 16000 else 'nothing'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    audio = tmp_path / "audio"
    audio.mkdir()
    write_voice_like_wav(audio / "u1.wav", seconds=1.5, sr=24000)
    write_voice_like_wav(audio / "u2.wav", seconds=0.5, sr=22050, channels=2)
    (audio / "u3.wav").write_bytes(b"not audio")
    (audio / "summary.json").write_text(json.dumps({"rtf": 0.5, "throughput_rtf": 0.25,
                                                    "items": {"u1": {"rtf": 0.4}, "u2": {"rtf": 0.6}}}))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(x) for x in [
        {"id": "u1", "text": "The cat sat on 2 mats."}, {"id": "u2", "text": "Nothing"},
        {"id": "u3", "text": "Unreadable."}, {"id": "u4", "text": "Missing."}]) + "\nbroken line\n")
    report = evaluate(EvalOptions(manifest, audio, asr="my_asr:factory", language="en", similarity=False))
    assert report["counts"] == {"items": 4, "scored": 2, "missing": 1, "unreadable": 1}
    assert report["wer"] == pytest.approx(1 / 7)  # 1 substitution over 6 + 1 reference words
    u1 = report["utterances"][0]
    assert u1["wer"] == pytest.approx(1 / 6) and u1["hypothesis"] == "the cat sat on two hats"
    assert u1["duration"] == pytest.approx(1.5, abs=1e-3) and u1["rtf"] == 0.4
    assert report["rtf"]["run"] == 0.5 and report["rtf"]["per_utterance"]["mean"] == pytest.approx(0.5)
    assert report["duration"]["total"] == pytest.approx(2.0, abs=1e-3)
    assert [p["id"] for p in report["problems"]] == ["u3", "u4"] and len(report["invalid_lines"]) == 1
    out = audio / "eval"
    assert json.loads((out / "report.json").read_text())["wer"] == report["wer"]
    markdown = (out / "report.md").read_text()
    assert "| WER (my_asr:factory) | 14.29 % |" in markdown and "u4`: missing" in markdown
    assert (out / "wer_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- real speech ----------------------------------------------------------------------------------------


def _resemblyzer_usable() -> bool:
    try:
        import resemblyzer  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Prompt + two sentences by festival (the teacher), the same two by espeak-ng (another speaker)."""
    need_program("text2wave", "festival")
    need_program("espeak-ng", "espeak-ng")
    require(importlib.util.find_spec("pocketsphinx") is not None, "pocketsphinx")
    require(_resemblyzer_usable(), "resemblyzer (pip install --no-deps resemblyzer webrtcvad-wheels)")
    root = tmp_path_factory.mktemp("speech")
    voices = root / "voices"
    voices.mkdir()
    for i, sentence in enumerate(SENTENCES):
        subprocess.run(["text2wave", "-o", str(voices / f"fest{i}.wav")], input=sentence, text=True, check=True)
        if i:
            subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(voices / f"esp{i}.wav"), sentence], check=True)
    # seed-tts-eval lines with the 5th field: the teacher's recording of the target text.
    lines = [f"u{i}|{SENTENCES[0]}|voices/fest0.wav|{SENTENCES[i]}|voices/fest{i}.wav" for i in (1, 2)]
    (root / "meta.lst").write_text("\n".join(lines) + "\n")
    folders = {"teacher": {1: "fest1", 2: "fest2"}, "other_speaker": {1: "esp1", 2: "esp2"},
               "wrong_text": {1: "fest2", 2: "fest1"}}
    for name, files in folders.items():
        (root / name).mkdir()
        for i, stem in files.items():
            shutil.copy(voices / f"{stem}.wav", root / name / f"u{i}.wav")
    write_frontend_onnx(root)  # a (random, tiny) campplus.onnx: exercises the CAM++ path
    return {"root": root, "manifest": root / "meta.lst"}


@pytest.fixture(scope="module")
def teacher_report(speech: dict[str, Path]) -> dict:
    """The teacher's own recordings, scored through the command line with --baseline."""
    out = speech["root"] / "teacher_report"
    assert main(["eval", "--manifest", str(speech["manifest"]), "--audio", str(speech["root"] / "teacher"),
                 "--baseline", "--out", str(out), "--language", "en"]) == 0
    return json.loads((out / "report.json").read_text())


def test_teacher_audio_scores_the_teacher_wer(speech: dict[str, Path], teacher_report: dict) -> None:
    baseline = teacher_report["baseline"]
    assert teacher_report["counts"]["scored"] == 2
    assert teacher_report["wer"] == baseline["wer"] and teacher_report["cer"] == baseline["cer"]
    for u in teacher_report["utterances"]:
        assert u["hypothesis"] == u["baseline"]["hypothesis"]
    assert teacher_report["wer"] < 0.5  # festival is intelligible to pocketsphinx
    wrong = evaluate(EvalOptions(speech["manifest"], speech["root"] / "wrong_text", similarity=False, plots=False))
    assert wrong["wer"] > teacher_report["wer"] + 0.3


def test_same_speaker_is_more_similar_than_another(speech: dict[str, Path], teacher_report: dict) -> None:
    other = evaluate(EvalOptions(speech["manifest"], speech["root"] / "other_speaker", asr="none",
                                 model=str(speech["root"]), plots=True))
    same = teacher_report["similarity"]["resemblyzer"]
    different = other["similarity"]["resemblyzer"]
    assert same["n"] == different["n"] == 2
    assert same["min"] > different["max"] + 0.1
    assert other["similarity"]["campplus"]["n"] == 2 and other["wer"] is None
    assert (speech["root"] / "other_speaker" / "eval" / "similarity.png").is_file()
    durations = [sf.info(str(speech["root"] / "other_speaker" / f"u{i}.wav")).duration for i in (1, 2)]
    assert other["duration"]["mean"] == pytest.approx(np.mean(durations), abs=1e-3)


def test_pocketsphinx_transcript_does_not_depend_on_what_came_before(speech: dict[str, Path]) -> None:
    """One transcriber over many files (as `vocalis eval` and recipes/builtin/measure_builtin.py use it): a clip's transcript
    is the same after loud noise and another speaker as when heard first."""
    from vocalis.eval.asr import PocketsphinxTranscriber

    wav, sr = sf.read(str(speech["root"] / "teacher" / "u1.wav"), dtype="float32")
    asr = PocketsphinxTranscriber()
    first = asr(wav, sr)
    noise = np.random.default_rng(0).uniform(-0.9, 0.9, 3 * 16000).astype(np.float32)
    asr(noise, 16000)
    other, other_sr = sf.read(str(speech["root"] / "other_speaker" / "u2.wav"), dtype="float32")
    asr(other, other_sr)
    assert asr(wav, sr) == first == PocketsphinxTranscriber()(wav, sr)
