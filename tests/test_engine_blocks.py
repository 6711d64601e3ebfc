"""Block manager: allocation, release, ref counts, prefix sharing by hash chain, eviction order."""

from __future__ import annotations

from qtoolkit.engine.block_manager import BlockManager
from qtoolkit.engine.params import SamplingParams
from qtoolkit.engine.sequence import Sequence


def seq(ids):
    return Sequence("r", list(ids), SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> None:
    bm.grow(s, len(s))
    s.num_computed_tokens = len(s)
    bm.register_full_blocks(s)


def test_grow_and_release_return_every_block():
    bm = BlockManager(8, 4)
    a = seq(range(10))
    assert bm.can_grow(a, 10) and not bm.can_grow(a, 33)
    bm.grow(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.grow(a, 12)  # still fits in 3 blocks
    assert len(a.block_table) == 3
    bm.release(a)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.num_computed_tokens == 0


def test_prefix_blocks_are_shared_and_refcounted():
    bm = BlockManager(16, 4)
    a = seq(range(11))  # 2 full blocks + 3 tokens
    computed(bm, a)
    b = seq(list(range(8)) + [99, 98, 97, 96, 95])
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    bm.take_prefix(b, hits)
    assert b.num_computed_tokens == 8
    assert all(bm.blocks[i].ref_count == 2 for i in hits)
    bm.grow(b, len(b))
    assert b.block_table[2] not in a.block_table  # its own tail: shared blocks are never written
    bm.release(a)
    assert all(bm.blocks[i].ref_count == 1 for i in hits)
    bm.release(b)
    assert bm.num_free_blocks == 16


def test_hash_chain_needs_the_same_prefix_not_just_the_same_block():
    bm = BlockManager(16, 4)
    computed(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # second block's tokens equal, first block's differ: no hit at all
    assert bm.match_prefix(seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(16, 4)
    computed(bm, seq(range(8)))
    same = seq(range(8))
    assert len(bm.match_prefix(same)) == 1  # the block holding the last token must be recomputed


def test_freed_blocks_stay_cached_until_reused_then_evicted():
    bm = BlockManager(4, 4)
    a = seq(range(9))
    computed(bm, a)
    bm.release(a)
    assert len(bm.match_prefix(seq(range(9)))) == 2  # still cached while free
    hog = seq(range(100, 116))
    bm.grow(hog, 16)  # takes all 4 blocks, evicting the cached ones
    assert bm.match_prefix(seq(range(9))) == []
    bm.release(hog)


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    computed(bm, seq(range(9)))
    assert bm.match_prefix(seq(range(9))) == []
