"""Block manager: allocation, reference counts, prefix hits by hashed full blocks, eviction order."""

from __future__ import annotations

from vocalis.config import SpeechLMConfig
from vocalis.engine.block_manager import BlockManager
from vocalis.engine.id_space import IdSpace
from vocalis.engine.request import Request


def _computed(bm: BlockManager, req: Request, n: int) -> None:
    """What the engine does after a step: positions computed, full blocks registered."""
    req.num_computed_tokens += n
    bm.cache_full_blocks(req)


def test_allocate_free_and_ref_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Request(list(range(10)))
    assert bm.allocate_slots(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in a.block_table)
    _computed(bm, a, 10)
    assert len(a.block_hashes) == 2  # two full blocks registered, the third is partial
    # growing by one position inside the last block needs no new block; crossing a boundary needs one
    a.token_ids.extend([100, 101])
    assert bm.allocate_slots(a, 1) and len(a.block_table) == 3
    _computed(bm, a, 1)
    assert bm.allocate_slots(a, 2) and len(a.block_table) == 4
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.block_hashes == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = Request(list(range(20)))
    assert not bm.allocate_slots(a, 20)
    assert a.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(a, 12)  # chunked: only what fits
    assert bm.num_free_blocks == 0


def test_prefix_hits_share_blocks_and_leave_one_position() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    ids = IdSpace.for_config(SpeechLMConfig())
    voice_text = list(range(200, 211))  # [sos] + 11 prompt-text ids = 12 positions = 3 full blocks
    a = Request(ids.prompt([1, 2, 3], voice_text, [5, 6, 7]))
    assert bm.match_prefix(a) == []
    assert bm.allocate_slots(a, a.num_tokens)
    _computed(bm, a, a.num_tokens)
    # same voice, other text: the three [sos] + prompt text blocks are shared, nothing after them
    b = Request(ids.prompt([9, 9], voice_text, [5, 6, 7]))
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:3]
    assert bm.allocate_slots(b, b.num_tokens - 12, hits)
    assert b.block_table[:3] == a.block_table[:3]
    assert all(bm.blocks[x].ref_count == 2 for x in hits)
    assert bm.num_prefix_hits == 3
    # an identical request shares all full blocks but must compute at least its last position
    c = Request(list(a.token_ids[:16]))  # four full blocks, all cached
    assert bm.match_prefix(c) == a.block_table[:3]
    bm.free(a)
    assert all(bm.blocks[x].ref_count == 1 for x in hits)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_text_and_speech_ids_never_collide() -> None:
    ids = IdSpace.for_config(SpeechLMConfig())
    assert set(ids.text(range(50))).isdisjoint(ids.speech(range(50)))
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Request([ids.sos, *ids.text([7, 8, 9])])
    assert bm.allocate_slots(a, a.num_tokens)
    _computed(bm, a, a.num_tokens)
    b = Request([ids.sos, *ids.speech([7, 8, 9])])  # same table rows, other table: no hit
    assert bm.match_prefix(b) == []


def test_freed_blocks_stay_cached_until_reused_tail_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Request([1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial
    assert bm.allocate_slots(a, 7)
    _computed(bm, a, 7)
    head, second, third, last = a.block_table
    bm.free(a)
    # a later identical request still finds the cached prefix
    again = Request([1, 2, 3, 4, 5, 6, 7])
    assert bm.match_prefix(again) == [head, second, third]
    # a new request needing one block takes the unhashed partial block first, then the tail (third)
    other = Request([9])
    assert bm.allocate_slots(other, 1) and other.block_table == [last]
    other2 = Request([8, 8, 8])
    assert bm.allocate_slots(other2, 3) and other2.block_table == [third, second]
    assert bm.match_prefix(again) == [head]  # evicted blocks no longer match


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = Request([1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    _computed(bm, a, 5)
    assert bm.match_prefix(Request([1, 2, 3, 4, 5])) == []
