"""CosyVoice 2's flow call on static shapes (`token2wav.static_flow.StaticFlow`): its conformer encoder with the
look-ahead tokens given per row (`Cv2StaticFlow.encode`), and its U-Net estimator as a `static_solve.Velocity`
(`UNetVelocity`); `StaticPath`: the engine's chunks on it (`Token2WavConfig.graphs`).

Legend: R rows (bucket), Tt tokens (bucket), T = 2 Tt mel frames, D encoder width, C = 80 mel channels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from vocalis.models.flow.encoder import chunk_attention_mask, padding_mask
from vocalis.models.flow.estimator import CausalConditionalDecoder, attention_bias
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.token2wav.config import CACHE_DTYPES
from vocalis.token2wav.cv2.hift import BucketedBody
from vocalis.token2wav.cv2.state import StreamState
from vocalis.token2wav.static_flow import FlowRow, StaticFlow
from vocalis.token2wav.static_solve import half_copy

if TYPE_CHECKING:
    from vocalis.token2wav.cv2.engine import Token2WavEngine


class UNetVelocity:
    """`CausalConditionalDecoder.forward` with the time terms and attention bias given (the same modules, in the
    same order); the time MLP runs in fp32 on the original module, the rest in `dtype` on a cast copy."""

    def __init__(self, estimator: CausalConditionalDecoder, dtype: torch.dtype = torch.float32) -> None:
        self.fp32 = estimator
        self.est = half_copy(estimator, dtype)
        self.dtype = dtype

    def time_terms(self, t: torch.Tensor) -> torch.Tensor:
        """t (scalar, fp32) -> the time MLP's output (1, 4D) in the compute dtype."""
        est = self.fp32
        return est.time_mlp(est.time_embeddings(t.reshape(1)).float()).to(self.dtype)

    def attention(self, mask: torch.Tensor, streaming: bool) -> torch.Tensor:
        """(2R, 1, T) -> additive bias (2R, T, T): block-causal when streaming, padded keys hidden."""
        return attention_bias(mask, self.est.static_chunk_size if streaming else 0, mask.dtype)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, terms: torch.Tensor,
                 spks: torch.Tensor, cond: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        est = self.est
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)  # (2R, 320, T)
        skips = []
        for resnet, blocks, downsample in est.down_blocks:
            h = _blocks(blocks, resnet(h, mask, terms), attn)
            skips.append(h)
            h = downsample(h * mask)
        for resnet, blocks in est.mid_blocks:
            h = _blocks(blocks, resnet(h, mask, terms), attn)
        for resnet, blocks, upsample in est.up_blocks:
            skip = skips.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)  # (2R, 2D, T)
            h = _blocks(blocks, resnet(h, mask, terms), attn)
            h = upsample(h * mask)
        h = est.final_block(h, mask)
        return est.final_proj(h * mask) * mask


def _blocks(blocks: nn.ModuleList, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    x = h.transpose(1, 2)  # (2R, T, D)
    for block in blocks:
        x = block(x, bias)
    return x.transpose(1, 2)


class Cv2StaticFlow(StaticFlow):
    """CosyVoice 2's flow on static shapes; dtype: the encoder's and the estimator's compute dtype (weights cast
    once; the Euler state and the time MLP fp32)."""

    def __init__(self, flow: CausalMaskedDiffWithXvec, n_timesteps: int, mode: str = "eager",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(flow, UNetVelocity(flow.decoder.estimator, dtype), n_timesteps, mode)
        self.embedding = half_copy(flow.input_embedding, dtype)
        self.encoder = half_copy(flow.encoder, dtype)
        self.proj = half_copy(flow.encoder_proj, dtype)

    def encode(self, tokens: torch.Tensor, lens: torch.Tensor, look: torch.Tensor, streaming: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`UpsampleConformerEncoder.forward` + the projection, the look-ahead conv reading each row's `look`
        context tokens in place -> mu (R, C, T) fp32, valid (R, 1, T)."""
        enc, c = self.encoder, self.encoder.config
        valid = padding_mask(lens, tokens.shape[1])  # (R, 1, Tt)
        seen = padding_mask(lens + look, tokens.shape[1]).transpose(1, 2).to(self.dtype)  # what the conv reads
        xs, pos_emb = enc.embed(self.embedding(tokens.clamp(min=0)) * seen)
        mask = chunk_attention_mask(valid, c.static_chunk_size if streaming else 0)
        xs = enc.pre_lookahead_layer(xs * seen)
        for layer in enc.encoders:
            xs = layer(xs, mask, pos_emb)
        up, up_lens = enc.up_layer(xs.transpose(1, 2), lens)  # (R, D, T)
        valid = padding_mask(up_lens, up.shape[2])  # (R, 1, T)
        xs, pos_emb = enc.up_embed(up.transpose(1, 2))
        mask = chunk_attention_mask(valid, c.static_chunk_size * c.up_stride if streaming else 0)
        for layer in enc.up_encoders:
            xs = layer(xs, mask, pos_emb)
        mu = self.proj(enc.after_norm(xs)).float()  # (R, T, C)
        return mu.transpose(1, 2), valid.float()


class StaticPath:
    """A `Token2WavEngine`'s chunks on static shapes: each request's flow call over its whole prefix (its chunk's
    tokens plus the look-ahead, or all of them on the final call) in buckets, and HiFT's body in buckets (unless a
    backend runs it: `body` None). The schedule, the emitted frames and the HiFT seams are the engine's own.

    The entry point a GPU run selects: `Token2WavConfig(graphs="cuda-graphs", graph_dtype="fp16")` (CUDA graphs
    per bucket, captured on first use) or "reduce-overhead"; "eager" / "compile" run the same functions on a CPU."""

    def __init__(self, engine: Token2WavEngine) -> None:
        self.engine = engine
        mode, dtype = engine.config.graphs, CACHE_DTYPES[engine.config.graph_dtype] or torch.float32
        self.flow = Cv2StaticFlow(engine.flow, engine.n_timesteps, mode, dtype)
        # HiFT's body in fp16 with an fp16 flow (audio rel RMS 1.7e-3 on the tiny preset); bf16 costs it 1.2e-2
        body_dtype = torch.float16 if dtype == torch.float16 else torch.float32
        self.body = None if engine.hift_body is not None else BucketedBody(engine.hift, mode, body_dtype)

    def mels(self, todo: list[tuple[StreamState, bool]]) -> list[torch.Tensor]:
        """Each request's new mel (C, frames) for its chunk (final or not)."""
        e, rows = self.engine, []
        for s, final in todo:
            look = 0 if final else e.stream.pre_lookahead_len
            ids = e._all_ids(s)[: e._chunk_end(s, final) + look]
            rows.append(FlowRow(ids, look, s.prompt, streaming=not e._needs_full_pass(s, final)))
        out = []
        for (s, _), row, mel in zip(todo, rows, self.flow(rows)):
            s.estimator_frames += mel.shape[1] * e.n_timesteps
            s.encoder_tokens += row.ids.numel()
            out.append(mel[:, (s.num_prompt_tokens + s.token_offset) * e.ratio :])
        return out
