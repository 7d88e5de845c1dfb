"""State-dict I/O: strict loading by name with clear errors, and our safetensors format."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vocalis.errors import ModelLoadError

_MAX_LISTED = 8


def check_state_dict(module: torch.nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise `ModelLoadError` naming every missing, unexpected or mis-shaped tensor (first few of each)."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    problems = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
        if items:
            shown = "; ".join(items[:_MAX_LISTED]) + (f"; ... ({len(items)} in all)" if len(items) > _MAX_LISTED else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise ModelLoadError(f"{what} does not fit the model: " + " | ".join(problems))


def load_strict(module: torch.nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Check names and shapes, then copy every tensor (dtype converted to the module's)."""
    check_state_dict(module, state, what)
    module.load_state_dict(dict(state), strict=True)


def read_torch_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """An official `*.pt` state dict (plain dict of tensors); never unpickles arbitrary objects."""
    if not path.is_file():
        raise ModelLoadError(f"missing checkpoint file: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a corrupt or non-checkpoint file
        raise ModelLoadError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{path} is not a state dict of tensors")
    return state


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ModelLoadError(f"missing checkpoint file: {path}")
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"cannot read checkpoint {path}: {exc}") from exc


def write_safetensors(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Atomic write: a crash leaves either the old file or the new one, never half of one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp))
    tmp.replace(path)
