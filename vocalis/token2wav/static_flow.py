"""A flow call on static shapes, written once for both families (`StaticFlow`): a batch of requests' tokens so far
(prompt first) through the family's encoder (`encode`) and the whole Euler solve (`static_solve.EulerSolve`) as one
function per (rows, tokens, streaming) bucket, run by a `graphs.BucketGraphs` mode (CUDA graphs, `torch.compile`).

Each call recomputes a request's whole prefix, as the reference's streaming calls do, so it keeps no caches: on a
GPU the graph replays in one launch, cheaper there than the incremental path's per-chunk Python and cache
bookkeeping. Rows are right-padded to the bucket and masked:
- the look-ahead conv reads a row's `look` tokens after its `lens` (a non-final call's right context) and zeros
  after those, as the module reads explicit context or zeros;
- every attention hides keys past `lens`, every conv after the look-ahead one is causal, so padded positions never
  reach valid ones;
- padded rows have one valid token (never an all-masked row).
So a row's mel equals the flow module's `inference` on that row alone (float summation order aside).

Legend: R rows (bucket), Tt tokens (bucket), T = ratio x Tt mel frames, C = 80 mel channels.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import nn

from vocalis.frontend.prompt import FlowPrompt
from vocalis.token2wav.graphs import ROW_BUCKETS, TOKEN_BUCKETS, BucketGraphs, bucket
from vocalis.token2wav.static_solve import EulerSolve, Velocity


@dataclass(frozen=True)
class FlowRow:
    """One request's flow call: ids (n,) prompt tokens then generated ones, the last `look` of them right context
    only (3 on a non-final call, 0 on a final one); `streaming`: block-causal attention (False: full)."""

    ids: torch.Tensor
    look: int
    prompt: FlowPrompt
    streaming: bool = True


class StaticFlow:
    """The family's encoder (`encode`, a subclass's) and the Euler solve on bucketed static shapes.

    flow: the family's flow module (its `input_embedding`, `speaker_projection`, `decoder` and `config` are read);
    velocity: its estimator as a `Velocity` (dtype: the compute dtype, weights cast once)."""

    def __init__(self, flow: nn.Module, velocity: Velocity, n_timesteps: int, mode: str = "eager") -> None:
        self.flow = flow
        self.dtype = velocity.dtype
        decoder = flow.decoder
        self.solve = EulerSolve(velocity, decoder.rand_noise, n_timesteps, decoder.config.inference_cfg_rate)
        self.ratio: int = flow.config.token_mel_ratio
        self.graphs = BucketGraphs(self._make, mode)

    def encode(self, tokens: torch.Tensor, lens: torch.Tensor, look: torch.Tensor, streaming: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (R, Tt), lens (R,) positions per row, look (R,) right-context tokens after them -> mu (R, C, T)
        fp32, valid (R, 1, T) float (graph-safe)."""
        raise NotImplementedError

    def _make(self, key: Hashable) -> Callable[..., torch.Tensor]:
        streaming = bool(key[2])  # type: ignore[index]

        def call(tokens: torch.Tensor, lens: torch.Tensor, look: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor) -> torch.Tensor:
            return self.chunk(tokens, lens, look, spks, cond, streaming)

        return call

    def chunk(self, tokens: torch.Tensor, lens: torch.Tensor, look: torch.Tensor, spks: torch.Tensor,
              cond: torch.Tensor, streaming: bool) -> torch.Tensor:
        """A bucket's whole flow call (graph-safe): tokens (R, Tt) long, lens, look (R,) long, spks (R, C)
        projected, cond (R, C, T) prompt mel then zeros -> mel (R, C, T) fp32, zero past each row's ratio x lens."""
        mu, valid = self.encode(tokens, lens, look, streaming)
        return self.solve(mu, valid, spks, cond, streaming)

    def inputs(self, rows: list[FlowRow]) -> tuple[tuple[int, int, bool], tuple[torch.Tensor, ...]]:
        """Rows of one streaming kind -> their bucket key and the padded inputs of `chunk`."""
        dev = self.flow.input_embedding.weight.device
        r, tt = bucket(len(rows), ROW_BUCKETS), bucket(max(row.ids.numel() for row in rows), TOKEN_BUCKETS)
        tokens = torch.zeros(r, tt, dtype=torch.long)
        lens = torch.ones(r, dtype=torch.long)  # padded rows: one valid token
        look = torch.zeros(r, dtype=torch.long)
        cond = torch.zeros(r, self.solve.noise.shape[1], self.ratio * tt)
        emb = torch.zeros(r, rows[0].prompt.embedding.numel())
        for i, row in enumerate(rows):
            n = row.ids.numel()
            tokens[i, :n] = row.ids
            lens[i], look[i] = n - row.look, row.look
            prompt_mel = row.prompt.mel.reshape(-1, cond.shape[1])  # (ratio P, C)
            cond[i, :, : prompt_mel.shape[0]] = prompt_mel.T
            emb[i] = row.prompt.embedding.reshape(-1)
        emb[len(rows):] = emb[0]
        spks = self.flow.speaker_projection(emb.to(dev)).float()
        return (r, tt, rows[0].streaming), (tokens.to(dev), lens.to(dev), look.to(dev), spks, cond.to(dev))

    def __call__(self, rows: list[FlowRow]) -> list[torch.Tensor]:
        """Each row's mel (C, ratio (n - look)), prompt frames included, fp32; rows grouped by kind, in buckets."""
        out: dict[int, torch.Tensor] = {}
        for streaming in (True, False):
            todo = [i for i, row in enumerate(rows) if row.streaming == streaming]
            for part in (todo[a : a + ROW_BUCKETS[-1]] for a in range(0, len(todo), ROW_BUCKETS[-1])):
                key, inputs = self.inputs([rows[i] for i in part])
                mel = self.graphs(key, *inputs)
                for j, i in enumerate(part):
                    out[i] = mel[j, :, : self.ratio * (rows[i].ids.numel() - rows[i].look)]
        return [out[i] for i in range(len(rows))]
