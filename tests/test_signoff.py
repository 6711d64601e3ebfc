"""`qtool signoff` end to end on a tiny local model (slow set): verdict, resumable steps, failing steps, and the
HTML report rendered by headless Chromium with its plots on screen."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from qtoolkit.cli import main
from qtoolkit.model.sources import resolve_model
from qtoolkit.quantize.recipe import load_recipe
from qtoolkit.quantize.report import QuantizeReport, QuantizeSummary
from qtoolkit.signoff.config import LocalSignoffConfig
from qtoolkit.signoff.policy import load_policy
from qtoolkit.signoff.run import SignoffRun
from qtoolkit.signoff.sweep import Candidate, _local_judge
from qtoolkit.signoff.verdicts import EXIT_CODES, overall

pytestmark = pytest.mark.slow
ARGS = ["--limit", "2", "--max-items", "2", "--concurrency", "1,2", "--num-requests", "2"]


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("signoff") / "int4"
    code = main(["signoff", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", *ARGS, "--output", str(out)])
    assert code in (0, 1, 3)
    return out


def test_report_files_and_verdict(run_dir):
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE")
    assert all(s["status"] == "ok" for s in report["steps"].values())
    names = {g["name"] for g in report["gates"]}
    speed = {f"throughput.{m}@c{c}" for m in ("decode_tpot_ratio", "prefill_ttft_ratio") for c in (1, 2)}
    assert {"code.kld_mean", "summarization.kld_mean"} | speed <= names
    assert report["verdict"] == overall([(g["verdict"], g["required"]) for g in report["gates"]])
    assert report["ablation"]["tiers"][0]["steps"][0]["label"].startswith("baseline")
    # every system served 3 rounds (the default) at every tier: each layer alone has an interval
    for row in report["ablation"]["tiers"]:
        assert row["alone_rounds"]["quantization"]["rounds"] == 3
    # the speed gates' pair (same serving configuration) got more rounds only while a gate was undecided
    bench = json.loads((run_dir / "bench.json").read_text())
    looks = bench["speed_rounds"]
    assert looks["pair"] == ["baseline_continuous", "candidate_continuous"]  # --speculative none: the default
    assert looks["looks"] == [3, 5, 7, 9] and looks["rounds"] in looks["looks"]
    gate = next(g for g in report["gates"] if g["name"] == "throughput.decode_tpot_ratio@c2")
    assert f"over {looks['rounds']} paired rounds" in gate["detail"] or gate["verdict"] == "NO EVIDENCE"
    assert set(report["plots"]) == {"throughput", "quality", "kld", "memory", "roofline"}
    md = (run_dir / "report.md").read_text()
    assert md.startswith(f"# Release sign-off: {report['verdict']}")


def test_rerun_reuses_finished_steps(run_dir, tiny_model_dir, capsys):
    before = json.loads((run_dir / "report.json").read_text())
    main(["signoff", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", *ARGS, "--output", str(run_dir)])
    after = json.loads((run_dir / "report.json").read_text())
    assert all(s.get("skipped") for s in after["steps"].values())
    assert after["verdict"] == before["verdict"] and after["gates"] == before["gates"]


def test_fresh_rerun_reproduces_verdict_and_quality_figures(run_dir, tiny_model_dir, tmp_path):
    """A second sign-off from scratch (nothing reused) quantizes to the same checkpoint and measures the same
    quality figures (greedy decoding, fixed seeds); only the timed figures may move."""
    out = tmp_path / "again"
    code = main(["signoff", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", *ARGS, "--output", str(out)])
    first = json.loads((run_dir / "report.json").read_text())
    again = json.loads((out / "report.json").read_text())
    assert not any(s.get("skipped") for s in again["steps"].values())
    assert code == EXIT_CODES[again["verdict"]]
    assert QuantizeSummary.from_json(again["quantize"]).totals == QuantizeSummary.from_json(first["quantize"]).totals
    for task in ("code", "summarization"):
        assert again["eval"][task]["summary"] == first["eval"][task]["summary"]
    untimed = {g["name"]: g for g in first["gates"] if not g["name"].startswith("throughput.")}
    assert untimed == {g["name"]: g for g in again["gates"] if not g["name"].startswith("throughput.")}
    if any(g["verdict"] == "FAIL" for g in untimed.values()):  # decided by quality alone: the verdict cannot move
        assert again["verdict"] == first["verdict"] == "FAIL"


def test_failing_policy_gate_gives_fail_and_names_it(run_dir, tiny_model_dir, tmp_path, capsys):
    strict = tmp_path / "strict.yaml"
    # kld_p99 is judged on its point (no interval), so a bound of 0 fails on any quantization error at all;
    # a mean's interval over two items still straddles 0 and would be INCONCLUSIVE, not FAIL
    strict.write_text("version: 1\nname: strict\ntasks:\n  code:\n    kld_p99: {max: 0.0}\n")
    out = tmp_path / "copy"
    shutil.copytree(run_dir, out)  # same inputs: every step is reused, only the gates change
    code = main(["signoff", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", "--policy", str(strict), *ARGS,
                 "--output", str(out)])
    assert code == 1
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "FAIL" and any("code.kld_p99" in r for r in report["reasons"])


def test_a_capacity_policy_measures_paired_searches_and_opens_the_report_with_them(run_dir, tiny_model_dir,
                                                                                   tmp_path):
    """The policy's SLO makes the bench step search both servers' capacity in rounds; the gate, the report's first
    lines and --rejudge read them."""
    import yaml

    policy = load_policy("default").model_dump()
    policy["throughput"]["capacity"] = {"slo": {"ttft_ms": 150}, "min_ratio": 0.5, "requests_per_probe": 8}
    path = tmp_path / "capacity.yaml"
    path.write_text(yaml.safe_dump(policy))
    out = tmp_path / "copy"
    shutil.copytree(run_dir, out)
    # the bench step runs again (its inputs name the SLO): no further speed looks, the capacity rounds are the point
    args = ["signoff", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", "--policy", str(path), *ARGS,
            "--max-rounds", "3", "--output", str(out)]
    assert main(args) in (0, 1, 3)
    bench = json.loads((out / "bench.json").read_text())
    capacity = bench["capacity"]
    assert capacity["pair"] == ["baseline_continuous", "candidate_continuous"] and 1 <= len(capacity["sweeps"]) <= 3
    assert all(len(r[x]["points"]) >= 2 for r in capacity["sweeps"] for x in capacity["pair"])
    report = json.loads((out / "report.json").read_text())
    gate = next(g for g in report["gates"] if g["name"] == "throughput.capacity_ratio")
    # 8-request probes on a shared machine: a round can find no capacity for a server (every rate it tried
    # saturated); the rounds then stop and the gate says so instead of deciding
    found = all(r[x]["capacity_estimate_rps"] for r in capacity["sweeps"] for x in capacity["pair"])
    assert (len(capacity["sweeps"]) == 3) == found
    assert gate["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE") if found else \
        (gate["verdict"] == "NO EVIDENCE" and "found no capacity" in gate["detail"])
    head = (out / "report.md").read_text().split("## Gates")[0]
    assert "p99 TTFT <= 150 ms" in head and "Capacity" in head
    assert main([*args, "--rejudge"]) in (0, 1, 3)
    again = json.loads((out / "report.json").read_text())  # judged again from bench.json's stored searches
    assert (again["verdict"], again["gates"], again["reasons"]) == (report["verdict"], report["gates"],
                                                                    report["reasons"])


def test_inconclusive_gate_draws_more_items(run_dir, tiny_model_dir, tmp_path, capsys):
    """A bound at the measured KLD itself straddles its CI: the sign-off draws more code items, up to the budget."""
    first = json.loads((run_dir / "report.json").read_text())
    point = next(g["point"] for g in first["gates"] if g["name"] == "code.kld_mean")
    tight = tmp_path / "tight.yaml"
    tight.write_text(f"version: 1\nname: tight\ntasks:\n  code:\n    kld_mean: {{max: {point}}}\n")
    out = tmp_path / "copy"
    shutil.copytree(run_dir, out)
    args = ["--limit", "2", "--max-items", "4", "--concurrency", "1,2", "--num-requests", "2"]
    main(["signoff", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", "--policy", str(tight), *args,
          "--output", str(out)])
    seq = json.loads((out / "sequential.json").read_text())
    assert [x["items"] for x in seq["looks"]] == [2, 4] and seq["error_rate_bound"] == pytest.approx(0.05)
    assert json.loads((out / "eval.json").read_text())["tasks"]["code"]["items"] == 4
    md = (out / "report.md").read_text()
    assert "2 -> 4 items over 2 look(s)" in md and "at most 5% over its 2 looks" in md and "K x 5%" not in md


def test_recipe_that_fails_to_quantize_still_reports(tiny_model_dir, tmp_path):
    bad = tmp_path / "g128.yaml"  # the tiny model's K = 64 is not divisible by 128
    bad.write_text("name: g128\nquantization:\n  modifier: QuantizationModifier\n  scheme: W4A16\n")
    out = tmp_path / "bad"
    code = main(["signoff", "--model", str(tiny_model_dir), "--recipe", str(bad), *ARGS, "--output", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert code == 2 and report["verdict"] == "ERROR"
    assert report["steps"]["quantize"]["status"] == "error" and "group_size 128" in report["steps"]["quantize"]["error"]
    assert (out / "report.html").is_file()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")
def test_html_renders_in_headless_chromium_with_plots(run_dir, tmp_path):
    from PIL import Image

    shot = tmp_path / "report.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
                    f"--screenshot={shot}", "--window-size=1100,2600", (run_dir / "report.html").as_uri()],
                   check=True, timeout=120, capture_output=True)
    img = Image.open(shot).convert("RGB")
    assert img.size == (1100, 2600)
    # matplotlib's colored lines, bars and markers: saturated pixels that text and tables never produce
    colored = sum(1 for r, g, b in img.getdata() if max(r, g, b) - min(r, g, b) > 80)
    assert colored > 5000, colored
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile2'}",
                          (run_dir / "report.html").as_uri()], check=True, timeout=120, capture_output=True,
                         text=True).stdout
    for plot in ("throughput", "quality", "kld", "memory", "roofline"):
        assert f'id="plot-{plot}"' in dom


def test_report_quality_figures_match_standalone_eval(run_dir, tiny_model_dir, tmp_path):
    """`qtool eval` on the same candidate, baseline, tasks and limit gives the report's quality figures."""
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", str(run_dir / "checkpoint"), "--baseline", str(tiny_model_dir),
                 "--task", "code,summarization", "--limit", "2", "--output", str(out)])
    assert code == 0
    standalone = json.loads(out.read_text())["tasks"]
    report = json.loads((run_dir / "report.json").read_text())
    for task in ("code", "summarization"):  # the intervals differ by design: the sign-off's ends are sided
        assert _without_intervals(report["eval"][task]["summary"]) == _without_intervals(standalone[task]["summary"])


def _without_intervals(node):
    """A summary's figures without its intervals: a sign-off computes each gate's PASS end and FAIL end at its own
    share of the look's error (evals/stats/paired.side_errors), a standalone eval a two-sided 95% interval."""
    if isinstance(node, dict):
        return {k: _without_intervals(v) for k, v in node.items() if k not in ("ci95", "ci_coverage", "ci_reliable")}
    return node


def test_report_bench_figures_match_standalone_bench_serve(run_dir, tiny_model_dir, tmp_path):
    """The report's throughput is bench.json's, and `qtool bench serve` on the same inputs serves the same load."""
    bench = json.loads((run_dir / "bench.json").read_text())
    report = json.loads((run_dir / "report.json").read_text())
    for tier, row in zip(bench["tiers"], report["ablation"]["tiers"], strict=True):
        assert row["concurrency"] == tier["concurrency"] and row["steps"]
        for step in row["steps"]:
            assert step["output_tok_per_s"] == tier["results"][step["system"]]["output_tok_per_s"]
    out = tmp_path / "bench.json"
    cfg = bench["config"]
    code = main(["bench", "serve", "--model", str(tiny_model_dir), "--batching", "static,continuous",
                 "--concurrency", "1,2", "--num-requests", "2", "--workload", cfg["workload"],
                 "--mean-output-tokens", str(cfg["mean_output_tokens"]),
                 "--max-output-tokens", str(cfg["max_output_tokens"]), "--seed", str(cfg["seed"]),
                 "--output", str(out)])
    assert code == 0
    standalone = json.loads(out.read_text())
    assert standalone["inputs"]["workload_sha256"] == bench["inputs"]["workload_sha256"]  # the same requests
    for ours, theirs in zip(bench["tiers"], standalone["tiers"], strict=True):
        for mode in ("static", "continuous"):
            a, b = ours["results"][f"baseline_{mode}"], theirs["results"][mode]
            for key in ("num_requests", "completed", "failed", "prompt_tokens", "output_tokens"):
                assert a[key] == b[key], (mode, key)
            assert set(a) == set(b)  # the same summary fields, so every figure is comparable one to one


def test_sweep_over_recipes_keeps_single_verdicts_generates_the_baseline_once_and_resumes(run_dir, tiny_model_dir,
                                                                                         tmp_path, capsys):
    """`--recipe int4-rtn,int3-rtn-canary`: each candidate's report is its single sign-off's, the second candidate
    reads every baseline completion from the first's, the exit code is the recommendation's, a rerun resumes."""
    out = tmp_path / "sweep"
    bad = tmp_path / "g128.yaml"  # the tiny model's K = 64 is not divisible by 128: its quantize step fails
    bad.write_text("name: g128\nquantization:\n  modifier: QuantizationModifier\n  scheme: W4A16\n")
    argv = ["signoff", "--model", str(tiny_model_dir), "--recipe", f"int4-rtn,{bad},int3-rtn-canary", *ARGS,
            "--output", str(out)]
    code = main(argv)
    sweep = json.loads((out / "report.json").read_text())
    assert code == sweep["exit_code"] and capsys.readouterr().out.startswith(sweep["line"])
    assert [c["name"] for c in sweep["candidates"]] == ["int4-rtn", "g128", "int3-rtn-canary"]
    failed = next(c for c in sweep["candidates"] if c["name"] == "g128")  # it errors; the others go on
    assert failed["verdict"] == "ERROR" and any("group_size 128" in r for r in failed["reasons"])
    assert code != 0 or sweep["recommended"] != "g128"
    assert (sweep["recommended"] is None) == (code != 0)
    single = json.loads((run_dir / "report.json").read_text())
    cand = json.loads((out / "candidates" / "int4-rtn" / "report.json").read_text())
    quality = {g["name"]: g for g in single["gates"] if not g["name"].startswith("throughput.")}
    assert {g["name"]: g for g in cand["gates"] if not g["name"].startswith("throughput.")} == quality
    # the speed gates are measured again in each run (a loaded machine can FAIL one and not the other): only a
    # quality FAIL, which both runs share, must make both verdicts FAIL
    if any(g["verdict"] == "FAIL" for g in quality.values()):
        assert cand["verdict"] == single["verdict"] == "FAIL"
    canary = json.loads((out / "candidates" / "int3-rtn-canary" / "eval.json").read_text())
    cache = canary["models"]["baseline"]["generations_cache"]
    assert cache["misses"] == 0 and cache["hits"] > 0
    for c in sweep["candidates"]:  # a candidate that already fails a gate is not benchmarked; the others are
        bench = json.loads((out / "candidates" / c["name"] / "steps.json").read_text())["bench"]
        if bench["status"] == "skipped":
            assert ("already fail" in bench["reason"] and c["verdict"] == "FAIL") or (
                "did not finish" in bench["reason"] and c["verdict"] == "ERROR")
        else:
            assert bench["status"] == "ok"
    # the family-wise reading rebuilds a candidate's figures from its finished items: at the full 5% it gives back
    # the candidate's own gates exactly, and at a smaller share its intervals only widen
    c = Candidate("int4-rtn", "int4-rtn", LocalSignoffConfig(model=str(tiny_model_dir), recipe="int4-rtn",
                                                              output=str(out / "candidates" / "int4-rtn"), limit=2,
                                                              max_items=2))
    policy = load_policy("default")
    c.run = SignoffRun(c.cfg, policy, load_recipe("int4-rtn"), resolve_model(str(tiny_model_dir)), c.folder, None,
                 quant=QuantizeReport.load(c.folder / "checkpoint" / "quantize_report.json"))
    judge = _local_judge(policy)
    full, third = judge(c, 0.05), judge(c, 0.05 / 3)
    assert [(g.name, g.verdict, g.judged) for g in full.gates] == [
        (g["name"], g["verdict"], g["judged"]) for g in cand["gates"]]
    widened = {g.name: g.judged for g in third.gates if g.task in ("code", "summarization") and g.judged is not None}
    # every quality bound of the default policy is a max: a wider interval's worst end is at least as high
    assert widened and all(widened[g.name] >= g.judged - 1e-12 for g in full.gates if g.name in widened)
    md = (out / "report.md").read_text()
    assert md.startswith("# Release sign-off over 3 candidates") and "fallback procedure" in md
    assert 'id="plot-pareto"' in (out / "report.html").read_text()
    assert main(argv) == code  # resumes: nothing runs again
    for name in ("int4-rtn", "int3-rtn-canary"):  # g128's failed quantize is tried again, as in a single run
        steps = json.loads((out / "candidates" / name / "report.json").read_text())["steps"]
        assert all(s.get("skipped") or s["status"] == "skipped" for s in steps.values())
