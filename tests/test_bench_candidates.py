"""bench_candidates / bench_ablation hold at most two servers (baseline and one candidate) and switch each between
systems; each candidate's figures keep bench.json's shape with its own paired baseline_static rounds, a candidate
whose server cannot start is recorded and the others go on, and the peak memory of the process tree is recorded."""

from __future__ import annotations

import threading

import psutil
import pytest

from qtoolkit.bench.ablation import AblationBench, bench_ablation, bench_candidates
from qtoolkit.engine.config import EngineConfig
from qtoolkit.errors import QToolError

pytestmark = pytest.mark.slow  # real servers, several rounds: minutes on 2 cores

SMALL = {"num_requests": 2, "mean_output_tokens": 4, "max_output_tokens": 8, "seed": 3}
PROVENANCE = {"baseline", "candidate", "workload_sha256", "rounds_workload_sha256"}


class ServerCount:
    """The most `qtool serve` children this process started inside the block alive at once, sampled in a thread.

    Only direct children count: a server's own short-lived forks (a subprocess between fork and exec carries the
    server's command line) are not servers, nor is a server an earlier test left running."""

    def __init__(self) -> None:
        self.most, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._before = {p.pid for p in psutil.Process().children()}

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            alive = 0
            for p in me.children(recursive=False):
                try:
                    alive += p.pid not in self._before and "serve" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    pass
            self.most = max(self.most, alive)
            self._stop.wait(0.1)

    def __enter__(self) -> ServerCount:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def check_shape(result: dict, systems: list[str], repeated: set[str], rounds: int) -> None:
    assert {"inputs", "config", "tiers", "peak_memory"} <= set(result) and PROVENANCE <= set(result["inputs"])
    assert result["config"]["systems"] == systems
    for tier in result["tiers"]:
        assert list(tier["results"]) == systems  # every system, in the systems' order
        assert all(r["completed"] == tier["num_requests"] for r in tier["results"].values())
    top = result["tiers"][-1]
    assert set(top["rounds"]) == repeated and all(len(v) == rounds for v in top["rounds"].values())
    peak = result["peak_memory"]
    assert peak["rss_bytes"] > 0 and 1 <= peak["servers"] <= 2
    table = AblationBench.from_json(result).table.to_json()  # what the sign-off's report and gates read
    assert table["tiers"][-1]["total_speedup_rounds"] is not None


def test_candidates_share_one_baseline_server_and_keep_their_own_pairs(tiny_model_dir, tmp_path):
    seen: list[str] = []
    with ServerCount() as servers:
        results = bench_candidates(tiny_model_dir, {"a": tiny_model_dir, "broken": tmp_path / "missing",
                                                    "b": tiny_model_dir}, EngineConfig(speculative="ngram"),
                                   concurrency=[1, 2], rounds=2, on_candidate=lambda n, r: seen.append(n), **SMALL)
    assert servers.most == 2  # the baseline and one candidate; never a server per system
    assert seen == ["a", "broken", "b"] and list(results) == seen
    assert "missing" in results["broken"]["error"] and "tiers" not in results["broken"]
    systems = ["baseline_static", "baseline_continuous", "candidate_static", "candidate_continuous",
               "baseline_static_spec", "baseline_continuous_spec", "candidate_continuous_spec"]
    a, b = results["a"], results["b"]
    for r in (a, b):
        check_shape(r, systems, {"baseline_static", "candidate_continuous_spec"}, rounds=2)
        # sized to the workload (2 x (longest prompt + 8) with headroom), far below the 1 GiB default
        assert 0 < r["config"]["kv_cache_tokens"] < 20_000
    # each candidate measured baseline_static again in its own rounds; the baseline-only layers are shared
    assert a["inputs"]["workload_sha256"] == b["inputs"]["workload_sha256"]
    assert a["tiers"][-1]["rounds"]["baseline_static"] != b["tiers"][-1]["rounds"]["baseline_static"]
    for shared in ("baseline_continuous", "baseline_continuous_spec"):
        assert a["tiers"][0]["results"][shared] == b["tiers"][0]["results"][shared]
    spec = a["tiers"][0]["results"]
    assert "speculative" in spec["candidate_continuous_spec"] and "speculative" not in spec["candidate_continuous"]


def test_bench_ablation_is_the_one_candidate_case(tiny_model_dir, tmp_path):
    with ServerCount() as servers:
        result = bench_ablation(tiny_model_dir, tiny_model_dir, concurrency=[2], rounds=2,
                                repeat=("baseline_static", "full_stack", "candidate_static"), **SMALL)
    assert servers.most <= 2
    check_shape(result, ["baseline_static", "baseline_continuous", "candidate_static", "candidate_continuous"],
                {"baseline_static", "candidate_continuous", "candidate_static"}, rounds=2)
    with pytest.raises(QToolError, match="exited"):
        bench_ablation(tiny_model_dir, tmp_path / "missing", concurrency=[1], **SMALL)
