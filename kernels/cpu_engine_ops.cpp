// AVX2 ops for the engine's CPU step, built once by kernels/cpu_build.py (like cpu_kernels.cpp).
//
// A decode step of a 135M model moves little data per op, so torch's per-op cost and its copies dominate:
//  - paged_attention: decode/verify rows attend straight over the paged KV cache through the block table (a
//    sliding window reads only the blocks inside it). The torch path gathered every sequence's blocks into a
//    padded copy per layer per step (at batch 32 that copy and the masked SDPA over it cost a third of the step).
//  - add_rms_norm: residual add + RMSNorm in one pass (six torch ops and two temporaries otherwise).
//  - rope_and_cache: RoPE on q and k plus the KV-cache write (about a dozen torch ops per layer otherwise);
//    rope_and_cache_quant writes a quantized cache (FP8 E4M3 bytes or int8, a scale per token and KV head),
//    which paged_attention reads as it is.
//  - silu_mul: SwiGLU's split, silu and product in one pass.
//  - dense_gemv: x[M, K] @ w[N, K]^T for small M, fp32 or bf16 weights, reading each weight row once for all M
//    rows; MKL's fp32 GEMV reaches about half the DRAM bandwidth on this CPU.
// Activations are fp32 or bf16, the KV cache that or FP8/int8 with scales; every sum is kept in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 is the top half of an fp32: widen and shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

// A quantized KV cache holds FP8 E4M3 bytes (as uint8_t) or int8 values; the scale is applied by the caller.
// E4M3 normals become fp32 by moving the exponent/mantissa bits into place and rebiasing the exponent (7 -> 127);
// subnormals (exponent 0) are m * 2^-9, built from the integer so no fp32 denormal (a slow assist) is ever made.
inline __m256 load8(const uint8_t* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f));
  const __m256 r = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  return _mm256_or_ps(r, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float to_f(uint8_t v) { return static_cast<float>(c10::Float8_e4m3fn(v, c10::Float8_e4m3fn::from_bits())); }
inline float to_f(int8_t v) { return static_cast<float>(v); }

template <typename C>
inline void widen_row(const C* x, int64_t D, float* out) {  // quantized values -> fp32 (unscaled)
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) _mm256_storeu_ps(out + i, load8(x + i));
  for (; i < D; ++i) out[i] = to_f(x[i]);
}

// dot(a, b) over D elements; a is fp32 (already converted), b in the cache's dtype.
template <typename T>
inline float dot(const float* a, const T* b, int64_t D) {
  int64_t i = 0;
  float s = 0.f;
  if (D >= 8) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    s = hsum(acc);
  }
  for (; i < D; ++i) s += a[i] * to_f(b[i]);
  return s;
}

template <typename T>
inline void axpy(float w, const T* x, float* y, int64_t D) {  // y += w * x
  int64_t i = 0;
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= D; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < D; ++i) y[i] += w * to_f(x[i]);
}

// [sum a[0], ..., sum a[7]]: the eight vectors' lane sums as one vector (a horizontal-add tree).
inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Sixteen FP8 E4M3 bytes as fp32 values times 2^-8 with F16C: an E4M3 byte's sign, exponent and mantissa bits
// moved into an fp16's places make that fp16 its value times 2^-8 (exponent biases 7 and 15), normals and
// subnormals alike, in 3 integer ops where load8's exact widening takes 11 per 8 bytes. Callers multiply the
// scale by 2^8: a power of two, so every product and sum is the exact widening's times 2^-8 and rounds the same.
constexpr float E4M3_SHIFTED = 256.f;
inline void load16_e4m3_shifted(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// Whether attend reads an FP8 cache of head size D through load16_e4m3_shifted (one choice for K and V).
template <typename C>
constexpr bool e4m3_shifted(int64_t D) { return std::is_same_v<C, uint8_t> && D % 16 == 0; }

// A key row as fp32: the cache's own row when it is fp32, else widened (unscaled; FP8 shifted, see above) into tmp.
template <typename C>
inline const float* fp32_row(const C* cache, int64_t slot, int64_t D, float* tmp) {
  if constexpr (std::is_same_v<C, float>) {
    return cache + slot * D;
  } else {
    if constexpr (std::is_same_v<C, uint8_t>) {
      if (e4m3_shifted<C>(D)) {
        for (int64_t d = 0; d < D; d += 16) {
          __m256 lo, hi;
          load16_e4m3_shifted(cache + slot * D + d, lo, hi);
          _mm256_storeu_ps(tmp + d, lo);
          _mm256_storeu_ps(tmp + d + 8, hi);
        }
        return tmp;
      }
    }
    widen_row(cache + slot * D, D, tmp);
    return tmp;
  }
}

// acc[0..W) += w * v[0..8W): W vectors of one head's output kept in registers over all positions.
template <int W, typename C, bool SCALED>
inline void weighted_values(const float* p, const float* vs, const int64_t* slot, int64_t L, const C* vc, int64_t D,
                            int64_t d0, float inv, float* out) {
  __m256 acc[W];
  for (int j = 0; j < W; ++j) acc[j] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<C, uint8_t> && W % 2 == 0) {
    if (e4m3_shifted<C>(D)) {
      for (int64_t i = 0; i < L; ++i) {
        const C* v = vc + slot[i] * D + d0;
        const __m256 wv = _mm256_set1_ps(p[i] * (vs[slot[i]] * E4M3_SHIFTED));
        for (int j = 0; j < W; j += 2) {
          __m256 lo, hi;
          load16_e4m3_shifted(v + 8 * j, lo, hi);
          acc[j] = _mm256_fmadd_ps(wv, lo, acc[j]);
          acc[j + 1] = _mm256_fmadd_ps(wv, hi, acc[j + 1]);
        }
      }
      const __m256 iv = _mm256_set1_ps(inv);
      for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(acc[j], iv));
      return;
    }
  }
  for (int64_t i = 0; i < L; ++i) {
    const C* v = vc + slot[i] * D + d0;
    const __m256 wv = _mm256_set1_ps(SCALED ? p[i] * vs[slot[i]] : p[i]);
    for (int j = 0; j < W; ++j) acc[j] = _mm256_fmadd_ps(wv, load8(v + 8 * j), acc[j]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
  for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(acc[j], iv));
}

// One query row's G heads (sharing KV head kh) against positions first..last of its sequence (first > 0 under a
// sliding window: blocks before it are never read). A quantized cache C (uint8_t = FP8, int8_t) comes with one
// scale per (slot, KV head) in ks/vs; an unquantized one (C = T) has none. Each head's result depends on that
// head alone, never on G, so one head per call (the single-row path) gives the bits of G heads per call.
// Decode attention at a long context was arithmetic and memory latency, not a read at the bandwidth (2k positions:
// 9 GB/s of a hot fp32 cache in one thread, 2 for FP8; measurements/2026-12-02/issue27/kv-plan/README.md), so
// eight positions' scores are computed at once (a horizontal-add tree instead of a reduction per dot product), the
// softmax's exp eight lanes at a time (ATen's exp_u20, as torch's CPU flash attention uses), each head's output
// in registers over the positions, and the scores pass prefetches keys and values ahead (a KV head's rows are
// Hk * D elements apart, a stride the hardware prefetchers follow poorly).
template <typename T, typename C>
void attend(const T* q, int64_t q_head_stride, const C* kc, const C* vc, const float* ks, const float* vs,
            const int64_t* table, int64_t first, int64_t last, int64_t bs, int64_t Hk, int64_t kh, int64_t D,
            int64_t G, float scale, T* out, std::vector<float>& buf) {
  constexpr bool scaled = std::is_same_v<C, uint8_t> || std::is_same_v<C, int8_t>;
  const int64_t L = last - first + 1, L8 = (L + 7) / 8 * 8;
  const bool vec = D % 8 == 0;
  buf.resize(G * L8 + G * D + D + 8 * D);
  float* s = buf.data();  // scores, then probabilities: [G, L8], padded with -inf / 0
  float* qf = s + G * L8;
  float* o = qf + G * D;  // one head's output
  float* rows = o + D;  // eight keys widened to fp32
  thread_local std::vector<int64_t> slots;
  slots.resize(L);
  int64_t* slot = slots.data();
  for (int64_t i = 0; i < L; ++i) {
    const int64_t p = first + i;
    slot[i] = (table[p / bs] * bs + p % bs) * Hk + kh;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(q[g * q_head_stride + d]) * scale;
  // scores, eight positions at a time (a key row is widened once for the G heads that share it)
  for (int64_t i0 = 0; i0 < L; i0 += 8) {
    const int64_t n = std::min<int64_t>(8, L - i0);
    const float* k[8];
    if (i0 + 64 + 8 <= L)  // the keys and values 64 positions on: each is read from memory once, here
      for (int64_t j = 0; j < 8; ++j) {
        const char* kr = reinterpret_cast<const char*>(kc + slot[i0 + 64 + j] * D);
        const char* vr = reinterpret_cast<const char*>(vc + slot[i0 + 64 + j] * D);
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(C)); b += 64) {
          _mm_prefetch(kr + b, _MM_HINT_T0);
          _mm_prefetch(vr + b, _MM_HINT_T1);
        }
      }
    for (int64_t j = 0; j < 8; ++j) k[j] = j < n ? fp32_row(kc, slot[i0 + j], D, rows + j * D) : k[0];
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * L8 + i0;
      if (vec) {
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qf + g * D + d);
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), a[j]);
        }
        _mm256_storeu_ps(sg, hsum8(a));
      } else {
        for (int64_t j = 0; j < n; ++j) sg[j] = dot(qf + g * D, k[j], D);
      }
      if constexpr (scaled) {
        const float shift = e4m3_shifted<C>(D) ? E4M3_SHIFTED : 1.f;
        for (int64_t j = 0; j < n; ++j) sg[j] *= ks[slot[i0 + j]] * shift;
      }
      for (int64_t j = n; j < 8; ++j) sg[j] = -std::numeric_limits<float>::infinity();
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    // softmax numerators in place, eight lanes at a time; the padding's exp(-inf) is 0
    float* p = s + g * L8;
    __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < L8; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(p + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    const __m256 m = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < L8; i += 8) {
      const __m256 e = at::vec::Vectorized<float>(_mm256_sub_ps(_mm256_loadu_ps(p + i), m)).exp_u20();
      _mm256_storeu_ps(p + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float inv = 1.f / hsum(sum);
    // the head's weighted sum of values, 64 output lanes at a time in registers
    if (!vec) {
      std::fill(o, o + D, 0.f);
      for (int64_t i = 0; i < L; ++i) axpy(scaled ? p[i] * vs[slot[i]] : p[i], vc + slot[i] * D, o, D);
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    } else {
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        switch (std::min<int64_t>(64, D - d0) / 8) {
          case 8: weighted_values<8, C, scaled>(p, vs, slot, L, vc, D, d0, inv, o + d0); break;
          case 7: weighted_values<7, C, scaled>(p, vs, slot, L, vc, D, d0, inv, o + d0); break;
          case 6: weighted_values<6, C, scaled>(p, vs, slot, L, vc, D, d0, inv, o + d0); break;
          case 5: weighted_values<5, C, scaled>(p, vs, slot, L, vc, D, d0, inv, o + d0); break;
          case 4: weighted_values<4, C, scaled>(p, vs, slot, L, vc, D, d0, inv, o + d0); break;
          case 3: weighted_values<3, C, scaled>(p, vs, slot, L, vc, D, d0, inv, o + d0); break;
          case 2: weighted_values<2, C, scaled>(p, vs, slot, L, vc, D, d0, inv, o + d0); break;
          default: weighted_values<1, C, scaled>(p, vs, slot, L, vc, D, d0, inv, o + d0); break;
        }
      }
    }
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(o[d]);
  }
}

// Every (row, KV head) pair is one task: its G query heads against the row's visible positions.
template <typename T, typename C>
void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache, const float* ks,
                 const float* vs, const int64_t* table, const int64_t* row_seq, const int64_t* row_last, int64_t B,
                 int64_t G, double scale, int64_t window, int64_t grain, torch::Tensor& out) {
  const int64_t Hk = k_cache.size(2), D = q.size(2), H = q.size(1), bs = k_cache.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kc = static_cast<const C*>(k_cache.data_ptr());
  const C* vc = static_cast<const C*>(v_cache.data_ptr());
  T* op = out.data_ptr<T>();
  at::parallel_for(0, q.size(0) * Hk, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / Hk, kh = i % Hk;
      const int64_t first = window > 0 ? std::max<int64_t>(0, row_last[t] - window + 1) : 0;
      attend<T, C>(qp + t * q.stride(0) + kh * G * D, D, kc, vc, ks, vs, table + row_seq[t] * B, first, row_last[t],
                   bs, Hk, kh, D, G, static_cast<float>(scale), op + t * H * D + kh * G * D, buf);
    }
  });
}

}  // namespace

// q [T, H, D] (any row stride, heads contiguous), caches [num_blocks, block_size, Hk, D], block_table [S, B]
// int64, row_seq [T] (row -> sequence), row_last [T] (newest position the row may see). window > 0: a row sees only
// its last `window` positions (itself included), as transformers' sliding-window mask (kv > q - window); 0 = all.
// A quantized cache (uint8 holding FP8 E4M3 bytes, or int8) comes with k_scales/v_scales [num_blocks, block_size,
// Hk] fp32, value = stored * scale; the bytes are read as they are, never widened into a copy.
// Returns [T, H * D].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                              torch::Tensor row_seq, torch::Tensor row_last, double scale, int64_t window,
                              c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, H, D] with dense heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "caches must be contiguous");
  const bool quantized = k_scales.has_value() && k_scales->defined();
  TORCH_CHECK(quantized == (v_scales.has_value() && v_scales->defined()), "give both k_scales and v_scales or neither");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the caches must share a dtype");
  if (quantized) {
    TORCH_CHECK(k_cache.scalar_type() == torch::kByte || k_cache.scalar_type() == torch::kChar,
                "a scaled cache holds uint8 (FP8 E4M3 bytes) or int8");
    TORCH_CHECK(k_scales->scalar_type() == torch::kFloat && v_scales->scalar_type() == torch::kFloat &&
                k_scales->is_contiguous() && v_scales->is_contiguous() &&
                k_scales->numel() * k_cache.size(3) == k_cache.numel() &&
                v_scales->numel() * v_cache.size(3) == v_cache.numel(),
                "k_scales/v_scales must be contiguous fp32 [num_blocks, block_size, Hk]");
  } else {
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches must share a dtype");
  }
  TORCH_CHECK(!quantized || k_cache.size(3) <= 512, "a quantized cache supports head_dim up to 512");
  const float* ksp = quantized ? k_scales->data_ptr<float>() : nullptr;
  const float* vsp = quantized ? v_scales->data_ptr<float>() : nullptr;
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && row_seq.scalar_type() == torch::kLong &&
              row_last.scalar_type() == torch::kLong, "block_table, row_seq and row_last must be int64");
  auto table = block_table.contiguous();
  auto seq = row_seq.contiguous();
  auto last = row_last.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2), B = table.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % Hk == 0, "cache head_dim or head counts do not match q");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 = no window)");
  const int64_t G = H / Hk;
  auto out = torch::empty({T, H * D}, q.options());
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* sp = seq.data_ptr<int64_t>();
  const int64_t* lp = last.data_ptr<int64_t>();
  int64_t positions = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(lp[t] >= 0 && lp[t] / bs < B && sp[t] >= 0 && sp[t] < table.size(0), "row ", t, " is out of range");
    positions += window > 0 ? std::min(lp[t] + 1, window) : lp[t] + 1;
  }
  // a batch-1 decode step is ~100K multiply-adds: cheaper on this thread than a fork/join of the pool
  const int64_t grain = positions * H * D < (int64_t{1} << 18) ? T * Hk : 1;
  const auto cache_type = k_cache.scalar_type();
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      if (!quantized) attend_rows<float, float>(q, k_cache, v_cache, ksp, vsp, tp, sp, lp, B, G, scale, window, grain, out);
      else if (cache_type == torch::kByte)
        attend_rows<float, uint8_t>(q, k_cache, v_cache, ksp, vsp, tp, sp, lp, B, G, scale, window, grain, out);
      else attend_rows<float, int8_t>(q, k_cache, v_cache, ksp, vsp, tp, sp, lp, B, G, scale, window, grain, out);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using B16 = at::BFloat16;
      if (!quantized) attend_rows<B16, B16>(q, k_cache, v_cache, ksp, vsp, tp, sp, lp, B, G, scale, window, grain, out);
      else if (cache_type == torch::kByte)
        attend_rows<B16, uint8_t>(q, k_cache, v_cache, ksp, vsp, tp, sp, lp, B, G, scale, window, grain, out);
      else attend_rows<B16, int8_t>(q, k_cache, v_cache, ksp, vsp, tp, sp, lp, B, G, scale, window, grain, out);
    }));
  return out;
}

namespace {

// residual' = x + residual (or x), out = weight * (residual' * rsqrt(mean(residual'^2) + eps)), per row.
template <typename T>
void add_rms_norm_impl(const T* x, const T* res, const T* w, T* res_out, T* out, int64_t rows, int64_t K, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> r(K);
    for (int64_t m = begin; m < end; ++m) {
      float ss = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        float v = to_f(x[m * K + k]);
        if (res) v += to_f(res[m * K + k]);
        if constexpr (!std::is_same_v<T, float>) v = to_f(static_cast<T>(v));  // residual kept in T
        r[k] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + eps);
      for (int64_t k = 0; k < K; ++k) {
        if (res_out) res_out[m * K + k] = static_cast<T>(r[k]);
        out[m * K + k] = static_cast<T>(to_f(w[k]) * (r[k] * inv));
      }
    }
  });
}

}  // namespace

// Returns (normed, new_residual); with no residual the new residual is x itself (no copy).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                        double eps) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "x must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1), "weight must match x");
  const bool has_res = residual.has_value() && residual->defined();
  torch::Tensor res = has_res ? residual->contiguous() : torch::Tensor();
  if (has_res) TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "residual must match x");
  auto out = torch::empty_like(x);
  auto res_out = has_res ? torch::empty_like(x) : x;
  auto w = weight.contiguous();
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      add_rms_norm_impl<float>(x.data_ptr<float>(), has_res ? res.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                               has_res ? res_out.data_ptr<float>() : nullptr, out.data_ptr<float>(), x.size(0),
                               x.size(1), static_cast<float>(eps));
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using B = at::BFloat16;
      add_rms_norm_impl<B>(x.data_ptr<B>(), has_res ? res.data_ptr<B>() : nullptr, w.data_ptr<B>(),
                           has_res ? res_out.data_ptr<B>() : nullptr, out.data_ptr<B>(), x.size(0), x.size(1),
                           static_cast<float>(eps));
    }));
  return {out, res_out};
}

namespace {

// MB activation rows against one weight row: MB accumulators, the weight row streamed once. Each 64 bytes of
// weight prefetch the line 8 KiB ahead (a few rows on): the fp32 decode GEMVs then read 20.1 instead of 19.3 GB/s,
// same bits (measurements/2026-12-02/issue27/intel-xeon/dense-prefetch.txt); a second accumulator did not help.
template <int MB, typename W>
inline void gemv_row(const float* x, int64_t K, const W* w, float* y, int64_t N) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if ((k & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k) + 8192, _MM_HINT_T0);
    const __m256 wv = load8(w + k);
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
  }
  for (int m = 0; m < MB; ++m) y[m * N] = hsum(acc[m]);
}

// bf16 weights, 16 per load: interleaving zeros below each 16-bit value (unpacklo/hi) widens them to fp32 in
// two ops, in the lane order [0-3, 8-11] / [4-7, 12-15]; x is permuted once per call to that order (xp).
template <int MB>
inline void gemv_row_bf16(const float* xp, int64_t K, const at::BFloat16* w, float* y, int64_t N) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp + m * K + k), acc[m]);
      acc[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp + m * K + k + 8), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) y[m * N] = hsum(acc[m]);
}

void gemv_bf16(const float* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t N, float* y) {
  std::vector<float> xp(M * K);
  static constexpr int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 16)
      for (int j = 0; j < 16; ++j) xp[m * K + k + j] = x[m * K + k + order[j]];
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 17) / K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const at::BFloat16* wr = w + n * K;
      _mm_prefetch(reinterpret_cast<const char*>(wr + 8 * K), _MM_HINT_T0);  // a few rows ahead of the stream
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) gemv_row_bf16<4>(xp.data() + m * K, K, wr, y + m * N + n, N);
      for (; m + 2 <= M; m += 2) gemv_row_bf16<2>(xp.data() + m * K, K, wr, y + m * N + n, N);
      for (; m < M; ++m) gemv_row_bf16<1>(xp.data() + m * K, K, wr, y + m * N + n, N);
    }
  });
}

// The fp32 rows with AVX-512 F: 16 lanes a load read 11-15% more weight bytes a second than AVX2's 8 on the
// Xeon VM (measurements/2026-12-02/issue27/intel-xeon/dense-avx512-probe.txt), and the fp32 decode is that read.
// Its sums differ from the AVX2 rows' in the last bits, so the choice is per weight (dense_avx512), never per
// batch size: a row decoded alone and in a batch take the same lanes.
#define QTOOLKIT_AVX512F __attribute__((target("avx2,fma,f16c,avx512f")))
template <int MB>
QTOOLKIT_AVX512F inline void gemv_row_512(const float* x, int64_t K, const float* w, float* y, int64_t N) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + 8192, _MM_HINT_T0);
    const __m512 wv = _mm512_loadu_ps(w + k);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m]);
  }
  for (int m = 0; m < MB; ++m) y[m * N] = _mm512_reduce_add_ps(acc[m]);
}

// Output rows [n0, n1) of y[M, N] = x[M, K] @ w^T with the AVX-512 rows.
QTOOLKIT_AVX512F void gemv_span_512(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                                    int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) gemv_row_512<4>(x + m * K, K, wr, y + m * N + n, N);
    for (; m + 2 <= M; m += 2) gemv_row_512<2>(x + m * K, K, wr, y + m * N + n, N);
    for (; m < M; ++m) gemv_row_512<1>(x + m * K, K, wr, y + m * N + n, N);
  }
}

// Output rows [n0, n1) with the AVX2 rows (any weight type load8 reads).
template <typename W>
void gemv_span(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) gemv_row<4>(x + m * K, K, wr, y + m * N + n, N);
    for (; m + 2 <= M; m += 2) gemv_row<2>(x + m * K, K, wr, y + m * N + n, N);
    for (; m < M; ++m) gemv_row<1>(x + m * K, K, wr, y + m * N + n, N);
  }
}

constexpr int64_t DENSE_AUTO = -1, DENSE_AVX2 = 0, DENSE_AVX512 = 1;

// Whether an fp32 weight with K inputs takes the AVX-512 rows: where kernels/cpu_isa.h allows AVX-512 F and K
// fills whole 16-lane loads.
inline bool dense_avx512(int64_t K) { return K % 16 == 0 && qtoolkit_isa::avx512f(); }

// Output rows [n0, n1) of an fp32 weight: isa DENSE_AUTO picks by CPU and K, the others force one (tests).
inline void gemv_span_f32(int64_t isa, const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                          int64_t n0, int64_t n1) {
  if (isa == DENSE_AVX512 || (isa == DENSE_AUTO && dense_avx512(K))) gemv_span_512(x, M, K, w, N, y, n0, n1);
  else gemv_span<float>(x, M, K, w, N, y, n0, n1);
}

template <typename W>
void gemv_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t isa = DENSE_AUTO) {
  // ~256 KiB of weight rows per task: enough to split a 576x576 matrix over both threads
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 18) / (K * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<W, float>) gemv_span_f32(isa, x, M, K, w, N, y, begin, end);
    else gemv_span<W>(x, M, K, w, N, y, begin, end);
  });
}

}  // namespace

// x [M, K] fp32 @ w [N, K]^T (fp32 or bf16) -> fp32 [M, N]; K must be a multiple of 8. isa (fp32 weights): -1
// picks by CPU (dense_avx512), 0 forces the AVX2 rows, 1 the AVX-512 ones (where allowed and K % 16 == 0).
torch::Tensor dense_gemv(torch::Tensor x, torch::Tensor w, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "x must be fp32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.size(1) % 8 == 0, "w must be [N, K] with K % 8 == 0");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  if (wc.scalar_type() == torch::kFloat) {
    TORCH_CHECK(isa >= DENSE_AUTO && isa <= DENSE_AVX512, "isa must be -1 (auto), 0 (AVX2) or 1 (AVX-512)");
    TORCH_CHECK(isa != DENSE_AVX512 || dense_avx512(K), "the AVX-512 rows need AVX-512 F (allowed) and K % 16 == 0");
    gemv_impl<float>(xc.data_ptr<float>(), M, K, wc.data_ptr<float>(), N, y.data_ptr<float>(), isa);
  } else {
    TORCH_CHECK(wc.scalar_type() == torch::kBFloat16, "w must be fp32 or bf16");
    if (K % 16 == 0) {  // the head of a quantized default model: 24 GB/s here vs 17 for gemv_impl (M = 1)
      gemv_bf16(xc.data_ptr<float>(), M, K, wc.data_ptr<at::BFloat16>(), N, y.data_ptr<float>());
      return y;
    }
    gemv_impl<at::BFloat16>(xc.data_ptr<float>(), M, K, wc.data_ptr<at::BFloat16>(), N, y.data_ptr<float>());
  }
  return y;
}

namespace {

// Rotate-half RoPE of one head (the same two products and one add per element as apply_rope in torch).
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, int64_t half, T* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]), c = to_f(cos[i]), s = to_f(sin[i]);
    out[i] = static_cast<T>(x1 * c - x2 * s);
    out[i + half] = static_cast<T>(x2 * c + x1 * s);
  }
}

template <typename T>
void rope_and_cache_impl(const T* qkv, int64_t T_, int64_t H, int64_t Hk, int64_t D, const T* cos, const T* sin,
                         const int64_t* slots, T* kc, T* vc, T* q) {
  const int64_t half = D / 2, width = (H + 2 * Hk) * D;
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, c, s, half, q + (t * H + h) * D);
      for (int64_t h = 0; h < Hk; ++h) {
        rope_head(row + (H + h) * D, c, s, half, kc + (slots[t] * Hk + h) * D);
        std::copy(row + (H + Hk + h) * D, row + (H + Hk + h + 1) * D, vc + (slots[t] * Hk + h) * D);
      }
    }
  });
}

}  // namespace

// qkv [T, (H + 2 Hk) * D] -> rotated q [T, H, D]; rotated k and v are written into the caches at `slots`
// (flat block * block_size + offset). cos/sin [T, D/2] hold each row's position.
torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                             torch::Tensor v_cache, torch::Tensor slots, int64_t H, int64_t Hk) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [T, width] tensor");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t T_ = qkv.size(0), D = k_cache.size(-1);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * Hk) * D && k_cache.size(-2) == Hk, "shapes do not match");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "qkv and the caches must share a dtype");
  auto c = cos.to(qkv.scalar_type()).contiguous();
  auto s = sin.to(qkv.scalar_type()).contiguous();
  TORCH_CHECK(c.numel() == T_ * D / 2 && s.numel() == T_ * D / 2, "cos/sin must be [T, D/2]");
  auto sl = slots.contiguous();
  TORCH_CHECK(sl.scalar_type() == torch::kLong && sl.numel() == T_, "slots must be int64 [T]");
  const int64_t capacity = k_cache.numel() / (Hk * D);
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot out of range");
  auto q = torch::empty({T_, H, D}, qkv.options());
  AT_DISPATCH_SWITCH(qkv.scalar_type(), "rope_and_cache",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rope_and_cache_impl<float>(qkv.data_ptr<float>(), T_, H, Hk, D, c.data_ptr<float>(), s.data_ptr<float>(), sp,
                                 k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), q.data_ptr<float>());
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using B = at::BFloat16;
      rope_and_cache_impl<B>(qkv.data_ptr<B>(), T_, H, Hk, D, c.data_ptr<B>(), s.data_ptr<B>(), sp,
                             k_cache.data_ptr<B>(), v_cache.data_ptr<B>(), q.data_ptr<B>());
    }));
  return q;
}

namespace {

// silu(g) * u in the one order every path uses (the decode loop's single-row path too), so they agree bit for bit.
inline float silu_times(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

template <typename T>
void silu_mul_impl(const T* in, int64_t rows, int64_t I, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = 0; i < I; ++i)
        out[t * I + i] = static_cast<T>(silu_times(to_f(in[t * 2 * I + i]), to_f(in[t * 2 * I + I + i])));
  });
}

}  // namespace

// gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I] (split, silu and mul in one pass, no temporaries).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2 * intermediate]");
  auto gu = gate_up.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({T, I}, gu.options());
  AT_DISPATCH_SWITCH(gu.scalar_type(), "silu_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] { silu_mul_impl(gu.data_ptr<float>(), T, I, out.data_ptr<float>()); })
    AT_DISPATCH_CASE(at::kBFloat16,
                     [&] { silu_mul_impl(gu.data_ptr<at::BFloat16>(), T, I, out.data_ptr<at::BFloat16>()); }));
  return out;
}

namespace {

// Round |v| <= 448 to the nearest E4M3 value, ties to even, as c10::Float8_e4m3fn's conversion does: normals
// keep 3 mantissa bits (add half an ulp minus one, plus the kept lsb, then truncate); below 2^-6 the grid is
// uniform in steps of 2^-9, which adding and subtracting 2^14 rounds to in fp32.
inline __m256 round_e4m3(__m256 v) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_andnot_ps(sign_bit, v);
  __m256i b = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 20), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), lsb));
  const __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFF00000u))));
  const __m256 magic = _mm256_set1_ps(16384.f);
  const __m256 sub = _mm256_sub_ps(_mm256_add_ps(a, magic), magic);
  const __m256 r = _mm256_blendv_ps(normal, sub, _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ));
  return _mm256_or_ps(r, _mm256_and_ps(sign_bit, v));
}

inline float quantize_one(float v, bool fp8) {
  return fp8 ? static_cast<float>(c10::Float8_e4m3fn(std::min(std::max(v, -448.f), 448.f)))
             : std::min(std::max(std::nearbyint(v), -128.f), 127.f);
}

// max |r[k]| over a row: the per-token scale of both activation quantizers (the fake one and the int8 one).
inline float row_absmax(const float* r, int64_t K) {
  const int64_t K8 = K / 8 * 8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(abs_mask, _mm256_loadu_ps(r + k)));
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.f;
  for (float l : lanes) amax = std::max(amax, l);
  for (int64_t k = K8; k < K; ++k) amax = std::max(amax, std::fabs(r[k]));
  return amax;
}

// One row of fake_quant_tokens (the decode loop's single-row path calls it on its own copy of the row).
inline void fake_quant_row(const float* r, int64_t K, bool fp8, float* orow) {
  const int64_t K8 = K / 8 * 8;
  const float eps = std::numeric_limits<float>::epsilon();
  const float qmax = fp8 ? 448.f : 127.f, qmin = fp8 ? -448.f : -128.f;
  const float amax = row_absmax(r, K);
  const float scale = std::max(amax / (fp8 ? 448.f : 127.5f), eps);
  const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 v = _mm256_div_ps(_mm256_loadu_ps(r + k), vs);
    v = fp8 ? round_e4m3(_mm256_min_ps(_mm256_max_ps(v, lo), hi))
            : _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    _mm256_storeu_ps(orow + k, _mm256_mul_ps(v, vs));
  }
  for (int64_t k = K8; k < K; ++k) orow[k] = quantize_one(r[k] / scale, fp8) * scale;
}

}  // namespace

// Dynamic per-token activation quantize-dequantize (W8A8 / FP8_DYNAMIC schemes on a CPU without FP8 or int8
// matmuls): the same operations as kernels/reference.py quantize_activations, in one vectorized pass instead of
// ~10 torch ops per Linear, with bit-identical results (division by the scale, round-half-even, E4M3
// saturation at 448).
torch::Tensor fake_quant_tokens(torch::Tensor x, bool fp8) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "x must be fp32 [M, K]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto out = torch::empty_like(xc);
  const float* in = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) fake_quant_row(in + m * K, K, fp8, o + m * K);
  });
  return out;
}

// Per-token int8 quantization of fp32 activations for the W8A8 prefill's int8 x int8 GEMM: (q int8 [M, K],
// scale fp32 [M, 1]) by the operations of kernels/reference.py quantize_activations("int") (scale = max|x| / 127.5,
// at least eps; q = x / scale rounded half-even, clamped to [-128, 127]), bit for bit, in one pass per row instead
// of ~8 torch ops (each its own pass over the activations and its own fork/join).
std::vector<torch::Tensor> quantize_tokens_int8(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "x must be fp32 [M, K]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), K8 = K / 8 * 8;
  auto q = torch::empty({M, K}, xc.options().dtype(torch::kInt8));
  auto scales = torch::empty({M, 1}, xc.options());
  const float* in = xc.data_ptr<float>();
  int8_t* qo = q.data_ptr<int8_t>();
  float* so = scales.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m256 lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
    for (int64_t m = begin; m < end; ++m) {
      const float* r = in + m * K;
      int8_t* qr = qo + m * K;
      const float scale = std::max(row_absmax(r, K) / 127.5f, std::numeric_limits<float>::epsilon());
      so[m] = scale;
      const __m256 vs = _mm256_set1_ps(scale);
      for (int64_t k = 0; k < K8; k += 8) {
        const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(r + k), vs),
                                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                                     lo), hi);
        const __m256i i = _mm256_cvtps_epi32(v);  // whole numbers in [-128, 127]: exact
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + k), _mm_packs_epi16(w, w));
      }
      for (int64_t k = K8; k < K; ++k) qr[k] = static_cast<int8_t>(quantize_one(r[k] / scale, false));
    }
  });
  return {q, scales};
}

// The W8A8 GEMM's int32 sums back to fp32: (float(acc) * sx[m]) * sw[n], kernels/dispatch.py's
// acc.float() * sx * sw in its order (same bits), one pass instead of three.
torch::Tensor int8_rescale(torch::Tensor acc, torch::Tensor sx, torch::Tensor sw) {
  TORCH_CHECK(acc.scalar_type() == torch::kInt && acc.dim() == 2 && acc.is_contiguous(), "acc must be int32 [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1), N8 = N / 8 * 8;
  TORCH_CHECK(sx.scalar_type() == torch::kFloat && sx.is_contiguous() && sx.numel() == M, "sx must be fp32 [M, 1]");
  TORCH_CHECK(sw.scalar_type() == torch::kFloat && sw.is_contiguous() && sw.numel() == N, "sw must be fp32 [N]");
  auto out = torch::empty({M, N}, sx.options());
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* xs = sx.data_ptr<float>();
  const float* ws = sw.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const __m256 vx = _mm256_set1_ps(xs[m]);
      int64_t n = 0;
      for (; n < N8; n += 8) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * N + n)));
        _mm256_storeu_ps(o + m * N + n, _mm256_mul_ps(_mm256_mul_ps(f, vx), _mm256_loadu_ps(ws + n)));
      }
      for (; n < N; ++n) o[m * N + n] = (static_cast<float>(a[m * N + n]) * xs[m]) * ws[n];
    }
  });
  return out;
}

// The W8A8 prefill GEMM in one parallel region: each thread multiplies the int8 activations by a block of the
// weight's rows (at::_int_mm, oneDNN's int8 GEMM, one thread inside the region) and rescales its int32 sums into
// y's columns right away, as int8_rescale does (same bits): one fork/join per Linear instead of oneDNN's own
// threading plus the rescale's, which on a shared machine each can wait a time slice for a descheduled thread.
torch::Tensor int8_int8_matmul(torch::Tensor q, torch::Tensor sx, torch::Tensor w, torch::Tensor sw) {
  TORCH_CHECK(q.scalar_type() == torch::kChar && q.dim() == 2 && q.is_contiguous(), "q must be int8 [M, K]");
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.dim() == 2 && w.is_contiguous() && w.size(1) == q.size(1),
              "w must be contiguous int8 [N, K]");
  const int64_t M = q.size(0), N = w.size(0);
  TORCH_CHECK(sx.scalar_type() == torch::kFloat && sx.is_contiguous() && sx.numel() == M, "sx must be fp32 [M, 1]");
  TORCH_CHECK(sw.scalar_type() == torch::kFloat && sw.is_contiguous() && sw.numel() == N, "sw must be fp32 [N]");
  auto out = torch::empty({M, N}, sx.options());
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t rows = std::max<int64_t>(8, ((N + threads - 1) / threads + 7) / 8 * 8);
  const int64_t blocks = (N + rows - 1) / rows;
  const float* xs = sx.data_ptr<float>();
  const float* ws = sw.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * rows, R = std::min(N, r0 + rows) - r0;
      const auto acc = at::_int_mm(q, w.narrow(0, r0, R).t()).contiguous();
      const int32_t* a = acc.data_ptr<int32_t>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < R; ++n)
          o[m * N + r0 + n] = (static_cast<float>(a[m * R + n]) * xs[m]) * ws[r0 + n];
    }
  });
  return out;
}

namespace {

// One head of K or V into the quantized cache: scale = max|x| / qmax (or the calibrated `fixed` scale when > 0),
// stored = x / scale saturated to E4M3's +-448, or rounded half-even to [-127, 127] -- the operations of
// qtoolkit/model/kv_quant.py quantize, so both paths write the same bytes.
inline void quantize_head(const float* x, int64_t D, bool fp8, float fixed, uint8_t* out, float* scale_out) {
  float scale = fixed;
  if (scale <= 0.f) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    scale = std::max(amax / (fp8 ? 448.f : 127.f), std::numeric_limits<float>::epsilon());
  }
  *scale_out = scale;
  for (int64_t d = 0; d < D; ++d) {
    const float y = x[d] / scale;
    if (fp8) out[d] = c10::Float8_e4m3fn(std::min(std::max(y, -448.f), 448.f)).x;
    else reinterpret_cast<int8_t*>(out)[d] = static_cast<int8_t>(std::min(std::max(std::nearbyint(y), -127.f), 127.f));
  }
}

template <typename T>
void rope_and_cache_quant_impl(const T* qkv, int64_t T_, int64_t H, int64_t Hk, int64_t D, const T* cos, const T* sin,
                               const int64_t* slots, uint8_t* kc, uint8_t* vc, float* ks, float* vs, const float* kfix,
                               const float* vfix, bool fp8, T* q) {
  const int64_t half = D / 2, width = (H + 2 * Hk) * D;
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> rot(D);
    std::vector<float> f(D);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, c, s, half, q + (t * H + h) * D);
      for (int64_t h = 0; h < Hk; ++h) {
        const int64_t slot = slots[t] * Hk + h;
        rope_head(row + (H + h) * D, c, s, half, rot.data());  // rounded to T first, as the torch path's k is
        for (int64_t d = 0; d < D; ++d) f[d] = to_f(rot[d]);
        quantize_head(f.data(), D, fp8, kfix ? kfix[h] : 0.f, kc + slot * D, ks + slot);
        const T* v = row + (H + Hk + h) * D;
        for (int64_t d = 0; d < D; ++d) f[d] = to_f(v[d]);
        quantize_head(f.data(), D, fp8, vfix ? vfix[h] : 0.f, vc + slot * D, vs + slot);
      }
    }
  });
}

}  // namespace

// rope_and_cache into a quantized cache: caches uint8 (fp8 = true: E4M3 bytes) or int8 [num_blocks, block_size, Hk,
// D], scales fp32 [num_blocks, block_size, Hk]; k_static/v_static fp32 [Hk] (calibrated) replace the dynamic scales.
torch::Tensor rope_and_cache_quant(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                   torch::Tensor v_cache, torch::Tensor k_scales, torch::Tensor v_scales,
                                   torch::Tensor slots, int64_t H, int64_t Hk, bool fp8,
                                   c10::optional<torch::Tensor> k_static, c10::optional<torch::Tensor> v_static) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [T, width] tensor");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == (fp8 ? torch::kByte : torch::kChar) &&
              v_cache.scalar_type() == k_cache.scalar_type(), "an FP8 cache is uint8, an int8 cache int8");
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat || qkv.scalar_type() == torch::kBFloat16, "qkv must be fp32 or bf16");
  const int64_t T_ = qkv.size(0), D = k_cache.size(-1);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * Hk) * D && k_cache.size(-2) == Hk, "shapes do not match");
  const int64_t capacity = k_cache.numel() / (Hk * D);
  TORCH_CHECK(k_scales.scalar_type() == torch::kFloat && v_scales.scalar_type() == torch::kFloat &&
              k_scales.is_contiguous() && v_scales.is_contiguous() && k_scales.numel() == capacity * Hk &&
              v_scales.numel() == capacity * Hk, "scales must be contiguous fp32 [num_blocks, block_size, Hk]");
  const float* kfix = nullptr;
  const float* vfix = nullptr;
  torch::Tensor kst, vst;
  if (k_static.has_value() && k_static->defined()) {
    TORCH_CHECK(v_static.has_value() && v_static->defined(), "give both static scales or neither");
    kst = k_static->to(torch::kFloat).contiguous();
    vst = v_static->to(torch::kFloat).contiguous();
    TORCH_CHECK(kst.numel() == Hk && vst.numel() == Hk, "static scales must be [Hk]");
    kfix = kst.data_ptr<float>();
    vfix = vst.data_ptr<float>();
  }
  auto c = cos.to(qkv.scalar_type()).contiguous();
  auto s = sin.to(qkv.scalar_type()).contiguous();
  TORCH_CHECK(c.numel() == T_ * D / 2 && s.numel() == T_ * D / 2, "cos/sin must be [T, D/2]");
  auto sl = slots.contiguous();
  TORCH_CHECK(sl.scalar_type() == torch::kLong && sl.numel() == T_, "slots must be int64 [T]");
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot out of range");
  auto q = torch::empty({T_, H, D}, qkv.options());
  auto* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  float* ks = k_scales.data_ptr<float>();
  float* vs = v_scales.data_ptr<float>();
  if (qkv.scalar_type() == torch::kFloat) {
    rope_and_cache_quant_impl<float>(qkv.data_ptr<float>(), T_, H, Hk, D, c.data_ptr<float>(), s.data_ptr<float>(),
                                     sp, kc, vc, ks, vs, kfix, vfix, fp8, q.data_ptr<float>());
  } else {
    using B = at::BFloat16;
    rope_and_cache_quant_impl<B>(qkv.data_ptr<B>(), T_, H, Hk, D, c.data_ptr<B>(), s.data_ptr<B>(), sp, kc, vc, ks, vs,
                                 kfix, vfix, fp8, q.data_ptr<B>());
  }
  return q;
}

// kernels/cpu_decode.cpp includes this file to call its ops from C++, with its own module
#ifndef QTOOLKIT_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fake_quant_tokens", &fake_quant_tokens, "per-token int8/FP8 quantize-dequantize of fp32 activations");
  m.def("quantize_tokens_int8", &quantize_tokens_int8, "per-token int8 quantization of fp32 activations (q, scale)");
  m.def("int8_int8_matmul", &int8_int8_matmul, "(q @ w^T) * sx * sw: int8 x int8 GEMM by blocks of w's rows");
  m.def("int8_rescale", &int8_rescale, "int32 GEMM sums * token scale * channel scale -> fp32");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from the fused gate|up projection");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q and k, k and v written into the paged cache");
  m.def("paged_attention", &paged_attention, "decode/verify attention over the paged KV cache", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("row_seq"), py::arg("row_last"),
        py::arg("scale"), py::arg("window") = 0, py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none());
  m.def("rope_and_cache_quant", &rope_and_cache_quant,
        "RoPE on q and k, k and v quantized (FP8 E4M3 or int8, a scale per token and KV head) into the paged cache",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scales"),
        py::arg("v_scales"), py::arg("slots"), py::arg("H"), py::arg("Hk"), py::arg("fp8"),
        py::arg("k_static") = py::none(), py::arg("v_static") = py::none());
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm, returns (normed, residual)");
  m.def("dense_gemv", &dense_gemv, "fp32 x fp32/bf16 weight matmul for small batches", py::arg("x"), py::arg("w"),
        py::arg("isa") = -1);
  m.def("dense_avx512", &dense_avx512, "whether an fp32 weight with K inputs takes the AVX-512 GEMV rows");
}
#endif
