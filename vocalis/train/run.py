"""`vocalis train TASK`: configure logging and the process group, run the trainer, clean up.

Launch one process (`vocalis train llm --config c.toml`) or several with
`torchrun --nproc_per_node N -m vocalis train llm --config c.toml`.
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any

import torch

from vocalis.train.config import TrainConfig
from vocalis.train.distributed import DistInfo, cleanup, init_distributed

log = logging.getLogger(__name__)


def train(config: TrainConfig) -> dict[str, Any]:
    if config.trainer.num_threads > 0:
        torch.set_num_threads(config.trainer.num_threads)
    info = init_distributed(config.trainer.device)
    if not info.is_main:  # only rank 0 talks, unless something goes wrong
        logging.getLogger("vocalis").setLevel(logging.WARNING)
    # A 1-rank group made for DeepSpeed is not `info.distributed` and stays: DeepSpeed caches it per process.
    try:
        summary = _run(config, info)
    except BaseException:
        if info.distributed:  # no barrier: the other ranks may sit in a collective that never ends
            cleanup(together=False)
        raise
    if info.distributed:
        # The finished trainer leaves its modules and parameters in reference cycles; collected only at interpreter
        # exit they would be torn down after torch's distributed state (a rank once aborted there), so collect
        # them now, then leave the group together.
        gc.collect()
        cleanup()
    return summary


def _run(config: TrainConfig, info: DistInfo) -> dict[str, Any]:
    """The trainer lives only in this frame, so its modules are unreferenced once it returns."""
    if config.task in ("dpo", "grpo"):
        from vocalis.train.policy_trainer import PolicyTrainer

        if config.task == "dpo":
            from vocalis.train.dpo import DPOObjective as objective
        else:
            from vocalis.train.grpo import GRPOObjective as objective
        return PolicyTrainer(config, info, objective).run()
    if config.trainer.engine == "deepspeed":
        from vocalis.train.deepspeed_engine import DeepSpeedTrainer

        return DeepSpeedTrainer(config, info).run()
    from vocalis.train.trainer import Trainer

    return Trainer(config, info).run()


if __name__ == "__main__":  # pragma: no cover - convenience for `python -m vocalis.train.run`
    sys.exit("use `vocalis train`")
