"""The sign-off's KV cache: `auto` resolved against a checkpoint's kv_cache_scheme, the ablation's KV cache layer
(bench/kv_layer.py) on a tiny random model served for real, its report row, and bad flags refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from qtoolkit.bench.kv_layer import (
    KVLayerRow,
    bench_kv_layer,
    checkpoint_kv_dtype,
    limiting_budget,
    resolve_kv_dtype,
    unquantized_bytes_per_token,
)
from qtoolkit.bench.summary import TierSummary
from qtoolkit.bench.types import BenchRequest
from qtoolkit.cli import main
from qtoolkit.errors import QToolError
from qtoolkit.signoff.report import kv_layer_lines
from qtoolkit.signoff.verdict import KVLayerSection


def _with_scheme(folder: Path, src: Path, scheme: dict | None) -> Path:
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    if scheme is not None:
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                      "kv_cache_scheme": scheme}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("scheme,expected", [
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}, "fp8"),
    ({"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}, "int8"),
    (None, None)])
def test_auto_takes_the_checkpoints_kv_scheme(tiny_model_dir, tmp_path, scheme, expected):
    ckpt = _with_scheme(tmp_path / "ckpt", tiny_model_dir, scheme)
    assert checkpoint_kv_dtype(ckpt) == expected
    assert resolve_kv_dtype("auto", ckpt) == (expected or "auto")
    assert resolve_kv_dtype("int8", ckpt) == "int8"  # asked for explicitly: taken as asked
    assert checkpoint_kv_dtype(tmp_path / "missing") is None


def test_the_budget_holds_a_quarter_of_the_tier_unquantized(tiny_model_dir):
    # tiny LLaMA: 2 layers, 2 KV heads, head_dim 16, fp32 -> 2 * 2 * 2 * 16 * 4 bytes a token
    assert unquantized_bytes_per_token(tiny_model_dir) == 512
    assert unquantized_bytes_per_token(tiny_model_dir, "bfloat16") == 256
    reqs = [BenchRequest(i, "long", "hello world " * n, 10) for i, n in enumerate((5, 50))]
    budget = limiting_budget(tiny_model_dir, reqs, concurrency=8)
    longest = len(AutoTokenizer.from_pretrained(tiny_model_dir)("hello world " * 50)["input_ids"]) + 10
    per_seq = (-(-longest // 16) + 1) * 16  # whole blocks and a spare one: the longest request fits whole
    assert budget == 2 * per_seq * 512  # two of the eight sequences held
    assert limiting_budget(tiny_model_dir, reqs, concurrency=2) == budget // 2  # never below one sequence


def test_layer_row_ratios_and_report_lines():
    def summary(dtype: str, capacity: int, tps: float, preemptions: float) -> TierSummary:
        return TierSummary.from_json({"completed": 32, "failed": 0, "duration_s": 1.0, "output_tok_per_s": tps,
                                      "requests_per_s": 32.0, "kv_cache_dtype": dtype,
                                      "kv_capacity_tokens": capacity, "kv_bytes_per_token": 512,
                                      "preemptions": preemptions})

    results = {"kv_auto": summary("auto", 1000, 10.0, 7), "kv_fp8": summary("fp8", 3760, 12.5, 0)}
    rounds = {"kv_auto": [10.0, 9.0, 11.0], "kv_fp8": [12.5, 11.0, 13.0]}
    row = KVLayerRow.from_tier(results, rounds, ["kv_auto", "kv_fp8"])
    assert row.capacity_ratio == pytest.approx(3.76) and row.throughput_ratio == pytest.approx(1.25)
    assert row.throughput_ratio_rounds["rounds"] == 3
    assert KVLayerRow.from_json(json.loads(json.dumps(row.to_json()))) == row
    section = KVLayerSection(row, {"concurrency": 32, "workload": "long", "kv_cache_memory": "123"})
    assert KVLayerSection.from_json(json.loads(json.dumps(section.to_json()))) == section
    text = "\n".join(kv_layer_lines(section))
    assert "| auto | 1000 | 7 |" in text and "| fp8 | 3760 | 0 |" in text and "3.76x" in text
    assert "over 3 interleaved rounds" in text.lower() and "95% CI" in text
    assert kv_layer_lines(None) == []


def test_layer_refuses_the_unquantized_cache_alone(tiny_model_dir):
    with pytest.raises(QToolError, match="--kv-cache-dtype fp8 or int8"):
        bench_kv_layer(tiny_model_dir, "auto")


def test_signoff_refuses_an_unknown_kv_cache_dtype(capsys, tmp_path):
    code = main(["signoff", "--model", "default", "--recipe", "fp8-dynamic-kv8", "--kv-cache-dtype", "fp4",
                 "--output", str(tmp_path / "so")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "fp4" in err and "fp8" in err
    assert not (tmp_path / "so").exists()  # refused before any work


def test_deployment_signoff_refuses_a_kv_cache_dtype(capsys, tmp_path):
    code = main(["signoff", "--candidate-endpoint", "http://127.0.0.1:9/v1", "--baseline-endpoint",
                 "http://127.0.0.1:9/v1", "--kv-cache-dtype", "fp8", "--output", str(tmp_path / "so")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "drop --kv-cache-dtype" in err


@pytest.mark.slow
def test_kv_layer_on_a_tiny_model_where_the_unquantized_cache_is_the_limit(tiny_model_dir, tmp_path):
    """Served for real, one server at a time: the fp8 cache holds >= 1.8x the tokens at the same budget (the byte
    ratio at head_dim 16 is 512 / 160), every request completes on both, and rounds give the ratio an interval."""
    ckpt = tmp_path / "long-ctx"
    shutil.copytree(tiny_model_dir, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 4096}))  # 2k-token prompts
    out = bench_kv_layer(ckpt, "fp8", concurrency=4, num_requests=4, rounds=2, mean_output_tokens=8,
                         max_output_tokens=16)
    layer = out["layer"]
    assert layer["capacity_ratio"] == pytest.approx(512 / 160, rel=0.05)
    for r in out["tier"]["results"].values():
        assert (r["completed"], r["errors"]) == (4, []) and r["prompt_tokens"] > 4 * 1500
    assert layer["preemptions"]["kv_auto"] >= layer["preemptions"]["kv_fp8"]
    assert layer["throughput_ratio_rounds"]["rounds"] == 2 and len(out["preemptions"]["kv_fp8"]) == 2
    assert int(out["config"]["kv_cache_memory"]) < 4 * 2200 * 512  # the unquantized cache cannot hold the tier


@pytest.mark.slow
def test_signoff_of_a_kv8_recipe_runs_the_kv_layer_and_reports_it(tiny_model_dir, tmp_path):
    """`qtool signoff --recipe fp8-dynamic-kv8` at the default `--kv-cache-dtype auto`: the checkpoint's FP8 KV
    scheme is the candidate's cache, the bench step writes bench_kv.json, and the report carries its row."""
    model = tmp_path / "long-ctx"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 4096}))  # 2k-token prompts
    policy = tmp_path / "summ.yaml"
    policy.write_text("version: 1\nname: summ\ntasks:\n  summarization:\n    kld_mean: {max: 10.0}\n")
    out = tmp_path / "so"
    code = main(["signoff", "--model", str(model), "--recipe", "fp8-dynamic-kv8", "--policy", str(policy),
                 "--limit", "2", "--max-items", "2", "--concurrency", "2", "--num-requests", "2", "--rounds", "2",
                 "--speculative", "none", "--output", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert code in (0, 1, 3) and all(s["status"] == "ok" for s in report["steps"].values())
    assert report["config"]["kv_cache_dtype"] == "auto"
    layer = report["kv_layer"]
    assert layer["kv_cache_dtype"] == "fp8" and layer["capacity_ratio"] > 1.8
    assert json.loads((out / "bench_kv.json").read_text())["config"]["concurrency"] == 2
    assert "## Ablation: KV cache layer (fp8 vs the unquantized cache)" in (out / "report.md").read_text()
    assert json.loads((out / "eval.json").read_text())["models"]["candidate"]["kv_cache_dtype"] == "fp8"
