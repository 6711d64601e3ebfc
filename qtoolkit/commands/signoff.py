"""`qtool signoff`: quantize, evaluate, benchmark and decide; exit 0 PASS, 1 FAIL, 2 error, 3 INCONCLUSIVE."""

from __future__ import annotations

import argparse
import contextlib
import sys

from qtoolkit.endpoints.args import add_server_arguments, resolve_server
from qtoolkit.errors import QToolError
from qtoolkit.signoff import defaults
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


def run(args: argparse.Namespace) -> int:
    # start-up time (`qtool --help` imports every command): the sign-off loads the evals, llm-compressor, torch
    from qtoolkit.signoff.run import SignoffConfig, signoff
    from qtoolkit.signoff.sweep import endpoint_pairs, recipe_list, signoff_endpoint_sweep, signoff_sweep

    deployed = args.candidate_endpoint or args.baseline_endpoint
    if bool(args.recipe) == bool(deployed):
        raise QToolError("pass --recipe R (quantize and serve here) or --candidate-endpoint with --baseline-endpoint "
                         "(sign off served deployments), not both or neither")
    if deployed and args.kv_cache_dtype != "auto":
        raise QToolError("--kv-cache-dtype sets the cache of servers qtoolkit starts: a deployment's KV cache is its "
                         "server's own flag (e.g. vLLM's --kv-cache-dtype fp8); drop --kv-cache-dtype")
    endpoint, _ = resolve_server(args.base_url, args.endpoint, ("/v1/completions",))
    pairs = endpoint_pairs(args.candidate_endpoint)
    several = (args.recipe is not None and len(recipe_list(args.recipe)) > 1) or len(pairs) > 1
    if several and args.rejudge:
        raise QToolError("--rejudge takes one recipe; to judge a sweep again rerun the same command: its finished "
                         "steps are reused")
    # stdout carries the verdict; llm-compressor's loguru sink binds to whatever sys.stdout is at its import
    with contextlib.redirect_stdout(sys.stderr):
        cfg = SignoffConfig(
            model=args.model, recipe=args.recipe, output=args.output, policy=args.policy, limit=args.limit,
            endpoint=endpoint, concurrency=args.concurrency, kv_cache_dtype=args.kv_cache_dtype,
            num_requests=args.num_requests,
            rounds=args.rounds or (defaults.DEPLOYMENT_ROUNDS if deployed else defaults.ROUNDS),
            max_rounds=max(defaults.MAX_ROUNDS, args.rounds or defaults.ROUNDS) if args.max_rounds is None
            else args.max_rounds,
            max_items=max(DEFAULT_MAX_ITEMS, args.limit) if args.max_items is None else args.max_items,
            allow_weak_sandbox=args.allow_weak_sandbox, rejudge=args.rejudge,
            speculative=None if deployed or (args.speculative or "none").lower() == "none" else args.speculative,
            candidate_endpoint=pairs[0][1] if pairs else None, baseline_endpoint=args.baseline_endpoint,
            baseline=args.baseline, candidate_model_id=args.candidate_model_id,
            baseline_model_id=args.baseline_model_id, data=args.data)
        if len(pairs) > 1:
            report = signoff_endpoint_sweep(cfg, pairs)
        else:
            report = signoff_sweep(cfg) if several else signoff(cfg)
    if several:
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
