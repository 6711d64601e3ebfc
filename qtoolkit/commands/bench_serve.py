"""`qtool bench serve`: throughput and latency of a serving endpoint under load, per concurrency tier."""

from __future__ import annotations

import argparse
import math
import signal
from typing import Any

from ..endpoints.args import ROUTES, add_server_arguments, resolve_server
from ..engine.config import EngineConfig, add_engine_args
from ..errors import QToolError
from ..io import lock_output, write_json

HELP = ("load-test our server (or any OpenAI-compatible --base-url): output tok/s, req/s, TTFT/TPOT/ITL per "
        "concurrency tier, static vs continuous batching and HF generate in one run")
DESCRIPTION = """\
Load-test our server (or any OpenAI-compatible server given by --base-url) tier by tier. The JSON holds, per tier
and system, vLLM's `vllm bench serve` fields in its units (mean/median/std/p99_ttft_ms, tpot_ms, itl_ms, e2el_ms,
output_throughput, request_throughput, total_token_throughput, completed, num_prompts, max_concurrency,
request_rate) beside qtoolkit's own figures in seconds (ttft_s p50/p99/mean, output_tok_per_s, ...). vLLM's flag
names are accepted, and qtoolkit's own names as aliases."""


EXAMPLES = """\
examples:
  qtool bench serve --model out/int4 --concurrency 1,4,16 --batching static,continuous --output bench.json
  qtool bench serve --model out/int4 --speculative ngram --concurrency 1 --output spec.json
  qtool bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/completions --model my-model \\
      --max-concurrency 1,8 --num-prompts 16 --request-rate 4 --output vllm-side.json   # vLLM's flag names
  qtool bench serve --model out/int4 --concurrency 1 --slo ttft_ms=2000,tpot_ms=100 --output capacity.json
  qtool bench serve --model out/int4 --concurrency 4 --request-rate 2 --burstiness 0.5 --output bursty.json
"""


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16,32, got {text!r}") from None


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("static", "continuous")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--batching takes static, continuous or static,continuous, got {text!r}")
    return list(dict.fromkeys(modes))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="model to serve (`default`, folder, .gguf); with --base-url, the served model's name")
    add_server_arguments(p, who="the model (instead of starting our own)", routes=tuple(ROUTES))
    p.add_argument("--api-key", default=None, help="deprecated (a command line shows in `ps`): the bearer key for "
                   "--base-url is read from QTOOLKIT_API_KEY or OPENAI_API_KEY")
    p.add_argument("--max-concurrency", "--concurrency", dest="concurrency", type=_int_list, default=[1, 4, 16, 32],
                   help="tiers: the most requests in flight, e.g. 1,4,16,32 (vLLM's --max-concurrency, one run "
                        "per value)")
    p.add_argument("--batching", type=_modes, default=["continuous"],
                   help="static, continuous, or static,continuous to measure both (and their ratio) in one run")
    p.add_argument("--workload", default="mixed",
                   help="code, summarization, mixed, long (~2k-token documents: the KV-cache-bound regime), or your own "
                        "workload file(s) FILE.jsonl[,FILE2.jsonl] "
                        "(prompt or messages per line; max_tokens per line, else the answer length measured on "
                        "the first system)")
    p.add_argument("--request-rate", "--rate", dest="rate", type=float, default=None,
                   help="Poisson arrival rate in requests/s (vLLM's --request-rate; default: all at once, inf)")
    p.add_argument("--burstiness", default="1.0",
                   help="with --request-rate: gamma arrivals of this shape (vLLM's --burstiness; 1 = Poisson, "
                        "below 1 burstier)")
    p.add_argument("--slo", "--goodput", dest="slo", default=None, metavar="ttft_ms=MS,tpot_ms=MS",
                   help="latency objectives: each tier reports goodput (requests/s meeting every bound, as vLLM's "
                        "--goodput), and each system gets an SLO sweep: the highest open-loop request rate whose "
                        "p99 TTFT and p99 TPOT stay within the bounds (a rate the server cannot keep up with is "
                        "reported as saturated)")
    p.add_argument("--slo-requests", default="24", metavar="N", help="requests per probe of the SLO sweep")
    p.add_argument("--slo-start-rate", default=None, metavar="R",
                   help="the sweep's first rate, requests/s (default: the system's closed-loop requests/s at the "
                        "first tier)")
    p.add_argument("--num-prompts", "--num-requests", dest="num_requests", type=int, default=None,
                   help="requests per tier (vLLM's --num-prompts; default: 2 x concurrency, between 4 and 64)")
    p.add_argument("--compare", choices=["hf"], default=None, help="hf: also run the workload through HF generate")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, output lengths and arrivals")
    p.add_argument("--mean-output-tokens", type=int, default=64, help="mean of the lognormal output lengths")
    p.add_argument("--max-output-tokens", type=int, default=128, help="output lengths are clipped to this")
    p.add_argument("--api", choices=["completions", "chat"], default=None,
                   help="OpenAI route the requests use: completions (/v1/completions, the default) or chat "
                        "(/v1/chat/completions); --endpoint PATH says the same in vLLM's words")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (for endpoints that reject the ignore_eos extension)")
    p.add_argument("--speculative", type=_proposers, default=[], metavar="PROPOSERS",
                   help="also measure the server with speculative decoding, one system per proposer: e.g. "
                        "ngram,self-int4 (draft:PATH, self-fp8, self:PATH, eagle3:DIR too); ratios give the speedup curve")
    p.add_argument("--rounds", default="1", metavar="N",
                   help="serve each tier this many times, on fresh requests each round, systems interleaved: every "
                        "spec / plain and continuous / static ratio gets a 95%% interval over the rounds")
    p.add_argument("--output", required=True, help="result JSON path")
    # the started servers' engine options; batching and proposers are lists here, one system each
    add_engine_args(p, skip=("batching", "speculative"))


def _rounds(text: str) -> int:
    """Read in run(), not by argparse, so a bad value is qtool's one-line error (exit 2), not a usage block."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise QToolError(f"--rounds {text!r} is not a positive integer: pass 1 (no interval) or more, e.g. 5")
    return value


def _positive(flag: str, text: str | None, kind: type = float) -> Any:
    """A positive finite number from a flag's text, else qtool's one-line error (exit 2) naming the flag."""
    try:
        value = kind(text)
    except (TypeError, ValueError):
        value = None
    if value is None or not 0 < value < math.inf:
        raise QToolError(f"{flag} {text!r} is not a positive {'integer' if kind is int else 'number'}: "
                         f"pass e.g. {flag} {'24' if kind is int else '1.0'}")
    return value


def _arrivals(args: argparse.Namespace) -> Any:
    """The arrival process and SLO, checked before any server starts (bad values: exit 2, no file)."""
    from ..bench.serve import Arrivals
    from ..bench.summary import SLO

    burstiness = _positive("--burstiness", args.burstiness)
    if burstiness != 1.0 and args.rate is None:
        raise QToolError("--burstiness shapes open-loop arrivals: pass --request-rate R with it")
    slo = None if args.slo is None else SLO.parse(args.slo)
    start = None if args.slo_start_rate is None else _positive("--slo-start-rate", args.slo_start_rate)
    probe = _positive("--slo-requests", args.slo_requests, int)
    if probe < 6:  # saturation compares the first and last third of a probe's arrivals
        raise QToolError(f"--slo-requests {probe} is too few to tell a queue building up: pass 6 or more")
    return Arrivals(args.rate, burstiness, slo, probe, start)


def _proposers(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip() and p.strip().lower() != "none"]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so server subprocesses are stopped


def run(args: argparse.Namespace) -> int:
    # start-up time (`qtool --help` imports every command): the load generator, the deployment client and the
    # workload files load the server's modules, numpy and the evals only when the command runs
    from ..bench.serve import bench_serve, format_table
    from ..bench.workload_files import parse_workload
    from ..endpoints.deployment import Deployment

    if args.num_requests is not None and args.num_requests <= 0:
        raise QToolError("--num-requests must be positive")
    if args.rate is not None and not 0 < args.rate < math.inf:
        raise QToolError(f"--request-rate {args.rate} is not a positive finite number of requests per second: "
                         "pass e.g. 4, or leave it out to send every request at once")
    rounds = _rounds(args.rounds)
    arrivals = _arrivals(args)
    engine = EngineConfig.from_args(args, batching="continuous", speculative=None)
    for proposer in args.speculative:  # fail before any server starts
        engine.replace(speculative=proposer)
    endpoint, route = resolve_server(args.base_url, args.endpoint, tuple(ROUTES))
    named = bool(args.endpoint) and any(args.endpoint.rstrip("/").endswith(r) for r in ROUTES)
    if args.api and named and ROUTES[route] != args.api:
        raise QToolError(f"--api {args.api} and --endpoint {route} disagree: pass one of them")
    api = args.api or ROUTES[route]
    if args.speculative and endpoint:
        raise QToolError("--speculative starts our own servers: drop --base-url (or start that server with it)")
    workload = parse_workload(args.workload)
    signal.signal(signal.SIGTERM, _interrupt)
    lock = lock_output(args.output)  # two benches into one file would overwrite each other's tiers
    report = bench_serve(args.model, engine, endpoint=endpoint, concurrency=args.concurrency, batching=args.batching,
                         speculative=args.speculative, workload=workload, arrivals=arrivals,
                         num_requests=args.num_requests, compare_hf=args.compare == "hf", seed=args.seed,
                         mean_output_tokens=args.mean_output_tokens, max_output_tokens=args.max_output_tokens,
                         api=api, ignore_eos=args.ignore_eos, api_key=args.api_key or Deployment("endpoint").api_key(),
                         rounds=rounds, on_tier=lambda partial: write_json(args.output, partial))
    path = write_json(args.output, report)
    lock.release()
    print(format_table(report))
    print(f"wrote {path}")
    failed = sum(r.get("failed", 0) for t in report["tiers"] for r in t["results"].values())
    return 1 if failed else 0
