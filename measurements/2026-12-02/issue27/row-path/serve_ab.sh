#!/bin/bash
# bench serve with the decode plan's single-row path off (QTOOLKIT_ROW_PATH=0) and on: two servers of the same
# checkpoint side by side, runs alternating between them, at c=1 (16 requests: the row path's steps) and c=32
# (64 requests: batched steps). One unrecorded warm-up run per server first (its first requests pay one-time
# costs: TTFT ~0.4 s against ~0.03 s after). Then serve_ab_summary.py OUTDIR writes OUTDIR/summary.json
# (removed in 9b0c4e1; `git show 9b0c4e1^:measurements/2026-12-02/issue27/row-path/serve_ab_summary.py`).
# usage: serve_ab.sh CHECKPOINT OUTDIR ROUNDS
set -u
ckpt=$1; out=$2; rounds=${3:-3}
name=$(basename "$ckpt")
mkdir -p "$out"
QTOOLKIT_ROW_PATH=0 qtool serve --model "$ckpt" --port 8610 > "$out/server-off.log" 2>&1 &
off=$!
QTOOLKIT_ROW_PATH=1 qtool serve --model "$ckpt" --port 8611 > "$out/server-on.log" 2>&1 &
on=$!
trap 'kill $off $on 2>/dev/null' EXIT
for port in 8610 8611; do
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
done
bench() {  # port concurrency requests output
  qtool bench serve --base-url "http://127.0.0.1:$1" --model "$name" --max-concurrency "$2" --num-prompts "$3" \
    --workload mixed --seed 0 --rounds 1 --output "$4" -q
}
for port in 8610 8611; do bench $port 4 8 "$out/warmup-$port.json"; done
for r in $(seq "$rounds"); do
  for c in 1 32; do
    n=$([ $c = 1 ] && echo 16 || echo 64)
    bench 8610 $c $n "$out/round$r-c$c-off.json"
    bench 8611 $c $n "$out/round$r-c$c-on.json"
  done
done
