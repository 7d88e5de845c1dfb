"""CosyVoice 3's flow call on static shapes (`token2wav.static_flow.StaticFlow`): its look-ahead conv encoder with
the look-ahead tokens given per row (`Cv3StaticFlow.encode`), and its DiT as a `static_solve.Velocity`
(`DiTVelocity`).

Legend: R rows (bucket), Tt tokens (bucket), T = ratio x Tt mel frames, D DiT width, C = 80 mel channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vocalis.models.cv3.dit import DiT, _modulate, dit_attention_mask, rotary_angles
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.flow.encoder import padding_mask
from vocalis.token2wav.static_flow import StaticFlow
from vocalis.token2wav.static_solve import half_copy


class DiTVelocity:
    """CosyVoice 3's `DiT.forward` with SiLU(time embedding) and the attention mask given."""

    def __init__(self, dit: DiT, dtype: torch.dtype = torch.float32) -> None:
        self.fp32 = dit
        self.dit = half_copy(dit, dtype)
        self.dtype = dtype

    def time_terms(self, t: torch.Tensor) -> torch.Tensor:
        """t (scalar, fp32) -> SiLU of the time embedding (1, D) in the compute dtype."""
        return F.silu(self.fp32.time_embed(t.reshape(1).float())).to(self.dtype)

    def attention(self, mask: torch.Tensor, streaming: bool) -> torch.Tensor:
        """(2R, 1, T) -> SDPA bool mask (2R, 1, T, T)."""
        return dit_attention_mask(mask, streaming, self.dit.config.static_chunk_size)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, terms: torch.Tensor,
                 spks: torch.Tensor, cond: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        dit = self.dit
        valid = mask.transpose(1, 2)  # (2R, T, 1)
        h = dit.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)  # (2R, T, D)
        angles = rotary_angles(dit.rotary_embed.inv_freq, x.shape[-1])  # (T, Dh) fp32
        silu_t = terms.expand(x.shape[0], -1)
        for block in dit.transformer_blocks:
            h = block(h, silu_t, angles, attn, valid)
        scale, shift = dit.norm_out.linear(silu_t).chunk(2, dim=1)
        return dit.proj_out(_modulate(h, shift, scale)).transpose(1, 2)  # (2R, C, T)


class Cv3StaticFlow(StaticFlow):
    """CosyVoice 3's flow on static shapes; dtype: the encoder's and the DiT's compute dtype (weights cast once;
    the Euler state, the time embedding and the rotary angles fp32)."""

    def __init__(self, flow: CausalMaskedDiffWithDiT, n_timesteps: int, mode: str = "eager",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(flow, DiTVelocity(flow.estimator, dtype), n_timesteps, mode)
        self.embedding = half_copy(flow.input_embedding, dtype)
        self.lookahead = half_copy(flow.pre_lookahead_layer, dtype)

    def encode(self, tokens: torch.Tensor, lens: torch.Tensor, look: torch.Tensor, streaming: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`CausalMaskedDiffWithDiT.encode`, the look-ahead conv reading each row's `look` context tokens in place
        -> mu (R, C, T) fp32, valid (R, 1, T)."""
        del streaming  # the encoder has no attention
        seen = padding_mask(lens + look, tokens.shape[1]).transpose(1, 2).to(self.dtype)  # (R, Tt, 1)
        h = self.lookahead(self.embedding(tokens.clamp(min=0)) * seen)  # (R, Tt, C)
        mu = h.float().repeat_interleave(self.ratio, dim=1).transpose(1, 2)  # (R, C, T)
        return mu, padding_mask(lens * self.ratio, mu.shape[2]).float()
