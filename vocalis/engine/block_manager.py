"""Paged KV blocks: allocation, reference counts and prefix sharing by hashed full blocks. Pure Python.

A block holds `block_size` consecutive positions of one sequence. A block whose positions are all computed
gets a chained hash (its ids and the hash of the block before it), so two requests whose id sequences agree
on whole blocks from position 0 share those blocks' K/V (ref count > 1). What a voice shares: its prompt
layout is [sos] + prompt_text + text + [task] + prompt_speech, so the reusable prefix is [sos] + prompt
text, in whole blocks; the prompt speech sits after the text and its K/V depends on the text. Identical
requests (same voice, same text) share everything but the last block.

Requests with different LoRA adapters never share a block: the chain of a request with an adapter starts from
a root digest of the adapter's name (the same ids give other K/V under other weights).

Freed blocks keep their hash and stay findable until they are reallocated (least recently freed first;
a request's tail blocks are freed before its head, so shared prefixes outlive the tails).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vocalis.engine.request import Request

_ROOT = b"vocalis-kv-v1"  # parent digest of a sequence's first block


def chain_root(adapter: str | None) -> bytes:
    """The parent digest of a sequence's first block: one chain per LoRA adapter (None: the base model's)."""
    if adapter is None:
        return _ROOT
    return hashlib.blake2b(_ROOT + b"/adapter/" + adapter.encode(), digest_size=16).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained digest of one full block (blake2b: collisions are not something a client can craft)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and registered in the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks, in eviction order (front = reused first)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # full-block hash -> block id
        self.num_prefix_hits = 0  # blocks taken from the cache (for metrics and tests)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (some may still carry a reusable cached prefix)."""
        return len(self._free)

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------------------
    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks equal to the request's leading full blocks (not taken yet; see `allocate_slots`).

        At least one position is always left to compute, since the last prompt position's output is needed.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = chain_root(request.adapter)
        for j in range((request.num_tokens - 1) // bs):
            h = block_hash(parent, request.token_ids[j * bs:(j + 1) * bs])
            bid = self._cached.get(h)
            if bid is None:
                break
            hits.append(bid)
            parent = h
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of the request's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = request.block_hashes[-1] if request.block_hashes else chain_root(request.adapter)
        for j in range(len(request.block_hashes), request.num_computed_tokens // bs):
            h = block_hash(parent, request.token_ids[j * bs:(j + 1) * bs])
            request.block_hashes.append(h)
            block = self.blocks[request.block_table[j]]
            if h not in self._cached and block.hash is None:
                block.hash = h
                self._cached[h] = block.block_id
            parent = h

    # ---- allocation ------------------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        needed = self._num_new_blocks(request, num_new_tokens, cached_blocks)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return needed + revived <= len(self._free)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Make the block table cover computed + cached + num_new_tokens positions; False (no change) if the
        free blocks do not suffice. `cached_blocks` (from `match_prefix`, at admission only) are taken first."""
        if not self.can_allocate(request, num_new_tokens, cached_blocks):
            return False
        needed = self._num_new_blocks(request, num_new_tokens, cached_blocks)
        for bid in cached_blocks:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1
            request.block_table.append(bid)
            assert block.hash is not None
            request.block_hashes.append(block.hash)
        self.num_prefix_hits += len(cached_blocks)
        for _ in range(needed):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None:  # evict its cached content
                if self._cached.get(block.hash) == bid:
                    del self._cached[block.hash]
                block.hash = None
            block.ref_count = 1
            request.block_table.append(bid)
        return True

    def _num_new_blocks(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int]) -> int:
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(total) - len(request.block_table) - len(cached_blocks))

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks (tail first); cached ones stay findable until reused."""
        for bid in reversed(request.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {bid} freed more often than allocated")
            if block.ref_count == 0:
                self._free[bid] = None
                if block.hash is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(bid, last=False)
        request.block_table = []
        request.block_hashes = []
