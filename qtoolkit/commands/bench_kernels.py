"""`qtool bench kernels`: time every dequant-matmul path against dense fp32/bf16 on decode and prefill shapes."""

from __future__ import annotations

import argparse

HELP = ("benchmark the quantized matmul paths (INT4/INT8/FP8) against dense fp32 and bf16, weights streamed "
        "from DRAM, with the memory bandwidth measured in the same run")


EXAMPLES = """\
examples:
  qtool bench kernels --quick
  qtool bench kernels --threads 2 --output bench_kernels.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", default="bench_kernels.json", help="result JSON (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="decode sizes M=1,8 only, fewer rounds (~1 min)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def run(args: argparse.Namespace) -> int:
    from qtoolkit.kernels.bench import format_table, run_benchmark
    from qtoolkit.kernels.cpu_build import cpu_kernels

    from qtoolkit.io import write_json
    from qtoolkit.progress import bar, status
    from qtoolkit.provenance import provenance

    status("loading the AVX2 CPU kernels (the first use compiles them, 1-2 min)")
    if cpu_kernels() is None:
        status("AVX2 CPU kernels unavailable: the qtoolkit paths are timed through their torch fallback")
    result = run_benchmark(quick=args.quick, threads=args.threads, progress_factory=lambda **kw: bar(**kw))
    result["cpu_extension"] = cpu_kernels() is not None
    result = {**provenance(command="bench kernels", quick=args.quick, threads=args.threads), **result}
    print(format_table(result))
    path = write_json(args.output, result)
    status(f"wrote {path}")
    return 0
