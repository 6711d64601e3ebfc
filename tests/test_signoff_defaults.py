"""`qtool signoff`'s flags and the configuration types read one set of defaults (qtoolkit/signoff/defaults.py): a
flag left out means what the type means. The flags build exactly one type per mode (qtoolkit/signoff/config.py),
and a type holds no field of another mode."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from qtoolkit.commands.signoff import add_arguments, config_of
from qtoolkit.errors import QToolError
from qtoolkit.signoff import defaults
from qtoolkit.signoff.config import (
    CommonSignoffConfig,
    DeploymentSignoffConfig,
    EndpointsSignoffConfig,
    EndpointSweepSignoffConfig,
    EngineSignoffConfig,
    LocalSignoffConfig,
    SweepSignoffConfig,
)

CAND, BASE = "http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([*argv, "--output", "out"])


def test_the_command_lines_defaults_are_the_configs():
    args = _args("--recipe", "int4-rtn")
    cfg = LocalSignoffConfig(recipe="int4-rtn", output="out")
    for name in ("model", "policy", "limit", "concurrency", "kv_cache_dtype", "speculative"):
        assert getattr(args, name) == getattr(cfg, name), name
    # left to the command, which applies the type's defaults with their dependence on other flags
    assert args.rounds is None and args.max_rounds is None and args.max_items is None


@pytest.mark.parametrize("argv, want", [
    (["--recipe", "int4-rtn"], LocalSignoffConfig(recipe="int4-rtn", output="out")),
    (["--recipe", "int4-rtn,fp8-dynamic"], SweepSignoffConfig(recipes=("int4-rtn", "fp8-dynamic"), output="out")),
    (["--candidate-endpoint", CAND, "--baseline-endpoint", BASE],
     DeploymentSignoffConfig(candidate_endpoint=CAND, baseline_endpoint=BASE, output="out")),
    (["--candidate-endpoint", f"a={CAND}", "--candidate-endpoint", f"b={CAND}", "--baseline-endpoint", BASE],
     EndpointSweepSignoffConfig(candidates=(("a", CAND), ("b", CAND)), baseline_endpoint=BASE, output="out")),
])
def test_each_mode_built_from_its_flags_alone_is_its_types_defaults(argv, want):
    """The main job, a sweep, a deployment and an endpoint sweep: the flags left out mean the type's defaults,
    including the budgets that follow --limit and --rounds and a deployment's own rounds."""
    assert config_of(_args(*argv)) == want


def test_the_budgets_follow_limit_and_rounds():
    cfg = config_of(_args("--recipe", "int4-rtn", "--limit", "100", "--rounds", "12"))
    assert (cfg.max_items, cfg.max_rounds) == (100, 12) == (defaults.max_items(100), defaults.max_rounds(12))
    deployed = config_of(_args("--candidate-endpoint", CAND, "--baseline-endpoint", BASE))
    assert deployed.rounds == defaults.DEPLOYMENT_ROUNDS and deployed.max_rounds == defaults.MAX_ROUNDS


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def test_a_modes_type_holds_no_field_of_another_mode():
    common = _names(CommonSignoffConfig)
    engine, served = _names(EngineSignoffConfig) - common, _names(EndpointsSignoffConfig) - common
    assert engine and served and not engine & served
    local, deployment = _names(LocalSignoffConfig), _names(DeploymentSignoffConfig)
    assert "candidate_endpoint" not in local and "baseline_endpoint" not in local
    assert not {"recipe", "endpoint", "speculative", "kv_cache_dtype", "rejudge"} & deployment
    assert "rejudge" not in _names(SweepSignoffConfig) | _names(EndpointSweepSignoffConfig)
    with pytest.raises(TypeError):
        LocalSignoffConfig(recipe="int4-rtn", output="out", candidate_endpoint=CAND)
    with pytest.raises(TypeError):
        DeploymentSignoffConfig(candidate_endpoint=CAND, baseline_endpoint=BASE, output="out", recipe="int4-rtn")
    with pytest.raises(TypeError):
        SweepSignoffConfig(recipes=("a", "b"), output="out", rejudge=True)
    with pytest.raises(TypeError):
        EndpointSweepSignoffConfig(candidates=(("a", CAND),), baseline_endpoint=BASE, output="out",
                                   kv_cache_dtype="fp8")


def test_report_config_keeps_the_flat_record():
    """report.json's `config` is written as before the modes had their own types (a rejudged run folder gives
    the same report): every mode writes the same keys, in the same order."""
    local = LocalSignoffConfig(recipe="int4-rtn", output="out").to_json()
    deployed = DeploymentSignoffConfig(candidate_endpoint=CAND, baseline_endpoint=BASE, output="out").to_json()
    assert list(local) == list(deployed) and len(local) == 25
    assert local["recipe"] == "int4-rtn" and local["candidate_endpoint"] is None and local["rejudge"] is False
    assert deployed["candidate_endpoint"] == CAND and deployed["recipe"] is None
    assert deployed["kv_cache_dtype"] == "auto" and deployed["diagnose_batches"] == (1, 8)
    sweep = SweepSignoffConfig(recipes=("a", "b"), output="out").to_json()
    assert sweep["recipe"] == "a,b" and "recipes" not in sweep


@pytest.mark.parametrize("argv, message", [
    (["--candidate-endpoint", CAND], "pass both --candidate-endpoint and --baseline-endpoint"),
    (["--baseline-endpoint", BASE], "pass both --candidate-endpoint and --baseline-endpoint"),
    (["--candidate-endpoint", f"a={CAND}", "--candidate-endpoint", f"b={CAND}"], "need one --baseline-endpoint"),
    (["--candidate-endpoint", CAND, "--baseline-endpoint", BASE, "--endpoint", CAND], "candidate-only shortcut"),
    (["--candidate-endpoint", CAND, "--baseline-endpoint", BASE, "--kv-cache-dtype", "fp8"], "drop --kv-cache-dtype"),
    (["--candidate-endpoint", CAND, "--baseline-endpoint", BASE, "--rejudge"], "drop --rejudge"),
    (["--recipe", "int4-rtn,fp8-dynamic", "--rejudge"], "rerun the same command"),
    (["--recipe", "int4-rtn", "--candidate-endpoint", CAND, "--baseline-endpoint", BASE], "not both or neither"),
    ([], "not both or neither"),
])
def test_flags_of_two_modes_are_refused_where_the_type_is_built(argv, message):
    with pytest.raises(QToolError, match=message):
        config_of(_args(*argv))


@pytest.mark.parametrize("argv, entry", [
    (["--recipe", "int4-rtn"], "qtoolkit.signoff.run.signoff_local"),
    (["--recipe", "int4-rtn,fp8-dynamic"], "qtoolkit.signoff.sweep.signoff_sweep"),
    (["--candidate-endpoint", CAND, "--baseline-endpoint", BASE], "qtoolkit.signoff.deployment.signoff_deployments"),
    (["--candidate-endpoint", f"a={CAND}", "--candidate-endpoint", f"b={CAND}", "--baseline-endpoint", BASE],
     "qtoolkit.signoff.sweep.signoff_endpoint_sweep"),
])
def test_the_command_runs_the_entry_of_its_configs_type_and_prints_on_stdout(argv, entry, monkeypatch, capsys):
    from qtoolkit.cli import main

    got = []
    single = {"verdict": "PASS", "reasons": ["why"]}
    sweep = {"line": "recommended: a", "candidates": [], "exit_code": 0}
    monkeypatch.setattr(entry, lambda cfg: got.append(cfg) or (sweep if "sweep" in entry else single))
    assert main(["signoff", *argv, "--output", "out"]) == 0
    [cfg] = got
    assert cfg == config_of(_args(*argv))
    # the answer on stdout (llm-compressor's import may log a line there first: its sink binds at import)
    assert ("recommended: a" if "sweep" in entry else "verdict: PASS") in capsys.readouterr().out.splitlines()
