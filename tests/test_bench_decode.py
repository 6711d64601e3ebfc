"""`qtool bench decode`: batch-1 decode of engine checkpoints against HF (and llama.cpp where it is installed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from qtoolkit.bench.decode import PROMPT, decode_rate, run_decode_bench, run_prefill_bench, side_by_side
from qtoolkit.cli import main
from qtoolkit.peers.child import PeerError
from qtoolkit.peers.llama_cpp import LlamaCppPeer

# Stand-ins for llama-cpp-python, first on the child's PYTHONPATH: a build that dies on load as a native build does
# on a CPU that lacks its instructions, and one that never answers.
BROKEN_PEERS = {
    "sigill": "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n",
    "hang": "import time\ntime.sleep(3600)\n",
}


def broken_llama_cpp(tmp_path: Path, kind: str) -> dict[str, str]:
    pkg = tmp_path / kind / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(BROKEN_PEERS[kind])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg.parent), os.environ.get("PYTHONPATH", "")])}


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


def test_the_bandwidth_probe_runs_at_the_start_of_each_round():
    calls = []

    def run(n):
        calls.append("decode")
        return [i * 0.01 for i in range(n)]

    def probe():
        calls.append("probe")
        return 20.0 + calls.count("probe")

    report = run_decode_bench({"a": (run, {})}, tokens=4, rounds=3, baseline=None, probe=probe)
    assert calls == ["decode"] + ["probe", "decode"] * 3  # not before the warm-up
    assert report["memory_bandwidth_gb_s_per_round"] == [21.0, 22.0, 23.0]
    assert "memory_bandwidth_gb_s_per_round" not in run_decode_bench({"a": (run, {})}, tokens=4, rounds=1,
                                                                     baseline=None)


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


def test_cli_decodes_each_checkpoint_with_each_kv_cache(tiny_model_dir, tmp_path):
    out = tmp_path / "kv.json"
    assert main(["bench", "decode", "--model", str(tiny_model_dir), "--kv-cache-dtype", "auto,fp8", "--tokens", "6",
                 "--rounds", "1", "--output", str(out)]) == 0
    systems = json.loads(out.read_text())["systems"]
    name = f"engine:{tiny_model_dir.name}"
    assert set(systems) == {name, f"{name}:kv-fp8"}
    assert [systems[n]["kv_cache_dtype"] for n in (name, f"{name}:kv-fp8")] == ["auto", "fp8"]
    # the quantized cache decodes in the C++ layer loop too (qtoolkit/model/decode_plan.py)
    assert {s["breakdown"]["layer_loop"] for s in systems.values()} == {"c++"}


def test_cli_decodes_after_a_long_prompt_and_counts_its_cache_read(tiny_model_dir, tmp_path):
    """--context-tokens: every system gets the same N-token prompt, and the breakdown counts the KV cache a token
    reads over it (weights alone leave most of a long-context token unexplained)."""
    reports = {}
    for n in (0, 300):
        out = tmp_path / f"ctx{n}.json"
        assert main(["bench", "decode", "--model", str(tiny_model_dir), "--context-tokens", str(n), "--tokens", "6",
                     "--rounds", "1", "--output", str(out)]) == 0
        reports[n] = json.loads(out.read_text())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok(reports[300]["prompt"], add_special_tokens=False).input_ids) in range(295, 306)
    assert reports[0]["prompt"] == PROMPT and reports[300]["inputs"]["context_tokens"] == 300
    (short,), (long,) = (list(r["systems"].values()) for r in reports.values())
    assert long["breakdown"]["kv_bytes_per_token"] > 8 * short["breakdown"]["kv_bytes_per_token"] > 0
    # the cache read adds its bytes to the weights' (both fractions are rounded to 3 decimals: on a slow round they
    # can print equal, so the test reads the proportion, not a strict order)
    b = long["breakdown"]
    grown = b["roofline_fraction"] * (b["weight_bytes_per_token"] + b["kv_bytes_per_token"]) / b["weight_bytes_per_token"]
    assert b["roofline_fraction_with_kv"] == pytest.approx(grown, rel=0.02, abs=0.0015)
    assert b["roofline_fraction_with_kv"] >= b["roofline_fraction"]


@pytest.mark.parametrize(("value", "message"), [("-1", "--context-tokens must be >= 0"),
                                                ("10000000", "more than the")])
def test_cli_refuses_a_context_it_cannot_build(tiny_model_dir, tmp_path, capsys, value, message):
    out = tmp_path / "x.json"
    assert main(["bench", "decode", "--model", str(tiny_model_dir), "--context-tokens", value,
                 "--output", str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("value", ["fp16", "", "auto,fp4"])
def test_cli_rejects_an_unknown_kv_cache(tmp_path, capsys, value):
    assert main(["bench", "decode", "--kv-cache-dtype", value, "--output", str(tmp_path / "x.json")]) == 2
    assert "--kv-cache-dtype takes auto, fp8, int8" in capsys.readouterr().err
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


def test_crashing_llama_cpp_peer_is_one_error_line_not_a_dead_qtool(tiny_model_dir, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    env = {**broken_llama_cpp(tmp_path, "sigill"), "QTOOLKIT_NO_CPU_EXT": "1"}
    out = tmp_path / "decode.json"
    done = subprocess.run([sys.executable, "-m", "qtoolkit", "-q", "bench", "decode", "--model", str(tiny_model_dir),
                           "--compare", "llama.cpp", "--gguf", str(gguf), "--tokens", "4", "--rounds", "1",
                           "--output", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "llama.cpp peer died with SIGILL" in lines[0] and "-DGGML_NATIVE=OFF" in lines[0]
    assert not out.exists()


def test_hanging_llama_cpp_peer_is_stopped_at_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", broken_llama_cpp(tmp_path, "hang")["PYTHONPATH"])
    monkeypatch.setattr("qtoolkit.peers.llama_cpp.LOAD_TIMEOUT_S", 3.0)
    start = time.monotonic()
    with pytest.raises(PeerError, match="did not answer within 3 s while loading"):
        LlamaCppPeer(tmp_path / "model.gguf", 1, PROMPT)
    assert time.monotonic() - start < 30


def test_peer_that_exits_reports_its_last_line(tmp_path, monkeypatch):
    pkg = tmp_path / "llama_cpp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import sys\nsys.stderr.write('cannot open shared object libllama.so\\n')\n"
                                     "sys.stderr.flush()\nimport os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(PeerError, match="exited with status 3 while loading .*libllama.so"):
        LlamaCppPeer(tmp_path / "model.gguf", 1, PROMPT)


def test_prefill_rounds_interleave_and_never_reuse_a_prompt():
    calls = []

    def fake(name, seconds_per_token):
        def run(text):
            calls.append((name, text))
            return len(text) * seconds_per_token
        return run

    prompts = {4: ["wwww", "aaaa", "bbbb"], 2: ["ww", "cc", "dd"]}
    report = run_prefill_bench({"base": fake("base", 0.02), "q": fake("q", 0.01)}, prompts, baseline="base")
    timed = calls[4:]  # after each system's warm-up at both lengths
    assert [t for _, t in calls[:4]] == ["ww", "wwww", "ww", "wwww"]
    assert timed == [("base", "cc"), ("q", "cc"), ("base", "aaaa"), ("q", "aaaa"), ("base", "dd"), ("q", "dd"),
                     ("base", "bbbb"), ("q", "bbbb")]
    assert report["prompt_tokens"] == [2, 4] and report["rounds"] == 2
    assert report["systems"]["q"]["4"]["prefill_tok_per_s"] == pytest.approx(100.0)
    assert report["ratios"] == {"q_over_base": {"2": pytest.approx(2.0), "4": pytest.approx(2.0)}}
    assert report["round_ratios"]["q_over_base"]["4"] == [pytest.approx(2.0)] * 2


def test_cli_times_prefill_at_each_length(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert main(["bench", "decode", "--model", str(tiny_model_dir), "--kv-cache-dtype", "auto,fp8", "--tokens", "4",
                 "--rounds", "2", "--no-breakdown", "--prefill-tokens", "64,16", "--output", str(out)]) == 0
    prefill = json.loads(out.read_text())["prefill"]
    name = f"engine:{tiny_model_dir.name}"
    assert prefill["prompt_tokens"] == [16, 64] and prefill["baseline"] == name
    for per in prefill["systems"].values():
        assert all(len(per[n]["samples"]) == 2 and per[n]["prefill_tok_per_s"] > 0 for n in ("16", "64"))
    assert set(prefill["ratios"]) == {f"{name}:kv-fp8_over_{name}"}
    rows = json.loads(out.read_text())["side_by_side"]
    assert [r["system"] for r in rows] == [name, f"{name}:kv-fp8"]
    assert rows[0]["decode_over_first"] == 1.0 and rows[0]["prefill_over_first"] == {"16": 1.0, "64": 1.0}
    assert rows[1]["roofline_fraction"] is None and set(rows[1]["prefill_tok_per_s"]) == {"16", "64"}
    printed = capsys.readouterr().out
    assert "prefill tok/s" in printed and "prefill@16" in printed


@pytest.mark.parametrize(("value", "message"), [("256,x", "--prefill-tokens takes positive token counts"),
                                                ("0", "--prefill-tokens takes positive"),
                                                ("10000000", "--prefill-tokens 10000000 is more than")])
def test_cli_refuses_prefill_lengths_it_cannot_run(tiny_model_dir, tmp_path, capsys, value, message):
    out = tmp_path / "x.json"
    assert main(["bench", "decode", "--model", str(tiny_model_dir), "--prefill-tokens", value,
                 "--output", str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_side_by_side_divides_round_by_round_by_the_first_engine():
    """Each engine checkpoint over the first --model: medians of per-round ratios for decode and for prefill at each
    length, the roofline fraction where the breakdown ran; peers (llama.cpp, hf) are left out."""
    decode = {"llama.cpp": [50.0, 50.0, 50.0], "engine:fp32": [10.0, 20.0, 10.0], "engine:fp8": [25.0, 40.0, 30.0]}
    roofline = {"engine:fp32": 0.9, "engine:fp8": 0.5}
    prefill = {"engine:fp32": {"256": [100.0, 50.0, 100.0]}, "engine:fp8": {"256": [95.0, 60.0, 90.0]}}
    first, fp8 = side_by_side(decode, roofline, prefill)
    assert first.system == "engine:fp32" and first.decode_over_first == 1.0 and first.roofline_fraction == 0.9
    assert fp8.decode_round_ratios == [2.5, 2.0, 3.0] and fp8.decode_over_first == 2.5
    assert fp8.decode_tok_per_s == 30.0 and fp8.prefill_tok_per_s == {"256": 90.0}
    assert fp8.prefill_over_first == {"256": 0.95}
    assert side_by_side({"hf": [1.0]}, {}, {}) == []


@pytest.mark.parametrize(("flags", "message"), [(["--threads", "0"], "--threads must be >= 1"),
                                               (["--rounds", "0"], "--rounds >= 1"),
                                               (["--tokens", "1"], "--tokens must be >= 2")])
def test_cli_refuses_hostile_counts_before_loading_anything(tmp_path, capsys, flags, message):
    out = tmp_path / "x.json"
    assert main(["bench", "decode", *flags, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
