"""Error spending across the sign-off's looks: a decisive gate is wrong with probability at most 5% overall.

The sequential draw (qtoolkit/signoff/sequential.py) may judge a gate at up to K looks (8, 16, 32, 64 items on
the main job). Judging every look on a 95% interval gives the gate K chances to exclude the truth, so its error
could reach K x 5%. Here the 5% is spent over the planned looks instead:

- Spending function: Lan-DeMets Pocock-type, alpha(t) = alpha ln(1 + (e - 1) t), with the information fraction
  t = items drawn / max items (Lan & DeMets 1983; Kim & DeMets 1987). It spends the error nearly evenly, so an
  early look keeps a usable level (99.0% at 8 of 64 items): a clearly good or clearly broken candidate still
  stops at the first look. The O'Brien-Fleming-type alpha(t) = 2 - 2 Phi(z / sqrt t) spends ~3e-8 at 8 of 64
  items, a 99.999997% interval that no 8-item sample (nor a 2,000-resample bootstrap) can decide on, so every
  sign-off would draw at least 32 items.
- Each look's own confidence level: look k judges a (1 - a_k) interval with a_k = spent(t_k) - spent(t_{k-1}),
  the error spent there. The a_k sum to the total spent, so by the union bound the chance that any look's
  interval excludes the truth is at most that total whatever rule stops the draw (a task also continues while
  another of its gates is undecided) and however the looks' samples are correlated. Exact group-sequential
  boundaries would spend slightly less conservatively, but they rest on jointly normal statistics with
  independent increments, which bootstrap, Student t and Newcombe intervals at 8 items do not give; the union
  bound needs only each look's own coverage.
- Each look's error is split between the two ends of a gate's interval (evals/stats/paired.py `side_errors`): a
  PASS is wrong only when the truth lies beyond the bound and a FAIL only when it lies within, so a gate whose
  PASS end misses with probability at most 5% over all looks, and whose FAIL end does too, is wrong with
  probability at most 5% whatever the truth. The union bound holds for intervals that keep their nominal level;
  at these levels KLD intervals of skewed item means miss more often than nominal on their low end (a false
  PASS) and the paired pass/fail interval is discrete at 8 items, so the share each end spends is set per gate statistic
  from the simulation with the truth exactly on the policy's bound (evals/stats/at_bound.py, table in
  evals/stats/at_bound_table.py, figures in measurements/2026-12-04/issue39/at-bound.json): the PASS end spends
  less where its interval overruns, the FAIL end keeps enough to decide a clear regression by the last look.
- A single look (--max-items equal to --limit) spends the same 5%, split the same way, in one look.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALPHA = 0.05  # the overall chance that a decisive gate is wrong, over all its looks (the report's claim)
SPEND = ALPHA  # the error the looks share between them, each look's split between its two ends (docstring)
NAME = "Lan-DeMets Pocock-type alpha spending"


def pocock_spent(t: float, alpha: float = SPEND) -> float:
    """Cumulative error spent by information fraction t in [0, 1]."""
    return alpha * math.log(1 + (math.e - 1) * min(max(t, 0.0), 1.0))


@dataclass(frozen=True)
class Design:
    """The planned looks (items drawn at each) and the confidence level each look's intervals use."""

    items: tuple[int, ...]
    alpha: float = SPEND  # the nominal error spent over the looks

    def __post_init__(self) -> None:
        if not self.items or any(b <= a for a, b in zip(self.items, self.items[1:], strict=False)) or self.items[0] <= 0:
            raise ValueError(f"looks must be increasing positive item counts, got {self.items}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")

    @property
    def spent(self) -> tuple[float, ...]:
        """Cumulative error spent after each look; the last is alpha."""
        total = self.items[-1]
        out = [pocock_spent(n / total, self.alpha) for n in self.items[:-1]]
        return (*out, self.alpha)

    @property
    def look_alphas(self) -> tuple[float, ...]:
        """The error each look spends (two-sided: a miss on either side of its interval)."""
        s = self.spent
        return tuple(b - a for a, b in zip((0.0, *s[:-1]), s, strict=True))

    @property
    def levels(self) -> tuple[float, ...]:
        """Each look's confidence level."""
        return tuple(1 - a for a in self.look_alphas)

    def level_at(self, items: int) -> float:
        """The level of the look that draws `items` (a count between looks takes the next planned look's)."""
        for n, level in zip(self.items, self.levels, strict=True):
            if items <= n:
                return level
        return self.levels[-1]

    def describe(self) -> str:
        looks = ", ".join(f"{n} items at {c:.2%}" for n, c in zip(self.items, self.levels, strict=True))
        return f"{NAME} ({looks})" if len(self.items) > 1 else f"one look ({looks})"


def plan(items: Sequence[int], alpha: float | None = None) -> Design:
    """The design over the planned looks' item counts (qtoolkit.signoff.sequential.stages); `alpha` overrides
    the nominal error spent (the coverage simulation compares spends)."""
    return Design(tuple(int(n) for n in items), SPEND if alpha is None else alpha)


@dataclass(frozen=True)
class DesignRecord:
    """A design as sequential.json holds it: its name, the planned looks' item counts, each look's level and the
    error spent by each."""

    name: str
    planned_items: list[int]
    levels: list[float]
    alpha_spent: list[float]

    @classmethod
    def of(cls, design: Design) -> DesignRecord:
        return cls(design.describe(), list(design.items), [round(c, 6) for c in design.levels], list(design.spent))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "planned_items": list(self.planned_items), "levels": list(self.levels),
                "alpha_spent": list(self.alpha_spent)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DesignRecord:
        return cls(str(d.get("name", "")), [int(n) for n in d.get("planned_items") or []],
                   [float(c) for c in d.get("levels") or []], [float(a) for a in d.get("alpha_spent") or []])


@dataclass(frozen=True)
class LookRecord:
    """One look of the eval step: the items drawn, the gates still undecided and those failed (by name), and the
    level its intervals were computed at (absent in files from before error spending)."""

    items: int
    undecided: list[str]
    failed: list[str]
    confidence: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "undecided": list(self.undecided), "failed": list(self.failed),
                "confidence": self.confidence}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LookRecord:
        return cls(int(d["items"]), list(d.get("undecided") or []), list(d.get("failed") or []),
                   d.get("confidence"))


@dataclass(frozen=True)
class SequentialRecord:
    """sequential.json: the looks the eval step took, its item budget, and the design that set the looks' levels
    with the overall error it bounds (a file from before error spending has no design: each look judged 95%)."""

    looks: list[LookRecord]
    max_items: int | None
    design: DesignRecord | None = None
    error_rate_bound: float | None = None

    def with_design(self, design: Design) -> SequentialRecord:
        """The looks under `design` as this code spends the error (--rejudge judges every look's task at it)."""
        return SequentialRecord(self.looks, self.max_items, DesignRecord.of(design), ALPHA)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"looks": [x.to_json() for x in self.looks], "max_items": self.max_items}
        if self.design is not None:
            out["design"] = self.design.to_json()
        if self.error_rate_bound is not None:
            out["error_rate_bound"] = self.error_rate_bound
        return out

    @classmethod
    def load(cls, path: Path) -> SequentialRecord | None:
        """sequential.json at `path`; None when the eval step wrote none."""
        return cls.from_json(json.loads(path.read_text())) if path.is_file() else None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SequentialRecord:
        design = d.get("design")
        return cls([LookRecord.from_json(x) for x in d.get("looks") or []], d.get("max_items"),
                   None if design is None else DesignRecord.from_json(design), d.get("error_rate_bound"))
