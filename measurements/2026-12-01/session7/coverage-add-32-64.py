"""Add the main job's looks of 32 and 64 items (8 doubled up to --max-items 64) to the shipped coverage table.

    cd WORKTREE && QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/session7/coverage-add-32-64.py

Every cell of the harness is seeded by (seed, n, scenario) alone, so running only the new sizes and merging them
into measurements/2026-12-01/ci-coverage.json gives what the full command (evals/stats/coverage.py, whose ITEM_SIZES
now hold 32 and 64) writes; the table module is then regenerated from the merged results. Without these rows the
sign-off read 32 and 64 items from the 24 and 40 rows, which assumes coverage only grows with n: false for the
paired binary interval (Newcombe 0.952 at 40, 0.929 at 64 in session7/bar-issue20.json).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from qtoolkit.evals.stats import coverage  # noqa: E402

NEW = (32, 64)
FULL = ROOT / "measurements/2026-12-01/ci-coverage.json"
TABLE = ROOT / "evals/stats/ci_coverage_table.py"


def main() -> int:
    data = json.loads(FULL.read_text())
    assert set(NEW) <= set(coverage.ITEM_SIZES)
    names = [s.name for s in coverage.SCENARIOS if s.shape != "rounds"]
    t0 = time.time()
    new = coverage.run(data["runs"], data["resamples"], data["seed"], names=names, item_sizes=NEW)
    for name, res in new.items():
        cells = {**data["scenarios"][name]["n"], **res["n"]}
        data["scenarios"][name]["n"] = {k: cells[k] for k in sorted(cells, key=int)}
    data["table"] = coverage.table(data["scenarios"])
    data["seconds_added_sizes"] = {"sizes": list(NEW), "seconds": round(time.time() - t0, 1)}
    FULL.write_text(json.dumps(data, indent=1) + "\n")
    coverage.write_table(TABLE, data["table"], data["command"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
