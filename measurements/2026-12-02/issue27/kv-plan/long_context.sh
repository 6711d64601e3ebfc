#!/bin/bash
# Batch-1 decode of CHECKPOINT after a 2,000-token prompt (random token ids, fixed seed), 64 tokens, 2 threads, with
# the KV cache of each given dtype, one process each; the C++ layer loop's own timers split the step.
# usage: long_context.sh CHECKPOINT KV... (e.g. long_context.sh /tmp/lead-int4 auto fp8 int8)
cd "$(dirname "$0")" && cd "$(git rev-parse --show-toplevel)"
ckpt=$1; shift
for kv in "$@"; do
python - "$ckpt" "$kv" <<'PY' 2>/dev/null | tail -1
import statistics, sys, time
import torch
from qtoolkit.engine import Engine, SamplingParams
torch.set_num_threads(2)
kv = sys.argv[2]
e = Engine(sys.argv[1], kv_cache_memory="1GiB", kv_cache_dtype=kv)
ids = torch.randint(100, 40000, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
e.add_request("a", e.tokenizer.decode(ids), SamplingParams(max_tokens=64, ignore_eos=True))
e.step()
while e.model.decode_plan in (None, False):
    e.step()
plan = e.model.decode_plan
plan.plan.reset_times()
walls = []
while e.has_unfinished_requests():
    t = time.perf_counter(); e.step(); walls.append(time.perf_counter() - t)
g, a, o = plan.plan.times()
n = len(walls)
print(f"kv {kv}: {n} steps, median {1e3 * statistics.median(walls):.2f} ms/token; layer loop: GEMV {1e3 * g / n:.2f}, "
      f"attention {1e3 * a / n:.2f}, other {1e3 * o / n:.2f} ms/token; single-row path {plan.plan.row_path}")
PY
done
