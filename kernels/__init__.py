"""Dequant-matmul kernels (installed as qtoolkit.kernels).

scheme.py      compressed-tensors config group -> the facts the kernels need
reference.py   the one torch reference: quantize_weight (bit-exact with compressed-tensors) and dequantize
dispatch.py    the one dispatch point: CUDA -> Triton, CPU -> cpu.py
cpu.py         CPU paths: AVX2 GEMV kernels (cpu_kernels.cpp, built by cpu_build.py) or blocked dequant + sgemm
int4_matmul.py Triton INT4 (packed) / INT8 group-wise kernel;  fp8_matmul.py  Triton FP8 weight-only and FP8 x FP8
bench.py       `qtool bench kernels`;  gpu_bench.py + gpu_check.sh  the prepared GPU check
"""
