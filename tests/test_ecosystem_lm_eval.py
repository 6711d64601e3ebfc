"""lm-eval through `qtool eval`: --num_fewshot and --log_samples passed on, --baseline paired per document."""

from __future__ import annotations

import json

import pytest
from qtoolkit.evals.lm_eval.paired import paired_results

from qtoolkit.cli import main


def test_paired_results_pair_by_document():
    cand = {"t": [{"doc_id": i, "acc": float(i % 2), "word_perplexity": (-3.0, 2)} for i in range(4)]}
    base = {"t": [{"doc_id": i, "acc": 0.0, "word_perplexity": (-2.0, 2)} for i in reversed(range(4))]}
    out = paired_results(cand, base, seed=0)["t"]
    assert out["documents"] == 4 and out["acc"]["delta"] == pytest.approx(0.5) and out["acc"]["items"] == 4
    assert out["not_paired"] == ["word_perplexity (not one number per document)"]


def test_lm_eval_options_without_the_harness_are_refused(capsys):
    assert main(["eval", "--model", "default", "--baseline", "default", "--num_fewshot", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--harness lm-eval" in err and "\n" not in err


@pytest.mark.slow  # two lm-eval runs (candidate and baseline): minutes on 2 busy cores
def test_lm_eval_with_baseline_fewshot_and_samples(tiny_model_dir, tmp_path):
    out = tmp_path / "lm.json"
    task = "qtoolkit_aclsum_aspect"
    assert main(["eval", "--harness", "lm-eval", "--model", str(tiny_model_dir), "--baseline", str(tiny_model_dir),
                 "--tasks", task, "--limit", "3", "--num_fewshot", "1", "--log_samples", "-o", str(out), "-q"]) == 0
    data = json.loads(out.read_text())
    assert data["configs"][task]["num_fewshot"] == 1
    assert len(data["samples"][task]) == 3 and len(data["baseline"]["samples"][task]) == 3
    paired = data["paired"][task]
    assert paired["documents"] == 3 and paired["acc"]["items"] == 3
    # the same model on both sides: every per-document difference is exactly zero; the interval still states
    # what 3 documents cannot rule out (a paired binary interval does not collapse to a point)
    lo, hi = paired["acc"]["ci95"]
    assert paired["acc"]["delta"] == 0 and lo <= 0 <= hi and "ci_method" in paired["acc"]
    assert data["baseline"]["results"][task]["acc,none"] == data["results"][task]["acc,none"]
