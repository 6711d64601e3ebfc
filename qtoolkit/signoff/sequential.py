"""Sample size follows the bound: when a quality gate is inconclusive, draw more items before deciding.

Rule: evaluate `limit` items per task; while some required quality gate is INCONCLUSIVE or without evidence,
none has failed, and fewer than `max_items` items were drawn, double the items (capped at `max_items`) of the
tasks whose gates are undecided and look again. Items come in the task's fixed order and finished items are
reused, so a look costs only its new items.

Error rate: every look judges a 95% interval, and looking up to K times gives a gate up to K chances to land
on the wrong side by chance, so a decisive verdict after K looks carries an error rate of at most K x 5% per
gate (the union bound), not 5%. The report states K.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .judge import Gate


@dataclass
class Look:
    items: int
    undecided: list[Gate]  # required quality gates still INCONCLUSIVE / without evidence after this look
    failed: list[Gate]

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "undecided": [g.name for g in self.undecided],
                "failed": [g.name for g in self.failed]}


def stages(limit: int, max_items: int | None) -> list[int]:
    """Item counts of successive looks: limit, 2 limit, 4 limit, ..., max_items."""
    out = [limit]
    while max_items is not None and out[-1] < max_items:
        out.append(min(out[-1] * 2, max_items))
    return out


def draw_until_decisive(run: Callable[[int, bool, list[str] | None], None],
                        judge: Callable[[], tuple[list[Gate], list[Gate]]], limit: int, max_items: int | None, *,
                        resume: bool) -> list[Look]:
    """`run(items, overwrite, tasks)` evaluates that many items of those tasks (None: all);
    `judge()` -> (undecided gates, failed gates)."""
    looks: list[Look] = []
    tasks: list[str] | None = None
    for i, items in enumerate(stages(limit, max_items)):
        if i:
            tasks = sorted({g.task for g in looks[-1].undecided})
        run(items, not resume and i == 0, tasks)
        undecided, failed = judge()
        looks.append(Look(items, undecided, failed))
        if failed or not undecided:
            break
    return looks


def describe(looks: list[Look], max_items: int | None) -> dict:
    return {"looks": [x.to_json() for x in looks], "max_items": max_items,
            "error_rate_bound": round(0.05 * len(looks), 3)}
