"""GPU kernel benchmark (run by kernels/gpu_check.sh on a CUDA machine): Triton INT4/FP8 vs bf16 cuBLAS.

Per shape and batch: bf16 `F.linear` (cuBLAS), the Triton INT4 kernel (group 128 and 32), Triton FP8 weight-only
and FP8 x FP8 dynamic, and torch._scaled_mm FP8 as a peer. Times come from triton.testing.do_bench (CUDA events,
median, L2 flushed between calls), so the weights come from HBM as in decode. Goals from the issue:
INT4 >= 3x bf16 at M <= 16 on 4096-class layers, FP8 >= 1.8x.
"""

from __future__ import annotations

import argparse
import sys

import torch
from qtoolkit.kernels import scheme as S
from qtoolkit.kernels.dispatch import TRITON_DECODE_MAX_M
from qtoolkit.kernels.reference import quantize_activations, quantize_weight

from qtoolkit.io import write_json
from qtoolkit.provenance import provenance

SHAPES = {"4096x4096": (4096, 4096), "4096x11008": (11008, 4096), "11008x4096": (4096, 11008)}
MS = [1, 4, 16, 32, 256]


def _decode(x: torch.Tensor) -> bool:
    """The kernel config family the engine's dispatch picks for this batch."""
    return x.shape[0] <= TRITON_DECODE_MAX_M


def _paths(w: torch.Tensor):
    # the Triton kernels import triton (optional): only on a CUDA machine
    from qtoolkit.kernels.fp8_matmul import fp8_linear
    from qtoolkit.kernels.int4_matmul import int_linear

    dev = w.device
    wb = w.to(torch.bfloat16)
    paths = {"bf16 cublas": (lambda x: torch.nn.functional.linear(x, wb), wb.nbytes)}
    for g in (128, 32):
        t = {k: v.to(dev) for k, v in quantize_weight(w.float().cpu(), S.w4a16(g)).items()}
        p, s = t["weight_packed"], t["weight_scale"].float()
        paths[f"triton int4 g{g}"] = ((lambda x, p=p, s=s, g=g: int_linear(x, p, s, None, g, decode=_decode(x))),
                                      p.nbytes + s.nbytes)
    t8 = {k: v.to(dev) for k, v in quantize_weight(w.float().cpu(), S.fp8_dynamic()).items()}
    w8, s8 = t8["weight"], t8["weight_scale"].float()
    paths["triton fp8 weight-only"] = (lambda x: fp8_linear(x, w8, s8, decode=_decode(x)), w8.nbytes)

    def fp8_dynamic(x):
        xq, xs = quantize_activations(x, "float")
        return fp8_linear(xq, w8, s8, x_scale=xs, out_dtype=x.dtype, decode=_decode(x))

    paths["triton fp8 dynamic"] = (fp8_dynamic, w8.nbytes)
    w8t = w8.t()  # _scaled_mm wants the second operand column-major

    def scaled_mm(x):
        xq, xs = quantize_activations(x, "float")
        return torch._scaled_mm(xq, w8t, scale_a=xs, scale_b=s8.reshape(1, -1), out_dtype=x.dtype)

    paths["torch _scaled_mm fp8 dynamic"] = (scaled_mm, w8.nbytes)
    return paths


def check_correct(paths, x: torch.Tensor) -> dict[str, float]:
    ref = paths["bf16 cublas"][0](x).float()
    return {name: float((fn(x).float() - ref).norm() / ref.norm()) for name, (fn, _) in paths.items()}


def main(argv: list[str] | None = None) -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default="gpu_bench.json")
    ap.add_argument("--quick", action="store_true", help="4096x4096 and M in 1, 16 only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    shapes = {"4096x4096": SHAPES["4096x4096"]} if args.quick else SHAPES
    ms = [1, 16] if args.quick else MS
    rows, errors = [], {}
    torch.manual_seed(0)
    for label, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        paths = _paths(w)
        errors[label] = check_correct(paths, torch.randn(8, k, device="cuda", dtype=torch.bfloat16))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times = {}
            for name, (fn, nbytes) in paths.items():
                try:
                    times[name] = do_bench(lambda fn=fn, x=x: fn(x), warmup=25, rep=100)
                except Exception as e:  # a peer op missing on this GPU must not sink the run
                    print(f"{label} M={m} {name}: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                rows.append({"shape": label, "n": n, "k": k, "m": m, "path": name, "ms": times[name],
                             "weight_bytes": nbytes, "gbs": nbytes / times[name] / 1e6})
            base = times.get("bf16 cublas")
            for r in rows:
                if r["shape"] == label and r["m"] == m and base:
                    r["speedup_vs_bf16"] = base / r["ms"]
                    print(f"{label:<12}{m:>5}  {r['path']:<30}{r['ms'] * 1e3:>9.1f} us{r['gbs']:>8.0f} GB/s"
                          f"{r['speedup_vs_bf16']:>7.2f}x", flush=True)
    goals = {}
    for r in rows:
        if r["m"] <= 16 and r["path"] in ("triton int4 g128", "triton fp8 weight-only", "triton fp8 dynamic"):
            goal = 3.0 if "int4" in r["path"] else 1.8
            goals[f"{r['path']} {r['shape']} M={r['m']}"] = {"speedup": round(r["speedup_vs_bf16"], 2),
                                                             "goal": goal, "met": r["speedup_vs_bf16"] >= goal}
    write_json(args.output, {**provenance(command="gpu_bench", quick=args.quick),
                             "device": torch.cuda.get_device_name(0), "rows": rows,
                             "relative_error_vs_bf16": errors, "goals": goals})
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
