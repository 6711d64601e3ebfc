"""What first-position acceptance an EAGLE-3 head would need for #17's bar (1.6x at concurrency 1), from the costs
a `qtool bench serve --speculative eagle3:DIR` run measured.

Each concurrency-1 tier's `speculative_ceiling` holds the measured draft cost r (one head step over one target
decode step), the verify cost per extra token v and the prefill share p of a request. With the engine's own
model of a step (qtoolkit/bench/spec_ceiling.py: decode = max over k of E(a, k) / ((1 + k v)(1 + k r)),
request = 1 / (p + (1 - p) / decode)), this finds by bisection the smallest acceptance a whose request speedup
reaches the target, and prints it beside the acceptance the head reached in that run.

    python measurements/2026-12-01/session7/eagle3-needed-acceptance.py BENCH.json [...] --output OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qtoolkit.engine.speculative.policy import SpeculationPolicy


def request_speedup(a: float, r: float, v: float, p: float, max_k: int) -> tuple[int, float]:
    policy = SpeculationPolicy(max_k)
    policy.draft_cost, policy.verify_cost = r, v
    k, gain = policy.best_k(a)
    gain = max(gain, 1.0)
    return k, 1.0 / (p + (1.0 - p) / gain)


def needed(r: float, v: float, p: float, max_k: int, target: float) -> float | None:
    if request_speedup(1.0, r, v, p, max_k)[1] < target:
        return None  # even perfect acceptance falls short at these costs
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if request_speedup(mid, r, v, p, max_k)[1] >= target else (mid, hi)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench", nargs="+", type=Path)
    ap.add_argument("--target", type=float, default=1.6)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--output", type=Path, required=True)
    a = ap.parse_args()
    rows = []
    for path in a.bench:
        data = json.loads(path.read_text())
        for tier in data["tiers"]:
            for name, res in tier["results"].items():
                c = res.get("speculative_ceiling")
                if not c or tier["concurrency"] != 1:
                    continue
                r, v, p = c["draft_cost_ratio"], c["verify_cost_per_token"], c["prefill_share"]
                need = needed(r, v, p, a.max_k, a.target)
                rows.append({"file": str(path), "workload": data.get("config", {}).get("workload"), "system": name,
                             "draft_cost_ratio": r, "verify_cost_per_token": v, "prefill_share": p,
                             "measured_first_position_acceptance": c["first_position_acceptance"],
                             "needed_first_position_acceptance": None if need is None else round(need, 3),
                             "ceiling_at_full_acceptance": c["full_acceptance"]["request_speedup"],
                             "ratio_rounds": tier.get("ratios_rounds")})
    a.output.write_text(json.dumps({"target_request_speedup": a.target, "max_k": a.max_k, "rows": rows}, indent=1))
    for row in rows:
        print(f"{row['file']} {row['workload']}: r={row['draft_cost_ratio']} v={row['verify_cost_per_token']} "
              f"p={row['prefill_share']} acceptance measured {row['measured_first_position_acceptance']}, "
              f"needed {row['needed_first_position_acceptance']}")


if __name__ == "__main__":
    main()
