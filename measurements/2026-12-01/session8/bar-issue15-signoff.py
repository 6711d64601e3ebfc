"""Issue #15 point 5 for `qtool signoff`: the whole sign-off (quantize int4-rtn -> eval code + summarization ->
bench serve of baseline and candidate servers -> diagnose -> verdict) runs on each new family, every step "ok".

Per family: the tiny random model of session7/bar-issue15.py (same configs, seed and x10 weights), then
`qtool signoff --model DIR --recipe int4-rtn` at a smoke size (--limit 2 --max-items 2, tiers 1,2 of 2 requests,
2 rounds, no speculation), each as its own `qtool` process. Random weights solve nothing and score no ROUGE, so a
decisive verdict is not expected: the point is that no step fails (an ERROR, exit 2, would say one did).

Run from the repository root: QTOOLKIT_SRC=$PWD OMP_NUM_THREADS=1 python3 measurements/2026-12-01/session8/bar-issue15-signoff.py
(FAMILIES=qwen3,mixtral runs those, in that order). bar-issue15-signoff.json beside this file is rewritten after
each family, so a stopped run keeps the families it finished.
"""

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from qtoolkit.model.sources import resolve_model

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("bar15", HERE.parent / "session7" / "bar-issue15.py")
bar15 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bar15)
SIZE = ["--limit", "2", "--max-items", "2", "--concurrency", "1,2", "--num-requests", "2", "--rounds", "2",
        "--speculative", "none"]


def main() -> None:
    tok = AutoTokenizer.from_pretrained(resolve_model("default").path)
    families = bar15.configs(tok)
    only = [f for f in os.environ.get("FAMILIES", "").split(",") if f]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in only or families:  # in the order asked: the JSON is rewritten after each family
            cfg = families[name]
            folder = Path(tmp) / name
            bar15.build(cfg, folder, tok)
            out = Path(tmp) / f"{name}-signoff"
            t = time.monotonic()
            p = subprocess.run([sys.executable, "-m", "qtoolkit", "signoff", "--model", str(folder), "--recipe",
                                "int4-rtn", *SIZE, "--output", str(out)], capture_output=True, text=True,
                               env=os.environ | {"QTOOLKIT_QUIET": "1"})
            report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
            rows[name] = {
                "model_type": cfg.model_type, "exit_code": p.returncode, "seconds": round(time.monotonic() - t, 1),
                "verdict": report.get("verdict"),
                "steps": {n: s.get("status") for n, s in (report.get("steps") or {}).items()},
                "gates": {g["name"]: g["verdict"] for g in report.get("gates", [])},
                "stderr_tail": p.stderr.strip().splitlines()[-2:],
            }
            rows[name]["every_step_ok"] = bool(rows[name]["steps"]) and all(
                s == "ok" for s in rows[name]["steps"].values())
            print(name, rows[name]["verdict"], rows[name]["exit_code"], rows[name]["steps"], flush=True)
            write(rows, only)


def write(rows: dict, only: list[str]) -> None:
    res = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(), "load_average": os.getloadavg(), "size": SIZE,
           "families": rows,
           "bar": {"every_family_every_step_ok": all(r["every_step_ok"] for r in rows.values()),
                   "no_error_verdict": all(r["verdict"] not in (None, "ERROR") and r["exit_code"] in (0, 1, 3)
                                           for r in rows.values())}}
    (HERE / "bar-issue15-signoff.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["bar"]), flush=True)


if __name__ == "__main__":
    main()
