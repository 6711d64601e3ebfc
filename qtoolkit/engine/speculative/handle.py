"""A request's KV on the draft side: its blocks in a draft's paged cache and the tokens whose K/V they hold.

A slim stand-in for a Sequence wherever a draft runs: the BlockManager grows, shrinks and releases it like one
(block_table, block_hashes, num_computed_tokens), and a ModelRunner feeds tokens at its computed position."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model_runner import Chunk


@dataclass
class KVHandle:
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # the BlockManager's bookkeeping; drafts never share
    num_computed_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the tokens whose K/V are computed, in order

    def feed(self, tokens: list[int]) -> Chunk:
        """The chunk that runs `tokens` next (one logits row, for the last of them)."""
        return Chunk(tokens, self.num_computed_tokens, self.block_table)

    def computed(self, tokens: list[int]) -> None:
        """`tokens` (just fed) now have K/V."""
        self.token_ids += tokens
        self.num_computed_tokens += len(tokens)

    def truncate(self, num_tokens: int) -> None:
        """Forget K/V past the first `num_tokens` (the caller hands back the blocks)."""
        del self.token_ids[num_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)
