"""Kernel benchmark: every matmul path on the same shapes, interleaved, weights streamed from DRAM.

Each path owns enough copies of its weight that one pass over them exceeds the last-level cache several times,
and each call uses the next copy, so the figures are DRAM-bound like a real decode step, not cache-hot.
Paths are timed round-robin (one batch of calls per path per round) so load from other processes hits them
alike; per path we keep the best and the median round. Ratios come from the best rounds of the same run.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qtoolkit.model.quant_linear import DenseLinear, make_linear

from . import scheme as S
from .reference import quantize_weight
from .roofline import measure_bandwidth

# Default model (SmolLM2-135M) linears as the engine runs them (q/k/v and gate/up fused), then 7B-class layers.
MODEL_SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
                "down 576x1536": (576, 1536)}
LARGE_SHAPES = {"4096x4096": (4096, 4096), "4096x11008": (11008, 4096)}
STREAM_BYTES = 128 << 20  # per path: 4x a 32 MiB L3 (the AVX2 EPYC's), so every pass reads from DRAM


@dataclass
class Path:
    name: str
    build: Callable[[torch.Tensor], torch.nn.Module | Callable]  # weight -> callable(x)
    act_dtype: torch.dtype = torch.float32
    copies: list = field(default_factory=list)
    bytes_per_call: int = 0


def _module_bytes(mod) -> int:
    if hasattr(mod, "weight_bytes"):
        return mod.weight_bytes()
    return sum(t.nbytes for t in getattr(mod, "tensors", ()))


class _AtenInt4:
    """torch's own CPU INT4 path (`_weight_int4pack_mm_for_cpu`, bf16 activations) as a peer, group 32."""

    def __init__(self, w: torch.Tensor, group: int = 32):
        n, k = w.shape
        g = w.reshape(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.clamp(torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)), 0, 15).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k), 1)
        zero = lo + 8 * scale  # aten dequantizes (q - 8) * scale + zero
        self.sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.group = group
        self.tensors = (self.packed, self.sz)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.sz)


def default_paths() -> list[Path]:
    def quant(group: dict):
        return lambda w: make_linear(quantize_weight(w, group), group)

    return [
        Path("dense fp32", lambda w: DenseLinear(w)),
        Path("dense bf16", lambda w: DenseLinear(w.to(torch.bfloat16)), torch.bfloat16),
        Path("int4 g32 (qtoolkit)", quant(S.w4a16(32))),
        Path("int4 g32 aten int4pack", _AtenInt4, torch.bfloat16),
        Path("int8 channel (qtoolkit)", quant(S.config_group("pack-quantized", num_bits=8, strategy="channel"))),
        Path("fp8 channel (qtoolkit)", quant(S.fp8_weight_only())),
    ]


def _time_calls(fn, copies: list, x: torch.Tensor, calls: int, start: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn(copies[(start + i) % len(copies)], x)
    return (time.perf_counter() - t0) / calls


def bench_shape(n: int, k: int, ms: list[int], paths: list[Path], rounds: int, min_round_s: float,
                progress=None) -> list[dict]:
    torch.manual_seed(0)
    base = torch.randn(n, k) * 0.02
    for p in paths:
        first = p.build(base)
        p.bytes_per_call = _module_bytes(first)
        count = max(1, math.ceil(STREAM_BYTES / max(p.bytes_per_call, 1)))
        # copies share no storage, so every call reads fresh weight bytes from DRAM
        p.copies = [first] + [copy.deepcopy(first) for _ in range(1, count)]
    rows = []
    for m in ms:
        xs = {p.name: torch.randn(m, k).to(p.act_dtype) for p in paths}
        calls = {}
        for p in paths:  # warm up, and size each path's batch of calls to ~min_round_s
            t = _time_calls(lambda mod, x: mod(x), p.copies, xs[p.name], 2, 0)
            calls[p.name] = max(1, min(len(p.copies) * 4, int(min_round_s / max(t, 1e-6))))
        times: dict[str, list[float]] = {p.name: [] for p in paths}
        for r in range(rounds):
            for p in paths:
                times[p.name].append(_time_calls(lambda mod, x: mod(x), p.copies, xs[p.name], calls[p.name],
                                                 r * calls[p.name]))
        for p in paths:
            best, med = min(times[p.name]), statistics.median(times[p.name])
            rows.append({"n": n, "k": k, "m": m, "path": p.name, "ms_best": best * 1e3, "ms_median": med * 1e3,
                         "weight_bytes": p.bytes_per_call, "gbs": p.bytes_per_call / best / 1e9,
                         "calls_per_round": calls[p.name], "rounds": rounds, "copies": len(p.copies)})
        if progress is not None:
            progress.update(1)
    for p in paths:
        p.copies = []
    return rows


def add_ratios(rows: list[dict], bandwidth_gbs: float) -> None:
    by_key = {(r["n"], r["k"], r["m"], r["path"]): r for r in rows}
    for r in rows:
        fp32 = by_key.get((r["n"], r["k"], r["m"], "dense fp32"))
        bf16 = by_key.get((r["n"], r["k"], r["m"], "dense bf16"))
        r["speedup_vs_fp32"] = fp32["ms_best"] / r["ms_best"] if fp32 else None
        r["speedup_vs_bf16"] = bf16["ms_best"] / r["ms_best"] if bf16 else None
        r["bandwidth_fraction"] = r["gbs"] / bandwidth_gbs


def run_benchmark(quick: bool = False, threads: int | None = None, progress_factory=None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    shapes = {**MODEL_SHAPES, **LARGE_SHAPES}
    decode_ms = [1, 8] if quick else [1, 4, 8, 16]
    prefill_ms = [] if quick else [256]
    rounds = 3 if quick else 5
    paths = default_paths()
    bandwidth = measure_bandwidth()
    total = len(shapes) * (len(decode_ms) + len(prefill_ms))
    bar = progress_factory(total=total, desc="bench kernels") if progress_factory else None
    rows = []
    for label, (n, k) in shapes.items():
        part = bench_shape(n, k, decode_ms, paths, rounds, 0.05 if quick else 0.08, bar)
        if prefill_ms:  # prefill is compute-bound and slow in fp32: fewer rounds
            part += bench_shape(n, k, prefill_ms, paths, 3, 0.05, bar)
        for r in part:
            r["shape"] = label
        rows += part
    if bar is not None:
        bar.close()
    bandwidth_after = measure_bandwidth()
    add_ratios(rows, max(bandwidth, bandwidth_after))
    return {"bandwidth_gbs": max(bandwidth, bandwidth_after), "bandwidth_gbs_before_after": [bandwidth,
            bandwidth_after], "threads": torch.get_num_threads(), "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    """The issue's acceptance figures: INT4 vs dense fp32 at M <= 8 on the 7B-class shapes."""
    out = {}
    for r in rows:
        if r["path"] == "int4 g32 (qtoolkit)" and r["shape"] in LARGE_SHAPES and r["m"] <= 8:
            out[f"int4 {r['shape']} M={r['m']}"] = {
                "speedup_vs_fp32": round(r["speedup_vs_fp32"], 2), "speedup_vs_bf16": round(r["speedup_vs_bf16"], 2),
                "gbs": round(r["gbs"], 2), "bandwidth_fraction": round(r["bandwidth_fraction"], 3)}
    return out


def format_table(result: dict) -> str:
    lines = [f"memory bandwidth (torch.sum, 512 MB): {result['bandwidth_gbs']:.1f} GB/s; "
             f"threads: {result['threads']}; times are best-of-rounds per call",
             f"{'shape':<18}{'M':>4}  {'path':<26}{'ms':>9}{'GB/s':>8}{'%bw':>6}{'x fp32':>8}{'x bf16':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['shape']:<18}{r['m']:>4}  {r['path']:<26}{r['ms_best']:>9.3f}{r['gbs']:>8.1f}"
                     f"{100 * r['bandwidth_fraction']:>5.0f}%{r['speedup_vs_fp32']:>8.2f}{r['speedup_vs_bf16']:>8.2f}")
    return "\n".join(lines)
