"""`qtool diagnose` on the tiny model: prefill and decode measured apart, a roofline, a named bottleneck."""

from __future__ import annotations

import json

from qtoolkit.cli import main
from qtoolkit.diagnose.result import DecodeRow, DiagnoseResult, KVCapacity, ModelBytes, Roofline
from qtoolkit.diagnose.run import classify


def test_diagnose_cli_writes_measurements(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "diag.json"
    code = main(["diagnose", "--model", str(tiny_model_dir), "--batches", "1,2", "--prompt-lengths", "16,32",
                 "--kv-cache-memory", "32MiB", "--output", str(out)])
    assert code == 0
    d = json.loads(out.read_text())
    assert d["machine_ceilings"]["memory_bandwidth_gb_s"] > 0 and d["machine_ceilings"]["fp32_gemm_gflop_s"] > 0
    # tied head: the lm_head streams the embedding table every step
    assert d["model"]["lm_head_bytes"] == 49152 * 64 * 4 and d["model"]["linear_bytes"] > 0
    assert [p["prompt_tokens"] for p in d["prefill"]] == [16, 32] and [r["batch"] for r in d["decode"]] == [1, 2]
    assert all(r["tokens_per_s"] > 0 and r["fraction_of_roofline"] > 0 for r in d["decode"])
    assert d["bottleneck"] in ("decode-memory", "prefill-compute", "KV-memory") and len(d["levers"]) >= 3
    assert "bottleneck:" in capsys.readouterr().out
    r = DiagnoseResult.from_json(d)  # the file reads back into the same typed result, key for key
    assert r.to_json() == d and list(r.to_json()) == list(d) and r.roofline[2].decode_attainable_tok_s > 0


def _fake(bw_bound: float, compute_bound: float, kv_fit: int) -> tuple:
    return ([DecodeRow(1, 1.0, 10.0, 100.0), DecodeRow(8, 1.0, 60.0, 133.0)],
            {1: Roofline(bw_bound, compute_bound, min(bw_bound, compute_bound))},
            KVCapacity(1000, 100, 16, 1024, kv_fit), ModelBytes(400_000_000, 100_000_000, 500_000_000, 10**8))


def test_classification_follows_the_roofline():
    assert classify(*_fake(50, 100, 64))[0] == "decode-memory"
    assert classify(*_fake(500, 100, 64))[0] == "prefill-compute"
    name, levers = classify(*_fake(50, 100, 4))
    assert name == "KV-memory" and "kv-cache-memory" in levers[0]
    assert "6.0x" in classify(*_fake(50, 100, 64))[1][0]  # batching lever quotes the measured scaling
