"""`CausalMaskedDiffWithDiT`: the CosyVoice 3 flow, 25 Hz speech tokens + prompt mel + x-vector -> 50 Hz mel.

tokens -> `input_embedding` (80 wide) -> `pre_lookahead_layer` (residual; each token sees `pre_lookahead_len`
tokens to its right) -> repeated `token_mel_ratio` times in time = mu. No conformer encoder, no `encoder_proj`.
The decoder is the CosyVoice 2 `CausalConditionalCFM` (fixed start noise, Euler with classifier-free guidance)
around a `DiT` estimator. The prompt is an in-context prefix: its tokens go in front, its mel is the condition of
the first frames, and those frames are cut from the output. Parameter names equal the official `flow.pt` keys.

Legend: B batch, Tt tokens, T mel frames (= token_mel_ratio * Tt), C = 80 channels, Cp pre-lookahead width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.config.cv3 import CV3FlowConfig
from vocalis.errors import InputError
from vocalis.models.cv3.dit import DiT
from vocalis.models.flow.cfm import CausalConditionalCFM
from vocalis.models.flow.encoder import padding_mask


class PreLookaheadLayer(nn.Module):
    """conv1 (C -> Cp, kernel lookahead + 1, reads to the right) -> leaky ReLU -> causal conv2 (Cp -> C, k=3),
    plus the input (residual)."""

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int) -> None:
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C); context (B, Tc <= pre_lookahead_len, C): embedded right-context tokens, else zeros.
        Returns (B, T, C)."""
        h = x.transpose(1, 2)  # (B, C, T)
        if context is not None and context.size(1) > 0:
            if context.size(1) > self.pre_lookahead_len:
                raise InputError(f"right context has {context.size(1)} tokens, at most {self.pre_lookahead_len}")
            h = torch.cat((h, context.transpose(1, 2)), dim=2)  # (B, C, T + Tc)
        h = F.pad(h, (0, x.size(1) + self.pre_lookahead_len - h.size(2)))  # (B, C, T + lookahead)
        h = F.leaky_relu(self.conv1(h))  # (B, Cp, T)
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))  # causal: (B, C, T)
        return h.transpose(1, 2) + x


class CausalMaskedDiffWithDiT(nn.Module):
    """The CosyVoice 3 flow (token-to-mel) model."""

    def __init__(self, config: CV3FlowConfig) -> None:
        super().__init__()
        if config.estimator.mel_dim != config.output_size or config.estimator.mu_dim != config.output_size:
            raise ValueError("the DiT's mel_dim and mu_dim must equal the flow's output_size")
        self.config = config
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(
            config.input_size, config.pre_lookahead_channels, config.pre_lookahead_len
        )
        self.decoder = CausalConditionalCFM(config.cfm, DiT(config.estimator), mel_dim=config.output_size)

    @property
    def estimator(self) -> DiT:
        return self.decoder.estimator

    def speaker_projection(self, embedding: torch.Tensor) -> torch.Tensor:
        """x-vector (B, spk_embed_dim) -> L2-normalised and projected (B, C)."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def encode(self, tokens: torch.Tensor, token_lens: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Token ids (B, Tt) (prompt tokens first), lengths (B,) -> mu (B, T, C), time-major.

        finalize=True: T = token_mel_ratio * Tt, zeros as right context past the end (padded rows see their own
        zeroed padding, as officially). finalize=False: the last `pre_lookahead_len` tokens are only right
        context, T = token_mel_ratio * (Tt - pre_lookahead_len); this assumes unpadded rows.
        """
        valid = padding_mask(token_lens, tokens.size(1)).transpose(1, 2)  # (B, Tt, 1)
        x = self.input_embedding(tokens.clamp(min=0).long()) * valid.to(self.input_embedding.weight.dtype)
        if finalize:
            h = self.pre_lookahead_layer(x)  # (B, Tt, C)
        else:
            n = self.config.pre_lookahead_len
            if tokens.size(1) <= n:
                raise InputError(f"a non-final flow call needs more than {n} tokens, got {tokens.size(1)}")
            h = self.pre_lookahead_layer(x[:, :-n], context=x[:, -n:])  # (B, Tt - n, C)
        return h.repeat_interleave(self.config.token_mel_ratio, dim=1)  # (B, T, C)

    def condition(self, prompt_feat: torch.Tensor, num_frames: int) -> torch.Tensor:
        """Prompt mel (B, Tp_mel, C), time-major -> decoder condition (B, C, T): prompt frames, then zeros."""
        cond = prompt_feat.new_zeros(prompt_feat.shape[0], num_frames, self.config.output_size)
        cond[:, : prompt_feat.shape[1]] = prompt_feat
        return cond.transpose(1, 2)

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
        """Synthesise mel for `token` continuing the prompt; batch 1 (the engine batches `encode` + the solver).

        token (1, Tt), token_len (1,), prompt_token (1, Tp), prompt_token_len (1,), prompt_feat (1, Tp_mel, C),
        prompt_feat_len (1,) (unused: the prompt is never padded), embedding (1, spk_embed_dim).
        streaming=True: block-causal DiT attention; finalize=False withholds the last `pre_lookahead_len` tokens
        as look-ahead context. Returns mel (1, C, T_out), prompt frames removed, float32.
        """
        del prompt_feat_len
        if token.size(0) != 1:
            raise InputError(f"flow inference takes one request at a time, got batch {token.size(0)}")
        spks = self.speaker_projection(embedding)  # (1, C)
        tokens = torch.cat((prompt_token.to(token.dtype), token), dim=1)  # (1, Tp + Tt)
        mu = self.encode(tokens, prompt_token_len + token_len, finalize=finalize)  # (1, T, C)
        num_frames, num_prompt = mu.size(1), prompt_feat.size(1)
        mask = mu.new_ones(1, 1, num_frames)
        mel = self.decoder(
            mu.transpose(1, 2).contiguous(),
            mask,
            spks.to(mu.dtype),
            self.condition(prompt_feat.to(mu.dtype), num_frames).contiguous(),
            n_timesteps=self.config.cfm.n_timesteps,
            streaming=streaming,
        )  # (1, C, T)
        return mel[:, :, num_prompt:].float()
