"""`qtool diagnose`: where does time go on this machine? Prefill and decode measured apart, against a roofline.

Decode reads every weight once per step (plus the KV cache of each sequence), so at small batch it is bound by
memory bandwidth; prefill multiplies each weight by many tokens, so it is bound by compute. Both ceilings are
measured in the same run (a streaming read and a GEMM), and the engine's achieved tok/s is set against them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..bench.workloads import build_workload
from ..engine import Engine, EngineConfig, SamplingParams
from ..engine.model_runner import kv_bytes_per_block
from ..kernels.roofline import measure_bandwidth, measure_gemm_flops
from ..progress import bar, status
from ..provenance import provenance
from .batching_ceiling import batching_ceiling, step_time_curve
from .result import DecodeRow, DiagnoseResult, KVCapacity, MachineCeilings, ModelBytes, PrefillRow, Roofline


def _leaf_linear_bytes(mod: torch.nn.Module) -> int | None:
    """Bytes one of the engine's Linears (model/quant_linear.py) streams per step: packed weights of a quantized
    module, else its dense weight; None for every other module and for containers of Linears."""
    if hasattr(mod, "weight_bytes") and not any(hasattr(c, "weight_bytes") for c in mod.children()):
        return mod.weight_bytes()
    return None


def model_bytes(model: torch.nn.Module) -> ModelBytes:
    """Bytes a decode step streams: every Linear's weights + the lm_head (the embedding lookup is a gather)."""
    linear = head = 0
    for name, mod in model.named_modules():
        size = _leaf_linear_bytes(mod)
        if size is None:
            continue
        if name.endswith("lm_head"):
            head += size
        else:
            linear += size
    c = model.config  # matmul weights per token from the shapes (quantized weights are buffers, not parameters)
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * \
        c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return ModelBytes(linear, head, linear + head, c.num_layers * per_layer + c.vocab_size * c.hidden_size)


def _timed_generate(engine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    engine.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t


def prefill_sweep(engine, lengths: list[int], vocab: int) -> list[PrefillRow]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in bar(lengths, desc="prefill sweep", unit="len"):
        prompt = torch.randint(100, vocab - 1, (n,), generator=g).tolist()
        _timed_generate(engine, [prompt], 1)  # warm-up (and fills no prefix cache: prompts differ below)
        prompt = torch.randint(100, vocab - 1, (n,), generator=g).tolist()
        t = _timed_generate(engine, [prompt], 1)
        rows.append(PrefillRow(n, round(t, 4), round(n / t, 1)))
    return rows


def decode_sweep(engine, batches: list[int], vocab: int, new_tokens: int = 32,
                 prompt_tokens: int = 32) -> list[DecodeRow]:
    """Decode tok/s per batch size: (full run - prefill-only run) isolates the decode steps."""
    rows = []
    g = torch.Generator().manual_seed(1)
    for b in bar(batches, desc="decode sweep", unit="batch"):
        def prompts(b: int = b) -> list[list[int]]:
            return [torch.randint(100, vocab - 1, (prompt_tokens,), generator=g).tolist() for _ in range(b)]

        _timed_generate(engine, prompts(), 4)  # warm-up
        t_prefill = _timed_generate(engine, prompts(), 1)
        t_full = _timed_generate(engine, prompts(), new_tokens + 1)
        t_decode = max(t_full - t_prefill, 1e-9)
        rows.append(DecodeRow(b, round(t_decode, 4), round(b * new_tokens / t_decode, 1),
                              round(1000 * t_decode / new_tokens, 2)))
    return rows


def roofline(sizes: ModelBytes, kv_per_token: int, bandwidth_gbs: float, gflops: float,
             batch: int, context: int) -> Roofline:
    """Attainable tok/s: decode = min(bytes bound, flops bound); prefill = flops bound."""
    flops_per_token = 2 * sizes.matmul_weights
    step_bytes = sizes.decode_bytes_per_step + batch * context * kv_per_token
    memory_bound = batch * bandwidth_gbs * 1e9 / step_bytes
    compute_bound = gflops * 1e9 / flops_per_token
    return Roofline(round(memory_bound, 1), round(compute_bound, 1), round(min(memory_bound, compute_bound), 1))


def classify(decode: list[DecodeRow], roof: dict[int, Roofline], kv: KVCapacity, sizes: ModelBytes,
             ceiling: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """Name the bottleneck and the order of levers, from the measured figures."""
    dec = {r.batch: r for r in decode}
    b1, bmax = dec[min(dec)], dec[max(dec)]
    scaling = bmax.tokens_per_s / b1.tokens_per_s
    levers: list[str] = []
    if kv.max_concurrent_at_context < max(dec):
        bottleneck = "KV-memory"
        levers.append(f"KV cache holds only {kv.max_concurrent_at_context} sequences of {kv.context} tokens: "
                      "raise --kv-cache-memory or quantize the KV cache before anything else")
    elif roof[1].decode_memory_bound_tok_s < roof[1].compute_bound_tok_s:
        bottleneck = "decode-memory"
    else:
        bottleneck = "prefill-compute"
    lever = (f"continuous batching: aggregate decode grows {scaling:.1f}x from batch {min(dec)} to {max(dec)} "
             "(weights are read once per step for the whole batch)")
    if by_concurrency := (ceiling or {}).get("by_concurrency"):
        top = by_concurrency[-1]
        lever += (f"; replayed on these step times, the {ceiling['workload']} workload's output "
                  f"lengths bound continuous / static at {top['continuous_over_static']:.2f}x at concurrency "
                  f"{top['concurrency']}")
    levers.append(lever)
    levers.append(f"weight quantization: a decode step streams {sizes.decode_bytes_per_step / 1e6:.0f} MB;"
                  " INT4 cuts the linear part ~3.5x, which lifts the batch-1 memory roofline")
    levers.append("speculative decoding at low concurrency: it turns memory-bound single-token steps into "
                  "multi-token verification; it fades as the batch fills the compute")
    if bottleneck == "prefill-compute":
        levers.reverse()
    return bottleneck, levers


def continuous_batching_ceiling(decode: list[DecodeRow], workload: str = "mixed", mean_output_tokens: int = 64,
                                max_output_tokens: int = 128, waves: int = 8) -> dict[str, Any]:
    """Upper bound of continuous / static output tok/s per measured batch size, for `qtool bench serve`'s
    default workload (its lengths replayed on the measured step times; see batching_ceiling)."""
    step = step_time_curve([(r.batch, r.ms_per_step / 1000) for r in decode])
    rows = []
    for c in sorted({r.batch for r in decode if r.batch > 1}):
        lengths = [r.max_tokens for r in build_workload(workload, waves * c, seed=0, mean_output_tokens=mean_output_tokens,
                                                        max_output_tokens=max_output_tokens)]
        rows.append({"concurrency": c, "continuous_over_static": round(batching_ceiling(lengths, c, step), 3)})
    return {"workload": workload, "mean_output_tokens": mean_output_tokens, "max_output_tokens": max_output_tokens,
            "requests_per_concurrency": f"{waves} x concurrency", "by_concurrency": rows}


def diagnose(model: str = "default", *, kv_cache_memory: str = "1GiB", dtype: str = "auto",
             batches: tuple[int, ...] = (1, 4, 16, 32), prompt_lengths: tuple[int, ...] = (64, 256, 1024),
             context: int = 1024, new_tokens: int = 32) -> DiagnoseResult:
    status("measuring memory bandwidth and GEMM throughput")
    bandwidth = measure_bandwidth()
    gflops = measure_gemm_flops()
    engine = Engine(model, EngineConfig(kv_cache_memory=kv_cache_memory, dtype=dtype, enable_prefix_caching=False,
                                        max_num_seqs=max(batches),
                                        max_num_batched_tokens=max(max(prompt_lengths), 1024)))
    vocab = engine.model.config.vocab_size
    sizes = model_bytes(engine.model)
    kv_per_token = kv_bytes_per_block(engine.model, 1)
    blocks, block_size = len(engine.block_manager.blocks), engine.block_manager.block_size
    kv = KVCapacity(kv_per_token, blocks, block_size, context, blocks * block_size // context)
    prefill = prefill_sweep(engine, [n for n in prompt_lengths if n < engine.max_model_len], vocab)
    decode = decode_sweep(engine, list(batches), vocab, new_tokens=new_tokens)
    roof = {b: roofline(sizes, kv_per_token, bandwidth, gflops, b, 64) for b in batches}
    prefill_roof = round(gflops * 1e9 / (2 * sizes.matmul_weights), 1)
    for row in decode:
        row.fraction_of_roofline = round(row.tokens_per_s / roof[row.batch].decode_attainable_tok_s, 3)
    for p in prefill:
        p.fraction_of_roofline = round(p.tokens_per_s / prefill_roof, 3)
    ceiling = continuous_batching_ceiling(decode)
    bottleneck, levers = classify(decode, roof, kv, sizes, ceiling)
    return DiagnoseResult(
        provenance(model=engine.source.describe(), kv_cache_memory=kv_cache_memory, dtype=dtype),
        MachineCeilings(round(bandwidth, 2), round(gflops, 1)), sizes, kv, prefill, decode, roof, prefill_roof,
        ceiling, bottleneck, levers)


def format_summary(r: DiagnoseResult) -> str:
    lines = [f"memory bandwidth {r.machine_ceilings.memory_bandwidth_gb_s} GB/s, "
             f"fp32 GEMM {r.machine_ceilings.fp32_gemm_gflop_s} GFLOP/s; "
             f"decode streams {r.model.decode_bytes_per_step / 1e6:.0f} MB/step"]
    lines += [f"prefill {p.prompt_tokens:>5} tok: {p.tokens_per_s:>8} tok/s "
              f"({100 * p.fraction_of_roofline:.0f}% of compute roofline)" for p in r.prefill]
    lines += [f"decode batch {d.batch:>3}: {d.tokens_per_s:>8} tok/s, {d.ms_per_step} ms/step "
              f"({100 * d.fraction_of_roofline:.0f}% of roofline)" for d in r.decode]
    lines += [f"continuous / static ceiling at concurrency {x['concurrency']:>3}: {x['continuous_over_static']:.2f}x "
              f"({r.batching_ceiling['workload']} workload, decode only)"
              for x in r.batching_ceiling.get("by_concurrency", [])]
    lines.append(f"bottleneck: {r.bottleneck}")
    lines += [f"  {i}. {lever}" for i, lever in enumerate(r.levers, 1)]
    return "\n".join(lines)
