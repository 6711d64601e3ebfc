#!/usr/bin/env bash
# GPU check for the Triton kernels, ready for a lent CUDA machine (H200/H100/A100): compiled-kernel tests, then
# the kernel benchmark; about 3-4 minutes on an H200 (autotuning included). Results go to $OUT (or ./gpu_check_out):
#   gpu_tests.xml/.log  pytest of tests/test_kernels_gpu.py (compiled kernels vs the shared reference)
#   gpu_bench.json      Triton INT4/FP8 vs bf16 cuBLAS per shape and batch, goals met or not
#   gpu_check.json      one-line summary: tests passed/failed, goals met
# Usage from the repo root:  bash kernels/gpu_check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
QUICK="${1:-}"

if ! "$PY" -c "import qtoolkit.kernels" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps -e . || { echo "cannot install qtoolkit" >&2; exit 2; }
fi
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))" \
  || { echo "needs torch with CUDA and triton" >&2; exit 2; }

export QTOOLKIT_QUIET=1 HF_HUB_OFFLINE=1
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -x tests/test_kernels_gpu.py \
  --junitxml "$OUT/gpu_tests.xml" 2>&1 | tail -n 30 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 200 "$PY" -m qtoolkit.kernels.gpu_bench --output "$OUT/gpu_bench.json" $QUICK 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}

"$PY" - "$OUT" "$tests_rc" "$bench_rc" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, tests_rc, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = {"tests_rc": tests_rc, "bench_rc": bench_rc}
try:
    root = ET.parse(out / "gpu_tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError):
    summary["tests"] = None
try:
    goals = json.loads((out / "gpu_bench.json").read_text())["goals"]
    summary["goals_met"] = {k: v["met"] for k, v in goals.items()}
except (OSError, KeyError, ValueError):
    summary["goals_met"] = None
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PYEOF
exit $(( tests_rc != 0 || bench_rc != 0 ))
