"""LLM task: next-speech-token cross-entropy on the speech part (`speech_lm_train.lm_training_forward`), with
optional label smoothing and 5:15 text-speech interleaving for text-streaming input.

With `[lora] enabled` the LLM is frozen and only LoRA adapters on its Linear layers train (`train.lora`): the
checkpoints hold the adapter weights alone (module "lora"), and every save also writes `<out>/adapter/`."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch
from torch import nn

from vocalis.adapters.lora_file import AdapterConfig, save_adapter
from vocalis.models.speech_lm import Qwen2LM
from vocalis.models.speech_lm_train import lm_training_forward
from vocalis.train.config import TrainConfig
from vocalis.train.data import Batch
from vocalis.train.lora import adapter_of, attach_lora
from vocalis.train.task import StepContext, Task, Wrap, build_part

ADAPTER_DIR = "adapter"


class LMObjective(nn.Module):
    """Wraps the LM so DDP sees one forward: batch -> (loss, accuracy)."""

    def __init__(self, llm: Qwen2LM, bistream_prob: float) -> None:
        super().__init__()
        self.llm = llm
        self.bistream_prob = bistream_prob

    def forward(self, batch: Batch, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        out = lm_training_forward(self.llm, batch.text_token, batch.text_token_len, batch.speech_token,
                                  batch.speech_token_len, rng=rng, bistream_prob=self.bistream_prob)
        return out.loss, out.acc


class LLMTask(Task):
    name = "llm"

    def __init__(self, config: TrainConfig) -> None:
        llm, self.model_config = build_part(config, "llm")
        assert isinstance(llm, Qwen2LM)
        if config.llm.label_smoothing is not None:
            llm.config = dataclasses.replace(llm.config, lsm_weight=config.llm.label_smoothing)
        llm.qwen.set_residual_dropout(config.llm.dropout)
        self.llm = llm
        self.modules = {"llm": llm}
        self.adapter_config: AdapterConfig | None = None
        if config.lora.enabled:
            init = config.model.init_from
            base = (str(Path(init).resolve()) if init and Path(init).is_dir()
                    else init or f"random {config.model.preset}")
            weights, self.adapter_config = attach_lora(llm, config.lora, base)
            self.modules = {"lora": weights}
        self.objective: nn.Module = LMObjective(llm, config.llm.bistream_prob)

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {"llm": self.llm} if self.adapter_config is not None else {}

    def save_artifacts(self, out_dir: Path) -> None:
        if self.adapter_config is not None:
            adapter = adapter_of(self.modules["lora"], self.adapter_config)  # type: ignore[arg-type]
            save_adapter(adapter, out_dir / ADAPTER_DIR)

    def wrap(self, wrap: Wrap) -> None:
        self.objective = wrap(self.objective)

    def checkpointed_layers(self):
        return self.llm.qwen.layers

    def micro_step(self, batch: Batch, ctx: StepContext) -> dict[str, float]:
        with ctx.autocast():
            loss, acc = self.objective(batch, ctx.py_rng)
        ctx.backward(loss, "main")
        ctx.update("main")
        return {"loss": float(loss.detach()), "acc": float(acc.detach())}
