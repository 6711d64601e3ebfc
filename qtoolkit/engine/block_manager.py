"""Paged KV cache bookkeeping: fixed-size blocks, a free list, ref counts, and prefix caching by hash chain.

Only full blocks whose K/V have been computed are registered for reuse, so a sequence that hits the cache
never reads a block another sequence is still filling. Freed blocks keep their hash until the free list
hands them out again (least recently freed first), so a finished or preempted prompt can still be reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol

from .sequence import Sequence

_ROOT = b"qtoolkit-prefix-cache-v1"
HOLE = -1  # a block_table entry whose block was freed: it lies wholly outside every layer's sliding window


def chain_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """A block's key: a digest over its parent's key and its own token ids, so equal keys mean equal prefixes.

    Python's hash() of the block's tokens alone let two different prefixes share KV on a collision (the class
    of bug behind vLLM's CVE-2025-25183); a 128-bit BLAKE2b over the chain makes a collision infeasible.
    Token ids are packed as uint32 in native byte order (vocabularies stay below 2**32; keys never leave
    the process)."""
    ids = array("I", tokens)
    if ids.itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit on this platform")
    digest = hashlib.blake2b(parent or _ROOT, digest_size=16)
    digest.update(ids.tobytes())
    return digest.digest()


class KVOwner(Protocol):
    """Whatever holds blocks: a Sequence, or a draft's KV handle (speculative/handle.py)."""

    block_table: list[int]
    block_hashes: list[bytes]
    num_computed_tokens: int


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.tokens: tuple[int, ...] | None = None  # kept to rule out hash collisions on a hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # chain key -> block id
        self.num_prefix_hits = 0  # tokens served from the prefix cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the sequence's leading full blocks (never its last token: it must be run)."""
        if not self.enable_prefix_caching:
            return []
        bs, ids, parent, hits = self.block_size, seq.token_ids, None, []
        for i in range((len(ids) - 1) // bs):
            tokens = tuple(ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks stay where they are; only free blocks carry a stale hash)."""
        for block_id in self.free:
            block = self.blocks[block_id]
            block.hash = block.tokens = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].hash is not None}

    def take_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give `seq` (holding no blocks yet) the matched cached blocks and mark those tokens computed."""
        assert not seq.block_table
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        seq.num_computed_tokens = len(block_ids) * self.block_size
        self.num_prefix_hits += seq.num_computed_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: publish the sequence's newly completed blocks so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached and block.hash is None:
                block.hash, block.tokens = h, tokens
                self.cached[h] = block.block_id

    # -- allocation -----------------------------------------------------------------------------------
    def can_grow(self, seq: KVOwner, num_tokens: int, reserve: int = 0) -> bool:
        """Whether `seq` can hold `num_tokens` tokens in total, leaving `reserve` blocks free."""
        return self.blocks_needed(num_tokens) - len(seq.block_table) + reserve <= len(self.free)

    def grow(self, seq: KVOwner, num_tokens: int) -> None:
        """Append fresh blocks until `seq` can hold `num_tokens` tokens (caller checked can_grow)."""
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached prefix entry: the block gets new contents
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash = block.tokens = None
            block.ref_count = 1
            seq.block_table.append(block_id)

    def shrink(self, seq: KVOwner, num_tokens: int) -> None:
        """Roll back: free the tail blocks `seq` no longer needs to hold `num_tokens` tokens (rejected draft
        tokens' slots). Those blocks were never registered for reuse: only computed tokens are."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = None
        del seq.block_hashes[keep:]

    def free_before(self, seq: KVOwner, position: int) -> None:
        """Free the blocks wholly before `position`, which no later query of `seq` reads (every layer slides its
        window past them). Their table entries become HOLE so positions keep their block index; a freed block
        keeps its prefix hash until reused, like any freed block."""
        i = min(position // self.block_size, len(seq.block_table)) - 1
        while i >= 0 and seq.block_table[i] != HOLE:
            block = self.blocks[seq.block_table[i]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = None
            seq.block_table[i] = HOLE
            i -= 1

    def release(self, seq: KVOwner) -> None:
        """Drop the sequence's references; tail blocks are freed first so shared prefixes stay cached longest."""
        for block_id in reversed(seq.block_table):
            if block_id == HOLE:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, "block freed twice"
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
