"""The KV cache layer (qtoolkit/bench/kv_layer.py, the one the sign-off runs) at c=32 on long prompts: the default
model with its fp32 cache and with the FP8 cache at one --kv-cache-memory where fp32 holds a quarter of the tier
(limiting_budget), each measurement its own server, rounds interleaved.

    python measurements/2026-12-02/issue30/kv_layer_c32.py OUT.json [ROUNDS] [REQUESTS] [MEAN_OUT] [MAX_OUT] [C] [BUDGET]

C (default 32) and BUDGET (a --kv-cache-memory; default limiting_budget) also give the batch-1 decode check at a
2k-token context: `... OUT.json 3 1 64 64 1 1GiB` (decode_ratio_rounds in the JSON).
"""

import json
import sys
from pathlib import Path

from qtoolkit.bench.kv_layer import bench_kv_layer
from qtoolkit.model.sources import resolve_model

out = Path(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
requests = int(sys.argv[3]) if len(sys.argv) > 3 else 32
mean_out = int(sys.argv[4]) if len(sys.argv) > 4 else 32
max_out = int(sys.argv[5]) if len(sys.argv) > 5 else 64
concurrency = int(sys.argv[6]) if len(sys.argv) > 6 else 32
budget = sys.argv[7] if len(sys.argv) > 7 else None
result = bench_kv_layer(resolve_model("default").path, "fp8", concurrency=concurrency, num_requests=requests,
                        mean_output_tokens=mean_out, max_output_tokens=max_out, workload="long", rounds=rounds,
                        kv_cache_memory=budget)
out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({**result["layer"], "decode_ratio_rounds": result["decode_ratio_rounds"]}, indent=2))
