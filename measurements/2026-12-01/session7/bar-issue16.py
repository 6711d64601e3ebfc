"""Issue 16's bar as a new user runs it: a small JSONL with prompts, chat messages, references and tests
(bar-workload.jsonl beside this script) through `qtool eval --task custom --data`, `qtool bench serve --workload`
and `qtool signoff --data`, against the unquantized default model. Writes bar-issue16.json (eval, bench) and
bar-issue16-signoff.json (the sign-off) beside it.

    cd WORKTREE && QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/session7/bar-issue16.py [eval|signoff]

The two phases are independent (the sign-off quantizes for itself), so on a loaded machine they run side by side;
without an argument both run, one after the other.

The candidate is `qtool quantize --model default --recipe int4-rtn` (cheap on a CPU). The sign-off's policy is
the default policy's `custom` section with its throughput and memory gates (written from the shipped default
policy, so it cannot drift from it), without the code/summarization tasks, to keep the run to minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DATA = HERE / "bar-workload.jsonl"
WORK = Path(os.environ.get("BAR_WORK", "/tmp/s7-bar16"))
OUT = HERE / "bar-issue16.json"
OUT_SIGNOFF = HERE / "bar-issue16-signoff.json"


def qtool(*args: str, timeout: int = 3600) -> dict:
    t0 = time.time()
    p = subprocess.run(["qtool", *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return {"command": "qtool " + " ".join(args), "exit_code": p.returncode, "seconds": round(time.time() - t0, 1),
            "stderr_tail": p.stderr.strip().splitlines()[-3:]}


def ci(fig: dict | None) -> dict | None:
    if fig is None:
        return None
    keep = ("candidate", "baseline", "delta", "mean_pm", "ci95", "ci_method", "ci_coverage", "ci_reliable", "items")
    return {k: fig[k] for k in keep if k in fig}


def policy_file() -> Path:
    sys.path.insert(0, str(HERE.parents[2]))
    from qtoolkit.signoff.policy import load_policy

    default = load_policy("default")
    doc = {"version": 1, "name": "default-custom-only",
           "description": "the default policy's custom, throughput and memory gates (no code/summarization)",
           "tasks": {"custom": {m: b.model_dump(exclude_defaults=True) for m, b in default.tasks["custom"].items()}},
           "throughput": default.throughput.model_dump(exclude_none=True),
           "memory": default.memory.model_dump(exclude_none=True)}
    path = WORK / "policy.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def eval_and_bench() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    out: dict = {"data": str(DATA.relative_to(HERE.parents[2])), "lines": sum(1 for _ in open(DATA)), "steps": {}}
    ckpt = WORK / "int4"
    if (ckpt / "quantize_report.json").exists():  # a finished checkpoint of this recipe is reused, and said so
        out["steps"]["quantize"] = {"reused": str(ckpt)}
    else:
        out["steps"]["quantize"] = qtool("quantize", "--model", "default", "--recipe", "int4-rtn", "--output",
                                         str(ckpt))

    ev = WORK / "eval.json"
    out["steps"]["eval"] = qtool("eval", "--model", str(ckpt), "--baseline", "default", "--task", "custom",
                                 "--data", str(DATA), "--output", str(ev), "--overwrite")
    if ev.exists():
        task = json.loads(ev.read_text())["tasks"]["custom:bar-workload"]
        s = task["summary"]
        out["eval"] = {"items": s["items"], "items_with_reference": s["items_with_reference"],
                       "items_with_tests": s["items_with_tests"], "kld": ci(s["text_stats"].get("kld")),
                       "same_top1": ci(s["text_stats"].get("same_top1")), "nll_answer": ci(s["nll_answer"]),
                       "rougeL": ci(s.get("rougeL")), "pass@1": ci(s.get("pass@1")),
                       "greedy_agreement": s["greedy_agreement"]["rate"], "answer_tokens": ci(s["answer_tokens"]),
                       "not_computed": s["not_computed"],
                       "kinds": sorted({r["kind"] for r in task["records"].values()}),
                       "worst_items": [w["id"] for w in s["worst_items"]]}

    bench = WORK / "bench.json"
    out["steps"]["bench_serve"] = qtool("bench", "serve", "--model", str(ckpt), "--workload", str(DATA),
                                        "--max-concurrency", "1,2", "--num-prompts", "4", "--max-output-tokens", "32",
                                        "--output", str(bench))
    if bench.exists():
        b = json.loads(bench.read_text())
        out["bench_serve"] = {"tiers": [{"concurrency": t["concurrency"],
                                         **{k: v for k, v in next(iter(t["results"].values())).items()
                                            if k in ("completed", "failed", "output_tokens", "output_tok_per_s")}}
                                        for t in b["tiers"]],
                              "workload": b["config"]["workload"]}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v.get("exit_code") for k, v in out["steps"].items()}))


def signoff() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    out: dict = {"data": str(DATA.relative_to(HERE.parents[2])), "steps": {}}
    run = WORK / "signoff"
    # one look of 4 items (--max-items 4): the verdict must come from those, as a short CPU run allows
    out["steps"]["signoff"] = qtool("signoff", "--model", "default", "--recipe", "int4-rtn", "--policy",
                                    str(policy_file()), "--data", str(DATA), "--limit", "4", "--max-items", "4",
                                    "--concurrency", "1,2", "--num-requests", "2", "--rounds", "2",
                                    "--speculative", "none", "--output", str(run))
    if (run / "report.json").exists():
        r = json.loads((run / "report.json").read_text())
        out["signoff"] = {"verdict": r.get("verdict"),
                          "gates": [{k: g.get(k) for k in ("name", "verdict", "point", "judged", "detail", "ci_method", "ci_coverage")}
                                    for g in r["gates"]],
                          "steps": {k: v["status"] for k, v in r["steps"].items()},
                          "worst_regressions_in_md": "## Worst regressions: custom:bar-workload"
                                                     in (run / "report.md").read_text(),
                          "eval_items": {k: v.get("items") for k, v in r["eval"].items()}}
    OUT_SIGNOFF.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"signoff": out["steps"]["signoff"]["exit_code"], "verdict": out.get("signoff", {}).get("verdict")}))


def main() -> int:
    phase = sys.argv[1] if len(sys.argv) > 1 else "all"
    if phase in ("eval", "all"):
        eval_and_bench()
    if phase in ("signoff", "all"):
        signoff()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
