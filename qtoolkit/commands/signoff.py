"""`qtool signoff`: quantize, evaluate, benchmark and decide; exit 0 PASS, 1 FAIL, 2 error."""

from __future__ import annotations

import argparse

HELP = "one command from model + recipe to a release verdict (PASS/FAIL) with a layer-by-layer ablation report"


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: concurrency tiers must be positive")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="`default`, a Hugging Face folder or a .gguf file")
    p.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    p.add_argument("--policy", default="default", help="policy name in recipes/policies/ or a YAML path")
    p.add_argument("--limit", type=int, default=8, help="items per eval task (small keeps the run to minutes)")
    p.add_argument("--endpoint", help="evaluate the candidate through this OpenAI-compatible endpoint")
    p.add_argument("--concurrency", type=_ints, default=[1, 8], help="bench tiers, e.g. 1,8,32")
    p.add_argument("--num-requests", type=int, help="requests per bench tier (default: two waves of the tier)")
    p.add_argument("--speculative", default="ngram",
                   help="proposer of the ablation's speculative-decoding layer (ngram, self-int4, draft:PATH, ...; "
                        "default ngram; none leaves the layer out)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of the throughput gates' systems at the top tier, on fresh requests each; the gates "
                        "judge the lower 95%% bound of the per-round speedups (default 5; 1 judges one point)")
    p.add_argument("--data", action="append", default=[], metavar="FILE.jsonl",
                   help="your own workload file (repeatable): its task custom:FILE-STEM joins the gates (policy "
                        "section `custom`) and the report, and the benchmark replays its request mix")
    p.add_argument("--output", required=True, help="report folder (reruns reuse finished steps)")


def run(args: argparse.Namespace) -> int:
    from qtoolkit.signoff import SignoffConfig, signoff

    report = signoff(SignoffConfig(model=args.model, recipe=args.recipe, output=args.output, policy=args.policy,
                                   limit=args.limit, endpoint=args.endpoint, concurrency=args.concurrency,
                                   num_requests=args.num_requests, rounds=args.rounds, data=args.data,
                                   speculative=None if args.speculative.lower() == "none" else args.speculative))
    print(f"verdict: {report['verdict']}")
    for reason in report["reasons"]:
        print(f"  - {reason}")
    print(f"report: {args.output}/report.html (also report.md, report.json)")
    if any(s.get("status") == "error" for s in report["steps"].values()):
        return 2
    return 0 if report["verdict"] == "PASS" else 1
