#!/bin/bash
# fp32 dense_gemv at M=1 on the default model's layer shapes (30 x qkv, o, gate_up, down), gemv_row without
# (old: kernels/cpu_engine_ops.cpp at OLD_REV) and with the 8 KiB prefetch (new: this tree), both built in one
# process, 3 passes a round, rounds interleaved; GB/s of weights read. usage: dense_prefetch.sh OLD_REV ROUNDS
cd "$(dirname "$0")" && cd "$(git rev-parse --show-toplevel)"
git show "$1:kernels/cpu_engine_ops.cpp" > /tmp/ops_old.cpp
cp kernels/cpu_engine_ops.cpp /tmp/ops_new.cpp
rm -rf /tmp/build_ops_old /tmp/build_ops_new
python - "$2" <<'PY'
"""dense_gemv M=1 on the default model's shapes (fp32), old vs new gemv_row built side by side, interleaved."""
import sys, time, statistics, torch
from torch.utils.cpp_extension import load
from qtoolkit.kernels.cpu_build import FLAGS
torch.set_num_threads(2)
mods = {v: load(name=f"ops_{v}", sources=[f"/tmp/ops_{v}.cpp"], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                build_directory=f"/tmp/build_ops_{v}" if __import__("os").makedirs(f"/tmp/build_ops_{v}", exist_ok=True) is None else None)
        for v in ("old", "new")}
torch.manual_seed(0)
# a decode step's dense weights: 30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536
ws = []
for _ in range(30):
    ws += [(torch.randn(960, 576), 576), (torch.randn(576, 576), 576), (torch.randn(3072, 576), 576), (torch.randn(576, 1536), 1536)]
nbytes = sum(w.numel() * 4 for w, _ in ws)
xs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
y_old = [mods["old"].dense_gemv(xs[k], w) for w, k in ws[:4]]
y_new = [mods["new"].dense_gemv(xs[k], w) for w, k in ws[:4]]
print("max abs diff", max((a - b).abs().max().item() for a, b in zip(y_old, y_new)))
res = {"old": [], "new": []}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for v in ("old", "new"):
        m = mods[v]
        t = time.perf_counter()
        for _ in range(3):
            for w, k in ws:
                m.dense_gemv(xs[k], w)
        res[v].append(3 * nbytes / (time.perf_counter() - t) / 1e9)
    print(r, {v: round(res[v][-1], 1) for v in res}, flush=True)
print("GB/s median old", round(statistics.median(res["old"]), 1), "new", round(statistics.median(res["new"]), 1))
PY
