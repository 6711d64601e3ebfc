"""lm-eval runs our shipped tasks against the registered `qtoolkit` model, offline (no network at all)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from qtoolkit.evals.lm_eval.run import TASKS_DIR, run_lm_eval, shipped_tasks
from qtoolkit.evals.sandbox.run import isolation


def test_shipped_tasks_are_found_by_lm_eval():
    from lm_eval.tasks import TaskManager

    names = shipped_tasks()
    assert {"qtoolkit_humaneval", "qtoolkit_aclsum", "qtoolkit_aclsum_aspect"} <= set(names)
    manager = TaskManager(include_path=str(TASKS_DIR))
    assert set(names) <= set(manager.all_tasks)


def test_simple_evaluate_through_the_python_api(tiny_model_dir, tmp_path):
    out = tmp_path / "lm.json"
    res = run_lm_eval(str(tiny_model_dir), "qtoolkit_aclsum_aspect,qtoolkit_humaneval_ppl", out, limit=2)
    r = res["results"]
    assert 0.0 <= r["qtoolkit_aclsum_aspect"]["acc,none"] <= 1.0  # loglikelihood requests
    assert r["qtoolkit_humaneval_ppl"]["bits_per_byte,none"] > 0  # loglikelihood_rolling requests
    assert json.loads(out.read_text())["harness"] == "lm-eval"


def test_loglikelihood_matches_rolling_for_a_whole_text(tiny_model_dir):
    """Scoring a text as one continuation or as a rolling text gives the same log-likelihood."""
    from lm_eval.api.instance import Instance
    from qtoolkit.evals.lm_eval.model import QToolkitLM

    lm = QToolkitLM(pretrained=str(tiny_model_dir), backend="engine")
    text = "def add(a, b):\n    return a + b\n"
    eos = lm.tokenizer.eos_token
    (ll, _), = lm.loglikelihood([Instance("loglikelihood", {}, (eos, text), 0)])
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert ll == pytest.approx(rolling, rel=1e-4)
    lm.max_length = 8  # forces several windows: every token still scored exactly once
    (windowed,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert windowed < 0 and len(lm.tokenizer(text, add_special_tokens=False).input_ids) > 8


@pytest.mark.slow  # a fresh interpreter importing lm-eval and torch: ~1 min on 2 busy cores
def test_wrapper_cli_runs_offline(tiny_model_dir, tmp_path):
    """`qtool-lm-eval` (evals/lm_eval/cli.py:main) with generate_until, in a network namespace where allowed."""
    cmd = [sys.executable, "-m", "qtoolkit.evals.lm_eval.cli", "run", "--model", "qtoolkit",
           "--model_args", f"pretrained={tiny_model_dir},backend=engine", "--tasks", "qtoolkit_aclsum",
           "--limit", "1", "--gen_kwargs", "max_gen_toks=8", "--output_path", str(tmp_path / "out")]
    if isolation()["network_namespace"] and shutil.which("unshare") and os.geteuid() == 0:
        cmd = ["unshare", "--net", "--", *cmd]  # no network interface at all
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list((tmp_path / "out").rglob("results*.json"))
    assert files, proc.stderr[-2000:]
    results = json.loads(files[0].read_text())["results"]["qtoolkit_aclsum"]
    assert 0.0 <= results["rouge1,none"] <= 1.0
