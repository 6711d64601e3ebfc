"""Ratios of serve_ab.sh's runs: output tok/s with the single-row path on over off, per round and tier.

    python measurements/2026-12-02/issue27/row-path/serve_ab_summary.py OUTDIR   # writes OUTDIR/summary.json
"""

import json
import re
import statistics
import sys
from pathlib import Path


def main(folder: Path) -> None:
    runs: dict[tuple[int, int], dict[str, float]] = {}
    for path in folder.glob("round*-c*-*.json"):
        r, c, side = re.fullmatch(r"round(\d+)-c(\d+)-(on|off)\.json", path.name).groups()
        tier = json.loads(path.read_text())["tiers"][0]["results"]["endpoint"]
        runs.setdefault((int(c), int(r)), {})[side] = tier["output_tok_per_s"]
    summary = {}
    for c in sorted({c for c, _ in runs}):
        rounds = [runs[(c, r)] for r in sorted(r for cc, r in runs if cc == c)]
        ratios = [x["on"] / x["off"] for x in rounds]
        summary[f"c={c}"] = {"off_tok_s": [x["off"] for x in rounds], "on_tok_s": [x["on"] for x in rounds],
                             "on_over_off": ratios, "median": statistics.median(ratios), "min": min(ratios),
                             "max": max(ratios)}
        print(f"c={c}: on/off median {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
