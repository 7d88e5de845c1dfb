"""Batched next-id choice with per-row parameters: min-length masking, temperature, RAS (nucleus + repetition
window) and greedy rows in one batch.

The tensor work (masking, temperature, softmax, the top entries in stable-sort order, top-k/top-p cut) runs on
the whole batch; only the random draw is per row, because torch has no batched multinomial with one generator
per row. Each row draws from its own request's `torch.Generator` and nothing else, with the same calls and values as
`vocalis.reference.sampling.ras_sampling`, so a request's ids do not depend on what else is in the batch and a seeded
request reproduces the reference sampler's ids for the same scores.

Legend: B rows, V speech ids, K the largest top_k in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vocalis.engine.request import Request
from vocalis.kernels.threads import single_thread


class Sampler:
    def __init__(self, eos_id: int, stop_ids: Sequence[int]) -> None:
        self.eos_id = eos_id
        self.stop_ids = list(stop_ids)

    @torch.inference_mode()
    def __call__(self, logp: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """logp: (B, V) log-probabilities (row i for requests[i]) -> one id per row. logp is not modified."""
        if logp.shape[0] == 1:  # one row's ops never fork, and the switch costs more than they do (threads.py)
            return self._sample(logp, requests)
        with single_thread(logp.device):
            return self._sample(logp, requests)

    def _sample(self, logp: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        scores = logp.float()
        masks = [(i, ids) for i, r in enumerate(requests) if (ids := self._masked_ids(r))]
        if len(masks) == 1 and len(requests) == 1:  # the same values in fewer ops (one row: see _ras)
            ids = torch.tensor(masks[0][1], device=scores.device)
            scores = scores.index_fill(1, ids, float("-inf"))
        elif masks:
            scores = scores.clone()
            for i, ids in masks:
                scores[i, ids] = float("-inf")
        out = [0] * len(requests)
        forced = [r.bistream.forced(r.num_output_tokens) if r.bistream is not None else None for r in requests]
        for i, f in enumerate(forced):
            if f is not None:  # [bistream] a fill by position: no draw, like the reference
                out[i] = f
        greedy = [i for i, r in enumerate(requests) if r.params.greedy and forced[i] is None]
        if greedy:
            top = scores[greedy].argmax(dim=-1).tolist()  # first index wins ties, like greedy_sampling
            for i, t in zip(greedy, top):
                out[i] = t
        ras = [i for i, r in enumerate(requests) if not r.params.greedy and forced[i] is None]
        if ras:
            rows = scores if len(ras) == len(requests) else scores[ras]
            for i, t in zip(ras, self._ras([requests[i] for i in ras], rows)):
                out[i] = t
        return out

    def _masked_ids(self, req: Request) -> list[int]:
        """Ids a row may not draw now: below min_len eos (the released model's rule; stop_all_masked: every stop
        id, to force a count); those off a phone model's label path; a bi-stream's own rule."""
        if req.bistream is not None:
            return req.bistream.masked_ids
        masked = req.label_path.masked_ids(req.output_ids) if req.label_path is not None else []
        if req.num_output_tokens < req.params.min_len:
            stops = self.stop_ids if req.params.stop_all_masked else [self.eos_id]
            masked = sorted(set(masked).union(stops)) if masked else stops
        return masked

    def _ras(self, requests: Sequence[Request], scores: torch.Tensor) -> list[int]:
        device = scores.device
        temps = [r.params.temperature for r in requests]
        if len(set(temps)) == 1:
            scores = scores if temps[0] == 1.0 else scores / temps[0]
        else:  # [parity] divide by the Python float per row, exactly as apply_temperature does
            scores = torch.stack([row if t == 1.0 else row / t for row, t in zip(scores, temps)])  # (B, V)
        k = max(r.params.top_k for r in requests)
        head, ids = _top(scores.softmax(dim=-1), k)  # (B, K) each
        # mass before each item (exclusive prefix sum, fp32 as the reference's) against top_p, and at most top_k
        # items: a kept prefix. Compared in Python on the fp32 values (exact): as few torch ops as possible, as
        # small ops right after a decode step run slowly (the thread pool is still winding down)
        before = head[:, :-1].cumsum(dim=-1).tolist()  # (B, K - 1)
        ids_rows = ids.tolist()
        out: list[int] = []
        for row, req in enumerate(requests):
            p = req.params
            top_p = float(np.float32(p.top_p))  # the reference compares fp32 tensors
            kept = 1  # item 0: nothing before it (top_p > 0 and top_k >= 1, as SamplingParams checks)
            while kept < p.top_k and before[row][kept - 1] < top_p:
                kept += 1
            gen = req.make_generator(device)
            draw = _draw(head[row, :kept], gen)
            top = ids_rows[row][draw]
            decoded = req.output_ids[-p.win_size:] if p.win_size > 0 else []
            if sum(1 for t in decoded if t == top) >= p.win_size * p.tau_r:
                # [ras] a repeat-heavy id is excluded and the id redrawn from the full distribution
                row_scores = scores[row].clone()
                row_scores[top] = float("-inf")
                top = _draw(row_scores.softmax(dim=0), gen)
            out.append(top)
        return out


def _top(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k entries of each row's stable descending sort (B, V) -> values (B, K), ids (B, K).

    Why not the sort itself: a full stable sort of every speech id costs a visible share of an int8 batch-1 step,
    for the 25 entries top-k sampling reads. `topk` gives the k largest values but orders ties arbitrarily.
    Taking k + 1: if the (k+1)-th value equals the k-th, a tie crosses the boundary and the stable sort's choice
    among the tied ids is needed: the full sort runs (rare). Otherwise the k taken are the sort's k; they are in
    its order unless two of them tie, where re-sorting them by id and then stably by value restores it (equal
    values by ascending id). So the result is always the sort's."""
    if k >= probs.shape[-1]:
        return probs.sort(dim=-1, descending=True, stable=True)
    vals, ids = probs.topk(k + 1, dim=-1)  # (B, K + 1), descending
    rows = vals.tolist()
    if any(r[k] == r[k - 1] for r in rows):  # a tie at the boundary
        probs, ids = probs.sort(dim=-1, descending=True, stable=True)
        return probs[:, :k], ids[:, :k]
    vals, ids = vals[:, :k], ids[:, :k]
    if any(r[i] == r[i + 1] for r in rows for i in range(k - 1)):  # ties inside (adjacent): order them by id
        ids, by_id = ids.sort(dim=-1)
        vals, order = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, order)
    return vals, ids


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from unnormalised probabilities (N,), consuming only `generator` (as sampling._multinomial_one)."""
    if probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(probs.multinomial(1, replacement=True, generator=generator).item())
