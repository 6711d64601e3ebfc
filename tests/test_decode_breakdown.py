"""`qtool bench decode`'s per-token split (qtoolkit/bench/decode_breakdown.py): parts that add up to the step, from the
C++ layer loop's timers or from timers around the Python loop's modules, and the roofline fraction."""

from __future__ import annotations

import json

import pytest

from qtoolkit.bench.decode import PROMPT
from qtoolkit.bench.decode_breakdown import measure_breakdown, roofline_rounds
from qtoolkit.cli import main
from qtoolkit.engine import Engine


@pytest.mark.parametrize("fused", ["1", "0"])
def test_parts_add_up_to_the_step(tiny_model_dir, fused, monkeypatch):
    monkeypatch.setenv("QTOOLKIT_FUSED_DECODE", fused)
    engine = Engine(str(tiny_model_dir), kv_cache_memory="4MiB", block_size=4)
    b = measure_breakdown(engine, PROMPT, 12, bandwidth_gb_s=10.0)
    assert b.steps == 10 and b.layer_loop == ("c++" if fused == "1" else "python")
    assert b.gemv_ms > 0 and b.attention_ms > 0 and b.other_ms > 0 and b.host_ms > 0
    assert b.gemv_ms + b.attention_ms + b.other_ms + b.host_ms == pytest.approx(b.ms_per_token, abs=0.01)
    assert b.roofline_tok_s == pytest.approx(10e9 / b.weight_bytes_per_token, rel=1e-3)
    assert b.roofline_fraction == pytest.approx(1e3 / b.ms_per_token / b.roofline_tok_s, rel=0.01)
    # the timers are gone afterwards: the next step runs the plain modules
    assert "forward" not in engine.model.__dict__ and "forward" not in engine.model.lm_head.__dict__


def test_roofline_rounds_pair_each_rate_with_its_rounds_bandwidth():
    # 100 MB a token: 200 tok/s at 40 GB/s is half the roofline, 150 tok/s at 20 GB/s three quarters
    r = roofline_rounds([200.0, 150.0, 100.0], [40.0, 20.0, 50.0], 100_000_000, working_set_bandwidth_gb_s=30.0)
    assert r.fractions == [0.5, 0.75, 0.2] and r.median_fraction == 0.5
    assert r.working_set_fraction == pytest.approx(150 * 1e8 / 30e9, abs=1e-3)
    with pytest.raises(ValueError):  # a rate without its round's bandwidth is a bug, not a shorter list
        roofline_rounds([200.0], [40.0, 20.0], 100_000_000, 30.0)


def test_cli_writes_the_breakdown(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model", str(tiny_model_dir), "--tokens", "6", "--rounds", "2",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    system = report["systems"][f"engine:{tiny_model_dir.name}"]
    b = system["breakdown"]
    assert b["layer_loop"] == "c++" and b["gemv_ms"] > 0 and 0 < b["roofline_fraction"]
    assert report["memory_bandwidth_gb_s"] > 0 and len(report["memory_bandwidth_gb_s_per_round"]) == 2
    r = system["roofline"]
    assert r["bandwidth_gb_s"] == report["memory_bandwidth_gb_s_per_round"] and len(r["fractions"]) == 2
    assert r["weight_bytes_per_token"] == b["weight_bytes_per_token"] and r["working_set_bandwidth_gb_s"] > 0
    assert all(f == pytest.approx(rate * r["weight_bytes_per_token"] / (bw * 1e9), abs=1e-3)
               for f, rate, bw in zip(r["fractions"], system["samples"], r["bandwidth_gb_s"], strict=True))
    printed = capsys.readouterr().out
    assert "roofline" in printed and "DRAM roofline reached per round" in printed


def test_no_breakdown_skips_every_bandwidth_probe(tiny_model_dir, tmp_path, monkeypatch):
    def no_probe(*args, **kwargs):
        raise AssertionError("--no-breakdown measured the bandwidth")

    monkeypatch.setattr("qtoolkit.kernels.roofline.measure_bandwidth", no_probe)
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model", str(tiny_model_dir), "--tokens", "6", "--rounds", "1",
                 "--no-breakdown", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "memory_bandwidth_gb_s_per_round" not in report
    assert "roofline" not in report["systems"][f"engine:{tiny_model_dir.name}"]
