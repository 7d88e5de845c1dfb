"""Learning-rate schedules as pure functions of the optimizer step, applied by a small stateful wrapper.

- warmup: `lr = base * w^0.5 * min(s^-0.5, s * w^-1.5)` with s = step + 1 (ESPnet/CosyVoice `WarmupLR`):
  linear rise to `base` at step w, then inverse square-root decay.
- constant: linear warmup over w steps (none when w = 0), then `base`.
- noam_hold: linear warmup over w steps, hold `base` for h steps, then `base * (w / (s - h))^rate`, floored at
  `min_lr` (NeMo's NoamHoldAnnealing; continuous at s = w + h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULERS = ("warmup", "constant", "noam_hold")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    name: str = "warmup"
    warmup_steps: int = 2500
    hold_steps: int = 0  # noam_hold only
    decay_rate: float = 0.5  # noam_hold only
    min_lr: float = 0.0  # noam_hold only

    def __post_init__(self) -> None:
        if self.name not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.name!r}; choose from {', '.join(SCHEDULERS)}")
        if self.warmup_steps < 0 or self.hold_steps < 0:
            raise ValueError("warmup_steps and hold_steps must be >= 0")


def lr_factor(config: SchedulerConfig, step: int) -> float:
    """Multiplier of the base learning rate for the update that follows `step` completed updates."""
    w = config.warmup_steps
    s = step + 1
    if config.name == "warmup":
        if w == 0:
            return s**-0.5
        return w**0.5 * min(s**-0.5, s * w**-1.5)
    if w > 0 and step < w:
        return s / w
    if config.name == "constant":
        return 1.0
    h = config.hold_steps
    if step < w + h:
        return 1.0
    return max(w, 1) ** config.decay_rate / max(step - h, 1) ** config.decay_rate


class Scheduler:
    """Sets every param group's lr to base_lr * lr_factor(step); its only state is the step."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: SchedulerConfig, base_lr: float) -> None:
        self.optimizer = optimizer
        self.config = config
        self.base_lr = base_lr
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        lr = self.base_lr * lr_factor(self.config, self.step_count)
        if self.config.name == "noam_hold":
            lr = max(lr, self.config.min_lr)
        return lr if math.isfinite(lr) else 0.0

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def set_step(self, step: int) -> None:
        self.step_count = step
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_step(int(state["step"]))
