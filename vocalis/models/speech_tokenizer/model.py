"""`SupervisedSpeechTokenizer`: 16 kHz speech -> 25 Hz discrete ids, trained with CTC on transcripts.

    wav 16 kHz -> Whisper log-mel (128, T) 100 Hz -> ConvSubsampler x4 -> encoder transformer (25 Hz)
      -> Linear(d, D) -> FSQ (D scalars, L levels: id in [0, L**D)) -> Linear(D, d) -> decoder transformer
      -> Linear(d, num_symbols) CTC logits

The ids are the FSQ indices; the CTC decoder exists only to make them carry the linguistic content
(the official S3 tokenizer is trained the same way, with an ASR loss behind the quantiser).

Shape legend: B batch, T mel frames (100 Hz), T4 = ceil(T / 4) token frames (25 Hz), V symbols.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.models.speech_tokenizer.config import SpeechTokenizerConfig
from vocalis.models.speech_tokenizer.encoder import ConvSubsampler, TransformerStack, length_mask
from vocalis.models.speech_tokenizer.fsq import FSQ
from vocalis.models.speech_tokenizer.symbols import BLANK_ID

logger = logging.getLogger(__name__)


def pad_mels(mels: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """List of (n_mels, T_i) -> (zero-padded batch (B, n_mels, max T), lengths (B,) int64)."""
    lengths = torch.tensor([m.shape[1] for m in mels], dtype=torch.int64)
    batch = mels[0].new_zeros(len(mels), mels[0].shape[0], int(lengths.max()))
    for i, m in enumerate(mels):
        batch[i, :, : m.shape[1]] = m
    return batch, lengths


class SupervisedSpeechTokenizer(nn.Module):
    """Mel encoder + FSQ bottleneck + CTC head. See the module docstring for the data flow."""

    def __init__(self, config: SpeechTokenizerConfig) -> None:
        super().__init__()
        cfg = config
        self.config = cfg
        self.subsample = ConvSubsampler(cfg.n_mels, cfg.d_model)
        self.encoder = TransformerStack(
            cfg.encoder_layers, cfg.d_model, cfg.num_heads, cfg.ffn_dim, cfg.dropout, cfg.rope_theta
        )
        self.to_fsq = nn.Linear(cfg.d_model, cfg.fsq_dim)
        self.fsq = FSQ(cfg.fsq_levels, cfg.fsq_dim)
        self.from_fsq = nn.Linear(cfg.fsq_dim, cfg.d_model)
        self.decoder = TransformerStack(
            cfg.decoder_layers, cfg.d_model, cfg.num_heads, cfg.ffn_dim, cfg.dropout, cfg.rope_theta
        )
        self.ctc_head = nn.Linear(cfg.d_model, cfg.num_symbols)

    @property
    def codebook_size(self) -> int:
        return self.config.codebook_size

    def encode(
        self, mel: torch.Tensor, mel_lens: torch.Tensor, quantize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mel (B, n_mels, T), mel_lens (B,)) -> (codes (B, T4) int64, quantised (B, T4, D), lens (B,)).

        Codes past `lens` are 0. `quantize=False`: the FSQ values unrounded (training warm-up, see `FSQ`).
        """
        if mel.dim() != 3 or mel.shape[1] != self.config.n_mels:
            raise ValueError(f"expected mel (B, {self.config.n_mels}, T), got {tuple(mel.shape)}")
        if bool((mel_lens < 1).any()):
            raise ValueError("every mel length must be >= 1")
        x, lens = self.subsample(mel, mel_lens.to(torch.int64))  # (B, T4, d)
        mask = length_mask(lens, x.shape[1])
        x = self.encoder(x, mask)
        quantised, codes = self.fsq(self.to_fsq(x), quantize)  # (B, T4, D), (B, T4)
        return codes.masked_fill(~mask, 0), quantised, lens

    def forward(
        self, mel: torch.Tensor, mel_lens: torch.Tensor, quantize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mel (B, n_mels, T), mel_lens (B,)) -> (codes (B, T4), ctc_logits (B, T4, V), lens (B,))."""
        codes, quantised, lens = self.encode(mel, mel_lens, quantize)
        mask = length_mask(lens, codes.shape[1])
        h = self.decoder(self.from_fsq(quantised), mask)
        return codes, self.ctc_head(h), lens

    def loss(
        self,
        mel: torch.Tensor,
        mel_lens: torch.Tensor,
        targets: torch.Tensor,
        target_lens: torch.Tensor,
        quantize: bool = True,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """CTC loss, averaged per target symbol over the batch.

        `targets` (B, U) padded symbol ids (no blanks), `target_lens` (B,). Utterances whose target cannot
        fit their frames (too many symbols for 25 Hz) contribute 0 and are counted in `ctc_infeasible`.
        Metrics: `ctc` (the loss), `code_usage` (distinct ids / valid frames in the batch),
        `code_perplexity` (exp entropy of the batch's id histogram), `ctc_infeasible`.
        """
        codes, logits, lens = self(mel, mel_lens, quantize)
        log_probs = F.log_softmax(logits.float(), dim=-1).transpose(0, 1)  # (T4, B, V)
        per_utt = F.ctc_loss(
            log_probs, targets, lens, target_lens, blank=BLANK_ID, reduction="none", zero_infinity=True
        )  # (B,)
        loss = per_utt.sum() / target_lens.clamp(min=1).sum()
        with torch.no_grad():
            valid = codes[length_mask(lens, codes.shape[1])]
            counts = torch.bincount(valid, minlength=self.codebook_size).float()
            probs = counts[counts > 0] / counts.sum()
            metrics = {
                "ctc": float(loss.detach()),
                "code_usage": float((counts > 0).sum() / max(valid.numel(), 1)),
                "code_perplexity": float(torch.exp(-(probs * probs.log()).sum())),
                "ctc_infeasible": float((target_lens > lens).sum()),
            }
        return loss, metrics

    @torch.no_grad()
    def tokenize_mels(self, mels: Sequence[torch.Tensor]) -> list[list[int]]:
        """Several clips' 128-bin log-mels (`frontend.audio.whisper_log_mel` of 16 kHz audio, each (128, T_i) on this
        model's device) -> their 25 Hz ids, one padded forward pass (eval mode)."""
        device = self.ctc_head.weight.device
        mel, mel_lens = pad_mels(mels)
        was_training = self.training
        self.eval()
        try:
            codes, _, lens = self.encode(mel, mel_lens.to(device))
        finally:
            self.train(was_training)
        return [row[: int(n)].tolist() for row, n in zip(codes.cpu(), lens.cpu())]


def greedy_ctc_decode(ctc_logits: torch.Tensor, lens: torch.Tensor) -> list[list[int]]:
    """Best path: argmax per frame, merge repeats, drop blanks. (B, T4, V), (B,) -> symbol ids per utterance."""
    best = ctc_logits.argmax(-1).cpu()
    out = []
    for row, n in zip(best, lens.cpu()):
        ids = torch.unique_consecutive(row[: int(n)])
        out.append([int(i) for i in ids if i != BLANK_ID])
    return out


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance between two id sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]
