"""`qtool signoff`: quantize, evaluate, benchmark and decide; exit 0 PASS, 1 FAIL, 2 error, 3 INCONCLUSIVE."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from qtoolkit.endpoints.args import add_server_arguments, resolve_server
from qtoolkit.errors import QToolError
from qtoolkit.signoff import defaults
from qtoolkit.signoff.config import (
    DeploymentSignoffConfig,
    EndpointSweepSignoffConfig,
    LocalSignoffConfig,
    SignoffConfig,
    SweepSignoffConfig,
)
from qtoolkit.signoff.verdicts import EXIT_CODES

DEFAULT_MAX_ITEMS = defaults.MAX_ITEMS
HELP = ("one command from model + recipe to a release verdict (PASS/FAIL/INCONCLUSIVE) with a layer-by-layer "
        "ablation report")


EXAMPLES = """\
examples:
  qtool signoff --model default --recipe fp8-dynamic --output runs/signoff-fp8
  qtool signoff --model default --recipe int3-rtn-canary --output runs/canary   # must FAIL (exit 1)
  qtool signoff --model default --recipe fp8-dynamic,int4-rtn,int3-rtn-canary --output runs/sweep  # which to ship
  qtool signoff --model ./my-model --recipe ./llmcompressor-recipe.yaml --policy ./policy.yaml --output runs/x
"""


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: concurrency tiers must be positive")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=defaults.MODEL, help="`default`, a Hugging Face folder or a .gguf file")
    p.add_argument("--recipe", help="recipe name in recipes/ or a YAML path; several, comma-separated, sign off each "
                   "against one baseline and recommend the cheapest that passes (not with --candidate-endpoint: the "
                   "served checkpoint is already quantized)")
    p.add_argument("--policy", default=defaults.POLICY, help="policy name in recipes/policies/ or a YAML path")
    p.add_argument("--limit", type=int, default=defaults.LIMIT, help="items per eval task (small keeps the run to minutes)")
    add_server_arguments(p, who="the candidate (evaluated there instead of in-process)", routes=("/v1/completions",))
    p.add_argument("--candidate-endpoint", metavar="[NAME=]URL", action="append", default=[],
                   help="sign off a deployment: the candidate served by any OpenAI-compatible server (vLLM, SGLang, "
                        "TGI, qtool serve); --model then names its local checkpoint (tokenizer, memory gate). "
                        "Repeat as NAME=URL to sign off several served candidates against one baseline and get one "
                        "recommendation (--model is then only their tokenizer)")
    p.add_argument("--baseline-endpoint", metavar="URL", help="the baseline deployment (with --candidate-endpoint)")
    p.add_argument("--baseline", help="local baseline model for the baseline endpoint's tokenizer (default: --model)")
    p.add_argument("--candidate-model-id", help="model id the candidate endpoint must serve (default: its only one)")
    p.add_argument("--baseline-model-id", help="model id the baseline endpoint must serve (default: its only one); "
                   "API keys come from QTOOLKIT_CANDIDATE_API_KEY / QTOOLKIT_BASELINE_API_KEY or OPENAI_API_KEY")
    p.add_argument("--concurrency", type=_ints, default=list(defaults.CONCURRENCY), help="bench tiers, e.g. 1,8,32")
    p.add_argument("--num-requests", type=int, help="requests per bench tier (default: two waves of the tier)")
    # none by default: each proposer adds three ablation systems, each served --rounds rounds at every tier
    # (about twice the bench step), and the speed gates then compare both sides with speculation on
    p.add_argument("--speculative", default=defaults.SPECULATIVE,
                   help="proposer of the ablation's speculative-decoding layer (ngram, self-int4, draft:PATH, eagle3:DIR, ...; "
                        "default none: the layer is left out; with one, the speed gates compare both sides with it)")
    p.add_argument("--kv-cache-dtype", default=defaults.KV_CACHE_DTYPE, metavar="{auto,fp8,int8}",
                   help="the candidate's KV cache in its eval and bench servers (default auto: the checkpoint's "
                        "kv_cache_scheme when its recipe has one, else the model's dtype); a quantized cache adds "
                        "the ablation's KV cache layer: unquantized vs quantized cache at a budget where it is the "
                        "limit")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of every ablation system at every tier, on fresh requests each, interleaved; the "
                        f"speed gates judge the interval of the per-round ratios (default {defaults.ROUNDS}; with 1 there is "
                        "no interval and the gates are INCONCLUSIVE; a deployment sign-off: "
                        f"{defaults.DEPLOYMENT_ROUNDS})")
    p.add_argument("--max-rounds", type=int, default=None,
                   help="while a speed gate is inconclusive, the candidate and baseline under the same serving "
                        f"configuration serve 2 more rounds per tier, up to this budget (default {defaults.MAX_ROUNDS}, or "
                        "--rounds if larger; "
                        "equal to --rounds: one look)")
    p.add_argument("--max-items", type=int, default=None,
                   help="while a quality gate is inconclusive, double the items per task up to this budget "
                        f"(default: {DEFAULT_MAX_ITEMS}, or --limit if larger; equal to --limit: one look)")
    p.add_argument("--allow-weak-sandbox", action="store_true",
                   help="run model-written code even where bubblewrap cannot (weaker isolation, shown in the report)")
    p.add_argument("--rejudge", action="store_true",
                   help="decide again from the step outputs already in --output (e.g. under another --policy); "
                        "runs no step")
    p.add_argument("--data", action="append", default=[], metavar="FILE.jsonl",
                   help="your own workload file (repeatable): its task custom:FILE-STEM joins the gates (policy "
                        "section `custom`) and the report, and the benchmark replays its request mix")
    p.add_argument("--output", required=True, help="report folder (reruns reuse finished steps)")


def recipe_list(spec: str) -> list[str]:
    """`--recipe a,b,c` -> the recipes; one name is a single sign-off."""
    return [s.strip() for s in spec.split(",") if s.strip()]


def endpoint_pairs(values: list[str]) -> list[tuple[str, str]]:
    """`--candidate-endpoint NAME=URL` (repeatable) -> [(name, url)]; a lone bare URL is named `candidate`."""
    pairs = []
    for v in values:
        name, sep, url = v.partition("=")
        if not sep or name.startswith(("http://", "https://")):
            if len(values) > 1:
                raise QToolError(f"--candidate-endpoint {v!r}: with several candidate endpoints name each one, "
                                 "e.g. --candidate-endpoint int4=http://host:8001/v1")
            name, url = "candidate", v
        pairs.append((name.strip(), url.strip()))
    if len({n for n, _ in pairs}) != len(pairs):
        raise QToolError("two --candidate-endpoint share a name: give each candidate its own NAME=URL")
    return pairs


REJUDGE_SWEEP = ("--rejudge takes one recipe; to judge a sweep again rerun the same command: its finished steps are "
                 "reused")


def config_of(args: argparse.Namespace) -> SignoffConfig:
    """The one configuration type of the mode the flags ask for; a flag left out takes the type's default, which
    is defaults.py's (the budgets that follow --limit and --rounds included). Flags of another mode are refused."""
    deployed = args.candidate_endpoint or args.baseline_endpoint
    if bool(args.recipe) == bool(deployed):
        raise QToolError("pass --recipe R (quantize and serve here) or --candidate-endpoint with --baseline-endpoint "
                         "(sign off served deployments), not both or neither")
    if deployed and args.kv_cache_dtype != "auto":
        raise QToolError("--kv-cache-dtype sets the cache of servers qtoolkit starts: a deployment's KV cache is its "
                         "server's own flag (e.g. vLLM's --kv-cache-dtype fp8); drop --kv-cache-dtype")
    endpoint, _ = resolve_server(args.base_url, args.endpoint, ("/v1/completions",))
    common: dict[str, Any] = {
        "model": args.model, "output": args.output, "policy": args.policy, "limit": args.limit,
        "concurrency": args.concurrency, "num_requests": args.num_requests, "data": args.data,
        "allow_weak_sandbox": args.allow_weak_sandbox, **({"rounds": args.rounds} if args.rounds else {}),
        "max_rounds": defaults.max_rounds(args.rounds or defaults.ROUNDS) if args.max_rounds is None
        else args.max_rounds,
        "max_items": defaults.max_items(args.limit) if args.max_items is None else args.max_items}
    if deployed:
        return _deployment_config(args, endpoint, common)
    common |= {"endpoint": endpoint, "kv_cache_dtype": args.kv_cache_dtype,
               "speculative": None if (args.speculative or "none").lower() == "none" else args.speculative}
    recipes = recipe_list(args.recipe)
    if len(recipes) > 1:
        if args.rejudge:
            raise QToolError(REJUDGE_SWEEP)
        return SweepSignoffConfig(recipes=tuple(recipes), **common)
    return LocalSignoffConfig(recipe=args.recipe, rejudge=args.rejudge, **common)


def _deployment_config(args: argparse.Namespace, endpoint: str | None, common: dict[str, Any],
                       ) -> DeploymentSignoffConfig | EndpointSweepSignoffConfig:
    """A deployment sign-off, or a sweep of several served candidates against one baseline endpoint."""
    pairs = endpoint_pairs(args.candidate_endpoint)
    if len(pairs) > 1 and args.rejudge:
        raise QToolError(REJUDGE_SWEEP)
    if len(pairs) > 1 and not args.baseline_endpoint:
        raise QToolError("several --candidate-endpoint need one --baseline-endpoint to be compared with")
    if not (pairs and args.baseline_endpoint):
        raise QToolError("pass both --candidate-endpoint and --baseline-endpoint: a deployment sign-off measures "
                         "both sides the same way (or neither, to sign off qtoolkit's own engine)")
    if endpoint:
        raise QToolError("--endpoint is the candidate-only shortcut: use --candidate-endpoint with --baseline-endpoint")
    if args.rejudge:
        raise QToolError("--rejudge judges a local sign-off's step outputs again; a deployment sign-off rerun with "
                         "the same command reuses its finished steps: drop --rejudge")
    served = {"baseline_endpoint": args.baseline_endpoint, "baseline": args.baseline,
              "candidate_model_id": args.candidate_model_id, "baseline_model_id": args.baseline_model_id}
    if len(pairs) > 1:
        return EndpointSweepSignoffConfig(candidates=tuple(pairs), **common, **served)
    return DeploymentSignoffConfig(candidate_endpoint=pairs[0][1], **common, **served)


def run(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    # stdout carries the verdict; llm-compressor's loguru sink binds to whatever sys.stdout is at its import, so
    # the sign-off is imported inside the redirect (imported here, not above: `qtool --help` imports every command)
    with contextlib.redirect_stdout(sys.stderr):
        from qtoolkit.signoff.deployment import signoff_deployments
        from qtoolkit.signoff.run import signoff_local
        from qtoolkit.signoff.sweep import signoff_endpoint_sweep, signoff_sweep

        match cfg:  # the mode is the configuration's type, never which of its fields are set
            case LocalSignoffConfig():
                report = signoff_local(cfg)
            case DeploymentSignoffConfig():
                report = signoff_deployments(cfg)
            case SweepSignoffConfig():
                report = signoff_sweep(cfg)
            case EndpointSweepSignoffConfig():
                report = signoff_endpoint_sweep(cfg)
            case _:
                raise TypeError(f"{type(cfg).__name__} is no sign-off mode")
    if isinstance(cfg, (SweepSignoffConfig, EndpointSweepSignoffConfig)):
        return _print_sweep(report, args.output)
    print(f"verdict: {report['verdict']}")
    for reason in report["reasons"]:
        print(f"  - {reason}")
    print(f"report: {args.output}/report.html (also report.md, report.json)")
    return EXIT_CODES[report["verdict"]]


def _print_sweep(report: dict, output: str) -> int:
    print(report["line"])
    for c in report["candidates"]:
        print(f"  {c['name']}: {c['verdict']} (at its family share {c['family_alpha']:.2%}: {c['family_verdict']})"
              + (f" - {c['error']}" if c.get("error") else ""))
    print(f"report: {output}/report.html (also report.md, report.json; each candidate's under candidates/)")
    return int(report["exit_code"])
