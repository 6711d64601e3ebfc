"""python -m qtoolkit.peers.engine_vs_vllm: bad input is one line and exit 2 before any server starts; with the
vLLM tier, qtool serve and vLLM serve the default model side by side and each tier's quotients carry intervals
over the interleaved rounds."""

from __future__ import annotations

import json
import math

import pytest

from qtoolkit.peers.engine_vs_vllm import FIGURES, main


@pytest.mark.parametrize(("args", "named"), [
    (["--concurrency", "x"], "comma-separated integers"),
    (["--concurrency", "0"], ">= 1"),
    (["--rounds", "1"], "an interval needs two"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, named):
    out = tmp_path / "c.json"
    assert main(["--output", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.vllm
def test_qtool_serve_and_vllm_on_the_default_model_through_one_client(tmp_path):
    out = tmp_path / "c.json"
    assert main(["--output", str(out), "--concurrency", "1", "--num-prompts", "2", "--rounds", "2"]) == 0
    (tier,) = json.loads(out.read_text())["tiers"]
    for f in FIGURES:
        assert len(tier["rounds"]["qtool"][f]) == len(tier["rounds"]["vllm"][f]) == 2
        r = tier["ratios"][f]
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["rounds"] == 2 and len(r["ci95"]) == 2
