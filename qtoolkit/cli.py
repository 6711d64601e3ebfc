"""`qtool`: thin argument parsing over the Python API.

Exit codes: 0 ok / PASS, 1 FAIL (a gate failed), 2 error (bad input, or any unexpected exception: a crash is
never a verdict), 3 INCONCLUSIVE (sign-off without enough evidence to decide).

Each command lives in `qtoolkit/commands/<name>.py` and exposes HELP, add_arguments(parser), run(args) and
optionally EXAMPLES (its --help epilog). `bench` and its kinds (`bench kernels`, `bench serve`, `bench decode`)
come from `commands/bench_<kind>.py`. Heavy imports (torch, transformers) happen inside run(), so `qtool --help`
stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import textwrap
import threading
import traceback

from . import __version__
from .errors import QToolError
from .io import no_room

COMMANDS = ["quantize", "generate", "serve", "eval", "diagnose", "signoff", "plot", "train-draft"]
BENCH_KINDS = ["kernels", "serve", "decode", "memory"]


def _load(name: str):
    try:
        return importlib.import_module(f"qtoolkit.commands.{name.replace('-', '_')}")
    except ModuleNotFoundError as e:
        if e.name == f"qtoolkit.commands.{name.replace('-', '_')}":
            return None  # command not built in this version
        raise


DESCRIPTION = """\
Quantize a released LLM, evaluate it against the unquantized model, serve and benchmark it, and sign it off
with one PASS/FAIL verdict. Everything runs offline; nothing is downloaded from a model hub."""

ENVIRONMENT = """\
environment variables:
  QTOOLKIT_QUIET=1       no progress bars or status lines (what -q sets)
  QTOOLKIT_CACHE=DIR     converted GGUF models and other caches (default: ~/.cache/qtoolkit)
  QTOOLKIT_NO_CPU_EXT=1  do not build or use the AVX2 C++ kernels; torch ops instead (correct, slower)
  QTOOLKIT_EXT_DIR=DIR   where the C++ kernels are built and cached (default: ~/.cache/qtoolkit/torch_extensions)
  LLM_COMPRESSOR_LOG_LEVEL  llm-compressor's own log level (qtool sets ERROR; WARNING with -v, INFO with -vv)

exit codes: 0 ok / PASS, 1 a gate failed (FAIL), 2 bad input or an error (ERROR), 3 undecided (INCONCLUSIVE)"""

EXAMPLES = """\
examples:
  qtool signoff --model default --recipe fp8-dynamic --output runs/signoff-fp8
  qtool quantize --model default --recipe int4-rtn --output out/int4
  qtool quantize --recipe int4-gptq --print-recipe > int4-gptq.llmcompressor.yaml
  qtool eval --model out/int4 --baseline default --task perplexity --limit 8 --output eval.json
  qtool bench serve --model out/int4 --max-concurrency 1,8 --output bench.json
  qtool COMMAND --help"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default after its help (not for flags whose default is "unset", nor for switches: a
    `--no-x` flag's default True reads as if the switch were on), text kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or \
                isinstance(action, argparse._StoreFalseAction):
            return text
        return super()._get_help_string(action)


def _output_flags() -> argparse.ArgumentParser:
    """-q / -v, accepted before or after the command (`qtool -q eval ...`, `qtool eval ... -q`)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("output")
    g.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="only results and errors: no progress bars or status lines (sets QTOOLKIT_QUIET=1)")
    g.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="more log output: -v shows qtoolkit's and llm-compressor's INFO lines, -vv DEBUG")
    return p


def _subparser(sub, name: str, mod, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    epilog = "\n\n".join(x for x in (getattr(mod, "EXAMPLES", "").strip("\n"), ENVIRONMENT) if x)
    description = getattr(mod, "DESCRIPTION", None) or textwrap.fill(f"{mod.HELP[0].upper()}{mod.HELP[1:]}.", 110)
    p = sub.add_parser(name, help=mod.HELP, description=description, epilog=epilog,
                       formatter_class=HelpFormatter, parents=[common])
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)
    return p


def build_parser() -> argparse.ArgumentParser:
    common = _output_flags()
    parser = argparse.ArgumentParser(prog="qtool", description=DESCRIPTION, epilog=f"{EXAMPLES}\n\n{ENVIRONMENT}",
                                     formatter_class=HelpFormatter, parents=[common])
    parser.add_argument("--version", action="version", version=f"qtool (qtoolkit) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        mod = _load(name)
        if mod is not None:
            _subparser(sub, name, mod, common)
    bench = sub.add_parser("bench", help="benchmarks that print measured figures and write JSON",
                           description="Benchmarks that print measured figures and write JSON: `kernels` (matmul "
                                       "paths), `serve` (a server under load, vLLM's field names), `decode` "
                                       "(batch-1 decode against llama.cpp and HF), `memory` (a command's "
                                       "process tree, peak PSS and RSS).",
                           epilog="examples:\n  qtool bench serve --model default --max-concurrency 1,4 "
                                  "--output bench.json\n  qtool bench kernels --quick\n  qtool bench KIND --help"
                                  f"\n\n{ENVIRONMENT}",
                           formatter_class=HelpFormatter, parents=[common])
    bench_sub = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    for kind in BENCH_KINDS:
        mod = _load(f"bench_{kind}")
        if mod is not None:
            _subparser(bench_sub, kind, mod, common)
    return parser


def configure_output(quiet: bool, verbose: int) -> None:
    """The CLI is the application, so it sets where log lines go: qtoolkit's own `qtoolkit` logger on stderr, and
    llm-compressor's level through its documented LLM_COMPRESSOR_LOG_LEVEL (read when it is imported). No other
    library's handlers or sinks are touched."""
    if quiet:
        os.environ["QTOOLKIT_QUIET"] = "1"
    level = logging.ERROR if quiet else {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    # llm-compressor warns at its import that no accelerator is found: on a CPU tool that is every run's first line,
    # and before a bad-input error it makes the error two lines; its warnings show from -v on
    lc_level = logging.ERROR if quiet else {0: logging.ERROR, 1: logging.WARNING}.get(verbose, logging.INFO)
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", logging.getLevelName(lc_level))
    log = logging.getLogger("qtoolkit")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("qtool: %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    configure_output(getattr(args, "quiet", False), getattr(args, "verbose", 0))
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        # past a file-size limit (ulimit -f) a write then fails with EFBIG, which names the file, instead of the
        # process dying of SIGXFSZ with nothing said
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        return int(args.func(args) or 0)
    except QToolError as e:
        print(f"qtool: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("qtool: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if (room := no_room(e)) is None:
            return _unexpected(e)
        where = f" {e.filename}" if e.filename else ""
        print(f"qtool: error: cannot write{where}: {room}: free space there (or raise the limit) and run the same "
              "command again", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, a corrupt file: an error, never a FAIL
        return _unexpected(e)


def _unexpected(e: BaseException) -> int:
    where = traceback.extract_tb(e.__traceback__)[-1]
    print(f"qtool: error: unexpected {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
          f"(at {os.path.basename(where.filename)}:{where.lineno}; set QTOOL_TRACEBACK=1 for the traceback)",
          file=sys.stderr)
    if os.environ.get("QTOOL_TRACEBACK"):
        traceback.print_exception(e)
    return 2


if __name__ == "__main__":
    sys.exit(main())
