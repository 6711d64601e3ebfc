"""`qtool bench decode`'s per-token split (qtoolkit/bench/decode_breakdown.py): parts that add up to the step, from the
C++ layer loop's timers or from timers around the Python loop's modules, and the roofline fraction."""

from __future__ import annotations

import json

import pytest

from qtoolkit.bench.decode import PROMPT
from qtoolkit.bench.decode_breakdown import measure_breakdown
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


def test_cli_writes_the_breakdown(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model", str(tiny_model_dir), "--tokens", "6", "--rounds", "1",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    b = report["systems"][f"engine:{tiny_model_dir.name}"]["breakdown"]
    assert b["layer_loop"] == "c++" and b["gemv_ms"] > 0 and 0 < b["roofline_fraction"]
    assert report["memory_bandwidth_gb_s"] > 0
    assert "roofline" in capsys.readouterr().out
