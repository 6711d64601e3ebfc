"""`qtool signoff`'s flags and `SignoffConfig` read one set of defaults (qtoolkit/signoff/defaults.py): a flag
left out means what the config means."""

from __future__ import annotations

import argparse

from qtoolkit.commands.signoff import add_arguments
from qtoolkit.signoff.steps import SignoffConfig


def test_the_command_lines_defaults_are_the_configs():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--recipe", "int4-rtn", "--output", "out"])
    cfg = SignoffConfig()
    for name in ("model", "policy", "limit", "concurrency", "kv_cache_dtype", "speculative"):
        assert getattr(args, name) == getattr(cfg, name), name
    # left to the command, which applies the config's defaults with their dependence on other flags
    assert args.rounds is None and args.max_rounds is None and args.max_items is None
