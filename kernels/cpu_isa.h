// Which instruction sets the CPU extensions may use, decided at run time (never from the build machine): every
// extension is compiled for AVX2, and its AVX-512 functions carry their own target attribute and run only where
// these checks allow. One header for all of them, so the INT4/INT8/FP8 kernels (cpu_kernels.cpp) and the dense GEMV
// (cpu_engine_ops.cpp) follow one switch; cpu_decode.cpp includes it first, at file scope, before it includes the
// other two inside their namespaces.
#pragma once
#include <cpuid.h>
#include <strings.h>
#include <cstdlib>

// ATen's vector types at the build's level (AVX2): header-only math such as Vectorized<float>::exp_u20. Included
// here, at file scope, because cpu_decode.cpp includes the other sources inside namespaces.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/cpu/vec/vec.h>

namespace qtoolkit_isa {

// The OS saves the AVX-512 state (XCR0 opmask, ZMM_Hi256, Hi16_ZMM): a VM can hide it from a CPU that has it.
inline bool os_saves_zmm() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return false;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xE6) == 0xE6;
}

// ATEN_CPU_CAPABILITY=default|avx2 holds torch's own kernels to AVX2 or less; it holds these too.
inline bool capped_by_torch() {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  return cap && (strcasecmp(cap, "default") == 0 || strcasecmp(cap, "avx2") == 0);
}

// AVX-512 F (the fp32 GEMV's 16-lane FMAs): the CPU reports it, the OS saves its state, torch is not capped.
inline bool avx512f() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return !capped_by_torch() && __builtin_cpu_supports("avx512f") && os_saves_zmm();
  }();
  return ok;
}

// AVX-512 BW on top of F (the FP8 GEMV widens 32 E4M3 bytes to fp16 in one 512-bit register), same conditions.
inline bool avx512bw() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return avx512f() && __builtin_cpu_supports("avx512bw");
  }();
  return ok;
}

// AVX-512 VNNI with VL and BW (the INT4/INT8 kernels' vpdpbusd on 256-bit vectors), under the same conditions.
inline bool avx512_vnni() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return avx512f() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
  }();
  return ok;
}

}  // namespace qtoolkit_isa
