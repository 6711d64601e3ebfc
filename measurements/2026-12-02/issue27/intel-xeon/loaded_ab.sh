#!/bin/bash
# Batch-1 decode ms/step of the INT4 checkpoint beside N busy processes (`python -c "while True: pass"`), for three
# builds of the decode loop, rounds interleaved: `gomp` (kernels/cpu_decode.cpp and qtoolkit/model/decode_plan.py
# at OLD_REV: libgomp barriers, the full team always), `fixed` (this tree with QTOOLKIT_ADAPTIVE_TEAM=0: RowBarrier, the full team always) and
# `adaptive` (this tree: RowBarrier and RowTeam). Each run: one engine, 16 warm-up tokens, then 128 timed decode
# steps (the prefill step excluded); prints one JSON line per run.
# usage: loaded_ab.sh CHECKPOINT OLD_REV BUSY ROUNDS
set -u
ckpt=$1; old=$2; busy=$3; rounds=$4
cd "$(git rev-parse --show-toplevel)"
cp kernels/cpu_decode.cpp /tmp/loaded_ab_new.cpp
cp qtoolkit/model/decode_plan.py /tmp/loaded_ab_new.py
git show "$old:kernels/cpu_decode.cpp" > /tmp/loaded_ab_old.cpp
git show "$old:qtoolkit/model/decode_plan.py" > /tmp/loaded_ab_old.py
pids=()
for _ in $(seq "$busy"); do python -c "while True: pass" & pids+=($!); done
use() {  # old | new
  cp "/tmp/loaded_ab_$1.cpp" kernels/cpu_decode.cpp
  cp "/tmp/loaded_ab_$1.py" qtoolkit/model/decode_plan.py
}
trap 'kill ${pids[*]} 2>/dev/null; use new' EXIT
step() {  # variant
  (cd /tmp && python - "$ckpt" "$1" "$busy" <<'PY'
import json, sys, time
import torch
from qtoolkit.bench.decode import PROMPT
from qtoolkit.engine import Engine, EngineConfig, SamplingParams
ckpt, variant, busy = sys.argv[1:]
torch.set_num_threads(2)
engine = Engine(ckpt, EngineConfig(kv_cache_memory="256MiB"))
def decode(n):
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()
    t, k = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        k += 1
    return (time.perf_counter() - t) / k
decode(16)
ms = 1e3 * decode(128)
plan = engine.model.decode_plan.plan
print(json.dumps({"variant": variant, "busy": int(busy), "ms_per_step": round(ms, 3), "team_after": getattr(plan, "row_team", None)}))
PY
  )
}
for _ in $(seq "$rounds"); do
  use old; step gomp
  use new; QTOOLKIT_ADAPTIVE_TEAM=0 step fixed
  step adaptive
done
