"""Next-token choice for the speech LM: nucleus, random, repetition-aware (RAS) and greedy sampling.

Every function takes one score vector (V,) (log-probabilities, or any logits) and returns a Python int.
Randomness comes only from the optional `torch.Generator`, so one seeded generator per request gives a
reproducible token stream. Scores passed in are never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from vocalis.config import SamplingConfig


class SampleFn(Protocol):
    """Chooses the next id from scores (V,) given the ids decoded so far in this request."""

    def __call__(self, scores: torch.Tensor, decoded: Sequence[int]) -> int: ...


def _multinomial_one(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(probs.multinomial(1, replacement=True, generator=generator).item())


def apply_temperature(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide scores by `temperature` (> 0). On log-probs this equals softmax(logits / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return scores if temperature == 1.0 else scores / temperature


def random_sampling(scores: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw from the full softmax of `scores` (V,)."""
    return _multinomial_one(scores.softmax(dim=0), generator)


def nucleus_sampling(
    scores: torch.Tensor, top_p: float = 0.8, top_k: int = 25, generator: torch.Generator | None = None
) -> int:
    """Official top-p/top-k rule: sort probabilities descending (stable), keep items while the mass taken
    before them is < top_p and fewer than top_k are kept, then draw from the kept (unnormalised) probabilities.
    """
    probs, ids = scores.softmax(dim=0).sort(descending=True, stable=True)  # (V,)
    head = probs[:top_k]
    # Mass taken before item i (exclusive prefix sum), compared in the probabilities' dtype like the official
    # running sum; the kept set is always a prefix and never empty (the first item has mass 0 before it).
    before = torch.cat((head.new_zeros(1), head[:-1].cumsum(dim=0)))
    num_kept = int((before < top_p).sum().item())
    return int(ids[_multinomial_one(head[:num_kept], generator)].item())


def ras_sampling(
    scores: torch.Tensor,
    decoded: Sequence[int],
    top_p: float = 0.8,
    top_k: int = 25,
    win_size: int = 10,
    tau_r: float = 0.1,
    generator: torch.Generator | None = None,
) -> int:
    """Repetition-aware sampling (VALL-E 2): a nucleus draw, and if that id already occurs at least
    `win_size * tau_r` times in the last `win_size` decoded ids, it is excluded and the id is redrawn from the
    full distribution (current official behaviour; before 2026-02 the redraw could return the same id).
    """
    top = nucleus_sampling(scores, top_p, top_k, generator)
    repeats = sum(1 for t in decoded[-win_size:] if t == top)
    if repeats >= win_size * tau_r:
        scores = scores.clone()
        scores[top] = float("-inf")
        top = random_sampling(scores, generator)
    return top


def greedy_sampling(scores: torch.Tensor, exclude_ids: Sequence[int] = ()) -> int:
    """Arg-max after setting `exclude_ids` to -inf; the first index wins ties."""
    if exclude_ids:
        scores = scores.clone()
        scores[list(exclude_ids)] = float("-inf")
    return int(scores.argmax().item())


def make_sampler(config: SamplingConfig, generator: torch.Generator | None = None) -> SampleFn:
    """RAS with the config's top-p/top-k/window, after temperature, drawing from `generator`."""

    def sample(scores: torch.Tensor, decoded: Sequence[int]) -> int:
        scores = apply_temperature(scores, config.temperature)
        return ras_sampling(scores, decoded, config.top_p, config.top_k, config.win_size, config.tau_r, generator)

    return sample


def make_greedy_sampler(exclude_ids: Sequence[int] = ()) -> SampleFn:
    """Deterministic arg-max (reference decoding); `exclude_ids` are never chosen."""
    excluded = tuple(exclude_ids)

    def sample(scores: torch.Tensor, decoded: Sequence[int]) -> int:
        return greedy_sampling(scores, excluded)

    return sample
