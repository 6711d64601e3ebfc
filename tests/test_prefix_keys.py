"""Prefix-cache keys: chained over the parent block's key and a cryptographic digest, not Python's hash()."""

from __future__ import annotations

import hashlib

from test_engine_blocks import computed, seq

from qtoolkit.engine import block_manager
from qtoolkit.engine.block_manager import BlockManager, chain_hash


def test_keys_chain_over_the_parent_and_are_digests():
    k1 = chain_hash(None, (1, 2, 3, 4))
    assert isinstance(k1, bytes) and len(k1) == 16 and k1 == chain_hash(None, (1, 2, 3, 4))
    assert chain_hash(k1, (5, 6, 7, 8)) != chain_hash(chain_hash(None, (9, 9, 9, 9)), (5, 6, 7, 8))
    assert chain_hash(None, (1, 2)) != chain_hash(None, (2, 1)) and chain_hash(None, (256,)) != chain_hash(None, (1, 0))


def test_same_block_under_another_prefix_is_not_reused():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    computed(bm, a)
    b = seq([0, 2, 3, 4, 5, 6, 7, 8, 9])  # its second block equals a's, its first does not
    assert bm.match_prefix(b) == []
    c = seq([1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert bm.match_prefix(c) == a.block_table[:1]


def test_a_forced_key_collision_cannot_serve_another_prompts_kv(monkeypatch):
    """Even a colliding key (forced here) is caught: a hit must also hold the same tokens."""
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: hashlib.sha256(b"same").digest())
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5])
    computed(bm, a)
    assert bm.match_prefix(seq([9, 9, 9, 9, 5])) == []
