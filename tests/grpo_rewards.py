"""A reward for the GRPO tests, plugged in as `grpo_rewards:even_ids`: the share of even speech ids in a rollout.
An untrained model scores about 0.5; only a trained one approaches 1."""

from __future__ import annotations

from collections.abc import Sequence

from vocalis.train.policy_config import GRPOConfig
from vocalis.train.rewards import Rollout


def even_ids(config: GRPOConfig):
    def score(rollouts: Sequence[Rollout]) -> list[float]:
        return [sum(1 for i in r.sequence.speech_ids if i % 2 == 0) / max(len(r.sequence.speech_ids), 1)
                for r in rollouts]

    return score
