"""The bench room's typed hand-offs: the Workload protocol (built-in and file workloads alike), tiers and the
ablation table as dataclasses whose JSON keeps its shape, the one tier loop, the `--speculative` value parsed once
into a SpeculativeSpec, and no import circle among the bench modules (TYPE_CHECKING imports included)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from qtoolkit.bench.ablation import AblationBench, AblationTable
from qtoolkit.bench.loop import Tier, TierLoop, TierRecord
from qtoolkit.bench.summary import TierSummary
from qtoolkit.bench.types import BenchRequest, Workload
from qtoolkit.bench.workload_files import FileWorkload, parse_workload
from qtoolkit.bench.workloads import BuiltinWorkload, as_workload, build_workload
from qtoolkit.cli import main
from qtoolkit.engine.config import EngineConfig
from qtoolkit.engine.speculative_spec import SpeculativeConfigError, SpeculativeSpec
from qtoolkit.errors import DataError, QToolError

BENCH = Path(__file__).resolve().parents[1] / "qtoolkit" / "bench"


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- Workload protocol -------------------------------------------------------------------------------------------
def test_builtin_and_file_workloads_are_both_workloads(tmp_path):
    f = _jsonl(tmp_path / "w.jsonl", [{"id": "a", "prompt": "A", "max_tokens": 5},
                                      {"id": "b", "messages": [{"role": "user", "content": "B"}], "max_tokens": 7}])
    for workload in (parse_workload("code"), parse_workload(str(f))):
        assert isinstance(workload, Workload)
        reqs = workload.requests(4, seed=1, mean_output_tokens=8, max_output_tokens=16)
        assert len(reqs) == 4 and all(isinstance(r, BenchRequest) and r.max_tokens > 0 for r in reqs)
        assert reqs == workload.requests(4, seed=1, mean_output_tokens=8, max_output_tokens=16)  # seeded
        json.dumps(workload.describe())
        workload.attach_length_probe("http://127.0.0.1:9", "m", name="x")  # attaching sends nothing
    assert parse_workload("code") == BuiltinWorkload("code") and parse_workload("code").describe() == "code"
    assert isinstance(parse_workload(str(f)), FileWorkload)
    assert parse_workload(str(f)).describe()["files"][0]["path"] == str(f)


def test_a_workload_name_and_its_value_give_the_same_requests():
    assert build_workload("mixed", 6, seed=2, max_output_tokens=32) == \
        BuiltinWorkload("mixed").requests(6, seed=2, max_output_tokens=32)
    assert as_workload(BuiltinWorkload("long")) == BuiltinWorkload("long")
    with pytest.raises(DataError, match="unknown workload 'poetry'"):
        as_workload("poetry")
    with pytest.raises(DataError, match="not a workload"):
        as_workload(42)  # type: ignore[arg-type]


def test_a_file_line_without_max_tokens_needs_a_probe(tmp_path):
    f = _jsonl(tmp_path / "w.jsonl", [{"id": "a", "prompt": "A"}])
    with pytest.raises(QToolError, match="attach_length_probe"):
        parse_workload(str(f)).requests(2, seed=0, max_output_tokens=8)


def _imports(path: Path) -> set[str]:
    """Sibling bench modules `path` imports, anywhere in the file (TYPE_CHECKING blocks and functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update([node.module] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qtoolkit.bench."):
            names.add(node.module.removeprefix("qtoolkit.bench."))
    return {n.split(".")[0] for n in names}


def test_no_import_circle_among_the_bench_modules():
    graph = {p.stem: _imports(p) for p in BENCH.glob("*.py")}
    assert "TYPE_CHECKING" not in "".join(p.read_text() for p in BENCH.glob("*.py"))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, set()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not circles, circles
    assert "workload_files" not in graph["workloads"] and "load_client" not in graph["vllm_names"]


# ---- the tier loop and the typed tables -----------------------------------------------------------------------
def test_the_loop_interleaves_tiers_and_repeats_only_what_it_is_told():
    calls = []

    def measure(label: str, reqs: list[BenchRequest], c: int, seed: int) -> TierSummary:
        calls.append((label, len(reqs), c, seed))
        return _summary(10.0 if label == "a" else 20.0, len(reqs))

    loop = TierLoop(["a", "b"], measure, BuiltinWorkload("code"), 0, 8, 16, rounds=3, repeat=["b", "a"])
    tiers = loop.run(loop.plan([1, 2], 4))
    assert [c[0] for c in calls[:4]] == ["a", "b", "b", "a"]  # the second tier runs in reverse
    assert [list(t.results) for t in tiers] == [["a", "b"], ["a", "b"]]  # results keep the systems' order
    assert tiers[0].rounds is None and tiers[1].rounds == {"a": [10.0] * 3, "b": [20.0] * 3}
    assert len(loop.round_requests) == 2 * 4 and not {r.prompt for r in loop.round_requests} & \
        {r.prompt for r in loop.requests}
    assert tiers[1].to_json()["rounds"] == tiers[1].rounds and "rounds" not in tiers[0].to_json()
    assert TierRecord.from_json(json.loads(json.dumps(tiers[1].to_json()))).tok_per_s("b") == 20.0


def _summary(output_tok_per_s: float, completed: int = 8) -> TierSummary:
    """A tier summary with only what the tables read (as an older, sparser file gives it)."""
    return TierSummary.from_json({"completed": completed, "failed": 0, "duration_s": 1.0,
                                  "output_tok_per_s": output_tok_per_s, "requests_per_s": completed / 1.0})


def _bench(rounds: dict | None, speculative: bool) -> dict:
    tps = {"baseline_static": 10.0, "baseline_continuous": 14.0, "candidate_static": 12.0,
           "candidate_continuous": 17.0}
    if speculative:
        tps |= {"baseline_static_spec": 11.0, "baseline_continuous_spec": 15.0, "candidate_continuous_spec": 19.0}
    tier = Tier(4, [BenchRequest(i, "code", "p", 4) for i in range(8)], {k: _summary(v) for k, v in tps.items()},
                rounds)
    return {"tiers": [tier.to_json()], "config": {"systems": list(tps)}}


@pytest.mark.parametrize("speculative", [False, True])
def test_the_ablation_table_round_trips_and_keeps_its_shape(speculative):
    rounds = {"baseline_static": [10.0, 10.5, 9.5], "candidate_static": [12.0, 12.2, 11.9],
              "candidate_continuous": [17.0, 17.5, 16.0], "candidate_continuous_spec": [19.0, 19.5, 18.0]}
    table = AblationBench.from_json(_bench(rounds, speculative)).table.to_json()
    assert AblationTable.from_json(json.loads(json.dumps(table))).to_json() == json.loads(json.dumps(table))
    (row,) = table["tiers"]
    top = "candidate_continuous_spec" if speculative else "candidate_continuous"
    assert [s["system"] for s in row["steps"]][-1] == top
    assert row["total_speedup"] == pytest.approx((19.0 if speculative else 17.0) / 10.0)
    assert row["quantization_speedup"] == pytest.approx(1.2) == row["alone_speedup"]["quantization"]
    # each layer with rounds on both sides gets an interval: here quantization alone (and, stacked, the
    # quantization step over whatever it lands on when that has rounds)
    assert set(row) - {"marginal_rounds"} == {
        "concurrency", "steps", "total_speedup", "alone_speedup", "quantization_speedup", "stacking_efficiency",
        "total_speedup_rounds", "quantization_speedup_rounds", "alone_rounds"}
    assert row["alone_rounds"]["quantization"]["rounds"] == 3
    assert row["total_speedup_rounds"]["rounds"] == 3
    assert set(row["steps"][0]) == {"system", "label", "output_tok_per_s", "marginal_gain"}
    assert "speculative decoding" in row["alone_speedup"] if speculative else "speculative decoding" not in \
        row["alone_speedup"]


# ---- SpeculativeSpec -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, path", [("ngram", "ngram", None), (" self-int4 ", "self-int4", None),
                                              ("eagle3:runs/head", "eagle3", "runs/head"),
                                              ("draft:/m/d:1", "draft", "/m/d:1"), ("self:ckpt", "self", "ckpt")])
def test_a_spec_is_parsed_once_into_fields(text, kind, path):
    spec = SpeculativeSpec.parse(text)
    assert spec == SpeculativeSpec(kind, path) and SpeculativeSpec.parse(str(spec)) == spec
    config = EngineConfig(speculative=text)
    assert config.speculative_spec == spec and config.speculative == str(spec)
    assert config.replace(num_speculative_tokens=2).speculative_spec == spec


def test_no_speculation_is_none():
    for off in (None, "", "none", "OFF"):
        assert SpeculativeSpec.parse(off) is None and EngineConfig(speculative=off).speculative_spec is None
    assert SpeculativeSpec.parse("self-fp8").self_draft_format == "fp8"
    assert SpeculativeSpec("self", "x").shares_target_kv and not SpeculativeSpec("draft", "x").shares_target_kv


@pytest.mark.parametrize("bad, fix", [("magic", "use ngram, draft:PATH"), ("eagle3:", "write eagle3:DIR"),
                                      ("draft", "write draft:PATH"), ("ngram:x", "use ngram, draft:PATH"),
                                      ("eagle3:  ", "write eagle3:DIR")])
def test_a_bad_spec_is_one_line_naming_the_fix(bad, fix):
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeSpec.parse(bad)
    assert isinstance(e.value, QToolError) and len(str(e.value).splitlines()) == 1 and fix in str(e.value)
    with pytest.raises(SpeculativeConfigError, match="unknown"):
        SpeculativeSpec("magic")


def test_a_bad_spec_on_the_command_line_exits_2_before_anything_starts(tmp_path, capsys):
    rc = main(["bench", "serve", "--speculative", "eagle3:", "--output", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "eagle3:DIR" in err, err
    assert not (tmp_path / "b.json").exists()


def test_the_deployment_throughput_table_keeps_its_shape():
    from qtoolkit.bench.deployment import DeploymentBench

    def summary(role: str, tps: float) -> dict:
        return {"endpoint": f"http://{role}", "model_id": "m", "output_tok_per_s": tps, "requests_per_s": 1.0,
                "completed": 4, "failed": 0, "duration_s": 4.0, "ttft_s": {"p50": 0.1}, "tpot_s": {"p50": 0.02}}

    tier = {"concurrency": 4, "num_requests": 4, "results": {"baseline": summary("b", 10.0),
                                                             "candidate": summary("c", 15.0)},
            "rounds": {"baseline": [10.0, 10.0, 11.0], "candidate": [15.0, 14.0, 16.0]}}
    table = DeploymentBench.from_json({"tiers": [tier, {**tier, "rounds": None}],
                                       "inputs": {"workload_sha256": "x"}}).table().to_json()
    top, plain = table["tiers"][0], table["tiers"][1]
    assert top["total_speedup"] == pytest.approx(1.5) and top["total_speedup_rounds"]["rounds"] == 3
    assert "total_speedup_rounds" not in plain and table["workload_sha256"] == "x"
    assert list(top["endpoints"]) == ["baseline", "candidate"]
    assert top["endpoints"]["candidate"] == {"endpoint": "http://c", "model_id": "m", "output_tok_per_s": 15.0,
                                             "requests_per_s": 1.0, "completed": 4, "failed": 0,
                                             "ttft_p50_s": 0.1, "tpot_p50_s": 0.02}
