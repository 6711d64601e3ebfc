"""The corpus as the trainer consumes it: the target's features per sample, computed once, and padded batches."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..progress import bar
from .data import Sample
from .target import Features, Teacher
from .ttt import Batch


@dataclass
class Item:
    sample: Sample
    features: Features


def featurize(teacher: Teacher, samples: list[Sample], desc: str, greedy: bool = False) -> list[Item]:
    items = []
    for s in bar(samples, desc=desc, unit="seq"):
        if len(s.token_ids) >= 3:
            items.append(Item(s, teacher.features(s.token_ids, greedy=greedy)))
    return items


def collate(items: list[Item], device: torch.device, scored_from_prompt: bool = False) -> Batch:
    """Pad to the longest item; with scored_from_prompt, rows before the prompt's last token are not scored (a
    draft starts after prefill, from the first token the target wrote)."""
    T = max(len(it.sample.token_ids) for it in items)
    B = len(items)
    f0 = items[0].features
    ids = torch.zeros(B, T, dtype=torch.int64)
    aux = torch.zeros(B, T, f0.aux.shape[-1])
    final = torch.zeros(B, T, f0.final.shape[-1])
    valid = torch.zeros(B, T, dtype=torch.bool)
    greedy = torch.zeros(B, T, dtype=torch.int64) if f0.greedy is not None else None
    first = torch.zeros(B, dtype=torch.int64)
    for b, it in enumerate(items):
        n = len(it.sample.token_ids)
        ids[b, :n] = torch.tensor(it.sample.token_ids)
        ids[b, n:] = it.sample.token_ids[-1]
        aux[b, :n], final[b, :n], valid[b, :n] = it.features.aux.cpu(), it.features.final.cpu(), True
        if greedy is not None:
            greedy[b, :n] = it.features.greedy.cpu()
        if scored_from_prompt:
            first[b] = max(0, it.sample.prompt_len - 1)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return Batch(to(ids), to(aux), to(final), to(valid), to(first), to(greedy))


def epoch_batches(n: int, batch_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    """A seeded epoch: shuffled, then sorted by length inside windows of 32 batches (little padding), batches
    shuffled again."""
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    window = 32 * batch_size
    batches = []
    for w in range(0, n, window):
        chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches
