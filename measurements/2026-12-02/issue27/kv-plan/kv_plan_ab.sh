#!/bin/bash
# Batch-1 decode of CHECKPOINT over an fp32, FP8 and int8 KV cache, the C++ layer loop on (QTOOLKIT_FUSED_DECODE=1)
# and off (=0, the Python loop every quantized cache took before it joined the plan), PAIRS alternating pairs of
# `qtool bench decode` runs of 3 interleaved rounds at 2 threads; one JSON line a run and system.
# usage: kv_plan_ab.sh CHECKPOINT PAIRS OUT.jsonl
set -e
cd "$(dirname "$0")" && cd "$(git rev-parse --show-toplevel)"
: > "$3"
for i in $(seq "$2"); do
  for fused in 1 0; do
    QTOOLKIT_FUSED_DECODE=$fused qtool bench decode --model "$1" --kv-cache-dtype auto,fp8,int8 --rounds 3 \
      --threads 2 --no-breakdown --output /tmp/kv_plan_ab.json >/dev/null 2>&1
    python - "$fused" "$i" >> "$3" <<'PY'
import json, sys
for name, s in json.load(open("/tmp/kv_plan_ab.json"))["systems"].items():
    print(json.dumps({"fused": sys.argv[1] == "1", "pair": int(sys.argv[2]), "system": name,
                      "tok_s": round(s["decode_tok_per_s"], 2), "samples": [round(x, 2) for x in s["samples"]]}))
PY
  done
done
rm -f /tmp/kv_plan_ab.json
python - "$3" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for name in dict.fromkeys(r["system"] for r in rows):
    ratios = []
    for p in sorted({r["pair"] for r in rows}):
        on, off = ([r["tok_s"] for r in rows if r["system"] == name and r["pair"] == p and r["fused"] is f][0]
                   for f in (True, False))
        ratios.append(on / off)
    print(f"{name}: C++ loop / Python loop per pair " + ", ".join(f"{x:.2f}" for x in ratios)
          + f" (median {statistics.median(ratios):.2f}x)")
PY
