"""Typed task summaries: what gates, the report and the terminal read from an eval, as fields, not key paths.

A task's `summarize()` writes JSON (eval.json keeps that layout); `TaskSummary.from_json` reads it into figures:
a paired delta (candidate, baseline, delta, 95% interval, items), a statistic over tokens (mean ± se, 95%
interval, percentiles), or a rate. `to_json` gives the same JSON back, key for key and in order, so the file stays
byte-compatible; a node of any other shape is kept as it is and is never a figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_CI_KEYS = ("ci95", "ci_method", "ci_coverage", "ci_reliable")


@dataclass(frozen=True)
class NotComputed:
    """Figures a backend could not score, and why: one `not_computed` line of a summary ("figures: reason").

    A line without the separator (the token statistics write "kld (needs ...)") is all `figures`, with no
    separate reason; `to_json` gives every line back as it was read."""

    figures: str
    reason: str = ""

    @classmethod
    def from_json(cls, line: str) -> NotComputed:
        figures, _, reason = line.partition(": ")
        return cls(figures, reason)

    def to_json(self) -> str:
        return f"{self.figures}: {self.reason}" if self.reason else self.figures

    def __str__(self) -> str:
        return self.to_json()


@dataclass(frozen=True)
class Interval:
    """A 95% interval, the method that made it, and that method's simulated coverage at this sample size."""

    bounds: tuple[float, float] | None
    method: str | None = None
    coverage: float | None = None
    reliable: bool | None = None

    @classmethod
    def from_json(cls, node: dict[str, Any]) -> Interval:
        ci = node.get("ci95")
        return cls(None if ci is None else (ci[0], ci[1]), node.get("ci_method"), node.get("ci_coverage"),
                   node.get("ci_reliable"))

    def to_json(self) -> dict[str, Any]:
        return {"ci95": None if self.bounds is None else list(self.bounds), "ci_method": self.method,
                "ci_coverage": self.coverage, "ci_reliable": self.reliable}

    @property
    def complete(self) -> bool:
        return self.bounds is not None and None not in self.bounds


def _emit(full: dict[str, Any], keys: tuple[str, ...] | None) -> dict[str, Any]:
    """The JSON of a figure: every key it was read with, in that order (a node without the coverage keys is
    written back without them, so a file reads and writes byte for byte)."""
    return full if keys is None else {k: full[k] for k in keys}


@dataclass(frozen=True)
class PairedDelta:
    """Candidate and baseline means over the same items, their difference and its paired interval."""

    candidate: float | None
    baseline: float | None
    delta: float | None
    ci: Interval
    items: int | None = None
    keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)  # as read from JSON

    @property
    def point(self) -> float | None:
        return self.delta

    def to_json(self) -> dict[str, Any]:
        return _emit({"candidate": self.candidate, "baseline": self.baseline, "delta": self.delta,
                      **self.ci.to_json(), "items": self.items}, self.keys)


@dataclass(frozen=True)
class TokenStat:
    """A statistic over all tokens: mean ± its standard error as llama.cpp prints it, an interval clustered by
    item, and whatever else the statistic carries (percentiles of KLD, RMS of Δp)."""

    mean: float
    se: float
    ci: Interval
    extra: dict[str, Any] = field(default_factory=dict)
    keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    items = None  # token statistics count tokens; the items are the text_stats' own

    @property
    def point(self) -> float:
        return self.mean

    def to_json(self) -> dict[str, Any]:
        return _emit({"mean_pm": [self.mean, self.se], **self.ci.to_json(), **self.extra}, self.keys)


@dataclass(frozen=True)
class Rate:
    """A share of items (greedy answers equal), with an interval where the task computes one."""

    rate: float
    items: int | None = None
    ci95: tuple[float, float] | None = None
    keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def point(self) -> float:
        return self.rate

    @property
    def ci(self) -> Interval:
        return Interval(self.ci95)

    def to_json(self) -> dict[str, Any]:
        return _emit({"rate": self.rate, "ci95": None if self.ci95 is None else list(self.ci95),
                      "items": self.items}, self.keys)


Figure = PairedDelta | TokenStat | Rate
_PAIRED = {"candidate", "baseline", "delta"}


def _parse(node: Any) -> Figure | None:
    if not isinstance(node, dict):
        return None
    keys = tuple(node)
    if _PAIRED <= set(keys) and set(keys) <= _PAIRED | {*_CI_KEYS, "items"}:
        return PairedDelta(node["candidate"], node["baseline"], node["delta"], Interval.from_json(node),
                           node.get("items"), keys)
    if keys and keys[0] == "mean_pm":
        extra = {k: node[k] for k in keys if k != "mean_pm" and k not in _CI_KEYS}
        return TokenStat(node["mean_pm"][0], node["mean_pm"][1], Interval.from_json(node), extra, keys)
    if "rate" in keys and set(keys) <= {"rate", "ci95", "items"}:
        ci = node.get("ci95")
        return Rate(node["rate"], node.get("items"), None if ci is None else (ci[0], ci[1]), keys)
    return None


def figure_from_json(node: Any) -> Figure | None:
    """The figure a summary node holds, or None when it has another shape (then it is kept as raw JSON)."""
    fig = _parse(node)
    return fig if fig is not None and fig.to_json() == node else None


def _typed(node: Any) -> Any:
    fig = figure_from_json(node)
    return node if fig is None else fig


@dataclass
class TextStats:
    """llama.cpp-style token statistics of a task (`text_stats`): ppl ratio, KLD, same top-1, Δp."""

    entries: dict[str, Any]  # figure name -> TokenStat, other keys (tokens, ppl_candidate...) as JSON

    @classmethod
    def from_json(cls, node: dict[str, Any]) -> TextStats:
        return cls({k: _typed(v) for k, v in node.items()})

    def to_json(self) -> dict[str, Any]:
        return {k: v.to_json() if isinstance(v, (PairedDelta, TokenStat, Rate)) else v
                for k, v in self.entries.items()}

    def figure(self, name: str) -> TokenStat | None:
        v = self.entries.get(name)
        return v if isinstance(v, TokenStat) else None

    @property
    def tokens(self) -> int:
        return self.entries.get("tokens", 0)

    @property
    def not_computed(self) -> list[NotComputed]:
        return [NotComputed.from_json(line) for line in self.entries.get("not_computed") or []]


@dataclass
class TaskSummary:
    """One task's summary: its figures by name, its token statistics, and the rest of its JSON as it is."""

    entries: dict[str, Any]

    @classmethod
    def from_json(cls, node: dict[str, Any] | None) -> TaskSummary:
        out: dict[str, Any] = {}
        for k, v in (node or {}).items():
            # text_stats, or one per text set (the perplexity task)
            stats = isinstance(v, dict) and (k == "text_stats" or {"items", "tokens"} <= set(v))
            out[k] = TextStats.from_json(v) if stats else _typed(v)
        return cls(out)

    def to_json(self) -> dict[str, Any]:
        return {k: v.to_json() if isinstance(v, (PairedDelta, TokenStat, Rate, TextStats)) else v
                for k, v in self.entries.items()}

    def figure(self, name: str) -> Figure | None:
        v = self.entries.get(name)
        return v if isinstance(v, (PairedDelta, TokenStat, Rate)) else None

    def deltas(self) -> dict[str, PairedDelta]:
        """The paired deltas, in the summary's order (the report's quality table)."""
        return {k: v for k, v in self.entries.items() if isinstance(v, PairedDelta)}

    @property
    def text_stats(self) -> TextStats | None:
        v = self.entries.get("text_stats")
        return v if isinstance(v, TextStats) else None

    def text_sets(self) -> dict[str, TextStats]:
        """Every block of token statistics: `text_stats`, or one per text set (the perplexity task)."""
        return {k: v for k, v in self.entries.items() if isinstance(v, TextStats)}

    def get(self, key: str, default: Any = None) -> Any:
        """A non-figure entry as JSON (isolation, worst_items, counts)."""
        return self.entries.get(key, default)

    @property
    def not_computed(self) -> list[NotComputed]:
        """The figures of the task a backend could not score (e.g. teacher-forced NLL through an endpoint)."""
        return [NotComputed.from_json(line) for line in self.entries.get("not_computed") or []]


@dataclass(frozen=True)
class RoundsRatio:
    """A throughput ratio over repeated rounds (stats.ratio_over_rounds): the geometric mean of the paired
    per-round ratios and its t-interval over rounds."""

    ratio: float
    ci: Interval
    rounds: int
    per_round: list[float]

    @classmethod
    def from_json(cls, node: dict[str, Any] | None) -> RoundsRatio | None:
        if not node:
            return None
        return cls(node["ratio"], Interval.from_json(node), node["rounds"], list(node.get("per_round") or []))
