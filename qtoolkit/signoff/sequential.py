"""Sample size follows the bound: when a quality gate is inconclusive, draw more items before deciding.

Rule: evaluate `limit` items per task; while some required quality gate is INCONCLUSIVE or without evidence,
none has failed, and fewer than `max_items` items were drawn, double the items (capped at `max_items`) of the
tasks whose gates are undecided and look again. Items come in the task's fixed order and finished items are
reused, so a look costs only its new items.

Error rate: looking up to K times gives a gate K chances to land on the wrong side by chance, so the 5% is
spent across the planned looks (qtoolkit/signoff/error_spending.py): each look's intervals are computed at that
look's own confidence level, and a decisive gate is wrong with probability at most 5% over all its looks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..evals.stats.paired import Level
from ..io import write_json
from .error_spending import ALPHA, Design, DesignRecord, LookRecord, SequentialRecord, plan
from .judge import Gate
from .policy import Policy
from .steps import StepOutcome, StepRunner

Run = Callable[[int, bool, list[str] | None, Level], None]
Judge = Callable[[], tuple[list[Gate], list[Gate]]]


@dataclass
class Look:
    items: int
    undecided: list[Gate]  # required quality gates still INCONCLUSIVE / without evidence after this look
    failed: list[Gate]
    confidence: float = 0.95  # the level this look's intervals were computed at (error_spending.Design)

    def record(self) -> LookRecord:
        """The look as sequential.json holds it (gates by name)."""
        return LookRecord(self.items, [g.name for g in self.undecided], [g.name for g in self.failed],
                          self.confidence)


def stages(limit: int, max_items: int | None) -> list[int]:
    """Item counts of successive looks: limit, 2 limit, 4 limit, ..., max_items."""
    out = [limit]
    while max_items is not None and out[-1] < max_items:
        out.append(min(out[-1] * 2, max_items))
    return out


def draw_until_decisive(run: Run, judge: Judge, limit: int, max_items: int | None, *, resume: bool) -> list[Look]:
    """`run(items, overwrite, tasks, level)` evaluates that many items of those tasks (None: all), every
    interval at the look's level; `judge()` -> (undecided gates, failed gates)."""
    looks: list[Look] = []
    tasks: list[str] | None = None
    design = design_of(limit, max_items)
    for i, (items, level) in enumerate(zip(design.items, design.levels, strict=True)):
        if i:
            tasks = sorted({g.task for g in looks[-1].undecided})
        run(items, not resume and i == 0, tasks, Level(level, len(design.items)))
        undecided, failed = judge()
        looks.append(Look(items, undecided, failed, level))
        if failed or not undecided:
            break
    return looks


def eval_step(runner: StepRunner, out: Path, inputs: dict[str, Any], policy: Policy, limit: int,
              max_items: int | None, run: Run, judge: Judge) -> StepOutcome:
    """The eval step of a local and of a deployment sign-off: `run` scores the items (eval.json, written per
    batch, so a rerun with the same inputs resumes its finished items), `judge` reads the quality gates after
    each look, and the looks go to sequential.json. How many items get drawn depends on the quality bounds when
    there is a budget, so they join the step's reuse key."""
    if max_items and max_items > limit:
        inputs = inputs | {"max_items": max_items, "quality_bounds": policy.model_dump()["tasks"]}
    resume = runner.interrupted("eval", inputs)

    def do_eval() -> None:
        looks = draw_until_decisive(run, judge, limit, max_items, resume=resume)
        write_json(out / "sequential.json", describe(looks, max_items).to_json())

    return runner.run("eval", inputs, out / "eval.json", do_eval)


def design_of(limit: int, max_items: int | None) -> Design:
    """The error-spending design over the looks `stages` plans."""
    return plan(stages(limit, max_items))


def planned_items(sequential: SequentialRecord | None) -> list[int] | None:
    """The looks' item counts a sequential.json planned; None for a run without one (or from before designs)."""
    design = None if sequential is None else sequential.design
    return list(design.planned_items) if design is not None and design.planned_items else None


def describe(looks: list[Look], max_items: int | None) -> SequentialRecord:
    """What sequential.json holds: the looks taken and the design that set their levels. The design is planned
    from the first look's size and the budget, so it is the same whether the draw stopped early or not."""
    design = design_of(looks[0].items if looks else max_items or 1, max_items)
    return SequentialRecord([x.record() for x in looks], max_items, DesignRecord.of(design), ALPHA)
