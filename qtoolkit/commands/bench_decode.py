"""`qtool bench decode`: single-stream decode tok/s of engine checkpoints against llama.cpp and HF, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..engine.config import KV_CACHE_DTYPES
from ..errors import QToolError
from ..io import write_json
from ..progress import bar, status

HELP = ("batch-1 greedy decode tok/s of one or more checkpoints in the engine against llama.cpp (the default "
        "model's GGUF) and HF generate, interleaved rounds, ratios in the JSON")


EXAMPLES = """\
examples:
  qtool bench decode --model default --model out/int4 --compare llama.cpp,hf --output decode.json
  qtool bench decode --model out/int4 --kv-cache-dtype auto,fp8 --rounds 5 --output kv.json
  qtool bench decode --model out/int4 --compare llama.cpp --context-tokens 2048 --output depth.json
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
        format_table,
        hf_decoder,
        llama_cpp_decoder,
        run_decode_bench,
    )
    from ..bench.decode_breakdown import DecodeBreakdown, RooflineRounds, format_breakdown, format_roofline
    from ..kernels.roofline import measure_bandwidth
    from ..model.sources import default_gguf_path, resolve_model
    from ..provenance import provenance

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
    if args.context_tokens < 0:
        raise QToolError(f"--context-tokens must be >= 0, got {args.context_tokens}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    models = args.model or ["default"]
    prompt = context_prompt(AutoTokenizer.from_pretrained(resolve_model(models[0]).path), args.context_tokens)
    # room for the prompt as each system's tokenizer counts it, and the decoded tokens
    cache_tokens = 2 * args.context_tokens + args.tokens + 64 if args.context_tokens else 0
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
    report = {**provenance(command="bench decode", models=models, compare=peers, threads=threads,
                           kv_cache_dtypes=caches, context_tokens=args.context_tokens), **report}
    print(format_table(report))
    for name, r in report["systems"].items():
        if "breakdown" in r:
            print(format_breakdown(name, DecodeBreakdown(**r["breakdown"])))
            print(format_roofline(name, RooflineRounds(**r["roofline"])))
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
