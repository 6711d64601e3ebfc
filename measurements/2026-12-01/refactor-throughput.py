"""Throughput before and after the session-6 restructuring (#19), in one run, interleaved.

Two source trees (a git worktree of the commit before, and the tree after) run the same commands one after the
other, alternating which goes first, over repeated rounds:
  - `qtool bench decode` (batch-1 greedy decode tok/s, the default fp32 model and the INT4 checkpoint);
  - `qtool bench serve` at concurrency 1 and 16 (output tok/s, mixed workload).
The ratio after / before of each round's figures is written with the median and min/max over rounds.

The two trees' built-in mixed workloads differ: #19 moved the summarization prompts onto the eval's question
(+23 characters, +69 prompt tokens over the c=16 tier's 16 requests). `--same-requests` serves both trees the same
requests instead: the `--after` tree's mixed workload (seed 0) written to a workload file (`--workload FILE`, which
both trees read the same way), so only the code differs.

    python measurements/2026-12-01/refactor-throughput.py --before /work/wt/before --after /work/main \
        --int4 /work/runs/int4-rtn --rounds 3 --output measurements/2026-12-01/refactor-throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path


def _run(tree: str, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        # each tree builds its engine ops into its own folder: a shared one is rebuilt on every switch of tree
        # (torch's build records the source path), and a lost build race falls back to the slow torch path
        ext = Path.home() / ".cache" / "qtoolkit" / f"torch_extensions-{Path(tree).resolve().name}"
        env = {**os.environ, "QTOOLKIT_SRC": tree, "QTOOLKIT_QUIET": "1", "QTOOLKIT_EXT_DIR": str(ext)}
        subprocess.run(["qtool", *args, "--output", str(out)], check=True, env=env)
        return json.loads(out.read_text())


def _decode(tree: str, models: list[str]) -> dict[str, float]:
    args = ["bench", "decode", "--tokens", "128", "--rounds", "1"]
    for m in models:
        args += ["--model", m]
    data = _run(tree, args)
    return {name: s["decode_tok_per_s"] for name, s in data["systems"].items()}


def _same_requests(tree: str, path: Path) -> str:
    """The tree's built-in mixed requests of both tiers (2 x 16) as a workload file; returns its path."""
    code = ("import json, sys; from qtoolkit.bench.workloads import build_workload; "
            "print('\\n'.join(json.dumps({'id': str(r.index), 'prompt': r.prompt, 'max_tokens': r.max_tokens}) "
            "for r in build_workload('mixed', 32, seed=0, mean_output_tokens=64, max_output_tokens=128)))")
    lines = subprocess.run(["python3", "-c", code], cwd=tree, env={**os.environ, "QTOOLKIT_SRC": tree}, check=True,
                           capture_output=True, text=True).stdout
    path.write_text(lines)
    return str(path)


def _serve(tree: str, workload: str = "mixed") -> dict[str, float]:
    data = _run(tree, ["bench", "serve", "--model", "default", "--max-concurrency", "1,16", "--num-prompts", "16",
                       "--workload", workload, "--seed", "0"])
    figures = {}
    for tier in data["tiers"]:
        for name, system in tier["results"].items():
            figures[f"serve c={tier['concurrency']} {name}"] = system["output_tok_per_s"]
    return figures


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--int4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-only", action="store_true", help="bench serve only (no bench decode, no --int4 needed)")
    p.add_argument("--same-requests", action="store_true",
                   help="serve both trees the --after tree's mixed requests (a workload file), not each its own")
    p.add_argument("--output", required=True)
    a = p.parse_args()
    trees = {"before": a.before, "after": a.after}
    samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    workload = "mixed"
    if a.same_requests:
        workload = _same_requests(a.after, Path(tempfile.mkdtemp()) / "refactor-throughput-requests.jsonl")
    for r in range(a.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for which in order:
            decode = {} if a.serve_only else _decode(trees[which], ["default", a.int4])
            figures = {**decode, **_serve(trees[which], workload)}
            for k, v in figures.items():
                samples[which].setdefault(k, []).append(v)
            print(r, which, {k: round(v, 1) for k, v in figures.items()}, flush=True)
    ratios = {}
    for k in samples["after"]:
        per_round = [x / y for x, y in zip(samples["after"][k], samples["before"][k], strict=True)]
        ratios[k] = {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round),
                     "per_round": per_round, "before": samples["before"][k], "after": samples["after"][k]}
    Path(a.output).write_text(json.dumps({"rounds": a.rounds, "trees": trees, "same_requests": a.same_requests,
                                          "after_over_before": ratios},
                                         indent=1))
    for k, v in ratios.items():
        print(f"{k}: after/before median {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f})")


if __name__ == "__main__":
    main()
