"""`qtool`: thin argument parsing over the Python API.

Exit codes: 0 ok / PASS, 1 FAIL (a gate failed), 2 error (bad input, or any unexpected exception: a crash is
never a verdict), 3 INCONCLUSIVE (sign-off without enough evidence to decide).

Each command lives in `qtoolkit/commands/<name>.py` and exposes HELP, add_arguments(parser) and run(args).
`bench` and its kinds (`bench kernels`, `bench serve`, `bench decode`) come from `commands/bench_<kind>.py`.
Heavy imports (torch, transformers) happen inside run(), so `qtool --help` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from .errors import QToolError

COMMANDS = ["quantize", "generate", "serve", "eval", "diagnose", "signoff"]
BENCH_KINDS = ["kernels", "serve", "decode"]


def _load(name: str):
    try:
        return importlib.import_module(f"qtoolkit.commands.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"qtoolkit.commands.{name}":
            return None  # command not built in this version
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qtool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        mod = _load(name)
        if mod is None:
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    bench = sub.add_parser("bench", help="benchmarks that print measured figures and write JSON")
    bench_sub = bench.add_subparsers(dest="bench_kind", required=True)
    for kind in BENCH_KINDS:
        mod = _load(f"bench_{kind}")
        if mod is None:
            continue
        p = bench_sub.add_parser(kind, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except QToolError as e:
        print(f"qtool: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("qtool: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, a corrupt file, a full disk: an error, never a FAIL
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(f"qtool: error: unexpected {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              f"(at {os.path.basename(where.filename)}:{where.lineno}; set QTOOL_TRACEBACK=1 for the traceback)",
              file=sys.stderr)
        if os.environ.get("QTOOL_TRACEBACK"):
            traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
