"""Helpers of the CosyVoice 3 parity tests (the `cv3_dir` / `cv3_model` fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path

import torch

ATOL = 1e-4  # fp32 against the official modules


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
