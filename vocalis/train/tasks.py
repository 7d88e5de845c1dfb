"""The task a training config names (`TrainConfig.task`): one module per part, over the `Task` base (`task`)."""

from __future__ import annotations

from pathlib import Path

from vocalis.train.config import TrainConfig
from vocalis.train.task import Task
from vocalis.train.task_flow import FlowTask
from vocalis.train.task_hift import HiFTTask
from vocalis.train.task_labeller import LabellerTask
from vocalis.train.task_llm import LLMTask
from vocalis.train.task_tokenizer import TokenizerTask


def build_task(config: TrainConfig, shards: list[Path]) -> Task:
    if config.task == "llm":
        return LLMTask(config)
    if config.task == "flow":
        return FlowTask(config)
    if config.task == "hift":
        return HiFTTask(config)
    if config.task == "labeller":
        return LabellerTask(config)
    return TokenizerTask(config, shards)
