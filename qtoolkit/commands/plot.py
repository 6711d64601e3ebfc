"""`qtool plot`: the report's plots for an eval or bench serve result JSON."""

from __future__ import annotations

import argparse

HELP = "draw the plots of a qtool eval or qtool bench serve result JSON, as the sign-off report draws them"

EXAMPLES = """\
examples:
  qtool plot eval.json                  # eval.kld.png, eval.quality.png next to it
  qtool plot bench.json --output plots  # plots/bench.output_tok_per_s.png, .ttft.png, .tpot.png
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE.json", help="a result JSON written by qtool eval or qtool bench serve")
    p.add_argument("--output", "-o", default=None, help="folder for the PNG files (default: next to FILE.json)")


def run(args: argparse.Namespace) -> int:
    from qtoolkit.signoff.plot import plot_file

    for path in plot_file(args.file, args.output):
        print(path)
    return 0
