"""Per-token log-probabilities of speech-token sequences under the speech LM, for a padded batch.

Each sequence is laid out as the engine decodes it (unistream): [sos] prompt_text + text [task] prompt_speech,
then its speech ids; the position before each speech id predicts it, and the last one predicts eos when the
sequence stopped. One causal pass over the right-padded batch gives all of them.

Legend: B sequences, T positions, L scored targets (speech ids + eos), D hidden, V speech ids + 3.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vocalis.models.speech_lm import Qwen2LM
from vocalis.train.policy_data import SpeechSequence


class SequenceScorer(nn.Module):
    """batch of sequences -> (log-probs (B, L), mask (B, L)); a module so DDP can wrap the policy's pass."""

    def __init__(self, llm: Qwen2LM) -> None:
        super().__init__()
        self.llm = llm

    def forward(self, seqs: Sequence[SpeechSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(self.llm, seqs)


def token_logprobs(llm: Qwen2LM, seqs: Sequence[SpeechSequence]) -> tuple[torch.Tensor, torch.Tensor]:
    device = llm.speech_embedding.weight.device
    eos = llm.config.eos_token
    inputs, starts, targets = [], [], []
    for s in seqs:
        prefix = llm.prefill_embeddings(s.text_ids, s.prompt_text_ids, s.prompt_speech_ids)[0]  # (P, D)
        speech = llm.embed_speech(s.speech_ids)[0] if s.speech_ids else prefix[:0]  # (N, D)
        inputs.append(torch.cat((prefix, speech)))  # (P + N, D)
        starts.append(prefix.shape[0] - 1)  # position predicting the first speech id
        targets.append(list(s.speech_ids) + ([eos] if s.stopped else []))
    lengths = torch.tensor([x.shape[0] for x in inputs], device=device)
    x = nn.utils.rnn.pad_sequence(inputs, batch_first=True)  # (B, T, D)
    valid = torch.arange(x.shape[1], device=device)[None, :] < lengths[:, None]  # (B, T)
    logits = llm(x, valid)  # (B, T, V)
    num = max(max(len(t) for t in targets), 1)
    b = len(seqs)
    pos = torch.zeros(b, num, dtype=torch.long, device=device)
    ids = torch.zeros(b, num, dtype=torch.long, device=device)
    mask = torch.zeros(b, num, dtype=torch.bool, device=device)
    for i, t in enumerate(targets):
        n = len(t)
        pos[i, :n] = torch.arange(starts[i], starts[i] + n, device=device)
        ids[i, :n] = torch.tensor(t, device=device)
        mask[i, :n] = True
    picked = logits.gather(1, pos[:, :, None].expand(-1, -1, logits.shape[-1]))  # (B, L, V)
    logp = picked.float().log_softmax(dim=-1).gather(2, ids[:, :, None]).squeeze(2)  # (B, L)
    return logp * mask, mask
