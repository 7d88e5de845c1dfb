"""The command line: bad input gives one clear line, exit code 2, and no output file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tiny_assets import make_tiny_model_dir, write_voice_like_wav
from vocalis.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny")


def _fail(capsys: pytest.CaptureFixture[str], argv: list[str], message: str, out: Path) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vocalis: error: "), err
    assert message.lower() in err[-1].lower(), err[-1]
    assert "Traceback" not in "\n".join(err)
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*"))  # no temp file left behind


def test_speak_writes_a_valid_wav(model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    out = tmp_path / "ok.wav"
    assert main(["speak", "Hi there.", "-o", str(out), "--model", str(model_dir), "--seed", "1", "--stream"]) == 0
    wav, sr = sf.read(out)
    assert sr == 24000 and len(wav) > 0 and np.isfinite(wav).all()
    assert "first chunk after" in caplog.text


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "text is empty"), ("  \n ", "text is empty"), ("?!...", "only punctuation"), ("x" * 20001, "limit")],
)
def test_bad_text(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    out = tmp_path / "o.wav"
    _fail(capsys, ["speak", text, "-o", str(out), "--model", str(model_dir)], message, out)


def _prompt_cases(tmp: Path) -> list[tuple[Path, str]]:
    text_file = tmp / "notes.wav"
    text_file.write_text("this is not audio")
    truncated = write_voice_like_wav(tmp / "trunc.wav")
    truncated.write_bytes(truncated.read_bytes()[:30])
    short = write_voice_like_wav(tmp / "short.wav", seconds=0.1)
    silent = tmp / "silent.wav"
    sf.write(silent, np.zeros(24000, dtype=np.float32), 24000)
    long = write_voice_like_wav(tmp / "long.wav", seconds=31.0, sr=16000)
    return [
        (tmp / "missing.wav", "not found"),
        (text_file, "cannot read"),
        (truncated, "cannot read"),
        (short, "too short"),
        (silent, "silent"),
        (long, "too long"),
    ]


def test_bad_prompt_audio(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for prompt, message in _prompt_cases(tmp_path):
        out = tmp_path / "o.wav"
        argv = ["speak", "Hi.", "-o", str(out), "--model", str(model_dir), "--prompt-wav", str(prompt),
                "--prompt-text", "Hello."]
        _fail(capsys, argv, message, out)


def test_stereo_odd_rate_prompt_works(model_dir: Path, tmp_path: Path) -> None:
    prompt = write_voice_like_wav(tmp_path / "stereo.wav", seconds=1.5, sr=44100, channels=2)
    out = tmp_path / "o.flac"
    argv = ["speak", "Hi.", "-o", str(out), "--model", str(model_dir), "--prompt-wav", str(prompt), "--seed", "2"]
    assert main(argv) == 0
    assert sf.info(out).samplerate == 24000


def test_bad_options_and_model_dirs(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.wav"
    base = ["speak", "Hi.", "-o", str(out), "--model", str(model_dir)]
    _fail(capsys, [*base, "--speed", "0.1"], "speed must be", out)
    _fail(capsys, [*base, "--voice", "nobody"], "unknown voice", out)
    _fail(capsys, [*base, "--prompt-text", "x"], "--prompt-text needs --prompt-wav", out)
    _fail(capsys, ["speak", "Hi.", "-o", str(tmp_path / "o.mp9"), "--model", str(model_dir)], "unsupported output",
          tmp_path / "o.mp9")
    _fail(capsys, ["speak", "Hi.", "-o", str(tmp_path / "nodir" / "o.wav")], "output folder does not exist",
          tmp_path / "nodir" / "o.wav")
    _fail(capsys, ["speak", "Hi.", "-o", str(out), "--model", str(tmp_path / "none")], "not found", out)
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in model_dir.iterdir():
        if p.name != "flow.safetensors":
            (broken / p.name).symlink_to(p)
    _fail(capsys, ["speak", "Hi.", "-o", str(out), "--model", str(broken)], "missing checkpoint file", out)


def test_info_and_subprocess_exit_code(model_dir: Path, tmp_path: Path) -> None:
    info = subprocess.run([sys.executable, "-m", "vocalis", "info", str(model_dir)], capture_output=True, text=True)
    assert info.returncode == 0 and "speech tokenizer: yes" in info.stdout
    out = tmp_path / "o.wav"
    bad = subprocess.run([sys.executable, "-m", "vocalis", "speak", "", "-o", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == "vocalis: error: text is empty"
    assert not out.exists()


def test_convert_then_info(compat_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "converted"
    assert main(["convert", str(compat_dir), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "flow.safetensors", "hift.safetensors", "llm.safetensors", "tokenizer", "vocalis.json"]
    assert main(["info", str(out)]) == 0
    assert "speech tokens 100" in capsys.readouterr().out
    _fail(capsys, ["convert", str(compat_dir), str(out)], "already exists", tmp_path / "never.wav")
