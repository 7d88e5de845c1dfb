"""`vocalis train TASK`: configure logging and the process group, run the trainer, clean up.

Launch one process (`vocalis train llm --config c.toml`) or several with
`torchrun --nproc_per_node N -m vocalis train llm --config c.toml`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from vocalis.train.config import TrainConfig
from vocalis.train.distributed import cleanup, init_distributed

log = logging.getLogger(__name__)


def train(config: TrainConfig) -> dict[str, Any]:
    if config.trainer.num_threads > 0:
        torch.set_num_threads(config.trainer.num_threads)
    info = init_distributed(config.trainer.device)
    if not info.is_main:  # only rank 0 talks, unless something goes wrong
        logging.getLogger("vocalis").setLevel(logging.WARNING)
    try:
        if config.trainer.engine == "deepspeed":
            from vocalis.train.deepspeed_engine import DeepSpeedTrainer

            trainer = DeepSpeedTrainer(config, info)
        else:
            from vocalis.train.trainer import Trainer

            trainer = Trainer(config, info)
        return trainer.run()
    finally:
        if info.distributed:  # a 1-rank group made for DeepSpeed stays: DeepSpeed caches it per process
            cleanup()


if __name__ == "__main__":  # pragma: no cover - convenience for `python -m vocalis.train.run`
    sys.exit("use `vocalis train`")
