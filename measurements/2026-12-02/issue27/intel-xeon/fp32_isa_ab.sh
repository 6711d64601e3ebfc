#!/bin/bash
# fp32 batch-1 decode of the default model with the dense GEMV's AVX-512 rows (the default here) and with
# ATEN_CPU_CAPABILITY=avx2 (the AVX2 rows; torch's own kernels are held to AVX2 as well), PAIRS alternating pairs
# of `qtool bench decode` runs of 3 rounds each; one JSON line a run. usage: fp32_isa_ab.sh PAIRS OUT.jsonl
set -e
cd "$(dirname "$0")" && cd "$(git rev-parse --show-toplevel)"
: > "$2"
for i in $(seq "$1"); do
  for cap in avx512 avx2; do
    if [ "$cap" = avx2 ]; then export ATEN_CPU_CAPABILITY=avx2; else unset ATEN_CPU_CAPABILITY; fi
    qtool bench decode --model default --rounds 3 --threads 2 --output /tmp/fp32_isa_ab.json >/dev/null 2>&1
    python - "$cap" "$i" >> "$2" <<'PY'
import json, sys
s = json.load(open("/tmp/fp32_isa_ab.json"))["systems"]
(name, sysd), = s.items()
print(json.dumps({"isa": sys.argv[1], "pair": int(sys.argv[2]), "tok_s": round(sysd["decode_tok_per_s"], 2),
                  "roofline": sysd["roofline"]["median_fraction"], "fractions": sysd["roofline"]["fractions"]}))
PY
  done
done
unset ATEN_CPU_CAPABILITY
rm -f /tmp/fp32_isa_ab.json
