"""What a `qtool bench serve` c=16 tier does inside the server, in CPU counts rather than wall-clock ratios, for
two source trees (before / after the #19 restructuring): engine steps, batch composition per step, prompt tokens
per step, CPU seconds per thread (engine driver thread, event loop, torch workers) and inside / outside
Engine.step. The server is `qtool serve` of the given tree, started through this file, which wraps
Scheduler.schedule, Engine.step and EngineDriver._iterate to count (the tree's code is not edited); SIGUSR1 makes
it write its counts and start over.

The load is the bench's: the mixed workload, seed 0, 16 requests per tier, a c=1 tier then the c=16 tier (the
counts cover the c=16 tier only), after the bench's two warm-up requests. `--workload-from` picks which tree
builds the requests, so a server can be fed the other tree's prompts. The load client is the tree this runs
from (QTOOLKIT_SRC); the two trees' load clients are the same code.

    QTOOLKIT_SRC=$PWD python measurements/2026-12-01/session8/serve16-counts.py --tree before=/work/wt/before \
        --tree after=/work/wt/serve16 --output measurements/2026-12-01/session8/serve16-counts.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve()


# ---- server side (runs inside `qtool serve` of the tree under test) ---------------------------------------------
def _thread_cpu() -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def serve_instrumented(argv: list[str]) -> None:
    from qtoolkit.engine import engine as engine_mod
    from qtoolkit.engine import scheduler as scheduler_mod
    from qtoolkit.server import driver as driver_mod

    rec: dict = {}

    def reset() -> None:
        rec.clear()
        rec.update(steps=[], step_cpu=0.0, step_wall=0.0, iter_cpu=0.0, iterations=0, busy_iterations=0,
                   thread_cpu=_thread_cpu(), process_cpu=time.process_time(), wall=time.perf_counter())

    reset()
    schedule, step, iterate = scheduler_mod.Scheduler.schedule, engine_mod.Engine.step, driver_mod.EngineDriver._iterate

    def counted_schedule(self):  # noqa: ANN001, ANN202
        plan = schedule(self)
        items = []
        for w in plan.work:
            seq, n = w if isinstance(w, tuple) else (w.seq, w.num_new)
            prompt_left = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
            items.append((n, min(n, prompt_left), seq.num_computed_tokens + n == len(seq)))
        rec["steps"].append({"items": len(items), "tokens": sum(n for n, _, _ in items),
                             "prompt_tokens": sum(p for _, p, _ in items),
                             "decodes": sum(1 for n, p, y in items if n == 1 and p == 0 and y),
                             "yield": sum(1 for _, _, y in items if y),
                             "running": len(self.running), "waiting": len(self.waiting)})
        return plan

    def counted_step(self):  # noqa: ANN001, ANN202
        c0, w0 = time.thread_time(), time.perf_counter()
        out = step(self)
        rec["paged_attention"] = self.runner.paged_attention  # False: the CPU ops failed to load (torch path)
        rec["step_cpu"] += time.thread_time() - c0
        rec["step_wall"] += time.perf_counter() - w0
        return out

    def counted_iterate(self):  # noqa: ANN001, ANN202
        c0, steps = time.thread_time(), len(rec["steps"])
        iterate(self)
        rec["iter_cpu"] += time.thread_time() - c0
        rec["iterations"] += 1
        rec["busy_iterations"] += len(rec["steps"]) > steps

    scheduler_mod.Scheduler.schedule = counted_schedule
    engine_mod.Engine.step = counted_step
    driver_mod.EngineDriver._iterate = counted_iterate

    def dump(signum, frame) -> None:  # noqa: ANN001
        cpu = _thread_cpu()
        data = {**rec, "wall": time.perf_counter() - rec["wall"], "process_cpu": time.process_time() - rec["process_cpu"],
                "thread_cpu": {k: round(v - rec["thread_cpu"].get(k, 0.0), 3) for k, v in cpu.items()}}
        Path(os.environ["COUNTS_OUT"]).write_text(json.dumps(data))
        reset()

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["qtool", *argv]
    from qtoolkit.cli import main

    sys.exit(main())


# ---- driver side -------------------------------------------------------------------------------------------------
def _workload(tree: str) -> list[dict]:
    code = ("import json; from qtoolkit.bench.workloads import build_workload; "
            "print(json.dumps([[r.index, r.kind, r.prompt, r.max_tokens] for r in build_workload('mixed', 32, seed=0, "
            "mean_output_tokens=64, max_output_tokens=128)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "QTOOLKIT_SRC": tree},
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _summ(steps: list[dict]) -> dict:
    return {"steps": len(steps), "steps_with_prompt_tokens": sum(1 for s in steps if s["prompt_tokens"]),
            "prompt_tokens": sum(s["prompt_tokens"] for s in steps), "tokens_fed": sum(s["tokens"] for s in steps),
            "tokens_yielded": sum(s["yield"] for s in steps),
            "batch_size_histogram": dict(sorted(Counter(s["items"] for s in steps).items())),
            "decode_only_steps": sum(1 for s in steps if s["decodes"] == s["items"]),
            "decode_only_batch_histogram": dict(sorted(Counter(s["items"] for s in steps
                                                                if s["decodes"] == s["items"]).items())),
            "mixed_steps": [(s["items"], s["prompt_tokens"], s["decodes"]) for s in steps if s["prompt_tokens"]]}


def measure(label: str, tree: str, requests: list[list], c1: bool) -> dict:
    from qtoolkit.bench.load_client import run_load, summarize, warm_up
    from qtoolkit.bench.workloads import BenchRequest
    from qtoolkit.server.process import free_port

    reqs = [BenchRequest(i, k, p, m) for i, k, p, m in requests]
    port = free_port()
    out = Path(tempfile.mkdtemp()) / "counts.json"
    # a private extension folder per tree: torch's build.ninja names the source's absolute path, so servers of
    # other worktrees sharing one folder rebuild it at every start (and race on its lock file)
    ext = Path(tempfile.gettempdir()) / f"serve16-ext-{Path(tree).name}"
    env = {**os.environ, "QTOOLKIT_SRC": tree, "COUNTS_OUT": str(out), "HF_HUB_OFFLINE": "1",
           "QTOOLKIT_EXT_DIR": str(ext)}
    proc = subprocess.Popen([sys.executable, str(HERE), "--serve", "--", "serve", "--model", "default", "--port",
                             str(port), "--log-level", "warning"], cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for _ in range(1800):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the {label} server exited with {proc.returncode}")
            time.sleep(0.5)
        else:
            raise SystemExit(f"the {label} server did not come up")
        warm_up(url, "default", seed=0)
        res1, d1 = asyncio.run(run_load(url, "default", reqs[:16], concurrency=1, seed=0)) if c1 else ([], 0.0)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        res, duration = asyncio.run(run_load(url, "default", reqs[16:32], concurrency=16, seed=1))
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        counts = json.loads(out.read_text())
    finally:
        proc.terminate()
        proc.wait(30)
    s = summarize(res, duration)
    if s["completed"] != len(res) or not counts.get("paged_attention"):
        raise SystemExit(f"{label}: {s['completed']}/{len(res)} completed, paged attention "
                         f"{counts.get('paged_attention')}: {s['errors']}")
    steps = counts.pop("steps")
    cpu = counts.pop("thread_cpu")
    return {"label": label, "tree": tree, "c16": {k: s[k] for k in ("completed", "prompt_tokens", "output_tokens",
                                                                     "duration_s", "output_tok_per_s")},
            "c1_output_tok_per_s": summarize(res1, d1)["output_tok_per_s"],
            "server": {**counts, **_summ(steps),
                       "thread_cpu_top": dict(sorted(cpu.items(), key=lambda kv: -kv[1])[:8])}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve_instrumented(sys.argv[3:])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--tree", action="append", required=True, help="LABEL=PATH")
    p.add_argument("--run", action="append", help="SERVER_LABEL:WORKLOAD_LABEL (default: each on its own)")
    p.add_argument("--skip-c1", action="store_true", help="no c=1 tier before the c=16 one (quicker on a loaded "
                   "machine; the c=1 prompts then leave nothing in the prefix cache)")
    p.add_argument("--output", required=True)
    a = p.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    workloads = {k: _workload(v) for k, v in trees.items()}
    runs = [r.split(":") for r in a.run] if a.run else [(k, k) for k in trees]
    results = []
    for server, wl in runs:
        r = measure(f"server={server} workload={wl}", trees[server], workloads[wl], not a.skip_c1)
        print(json.dumps({k: v for k, v in r.items() if k != "server"}), flush=True)
        results.append(r)
        Path(a.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
