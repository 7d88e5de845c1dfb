"""The training loop: one explicit loop for every task, on one process or many (torchrun).

Per micro-batch: the task's forward/backward under autocast, inside `no_sync()` of every DDP module except on
accumulation boundaries (an accumulation window may span an epoch end); on a boundary each optimizer group is unscaled
(fp16), clipped (its norm logged), stepped (skipped when the norm is not finite), zeroed and scheduled, and the step
counter advances. An epoch ends for all ranks as soon as one rank runs out of batches (a MIN all-reduce per
micro-batch), so no rank waits in a collective the others never reach. A checkpoint records where in the epoch the run
stands, so a resumed run skips exactly the micro-batches already consumed and continues bit-identically on CPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vocalis.checkpoint import load_strict
from vocalis.errors import InputError
from vocalis.train import checkpointing as ckpt
from vocalis.train.config import TrainConfig
from vocalis.train.data import Batch, ShardDataset, make_loader, resolve_shards
from vocalis.train.distributed import (
    DistInfo,
    all_ranks_have,
    gather_objects,
    parameter_digest,
    sum_over_ranks,
)
from vocalis.train.logger import MetricsLogger
from vocalis.train.schedulers import Scheduler
from vocalis.train.task import Task, enable_gradient_checkpointing
from vocalis.train.tasks import build_task

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Group:
    """One optimizer and everything stepping it."""

    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler
    scaler: torch.amp.GradScaler
    grad_norm: float = 0.0
    skipped: int = 0


@dataclass
class _Window:
    """Metrics accumulated between two log lines."""

    sums: dict[str, float] = field(default_factory=dict)
    count: int = 0
    samples: int = 0
    frames: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, metrics: dict[str, float], batch: Batch) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.samples += batch.size
        self.frames += batch.num_frames


def build_optimizer(params: list[nn.Parameter], config: TrainConfig, lr: float) -> torch.optim.Optimizer:
    o = config.optim
    if o.name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    raise InputError(f"unknown optimizer {o.name!r}; choose adam or adamw")


class Trainer:
    def __init__(self, config: TrainConfig, info: DistInfo) -> None:
        self.config = config
        self.info = info
        t = config.trainer
        self.out_dir = Path(t.out_dir)
        self.shards = resolve_shards(config.data.train)
        # Same seed on every rank before building: identical initial weights (DDP also broadcasts rank 0's).
        torch.manual_seed(t.seed)
        self.task: Task = build_task(config, self.shards)
        if t.gradient_checkpointing:
            n = enable_gradient_checkpointing(self.task.checkpointed_layers())
            log.info("gradient checkpointing on %d layers", n)
        for m in (*self.task.modules.values(), *self.task.frozen_modules().values()):
            m.to(info.device)
        self.groups: dict[str, Group] = {}
        for name, params in self.task.groups().items():
            lr = self.task.group_lr(name, config)
            opt = build_optimizer(params, config, lr)
            self.groups[name] = Group(params, opt, Scheduler(opt, config.scheduler, lr),
                                      torch.amp.GradScaler(info.device.type, enabled=t.precision == "fp16"))
        self.ddp: list[DistributedDataParallel] = []
        self._wrap_modules()
        # Per-rank random streams (dropout, objective draws), different on each rank.
        torch.manual_seed(t.seed + 1 + info.rank)
        self.py_rng = random.Random(f"{t.seed}-{info.rank}-objective")
        self.generator = torch.Generator(device=info.device).manual_seed(t.seed * 1000 + info.rank)
        self.resumed_from: Path | None = None
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0
        self.boundary = False
        self._last_saved_step = -1
        if t.resume:
            self._resume(t.resume)
        self.metrics = MetricsLogger(self.out_dir, t.tensorboard, info.is_main)
        self.dataset = ShardDataset(self.shards, config.data, config.task, info.rank, info.world_size,
                                    target_encoder=self.task.target_encoder())

    # ---- set-up ------------------------------------------------------------------------------------------
    def _wrap_modules(self) -> None:
        if self.info.distributed:
            self.task.wrap(self._wrap_ddp)

    def _wrap_ddp(self, module: nn.Module) -> nn.Module:
        dev = self.info.device
        # Buffers are synced once at construction only: none holds running statistics (rand_noise is constant).
        ddp = DistributedDataParallel(module, device_ids=[dev.index] if dev.type == "cuda" else None,
                                      forward_sync_buffers=False)
        self.ddp.append(ddp)
        return ddp

    def _resume(self, where: str) -> None:
        if where == "auto":
            found = ckpt.list_checkpoints(self.out_dir)
            if not found:
                log.info("no checkpoint in %s: starting from scratch", self.out_dir)
                return
            path = found[-1]
        else:
            path = Path(where)
        state = ckpt.load_checkpoint(path)
        self.resumed_from = path
        if state.get("task") != self.config.task:
            raise InputError(f"{path} is a {state.get('task')!r} checkpoint, this run trains {self.config.task!r}")
        fresh = (self.task.optional_parts() & set(self.task.modules)) - set(state["models"])
        if fresh:
            log.info("%s holds no %s: starting %s fresh", path, ", ".join(sorted(fresh)),
                     "them" if len(fresh) > 1 else "it")
        for name, module in self.task.modules.items():
            if name not in fresh:
                load_strict(module, state["models"][name], f"{path}:{name}")
        for name, g in self.groups.items():
            if name in fresh:
                continue
            if name in state.get("optimizers", {}):  # absent with DeepSpeed: its own checkpoint holds them
                g.optimizer.load_state_dict(state["optimizers"][name])
            g.scheduler.load_state_dict(state["schedulers"][name])
            g.scaler.load_state_dict(state["scalers"][name])
        self.task.load_extra_state(state.get("extra", {}))
        self.step, self.epoch, self.batches_in_epoch = state["step"], state["epoch"], state["batches_in_epoch"]
        rngs = state.get("rng", [])
        if len(rngs) == self.info.world_size:
            ckpt.restore_rng(rngs[self.info.rank], self.py_rng, self.generator)
        else:
            log.warning("checkpoint holds RNG states of %d ranks, this run has %d: random streams restart",
                        len(rngs), self.info.world_size)
        self._last_saved_step = self.step
        log.info("resumed from %s at step %d (epoch %d, %d batches in)", path, self.step, self.epoch,
                 self.batches_in_epoch)

    # ---- StepContext ---------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        p = self.config.trainer.precision
        if p == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.info.device.type, dtype=_DTYPES[p])

    def backward(self, loss: torch.Tensor, group: str) -> None:
        self.groups[group].scaler.scale(loss / self.config.trainer.accum_grad).backward()

    def update(self, group: str) -> None:
        if not self.boundary:
            return
        g = self.groups[group]
        clip = self.config.trainer.grad_clip
        g.scaler.unscale_(g.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(g.params, clip if clip > 0 else math.inf)
        g.grad_norm = float(norm)
        if math.isfinite(g.grad_norm):
            g.scaler.step(g.optimizer)
        else:
            g.skipped += 1
            log.warning("step %d: %s gradient norm is %s; update skipped", self.step, group, g.grad_norm)
        g.scaler.update()
        g.optimizer.zero_grad(set_to_none=True)
        g.scheduler.step()

    # ---- loop --------------------------------------------------------------------------------------------
    def _micro_step(self, batch: Batch, boundary: bool) -> dict[str, float]:
        self.boundary = boundary
        with contextlib.ExitStack() as stack:
            if not boundary:
                for m in self.ddp:
                    stack.enter_context(m.no_sync())
            return self.task.micro_step(batch, self)  # type: ignore[arg-type]

    def _finished(self) -> bool:
        t = self.config.trainer
        return (t.max_steps > 0 and self.step >= t.max_steps) or (t.max_epochs > 0 and self.epoch >= t.max_epochs)

    def run(self) -> dict[str, Any]:
        t = self.config.trainer
        if t.max_steps <= 0 and t.max_epochs <= 0:
            raise InputError("set trainer.max_steps or trainer.max_epochs")
        loader = make_loader(self.dataset)
        window = _Window()
        total_samples = total_frames = 0
        run_start = time.perf_counter()
        log.info("training %s on %d rank(s), %s, %s precision, accum %d; metrics: %s", self.config.task,
                 self.info.world_size, self.info.device, t.precision, t.accum_grad, self.metrics.backend)
        micro = 0  # micro-batches into the current accumulation window (windows may span epochs)
        save_pending = False
        while not self._finished():
            self.dataset.set_epoch(self.epoch)
            batches = iter(loader)
            for _ in range(self.batches_in_epoch):  # [resume] replay the epoch's consumed batches unseen
                next(batches, None)
            seen = 0
            while not self._finished():
                batch = next(batches, None)
                if not all_ranks_have(batch is not None, self.info):
                    break
                assert batch is not None
                seen += 1
                self.batches_in_epoch += 1
                boundary = micro + 1 == t.accum_grad
                metrics = self._micro_step(batch.to(self.info.device), boundary)
                window.add(metrics, batch)
                micro = 0 if boundary else micro + 1
                if boundary:
                    self.step += 1
                    if self.step % t.log_every == 0 or self._finished():
                        s, f = self._log(window)
                        total_samples, total_frames = total_samples + s, total_frames + f
                        window = _Window()
                    if save_pending or (t.save_every > 0 and self.step % t.save_every == 0):
                        self.save()
                        save_pending = False
            if t.max_steps > 0 and self.step >= t.max_steps:
                break  # mid-epoch: the checkpoint keeps the position within this epoch
            if seen == 0 and self.batches_in_epoch == 0:
                raise InputError("an epoch gave no batch on some rank: too little data for the ranks, or the "
                                 "filters (data.min_frames, max_frames, text limits) drop everything")
            self.epoch += 1
            self.batches_in_epoch = 0
            if t.save_every == 0:
                # A checkpoint holds no half-accumulated gradients: save now, or at the window's end.
                if micro != 0:
                    save_pending = True
                elif self._last_saved_step != self.step:
                    self.save()
        if window.count:
            s, f = self._log(window)
            total_samples, total_frames = total_samples + s, total_frames + f
        if self._last_saved_step != self.step:
            self.save()
        return self._finish(total_samples, total_frames, time.perf_counter() - run_start)

    def _log(self, window: _Window) -> tuple[int, int]:
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        keys = sorted(window.sums)
        totals = sum_over_ranks([window.sums[k] for k in keys] + [window.count, window.samples, window.frames],
                                self.info)
        n = max(totals[len(keys)], 1)
        samples, frames = int(totals[-2]), int(totals[-1])
        scalars = {k: totals[i] / n for i, k in enumerate(keys)}
        for name, g in self.groups.items():
            suffix = "" if name == "main" else f"_{name}"
            scalars[f"grad_norm{suffix}"] = g.grad_norm
            scalars[f"lr{suffix}"] = g.optimizer.param_groups[0]["lr"]
        scalars["samples_per_s"] = samples / elapsed
        scalars["frames_per_s"] = frames / elapsed
        scalars["epoch"] = self.epoch
        self.metrics.log(self.step, scalars)
        if self.info.is_main:
            shown = " ".join(f"{k} {v:.4g}" for k, v in scalars.items())
            log.info("step %d: %s", self.step, shown)
        return samples, frames

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        rngs = gather_objects(ckpt.capture_rng(self.py_rng, self.generator), self.info)
        return {
            "task": self.config.task,
            "models": {k: {n: v.detach().cpu() for n, v in m.state_dict().items()} for k, m in self.task.modules.items()},
            "optimizers": {k: g.optimizer.state_dict() for k, g in self.groups.items()},
            "schedulers": {k: g.scheduler.state_dict() for k, g in self.groups.items()},
            "scalers": {k: g.scaler.state_dict() for k, g in self.groups.items()},
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "config": self.config.to_dict(),
            "model_config": self.task.model_config.to_dict() if self.task.model_config is not None else None,
            "extra": self.task.extra_state(),
            "rng": rngs,
        }

    def save(self) -> Path | None:
        state = self.state()  # collective (RNG gather): every rank calls it
        self._last_saved_step = self.step
        if not self.info.is_main:
            return None
        path = ckpt.checkpoint_path(self.out_dir, self.step)
        ckpt.save_atomic(state, path)
        self.task.save_artifacts(self.out_dir)
        ckpt.prune(self.out_dir, self.config.trainer.keep_checkpoints)
        log.info("saved %s", path)
        return path

    def _finish(self, samples: int, frames: int, elapsed: float) -> dict[str, Any]:
        digests = gather_objects(parameter_digest(self.task.modules), self.info)
        summary = {
            "task": self.config.task,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.info.world_size,
            "param_digests": digests,
            "replicas_identical": len(set(digests)) == 1,
            "skipped_updates": {k: g.skipped for k, g in self.groups.items()},
            "samples_per_s": samples / max(elapsed, 1e-9),
            "frames_per_s": frames / max(elapsed, 1e-9),
            "metrics_backend": self.metrics.backend,
            "last_checkpoint": str(ckpt.checkpoint_path(self.out_dir, self.step)),
        }
        if not summary["replicas_identical"]:
            log.error("replicas diverged: parameter digests differ across ranks")
        if self.info.is_main:
            (self.out_dir / SUMMARY).write_text(json.dumps(summary, indent=1), encoding="utf-8")
        self.metrics.close()
        return summary
