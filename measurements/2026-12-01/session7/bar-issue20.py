"""Issue 20's bar on the current tree: the coverage harness rerun at the main job's sample sizes, beside the
percentile method, and every default-policy gate mapped to the statistic (and interval method) it reads.
Writes bar-issue20.json beside it.

    cd WORKTREE && QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/session7/bar-issue20.py [--gates-only]

1. `evals.coverage.run` over the calibrated scenarios at the main job's looks (8 items, doubled to the
   --max-items budget 64: 8, 16, 32, 64), at 40 items and at its 5 rounds, with the shipped table's settings
   (4,000 runs, 2,000 resamples, seed 0). Every cell is seeded by (seed, n, scenario) alone, so the 8/16/40
   rows must equal evals/stats/ci_coverage_table.py exactly when the table is current with the code.
2. Each gate of the default policy (recipes/policies/default.yaml) against real eval summaries: the method
   named in the figure it reads, the table's method for that shape at that many items, and its coverage.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from qtoolkit.evals.stats import coverage  # noqa: E402
from qtoolkit.evals.stats.ci_coverage_table import TABLE  # noqa: E402
from qtoolkit.evals.stats.paired import LABELS, coverage_at  # noqa: E402
from qtoolkit.evals.summary import TaskSummary  # noqa: E402

from qtoolkit.signoff.policy import METRICS, load_policy, metric_figure  # noqa: E402

SIZES = (8, 16, 32, 40, 64)
ROUNDS = (5,)
GATE_SHAPES = {"kld_mean": "kld", "nll_delta": "nll", "rougeL_drop": "bounded", "pass_at_1_drop": "binary"}
EVALS = {  # real summaries made by `qtool eval` (the fp8-dynamic main job's tasks; the custom bar's eval)
    "fp8-dynamic, 8 items": ROOT / "measurements/2026-12-01/eval-fp8-dynamic-code-summarization-limit8.json",
    "fp8-dynamic, 24 items": ROOT / "measurements/2026-12-01/eval-fp8-dynamic-code-summarization-limit24.json",
    "int4-rtn, custom bar": Path("/tmp/s7-bar16/eval.json"),
}


def rerun() -> dict:
    names = [s.name for s in coverage.SCENARIOS if s.kind == "calibrated"]
    t0 = time.time()
    results = coverage.run(4000, 2000, 0, names=names, item_sizes=SIZES, round_sizes=ROUNDS)
    tab = coverage.table(results)
    shapes = {shape: {n: {"method": method, "coverage": row["coverage"][method][n],
                          "percentile": row["coverage"]["percentile"][n],
                          "all": {m: c[n] for m, c in row["coverage"].items()}}
                      for n, method in row["method"].items()} for shape, row in tab.items()}
    return {"seconds": round(time.time() - t0, 1), "scenarios": names, "shapes": shapes}


def compare(rerun: dict) -> None:
    """Against the shipped table (evals/stats/ci_coverage_table.py) and what the sign-off reads at each n."""
    for shape, rows in rerun["shapes"].items():
        for n, cell in rows.items():
            measured = cell.get("all") or {cell["method"]: cell["coverage"], "percentile": cell["percentile"]}
            shipped = TABLE[shape]
            cell["meets_target"] = cell["coverage"] >= coverage.TARGET
            cell["shipped_method"] = shipped["method"].get(n)
            cell["equals_shipped"] = (None if n not in shipped["method"] else cell["method"] == shipped["method"][n]
                                      and all(shipped["coverage"][m][n] == c for m, c in measured.items()))
            cell["read_by_signoff"] = dict(zip(("method", "coverage", "reliable"), coverage_at(shape, int(n)),
                                               strict=True))


def gate_map() -> list[dict]:
    policy = load_policy("default")
    rows = []
    label_to_method = {v: k for k, v in LABELS.items()}
    for run, path in EVALS.items():
        if not path.exists():
            rows.append({"eval": run, "missing": str(path)})
            continue
        tasks = json.loads(path.read_text())["tasks"]
        for task, entry in tasks.items():
            section = "custom" if task.startswith("custom:") else task
            summary = TaskSummary.from_json(entry["summary"])
            for gate in policy.tasks.get(section, {}):
                fig = metric_figure(summary, METRICS[task][gate])
                if fig is None:
                    rows.append({"eval": run, "gate": f"{task}.{gate}", "figure": None})
                    continue
                # token statistics count their items in text_stats (KLD's interval is over items)
                n = fig.items if getattr(fig, "items", None) else summary.text_stats.entries["items"]
                shape = GATE_SHAPES[gate]
                sub = {"kld": "kld-heavy", "bounded": "bounded-sparse"}.get(shape)
                base_cov = coverage_at(shape, int(n))[1]
                if sub and fig.ci.coverage != base_cov and fig.ci.coverage == coverage_at(sub, int(n))[1]:
                    shape = sub  # stats.refine_shape: item means spread widely, or most deltas are exactly 0
                table_method, cov, reliable = coverage_at(shape, int(n))
                rows.append({"eval": run, "gate": f"{task}.{gate}", "shape": shape, "items": n,
                             "figure_method": fig.ci.method, "figure_coverage": fig.ci.coverage,
                             "figure_reliable": fig.ci.reliable, "table_method": table_method,
                             "table_coverage": cov, "same_method": label_to_method.get(fig.ci.method) == table_method})
    rows.append({"gate": "throughput.min_speedup", "shape": "rounds", "rounds": 5,
                 **dict(zip(("table_method", "table_coverage", "reliable"), coverage_at("rounds", 5), strict=True))})
    rows.append({"gate": "memory.max_linear_ratio_vs_bf16", "shape": None,
                 "note": "the checkpoint's measured bytes: a point, no sample, no interval"})
    return rows


def main() -> int:
    path = HERE / "bar-issue20.json"
    if sys.argv[1:] == ["--gates-only"]:  # refresh the gate map and the comparison with the shipped table
        out = {**json.loads(path.read_text()), "gates": gate_map()}
    else:
        out = {"target": coverage.TARGET, "sizes": SIZES, "rounds": ROUNDS, "gates": gate_map(), "rerun": rerun()}
    compare(out["rerun"])
    path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
