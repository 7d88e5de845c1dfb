"""DPO on preference pairs: raise the policy's log-likelihood margin of the chosen over the rejected speech
sequence, measured against a frozen reference model (the starting weights).

Per pair, with sequence log-probs (summed over speech ids and eos) under the policy (pi) and the reference (ref):
    margin = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    loss = -(1 - s) * log sigmoid(margin) - s * log sigmoid(-margin)      (s: dpo.label_smoothing)
Metrics: loss, margin (the chosen-minus-rejected implicit reward), accuracy (share of pairs with margin > 0),
and each side's implicit reward beta * (pi - ref).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vocalis.train.policy_data import Pair, read_pairs, shuffled_positions
from vocalis.train.policy_trainer import PolicyObjective, PolicyTrainer
from vocalis.train.sequence_logp import token_logprobs


class DPOObjective(PolicyObjective):
    name = "dpo"

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer
        config = trainer.config
        self.beta = config.dpo.beta
        self.smoothing = config.dpo.label_smoothing
        self.pairs = read_pairs(config.policy.data, trainer.policy.config.num_speech_rows - 3)

    def items_for_step(self, step: int) -> list[Pair]:
        """The step's pairs over all ranks: epochs of a seeded shuffle, read in order."""
        k = self.trainer.config.policy.global_batch
        return [self.pairs[i] for i in shuffled_positions(len(self.pairs), self.trainer.config.trainer.seed,
                                                           step * k, k)]

    def loss(self, items: Sequence[Pair], micro_batch: int) -> tuple[torch.Tensor, dict[str, float]]:
        seqs = [p.chosen for p in items] + [p.rejected for p in items]
        logp, _ = self.trainer.scorer(seqs)  # (2n, L)
        with torch.no_grad():
            ref, _ = token_logprobs(self.trainer.reference, seqs)
        n = len(items)
        pi, rf = logp.sum(dim=1), ref.sum(dim=1)  # (2n,)
        chosen, rejected = self.beta * (pi[:n] - rf[:n]), self.beta * (pi[n:] - rf[n:])  # (n,)
        margin = chosen - rejected
        losses = -(1 - self.smoothing) * F.logsigmoid(margin) - self.smoothing * F.logsigmoid(-margin)
        m = margin.detach()
        return losses.sum() / micro_batch, {
            "loss": float(losses.detach().sum()), "margin": float(m.sum()), "accuracy": float((m > 0).float().sum()),
            "reward_chosen": float(chosen.detach().sum()), "reward_rejected": float(rejected.detach().sum()),
        }
