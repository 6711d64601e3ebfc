"""The reduced draft vocabulary: the N most frequent target tokens in the training text, N chosen by measured
coverage of the target's own greedy tokens on held-out text against the cost of the draft's LM head."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .data import KINDS, Sample

SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
MIN_COVERAGE = 0.99  # an uncovered token caps acceptance: 1% of target tokens the draft can never propose


@dataclass
class CoverageRow:
    draft_vocab_size: int
    coverage: dict[str, float]  # per workload and "all": share of held-out greedy target tokens in the vocabulary
    lm_head_params: int
    lm_head_share_of_head: float  # of the whole head's parameters


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


def coverage_table(counts: torch.Tensor, heldout: dict[str, list[Sample]], hidden: int, body_params: int,
                   sizes: tuple[int, ...] = SIZES) -> list[CoverageRow]:
    vocab = len(counts)
    rows = []
    ranked = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))
    rank = torch.empty(vocab, dtype=torch.int64)
    rank[torch.tensor(ranked)] = torch.arange(vocab)
    tokens = {k: torch.tensor(greedy_tokens(heldout.get(k, [])), dtype=torch.int64) for k in KINDS}
    tokens["all"] = torch.cat(list(tokens.values()))
    for n in [s for s in sizes if s < vocab] + [vocab]:
        cov = {k: float((rank[t] < n).float().mean()) if len(t) else float("nan") for k, t in tokens.items()}
        rows.append(CoverageRow(n, cov, n * hidden, n * hidden / (n * hidden + body_params)))
    return rows


def choose_size(rows: list[CoverageRow], min_coverage: float = MIN_COVERAGE) -> int:
    """The smallest vocabulary whose coverage reaches min_coverage on every workload."""
    for row in rows:
        if all(v >= min_coverage for k, v in row.coverage.items() if v == v):
            return row.draft_vocab_size
    return rows[-1].draft_vocab_size


def table_json(rows: list[CoverageRow]) -> list[dict]:
    return [asdict(r) for r in rows]
