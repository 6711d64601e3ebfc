"""What keeps an eval's (and so a sign-off's and a sweep's) memory bounded, checked through the code paths:
the eval loads one in-process model at a time and frees it before the next side loads, with the same results
as with both held; a HumanEval program's sandbox starts without a fork of the evaluator (no preexec_fn, so the
child never holds the evaluator's pages) under the same rlimits; and `qtool bench memory` counts a page shared
by a forked child once in PSS and twice in RSS."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
import weakref

import pytest
from qtoolkit.evals import runner
from qtoolkit.evals.backends import factory
from qtoolkit.evals.backends.engine import EngineBackend
from qtoolkit.evals.runner import EvalConfig, evaluate
from qtoolkit.evals.sandbox import run as sandbox_run
from qtoolkit.evals.sandbox.run import Limits, isolation, run_program

from qtoolkit.cli import main

needs_bwrap = pytest.mark.skipif(not isolation()["bubblewrap"], reason=f"no bubblewrap: {isolation()['missing']}")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tiny_model_dir, tokenizer_dir):
    """Candidate = a second random tiny LLaMA with the same tokenizer (different weights, so KLD > 0)."""
    from conftest import build_tiny_llama

    other = build_tiny_llama(tmp_path_factory.mktemp("tiny-other-mem"), tokenizer_dir, seed=1)
    return str(other), str(tiny_model_dir)


class _Live:
    """Every EngineBackend the eval builds, and how many were alive (after a collection) when each was built."""

    def __init__(self) -> None:
        self.alive: weakref.WeakSet = weakref.WeakSet()
        self.alive_at_build: list[int] = []
        live = self

        class Tracked(EngineBackend):
            def __init__(self, spec: str, **options) -> None:
                gc.collect()
                live.alive_at_build.append(len(live.alive))
                super().__init__(spec, **options)
                live.alive.add(self)

        self.cls = Tracked


class _BothKept:
    """The slot of the old eval: nothing is released when the other side loads."""

    def take(self, side) -> None:
        pass


TASKS = "code,summarization,perplexity"


def _cfg(pair: tuple[str, str], output: str) -> EvalConfig:
    cand, base = pair
    return EvalConfig(model=cand, baseline=base, tasks=TASKS, limit=1, output=output, seed=2,
                      task_options={"max_tokens": 6, "allow_weak_sandbox": True})


def test_eval_holds_one_engine_at_a_time_with_the_same_results(tiny_pair, tmp_path, monkeypatch):
    live = _Live()
    monkeypatch.setattr(factory, "EngineBackend", live.cls)
    one = evaluate(_cfg(tiny_pair, str(tmp_path / "one.json")))
    # no engine was built while another was alive: the other side's was released (and collected) first
    assert live.alive_at_build and set(live.alive_at_build) == {0}, live.alive_at_build
    batches = 3  # one batch a task at --limit 1 (perplexity: 2 items, a batch of 8)
    assert len(live.alive_at_build) <= 2 * batches  # each side loads at most once a batch
    gc.collect()
    assert len(live.alive) == 0  # and none outlives the eval

    # the old way (both sides held) gives the same records: only the order of the sides' calls changed
    live.alive_at_build.clear()
    monkeypatch.setattr(runner, "Resident", _BothKept)
    both = evaluate(_cfg(tiny_pair, str(tmp_path / "both.json")))
    assert max(live.alive_at_build) == 1 and len(live.alive_at_build) == 2  # two engines at once, loaded once
    for task in TASKS.split(","):
        assert one["tasks"][task]["records"] == both["tasks"][task]["records"], task
        assert one["tasks"][task]["summary"] == both["tasks"][task]["summary"], task
    assert one["tasks"]["perplexity"]["summary"]["code"]["kld"]["mean_pm"][0] > 0  # distributions were compared


def test_a_released_side_is_not_reloaded_to_describe_it(tiny_pair, tmp_path, monkeypatch):
    """The eval's record names both models after every task without loading a released one again."""
    live = _Live()
    monkeypatch.setattr(factory, "EngineBackend", live.cls)
    res = evaluate(EvalConfig(model=tiny_pair[0], baseline=tiny_pair[1], tasks="perplexity", limit=1,
                              output=str(tmp_path / "p.json")))
    assert len(live.alive_at_build) == 2  # candidate, then baseline: describing the candidate loaded nothing
    assert res["models"]["candidate"]["backend"] == res["models"]["baseline"]["backend"] == "engine"


LIMITS = Limits(wall_s=20.0, cpu_s=7, memory_bytes=768 << 20, file_bytes=3 << 20, open_files=48)
CHECK_LIMITS = f"""
import resource
assert resource.getrlimit(resource.RLIMIT_AS) == ({LIMITS.memory_bytes}, {LIMITS.memory_bytes})
assert resource.getrlimit(resource.RLIMIT_CPU) == ({LIMITS.cpu_s}, {LIMITS.cpu_s + 1})
assert resource.getrlimit(resource.RLIMIT_FSIZE) == ({LIMITS.file_bytes}, {LIMITS.file_bytes})
assert resource.getrlimit(resource.RLIMIT_NOFILE) == ({LIMITS.open_files}, {LIMITS.open_files})
assert resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)
try:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
except (ValueError, OSError):
    pass
else:
    raise SystemExit("raised its own memory limit")
"""


@needs_bwrap
def test_sandbox_starts_without_forking_the_evaluator_and_keeps_its_limits(monkeypatch):
    real = subprocess.Popen
    seen: list[dict] = []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sandbox_run.subprocess, "Popen", spy)
    r = run_program(CHECK_LIMITS, LIMITS, mode="bubblewrap")
    assert r.passed, r.stderr
    assert len(seen) == 1 and seen[0].get("preexec_fn") is None
    # without preexec_fn CPython starts the child with vfork: it never maps a copy of the evaluator's pages
    assert getattr(subprocess, "_USE_VFORK", True)


def test_bench_memory_counts_a_forked_childs_shared_pages_once_in_pss(tmp_path, capsys):
    out = tmp_path / "m.json"
    program = ("import os, time\nx = bytearray(256 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\n"
               "pid = os.fork()\ntime.sleep(2.5)\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n")
    assert main(["bench", "memory", "--output", str(out), "--every", "0.2", "--", sys.executable, "-c",
                 program]) == 0
    m = json.loads(out.read_text())
    rss, pss = m["peak_rss"], m["peak_pss"]
    assert rss["processes"] == 2 and rss["bytes"] > 2 * (250 << 20)  # the child's copy-on-write pages again
    assert (250 << 20) < pss["bytes"] < 1.3 * (256 << 20) + (64 << 20)  # counted once
    assert m["rc"] == 0 and m["timeline_s_rss_pss_gib_processes_root_pss_gib"]
    # the root apart: its 256 MiB before the fork, half of them while the child shares them
    assert (120 << 20) < m["peak_root_pss"]["bytes"] <= pss["bytes"]


def test_bench_memory_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "m.json"
    for argv, words in ((["--output", str(out)], "no command to measure"),
                        (["--output", str(out), "--every", "0", "--", "true"], "--every"),
                        (["--output", str(tmp_path), "--", "true"], "is a folder"),
                        (["--output", str(out), "--", str(tmp_path / "no-such-program")], "cannot start")):
        assert main(["bench", "memory", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and err.count("\n") == 0, err
    assert not out.exists()


def test_bench_memory_passes_the_commands_exit_status_through(tmp_path):
    out = tmp_path / "m.json"
    assert main(["bench", "memory", "-o", str(out), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert json.loads(out.read_text())["rc"] == 3


def test_bench_memory_stopped_midway_still_writes_its_peaks(tmp_path):
    out = tmp_path / "m.json"
    sampler = subprocess.Popen([sys.executable, "-m", "qtoolkit", "bench", "memory", "--every", "0.2", "-o", str(out),
                                "--", sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(4)  # started and sampling; then stopped as a timeout or an operator would
    sampler.terminate()
    assert sampler.wait(timeout=30) == 2  # the command was killed: not a verdict
    m = json.loads(out.read_text())
    assert m["interrupted"] is True and m["peak_rss"]["bytes"] > 0 and m["rc"] != 0
