// AVX2 dequant-matmul kernels for the CPU path (built once by kernels/cpu_build.py with -O3 -mavx2 -mfma -mf16c).
//
// Decode on this CPU is memory-bound only if the kernel is cheap per weight byte. The INT4 kernel therefore
// follows the llama.cpp Q4 x Q8 scheme: activations are quantized to int8 per 32-element block (once per call),
// and the packed nibbles are multiplied with vpmaddubsw/vpmaddwd in registers; only one float FMA per 32 weights.
// It reads the checkpoint's own pack-quantized layout (byte b of a row holds element 2b in its low nibble and
// 2b+1 in its high nibble, offset by +8), so no repack is needed: the activations are permuted instead.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_isa.h"

namespace {

// Activations of one call, quantized to int8 per block of 32. For the INT4 kernel they are permuted to match the
// nibble order: for each chunk of 64 elements, 32 bytes of the even elements then 32 bytes of the odd ones.
struct QuantizedActivations {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> d;       // [M, K/32] block scales
  std::vector<float> dsum;    // [M, K/32] block scale * sum of the block's int8 values (for the weight offset)
  // INT4 only, per 64-chunk as 8 lanes matching the kernel's lanes (0-3: first block, 4-7: second block):
  std::vector<float> dvec;    // [M, K/64, 8] block scales
  std::vector<float> dsq;     // [M, K/64, 8] dsum / 4 (each block's term is summed over 4 lanes)
};

QuantizedActivations quantize_activations(const float* x, int64_t M, int64_t K, bool nibble_order) {
  QuantizedActivations a;
  const int64_t nb = K / 32;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.dsum.resize(M * nb);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* qr = a.q.data() + m * K;
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xr[b * 32 + i]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      const int64_t chunk = b / 2, half = b % 2;  // which 64-chunk, and which 32-block inside it
      for (int i = 0; i < 32; ++i) {
        const int v = static_cast<int>(std::nearbyint(xr[b * 32 + i] * inv));
        sum += v;
        // element e of the chunk (e = half*32 + i) goes to even/odd plane position e/2
        const int64_t e = half * 32 + i;
        qr[nibble_order ? chunk * 64 + (e % 2) * 32 + e / 2 : b * 32 + i] = static_cast<int8_t>(v);
      }
      a.d[m * nb + b] = d;
      a.dsum[m * nb + b] = d * static_cast<float>(sum);
    }
  }
  if (nibble_order) {
    a.dvec.resize(M * nb * 4);
    a.dsq.resize(M * nb * 4);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b)
        for (int l = 0; l < 4; ++l) {
          a.dvec[(m * nb + b) * 4 + l] = a.d[m * nb + b];
          a.dsq[(m * nb + b) * 4 + l] = a.dsum[m * nb + b] * 0.25f;
        }
  }
  return a;
}

// Rows per thread task. Below ~128K weights the fork/join costs more than the split saves, so tiny matrices run
// on the calling thread; anything larger is split evenly over the threads. (A fixed ~512K-weight grain left the
// decode-sized layers of a 135M model, 576-3072 rows of K = 576, on one thread or split 910/50.)
inline int64_t rows_per_task(int64_t N, int64_t K) {
  if (N * K < (int64_t{1} << 17)) return std::max<int64_t>(N, 1);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(16, (N + threads - 1) / threads);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MB activation rows against one weight row. ws/zp: this row's group scales and (optional) zero points.
// Per 64 weights: one load, three ops to split nibbles, then per activation row two vpmaddubsw, one vpmaddwd and
// three float ops. The +8 (or +8+zp) nibble offset is applied as -offset * block_scale * sum(x_q), folded into
// the same FMA chain. Groups of 64 or more: one scale covers group/64 chunks (group 32 takes int4_g32_rows).
template <int MB, bool ASYM>
inline void int4_row(const uint8_t* w, const float* ws, const int8_t* zp, int64_t K, int64_t group,
                     const QuantizedActivations& a, int64_t m0, float* out, int64_t out_stride) {
  const int64_t nchunk = K / 64, chunks_per_group = group / 64;
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  const float* dvec[MB];
  const float* dsq[MB];
  const int8_t* xq[MB];
  for (int i = 0; i < MB; ++i) {
    dvec[i] = a.dvec.data() + (m0 + i) * nchunk * 8;
    dsq[i] = a.dsq.data() + (m0 + i) * nchunk * 8;
    xq[i] = a.q.data() + (m0 + i) * K;
  }
  __m256 wscale = _mm256_setzero_ps(), neg_off = _mm256_set1_ps(-8.f);
  for (int64_t c = 0, left = 0, g = 0; c < nchunk; ++c, --left) {
    if (left == 0) {  // next group: one scale for the next group/64 chunks
      wscale = _mm256_set1_ps(ws[g]);
      if (ASYM) neg_off = _mm256_set1_ps(-8.f - zp[g]);
      left = chunks_per_group;
      ++g;
    }
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
    const __m256i lo = _mm256_and_si256(packed, low_mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
    for (int i = 0; i < MB; ++i) {
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + c * 64));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + c * 64 + 32));
      const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));  // lanes 0-3 block 2c, 4-7 block 2c+1
      // (dot * x_scale - offset * x_scale * sum(x_q) / 4) * w_scale
      const __m256 t = _mm256_fmadd_ps(neg_off, _mm256_loadu_ps(dsq[i] + c * 8),
                                       _mm256_mul_ps(dot, _mm256_loadu_ps(dvec[i] + c * 8)));
      acc[i] = _mm256_fmadd_ps(t, wscale, acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) out[i * out_stride] = hsum(acc[i]);
}

// Group 32, NR weight rows at a time: the activation loads of a chunk are shared by the NR rows, and the nibble
// offset (+8, or +8+zp) is taken out of the chunk loop: sum_b s_b * (-8 - zp_b) * d_b * sum(x_q in b) is one short
// dot product per row over the K/32 block scales, added at the end. Per 64 weights and activation row that
// leaves two vpmaddubsw, one add, one vpmaddwd, a convert, a multiply and an FMA (the decode rows of the default
// model, K = 576, ran 1.2-1.5x faster than int4_row with zero points, about the same without).
template <bool ASYM>
inline float int4_offset_term(const float* s, const int8_t* z, const float* dsum, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  const __m256 minus8 = _mm256_set1_ps(-8.f);
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256 off = minus8;
    if (ASYM) off = _mm256_sub_ps(minus8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + b)))));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + b), off), _mm256_loadu_ps(dsum + b), acc);
  }
  float r = hsum(acc);
  for (; b < nb; ++b) r += s[b] * (-8.f - (ASYM ? static_cast<float>(z[b]) : 0.f)) * dsum[b];
  return r;
}

template <int MB, int NR, bool ASYM>
inline void int4_g32_rows(const uint8_t* w, const float* ws, const int8_t* zp, int64_t K,
                          const QuantizedActivations& a, int64_t m0, float* out, int64_t out_stride) {
  const int64_t nchunk = K / 64, nb = K / 32, w_stride = K / 2;
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i dup = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
  const int8_t* xq[MB];
  const float* dvec[MB];
  for (int i = 0; i < MB; ++i) {
    xq[i] = a.q.data() + (m0 + i) * K;
    dvec[i] = a.dvec.data() + (m0 + i) * nchunk * 8;
  }
  for (int64_t c = 0; c < nchunk; ++c) {
    __m256i xl[MB], xh[MB];
    __m256 dv[MB];
    for (int i = 0; i < MB; ++i) {
      xl[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + c * 64));
      xh[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + c * 64 + 32));
      dv[i] = _mm256_loadu_ps(dvec[i] + c * 8);
    }
    for (int r = 0; r < NR; ++r) {
      // software prefetch of the rows 4 passes ahead: streamed from DRAM, the decode layers ran ~13% faster
      if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (r + 4 * NR) * w_stride + c * 32), _MM_HINT_T0);
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * w_stride + c * 32));
      const __m256i lo = _mm256_and_si256(packed, low_mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
      const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ws + r * nb + 2 * c)));
      const __m256 wscale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), dup);
      for (int i = 0; i < MB; ++i) {
        const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[i]), _mm256_maddubs_epi16(hi, xh[i]));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[r][i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv[i], wscale), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MB; ++i)
      out[i * out_stride + r] = hsum(acc[r][i]) + int4_offset_term<ASYM>(
          ws + r * nb, ASYM ? zp + r * nb : nullptr, a.dsum.data() + (m0 + i) * nb, nb);
}

template <int MB, int NR>
inline void int4_g32_any(const uint8_t* w, const float* ws, const int8_t* zp, int64_t K,
                         const QuantizedActivations& a, int64_t m0, float* out, int64_t out_stride) {
  if (zp) int4_g32_rows<MB, NR, true>(w, ws, zp, K, a, m0, out, out_stride);
  else int4_g32_rows<MB, NR, false>(w, ws, zp, K, a, m0, out, out_stride);
}

template <int NR>
inline void int4_g32_block(const uint8_t* w, const float* ws, const int8_t* zp, int64_t K, int64_t M,
                           const QuantizedActivations& a, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int4_g32_any<4, NR>(w, ws, zp, K, a, m, out + m * N, N);
  for (; m + 2 <= M; m += 2) int4_g32_any<2, NR>(w, ws, zp, K, a, m, out + m * N, N);
  for (; m < M; ++m) int4_g32_any<1, NR>(w, ws, zp, K, a, m, out + m * N, N);
}

template <int MB>
inline void int4_row_any(const uint8_t* w, const float* ws, const int8_t* zp, int64_t K, int64_t group,
                         const QuantizedActivations& a, int64_t m0, float* out, int64_t out_stride) {
  if (zp) int4_row<MB, true>(w, ws, zp, K, group, a, m0, out, out_stride);
  else int4_row<MB, false>(w, ws, zp, K, group, a, m0, out, out_stride);
}

void check_int4_args(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& zeros,
                     int64_t K, int64_t group) {
  TORCH_CHECK(packed.dtype() == torch::kInt32 && packed.is_contiguous(), "packed must be contiguous int32");
  TORCH_CHECK(K % 64 == 0 && (group == 32 || group % 64 == 0) && K % group == 0,
              "need K % 64 == 0 and group 32 or a multiple of 64 dividing K");
  TORCH_CHECK(packed.size(1) * 8 == K, "packed width does not match K");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.size(1) == K / group,
              "scales must be contiguous fp32 [N, K/group]");
  TORCH_CHECK(!zeros.defined() || zeros.numel() == 0 ||
              (zeros.dtype() == torch::kInt8 && zeros.is_contiguous() && zeros.sizes() == scales.sizes()),
              "zeros must be int8 shaped like scales");
}

// The [N, K] fp32 destination of a dequantize: a view of the caller's buffer, or a new tensor.
torch::Tensor dequant_output(const c10::optional<torch::Tensor>& buf, int64_t N, int64_t K) {
  if (!buf.has_value()) return torch::empty({N, K}, torch::kFloat32);
  TORCH_CHECK(buf->dtype() == torch::kFloat32 && buf->is_contiguous() && buf->numel() >= N * K,
              "out must be a contiguous fp32 buffer of at least N*K elements");
  return buf->view({-1}).narrow(0, 0, N * K).view({N, K});
}

}  // namespace

// y[M, N] = x[M, K] @ dequant(W)^T for pack-quantized 4-bit W ([N, K/8] int32), group scales [N, K/group].
torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros,
                          int64_t group) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  check_int4_args(packed, scales, zeros, K, group);
  const QuantizedActivations a = quantize_activations(x.data_ptr<float>(), M, K, true);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int32_t>());
  const float* s = scales.data_ptr<float>();
  const int8_t* z = (zeros.defined() && zeros.numel()) ? zeros.data_ptr<int8_t>() : nullptr;
  float* out = y.data_ptr<float>();
  const int64_t G = K / group;
  if (group == 32) {
    at::parallel_for(0, N, rows_per_task(N, K), [&](int64_t begin, int64_t end) {
      int64_t n = begin;
      for (; n + 2 <= end; n += 2)
        int4_g32_block<2>(w + n * (K / 2), s + n * G, z ? z + n * G : nullptr, K, M, a, out + n, N);
      for (; n < end; ++n)
        int4_g32_block<1>(w + n * (K / 2), s + n * G, z ? z + n * G : nullptr, K, M, a, out + n, N);
    });
    return y;
  }
  at::parallel_for(0, N, rows_per_task(N, K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wr = w + n * (K / 2);
      const float* sr = s + n * G;
      const int8_t* zr = z ? z + n * G : nullptr;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int4_row_any<4>(wr, sr, zr, K, group, a, m, out + m * N + n, N);
      for (; m + 2 <= M; m += 2) int4_row_any<2>(wr, sr, zr, K, group, a, m, out + m * N + n, N);
      for (; m < M; ++m) int4_row_any<1>(wr, sr, zr, K, group, a, m, out + m * N + n, N);
    }
  });
  return y;
}

namespace {

// Rows [r0, r1) of an INT4 weight as fp32 into o (row r0 first, K floats a row): the prefill dequantization.
inline void int4_dequant_rows(const uint8_t* w, const float* s, const int8_t* z, int64_t K, int64_t group,
                            int64_t r0, int64_t r1, float* o) {
  const int64_t G = K / group;
  for (int64_t n = r0; n < r1; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      const float sc = s[n * G + g];
      const float off = 8.f + (z ? z[n * G + g] : 0);
      const uint8_t* wb = w + n * (K / 2) + g * group / 2;
      float* ob = o + (n - r0) * K + g * group;
      // 16 bytes (32 weights) at a time: nibbles split, interleaved back into element order, then the scalar
      // loop's (nibble - offset) * scale in 8 lanes (same bits); a scalar loop here cost a quarter of an
      // INT4 prefill's sgemm time on the default model's layers
      const __m256 vs = _mm256_set1_ps(sc), voff = _mm256_set1_ps(off);
      const __m128i mask = _mm_set1_epi8(0x0F);
      for (int64_t b = 0; b < group / 2; b += 16) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + b));
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const __m128i e[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
        for (int h = 0; h < 2; ++h)
          for (int q = 0; q < 2; ++q) {
            const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q ? _mm_srli_si128(e[h], 8) : e[h]));
            _mm256_storeu_ps(ob + 2 * b + 16 * h + 8 * q, _mm256_mul_ps(_mm256_sub_ps(f, voff), vs));
          }
      }
    }
  }
}

}  // namespace

// fp32 [N, K] weight from the packed layout (prefill path: dequantize a block, then sgemm). `out`, when given,
// is a reused scratch buffer: a fresh multi-MB allocation per block costs its page faults on every call.
torch::Tensor int4_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros, int64_t group,
                              c10::optional<torch::Tensor> out_buf) {
  const int64_t N = packed.size(0), K = packed.size(1) * 8;
  check_int4_args(packed, scales, zeros, K, group);
  auto out = dequant_output(out_buf, N, K);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int32_t>());
  const float* s = scales.data_ptr<float>();
  const int8_t* z = (zeros.defined() && zeros.numel()) ? zeros.data_ptr<int8_t>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, rows_per_task(N, K), [&](int64_t begin, int64_t end) {
    int4_dequant_rows(w, s, z, K, group, begin, end, o + begin * K);
  });
  return out;
}

namespace {

// 16 FP8 E4M3 bytes -> two vectors of 8 floats, each 2^-8 times the true value. E4M3's sign/exponent/mantissa
// moved into fp16's bit positions is the same number scaled by 2^(7-15) (subnormals included), and F16C turns
// that into fp32 in one instruction; the 2^8 is folded into the row scale. (0x7F, NaN in E4M3, reads as 480.)
inline void fp8x16_to_f32(const uint8_t* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
  const __m256i body = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7);
  const __m256i h = _mm256_or_si256(sign, body);
  a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

template <int MB>
inline void fp8_row(const uint8_t* w, float scale, const float* x, int64_t K, float* out, int64_t out_stride) {
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m256 w0, w1;
    fp8x16_to_f32(w + k, w0, w1);
    for (int i = 0; i < MB; ++i) {
      acc[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * K + k), acc[i]);
      acc[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * K + k + 8), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) out[i * out_stride] = hsum(acc[i]) * scale * 256.f;
}

// Rows [r0, r1) of an int8 weight as fp32 into o (row r0 first): (q - z) * s, the operations of kernels/cpu.py
// dequantize_int8 in its order (same bits).
inline void int8_dequant_rows(const int8_t* w, const float* s, const int8_t* z, int64_t K, int64_t group,
                              int64_t r0, int64_t r1, float* o) {
  const int64_t G = K / group;
  for (int64_t n = r0; n < r1; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const float sc = s[n * G + g], zp = z ? static_cast<float>(z[n * G + g]) : 0.f;
      const __m256 vs = _mm256_set1_ps(sc), vz = _mm256_set1_ps(zp);
      const int8_t* wb = w + n * K + g * group;
      float* ob = o + (n - r0) * K + g * group;
      int64_t k = 0;
      for (; k + 8 <= group; k += 8) {
        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + k))));
        if (z) f = _mm256_sub_ps(f, vz);
        _mm256_storeu_ps(ob + k, _mm256_mul_ps(f, vs));
      }
      for (; k < group; ++k) ob[k] = (z ? static_cast<float>(wb[k]) - zp : static_cast<float>(wb[k])) * sc;
    }
}

// Rows [r0, r1) of an FP8 E4M3 weight (K % 16 == 0) with per-row scales as fp32 into o (row r0 first).
inline void fp8_dequant_rows(const uint8_t* wp, const float* sp, int64_t K, int64_t r0, int64_t r1, float* o) {
  for (int64_t n = r0; n < r1; ++n) {
    const __m256 s = _mm256_set1_ps(sp[n] * 256.f);
    float* on = o + (n - r0) * K;
    for (int64_t k = 0; k < K; k += 16) {
      __m256 a, b;
      fp8x16_to_f32(wp + n * K + k, a, b);
      _mm256_storeu_ps(on + k, _mm256_mul_ps(a, s));
      _mm256_storeu_ps(on + k + 8, _mm256_mul_ps(b, s));
    }
  }
}

}  // namespace

// y[M, N] = x[M, K] @ (W_fp8 * scale[:, None])^T with W given as its raw bytes (uint8 view), per-row scales.
torch::Tensor fp8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 2-D");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous(), "w must be the uint8 view of the fp8 weight");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 16 == 0, "need K % 16 == 0 and matching shapes");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.numel() == N, "scales must be fp32 [N]");
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, rows_per_task(N, K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      // widening is most of an FP8 GEMV's work here: widen each chunk once for up to 8 activation rows
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) fp8_row<8>(wp + n * K, sp[n], xp + m * K, K, out + m * N + n, N);
      for (; m + 4 <= M; m += 4) fp8_row<4>(wp + n * K, sp[n], xp + m * K, K, out + m * N + n, N);
      for (; m + 2 <= M; m += 2) fp8_row<2>(wp + n * K, sp[n], xp + m * K, K, out + m * N + n, N);
      for (; m < M; ++m) fp8_row<1>(wp + n * K, sp[n], xp + m * K, K, out + m * N + n, N);
    }
  });
  return y;
}

// fp32 [N, K] weight from an int8 weight with group scales [N, K/group] and optional int8 zero points (prefill
// path), into `out` when given: (q - z) * s, the operations of kernels/cpu.py dequantize_int8 in its order (same
// bits), vectorized instead of five torch ops and their temporaries over the whole weight.
torch::Tensor int8_dequantize(torch::Tensor q, torch::Tensor scales, torch::Tensor zeros, int64_t group,
                              c10::optional<torch::Tensor> out_buf) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "w must be contiguous int8 2-D");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(group > 0 && K % group == 0, "group must divide K");
  const int64_t G = K / group;
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * G,
              "scales must be contiguous fp32 [N, K/group]");
  const bool asym = zeros.defined() && zeros.numel();
  TORCH_CHECK(!asym || (zeros.dtype() == torch::kInt8 && zeros.is_contiguous() && zeros.numel() == N * G),
              "zeros must be int8 shaped like scales");
  auto out = dequant_output(out_buf, N, K);
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const int8_t* z = asym ? zeros.data_ptr<int8_t>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, rows_per_task(N, K), [&](int64_t begin, int64_t end) {
    int8_dequant_rows(w, s, z, K, group, begin, end, o + begin * K);
  });
  return out;
}

// fp32 [N, K] weight from FP8 bytes and per-row scales (prefill path), into `out` when given (see above).
torch::Tensor fp8_dequantize(torch::Tensor w, torch::Tensor scales, c10::optional<torch::Tensor> out_buf) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.size(1) % 16 == 0, "bad fp8 weight");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = dequant_output(out_buf, N, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, rows_per_task(N, K), [&](int64_t begin, int64_t end) {
    fp8_dequant_rows(wp, sp, K, begin, end, o + begin * K);
  });
  return out;
}

// BLAS sgemm (Fortran interface, 32-bit ints) from the MKL that libtorch_cpu links in and exports; weak, so a
// torch build without it still loads this extension and fused_dequant_sgemm multiplies through at::mm instead.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {

// y = x @ W^T for a weight stored quantized, in one parallel region: each thread dequantizes a block of W's rows
// into its own buffer and multiplies it by all of x right away (sgemm on the calling thread: MKL runs one thread
// inside a parallel region), writing y's columns in place. Against dequantizing the whole layer and then running
// one sgemm, the block is read back from the core's own cache instead of L3/DRAM, and a layer is one fork/join
// instead of two: on a shared machine every extra fork/join can wait a time slice for a descheduled thread.
// deq(r0, r1, out) writes rows [r0, r1) as fp32, K floats a row. block_bytes: a block's fp32 size at most.
template <class Deq>
torch::Tensor fused_dequant_sgemm(const torch::Tensor& x, int64_t N, int64_t block_bytes, Deq&& deq) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 2-D");
  TORCH_CHECK(block_bytes > 0, "block_bytes must be positive");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M < (int64_t{1} << 31) && N < (int64_t{1} << 31) && K < (int64_t{1} << 31), "too large for sgemm");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // blocks split evenly over the threads (each thread takes the same number of equal blocks), 8-row multiples
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + 7) / 8));
  const int64_t max_rows = std::max<int64_t>(8, block_bytes / (4 * K));
  const int64_t per_thread = (N + threads - 1) / threads;
  const int64_t per_thread_blocks = (per_thread + max_rows - 1) / max_rows;
  const int64_t rows = ((per_thread + per_thread_blocks - 1) / per_thread_blocks + 7) / 8 * 8;
  const int64_t blocks = (N + rows - 1) / rows;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    // per thread and reused: a fresh buffer above malloc's mmap threshold pays its page faults on every call
    static thread_local std::vector<float> buf;
    if (buf.size() < static_cast<size_t>(rows * K)) buf.resize(rows * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * rows, r1 = std::min(N, r0 + rows);
      deq(r0, r1, buf.data());
      const int m = static_cast<int>(r1 - r0), n = static_cast<int>(M), k = static_cast<int>(K),
                ldc = static_cast<int>(N);
      const float one = 1.f, zero = 0.f;
      if (sgemm_ != nullptr) {
        // column-major view: y^T[r0:r1, :] (ld N) = W_block^T (K x R, transposed) x x^T (K x M)
        sgemm_("T", "N", &m, &n, &k, &one, buf.data(), &k, xp, &k, &zero, yp + r0, &ldc);
      } else {
        const auto wb = torch::from_blob(buf.data(), {r1 - r0, K}, torch::kFloat32);
        y.narrow(1, r0, r1 - r0).copy_(at::mm(x, wb.t()));
      }
    }
  });
  return y;
}

}  // namespace

// x @ dequant(W)^T for the prefill path, one kernel per storage kind (fused_dequant_sgemm above); the weight's
// fp32 values are the *_dequantize ops' bits.
torch::Tensor int4_dequant_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros,
                                  int64_t group, int64_t block_bytes) {
  const int64_t N = packed.size(0), K = packed.size(1) * 8;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with the weight's K");
  check_int4_args(packed, scales, zeros, K, group);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int32_t>());
  const float* s = scales.data_ptr<float>();
  const int8_t* z = (zeros.defined() && zeros.numel()) ? zeros.data_ptr<int8_t>() : nullptr;
  return fused_dequant_sgemm(x, N, block_bytes, [&](int64_t r0, int64_t r1, float* o) {
    int4_dequant_rows(w, s, z, K, group, r0, r1, o);
  });
}

torch::Tensor int8_dequant_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor zeros,
                                  int64_t group, int64_t block_bytes) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "w must be contiguous int8 2-D");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with the weight's K");
  TORCH_CHECK(group > 0 && K % group == 0, "group must divide K");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * (K / group),
              "scales must be contiguous fp32 [N, K/group]");
  const bool asym = zeros.defined() && zeros.numel();
  TORCH_CHECK(!asym || (zeros.dtype() == torch::kInt8 && zeros.is_contiguous() && zeros.numel() == scales.numel()),
              "zeros must be int8 shaped like scales");
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const int8_t* z = asym ? zeros.data_ptr<int8_t>() : nullptr;
  return fused_dequant_sgemm(x, N, block_bytes, [&](int64_t r0, int64_t r1, float* o) {
    int8_dequant_rows(w, s, z, K, group, r0, r1, o);
  });
}

torch::Tensor fp8_dequant_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales, int64_t block_bytes) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() && w.size(1) % 16 == 0,
              "w must be the contiguous uint8 view of an fp8 weight with K % 16 == 0");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with the weight's K");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous fp32 [N]");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  return fused_dequant_sgemm(x, N, block_bytes, [&](int64_t r0, int64_t r1, float* o) {
    fp8_dequant_rows(wp, sp, K, r0, r1, o);
  });
}



namespace {

// MB activation rows against one int8 weight row ([-128, 127], e.g. W8A16, W8A8 or unpacked INT3).
// vpmaddubsw needs an unsigned operand: |w| times x carrying w's sign (llama.cpp's Q8 trick), 128*127*2 fits s16.
template <int MB>
inline void int8_row(const int8_t* w, const float* ws, const int8_t* zp, int64_t K, int64_t group,
                     const QuantizedActivations& a, int64_t m0, float* out, int64_t out_stride) {
  const int64_t nb = K / 32, blocks_per_group = group / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  float corr[MB];
  for (int i = 0; i < MB; ++i) { acc[i] = _mm256_setzero_ps(); corr[i] = 0.f; }
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
    const __m256i wabs = _mm256_sign_epi8(wv, wv);
    const int64_t g = b / blocks_per_group;
    const float s = ws[g];
    const float o = zp ? s * zp[g] : 0.f;
    for (int i = 0; i < MB; ++i) {
      const int64_t m = m0 + i;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + m * K + b * 32));
      const __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
      acc[i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(s * a.d[m * nb + b]), acc[i]);
      corr[i] += o * a.dsum[m * nb + b];
    }
  }
  for (int i = 0; i < MB; ++i) out[i * out_stride] = hsum(acc[i]) - corr[i];
}

}  // namespace

// y[M, N] = x[M, K] @ dequant(W)^T for an int8 weight [N, K] with group scales [N, K/group] (group = K: channel).
torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor zeros,
                          int64_t group) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 2-D");
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.is_contiguous(), "w must be contiguous int8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 32 == 0 && group % 32 == 0 && K % group == 0, "need K, group % 32 == 0");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * (K / group),
              "scales must be contiguous fp32 [N, K/group]");
  TORCH_CHECK(!zeros.defined() || zeros.numel() == 0 ||
              (zeros.dtype() == torch::kInt8 && zeros.is_contiguous() && zeros.numel() == scales.numel()),
              "zeros must be int8 shaped like scales");
  const QuantizedActivations a = quantize_activations(x.data_ptr<float>(), M, K, false);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const int8_t* z = (zeros.defined() && zeros.numel()) ? zeros.data_ptr<int8_t>() : nullptr;
  float* out = y.data_ptr<float>();
  const int64_t G = K / group;
  at::parallel_for(0, N, rows_per_task(N, K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* zr = z ? z + n * G : nullptr;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int8_row<4>(wp + n * K, s + n * G, zr, K, group, a, m, out + m * N + n, N);
      for (; m < M; ++m) int8_row<1>(wp + n * K, s + n * G, zr, K, group, a, m, out + m * N + n, N);
    }
  });
  return y;
}


// ---------------------------------------------------------------------------------------------------------------
// INT4 GEMV on a row-interleaved copy of the weight ("R8"), repacked once at load by int4_repack_r8.
//
// The checkpoint layout keeps each row contiguous, so a kernel reading it ends every row with a horizontal sum
// and a per-row offset term, and broadcasts each row's scales lane by lane: at K = 576 (9 chunks per row) that
// per-row work costs about as much as the dot product itself. R8 interleaves 8 rows in 4-byte units, so one
// 32-byte load holds 4 bytes (8 nibbles) of 8 rows, each 32-bit lane belongs to one row, and the whole kernel is
// vertical: one int8 activation word broadcast per unit, the block's 8 row scales one load, no horizontal sums,
// 8 outputs per store. Layout of a group of 8 rows (nb = K/32 blocks, 4 units of 4 bytes per block and row):
//   w[((g * nb + b) * 4 + u) * 32 + 4 * r + t] = byte 16b + 4u + t of row 8g + r (elements 32b + 8u + 2t, +1)
//   s[(g * G + j) * 8 + r] = scale of group j of row 8g + r;  z likewise (int8), or empty (symmetric)
// Rows past N up to a multiple of 8 are zero (scale 0) and never stored. The tensor returned for w is a view of
// its first N rows, so N = w.size(0) and the storage still holds the padding.
namespace {

// Software prefetch distance in bytes of the R8 weight stream (and, scaled, of its scales): streamed from DRAM
// one core keeps too few misses in flight on its own (default model's layers, 1 thread: ~10 GB/s without,
// ~15 GB/s at 4 KiB; 512 B-2 KiB gained less, 8 KiB and more lost again).
constexpr int64_t R8_PREFETCH = 4096;
struct R8Activations {
  std::vector<int8_t> q;     // [M, K]: per block, per unit u the 4 even elements of 8u..8u+7, then the 4 odd ones
  std::vector<float> d;      // [M, K/32] block scales
  std::vector<float> dsum;   // [M, K/32] block scale * sum of the block's int8 values
};

// Per 32-element block: d = amax / 127, q = round-to-nearest-even(x / d) (as quantize_activations does).
void quantize_r8(const float* x, int64_t M, int64_t K, R8Activations& a, bool nibble_order = true) {
  const int64_t nb = K / 32;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.dsum.resize(M * nb);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * 32;
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * i), abs_mask));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float d = _mm_cvtss_f32(h) / 127.f;
      const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
      alignas(32) int32_t v[32];
      for (int i = 0; i < 4; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(v + 8 * i),
                           _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), inv)));
      int8_t* qb = a.q.data() + m * K + b * 32;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        sum += v[i];
        // nibble order: per unit of 8, the 4 even elements then the 4 odd ones (INT4); else as given (INT8)
        qb[nibble_order ? (i & ~7) + (i & 1) * 4 + (i & 7) / 2 : i] = static_cast<int8_t>(v[i]);
      }
      a.d[m * nb + b] = d;
      a.dsum[m * nb + b] = d * static_cast<float>(sum);
    }
  }
}

// Two cache lines of weights (one block of 8 rows at INT4) and one line of scales ahead every 64 bytes of them
// (every other block for fp32 scales of 32-element groups, every fourth for bf16).
template <typename S>
inline void r8_prefetch(const void* w, const S* s, int64_t b) {
  _mm_prefetch(static_cast<const char*>(w) + R8_PREFETCH, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(w) + R8_PREFETCH + 64, _MM_HINT_T0);
  if ((b & (64 / (8 * sizeof(S)) - 1)) == 0)
    _mm_prefetch(reinterpret_cast<const char*>(s) + R8_PREFETCH * sizeof(S) / 16, _MM_HINT_T0);
}

// 8 group scales as fp32: stored as fp32, or as bf16 (the top half of an fp32, so widening is exact).
inline __m256 load_scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The float part shared by both instruction sets, in one order so that they agree bit for bit (the integer dot
// products are exact in both): acc += dot * (s * d_x) + s * (base - z) * d_x * sum(x_q), base -8 for INT4's
// nibble offset, 0 for INT8.
struct R8Scales {
  __m256 s, off;  // the 8 rows' scales of the current group, and s * (-8 - z)
  template <typename S>
  inline void load(const S* sp, const int8_t* zp, float base = -8.f) {
    s = load_scales8(sp);
    __m256 o = _mm256_set1_ps(base);
    if (zp) o = _mm256_sub_ps(o, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zp)))));
    off = _mm256_mul_ps(s, o);
  }
};

inline __m256 r8_accumulate(__m256 acc, __m256i dot, const R8Scales& sc, float d, float dsum) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc.s, _mm256_set1_ps(d)), acc);
  return _mm256_fmadd_ps(sc.off, _mm256_set1_ps(dsum), acc);
}

inline void r8_store(float* out, int64_t ldo, int i, __m256 acc, int64_t valid) {
  if (valid == 8) {
    _mm256_storeu_ps(out + i * ldo, acc);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, acc);
  for (int64_t r = 0; r < valid; ++r) out[i * ldo + r] = tmp[r];
}

// One group of 8 weight rows against MB activation rows (AVX2: vpmaddubsw pairs summed in int16 over a block's
// 8 products per lane pair, at most 8 * 2 * 15 * 127 = 30480, then vpmaddwd to int32).
template <int MB, typename S>
inline void int4_r8_group_avx2(const uint8_t* w, const S* s, const int8_t* z, int64_t K, int64_t bpg,
                               const R8Activations& a, int64_t m0, float* out, int64_t ldo, int64_t valid) {
  const int64_t nb = K / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  R8Scales sc;
  for (int64_t b = 0; b < nb; ++b) {
    if (b % bpg == 0) sc.load(s + (b / bpg) * 8, z ? z + (b / bpg) * 8 : nullptr);
    r8_prefetch(w + b * 128, s + b / bpg * 8, b);
    __m256i d16[MB];
    for (int i = 0; i < MB; ++i) d16[i] = _mm256_setzero_si256();
    for (int u = 0; u < 4; ++u) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 4 + u) * 32));
      const __m256i lo = _mm256_and_si256(wv, mask), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
      for (int i = 0; i < MB; ++i) {
        const int8_t* xq = a.q.data() + (m0 + i) * K + b * 32 + u * 8;
        d16[i] = _mm256_add_epi16(d16[i], _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xq))),
            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xq + 4)))));
      }
    }
    for (int i = 0; i < MB; ++i)
      acc[i] = r8_accumulate(acc[i], _mm256_madd_epi16(d16[i], ones), sc, a.d[(m0 + i) * nb + b],
                             a.dsum[(m0 + i) * nb + b]);
  }
  for (int i = 0; i < MB; ++i) r8_store(out, ldo, i, acc[i], valid);
}

// The same with AVX-512 VNNI on 256-bit vectors (vpdpbusd: u8 x s8 products summed into int32 lanes in one
// instruction, where AVX2 needs vpmaddubsw + vpaddw + vpmaddwd). Compiled for that target only; called only when
// the CPU and OS allow it (r8_isa).
#define QTOOLKIT_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
template <int MB, typename S>
QTOOLKIT_VNNI void int4_r8_group_vnni(const uint8_t* w, const S* s, const int8_t* z, int64_t K, int64_t bpg,
                                      const R8Activations& a, int64_t m0, float* out, int64_t ldo, int64_t valid) {
  const int64_t nb = K / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  R8Scales sc;
  for (int64_t b = 0; b < nb; ++b) {
    if (b % bpg == 0) sc.load(s + (b / bpg) * 8, z ? z + (b / bpg) * 8 : nullptr);
    r8_prefetch(w + b * 128, s + b / bpg * 8, b);
    __m256i lo_acc[MB], hi_acc[MB];
    for (int i = 0; i < MB; ++i) lo_acc[i] = hi_acc[i] = _mm256_setzero_si256();
    for (int u = 0; u < 4; ++u) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 4 + u) * 32));
      const __m256i lo = _mm256_and_si256(wv, mask), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
      for (int i = 0; i < MB; ++i) {
        const int8_t* xq = a.q.data() + (m0 + i) * K + b * 32 + u * 8;
        lo_acc[i] = _mm256_dpbusd_epi32(lo_acc[i], lo, _mm256_set1_epi32(load_i32(xq)));
        hi_acc[i] = _mm256_dpbusd_epi32(hi_acc[i], hi, _mm256_set1_epi32(load_i32(xq + 4)));
      }
    }
    for (int i = 0; i < MB; ++i)
      acc[i] = r8_accumulate(acc[i], _mm256_add_epi32(lo_acc[i], hi_acc[i]), sc, a.d[(m0 + i) * nb + b],
                             a.dsum[(m0 + i) * nb + b]);
  }
  for (int i = 0; i < MB; ++i) r8_store(out, ldo, i, acc[i], valid);
}

constexpr int64_t R8_AVX2 = 0, R8_VNNI = 1;

// AVX-512 VNNI where kernels/cpu_isa.h allows it (CPU, OS and ATEN_CPU_CAPABILITY), else AVX2.
int64_t r8_auto_isa() { return qtoolkit_isa::avx512_vnni() ? R8_VNNI : R8_AVX2; }

template <int MB, typename S>
inline void int4_r8_group(int64_t isa, const uint8_t* w, const S* s, const int8_t* z, int64_t K, int64_t bpg,
                          const R8Activations& a, int64_t m0, float* out, int64_t ldo, int64_t valid) {
  if (isa == R8_VNNI) int4_r8_group_vnni<MB>(w, s, z, K, bpg, a, m0, out, ldo, valid);
  else int4_r8_group_avx2<MB>(w, s, z, K, bpg, a, m0, out, ldo, valid);
}

}  // namespace

// The R8 copy of a pack-quantized INT4 weight (see above): (w [N, K/2] uint8 view over N8 rows, s [N8/8, G, 8],
// z [N8/8, G, 8] or empty).
std::vector<torch::Tensor> int4_repack_r8(torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros,
                                          int64_t group) {
  const int64_t N = packed.size(0), K = packed.size(1) * 8;
  check_int4_args(packed, scales, zeros, K, group);
  const int64_t N8 = (N + 7) / 8 * 8, nb = K / 32, G = K / group;
  const bool asym = zeros.defined() && zeros.numel();
  auto w = torch::zeros({N8, K / 2}, torch::kUInt8);
  auto s = torch::zeros({N8 / 8, G, 8}, torch::kFloat32);
  auto z = asym ? torch::zeros({N8 / 8, G, 8}, torch::kInt8) : torch::empty({0}, torch::kInt8);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(packed.data_ptr<int32_t>());
  uint8_t* dst = w.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / 8, r = n % 8;
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t u = 0; u < 4; ++u)
        std::memcpy(dst + ((g * nb + b) * 4 + u) * 32 + 4 * r, src + n * (K / 2) + 16 * b + 4 * u, 4);
    for (int64_t j = 0; j < G; ++j) {
      s.data_ptr<float>()[(g * G + j) * 8 + r] = scales.data_ptr<float>()[n * G + j];
      if (asym) z.data_ptr<int8_t>()[(g * G + j) * 8 + r] = zeros.data_ptr<int8_t>()[n * G + j];
    }
  }
  // Scales that bf16 holds exactly (a checkpoint's bf16 weight_scale, widened at load) are stored as bf16: at
  // 32-element groups fp32 scales are a fifth of the bytes a decode step streams, bf16 ones a tenth, and the
  // kernel widens them exactly, so the output is the same bits.
  const bool bf16_exact = torch::equal(s.to(torch::kBFloat16).to(torch::kFloat32), s);
  return {w.narrow(0, 0, N), bf16_exact ? s.to(torch::kBFloat16) : s, z};
}

namespace {

// Groups [g0, g1) of 8 rows of an R8 INT4 weight (N rows) against the M rows of `acts`: out[m * N + 8g + r].
// The one loop over groups, for the batched GEMV (int4_matmul_r8) and the decode loop's single-row path.
template <typename S>
void int4_r8_span(int64_t isa, const uint8_t* wp, const S* sp, const int8_t* zp, int64_t N, int64_t K,
                  int64_t group, const R8Activations& acts, int64_t M, int64_t g0, int64_t g1, float* out) {
  const int64_t G = K / group, bpg = group / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = wp + g * 8 * (K / 2);
    const S* sg = sp + g * G * 8;
    const int8_t* zg = zp ? zp + g * G * 8 : nullptr;
    const int64_t valid = std::min<int64_t>(8, N - g * 8);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) int4_r8_group<4>(isa, wg, sg, zg, K, bpg, acts, m, out + m * N + g * 8, N, valid);
    for (; m + 2 <= M; m += 2) int4_r8_group<2>(isa, wg, sg, zg, K, bpg, acts, m, out + m * N + g * 8, N, valid);
    for (; m < M; ++m) int4_r8_group<1>(isa, wg, sg, zg, K, bpg, acts, m, out + m * N + g * 8, N, valid);
  }
}

template <typename S>
void int4_r8_rows(int64_t isa, const R8Activations& acts, int64_t M, int64_t N, int64_t K, int64_t group,
                  const uint8_t* wp, const S* sp, const int8_t* zp, float* out) {
  at::parallel_for(0, (N + 7) / 8, std::max<int64_t>(1, rows_per_task(N, K) / 8), [&](int64_t begin, int64_t end) {
    int4_r8_span(isa, wp, sp, zp, N, K, group, acts, M, begin, end, out);
  });
}

}  // namespace

// y[M, N] = x[M, K] @ dequant(W)^T from the R8 copy; isa -1 picks by CPU (r8_auto_isa), 0 AVX2, 1 AVX-512 VNNI.
torch::Tensor int4_matmul_r8(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor z, int64_t group,
                             int64_t isa) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), N8 = (N + 7) / 8 * 8;
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.size(1) * 2 == K && K % 32 == 0 && group % 32 == 0 &&
              K % group == 0 && w.storage().nbytes() >= static_cast<size_t>((w.storage_offset() + N8 * K / 2)),
              "w must be an int4_repack_r8 weight matching x's K");
  TORCH_CHECK((s.dtype() == torch::kFloat32 || s.dtype() == torch::kBFloat16) && s.numel() == N8 * (K / group),
              "s must be int4_repack_r8's scales");
  TORCH_CHECK(z.numel() == 0 || (z.dtype() == torch::kInt8 && z.numel() == s.numel()), "bad zero points");
  if (isa < 0) isa = r8_auto_isa();
  TORCH_CHECK(isa == R8_AVX2 || (isa == R8_VNNI && r8_auto_isa() == R8_VNNI), "this CPU cannot run that ISA");
  static thread_local R8Activations a;  // reused: a decode step makes ~120 of these calls
  quantize_r8(x.data_ptr<float>(), M, K, a);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* zp = z.numel() ? z.data_ptr<int8_t>() : nullptr;
  if (s.dtype() == torch::kBFloat16)
    int4_r8_rows(isa, a, M, N, K, group, w.data_ptr<uint8_t>(), s.data_ptr<at::BFloat16>(), zp, y.data_ptr<float>());
  else
    int4_r8_rows(isa, a, M, N, K, group, w.data_ptr<uint8_t>(), s.data_ptr<float>(), zp, y.data_ptr<float>());
  return y;
}


namespace {

// INT8 weights in R8 (W8A16 layers, the INT8 LM head): 8 rows interleaved in 4-byte units, 8 units per 32-element
// block: w[((g * nb + b) * 8 + u) * 32 + 4 * r + t] = element 32b + 4u + t of row 8g + r. vpmaddubsw and vpdpbusd
// need one unsigned operand: |w| times x carrying w's sign (|-128| reads as 128 unsigned).
template <int MB>
inline void int8_r8_group_avx2(const int8_t* w, const float* s, const int8_t* z, int64_t K, int64_t bpg,
                               const R8Activations& a, int64_t m0, float* out, int64_t ldo, int64_t valid) {
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  R8Scales sc;
  for (int64_t b = 0; b < nb; ++b) {
    if (b % bpg == 0) sc.load(s + (b / bpg) * 8, z ? z + (b / bpg) * 8 : nullptr, 0.f);
    r8_prefetch(w + b * 256, s + b / bpg * 8, b);
    r8_prefetch(w + b * 256 + 128, s, 1);
    __m256i d32[MB];
    for (int i = 0; i < MB; ++i) d32[i] = _mm256_setzero_si256();
    for (int u = 0; u < 8; ++u) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 8 + u) * 32));
      const __m256i wabs = _mm256_sign_epi8(wv, wv);
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_set1_epi32(load_i32(a.q.data() + (m0 + i) * K + b * 32 + u * 4));
        d32[i] = _mm256_add_epi32(d32[i], _mm256_madd_epi16(
            _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)), ones));
      }
    }
    for (int i = 0; i < MB; ++i)
      acc[i] = r8_accumulate(acc[i], d32[i], sc, a.d[(m0 + i) * nb + b], a.dsum[(m0 + i) * nb + b]);
  }
  for (int i = 0; i < MB; ++i) r8_store(out, ldo, i, acc[i], valid);
}

template <int MB>
QTOOLKIT_VNNI void int8_r8_group_vnni(const int8_t* w, const float* s, const int8_t* z, int64_t K, int64_t bpg,
                                      const R8Activations& a, int64_t m0, float* out, int64_t ldo, int64_t valid) {
  const int64_t nb = K / 32;
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  R8Scales sc;
  for (int64_t b = 0; b < nb; ++b) {
    if (b % bpg == 0) sc.load(s + (b / bpg) * 8, z ? z + (b / bpg) * 8 : nullptr, 0.f);
    r8_prefetch(w + b * 256, s + b / bpg * 8, b);
    r8_prefetch(w + b * 256 + 128, s, 1);
    __m256i d32[MB];
    for (int i = 0; i < MB; ++i) d32[i] = _mm256_setzero_si256();
    for (int u = 0; u < 8; ++u) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 8 + u) * 32));
      const __m256i wabs = _mm256_sign_epi8(wv, wv);
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_set1_epi32(load_i32(a.q.data() + (m0 + i) * K + b * 32 + u * 4));
        d32[i] = _mm256_dpbusd_epi32(d32[i], wabs, _mm256_sign_epi8(xv, wv));
      }
    }
    for (int i = 0; i < MB; ++i)
      acc[i] = r8_accumulate(acc[i], d32[i], sc, a.d[(m0 + i) * nb + b], a.dsum[(m0 + i) * nb + b]);
  }
  for (int i = 0; i < MB; ++i) r8_store(out, ldo, i, acc[i], valid);
}

template <int MB>
inline void int8_r8_group(int64_t isa, const int8_t* w, const float* s, const int8_t* z, int64_t K, int64_t bpg,
                          const R8Activations& a, int64_t m0, float* out, int64_t ldo, int64_t valid) {
  if (isa == R8_VNNI) int8_r8_group_vnni<MB>(w, s, z, K, bpg, a, m0, out, ldo, valid);
  else int8_r8_group_avx2<MB>(w, s, z, K, bpg, a, m0, out, ldo, valid);
}

// Groups [g0, g1) of an R8 INT8 weight against the M rows of `acts`, as int4_r8_span.
void int8_r8_span(int64_t isa, const int8_t* wp, const float* sp, const int8_t* zp, int64_t N, int64_t K,
                  int64_t group, const R8Activations& acts, int64_t M, int64_t g0, int64_t g1, float* out) {
  const int64_t G = K / group, bpg = group / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* wg = wp + g * 8 * K;
    const float* sg = sp + g * G * 8;
    const int8_t* zg = zp ? zp + g * G * 8 : nullptr;
    const int64_t valid = std::min<int64_t>(8, N - g * 8);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) int8_r8_group<4>(isa, wg, sg, zg, K, bpg, acts, m, out + m * N + g * 8, N, valid);
    for (; m < M; ++m) int8_r8_group<1>(isa, wg, sg, zg, K, bpg, acts, m, out + m * N + g * 8, N, valid);
  }
}

}  // namespace

// The R8 copy of an int8 weight [N, K] with group scales [N, K/group]: (w [N, K] int8 view over N8 rows,
// s [N8/8, G, 8], z [N8/8, G, 8] or empty).
std::vector<torch::Tensor> int8_repack_r8(torch::Tensor q, torch::Tensor scales, torch::Tensor zeros,
                                          int64_t group) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "w must be contiguous int8 2-D");
  const int64_t N = q.size(0), K = q.size(1), N8 = (N + 7) / 8 * 8, nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && K % group == 0, "need K, group % 32 == 0");
  const int64_t G = K / group;
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N * G,
              "scales must be contiguous fp32 [N, K/group]");
  const bool asym = zeros.defined() && zeros.numel();
  TORCH_CHECK(!asym || (zeros.dtype() == torch::kInt8 && zeros.is_contiguous() && zeros.numel() == N * G),
              "zeros must be int8 shaped like scales");
  auto w = torch::zeros({N8, K}, torch::kInt8);
  auto s = torch::zeros({N8 / 8, G, 8}, torch::kFloat32);
  auto z = asym ? torch::zeros({N8 / 8, G, 8}, torch::kInt8) : torch::empty({0}, torch::kInt8);
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = w.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / 8, r = n % 8;
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t u = 0; u < 8; ++u)
        std::memcpy(dst + ((g * nb + b) * 8 + u) * 32 + 4 * r, src + n * K + 32 * b + 4 * u, 4);
    for (int64_t j = 0; j < G; ++j) {
      s.data_ptr<float>()[(g * G + j) * 8 + r] = scales.data_ptr<float>()[n * G + j];
      if (asym) z.data_ptr<int8_t>()[(g * G + j) * 8 + r] = zeros.data_ptr<int8_t>()[n * G + j];
    }
  }
  return {w.narrow(0, 0, N), s, z};
}

// y[M, N] = x[M, K] @ dequant(W)^T from the INT8 R8 copy; isa as int4_matmul_r8.
torch::Tensor int8_matmul_r8(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor z, int64_t group,
                             int64_t isa) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), N8 = (N + 7) / 8 * 8;
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.size(1) == K && K % 32 == 0 && group % 32 == 0 && K % group == 0 &&
              w.storage().nbytes() >= static_cast<size_t>(w.storage_offset() + N8 * K),
              "w must be an int8_repack_r8 weight matching x's K");
  TORCH_CHECK(s.dtype() == torch::kFloat32 && s.numel() == N8 * (K / group), "s must be int8_repack_r8's scales");
  TORCH_CHECK(z.numel() == 0 || (z.dtype() == torch::kInt8 && z.numel() == s.numel()), "bad zero points");
  if (isa < 0) isa = r8_auto_isa();
  TORCH_CHECK(isa == R8_AVX2 || (isa == R8_VNNI && r8_auto_isa() == R8_VNNI), "this CPU cannot run that ISA");
  static thread_local R8Activations a;
  quantize_r8(x.data_ptr<float>(), M, K, a, false);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  const int8_t* zp = z.numel() ? z.data_ptr<int8_t>() : nullptr;
  float* out = y.data_ptr<float>();
  const R8Activations& acts = a;
  at::parallel_for(0, N8 / 8, std::max<int64_t>(1, rows_per_task(N, K) / 8), [&](int64_t begin, int64_t end) {
    int8_r8_span(isa, wp, sp, zp, N, K, group, acts, M, begin, end, out);
  });
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// FP8 E4M3 GEMV on a row-interleaved copy of the weight (R8), repacked once at load by fp8_repack_r8.
//
// The checkpoint layout's row kernel (fp8_row) ends every row with a horizontal sum and widens 16 bytes per
// F16C step on 256-bit registers. In R8, 8 rows are interleaved in 4-byte units, so one 32-byte load holds 4
// elements of each of 8 rows, every lane belongs to one (row, element mod 4) pair, and the kernel is vertical:
// widen 32 bytes, multiply by the activations' 4 elements broadcast to every row, accumulate; the 4 lanes of a
// row are summed once per group of 8 rows. Layout (nu = K/4 units of 4 elements):
//   w[(g * nu + u) * 32 + 4 * r + t] = byte of element 4u + t of row 8g + r;  s[8g + r] = row 8g + r's scale
// Rows past N up to a multiple of 8 are zero (scale 0) and never stored; w is returned as a view of N rows.
//
// The weights are widened exactly (E4M3 -> fp16 bit moves, then F16C; each value 2^-8 of the true one, the 2^8
// going into the row scale), and each lane accumulates the same products in the same order at either ISA, so
// the AVX2 and AVX-512 kernels agree bit for bit, as do a row alone and in a batch.
namespace {

constexpr int64_t FP8_AVX2 = 0, FP8_AVX512 = 1;

// AVX-512 F and BW where kernels/cpu_isa.h allows them, else AVX2.
int64_t fp8_auto_isa() { return qtoolkit_isa::avx512bw() ? FP8_AVX512 : FP8_AVX2; }

// The 4 lanes of each of 8 rows (lane 4r + t), summed in one order for both ISAs, times the rows' scales
// (times 2^8, the widening's offset).
inline void fp8_r8_finish(const float* lanes, const float* s, float* out, int64_t valid) {
  for (int64_t r = 0; r < valid; ++r)
    out[r] = ((lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3])) * (s[r] * 256.f);
}

// 16 E4M3 bytes -> 16 fp16 bit patterns (2^-8 times their values, as fp8x16_to_f32): sign-extended byte shifted left by 7 puts the sign
// at bit 15, exponent and mantissa at bits 7-13; bit 14 (a copy of the sign) is cleared.
inline __m256i fp8x16_to_f16(__m128i b) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}

template <int MB>
inline void fp8_r8_group_avx2(const uint8_t* w, const float* s, int64_t K, const float* x, int64_t ldx, float* out,
                              int64_t ldo, int64_t valid) {
  const int64_t nu = K / 4;
  __m256 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nu; ++u) {
    if ((u & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + u * 32) + R8_PREFETCH, _MM_HINT_T0);
    const __m256i h0 = fp8x16_to_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + u * 32)));
    const __m256i h1 = fp8x16_to_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + u * 32 + 16)));
    const __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h0)), w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1));
    const __m256 w2 = _mm256_cvtph_ps(_mm256_castsi256_si128(h1)), w3 = _mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1));
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x + i * ldx + 4 * u));
      acc[i][0] = _mm256_fmadd_ps(w0, xv, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w1, xv, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(w2, xv, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(w3, xv, acc[i][3]);
    }
  }
  alignas(32) float lanes[32];
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < 4; ++j) _mm256_store_ps(lanes + 8 * j, acc[i][j]);
    fp8_r8_finish(lanes, s, out + i * ldo, valid);
  }
}

// The same with AVX-512 BW: 32 bytes widened in one register, two 16-lane conversions (rows 0-3, rows 4-7).
#define QTOOLKIT_AVX512BW __attribute__((target("avx2,fma,f16c,avx512f,avx512bw")))
template <int MB>
QTOOLKIT_AVX512BW void fp8_r8_group_512(const uint8_t* w, const float* s, int64_t K, const float* x, int64_t ldx,
                                        float* out, int64_t ldo, int64_t valid) {
  const int64_t nu = K / 4;
  const __m512i keep = _mm512_set1_epi16(static_cast<short>(0xBFFF));
  __m512 lo[MB], hi[MB];
  for (int i = 0; i < MB; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t u = 0; u < nu; ++u) {
    if ((u & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + u * 32) + R8_PREFETCH, _MM_HINT_T0);
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + u * 32))), 7), keep);
    const __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_broadcast_f32x4(_mm_loadu_ps(x + i * ldx + 4 * u));
      lo[i] = _mm512_fmadd_ps(w0, xv, lo[i]);
      hi[i] = _mm512_fmadd_ps(w1, xv, hi[i]);
    }
  }
  alignas(64) float lanes[32];
  for (int i = 0; i < MB; ++i) {
    _mm512_store_ps(lanes, lo[i]);
    _mm512_store_ps(lanes + 16, hi[i]);
    fp8_r8_finish(lanes, s, out + i * ldo, valid);
  }
}

template <int MB>
inline void fp8_r8_group(int64_t isa, const uint8_t* w, const float* s, int64_t K, const float* x, int64_t ldx,
                         float* out, int64_t ldo, int64_t valid) {
  if (isa == FP8_AVX512) fp8_r8_group_512<MB>(w, s, K, x, ldx, out, ldo, valid);
  else fp8_r8_group_avx2<MB>(w, s, K, x, ldx, out, ldo, valid);
}

// Groups [g0, g1) of 8 rows of an R8 FP8 weight (N rows) against the M fp32 rows of x [M, K]: out[m * N + 8g + r].
// The one loop over groups, for the batched GEMV (fp8_matmul_r8) and the decode loop's single-row path.
void fp8_r8_span(int64_t isa, const uint8_t* wp, const float* sp, int64_t N, int64_t K, const float* x, int64_t M,
                 int64_t g0, int64_t g1, float* out) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = wp + g * 8 * K;
    const float* sg = sp + g * 8;
    const int64_t valid = std::min<int64_t>(8, N - g * 8);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) fp8_r8_group<4>(isa, wg, sg, K, x + m * K, K, out + m * N + g * 8, N, valid);
    for (; m + 2 <= M; m += 2) fp8_r8_group<2>(isa, wg, sg, K, x + m * K, K, out + m * N + g * 8, N, valid);
    for (; m < M; ++m) fp8_r8_group<1>(isa, wg, sg, K, x + m * K, K, out + m * N + g * 8, N, valid);
  }
}

}  // namespace

// The R8 copy of an FP8 E4M3 weight (its uint8 view [N, K]) with per-row scales ([N] or [N, 1]): (w [N, K] uint8
// view over N8 rows, s [N8] fp32, an empty zero-point tensor), in the (w, s, z) order of the other R8 copies.
std::vector<torch::Tensor> fp8_repack_r8(torch::Tensor q, torch::Tensor scales) {
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 2 && q.is_contiguous(), "w must be the contiguous uint8 view "
              "of a 2-D fp8 weight");
  const int64_t N = q.size(0), K = q.size(1), N8 = (N + 7) / 8 * 8, nu = K / 4;
  TORCH_CHECK(K % 4 == 0 && K > 0, "need K % 4 == 0");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous fp32 with one per row");
  auto w = torch::zeros({N8, K}, torch::kUInt8);
  auto s = torch::zeros({N8}, torch::kFloat32);
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* dst = w.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / 8, r = n % 8;
    for (int64_t u = 0; u < nu; ++u) std::memcpy(dst + (g * nu + u) * 32 + 4 * r, src + n * K + 4 * u, 4);
    s.data_ptr<float>()[n] = scales.data_ptr<float>()[n];
  }
  return {w.narrow(0, 0, N), s, torch::empty({0}, torch::kInt8)};
}

// y[M, N] = x[M, K] @ (W_fp8 * s[:, None])^T from the R8 copy. z (empty) and group (K) keep the R8 GEMVs' one
// argument order; isa -1 picks by CPU (fp8_auto_isa), 0 AVX2, 1 AVX-512.
torch::Tensor fp8_matmul_r8(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor z, int64_t group,
                            int64_t isa) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), N8 = (N + 7) / 8 * 8;
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.size(1) == K && K % 4 == 0 && group == K &&
              w.storage().nbytes() >= static_cast<size_t>(w.storage_offset() + N8 * K),
              "w must be an fp8_repack_r8 weight matching x's K");
  TORCH_CHECK(s.dtype() == torch::kFloat32 && s.is_contiguous() && s.numel() == N8, "s must be fp8_repack_r8's scales");
  TORCH_CHECK(z.numel() == 0, "FP8 weights have no zero points");
  if (isa < 0) isa = fp8_auto_isa();
  TORCH_CHECK(isa == FP8_AVX2 || (isa == FP8_AVX512 && fp8_auto_isa() == FP8_AVX512), "this CPU cannot run that ISA");
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N8 / 8, std::max<int64_t>(1, rows_per_task(N, K) / 8), [&](int64_t begin, int64_t end) {
    fp8_r8_span(isa, wp, sp, N, K, xp, M, begin, end, out);
  });
  return y;
}

int64_t fp8_r8_isa() { return fp8_auto_isa(); }

int64_t r8_isa() { return r8_auto_isa(); }

// kernels/cpu_decode.cpp includes this file to call its ops from C++, with its own module
#ifndef QTOOLKIT_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_matmul", &int4_matmul, "packed INT4 x fp32 matmul (AVX2, int8 activation blocks)");
  m.def("int4_repack_r8", &int4_repack_r8, "packed INT4 -> row-interleaved R8 copy (w, s, z)");
  m.def("int4_matmul_r8", &int4_matmul_r8, "R8 INT4 x fp32 matmul (AVX2 or AVX-512 VNNI)", py::arg("x"),
        py::arg("w"), py::arg("s"), py::arg("z"), py::arg("group"), py::arg("isa") = -1);
  m.def("int8_repack_r8", &int8_repack_r8, "int8 weight -> row-interleaved R8 copy (w, s, z)");
  m.def("int8_matmul_r8", &int8_matmul_r8, "R8 INT8 x fp32 matmul (AVX2 or AVX-512 VNNI)", py::arg("x"),
        py::arg("w"), py::arg("s"), py::arg("z"), py::arg("group"), py::arg("isa") = -1);
  m.def("fp8_repack_r8", &fp8_repack_r8, "FP8 E4M3 weight (uint8 view) -> row-interleaved R8 copy (w, s, z)");
  m.def("fp8_matmul_r8", &fp8_matmul_r8, "R8 FP8 x fp32 matmul (AVX2 + F16C or AVX-512 BW)", py::arg("x"),
        py::arg("w"), py::arg("s"), py::arg("z"), py::arg("group"), py::arg("isa") = -1);
  m.def("fp8_r8_isa", &fp8_r8_isa, "the ISA the FP8 R8 kernel picks on this CPU: 0 AVX2, 1 AVX-512 BW");
  m.def("r8_isa", &r8_isa, "the ISA the R8 kernels pick on this CPU: 0 AVX2, 1 AVX-512 VNNI");
  m.def("int4_dequantize", &int4_dequantize, "packed INT4 -> fp32 weight", py::arg("packed"), py::arg("scales"),
        py::arg("zeros"), py::arg("group"), py::arg("out") = py::none());
  m.def("int8_matmul", &int8_matmul, "int8 weight x fp32 matmul (AVX2, int8 activation blocks)");
  m.def("fp8_matmul", &fp8_matmul, "FP8 E4M3 weight x fp32 matmul (AVX2 + F16C)");
  m.def("int8_dequantize", &int8_dequantize, "int8 weight (group scales, optional zero points) -> fp32",
        py::arg("q"), py::arg("scales"), py::arg("zeros"), py::arg("group"), py::arg("out") = py::none());
  m.def("fp8_dequantize", &fp8_dequantize, "FP8 E4M3 weight -> fp32", py::arg("w"), py::arg("scales"),
        py::arg("out") = py::none());
  m.def("int4_dequant_matmul", &int4_dequant_matmul, "x @ dequant(packed INT4)^T, blocks dequantized in cache",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("group"),
        py::arg("block_bytes"));
  m.def("int8_dequant_matmul", &int8_dequant_matmul, "x @ dequant(int8)^T, blocks dequantized in cache",
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("zeros"), py::arg("group"), py::arg("block_bytes"));
  m.def("fp8_dequant_matmul", &fp8_dequant_matmul, "x @ dequant(FP8 E4M3)^T, blocks dequantized in cache",
        py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("block_bytes"));
}
#endif
