"""The loop of preference and reinforcement fine-tuning of the speech LM (`vocalis train dpo | grpo`).

Per optimizer step: the objective lists the step's items over all ranks (DPO: pairs; GRPO: rollout samples);
each rank takes its contiguous share, the objective prepares it (GRPO: rollouts through the engine, rewards,
advantages), and the share runs in micro-batches, accumulated (`no_sync` until the last), each micro-batch's
loss divided by the accumulation count. An objective's loss is its items' sum divided by `micro_batch`, so an
update is the mean over the global batch however it is split over ranks. Then clip, step, schedule.

The reference model is a frozen copy of the starting policy. With `[lora] enabled`, only adapters train (the
checkpoints hold them alone; `<out>/adapter/` is written at every save). Checkpoints (`checkpointing.py`
format) resume exactly: weights, optimizer, schedule, step, every rank's RNG, and the objective's state.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vocalis.adapters.lora_file import save_adapter
from vocalis.checkpoint import load_strict
from vocalis.errors import InputError
from vocalis.models.speech_lm import Qwen2LM
from vocalis.train import checkpointing as ckpt
from vocalis.train.config import TrainConfig
from vocalis.train.distributed import DistInfo, gather_objects, parameter_digest, sum_over_ranks
from vocalis.train.logger import MetricsLogger
from vocalis.train.lora import adapter_of, attach_lora
from vocalis.train.schedulers import Scheduler
from vocalis.train.sequence_logp import SequenceScorer
from vocalis.train.task import build_part
from vocalis.train.trainer import build_optimizer

log = logging.getLogger(__name__)


class PolicyObjective(abc.ABC):
    name: str

    @abc.abstractmethod
    def items_for_step(self, step: int) -> list[Any]:
        """Every rank's items of optimizer step `step`, in a fixed order (each rank takes a contiguous share)."""

    def prepare(self, items: Sequence[Any], step: int) -> list[Any]:
        """This rank's share -> what `loss` takes (GRPO: rollouts, rewards, advantages). Collective: every rank
        calls it."""
        return list(items)

    @abc.abstractmethod
    def loss(self, items: Sequence[Any], micro_batch: int) -> tuple[torch.Tensor, dict[str, float]]:
        """(sum of the items' losses / micro_batch, metric sums over the items)."""

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the step already averaged over every rank (e.g. rewards)."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what `extra_state` saved."""


class PolicyTrainer:
    """The loop DPO and GRPO share; `objective` makes the run's objective from the trainer (the caller picks it, so
    the loop imports neither objective)."""

    def __init__(self, config: TrainConfig, info: DistInfo,
                 objective: Callable[[PolicyTrainer], PolicyObjective]) -> None:
        self.config, self.info = config, info
        t = config.trainer
        self.out_dir = Path(t.out_dir)
        if t.engine != "ddp" or t.precision == "fp16":
            raise InputError(f"{config.task} runs on the ddp engine in fp32 or bf16 (trainer.engine={t.engine}, "
                             f"trainer.precision={t.precision})")
        torch.manual_seed(t.seed)
        llm, self.model_config = build_part(config, "llm")
        if not isinstance(llm, Qwen2LM):
            raise InputError(f"{config.task} trains CosyVoice 2-family speech LMs; this model's is a "
                             f"{type(llm).__name__}")
        self.reference = copy.deepcopy(llm).eval().requires_grad_(False)
        llm.qwen.set_residual_dropout(config.llm.dropout)
        self.policy = llm
        self.adapter_config = None
        self.trained: nn.Module = llm
        self.part = "llm"
        if config.lora.enabled:
            init = config.model.init_from
            base = str(Path(init).resolve()) if init and Path(init).is_dir() else init or "random preset"
            self.trained, self.adapter_config = attach_lora(llm, config.lora, base)
            self.part = "lora"
        for m in (self.policy, self.reference, self.trained):
            m.to(info.device)
        self.scorer: nn.Module = SequenceScorer(llm)
        if info.distributed:
            dev = info.device
            self.scorer = DistributedDataParallel(self.scorer, device_ids=[dev.index] if dev.type == "cuda" else None)
        params = [p for p in self.trained.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, config, config.optim.lr)
        self.scheduler = Scheduler(self.optimizer, config.scheduler, config.optim.lr)
        self.params = params
        torch.manual_seed(t.seed + 1 + info.rank)  # dropout differs per rank
        self.py_rng = random.Random(f"{t.seed}-{info.rank}-objective")
        self.generator = torch.Generator(device=info.device).manual_seed(t.seed * 1000 + info.rank)
        self.objective = objective(self)
        self.accum = config.policy.accumulation(info.world_size)
        self.step = 0
        if t.resume:
            self._resume(t.resume)
        self.metrics = MetricsLogger(self.out_dir, t.tensorboard, info.is_main)

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        rngs = gather_objects(ckpt.capture_rng(self.py_rng, self.generator), self.info)
        return {
            "task": self.config.task,
            "models": {self.part: {k: v.detach().cpu() for k, v in self.trained.state_dict().items()}},
            "optimizers": {"main": self.optimizer.state_dict()},
            "schedulers": {"main": self.scheduler.state_dict()},
            "scalers": {"main": {}},
            "step": self.step, "epoch": 0, "batches_in_epoch": 0,
            "config": self.config.to_dict(),
            "model_config": self.model_config.to_dict(),
            "extra": self.objective.extra_state(),
            "rng": rngs,
        }

    def save(self) -> None:
        state = self.state()  # collective
        if not self.info.is_main:
            return
        path = ckpt.checkpoint_path(self.out_dir, self.step)
        ckpt.save_atomic(state, path)
        if self.adapter_config is not None:
            adapter = adapter_of(self.trained, self.adapter_config)  # type: ignore[arg-type]
            save_adapter(adapter, self.out_dir / "adapter")
        ckpt.prune(self.out_dir, self.config.trainer.keep_checkpoints)
        log.info("saved %s", path)

    def _resume(self, where: str) -> None:
        found = ckpt.list_checkpoints(self.out_dir) if where == "auto" else [Path(where)]
        if not found:
            log.info("no checkpoint in %s: starting from scratch", self.out_dir)
            return
        path = found[-1]
        state = ckpt.load_checkpoint(path)
        if state.get("task") != self.config.task or self.part not in state.get("models", {}):
            raise InputError(f"{path} is not a {self.config.task} checkpoint of the {self.part} (it holds "
                             f"{state.get('task')!r}: {sorted(state.get('models', {}))})")
        load_strict(self.trained, state["models"][self.part], f"{path}:{self.part}")
        self.optimizer.load_state_dict(state["optimizers"]["main"])
        self.scheduler.load_state_dict(state["schedulers"]["main"])
        self.step = state["step"]
        rngs = state.get("rng", [])
        if len(rngs) == self.info.world_size:
            ckpt.restore_rng(rngs[self.info.rank], self.py_rng, self.generator)
        self.objective.load_extra_state(state.get("extra", {}))
        log.info("resumed from %s at step %d", path, self.step)

    # ---- loop --------------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        p = self.config.trainer.precision
        if p == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.info.device.type, dtype=torch.bfloat16)

    def run(self) -> dict[str, Any]:
        t, pc = self.config.trainer, self.config.policy
        if t.max_steps <= 0:
            raise InputError("set trainer.max_steps (optimizer steps) for dpo and grpo")
        rank, world = self.info.rank, self.info.world_size
        log.info("%s on %d rank(s), %s: global batch %d = micro %d x accumulation %d x ranks %d", self.config.task,
                 world, self.info.device, pc.global_batch, pc.micro_batch, self.accum, world)
        while self.step < t.max_steps:
            start = time.perf_counter()
            items = self.objective.items_for_step(self.step)
            share = len(items) // world
            mine = self.objective.prepare(items[rank * share:(rank + 1) * share], self.step)
            sums: dict[str, float] = {}
            for j in range(self.accum):
                micro = mine[j * pc.micro_batch:(j + 1) * pc.micro_batch]
                sync = j == self.accum - 1 or not isinstance(self.scorer, DistributedDataParallel)
                with contextlib.nullcontext() if sync else self.scorer.no_sync():  # type: ignore[operator]
                    with self.autocast():
                        loss, metrics = self.objective.loss(micro, pc.micro_batch)
                    (loss / self.accum).backward()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
            clip = t.grad_clip
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else math.inf))
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                log.warning("step %d: gradient norm %s; update skipped", self.step, norm)
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            keys = sorted(sums)
            totals = sum_over_ranks([sums[k] for k in keys], self.info)
            scalars = {k: totals[i] / len(items) for i, k in enumerate(keys)}
            scalars.update(self.objective.step_metrics())
            scalars.update(grad_norm=norm, lr=self.optimizer.param_groups[0]["lr"],
                           step_seconds=time.perf_counter() - start)
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                self.metrics.log(self.step, scalars)
                if self.info.is_main:
                    log.info("step %d: %s", self.step, " ".join(f"{k} {v:.4g}" for k, v in scalars.items()))
            if (t.save_every > 0 and self.step % t.save_every == 0) or self.step == t.max_steps:
                self.save()
        return self._finish()

    def _finish(self) -> dict[str, Any]:
        digests = gather_objects(parameter_digest({self.part: self.trained}), self.info)
        summary = {"task": self.config.task, "step": self.step, "world_size": self.info.world_size,
                   "param_digests": digests, "replicas_identical": len(set(digests)) == 1,
                   "metrics_backend": self.metrics.backend,
                   "last_checkpoint": str(ckpt.checkpoint_path(self.out_dir, self.step))}
        if self.info.is_main:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        self.metrics.close()
        return summary
