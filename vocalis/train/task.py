"""What the trainer trains: a `Task` owns its modules, optimizer groups and one micro-step.

The trainer owns the loop, DDP, precision, accumulation, clipping, schedules and checkpoints; a task only says
how one batch turns into losses, through a `StepContext`:

    with ctx.autocast():
        loss = objective(batch)          # a DDP-wrapped nn.Module when distributed
    ctx.backward(loss, "main")           # scaled for fp16, divided by accum_grad
    ctx.update("main")                   # at an accumulation boundary: unscale, clip, step, schedule

The GAN task calls backward/update twice (discriminator, then generator), each with its own optimizer.
"""

from __future__ import annotations

import abc
import functools
import logging
import random
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vocalis.checkpoint import load_strict
from vocalis.config import PRESETS, ModelConfig
from vocalis.errors import InputError
from vocalis.model_dir import load_model
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.models.speech_lm import Qwen2LM
from vocalis.train.checkpointing import load_checkpoint
from vocalis.train.config import TrainConfig
from vocalis.train.data import Batch

log = logging.getLogger(__name__)

Wrap = Callable[[nn.Module], nn.Module]


class StepContext(Protocol):
    boundary: bool  # this micro-batch ends an accumulation window (optimizers step)
    py_rng: random.Random  # objective randomness (Python side), per rank, checkpointed
    generator: torch.Generator  # objective randomness (torch, on the training device), per rank, checkpointed

    def autocast(self) -> AbstractContextManager: ...
    def backward(self, loss: torch.Tensor, group: str) -> None: ...
    def update(self, group: str) -> None: ...


class Task(abc.ABC):
    """One trainable component. `modules` are saved by name in checkpoints and exported by name."""

    name: str
    modules: dict[str, nn.Module]
    model_config: ModelConfig | None  # architecture of the TTS model the modules belong to (None: tokenizer)

    def groups(self) -> dict[str, list[nn.Parameter]]:
        """Optimizer groups: name -> parameters. One group ("main") unless the task says otherwise."""
        return {"main": [p for m in self.modules.values() for p in m.parameters() if p.requires_grad]}

    def group_lr(self, group: str, config: TrainConfig) -> float:
        return config.optim.lr

    @abc.abstractmethod
    def wrap(self, wrap: Wrap) -> None:
        """Replace the objective module(s) by `wrap(module)` (DDP); called once, after moving to the device."""

    @abc.abstractmethod
    def micro_step(self, batch: Batch, ctx: StepContext) -> dict[str, float]:
        """Forward + backward (+ update at boundaries) on one micro-batch; returns scalar metrics."""

    def frozen_modules(self) -> dict[str, nn.Module]:
        """Modules the task runs but neither trains nor checkpoints (a LoRA base, a reference model): moved to the
        device with the trained ones."""
        return {}

    def save_artifacts(self, out_dir: Path) -> None:
        """Write what a checkpoint also yields for users (e.g. a LoRA adapter folder); rank 0, at every save."""

    def optional_parts(self) -> frozenset[str]:
        """Modules (and optimizer groups of the same name) a resumed checkpoint may lack; they start fresh."""
        return frozenset()

    def checkpointed_layers(self) -> Iterable[nn.Module]:
        """Repeated blocks whose activations gradient checkpointing recomputes."""
        return ()

    def target_encoder(self) -> Callable[[str, str], list[int]] | None:
        """(text, language) -> CTC target ids, for tasks that learn from transcripts (run in data workers)."""
        return None

    def extra_state(self) -> dict[str, Any]:
        """Plain data saved with the checkpoint besides the weights (e.g. a symbol table)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Check/restore what `extra_state` saved (on resume)."""


def enable_gradient_checkpointing(layers: Iterable[nn.Module]) -> int:
    """Recompute each layer's activations in backward instead of storing them. The layer's `forward` is
    replaced on the instance, so parameter names (and checkpoints) stay as they are."""
    count = 0
    for layer in layers:
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Callable = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward  # type: ignore[method-assign]
        count += 1
    return count


def build_part(config: TrainConfig, part: str) -> tuple[nn.Module, ModelConfig]:
    """The llm, flow or hift module to train: from `model.init_from` (an official CosyVoice2 or Vocalis
    directory: fine-tuning) or randomly initialised at `model.preset`; then `model.checkpoint` weights."""
    m = config.model
    if m.init_from:
        loaded = load_model(m.init_from)
        module, model_config = getattr(loaded, part), loaded.config
        log.info("fine-tuning %s from %s", part, loaded.describe())
    else:
        if m.preset not in PRESETS:
            raise InputError(f"unknown preset {m.preset!r}; choose from {', '.join(PRESETS)}")
        model_config = PRESETS[m.preset]
        if m.hift_channels is not None:
            model_config = replace(model_config, hift=replace(model_config.hift, base_channels=m.hift_channels))
        module = _random_part(model_config, part)
    module.train().requires_grad_(True)
    if m.checkpoint:
        load_checkpoint_part(module, m.checkpoint, part)
    return module, model_config


def load_checkpoint_part(module: nn.Module, checkpoint: str, part: str) -> None:
    """`model.checkpoint`: a training checkpoint's `part` weights into `module` (strictly), starting a new run."""
    models = load_checkpoint(checkpoint).get("models", {})
    if part not in models:
        raise InputError(f"checkpoint {checkpoint} has no {part!r} weights (it has {sorted(models)})")
    load_strict(module, models[part], f"{checkpoint}:{part}")


def _random_part(config: ModelConfig, part: str) -> nn.Module:
    """Build only the part asked for (a random 0.5B LLM takes seconds; no need when training the flow)."""
    if part == "llm":
        return Qwen2LM(config.llm)
    if part == "flow":
        return CausalMaskedDiffWithXvec(config.flow)
    return HiFTGenerator(config.hift)
