"""The reduced draft vocabulary: the N most frequent target tokens in the training text, N chosen by measured
coverage of the target's own greedy tokens on held-out text against the cost of the draft's LM head.

The choice maximizes a modeled speedup of chain drafting at k=4: a token outside the vocabulary is never
accepted, so per-token acceptance is at most ACCEPT_CEILING x coverage(N); the tokens per verification step are
(1 - a^(k+1)) / (1 - a); a step costs one verification plus k draft steps, each draft step priced by its
parameters relative to the target's (the head's body plus N x hidden for its LM head). A coverage-only rule
picked the full vocabulary on the default model (99% is out of reach of a 70k-token corpus: see
measurements/2026-12-01/draft-vocab-coverage.json), at 85% of the head's parameters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .data import KINDS, Sample

SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
ACCEPT_CEILING = 0.7  # per-token acceptance of a fully covered EAGLE-style head, the model's one assumption
CHAIN_K = 4


@dataclass
class CoverageRow:
    draft_vocab_size: int
    coverage: dict[str, float]  # per workload and "all": share of held-out greedy target tokens in the vocabulary
    lm_head_params: int
    lm_head_share_of_head: float  # of the whole head's parameters
    modeled_speedup: float = float("nan")  # chain k=4 over plain decoding, from the module docstring's model


def token_counts(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    ids = torch.tensor([t for s in samples for t in s.token_ids], dtype=torch.int64)
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size]


def top_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent token ids (ties broken by the smaller id), in ascending id order."""
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))[:n]
    return torch.tensor(sorted(order), dtype=torch.int64)


def greedy_tokens(samples: list[Sample]) -> list[int]:
    """The tokens the target wrote greedily: the continuation part of held-out samples."""
    return [t for s in samples for t in s.token_ids[s.prompt_len:]]


def modeled_speedup(coverage: float, draft_params: int, target_params: int, k: int = CHAIN_K) -> float:
    a = min(ACCEPT_CEILING * coverage, 0.999)
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens / (1 + k * draft_params / target_params)


def coverage_table(counts: torch.Tensor, heldout: dict[str, list[Sample]], hidden: int, body_params: int,
                   sizes: tuple[int, ...] = SIZES, target_params: int | None = None) -> list[CoverageRow]:
    vocab = len(counts)
    rows = []
    ranked = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))
    rank = torch.empty(vocab, dtype=torch.int64)
    rank[torch.tensor(ranked)] = torch.arange(vocab)
    tokens = {k: torch.tensor(greedy_tokens(heldout.get(k, [])), dtype=torch.int64) for k in KINDS}
    tokens["all"] = torch.cat(list(tokens.values()))
    for n in [s for s in sizes if s < vocab] + [vocab]:
        cov = {k: float((rank[t] < n).float().mean()) if len(t) else float("nan") for k, t in tokens.items()}
        speed = float("nan") if target_params is None else \
            modeled_speedup(min(v for v in cov.values() if v == v), body_params + n * hidden, target_params)
        rows.append(CoverageRow(n, cov, n * hidden, n * hidden / (n * hidden + body_params), speed))
    return rows


def choose_size(rows: list[CoverageRow]) -> int:
    """The vocabulary with the highest modeled speedup (the worst workload's coverage counts)."""
    return max(rows, key=lambda r: (r.modeled_speedup, -r.draft_vocab_size)).draft_vocab_size


def table_json(rows: list[CoverageRow]) -> list[dict]:
    return [asdict(r) for r in rows]
