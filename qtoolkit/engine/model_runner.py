"""Turns one scheduled step (what each sequence feeds: tokens from a position on, over its block table) into a
flat forward batch over the paged KV cache, runs the model and hands back float32 logits for the rows that need
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from qtoolkit.kernels.cpu_build import engine_ops

from ..model.kv_quant import KV_CACHE_DTYPES, SCALE_BYTES, STORAGE
from ..model.llama import AttentionGroup, ForwardBatch, LlamaModel
from .sequence import Sequence

# Sequences bringing at most this many tokens (decode, speculative verification) share one padded attention
# call; longer prefill chunks get a call each, so a decode batch is never padded up to a prefill's length.
SHORT_QUERY = 16


class Feed(Protocol):
    """What one sequence brings to a forward: `tokens` at positions start, start+1, ... whose K/V go to the slots
    of `block_table`; the last `num_logits` rows get logits. The engine's WorkItem is one."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def start(self) -> int: ...
    @property
    def block_table(self) -> list[int]: ...
    @property
    def num_logits(self) -> int: ...


@dataclass
class Chunk:
    """A Feed built on the spot (draft steps, teacher-forced scoring, tests)."""

    tokens: list[int]
    start: int
    block_table: list[int]
    num_logits: int = 1


@dataclass
class StepOutput:
    logits: torch.Tensor  # [sum(num_logits), vocab], in feed order
    aux: list[torch.Tensor] | None = None  # per feed: [its rows, 3 * hidden] target features, when asked for


def kv_bytes_per_block(model: LlamaModel, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block's K and V over all layers: values in the model's dtype, or FP8/int8 bytes plus one
    fp32 scale per token and KV head."""
    c = model.config
    per_head = c.head_dim * torch.finfo(model.dtype).bits // 8 if kv_cache_dtype == "auto" else \
        c.head_dim + SCALE_BYTES
    return 2 * c.num_layers * block_size * c.num_kv_heads * per_head


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto",
                 shared: ModelRunner | None = None, layer_ids: list[int] | None = None):
        """`kv_cache_dtype`: auto (the model's dtype), fp8 or int8. `shared`: another runner whose cache this one
        reads and writes (a self-draft sharing the target's), its dtype and scales included. `layer_ids`: the
        shared cache's layer each of `model`'s layers reads (a layer-skipping draft keeps some of the target's
        layers, which keep their own cache slices); default layer i reads slice i."""
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        c = model.config
        if shared is not None:
            self.kv_cache_dtype, self.kv_cache, self.kv_scales = shared.kv_cache_dtype, shared.kv_cache, shared.kv_scales
        else:
            if kv_cache_dtype not in KV_CACHE_DTYPES:
                raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is unknown: use {', '.join(KV_CACHE_DTYPES)}")
            self.kv_cache_dtype = kv_cache_dtype
            quantized = kv_cache_dtype != "auto"
            # zeros, not empty: padded block-table entries and masked slots are still read by attention,
            # and 0 * NaN garbage would poison the softmax-weighted sum
            self.kv_cache = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                                        dtype=STORAGE[kv_cache_dtype] if quantized else model.dtype)
            self.kv_scales = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads) if quantized \
                else None
        kind = None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        for i, layer in zip(layer_ids or range(c.num_layers), model.layers, strict=True):
            attn = layer.attn
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            attn.kv_kind = kind
            if kind is not None:
                attn.k_scales, attn.v_scales = self.kv_scales[i, 0], self.kv_scales[i, 1]
            # a checkpoint's calibrated scales serve the cache they were calibrated for; otherwise dynamic ones
            calibrated = attn.kv_calibrated
            attn.kv_static = calibrated if calibrated is not None and calibrated.kind == kind else None
        self.group = c.num_heads // c.num_kv_heads
        self.windows = sorted({w for i in range(c.num_layers) if (w := c.layer_window(i)) is not None})
        # decode and verify rows attend in place over the paged cache when the CPU ops are built
        self.paged_attention = self.kv_cache.device.type == "cpu" and engine_ops() is not None

    def _block_table(self, feeds: list[tuple[Feed, int]]) -> torch.Tensor:
        """[S, max_blocks] int64: the blocks each sequence's attention reads, padded with block 0."""
        bs = self.block_size
        counts = [-(-(f.start + n) // bs) for f, n in feeds]
        table = torch.zeros(len(feeds), max(counts), dtype=torch.long)
        for i, ((f, _), nb) in enumerate(zip(feeds, counts, strict=True)):
            table[i, :nb] = torch.tensor(f.block_table[:nb]).clamp_(min=0)  # a HOLE (freed) reads block 0, masked
        return table

    def _paged_group(self, feeds: list[tuple[Feed, int]], first_row: int) -> AttentionGroup:
        """Short queries for engine_ops.paged_attention: rows stay flat, each knows its sequence and horizon."""
        table = self._block_table(feeds)
        row_seq, row_last = [], []
        for i, (f, n) in enumerate(feeds):
            row_seq += [i] * n
            row_last += range(f.start, f.start + n)
        return AttentionGroup(rows=slice(first_row, first_row + len(row_seq)), num_seqs=len(feeds),
                              q_len=max(n for _, n in feeds), block_table=table, row_seq=torch.tensor(row_seq),
                              row_last=torch.tensor(row_last))

    def _group(self, feeds: list[tuple[Feed, int]], first_row: int) -> AttentionGroup:
        bs, G = self.block_size, self.group
        lens = [n for _, n in feeds]
        S, Q = len(feeds), max(lens)
        table = self._block_table(feeds)
        max_blocks = table.shape[1]
        last_pos = torch.zeros(S, Q, dtype=torch.long)  # the newest position each query row may see
        for i, (f, n) in enumerate(feeds):
            last_pos[i, :n] = torch.arange(f.start, f.start + n)
        slots = torch.arange(max_blocks * bs)[None, None, :]
        mask = slots <= last_pos[:, :, None]  # pad rows see slot 0 only
        # a sliding window of w: a query sees its last w positions (transformers: kv > q - w)
        window_masks = {w: (mask & (slots > last_pos[:, :, None] - w)).unsqueeze(1).repeat(1, 1, G, 1)
                        for w in self.windows}
        group = AttentionGroup(rows=slice(first_row, first_row + sum(lens)), num_seqs=S, q_len=Q,
                               block_table=table, mask=mask.unsqueeze(1).repeat(1, 1, G, 1),
                               window_masks=window_masks)
        if any(n != Q for n in lens):
            gather, scatter, offset = [], [], 0
            for i, n in enumerate(lens):
                gather += list(range(offset, offset + n)) + [offset] * (Q - n)
                scatter += range(i * Q, i * Q + n)
                offset += n
            group.gather, group.scatter = torch.tensor(gather), torch.tensor(scatter)
        return group

    def prepare(self, feeds: list[Feed], aux_layers: tuple[int, ...] = ()) -> tuple[ForwardBatch, list[int]]:
        """feeds in any order; logits come back in that order. Also returns each feed's first row in the batch."""
        bs = self.block_size
        tokens = [f.tokens for f in feeds]
        sized = [(f, len(t)) for f, t in zip(feeds, tokens, strict=True)]
        short = [i for i, (_, n) in enumerate(sized) if n <= SHORT_QUERY]
        order = short + [i for i, (_, n) in enumerate(sized) if n > SHORT_QUERY]
        ids, positions, slots, first_row = [], [], [], {}
        for i in order:
            feed, n = sized[i]
            first_row[i] = len(ids)
            ids += tokens[i]
            pos = range(feed.start, feed.start + n)
            positions += pos
            table = feed.block_table
            slots += [table[p // bs] * bs + p % bs for p in pos]
        groups = []
        if short:
            group = self._paged_group if self.paged_attention else self._group
            groups.append(group([sized[i] for i in short], 0))
        for i in order[len(short):]:
            groups.append(self._group([sized[i]], first_row[i]))
        rows = []
        for i, (feed, n) in enumerate(sized):
            end = first_row[i] + n
            rows += range(end - feed.num_logits, end)
        return ForwardBatch(input_ids=torch.tensor(ids), positions=torch.tensor(positions),
                            slot_mapping=torch.tensor(slots), groups=groups,
                            logits_rows=None if len(rows) == len(ids) and rows == sorted(rows) else
                            torch.tensor(rows, dtype=torch.long), aux_layers=aux_layers), \
            [first_row[i] for i in range(len(feeds))]

    def forward(self, feeds: list[Feed]) -> torch.Tensor:
        """Writes the fed tokens' K/V into the cache; returns logits [sum(num_logits), vocab] in feed order."""
        return self.step(feeds).logits

    def step(self, feeds: list[Feed], aux_layers: tuple[int, ...] = ()) -> StepOutput:
        """forward(), plus the hidden states entering `aux_layers` for every fed row when any are asked for."""
        batch, first_rows = self.prepare(feeds, aux_layers)
        logits = self.model(batch)
        if not aux_layers:
            return StepOutput(logits)
        return StepOutput(logits, [batch.aux[r:r + len(f.tokens)] for f, r in zip(feeds, first_rows, strict=True)])

    def run(self, work: list[tuple[Sequence, int]], num_logits: list[int]) -> torch.Tensor:
        """forward() for sequences' own next tokens: (sequence, how many), and how many trailing rows get logits."""
        return self.forward([Chunk(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n], s.num_computed_tokens,
                                   s.block_table, k) for (s, n), k in zip(work, num_logits, strict=True)])
