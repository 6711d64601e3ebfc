"""`qtool bench serve`: throughput and latency of a serving endpoint under load, per concurrency tier."""

from __future__ import annotations

import argparse

HELP = ("load-test our server (or any OpenAI-compatible --endpoint): output tok/s, req/s, TTFT/TPOT/ITL per "
        "concurrency tier, static vs continuous batching and HF generate in one run")


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
                   help="model to serve (`default`, folder, .gguf); with --endpoint, the served model's name")
    p.add_argument("--endpoint", default=None, help="an existing OpenAI-compatible server, e.g. http://host:8000/v1")
    p.add_argument("--api-key", default=None, help="bearer key for --endpoint")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 32], help="tiers, e.g. 1,4,16,32")
    p.add_argument("--batching", type=_modes, default=["continuous"],
                   help="static, continuous, or static,continuous to measure both (and their ratio) in one run")
    p.add_argument("--workload", default="mixed",
                   help="code, summarization, mixed, or your own workload file(s) FILE.jsonl[,FILE2.jsonl] "
                        "(prompt or messages per line; max_tokens per line, else the answer length measured on "
                        "the first system)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrival rate in requests/s (default: all at once)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per tier (default: 2 x concurrency, between 4 and 64)")
    p.add_argument("--compare", choices=["hf"], default=None, help="hf: also run the workload through HF generate")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, output lengths and arrivals")
    p.add_argument("--mean-output-tokens", type=int, default=64, help="mean of the lognormal output lengths")
    p.add_argument("--max-output-tokens", type=int, default=128, help="output lengths are clipped to this")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (for endpoints that reject the ignore_eos extension)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", default="auto", help="engine and HF precision: auto, float32, bfloat16")
    p.add_argument("--speculative", type=_proposers, default=[], metavar="PROPOSERS",
                   help="also measure the server with speculative decoding, one system per proposer: e.g. "
                        "ngram,self-int4 (draft:PATH, self-fp8, self:PATH too); ratios give the speedup curve")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="most drafts per step (1-16)")
    p.add_argument("--output", required=True, help="result JSON path")


def _proposers(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip() and p.strip().lower() != "none"]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so server subprocesses are stopped


def run(args: argparse.Namespace) -> int:
    import signal

    from ..bench import bench_serve, format_table
    from ..engine.speculative import check_speculative_args
    from ..errors import QToolError
    from ..io import write_json

    if args.num_requests is not None and args.num_requests <= 0:
        raise QToolError("--num-requests must be positive")
    if args.rate is not None and args.rate <= 0:
        raise QToolError("--rate must be a positive number of requests per second")
    for proposer in args.speculative:  # fail before any server starts
        check_speculative_args(proposer, args.num_speculative_tokens)
    if args.speculative and args.endpoint:
        raise QToolError("--speculative starts our own servers: drop --endpoint (or start that server with it)")
    from ..workload_files import parse_workload

    workload = parse_workload(args.workload)
    signal.signal(signal.SIGTERM, _interrupt)
    report = bench_serve(args.model, endpoint=args.endpoint, concurrency=args.concurrency, batching=args.batching,
                         workload=workload, rate=args.rate, num_requests=args.num_requests,
                         compare_hf=args.compare == "hf", seed=args.seed, mean_output_tokens=args.mean_output_tokens,
                         max_output_tokens=args.max_output_tokens, api=args.api, ignore_eos=args.ignore_eos,
                         api_key=args.api_key, kv_cache_memory=args.kv_cache_memory,
                         max_num_seqs=args.max_num_seqs, dtype=args.dtype, speculative=args.speculative,
                         num_speculative_tokens=args.num_speculative_tokens,
                         on_tier=lambda partial: write_json(args.output, partial))
    path = write_json(args.output, report)
    print(format_table(report))
    print(f"wrote {path}")
    failed = sum(r.get("failed", 0) for t in report["tiers"] for r in t["results"].values())
    return 1 if failed else 0
