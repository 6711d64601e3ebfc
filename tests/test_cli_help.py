"""The CLI explains itself: every command's --help has a description, examples, defaults and help for each flag;
`--version` and `qtoolkit.__version__` come from the package metadata; `-q` / `-v` work on either side of the
command; `qtool --help` and `import qtoolkit` load no torch."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys

import pytest

import qtoolkit
from qtoolkit.cli import HelpFormatter, build_parser, main


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


COMMANDS = [path for path, _ in _commands(build_parser())]


def test_every_command_is_listed():
    for name in ("quantize", "eval", "signoff", "serve", "generate", "diagnose", ("bench", "serve")):
        assert (name if isinstance(name, tuple) else (name,)) in COMMANDS


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_has_description_examples_defaults_and_flag_help(path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*path, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "(default: " in out or not any(a.default not in (None, False, argparse.SUPPRESS) for a in
                                          dict(_commands(build_parser()))[path]._actions[1:])
    assert "examples:" in out and f"qtool {' '.join(path)}" in out.split("examples:")[1]
    parser = dict(_commands(build_parser()))[path]
    assert parser.description and not parser.description.startswith("`")
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            assert action.help, f"qtool {' '.join(path)} {action.option_strings} has no help"
    shown = [a for a in parser._actions if a.option_strings and a.default not in (None, False, argparse.SUPPRESS)
             and not isinstance(a, (argparse._HelpAction, argparse._StoreFalseAction)) and "default" not in (a.help or "")]
    for action in shown:  # ArgumentDefaultsHelpFormatter's "(default: X)" on every flag that has one
        assert "%(default)s" in HelpFormatter("qtool")._get_help_string(action), action
    for action in parser._actions:  # `--no-x (default: True)` would read as the switch being on
        if isinstance(action, argparse._StoreFalseAction):
            assert "%(default)s" not in HelpFormatter("qtool")._get_help_string(action), action
    if len(path) == 1 or path[0] == "bench" and len(path) == 2:
        assert "QTOOLKIT_NO_CPU_EXT" in out and "QTOOLKIT_EXT_DIR" in out and "QTOOLKIT_CACHE" in out


def test_version_from_package_metadata():
    want = importlib.metadata.version("qtoolkit")
    assert qtoolkit.__version__ == want
    out = subprocess.run([sys.executable, "-m", "qtoolkit", "--version"], capture_output=True, text=True,
                         env={**os.environ}, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"qtool (qtoolkit) {want}"


def test_help_and_import_load_no_torch():
    code = ("import sys, qtoolkit; from qtoolkit.cli import build_parser; build_parser().format_help(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-500:]


@pytest.mark.parametrize("argv", [["-q", "quantize", "--recipe", "x"], ["quantize", "--recipe", "x", "--quiet"]])
def test_quiet_before_or_after_the_command(argv):
    args = build_parser().parse_args(argv)
    assert args.quiet is True and not hasattr(args, "verbose")


def test_verbose_counts():
    assert build_parser().parse_args(["-vv", "eval"]).verbose == 2
    assert build_parser().parse_args(["eval", "-v"]).verbose == 1


def test_quiet_silences_status_lines(capsys, monkeypatch):
    monkeypatch.delenv("QTOOLKIT_QUIET", raising=False)
    assert main(["quantize", "--recipe", "int4-rtn", "-q"]) == 2  # no --output: one error line, nothing else
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--output is required" in err[0]
    assert os.environ.get("QTOOLKIT_QUIET") == "1"
