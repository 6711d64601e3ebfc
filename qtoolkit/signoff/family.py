"""The family-wise error of a recommendation among several candidates: the fallback procedure over the candidates.

A sweep recommends one of m candidates. Each candidate's own verdict is its single sign-off's (gates at 95%,
error spent over the looks), so each PASS is wrong with probability at most 5%; with m candidates, the chance that
some false PASS is there to be picked grows towards m x 5%. The recommendation therefore rests on a second reading
of each candidate's evidence, at a level that keeps the family-wise error at most ALPHA = 5%:

- Fallback procedure (Wiens 2003): the candidates are ordered by their weight bytes, largest first (the order in
  which quantization's risk grows, known before any quality figure), and each gets an equal share alpha / m. A
  candidate that passes at its level hands its share on to the next, so after a clean fp8 an int4 candidate is
  judged at 2 alpha / m. The family-wise error stays at most alpha (it is a Bonferroni split whose unused shares
  are recycled along a fixed order), and every candidate is still judged when one before it fails, unlike a
  fixed-sequence test that stops there.
- Why not Holm: Holm's step-down orders the candidates by their p-values, and a gate here is an interval judged
  against a bound (bootstrap-t, BCa, Newcombe, Student t over rounds), not a p-value; the fallback needs only
  each candidate's intervals at a stated level.
- A candidate's share a is spent the way its sign-off spends 5%: over the looks with the same design scaled by
  a / 5% (qtoolkit/signoff/error_spending.py), a single look at 1 - a, and the throughput rounds at 1 - a. Its
  intersection-union test (every gate must pass) is a level-a test because each gate is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..evals.results import EvalResults
from ..evals.resummarize import resummarize
from . import verdicts
from .error_spending import ALPHA, plan
from .judge import Gate
from .sequential import stages

NAME = "fallback procedure (Wiens 2003): an equal split of 5% over the candidates, largest weights first, each " \
       "passing candidate handing its share on"


@dataclass
class FamilyJudgement:
    """One candidate's evidence judged at its share of the family-wise error."""

    alpha: float  # the share the candidate was judged at
    verdict: str  # the gates' overall verdict at that level
    gates: list[Gate] = field(default_factory=list)

    @property
    def recommendable(self) -> bool:
        return self.verdict == verdicts.PASS

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "verdict": self.verdict,
                "undecided_or_failed": [g.name for g in self.gates if g.required and g.verdict != verdicts.PASS]}


def look_levels(limit: int, max_items: int | None, alpha: float) -> dict[int, float]:
    """Items at each planned look -> that look's interval level when the sign-off's 5% is `alpha` instead."""
    design = plan(stages(limit, max_items))
    scaled = plan(design.items, design.alpha * alpha / ALPHA)
    return dict(zip(scaled.items, scaled.levels, strict=True))


# (EvalResults at the family level, throughput level) -> the gates
Rejudge = Callable[[EvalResults | None, float], list[Gate]]


def judge_at(alpha: float, folder: Path, levels: dict[int, float], task_options: dict[str, Any],
             rejudge: Rejudge) -> FamilyJudgement:
    """A candidate's gates with every interval at its share `alpha`: each task's summary rebuilt from its
    finished items (evals/resummarize.py, as --rejudge does) at the level of the look it stopped at, the
    throughput rounds at 1 - alpha."""
    def level_at(items: int) -> float:
        # the look the task stopped at (a workload file shorter than a look stops between them: the next)
        return next((lv for n, lv in sorted(levels.items()) if items <= n), min(levels.values()))

    source = folder / "eval.json"
    evals = resummarize(source, level_at, len(levels), task_options) if source.is_file() else None
    gates = rejudge(evals, 1 - alpha)
    verdict = verdicts.overall([(g.verdict, g.required) for g in gates]) if gates else verdicts.INCONCLUSIVE
    return FamilyJudgement(alpha, verdict, gates)


def fallback(order: list[str], passes_at: Callable[[str, float], bool], alpha: float = ALPHA) -> dict[str, float]:
    """The share each candidate (in `order`) is judged at; `passes_at(name, share)` judges it there."""
    share = alpha / len(order) if order else 0.0
    carried, out = 0.0, {}
    for name in order:
        out[name] = share + carried
        carried = out[name] if passes_at(name, out[name]) else 0.0
    return out
