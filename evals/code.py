"""The `code` task: HumanEval, executed in the sandbox, plus signals that still move when pass@1 is ~0.

Per problem and model: greedy pass@1 (and unbiased pass@k from `samples` sampled completions), the mean NLL
of the canonical solution given the prompt, and whether the candidate's greedy completion equals the
baseline's. The token-level KLD statistics run over the code text (prompt + canonical solution).
"""

from __future__ import annotations

from typing import Any

from .backends.base import Backend, GenParams
from .data import humaneval_problems
from .sandbox.run import Isolation, Limits, require, run_program
from .stats.paired import NOMINAL, Level, paired_delta, pass_at_k, token_stats
from .task import join_tokens, paired_scores, scored_records, side_scores

# Completion ends where a new top-level statement starts (the stop set of the Codex paper).
DEFAULT_LIMITS = Limits()
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]


def program(problem: dict[str, Any], completion: str) -> list[str]:
    """The program's parts, compiled and run one after another in one namespace: the completion cannot swallow
    the tests (an unclosed string stays a syntax error of its own part), and the last part is the check."""
    return [f"{problem['prompt']}{completion}\n", problem["test"], f"check({problem['entry_point']})\n"]


def run_checked(source: str | list[str], limits: Limits = DEFAULT_LIMITS,
                isolation: Isolation | None = None) -> dict[str, Any]:
    """Run a program that checks a completion in the sandbox; the one place a pass is read from its result.
    `isolation` defaults to the required one (raises SandboxUnavailable where bubblewrap cannot run)."""
    isolation = isolation or require()
    r = run_program(source, limits, mode=isolation.mode)
    return {"passed": r.passed, "status": r.status, "error": "" if r.passed else r.stderr[-300:]}


def execute(problem: dict[str, Any], completion: str, limits: Limits = DEFAULT_LIMITS,
            isolation: Isolation | None = None) -> dict[str, Any]:
    """Score one completion; `isolation` defaults to the required one (raises SandboxUnavailable if missing)."""
    return run_checked(program(problem, completion), limits, isolation)


class CodeTask:
    name = "code"
    default_limit = 20
    batch_size = 8

    def __init__(self, max_tokens: int = 256, samples: int = 1, temperature: float = 0.8, seed: int = 0,
                 timeout_s: float = 10.0, allow_weak_sandbox: bool = False, **_: Any):
        self.max_tokens, self.samples, self.temperature, self.seed = max_tokens, samples, temperature, seed
        self.limits = Limits(wall_s=timeout_s, cpu_s=max(1, int(timeout_s)))
        self.isolation = require(allow_weak_sandbox)  # fail closed before any model is loaded

    def settings(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "samples": self.samples, "temperature": self.temperature,
                "seed": self.seed, "stop": STOP, "isolation": self.isolation.mode}

    def items(self, limit: int) -> list[dict[str, Any]]:
        return [dict(p, id=p["task_id"]) for p in humaneval_problems()[:limit]]

    def _side(self, backend: Backend, problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
        prompts = [p["prompt"] for p in problems]
        greedy = backend.generate(prompts, GenParams(self.max_tokens, 0.0, STOP, self.seed))
        sides = []
        for p, g in zip(problems, greedy, strict=True):
            scored = execute(p, g.text, self.limits, self.isolation)
            sides.append({"completion": g.text, "finish_reason": g.finish_reason, **scored})
        if self.samples > 1:
            for j in range(self.samples):
                params = GenParams(self.max_tokens, self.temperature, STOP, self.seed + 1 + j)
                for side, p, g in zip(sides, problems, backend.generate(prompts, params), strict=True):
                    passed = execute(p, g.text, self.limits, self.isolation)["passed"]
                    side.setdefault("sample_passed", []).append(passed)
        return sides

    def run_batch(self, items: list[dict[str, Any]], candidate: Backend, baseline: Backend) -> list[dict]:
        tok = candidate.tokenizer
        joined = [join_tokens(tok, p["prompt"], p["canonical_solution"]) for p in items]
        seqs = [ids for ids, _ in joined]
        # each side's generation and scores before the other's: one model loaded at a time (task.side_scores)
        cand, sc = self._side(candidate, items), side_scores(candidate, seqs)
        base, sb = self._side(baseline, items), sc if isinstance(sc, str) else side_scores(baseline, seqs)
        texts = paired_scores(sc, sb, [0] * len(joined))
        records = []
        for p, c, b, (ids, start), t in zip(items, cand, base, joined, texts, strict=True):
            sol, n = slice(start - 1, len(ids) - 1), max(len(ids) - start, 1)  # predictions of the solution
            scored = "unsupported" not in t
            records.append({
                "id": p["id"], "candidate": c, "baseline": b,
                "agree_exact": c["completion"].rstrip() == b["completion"].rstrip(),
                "solution_tokens": n,
                "nll_solution_candidate": sum(t["nll_candidate"][sol]) / n if scored else None,
                "nll_solution_baseline": sum(t["nll_baseline"][sol]) / n if scored else None,
                "token_record": t,
            })
        return records

    def summarize(self, records: list[dict[str, Any]], *, seed: int, level: Level = NOMINAL) -> dict[str, Any]:
        token_records, unsupported = scored_records(records)
        scored = [r for r in records if r["nll_solution_candidate"] is not None]
        out: dict[str, Any] = {
            "pass@1": paired_delta([r["candidate"]["passed"] for r in records],
                                   [r["baseline"]["passed"] for r in records], seed=seed, level=level),
            "nll_canonical_solution": paired_delta(
                [r["nll_solution_candidate"] for r in scored], [r["nll_solution_baseline"] for r in scored],
                [r["solution_tokens"] for r in scored], seed=seed + 10, level=level),
            "greedy_agreement": {"rate": sum(r["agree_exact"] for r in records) / max(len(records), 1),
                                 "items": len(records)},
            "text_stats": token_stats(token_records, seed=seed + 20, level=level),
            "not_computed": [f"nll_canonical_solution, text_stats: {why}" for why in unsupported],
            "isolation": self.isolation.describe(),
        }
        if self.samples > 1:
            for k in sorted({1, min(10, self.samples), self.samples}):
                def est(side: str, k: int = k) -> list[float]:
                    return [pass_at_k(len(r[side]["sample_passed"]), sum(r[side]["sample_passed"]), k)
                            for r in records]
                out[f"sampled_pass@{k}"] = paired_delta(est("candidate"), est("baseline"), seed=seed + 30 + k, level=level)
        return out
