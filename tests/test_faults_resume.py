"""kill -9 in the middle of `qtool signoff`, then the same command again: it resumes from what finished, never
reads a half-written part as finished, and reaches the same verdict, the same failing gates and the same quality
figures as an uninterrupted run (slow set: a sign-off of the tiny model takes minutes on 2 cores).

Kills land at seeded random moments inside chosen steps (quantize, eval, bench, diagnose). After each kill every
JSON in the folder must parse, and every output of a step recorded as finished must be unchanged by the kill and
the resumed run (bytes lost: 0). Set QTOOLKIT_FAULT_FIGURES=FILE.json to keep the run's figures."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qtoolkit.io import write_json
from qtoolkit.quantize.report import QuantizeSummary

pytestmark = pytest.mark.slow

POLICY = """\
version: 1
name: faults
description: a policy whose gates fail for certain (tiny random model), so the failing gates can be compared
tasks:
  summarization:
    kld_mean: {max: 0.0}
throughput:
  min_speedup: 1.0
memory:
  max_linear_ratio_vs_bf16: 0.10
"""
ARGS = ["--recipe", "int4-rtn", "--limit", "2", "--max-items", "2", "--concurrency", "1", "--num-requests", "2",
        "--rounds", "1", "--speculative", "none", "--allow-weak-sandbox"]
STEP_OUTPUTS = {"quantize": "checkpoint/quantize_report.json", "eval": "eval.json", "bench": "bench.json",
                "diagnose": "diagnose.json"}


def signoff_cmd(model: Path, policy: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "qtoolkit", "signoff", "--model", str(model), "--policy", str(policy), *ARGS,
            "--output", str(out)]


def steps(out: Path) -> dict:
    try:
        return json.loads((out / "steps.json").read_text())
    except (OSError, ValueError):
        return {}


def finished_outputs(out: Path) -> dict[str, str]:
    """sha256 of each output whose step steps.json records as finished."""
    done = {}
    for name, state in steps(out).items():
        path = out / STEP_OUTPUTS[name]
        if state.get("status") == "ok" and path.is_file():
            done[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return done


def every_json_parses(out: Path) -> list[str]:
    bad = []
    for p in out.rglob("*.json"):
        try:
            json.loads(p.read_text())
        except ValueError:
            bad.append(str(p.relative_to(out)))
    return bad


def run_killed_in(cmd: list[str], out: Path, step: str, delay_s: float, timeout_s: float = 1800) -> bool:
    """Start `cmd`, SIGKILL it `delay_s` after steps.json shows `step` running; False if it ended first."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while steps(out).get(step, {}).get("status") != "running":
            if proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, f"step {step} never ran"
            time.sleep(0.1)
        time.sleep(delay_s)
        if proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def verdict(out: Path) -> tuple[str, list[str], dict]:
    report = json.loads((out / "report.json").read_text())
    failing = sorted(g["name"] for g in report["gates"] if g["verdict"] == "FAIL")
    quality = {"eval": report["eval"], "quantize": QuantizeSummary.from_json(report["quantize"]).totals,
               "gates": {g["name"]: (g["verdict"], g.get("judged")) for g in report["gates"]
                         if not g["name"].startswith("throughput")}}
    return report["verdict"], failing, quality


def test_signoff_killed_three_times_resumes_to_the_same_verdict(tiny_model_dir, tmp_path):
    policy = tmp_path / "faults.yaml"
    policy.write_text(POLICY)
    ref = tmp_path / "uninterrupted"
    t = time.monotonic()
    ref_code = subprocess.run(signoff_cmd(tiny_model_dir, policy, ref), capture_output=True, timeout=3600).returncode
    uninterrupted_s = time.monotonic() - t
    ref_verdict = verdict(ref)
    assert ref_verdict[0] == "FAIL" and ref_code == 1 and ref_verdict[1], ref_verdict

    rng, out = random.Random(31), tmp_path / "killed"
    cmd = signoff_cmd(tiny_model_dir, policy, out)
    kills, lost, resumed = [], 0, 0
    for step in ("quantize", "eval", "bench", "diagnose"):
        before = finished_outputs(out)
        delay = round(rng.uniform(0.0, 3.0), 2)
        killed = run_killed_in(cmd, out, step, delay)
        kills.append({"step": step, "delay_s": delay, "killed": killed})
        assert every_json_parses(out) == []
        after = finished_outputs(out)
        lost += sum(1 for name, digest in before.items() if after.get(name) != digest)
        resumed += bool(before)
    assert sum(k["killed"] for k in kills) >= 3, kills
    before = finished_outputs(out)
    t = time.monotonic()
    code = subprocess.run(cmd, capture_output=True, timeout=3600).returncode
    final_s = time.monotonic() - t
    after = finished_outputs(out)
    lost += sum(1 for name, digest in before.items() if after.get(name) != digest)
    got = verdict(out)
    assert code == ref_code and got[0] == ref_verdict[0] and got[1] == ref_verdict[1]
    assert got[2] == ref_verdict[2]  # same quality figures: greedy decoding, fixed seeds
    assert lost == 0
    skipped = [n for n, s in json.loads((out / "report.json").read_text())["steps"].items() if s.get("skipped")]
    if path := os.environ.get("QTOOLKIT_FAULT_FIGURES"):
        write_json(path, {"command": " ".join(cmd[1:]), "seed": 31, "kills": kills,
                          "faults_injected": sum(k["killed"] for k in kills), "runs_resumed": resumed + 1,
                          "verdict_uninterrupted": ref_verdict[0], "verdict_resumed": got[0],
                          "failing_gates": got[1], "verdicts_equal": got[0] == ref_verdict[0],
                          "failing_gates_equal": got[1] == ref_verdict[1], "quality_figures_equal": True,
                          "finished_outputs_changed_by_a_kill": lost, "steps_reused_by_the_last_run": skipped,
                          "uninterrupted_s": round(uninterrupted_s, 1), "last_resumed_run_s": round(final_s, 1)})
