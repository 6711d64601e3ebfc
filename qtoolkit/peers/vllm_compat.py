"""Which of qtoolkit's checkpoints vLLM CPU serves, measured: for the default model and each shipped recipe's
checkpoint of it, does vLLM load and serve it, with which `--dtype` (float32 first, then bfloat16), and how its
greedy tokens agree with qtoolkit's engine (what `qtool generate` runs) on the same checkpoint and prompts.

    python -m qtoolkit.peers.vllm_compat --output compat.json [--recipes fp8-dynamic,int4-rtn] [--workdir DIR]

One vLLM server at a time; a refusal is vLLM's own line from its log, quoted.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from ..errors import QToolError
from ..io import write_json
from ..model.sources import resolve_model
from ..provenance import provenance
from ..quantize.recipe import list_recipes
from .vllm_env import VLLMEnv, VLLMError, ensure_env, refusal, vllm_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process by which",
           "Once upon a time, in a small village,", "The three laws of motion are", "import numpy as np\n",
           "To make a cup of tea, first", "The main causes of the French Revolution were"]
MAX_TOKENS = 16
DTYPES = ("float32", "bfloat16")
# whether vLLM loads and serves a checkpoint, and its greedy tokens, do not depend on torch.compile, which costs
# minutes per new checkpoint on 2 cores
EAGER = ["--enforce-eager"]


@dataclass
class Agreement:
    prompts: int
    equal: int  # prompts whose greedy tokens are equal over all MAX_TOKENS
    first_divergence: list[int | None]  # per prompt: the first token position that differs, None if none
    same_first_token: int


@dataclass
class CompatRow:
    checkpoint: str  # "default" or the recipe's name
    served: bool
    dtype: str | None = None  # the first --dtype vLLM served it with
    tried: dict[str, str] = field(default_factory=dict)  # dtype -> "served" or vLLM's refusal, quoted
    start_s: float | None = None
    agreement: Agreement | None = None
    engine_dtype: str | None = None


def _ours(folder: Path, dtype: str, ids: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of qtoolkit's engine (as `qtool generate` runs it) on the checkpoint, in vLLM's dtype."""
    from qtoolkit.engine import Engine, EngineConfig, SamplingParams  # start-up time: torch loads here

    engine = Engine(str(folder), EngineConfig(dtype=dtype))
    out = [o.token_ids for o in engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                                                  use_tqdm=False)]
    del engine
    gc.collect()
    return out


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> Agreement:
    firsts = []
    for a, b in zip(ours, theirs, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        firsts.append(diff if diff is not None or len(a) == len(b) else min(len(a), len(b)))
    return Agreement(len(ours), sum(a == b for a, b in zip(ours, theirs, strict=True)), firsts,
                     sum(bool(a) and bool(b) and a[0] == b[0] for a, b in zip(ours, theirs, strict=True)))


class _Refused(Exception):
    pass


def _complete(url: str, name: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True})
    try:
        return list(r.json()["choices"][0]["token_ids"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise _Refused(f"HTTP {r.status_code}: {r.text[:300]}") from None


def measure(env: VLLMEnv, name: str, folder: Path, log_dir: Path) -> CompatRow:
    row = CompatRow(name, served=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for dtype in DTYPES:
        start = time.monotonic()
        try:
            with vllm_server(env, folder, dtype=dtype, served_model_name=name, startup_timeout_s=900,
                             log_dir=log_dir, extra_args=EAGER) as server:
                row.start_s = round(time.monotonic() - start, 1)
                ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
                try:  # vLLM first: a refusal skips our engine
                    theirs = [_complete(server.url, name, p) for p in ids]
                except _Refused as e:  # its HTTP answer only says "see the stack trace": quote the log's reason
                    raise _Refused(f"{e}; its log: {refusal(server.log)}") from None
            ours = _ours(folder, dtype, ids)
        except VLLMError as e:
            row.tried[dtype] = str(e).split(": its log is")[0]
            continue
        except _Refused as e:  # loaded, but generating fails (a kernel missing for this dtype)
            row.tried[dtype] = f"loaded, but a completion failed: {e}"
            continue
        row.served, row.dtype, row.tried[dtype] = True, dtype, "served"
        row.agreement, row.engine_dtype = agreement(ours, theirs), dtype
        break
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qtoolkit.peers.vllm_compat", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--recipes", default=None, help="comma-separated (default: every shipped recipe)")
    p.add_argument("--workdir", type=Path, default=Path("runs/vllm-compat"), help="checkpoints, kept for reruns")
    p.add_argument("--env", type=Path, default=None, help="the vLLM venv (default $QTOOLKIT_VLLM_ENV or ./.venv-vllm)")
    a = p.parse_args(argv)
    from ..quantize.run import quantize  # start-up time: llm-compressor loads only here

    try:
        env = ensure_env(a.env)
        names = a.recipes.split(",") if a.recipes else list_recipes()
        # rows already in --output are kept: a rerun measures the rest
        rows = [CompatRow(**{**r, "agreement": Agreement(**r["agreement"]) if r.get("agreement") else None})
                for r in (json.loads(a.output.read_text()).get("rows", []) if a.output.is_file() else [])]
        for name in [n for n in ["default", *names] if n not in {r.checkpoint for r in rows}]:
            folder = resolve_model("default").path if name == "default" else a.workdir / name
            if name != "default" and not (folder / "quantize_report.json").is_file():
                quantize("default", name, folder, overwrite=True)
            print(f"vllm-compat: {name}", file=sys.stderr, flush=True)
            rows.append(measure(env, name, folder, a.workdir))
            write_json(a.output, {**provenance(vllm=env.versions), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                                  "vllm_args": EAGER,
                                  "rows": [asdict(r) for r in rows]})
        return 0
    except QToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
