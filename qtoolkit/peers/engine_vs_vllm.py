"""qtoolkit's engine against vLLM CPU on the same checkpoint, through the same client: `qtool serve` and vLLM's
OpenAI server both up, `qtool bench serve --base-url` sending each the same requests tier by tier, in interleaved
rounds with the order swapped every round; per tier, qtool serve ÷ vLLM for output tok/s, median TTFT and median
TPOT, each a geometric mean over rounds with its t interval (evals/stats/paired.ratio_over_rounds).

    python -m qtoolkit.peers.engine_vs_vllm --output cmp.json [--model default] [--dtype float32]
        [--concurrency 1,8,32] [--num-prompts 32] [--rounds 3] [--workload mixed]

vLLM is set up as its CPU docs say: its KV cache in VLLM_CPU_KVCACHE_SPACE, its OpenMP threads bound to the
machine's cores (VLLM_CPU_OMP_THREADS_BIND), no torch.compile on 2 cores (`--enforce-eager`: compiling costs
minutes a checkpoint and CUDA graphs do not exist on a CPU). qtool serve runs with its defaults. The servers
take turns: a tier runs on one server while the other waits idle.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from qtoolkit.evals.stats.paired import ratio_over_rounds
from tqdm import tqdm

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..io import write_json
from ..provenance import provenance
from ..server.process import server_process
from .client_agreement import qtool_bench
from .vllm_env import ensure_env, vllm_server

FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


@dataclass
class TierComparison:
    concurrency: int
    rounds: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: {s: {f: [] for f in FIGURES} for s in ("qtool", "vllm")})

    def ratios(self) -> dict[str, dict[str, Any]]:
        """figure -> qtool ÷ vLLM over the rounds (ratio_over_rounds: geometric mean, t interval)."""
        return {f: ratio_over_rounds(self.rounds["qtool"][f], self.rounds["vllm"][f]) for f in FIGURES}

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"ratios": self.ratios()}


def compare(model: str, dtype: str, concurrency: list[int], *, num_prompts: int, rounds: int, workload: str,
            seed: int, vllm_env: Path | None, vllm_dtype: str | None = None) -> list[TierComparison]:
    """`dtype` is qtool serve's; vLLM's is `vllm_dtype` where given (vLLM CPU runs 4-bit checkpoints only in
    bfloat16, while the engine's INT4 kernels take fp32 activations: each engine in its best dtype)."""
    env = ensure_env(vllm_env)
    tiers = {c: TierComparison(c) for c in concurrency}
    cores = f"0-{(os.cpu_count() or 1) - 1}"
    with tempfile.TemporaryDirectory() as tmp, \
            server_process(model, EngineConfig(dtype=dtype)) as ours, \
            vllm_server(env, model, dtype=vllm_dtype or dtype, served_model_name="vllm", max_model_len=4096,
                        omp_threads_bind=cores, extra_args=["--enforce-eager"]) as theirs:
        our_name = httpx.get(f"{ours}/v1/models", timeout=30).json()["data"][0]["id"]
        servers = {"qtool": (ours, our_name), "vllm": (theirs.url, "vllm")}
        with tqdm(total=rounds * 2, desc="engine vs vLLM", unit="run") as bar:
            for r in range(rounds):
                order = ("qtool", "vllm") if r % 2 == 0 else ("vllm", "qtool")
                for name in order:
                    url, served = servers[name]
                    got = qtool_bench(url, served, concurrency, workload=workload, num_prompts=num_prompts,
                                      seed=seed + r, out=Path(tmp) / f"{name}-{r}.json")
                    for c, result in got.items():
                        for f in FIGURES:
                            tiers[c].rounds[name][f].append(float(result[f]))
                    bar.update()
    return list(tiers.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qtoolkit.peers.engine_vs_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="qtool serve's (and vLLM's)")
    p.add_argument("--vllm-dtype", default=None, choices=["float32", "bfloat16"], help="vLLM's, where it differs")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workload", default="mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-env", type=Path, default=None)
    a = p.parse_args(argv)
    try:
        concurrency = sorted({int(x) for x in a.concurrency.split(",")})
    except ValueError:
        print(f"error: --concurrency {a.concurrency}: give comma-separated integers, e.g. 1,8,32", file=sys.stderr)
        return 2
    if concurrency[0] < 1 or a.num_prompts < 1 or a.rounds < 2:
        print("error: --concurrency and --num-prompts must be >= 1 and --rounds >= 2 (an interval needs two)",
              file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        tiers = compare(a.model, a.dtype, concurrency, num_prompts=a.num_prompts, rounds=a.rounds,
                        workload=a.workload, seed=a.seed, vllm_env=a.vllm_env, vllm_dtype=a.vllm_dtype)
    except (QToolError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_json(a.output, {"command": "python -m qtoolkit.peers.engine_vs_vllm " + " ".join(argv or sys.argv[1:]),
                          **provenance(model=a.model, dtype=a.dtype, vllm_dtype=a.vllm_dtype or a.dtype,
                                       workload=a.workload),
                          "seconds": round(time.monotonic() - start, 1), "quotient": "qtool serve / vLLM",
                          "tiers": [t.to_json() for t in tiers]})
    for t in tiers:
        ratios = t.ratios()
        print(f"c={t.concurrency}: " + ", ".join(
            f"{f} {ratios[f]['ratio']:.2f}x {[round(x, 2) for x in ratios[f]['ci95'] or []]}" for f in FIGURES)
            + " (qtool serve / vLLM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
