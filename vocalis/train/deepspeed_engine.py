"""`--engine deepspeed`: the same loop with DeepSpeed ZeRO-2 owning the optimizer step.

DeepSpeed partitions optimizer states and gradients across ranks (ZeRO stage 2) and does the accumulation,
clipping and gradient reduction itself; the trainer keeps its data pipeline, schedules, logging, RNG handling and
checkpoints (weights in our format for export, plus DeepSpeed's own sharded optimizer checkpoint under
`<out_dir>/deepspeed/<tag>` for an exact resume). Weights stay fp32; bf16 runs under torch.autocast.

Limits: one optimizer group (llm, flow, tokenizer; the two-optimizer HiFT GAN uses DDP), fp32 or bf16.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vocalis.errors import InputError
from vocalis.train.checkpointing import CHECKPOINT_DIR
from vocalis.train.config import TrainConfig
from vocalis.train.distributed import DistInfo
from vocalis.train.trainer import Trainer

log = logging.getLogger(__name__)

DS_DIR = "deepspeed"


def default_ds_config(config: TrainConfig) -> dict[str, Any]:
    t = config.trainer
    return {
        "train_micro_batch_size_per_gpu": 1,  # batches are dynamic; DeepSpeed only needs a number
        "gradient_accumulation_steps": t.accum_grad,
        "gradient_clipping": t.grad_clip if t.grad_clip > 0 else 0.0,
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False},
        "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }


def _single_process_group(info: DistInfo) -> None:
    """DeepSpeed needs a process group even for one process: a 1-rank group on a free loopback port. It stays
    up for the life of the process (DeepSpeed caches its groups), so later runs in the same process reuse it."""
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's sanity check reads it
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if info.device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


class DeepSpeedTrainer(Trainer):
    def __init__(self, config: TrainConfig, info: DistInfo) -> None:
        if config.trainer.precision == "fp16":
            raise InputError("--engine deepspeed runs fp32 or bf16 here; use --engine ddp for fp16 with a GradScaler")
        self.engine: Any = None
        super().__init__(config, info)
        if self.resumed_from is not None:
            tag = self.resumed_from.stem
            ds_dir = self.resumed_from.parent.parent / DS_DIR
            if not (ds_dir / tag).is_dir():
                raise InputError(f"{self.resumed_from} has no DeepSpeed optimizer checkpoint at {ds_dir / tag}")
            self.engine.load_checkpoint(str(ds_dir), tag=tag, load_optimizer_states=True,
                                        load_lr_scheduler_states=False)

    def _wrap_modules(self) -> None:
        import deepspeed

        if len(self.groups) != 1:
            raise InputError(f"--engine deepspeed supports one optimizer; the {self.config.task} task has "
                             f"{len(self.groups)} ({', '.join(self.groups)}): use --engine ddp")
        _single_process_group(self.info)
        if self.config.trainer.deepspeed_config:
            import json

            ds_config = json.loads(Path(self.config.trainer.deepspeed_config).read_text(encoding="utf-8"))
        else:
            ds_config = default_ds_config(self.config)
        group = next(iter(self.groups.values()))

        def wrap(module: torch.nn.Module) -> torch.nn.Module:
            engine, _, _, _ = deepspeed.initialize(model=module, optimizer=group.optimizer,
                                                   lr_scheduler=group.scheduler, config=ds_config)
            self.engine = engine
            return engine

        self.task.wrap(wrap)
        log.info("DeepSpeed ZeRO-%s engine on %d rank(s)", ds_config.get("zero_optimization", {}).get("stage", 0),
                 self.info.world_size)

    # ---- StepContext: DeepSpeed scales by the accumulation, reduces, clips and steps ---------------------------
    def backward(self, loss: torch.Tensor, group: str) -> None:
        self.engine.backward(loss)

    def update(self, group: str) -> None:
        self.engine.step()  # a no-op for the optimizer except on accumulation boundaries (also steps the schedule)
        if self.boundary:
            norm = self.engine.get_global_grad_norm()
            self.groups[group].grad_norm = float(norm) if norm is not None else float("nan")

    def _micro_step(self, batch, boundary: bool) -> dict[str, float]:
        self.boundary = boundary
        return self.task.micro_step(batch, self)  # type: ignore[arg-type]

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        state = super().state()
        del state["optimizers"]  # sharded across ranks: in DeepSpeed's own checkpoint
        state["deepspeed_tag"] = f"step_{self.step:08d}"
        return state

    def save(self) -> Path | None:
        tag = f"step_{self.step:08d}"
        self.engine.save_checkpoint(str(Path(self.config.trainer.out_dir) / DS_DIR), tag=tag)  # collective
        path = super().save()
        if path is not None:
            assert path.parent.name == CHECKPOINT_DIR and path.stem == tag
        return path
