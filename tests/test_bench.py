"""`vocalis bench` end to end on the tiny preset: both sides run in real subprocesses, JSON and PNG come out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vocalis.cli import main


def test_bench_quick_tiny_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--preset", "tiny", "--quick", "--batches", "1,2", "--concurrency", "1,2", "--tokens", "30",
               "--e2e-repeats", "3", "--stream-repeats", "2", "--t2w-step", "1", "--rounds", "2",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["config"]["t2w_step"] == 1  # the 2-stream batch's token2wav runs one stream per step
    ref, eng = report["reference"], report["engine"]["fp32"]
    assert report["machine"]["copy_gbps"] > 0
    assert ref["llm"]["decode_tps"] > 0 and ref["e2e"]["first_chunk_s"] > 0
    assert set(eng["llm"]) == {"1", "2"} and set(eng["e2e"]) == {"1", "2"}
    # both sides made the same forced amount of audio: 30 tokens = 1.2 s per stream
    assert ref["e2e"]["audio_s"] == pytest.approx(1.2)
    assert eng["e2e"]["2"]["audio_s"] == pytest.approx(2.4)
    # single-stream figures are medians of 3 requests on each side, the 2-stream ones of 2 batches
    for e2e, repeats in ((ref["e2e"], 3), (eng["e2e"]["1"], 3), (eng["e2e"]["2"], 2)):
        walls = [r["wall_s"] for r in e2e["runs"]]
        assert len(walls) == repeats and e2e["wall_s"] == pytest.approx(float(np.median(walls)))
    assert eng["decode_limit_tps"] > 0 and 0 < eng["peak_rss_mib"] < 4096
    assert "decode_b1_fraction_of_limit[fp32]" in report["targets"]
    # two rounds of both sides: the table is round 1's, each target the median of the rounds' own ratios
    rounds = report["rounds"]
    assert len(rounds) == 2 and rounds[0]["reference"] == ref and rounds[0]["engine"]["fp32"] == eng
    assert rounds[1]["reference"]["e2e"]["runs"] != ref["e2e"]["runs"]  # measured again
    for key, value in report["targets"].items():
        if key != "wanted" and value is not None:
            assert value == pytest.approx(float(np.median([r["targets"][key] for r in rounds]))), key
    first = rounds[1]["engine"]["fp32"]["e2e"]["1"]["first_chunk_s"] / rounds[1]["reference"]["e2e"]["first_chunk_s"]
    assert rounds[1]["targets"]["first_chunk_vs_reference[fp32]"] == pytest.approx(first)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "LLM decode tok/s, batch 1" in printed and "round 2: " in printed and "medians of the rounds" in printed


def test_bench_llm_part_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--preset", "tiny", "--quick", "--parts", "llm", "--batches", "1,3", "--json", str(out),
               "--plot", str(tmp_path / "none.png")])
    assert rc == 0 and not (tmp_path / "none.png").exists()  # the plot needs every part
    report = json.loads(out.read_text())
    ref, eng = report["reference"], report["engine"]["fp32"]
    assert "token2wav" not in ref and "e2e" not in ref and "e2e" not in eng
    assert set(eng["llm"]) == {"1", "3"} and all(v["decode_tps"] > 0 for v in eng["llm"].values())
    assert eng["decode_limit_tps"] > 0
    # batch 1 against the bandwidth limit: quick = 8 tokens in 2 segments, a probe around each segment
    b1 = eng["decode_b1"]
    assert b1["tokens"] == 8 and len(b1["segment_tps"]) == 2
    assert len(b1["read_gbps"]) == len(b1["copy_gbps"]) == 3 and b1["probe_threads"] == 2
    assert b1["read_gbps_spread"]["min"] <= b1["bandwidth_gbps"] <= b1["read_gbps_spread"]["max"]
    assert b1["bandwidth_gbps"] == eng["bandwidth_gbps"] and b1["decode_tps"] == eng["llm"]["1"]["decode_tps"]
    # a step reads the weights plus the row's K/V (prompt + outputs so far)
    assert b1["bytes_per_token"] > b1["weight_bytes"] == eng["bytes_per_token"]
    assert b1["fraction_of_limit"] == pytest.approx(b1["decode_tps"] * b1["bytes_per_token"] / 1e9
                                                    / b1["bandwidth_gbps"])
    assert report["targets"]["decode_b1_fraction_of_limit[fp32]"] == b1["fraction_of_limit"]
    printed = capsys.readouterr().out
    assert "LLM decode tok/s, batch 3" in printed and "token2wav" not in printed
    assert "fraction of limit (batch 1)" in printed and "read GB/s probes min/med/max" in printed


def test_bench_flow_steps_set_the_engines_euler_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--flow-steps 2`: the engine's token2wav puts the same frames through 2 Euler steps instead of the model's 10
    (its estimator-frame count, frames x steps, is a fifth); the table says so."""
    frames = {}
    for steps in (None, 2):
        out = tmp_path / f"bench{steps}.json"
        extra = [] if steps is None else ["--flow-steps", str(steps)]
        rc = main(["bench", "--preset", "tiny", "--quick", "--parts", "token2wav", "--tokens", "30", *extra,
                   "--json", str(out), "--plot", ""])
        assert rc == 0
        report = json.loads(out.read_text())
        assert report["config"]["flow_steps"] == steps
        frames[steps] = report["engine"]["fp32"]["token2wav"]["estimator_frames"]
        assert ("engine: 2 Euler steps" in capsys.readouterr().out) == (steps == 2)
    assert frames[None] > 0 and frames[2] * 5 == frames[None]


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset"),
    (["--e2e-repeats", "0"], "must be positive"),
    (["--stream-repeats", "0"], "must be positive"),
    (["--rounds", "0"], "must be positive"),
    (["--precision", "fp16"], "fp16 needs a CUDA GPU"),
    (["--tokens", "0"], "must be positive"),
    (["--parts", "llm,vocoder"], "--parts takes"),
    (["--t2w-step", "0"], "--t2w-step must be >= 1"),
    (["--flow-steps", "0"], "--flow-steps must be >= 1"),
])
def test_bench_bad_options_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vocalis: error:") and message in err
