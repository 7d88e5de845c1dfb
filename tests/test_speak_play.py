"""`vocalis speak --play`: plays on the default output device through miniaudio; without the library or a device it
says why in one warning line and still writes the file (exit 0)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from tiny_assets import make_tiny_model_dir

from vocalis.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny")


def test_play_writes_the_file_and_plays_or_says_there_is_no_device(model_dir: Path, tmp_path: Path, caplog) -> None:
    pytest.importorskip("miniaudio", reason="miniaudio (the play extra) is not installed")
    caplog.set_level("INFO")
    out = tmp_path / "o.wav"
    assert main(["speak", "Hi there.", "-o", str(out), "--model", str(model_dir), "--seed", "1", "--stream",
                 "--play"]) == 0
    wav, sr = sf.read(out)
    assert sr == 24000 and len(wav) > 0 and np.isfinite(wav).all()
    played, skipped = "played on" in caplog.text, "not played: no audio output device" in caplog.text
    assert played != skipped, caplog.text  # one or the other, never a silent "null" device


def test_play_without_the_library_says_how_to_get_it(model_dir: Path, tmp_path: Path, caplog, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "miniaudio", None)  # import fails as where it is not installed
    caplog.set_level("INFO")
    assert main(["speak", "Hi.", "--model", str(model_dir), "--play"]) == 0  # nothing to write, nothing to play
    assert "not played: no sound library (pip install 'vocalis[play]'" in caplog.text
    assert "made " in caplog.text and not list(tmp_path.iterdir())


def test_speech_must_go_somewhere(model_dir: Path, capsys) -> None:
    assert main(["speak", "Hi.", "--model", str(model_dir)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "vocalis: error: say where the speech goes: -o FILE, --play, or both"
