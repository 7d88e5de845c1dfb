"""`vocalis bench --preset cosyvoice3-0.5b` machinery at the compat_cv3 fixture's tiny shapes (the released shapes
are built on the meta device by test_cv3_model_dir): every part runs and reports its figures."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from vocalis.bench.cli import add_arguments, config_from_args
from vocalis.bench.cv3 import cv3_summary, run_cv3
from vocalis.model_dir import read_cosyvoice3_config


def test_cv3_bench_runs_every_part(cv3_dir: Path) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--preset", "cosyvoice3-0.5b", "--tokens", "30", "--batches", "1,2",
                                         "--concurrency", "2"]))
    import dataclasses

    cfg = dataclasses.replace(cfg, decode_tokens=4, prompt_tokens=7, text_words=3)
    report = run_cv3(cfg, read_cosyvoice3_config(cv3_dir))
    assert report["llm"]["b2"]["decode_tok_s"] > 0 and report["llm"]["reference_b1"]["decode_tok_s"] > 0
    assert report["token2wav"]["engine"]["rtf"] > 0 and report["token2wav"]["reference"]["first_chunk_s"] > 0
    assert report["e2e"]["c2"]["audio_s_per_s"] > 0
    assert "token2wav" in cv3_summary(report)


def test_unknown_preset_names_the_cv3_one() -> None:
    from vocalis.errors import InputError

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(InputError, match="cosyvoice3-0.5b"):
        config_from_args(p.parse_args(["--preset", "nope"]))
