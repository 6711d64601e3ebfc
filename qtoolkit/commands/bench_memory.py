"""`qtool bench memory`: run a command with its process tree's peak memory (summed PSS and RSS) sampled into JSON."""

from __future__ import annotations

import argparse

HELP = ("run a command and write its process tree's peak memory (summed PSS, what the tree holds, and summed "
        "RSS) with a once-a-second timeline as JSON")

EXAMPLES = """\
examples:
  qtool bench memory --output single.json -- qtool signoff --model default --recipe fp8-dynamic --output runs/s1
  qtool bench memory --output sweep.json -- qtool signoff --model default --recipe fp8-dynamic,int8 --output runs/s2
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", default="memory.json", help="result JSON (default: %(default)s)")
    parser.add_argument("--every", type=float, default=0.5,
                        help="seconds between samples; a PSS reading walks the page tables, ~10 ms a GiB "
                             "(default: %(default)s)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the command to run and measure, after --")


def run(args: argparse.Namespace) -> int:
    from qtoolkit.bench.tree_memory import measure_command
    from qtoolkit.progress import status

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    result = measure_command(command, args.output, args.every)
    status(f"peak summed PSS {result.pss.to_json()['gib']} GiB, RSS {result.rss.to_json()['gib']} GiB over "
           f"{result.pss.processes} processes; wrote {args.output}")
    return result.rc if result.rc is not None and 0 <= result.rc <= 3 else 2
