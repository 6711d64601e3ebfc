"""The report sections of a deployment sign-off: which endpoints were measured (model ids, versions), their bench
tiers, and what an endpoint cannot give ("not measurable on this deployment"), the ablation first among them."""

from __future__ import annotations

from typing import Any

from ..evals.summary import RoundsRatio
from .verdict import DeploymentSection


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _version(info: dict[str, Any]) -> str:
    parts = [f"{k} {v}" for k, v in (info.get("version") or {}).items()]
    if info.get("server"):
        parts.append(f"`server: {info['server']}`")
    owners = sorted({m["owned_by"] for m in info.get("models", []) if m.get("owned_by")})
    if owners:
        parts.append("owned_by " + ", ".join(owners))
    return "; ".join(parts) or "none exposed (no /version, no `server` header)"


def deployment_lines(section: DeploymentSection | None) -> list[str]:
    """Markdown lines; [] for a sign-off of qtoolkit's own engine."""
    deps = section.endpoints if section else None
    if not section or not deps:
        return []
    lines = ["", "## Deployments measured", "", "| role | endpoint | model measured | models served | version | key |",
             "|---|---|---|---|---|---|"]
    for role, info in deps.items():
        key = f"from ${info['api_key_env']}" if info.get("api_key_env") else "none"
        lines.append(f"| {role} | {info['url']} | `{info['model_id']}` | {', '.join(info['model_ids'])} | "
                     f"{_version(info)} | {key} |")
    bench = section.bench
    if bench is not None:
        lines += ["", "## Throughput of the deployments (same load generator, workload and rounds on both)", "",
                  f"Workload sha256 `{bench.workload_sha256[:16]}`.", "",
                  "| concurrency | endpoint | model | ok | out tok/s | req/s | TTFT p50 ms | TPOT p50 ms |",
                  "|---|---|---|---|---|---|---|---|"]
        notes = []
        for tier in bench.tiers:
            for role, e in tier.endpoints.items():
                ms = [_num(None if v is None else 1000 * v, ".0f") for v in (e.ttft_p50_s, e.tpot_p50_s)]
                lines.append(f"| {tier.concurrency} | {role}: {e.endpoint} | `{e.model_id}` | "
                             f"{e.completed}/{tier.num_requests} | {e.output_tok_per_s:.1f} | "
                             f"{e.requests_per_s:.2f} | {ms[0]} | {ms[1]} |")
            line = f"- concurrency {tier.concurrency}: candidate ÷ baseline {_num(tier.total_speedup, '.3f')}x"
            if r := RoundsRatio.from_json(tier.total_speedup_rounds):
                ci = f"95% CI [{r.ci.bounds[0]:.3f}, {r.ci.bounds[1]:.3f}]" if r.ci.bounds is not None else "no CI"
                line += f"; over {r.rounds} rounds of fresh requests {r.ratio:.3f}x, {ci}"
            notes.append(line)
        lines += [""] + notes + [""]
    items = section.not_measurable
    ablation = next((x for x in items if x.key == "ablation"), None)
    if ablation:
        lines += ["", "## Ablation: not measurable on this deployment", "", f"{ablation.reason}.", ""]
    if items:
        lines += ["## Not measurable on this deployment", "",
                  "Never filled in from the local engine; gates resting on them are marked `not measurable`.", ""]
        lines += [f"- {x.what}: {x.reason}" for x in items]
        lines.append("")
    return lines
