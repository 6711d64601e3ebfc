"""`qtool bench decode`: batch-1 decode of engine checkpoints against HF (and llama.cpp where it is installed)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from qtoolkit.cli import main
from qtoolkit.decode_bench import decode_rate, run_decode_bench


def test_decode_rate_leaves_out_the_first_token():
    assert decode_rate([10.0, 10.5, 11.0, 11.5]) == pytest.approx(3 / 1.5)


def test_rounds_interleave_systems_and_ratios_use_the_baseline():
    calls = []

    def fake(name, step):
        def run(n):
            calls.append(name)
            return [i * step for i in range(n)]
        return run, {"kind": name}

    report = run_decode_bench({"a": fake("a", 0.01), "b": fake("b", 0.02)}, tokens=5, rounds=2, baseline="b")
    assert calls == ["a", "b", "a", "b", "a", "b"]  # warm-up, then rounds alternate
    assert report["systems"]["a"]["decode_tok_per_s"] == pytest.approx(100.0)
    assert report["ratios"] == {"a_over_b": pytest.approx(2.0)}


def test_cli_engine_vs_hf_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", "--model", str(tiny_model_dir), "--compare", "hf", "--tokens", "6", "--rounds", "2",
               "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {f"engine:{tiny_model_dir.name}", "hf"}
    for r in report["systems"].values():
        assert len(r["samples"]) == 2 and r["decode_tok_per_s"] > 0
    assert "decode tok/s" in capsys.readouterr().out


def test_cli_rejects_unknown_peer(tmp_path, capsys):
    assert main(["bench", "decode", "--compare", "vllm", "--output", str(tmp_path / "x.json")]) == 2
    assert "--compare takes llama.cpp and/or hf" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_cli_int4_engine_against_llama_cpp(tmp_path):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model", "default", "--compare", "llama.cpp", "--tokens", "16", "--rounds", "1",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["systems"]["llama.cpp"]["decode_tok_per_s"] > 0
    assert set(report["ratios"]) == {"engine:SmolLM2-135M-Instruct_over_llama.cpp"}
