"""Flow task: conditional flow matching (`flow_train.flow_matching_loss`) with random chunk masks, random
in-context prompts and classifier-free-guidance dropout; every random draw comes from the rank's generator."""

from __future__ import annotations

import torch
from torch import nn

from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.flow.flow_train import flow_matching_loss
from vocalis.train.config import TrainConfig
from vocalis.train.data import Batch
from vocalis.train.task import StepContext, Task, Wrap, build_part


class FlowObjective(nn.Module):
    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        return flow_matching_loss(self.flow, batch.speech_token, batch.speech_token_len, batch.mel, batch.mel_len,
                                  batch.embedding, generator=generator)


class FlowTask(Task):
    name = "flow"

    def __init__(self, config: TrainConfig) -> None:
        flow, self.model_config = build_part(config, "flow")
        assert isinstance(flow, CausalMaskedDiffWithXvec)
        self.modules = {"flow": flow}
        self.objective: nn.Module = FlowObjective(flow)

    def wrap(self, wrap: Wrap) -> None:
        self.objective = wrap(self.objective)

    def checkpointed_layers(self):
        flow = self.modules["flow"]
        est = flow.decoder.estimator
        yield from flow.encoder.encoders
        yield from flow.encoder.up_encoders
        for level in (*est.down_blocks, *est.mid_blocks, *est.up_blocks):
            yield from level[1]  # the transformer blocks of each level

    def micro_step(self, batch: Batch, ctx: StepContext) -> dict[str, float]:
        with ctx.autocast():
            loss = self.objective(batch, ctx.generator)
        ctx.backward(loss, "main")
        ctx.update("main")
        return {"loss": float(loss.detach())}
