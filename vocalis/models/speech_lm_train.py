"""Training objective of the speech LM (`Qwen2LM.forward` / `prepare_lm_input_target` of the official code).

Per sample, either a unistream sequence [sos] + text + [task_id] + speech -> targets
[ignore]*(1 + text_len) + speech + [eos], or (with probability `bistream_prob`, only when speech_len/text_len
exceeds mix_ratio 15/5) a bistream sequence: blocks of 5 text + 15 speech whose last text position predicts
the block's first speech id and whose last speech position predicts the fill id, then a final block of the
remaining text + [task_id] + remaining speech ending in eos. Loss: label-smoothed KL (= cross-entropy at
smoothing 0) summed over non-ignored targets and divided by their number; plus token accuracy.

Legend: B batch, T positions, D hidden, V speech ids + 3.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vocalis.models.speech_lm import SOS_ROW, TASK_ID_ROW, Qwen2LM

IGNORE_ID = -1


@dataclass(frozen=True, slots=True)
class LMTrainOutput:
    loss: torch.Tensor  # scalar
    acc: torch.Tensor  # scalar, fraction of non-ignored targets predicted exactly


def build_sequence(
    model: Qwen2LM,
    text_emb: torch.Tensor,
    speech_ids: torch.Tensor,
    speech_emb: torch.Tensor,
    bistream: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample: text_emb (Nt, D), speech_ids (Ns,), speech_emb (Ns, D) -> inputs (L, D), targets (L,)."""
    c = model.config
    sos = model.llm_embedding.weight[SOS_ROW : SOS_ROW + 1]  # (1, D)
    task_id = model.llm_embedding.weight[TASK_ID_ROW : TASK_ID_ROW + 1]  # (1, D)
    eos = speech_ids.new_tensor([c.eos_token])
    n_text_total = text_emb.shape[0]
    if not bistream:
        inputs = torch.cat((sos, text_emb, task_id, speech_emb), dim=0)
        targets = torch.cat((speech_ids.new_full((1 + n_text_total,), IGNORE_ID), speech_ids, eos))
        return inputs, targets
    n_text, n_speech = c.mix_ratio
    parts, labels = [sos], [speech_ids.new_full((1,), IGNORE_ID)]
    for j in range(-(-(n_text_total + 1) // n_text)):  # ceil((text_len + 1) / n_text) blocks
        text = text_emb[j * n_text : (j + 1) * n_text]
        if text.shape[0] == n_text:
            speech = speech_ids[j * n_speech : (j + 1) * n_speech]
            assert speech.shape[0] == n_speech, "bistream needs speech_len > text_len * 15/5"
            parts += [text, speech_emb[j * n_speech : (j + 1) * n_speech]]
            labels += [speech_ids.new_full((n_text - 1,), IGNORE_ID), speech, speech_ids.new_tensor([c.fill_token])]
        else:
            parts += [text, task_id, speech_emb[j * n_speech :]]
            labels += [speech_ids.new_full((text.shape[0],), IGNORE_ID), speech_ids[j * n_speech :], eos]
    return torch.cat(parts, dim=0), torch.cat(labels)


def label_smoothing_loss(logits: torch.Tensor, targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    """KL(smoothed one-hot || softmax(logits)) summed over targets != IGNORE_ID, divided by their count.
    logits (B, T, V), targets (B, T)."""
    v = logits.shape[-1]
    logp = logits.reshape(-1, v).log_softmax(dim=-1)  # (B*T, V)
    flat = targets.reshape(-1)
    keep = flat != IGNORE_ID
    true_dist = torch.full_like(logp, smoothing / (v - 1))
    true_dist.scatter_(1, flat.clamp(min=0)[:, None], 1.0 - smoothing)
    kl = F.kl_div(logp, true_dist, reduction="none").sum(dim=-1)  # (B*T,)
    return (kl * keep).sum() / keep.sum().clamp(min=1)


def masked_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Share of non-ignored targets equal to the arg-max of logits (B, T, V)."""
    keep = targets != IGNORE_ID
    hits = (logits.argmax(dim=-1) == targets) & keep
    return hits.sum() / keep.sum().clamp(min=1)


def lm_training_forward(
    model: Qwen2LM,
    text_token: torch.Tensor,
    text_token_len: torch.Tensor,
    speech_token: torch.Tensor,
    speech_token_len: torch.Tensor,
    rng: random.Random | None = None,
    bistream_prob: float = 0.5,
) -> LMTrainOutput:
    """text_token (B, Nt) and speech_token (B, Ns), 0-padded, with lengths (B,) -> loss and accuracy.
    `rng` draws the uni/bistream choice once per sample (a fresh unseeded Random when None)."""
    rng = rng or random.Random()
    c = model.config
    n_text, n_speech = c.mix_ratio
    text_emb = model.qwen.embed_tokens(text_token)  # (B, Nt, D)
    speech_emb = model.speech_embedding(speech_token)  # (B, Ns, D)
    inputs, targets = [], []
    for i in range(text_token.shape[0]):
        nt, ns = int(text_token_len[i]), int(speech_token_len[i])
        # The draw happens for every sample (as in the official loop), eligible or not.
        bistream = rng.random() < bistream_prob and ns * n_text > n_speech * nt
        x, y = build_sequence(model, text_emb[i, :nt], speech_token[i, :ns].long(), speech_emb[i, :ns], bistream)
        inputs.append(x)
        targets.append(y)
    lengths = torch.tensor([x.shape[0] for x in inputs], device=text_emb.device)
    lm_input = torch.nn.utils.rnn.pad_sequence(inputs, batch_first=True)  # (B, T, D)
    lm_target = torch.nn.utils.rnn.pad_sequence(targets, batch_first=True, padding_value=IGNORE_ID)  # (B, T)
    valid = torch.arange(lm_input.shape[1], device=lengths.device)[None, :] < lengths[:, None]  # (B, T)
    logits = model(lm_input, valid)  # (B, T, V)
    return LMTrainOutput(label_smoothing_loss(logits, lm_target, c.lsm_weight), masked_accuracy(logits, lm_target))
