"""Labeller task: the phone model's prompt tokenizer (`FrameLabeller`), cross-entropy per 25 Hz frame against the
stored speech ids, which for the phone model are the labels of the teacher's alignment (`vocalis.train.phone_labels`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vocalis.config import PHONE_LABELS
from vocalis.errors import InputError
from vocalis.models.speech_tokenizer.labeller import FrameLabeller, labeller_config
from vocalis.train.config import TrainConfig
from vocalis.train.data import Batch
from vocalis.train.task import StepContext, Task, Wrap, load_checkpoint_part

log = logging.getLogger(__name__)


class LabellerObjective(nn.Module):
    def __init__(self, model: FrameLabeller) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        assert batch.mel is not None and batch.speech_token is not None and batch.speech_token_len is not None
        mel = batch.mel.transpose(1, 2)  # (B, 128, T100)
        return self.model.loss(mel, batch.mel_len.clamp(min=1), batch.speech_token, batch.speech_token_len)


class LabellerTask(Task):
    name = "labeller"
    model_config = None

    def __init__(self, config: TrainConfig) -> None:
        try:
            model = FrameLabeller(labeller_config(config.labeller.preset, PHONE_LABELS))
        except ValueError as exc:
            raise InputError(str(exc)) from exc
        if config.model.checkpoint:  # start from these weights (a new machine: the committed rung)
            load_checkpoint_part(model, config.model.checkpoint, "labeller")
        log.info("frame labeller: %d labels, %.2f M parameters", PHONE_LABELS,
                 sum(p.numel() for p in model.parameters()) / 1e6)
        self.modules = {"labeller": model}
        self.objective: nn.Module = LabellerObjective(model)

    def wrap(self, wrap: Wrap) -> None:
        self.objective = wrap(self.objective)

    def checkpointed_layers(self):
        return self.modules["labeller"].encoder.layers

    def micro_step(self, batch: Batch, ctx: StepContext) -> dict[str, float]:
        with ctx.autocast():
            loss, metrics = self.objective(batch)
        ctx.backward(loss, "main")
        ctx.update("main")
        return {"loss": float(loss.detach()), **metrics}
