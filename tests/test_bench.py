"""`vocalis bench` end to end on the tiny preset: both sides run in real subprocesses, JSON and PNG come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vocalis.cli import main


def test_bench_quick_tiny_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--preset", "tiny", "--quick", "--batches", "1,2", "--concurrency", "1,2", "--tokens", "30",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    ref, eng = report["reference"], report["engine"]["fp32"]
    assert report["machine"]["copy_gbps"] > 0
    assert ref["llm"]["decode_tps"] > 0 and ref["e2e"]["first_chunk_s"] > 0
    assert set(eng["llm"]) == {"1", "2"} and set(eng["e2e"]) == {"1", "2"}
    # both sides made the same forced amount of audio: 30 tokens = 1.2 s per stream
    assert ref["e2e"]["audio_s"] == pytest.approx(1.2)
    assert eng["e2e"]["2"]["audio_s"] == pytest.approx(2.4)
    assert eng["decode_limit_tps"] > 0 and 0 < eng["peak_rss_mib"] < 4096
    assert "decode_b1_fraction_of_limit[fp32]" in report["targets"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "LLM decode tok/s, batch 1" in capsys.readouterr().out


def test_bench_llm_part_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--preset", "tiny", "--quick", "--parts", "llm", "--batches", "1,3", "--json", str(out),
               "--plot", str(tmp_path / "none.png")])
    assert rc == 0 and not (tmp_path / "none.png").exists()  # the plot needs every part
    report = json.loads(out.read_text())
    ref, eng = report["reference"], report["engine"]["fp32"]
    assert "token2wav" not in ref and "e2e" not in ref and "e2e" not in eng
    assert set(eng["llm"]) == {"1", "3"} and all(v["decode_tps"] > 0 for v in eng["llm"].values())
    assert len(eng["bandwidth_gbps_before_after"]) == 2 and eng["decode_limit_tps"] > 0
    assert "decode_b1_fraction_of_limit[fp32]" in report["targets"]
    printed = capsys.readouterr().out
    assert "LLM decode tok/s, batch 3" in printed and "token2wav" not in printed


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset"),
    (["--precision", "fp16"], "fp16 needs a CUDA GPU"),
    (["--tokens", "0"], "must be positive"),
    (["--parts", "llm,vocoder"], "--parts takes"),
])
def test_bench_bad_options_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vocalis: error:") and message in err
