"""Capacity, throughput and long-context decode speed of the quantized KV cache against the unquantized one, on the
default model, written to JSON (see README.md beside this file for the command).

capacity: one fixed --kv-cache-memory, 32 distinct long prompts (ACLSum documents cut to --prompt-tokens) sent at
once (c=32) with --max-tokens each; per cache dtype: the tokens the cache holds, the most tokens and sequences
resident at once, preemptions, and output tokens per second. Rounds alternate the dtypes.
decode: batch 1, a --context-tokens prompt, then --decode-tokens greedy tokens; the decode rate is taken from the
first sampled token to the last (prefill excluded). Rounds alternate the dtypes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from qtoolkit.evals.perplexity import summarization_texts

from qtoolkit.engine import Engine, EngineConfig, SamplingParams

DTYPES = ("auto", "fp8")


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    docs = [text for _, text in summarization_texts()]
    out = []
    for i in range(n):  # document i, then the next ones until the prompt is long enough: every prompt distinct
        ids: list[int] = []
        j = i
        while len(ids) < length:
            ids += tokenizer(docs[j % len(docs)] + "\n\n").input_ids
            j += 1
        out.append(ids[:length])
    return out


def capacity_round(engine: Engine, batch: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()
    for j, ids in enumerate(batch):
        engine.add_request(f"cap-{time.monotonic_ns()}-{j}", ids, params)
    peak_tokens = peak_running = generated = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        st = engine.stats()
        peak_tokens = max(peak_tokens, st.kv_blocks_used * st.block_size)
        peak_running = max(peak_running, st.num_running)
    elapsed = time.perf_counter() - started
    after = engine.stats()
    generated = after.generation_tokens - before.generation_tokens
    return {"seconds": elapsed, "output_tokens": generated, "output_tok_per_s": generated / elapsed,
            "peak_kv_tokens_in_use": peak_tokens, "peak_running": peak_running,
            "preemptions": after.num_preemptions - before.num_preemptions}


def decode_round(engine: Engine, ids: list[int], n: int) -> dict:
    engine.add_request(f"dec-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=n, ignore_eos=True))
    first = last = None
    count = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.token_ids and first is None:
                first, count = time.perf_counter(), len(out.token_ids)
            elif out.token_ids:
                last, count = time.perf_counter(), len(out.token_ids)
    return {"decode_tokens": count - 1, "decode_seconds": last - first, "decode_tok_per_s": (count - 1) / (last - first)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-cache-memory", default="180MiB")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip", choices=["capacity", "decode"], default=None, help="leave one measurement out")
    p.add_argument("--output", required=True)
    args = p.parse_args()
    engines = {kv: Engine("default", EngineConfig(kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=kv,
                                                  max_num_seqs=args.concurrency, enable_prefix_caching=False))
               for kv in DTYPES}
    tok = engines["auto"].tokenizer
    batch = prompts(tok, args.concurrency, args.prompt_tokens)
    context = prompts(tok, 1, args.context_tokens)[0] if args.skip != "decode" else None
    result = {"model": "default", "settings": vars(args), "dtypes": {}}
    for kv, engine in engines.items():
        st = engine.stats()
        result["dtypes"][kv] = {"kv_capacity_tokens": st.kv_capacity_tokens, "kv_bytes_per_token":
                                st.kv_bytes_per_token, "capacity_rounds": [], "decode_rounds": []}
    for r in range(args.rounds):
        order = DTYPES if r % 2 == 0 else DTYPES[::-1]
        for kv in order if args.skip != "capacity" else ():
            result["dtypes"][kv]["capacity_rounds"].append(capacity_round(engines[kv], batch, args.max_tokens))
            print(kv, "capacity", result["dtypes"][kv]["capacity_rounds"][-1], flush=True)
        if context is not None:
            for kv in order:
                result["dtypes"][kv]["decode_rounds"].append(decode_round(engines[kv], context, args.decode_tokens))
                print(kv, "decode", result["dtypes"][kv]["decode_rounds"][-1], flush=True)
    auto, fp8 = result["dtypes"]["auto"], result["dtypes"]["fp8"]

    def ratios(key: str, rounds: str) -> list[float]:
        return [b[key] / a[key] for a, b in zip(auto[rounds], fp8[rounds], strict=True)]

    result["fp8_over_auto"] = {
        "kv_capacity_tokens": fp8["kv_capacity_tokens"] / auto["kv_capacity_tokens"],
        "peak_kv_tokens_in_use": ratios("peak_kv_tokens_in_use", "capacity_rounds"),
        "peak_running": ratios("peak_running", "capacity_rounds"),
        "output_tok_per_s": ratios("output_tok_per_s", "capacity_rounds"),
        "decode_tok_per_s_2k_context": ratios("decode_tok_per_s", "decode_rounds") if context else [],
    }
    result["fp8_over_auto"]["median"] = {k: statistics.median(v) for k, v in result["fp8_over_auto"].items()
                                         if isinstance(v, list) and v}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["fp8_over_auto"], indent=2))


if __name__ == "__main__":
    main()
