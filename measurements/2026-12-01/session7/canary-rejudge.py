"""The shipped int3-rtn-canary's measured step outputs (../signoff-int3-rtn-canary.report.json, measured before the
session-6 restructuring) judged again by the current tree's gates: `qtool signoff --rejudge` on a folder rebuilt
from that report (quality and memory step outputs; the bench is not rebuilt). It checks the judging code, not a fresh quantization or evaluation (the full canary sign-off
re-runs those). Observed outcomes -> canary-rejudge.json.

Run from the repository root: QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/session7/canary-rejudge.py
"""
import json
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
report = json.loads((HERE.parent / "signoff-int3-rtn-canary.report.json").read_text())
with tempfile.TemporaryDirectory(prefix="canary-rejudge-") as tmp:
    out = Path(tmp)
    (out / "checkpoint").mkdir()
    # the report keeps the bench only as a summary of another schema: the throughput gate goes without it
    steps = dict(report["steps"], bench={"status": "error", "error": "not rebuilt from the report"})
    (out / "steps.json").write_text(json.dumps(steps))
    (out / "eval.json").write_text(json.dumps({"tasks": report["eval"]}))
    (out / "diagnose.json").write_text(json.dumps(report["diagnose"]))
    (out / "checkpoint" / "quantize_report.json").write_text(json.dumps(report["quantize"]))
    p = subprocess.run(["qtool", "signoff", "--model", "default", "--recipe", "int3-rtn-canary", "--rejudge",
                        "--output", str(out)], capture_output=True, text=True, timeout=600)
    new = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
result = {"command": "qtool signoff --model default --recipe int3-rtn-canary --rejudge --output DIR",
          "exit_code": p.returncode, "stderr_tail": p.stderr.strip().splitlines()[-2:],
          "printed_verdict": next((x for x in p.stdout.splitlines() if "verdict:" in x), None),
          "verdict_then": report["verdict"], "verdict_now": new.get("verdict"),
          "failed_gates_now": [g["name"] for g in new.get("gates", []) if g.get("verdict") == "FAIL"],
          "failed_gates_then": [g["name"] for g in report["gates"] if g.get("verdict", "FAIL") == "FAIL"
                                and not g.get("passed")],
          "note": "exit 2, not 1, because the bench step is marked as an error here (not rebuilt): a sign-off with "
                  "a failed step is an error whatever its verdict",
          "gates_now": {g["name"]: g.get("verdict") for g in new.get("gates", [])}}
(HERE / "canary-rejudge.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
