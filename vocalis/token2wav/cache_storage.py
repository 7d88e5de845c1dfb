"""Where the flow caches' keys and values live in host memory (`compact`), for every family's caches.

A chunk makes a request's caches as one tensor per transformer block, K and V, per Euler step (~100 per step at
the CosyVoice 2 0.5B shapes, a few hundred KiB each), allocated among the step's temporaries from malloc's arenas.
They outlive the step, so the arenas can neither reuse nor give back the temporaries' memory around them: at 8
streams of the 0.5B model the holes reach 1-3 GB. Moved into one block per request and Euler step, above glibc's
mmap threshold at the 0.5B shapes (`kernels.heap`), they are mapped and unmapped whole, and what the arenas hold
after a step is free again in one piece. The cost: one more copy of the request's own frames per chunk.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KeyValueCache(Protocol):
    """One request's cache at one Euler step: keys and values per transformer block, replaced (never written in
    place) by the chunks that extend it."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def compact(cache: KeyValueCache) -> None:
    """Move the cache's keys and values into one new tensor per dtype, the cache keeping views of it (same
    values, shapes and dtypes); on a CPU, after each Euler step that extended the cache."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in (*cache.keys, *cache.values):
        by_dtype.setdefault(t.dtype, []).append(t)
    moved: dict[int, torch.Tensor] = {}
    for dtype, tensors in by_dtype.items():
        slab = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
        at = 0
        for t in tensors:
            moved[id(t)] = slab[at : at + t.numel()].view(t.shape).copy_(t)
            at += t.numel()
    cache.keys = [moved[id(t)] for t in cache.keys]
    cache.values = [moved[id(t)] for t in cache.values]
