"""`qtool diagnose`: prefill vs decode on this machine, against a measured roofline."""

from __future__ import annotations

import argparse

HELP = "measure prefill and decode separately, classify the bottleneck with a roofline, recommend levers"


EXAMPLES = """\
examples:
  qtool diagnose --model out/int4 --output diagnose.json
  qtool diagnose --model default --batches 1,8 --prompt-lengths 128
"""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="`default`, a Hugging Face folder or a .gguf file")
    p.add_argument("--batches", type=_ints, default=(1, 4, 16, 32), help="decode batch sizes (e.g. 1,4,16,32)")
    p.add_argument("--prompt-lengths", type=_ints, default=(64, 256, 1024), help="prefill lengths")
    p.add_argument("--kv-cache-memory", default="1GiB", help="memory for the paged KV cache, e.g. 512MiB")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (dense weights)")
    p.add_argument("--output", help="write the measurements as JSON")


def run(args: argparse.Namespace) -> int:
    from qtoolkit.diagnose.run import diagnose, format_summary
    from qtoolkit.io import write_json

    result = diagnose(args.model, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                      batches=args.batches, prompt_lengths=args.prompt_lengths)
    print(format_summary(result))
    if args.output:
        write_json(args.output, result.to_json())
        print(f"wrote {args.output}")
    return 0
