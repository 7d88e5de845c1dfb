"""Configuration of preference and reinforcement fine-tuning of the speech LM (`vocalis train dpo | grpo`).

Batch sizes use the official GRPO recipe's names: `global_batch` sequences (DPO: pairs) make one optimizer step
over all ranks, in micro-batches of `micro_batch` per forward pass; the accumulation count follows:
global_batch / (micro_batch x ranks), which must be a whole number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """`[policy]`: data (JSON lines: preference pairs for dpo, prompts for grpo), batch sizes, the rollout model."""

    data: str = ""
    global_batch: int = 32
    micro_batch: int = 4

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.global_batch < self.micro_batch:
            raise ValueError(f"need 1 <= micro_batch <= global_batch, got {self.micro_batch}, {self.global_batch}")

    def accumulation(self, world_size: int, per_step: int | None = None) -> int:
        """Micro-batches per rank per optimizer step; ValueError when the sizes do not divide."""
        total = per_step if per_step is not None else self.global_batch
        if total % (self.micro_batch * world_size):
            raise ValueError(f"policy.global_batch {total} is not a multiple of micro_batch x ranks "
                             f"({self.micro_batch} x {world_size})")
        return total // (self.micro_batch * world_size)


@dataclass(frozen=True, slots=True)
class DPOConfig:
    """`[dpo]`: beta (how far the policy may move from the frozen reference), label smoothing of the preference
    (0: plain DPO; > 0: the conservative variant for noisy labels)."""

    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    """`[grpo]`: group_size G rollouts per prompt (each with its own seed), rewards (scorer names, or
    `module:factory` for your own) and their weights, the clipped objective's epsilon, the KL coefficient to the
    frozen reference, and the rollouts' sampling (the model's RAS by default; temperature scales it).

    Reward settings: `target_tokens_per_text_token` (the length scorer's target: speech ids per text id; 0 = no
    length reward term), `repetition_ngram` (the repetition scorer's n), `asr` (the wer scorer's transcriber:
    pocketsphinx or module:factory), `language`.
    """

    group_size: int = 8
    rewards: tuple[str, ...] = ("length", "repetition")
    reward_weights: tuple[float, ...] = ()  # one per reward; empty = all 1
    clip_eps: float = 0.2
    kl_coef: float = 0.04
    updates_per_rollout: int = 1  # optimizer steps on each rollout batch (the old policy's log-probs fixed)
    temperature: float = 1.0
    target_tokens_per_text_token: float = 0.0  # 0: the length scorer rewards the model's own text-length ratio range
    target_length: int = 0  # > 0: the length scorer's target number of speech ids, whatever the text
    repetition_ngram: int = 4
    asr: str = "pocketsphinx"
    language: str = "en"
    max_len: int = 0  # > 0: cap on speech ids per rollout (the model's text-length bound otherwise)

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2 (advantages compare a group), got {self.group_size}")
        if not self.rewards:
            raise ValueError("grpo.rewards is empty")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"grpo.reward_weights has {len(self.reward_weights)} values for "
                             f"{len(self.rewards)} rewards")
        if self.clip_eps <= 0 or self.kl_coef < 0 or self.temperature <= 0 or self.updates_per_rollout < 1:
            raise ValueError("need grpo.clip_eps > 0, kl_coef >= 0, temperature > 0, updates_per_rollout >= 1")

    def weights(self) -> tuple[float, ...]:
        return self.reward_weights or (1.0,) * len(self.rewards)
