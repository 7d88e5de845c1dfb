"""Rank-0 training metrics: TensorBoard scalars (when `tensorboard` is installed) plus a JSON-lines file.

`train_log.jsonl` in the run folder always gets one record per log interval, so a run can be inspected
(and tested) without TensorBoard; the TensorBoard event files go to `<out_dir>/tensorboard`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JSONL = "train_log.jsonl"


class MetricsLogger:
    def __init__(self, out_dir: Path, tensorboard: bool, enabled: bool) -> None:
        self.enabled = enabled
        self.writer = None
        self.backend = "jsonl"
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / JSONL, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional dependency (the `train` extra)
                log.warning("tensorboard is not installed: metrics go to %s only", out_dir / JSONL)
            else:
                self.writer = SummaryWriter(str(out_dir / "tensorboard"))
                self.backend = "tensorboard+jsonl"

    def log(self, step: int, scalars: dict[str, float], extra: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(f"train/{k}", v, step)
        self.jsonl.write(json.dumps({"step": step, **scalars, **(extra or {})}) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            self.writer.close()
        self.jsonl.close()
