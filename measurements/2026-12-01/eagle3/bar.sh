#!/usr/bin/env bash
# The #17 bar: eagle3 / no speculation, output tok/s at concurrency 1 and 32, code and summarization, with a 95%
# interval over rounds of fresh requests (bench serve --rounds), for the default fp32 target and its INT4 checkpoint.
#   HEAD=/work/runs/eagle3-default INT4=/work/runs/int4-rtn bash measurements/2026-12-01/eagle3/bar.sh
set -euo pipefail
cd "$(dirname "$0")"
HEAD=${HEAD:?the qtool train-draft output folder} INT4=${INT4:?an int4-rtn checkpoint of the default model}
ROUNDS=${ROUNDS:-3}
for workload in code summarization; do
  qtool -q bench serve --model default --speculative "eagle3:$HEAD" --max-concurrency 1,32 \
    --workload "$workload" --rounds "$ROUNDS" --seed 0 --output "bench-fp32-$workload.json"
  qtool -q bench serve --model "$INT4" --speculative "eagle3:$HEAD" --max-concurrency 1 \
    --workload "$workload" --rounds "$ROUNDS" --seed 0 --output "bench-int4-$workload.json"
done
