"""`CausalMaskedDiffWithXvec`: 25 Hz speech tokens + prompt mel + x-vector -> 50 Hz 80-bin mel.

tokens -> `input_embedding` -> `UpsampleConformerEncoder` (x2 in time) -> `encoder_proj` = mu; the CFM decoder
turns mu, the projected speaker vector and the prompt-mel condition (prompt frames, then zeros) into mel.
The prompt is an in-context prefix: its tokens go in front of the new ones and its frames are cut from the
output. Parameter names equal the official `flow.pt` keys.

Legend: B batch, Tt tokens, T mel frames (= token_mel_ratio * Tt), D encoder width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.config import FlowConfig
from vocalis.errors import InputError
from vocalis.models.flow.cfm import CausalConditionalCFM
from vocalis.models.flow.encoder import UpsampleConformerEncoder, padding_mask


class CausalMaskedDiffWithXvec(nn.Module):
    """The CosyVoice 2 flow (token-to-mel) model."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        if config.encoder.pre_lookahead_len != config.pre_lookahead_len:
            raise ValueError("FlowConfig.pre_lookahead_len must equal its encoder's pre_lookahead_len")
        if config.encoder.up_stride != config.token_mel_ratio:
            raise ValueError("the encoder's up_stride must equal token_mel_ratio (mel frames per token)")
        self.config = config
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.encoder = UpsampleConformerEncoder(config.encoder)
        self.encoder_proj = nn.Linear(self.encoder.output_size, config.output_size)
        self.decoder = CausalConditionalCFM(config.cfm, config.estimator, mel_dim=config.output_size)

    def speaker_projection(self, embedding: torch.Tensor) -> torch.Tensor:
        """x-vector (B, spk_embed_dim) -> L2-normalised and projected (B, output_size)."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def encode(
        self,
        tokens: torch.Tensor,
        token_lens: torch.Tensor,
        streaming: bool = False,
        finalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (B, Tt), lengths (B,) -> mu (B, T, output_size) and its valid mask (B, 1, T).

        With finalize=False the last `pre_lookahead_len` tokens are only right context for the look-ahead
        conv, so T = token_mel_ratio * (Tt - pre_lookahead_len); this assumes unpadded rows (batch 1).
        """
        valid = padding_mask(token_lens, tokens.size(1)).transpose(1, 2)  # (B, Tt, 1)
        x = self.input_embedding(tokens.clamp(min=0).long()) * valid.to(self.input_embedding.weight.dtype)
        if finalize:
            h, mask = self.encoder(x, token_lens, streaming=streaming)
        else:
            n = self.config.pre_lookahead_len
            if tokens.size(1) <= n:
                raise InputError(f"a non-final flow call needs more than {n} tokens, got {tokens.size(1)}")
            h, mask = self.encoder(x[:, :-n], token_lens, context=x[:, -n:], streaming=streaming)
        return self.encoder_proj(h), mask  # (B, T, 80), (B, 1, T)

    @torch.inference_mode()
    def inference(
        self,
        token: torch.Tensor,
        token_len: torch.Tensor,
        prompt_token: torch.Tensor,
        prompt_token_len: torch.Tensor,
        prompt_feat: torch.Tensor,
        prompt_feat_len: torch.Tensor,
        embedding: torch.Tensor,
        streaming: bool,
        finalize: bool,
    ) -> torch.Tensor:
        """Synthesise mel for `token` continuing the prompt; batch 1.

        token (1, Tt), token_len (1,), prompt_token (1, Tp), prompt_token_len (1,), prompt_feat (1, Tp_mel, 80)
        with Tp_mel = token_mel_ratio * Tp, prompt_feat_len (1,) (unused: the prompt is never padded),
        embedding (1, spk_embed_dim). streaming=True uses block-causal attention everywhere; finalize=False
        withholds the last `pre_lookahead_len` tokens as look-ahead context.
        Returns mel (1, 80, T_out), T_out = token_mel_ratio * (Tt, minus pre_lookahead_len if not finalize).
        """
        del prompt_feat_len
        if token.size(0) != 1:
            raise InputError(f"flow inference takes one request at a time, got batch {token.size(0)}")
        spks = self.speaker_projection(embedding)  # (1, 80)
        tokens = torch.cat([prompt_token.to(token.dtype), token], dim=1)  # (1, Tp + Tt)
        mu, _ = self.encode(tokens, prompt_token_len + token_len, streaming=streaming, finalize=finalize)

        num_frames = mu.size(1)
        num_prompt = prompt_feat.size(1)
        cond = torch.zeros_like(mu)  # (1, T, 80): prompt mel, then zeros
        cond[:, :num_prompt] = prompt_feat.to(mu.dtype)
        mask = torch.ones(1, 1, num_frames, device=mu.device, dtype=mu.dtype)
        mel = self.decoder(
            mu.transpose(1, 2).contiguous(),
            mask,
            spks.to(mu.dtype),
            cond.transpose(1, 2).contiguous(),
            n_timesteps=self.config.cfm.n_timesteps,
            streaming=streaming,
        )  # (1, 80, T)
        return mel[:, :, num_prompt:].float()
