"""Training checkpoints: atomic writes, discovery, pruning, RNG state capture and averaging.

A checkpoint is one `torch.save` dict: `models` (name -> state_dict), `optimizers`, `schedulers`, `scalers`
(per optimizer group), `step`, `epoch`, `batches_in_epoch` (micro-batches of `epoch` already consumed),
`config` (the TrainConfig as plain data), `model_config` (architecture as plain data), `task`, and `rng` (one
entry per rank, so every rank resumes its own dropout / objective streams). Everything in it is a tensor or
plain Python data, so it loads with `weights_only=True`.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vocalis.errors import InputError

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR / f"step_{step:08d}.pt"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Finished checkpoints of a run, oldest first (half-written `.tmp` files never match)."""
    d = Path(out_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _NAME.match(p.name))


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`: a crash leaves
    either the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for corrupt/foreign files
        raise InputError(f"cannot read checkpoint {path}: {exc}") from exc


def prune(out_dir: str | Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(out_dir)[:-keep]:
        old.unlink(missing_ok=True)


def capture_rng(py_rng: random.Random, generator: torch.Generator) -> dict[str, Any]:
    """This rank's random streams: global torch (CPU and CUDA), numpy, python, and the objective's own."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "python": random.getstate(),
        "objective_python": py_rng.getstate(),
        "objective_torch": generator.get_state(),
    }


def restore_rng(state: dict[str, Any], py_rng: random.Random, generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    random.setstate(_tuples(state["python"]))
    py_rng.setstate(_tuples(state["objective_python"]))
    generator.set_state(state["objective_torch"])


def _tuples(x: Any) -> Any:
    """random.setstate wants tuples; a save/load round trip may hand back lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def average_models(paths: list[Path]) -> dict[str, dict[str, torch.Tensor]]:
    """Element-wise mean of each model's floating-point tensors over several checkpoints (in float64, cast
    back); integer buffers are taken from the last checkpoint."""
    if not paths:
        raise InputError("no checkpoints to average")
    sums: dict[str, dict[str, torch.Tensor]] = {}
    last: dict[str, dict[str, torch.Tensor]] = {}
    for p in paths:
        models = load_checkpoint(p)["models"]
        if sums and set(models) != set(sums):
            raise InputError(f"{p} holds models {sorted(models)}, the others {sorted(sums)}")
        for name, sd in models.items():
            acc = sums.setdefault(name, {})
            for k, v in sd.items():
                if v.is_floating_point():
                    acc[k] = acc[k] + v.double() if k in acc else v.double()
        last = models
    return {
        name: {k: (sums[name][k] / len(paths)).to(v.dtype) if v.is_floating_point() else v for k, v in sd.items()}
        for name, sd in last.items()
    }
