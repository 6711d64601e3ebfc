"""`qtool bench decode`: single-stream decode tok/s of engine checkpoints against llama.cpp and HF, side by side."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from ..engine.config import KV_CACHE_DTYPES
from ..errors import QToolError
from ..io import write_json
from ..progress import bar, status

HELP = ("batch-1 greedy decode tok/s of one or more checkpoints in the engine against llama.cpp (the default "
        "model's GGUF) and HF generate, interleaved rounds, ratios in the JSON; with several --model, a side-by-side "
        "table (decode, roofline, --prefill-tokens prefill, each over the first --model)")


EXAMPLES = """\
examples:
  qtool bench decode --model default --model out/int4 --compare llama.cpp,hf --output decode.json
  qtool bench decode --model out/int4 --kv-cache-dtype auto,fp8 --rounds 5 --output kv.json
  qtool bench decode --model out/int4 --compare llama.cpp --context-tokens 2048 --output depth.json
  qtool bench decode --model default --model out/fp8 --prefill-tokens 256,2048 --rounds 5 --output prefill.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None, metavar="MODEL",
                   help="engine checkpoint (`default`, folder, .gguf); repeat to compare several (default: default)")
    p.add_argument("--compare", default="", help="peers, comma-separated: llama.cpp, hf")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the default model's own GGUF)")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    p.add_argument("--dtype", default="auto", help="engine and HF precision: auto, float32, bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,fp8,int8}[,...]",
                   help="the engine's KV cache; comma-separated to decode each checkpoint with each cache, as "
                        "systems `engine:NAME` (auto) and `engine:NAME:kv-fp8` / `:kv-int8` (default: auto)")
    p.add_argument("--context-tokens", type=int, default=0, metavar="N",
                   help="decode after an N-token prompt (HumanEval's problem statements), so every token attends "
                        "over N cached ones (default: a ~20-token prompt)")
    p.add_argument("--prefill-tokens", default="", metavar="N[,N...]",
                   help="also time prefill (prompt to first token) at these prompt lengths, every engine checkpoint "
                        "in the same interleaved rounds, each over the first --model (e.g. 256,2048)")
    p.add_argument("--threads", type=int, default=None, help="threads for every system (default: torch's choice)")
    p.add_argument("--no-breakdown", action="store_true",
                   help="skip the per-token split (GEMV / attention / other ops / host) and the roofline fraction")
    p.add_argument("--output", required=True, help="result JSON path")


def run(args: argparse.Namespace) -> int:
    # start-up time (`qtool --help` imports every command): torch and the decoders load when the command runs
    import torch
    from transformers import AutoTokenizer

    from ..bench.decode import (
        context_prompt,
        engine_decoder,
        format_side_by_side,
        format_table,
        hf_decoder,
        llama_cpp_decoder,
        run_decode_bench,
    )
    from ..bench.decode_breakdown import DecodeBreakdown, RooflineRounds, format_breakdown, format_roofline
    from ..kernels.roofline import measure_bandwidth
    from ..model.sources import default_gguf_path, resolve_model
    from ..provenance import provenance

    peers, caches = _checked_args(args)
    prefill_tokens = _prefill_lengths(args.prefill_tokens)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    models = args.model or ["default"]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(models[0]).path)
    prompt = context_prompt(tokenizer, args.context_tokens)
    # built before any model loads: a length the text cannot give is an error line, not minutes later
    prefill_prompts = _prefill_prompts(tokenizer, prefill_tokens, args.rounds)
    # room for the prompt as each system's tokenizer counts it, and the decoded tokens
    cache_tokens = 2 * args.context_tokens + args.tokens + 64 if args.context_tokens else 0
    if prefill_tokens:  # the longest prefill prompt, however a tokenizer re-counts its text
        cache_tokens = max(cache_tokens, 2 * max(prefill_tokens) + args.tokens + 64)
    systems = {}
    if "llama.cpp" in peers:  # first: a broken peer build is reported before minutes of engine loading
        gguf = Path(args.gguf) if args.gguf else default_gguf_path()
        if not gguf.is_file():
            raise QToolError(f"--gguf {gguf} does not exist: pass a .gguf file")
        status("starting llama.cpp in a child process")
        systems["llama.cpp"] = llama_cpp_decoder(gguf, threads, prompt, max(1024, cache_tokens))
    for spec in models:
        for cache in caches:
            status(f"loading {spec} into the engine" + ("" if cache == "auto" else f" with a {cache} KV cache"))
            name = f"engine:{resolve_model(spec).name}" + ("" if cache == "auto" else f":kv-{cache}")
            systems[name] = engine_decoder(spec, args.dtype, threads, cache, prompt, cache_tokens)
    if "hf" in peers:
        systems["hf"] = hf_decoder(resolve_model(models[0]).path, args.dtype, prompt)
    with bar(total=args.rounds * len(systems), desc="decode rounds", unit="run") as progress:
        report = run_decode_bench(systems, tokens=args.tokens, rounds=args.rounds,
                                  baseline="llama.cpp" if "llama.cpp" in systems else None, progress=progress,
                                  probe=None if args.no_breakdown else measure_bandwidth, prompt=prompt)
    if not args.no_breakdown:
        report = _with_breakdowns(report, systems, args.tokens)
    if prefill_prompts:
        report["prefill"] = _prefill_report(systems, prefill_prompts)
    rows = _side_by_side(report)
    report = {**provenance(command="bench decode", models=models, compare=peers, threads=threads,
                           kv_cache_dtypes=caches, context_tokens=args.context_tokens), **report,
              "side_by_side": [asdict(r) for r in rows]}
    print(format_table(report))
    for name, r in report["systems"].items():
        if "breakdown" in r:
            print(format_breakdown(name, DecodeBreakdown(**r["breakdown"])))
            print(format_roofline(name, RooflineRounds(**r["roofline"])))
    if "prefill" in report:
        from ..bench.decode import format_prefill_table

        print(format_prefill_table(report["prefill"]))
    if len(rows) > 1:
        print(format_side_by_side(rows))
    path = write_json(args.output, report)
    status(f"wrote {path}")
    return 0


def _with_breakdowns(report: dict, systems: dict, tokens: int) -> dict:
    """Each engine system's roofline fractions of its timed rounds (against the bandwidth measured at the start of
    each round, and against a buffer as large as its weights) and, from one more timed decode, its per-token split
    against the DRAM bandwidth measured once here (qtoolkit/bench/decode_breakdown.py)."""
    # start-up time, as in run(): these pull torch and the engine
    from ..bench.decode_breakdown import measure_breakdown, roofline_rounds
    from ..kernels.roofline import measure_bandwidth

    status("measuring memory bandwidth and the per-token breakdown")
    bandwidth = measure_bandwidth()
    for name, (decode, _) in systems.items():
        engine = getattr(decode, "engine", None)
        if engine is None:
            continue
        result = report["systems"][name]
        decode(16)  # the probes evicted the weights from the caches: a token after them took 8 ms against 6
        breakdown = measure_breakdown(engine, decode.prompt, tokens, bandwidth)
        weight_bytes = breakdown.weight_bytes_per_token
        working_set = measure_bandwidth(size_mb=max(1, weight_bytes >> 20))
        result["roofline"] = roofline_rounds(result["samples"], report["memory_bandwidth_gb_s_per_round"],
                                             weight_bytes, working_set).to_json()
        result["breakdown"] = breakdown.to_json()
    return {**report, "memory_bandwidth_gb_s": round(bandwidth, 2)}


def _prefill_lengths(text: str) -> list[int]:
    """--prefill-tokens as sorted distinct lengths, or a one-line error."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise QToolError(f"--prefill-tokens takes positive token counts, comma-separated (e.g. 256,2048), got {text!r}")
    return sorted({int(p) for p in parts})


def _prefill_prompts(tokenizer, lengths: list[int], rounds: int) -> dict[int, list[str]]:
    """A warm-up text and one per round for each length, every one starting at its own token of HumanEval's text
    (a prompt that started where another did would find that one's blocks in the prefix cache)."""
    from ..bench.decode import context_prompt

    return {n: [context_prompt(tokenizer, n, 97 * (r * len(lengths) + i), "--prefill-tokens")
                for r in range(rounds + 1)] for i, n in enumerate(lengths)}


def _prefill_report(systems: dict, prompts: dict[int, list[str]]) -> dict:
    """Prefill tok/s of every engine system at each length in interleaved rounds, over the first one's (the first
    --model with the first cache)."""
    from ..bench.decode import run_prefill_bench

    engines = {name: decode.prefill for name, (decode, _) in systems.items() if hasattr(decode, "prefill")}
    baseline = next(iter(engines))
    rounds = len(next(iter(prompts.values()))) - 1
    status("timing prefill")
    with bar(total=rounds * len(prompts) * len(engines), desc="prefill rounds", unit="run") as progress:
        return run_prefill_bench(engines, prompts, baseline=baseline, progress=progress)


def _checked_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The peers and KV caches asked for, or a one-line error for any flag out of range (before anything loads)."""
    peers = [c.strip() for c in args.compare.split(",") if c.strip()]
    bad = [c for c in peers if c not in ("llama.cpp", "hf")]
    if bad:
        raise QToolError(f"--compare takes llama.cpp and/or hf, got {', '.join(bad)}")
    if args.tokens < 2 or args.rounds < 1:
        raise QToolError("--tokens must be >= 2 and --rounds >= 1")
    caches = list(dict.fromkeys(c.strip() for c in args.kv_cache_dtype.split(",") if c.strip()))
    if not caches or any(c not in KV_CACHE_DTYPES for c in caches):
        raise QToolError(f"--kv-cache-dtype takes {', '.join(KV_CACHE_DTYPES)} (comma-separated), got "
                         f"{args.kv_cache_dtype!r}")
    if args.threads is not None and args.threads < 1:
        raise QToolError(f"--threads must be >= 1, got {args.threads}")
    if args.context_tokens < 0:
        raise QToolError(f"--context-tokens must be >= 0, got {args.context_tokens}")
    return peers, caches


def _side_by_side(report: dict):
    """The side-by-side rows (qtoolkit/bench/decode.py side_by_side) from this command's own report."""
    from ..bench.decode import side_by_side

    systems = report["systems"]
    prefill = report.get("prefill", {}).get("systems", {})
    return side_by_side({name: r["samples"] for name, r in systems.items()},
                        {name: r["roofline"]["median_fraction"] for name, r in systems.items() if "roofline" in r},
                        {name: {n: v["samples"] for n, v in per.items()} for name, per in prefill.items()})
