"""What speculation did inside the server during one bench tier, and what it could have bought at best.

The load generator sees only tokens and timings; the engine's side (draft and verify time, acceptance per draft
position, the policy's cost estimates) comes from the server's Prometheus `/metrics`, scraped before and after the
tier and differenced. From those measured costs the tier gets a ceiling: the speedup the policy's own cost model
(Leviathan et al.) allows at the measured acceptance and at perfect acceptance, first for the decode steps, then
for whole requests, where the prefill share measured on the no-spec system of the same tier does not speed up.
The ceiling is reported for concurrency 1, where a request's time is its own prefill plus its decode steps.
The model takes draft positions as independent trials of the first position's acceptance; prompt lookup's
acceptance is bursty (a match tends to run on), so it can beat the "measured acceptance" figure. The figure at
acceptance 1 is a true bound for the measured r and v: no step can emit more than k + 1 tokens. Both costs are
moving estimates from the same tier, so they carry its noise (v at batch 1 read 0.02-0.13 across runs here).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .engine.speculative.policy import SpeculationPolicy


async def _get_metrics(base_url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(headers=headers, timeout=10.0) as client:
            resp = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def parse_speculative(text: str) -> dict[str, Any] | None:
    """The qtool_spec_* samples of one scrape; None when the server does not speculate (or is not ours)."""
    out: dict[str, Any] = {"position": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removesuffix("_total")  # totals are counters, exposed as NAME_total
            if not name.startswith("qtool_spec_"):
                continue
            labels = s.labels
            if name == "qtool_spec_position_tokens":
                out["position"][(int(labels["position"]), labels["outcome"])] = s.value
            elif name == "qtool_spec_seconds":
                out[f"{labels['phase']}_seconds"] = s.value
            elif name == "qtool_spec_decode_steps":
                out[f"{labels['kind']}_steps"] = s.value
            elif not labels:
                out[name.removeprefix("qtool_spec_")] = s.value
    # the labelled samples appear once the engine has reported speculation; a plain server shows zeros only
    return out if "verify_seconds" in out else None


def scrape_speculative(base_url: str, api_key: str | None = None) -> dict[str, Any] | None:
    text = asyncio.run(_get_metrics(base_url, api_key))
    return parse_speculative(text) if text else None


def tier_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """Engine-side speculation over one tier: counters differenced, the policy's cost estimates as at its end."""
    if not after:
        return None
    before = before or {"position": {}}

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    positions = sorted({p for p, _ in after["position"]})
    by_position = []
    for p in positions:
        proposed = after["position"].get((p, "proposed"), 0) - before["position"].get((p, "proposed"), 0)
        accepted = after["position"].get((p, "accepted"), 0) - before["position"].get((p, "accepted"), 0)
        if proposed > 0:
            by_position.append(round(accepted / proposed, 4))
    drafted, accepted = d("draft_tokens"), d("accepted_tokens")
    propose, verify = d("propose_seconds"), d("verify_seconds")
    return {"draft_tokens": int(drafted), "accepted_tokens": int(accepted),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_by_position": by_position,
            "verifications": int(d("verifications")),
            "speculative_steps": int(d("speculative_steps")), "plain_steps": int(d("plain_steps")),
            "proposer_seconds": round(propose, 4), "verify_seconds": round(verify, 4),
            "proposer_share": round(propose / (propose + verify), 4) if propose + verify > 0 else 0.0,
            "draft_cost_ratio": round(after.get("draft_cost_ratio", 0.0), 4),
            "verify_cost_per_token": round(after.get("verify_cost_per_token", 0.0), 4)}


def speculation_ceiling(engine: dict[str, Any], *, num_speculative_tokens: int,
                        prefill_share: float) -> dict[str, Any]:
    """Best speedup the measured costs allow: at the measured first-position acceptance, and at acceptance 1.

    decode = max over k <= K of E(a, k) / ((1 + k v) (1 + k r)), the policy's model of one step;
    request = 1 / (p + (1 - p) / decode), with p the no-spec system's share of request time spent before the first
    token (prefill), which speculation does not touch.
    """
    policy = SpeculationPolicy(num_speculative_tokens)
    policy.draft_cost, policy.verify_cost = engine["draft_cost_ratio"], engine["verify_cost_per_token"]
    measured = engine["acceptance_by_position"][0] if engine["acceptance_by_position"] else 0.0
    out: dict[str, Any] = {"model": "E(a,k) / ((1 + k v)(1 + k r)); request = 1 / (p + (1 - p) / decode)",
                           "draft_cost_ratio": policy.draft_cost, "verify_cost_per_token": policy.verify_cost,
                           "prefill_share": round(prefill_share, 4), "first_position_acceptance": measured}
    for name, a in (("measured_acceptance", measured), ("full_acceptance", 1.0)):
        k, gain = policy.best_k(a)
        gain = max(gain, 1.0)  # below 1 the policy decodes plainly
        out[name] = {"best_k": k, "decode_speedup": round(gain, 3),
                     "request_speedup": round(1.0 / (prefill_share + (1.0 - prefill_share) / gain), 3)}
    return out


def prefill_share(result: dict[str, Any]) -> float | None:
    """Share of a request's time before its first token, from a tier summary at concurrency 1."""
    ttft, latency = (result.get("ttft_s") or {}).get("mean"), (result.get("latency_s") or {}).get("mean")
    return ttft / latency if ttft and latency else None
