"""Shared fixtures of the CosyVoice 3 parity tests: the `compat_cv3` folder, loaded unchanged, and its references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

COMPAT_CV3_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "compat_cv3"
ATOL = 1e-4  # fp32 against the official modules


@pytest.fixture(scope="session")
def cv3_dir() -> Path:
    """`../shared/reference/compat_cv3`: skipped when absent on a developer machine, a failure in CI."""
    if not (COMPAT_CV3_DIR / "llm.pt").exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CosyVoice 3 compatibility fixture missing at {COMPAT_CV3_DIR}: broken CI set-up")
        pytest.skip(f"CosyVoice 3 compatibility fixture missing at {COMPAT_CV3_DIR}")
    return COMPAT_CV3_DIR


@pytest.fixture(scope="session")
def cv3_model(cv3_dir: Path):  # -> vocalis.model_dir.LoadedModel of kind "cosyvoice3"
    """The folder through `load_model` (strict by name), modules in eval mode; tests must not modify them."""
    from vocalis.model_dir import load_model

    return load_model(cv3_dir)


def cv3_reference(cv3_dir: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(cv3_dir / "reference" / f"{name}.pt", weights_only=True)


def max_diff(name: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference (printed, so `pytest -s` shows the margins); shapes must match exactly."""
    assert tuple(ours.shape) == tuple(ref.shape), f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    print(f"[cv3 parity] {name}: max abs diff {diff:.3e}")
    return diff


def state_dict_shapes(sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sd.items()}
