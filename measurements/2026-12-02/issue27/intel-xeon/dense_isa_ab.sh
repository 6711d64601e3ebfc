#!/bin/bash
# fp32 dense_gemv at M=1 on the default model's layer shapes (30 x qkv, o, gate_up, down), this tree's AVX2 rows
# (isa 0) against its AVX-512 rows (isa 1) in one process, 3 passes a round, rounds interleaved; GB/s of weights
# read. usage: dense_isa_ab.sh ROUNDS
cd "$(dirname "$0")" && cd "$(git rev-parse --show-toplevel)"
python - "$1" <<'PY'
"""dense_gemv M=1 on the default model's fp32 shapes, AVX2 vs AVX-512 rows of one build, interleaved."""
import statistics, sys, time
import torch
from qtoolkit.kernels.cpu_build import engine_ops
torch.set_num_threads(2)
ops = engine_ops()
torch.manual_seed(0)
ws = []
for _ in range(30):
    ws += [(torch.randn(960, 576), 576), (torch.randn(576, 576), 576), (torch.randn(3072, 576), 576), (torch.randn(576, 1536), 1536)]
nbytes = sum(w.numel() * 4 for w, _ in ws)
xs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
print("max abs diff", max((ops.dense_gemv(xs[k], w, 0) - ops.dense_gemv(xs[k], w, 1)).abs().max().item() for w, k in ws[:4]))
res = {0: [], 1: []}
for r in range(int(sys.argv[1])):
    for isa in (0, 1) if r % 2 == 0 else (1, 0):
        t = time.perf_counter()
        for _ in range(3):
            for w, k in ws:
                ops.dense_gemv(xs[k], w, isa)
        res[isa].append(3 * nbytes / (time.perf_counter() - t) / 1e9)
    print(r, {"avx2": round(res[0][-1], 1), "avx512": round(res[1][-1], 1)}, flush=True)
print("GB/s median avx2", round(statistics.median(res[0]), 1), "avx512", round(statistics.median(res[1]), 1),
      "ratio", round(statistics.median(b / a for a, b in zip(res[0], res[1])), 3))
PY
