"""`qtool diagnose` on the tiny model: prefill and decode measured apart, a roofline, a named bottleneck."""

from __future__ import annotations

import json

from qtoolkit.cli import main
from qtoolkit.diagnose import classify


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


def _fake(bw_bound: float, compute_bound: float, kv_fit: int) -> dict:
    return {"decode": [{"batch": 1, "tokens_per_s": 10.0}, {"batch": 8, "tokens_per_s": 60.0}],
            "roofline": {"batch1": {"decode_memory_bound_tok_s": bw_bound, "compute_bound_tok_s": compute_bound}},
            "kv": {"max_concurrent_at_context": kv_fit, "context": 1024},
            "model": {"decode_bytes_per_step": 500e6}}


def test_classification_follows_the_roofline():
    assert classify(_fake(50, 100, 64))[0] == "decode-memory"
    assert classify(_fake(500, 100, 64))[0] == "prefill-compute"
    name, levers = classify(_fake(50, 100, 4))
    assert name == "KV-memory" and "kv-cache-memory" in levers[0]
    assert "6.0x" in classify(_fake(50, 100, 64))[1][0]  # batching lever quotes the measured scaling
