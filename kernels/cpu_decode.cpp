// The decoder's layer loop for decode and verify steps in one C++ call (built once by kernels/cpu_build.py).
//
// A batch-1 decode step of the default model runs 30 layers of ~9 kernels each; driven from Python, every one
// of them pays an interpreter round trip, pybind argument parsing and module attribute lookups. A DecodePlan
// holds each layer's weights, norms and KV cache once (bound at the first decode step) and runs the whole loop
// here: add+RMSNorm, the fused q|k|v GEMV, RoPE + cache append, paged attention, o_proj, add+RMSNorm, gate|up,
// SwiGLU and down_proj. It calls the very functions the Python path calls (cpu_kernels.cpp, cpu_engine_ops.cpp,
// included below in their own namespaces), in the same order on the same inputs, so its outputs are bit for bit
// those of the Python loop. Which kernel each Linear takes, and up to how many rows, is decided in
// kernels/dispatch.py (gemv_spec), the one dispatch point; this file only runs what it was given.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>
#include <cpuid.h>
#include <immintrin.h>
#include <strings.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_isa.h"  // at file scope: the two sources below include it inside their namespaces, a no-op there

#define QTOOLKIT_NO_MODULE
namespace qk {
#include "cpu_kernels.cpp"
}
namespace qe {
#include "cpu_engine_ops.cpp"
}

namespace {

// kind codes of kernels/dispatch.py GemvSpec
constexpr int64_t DENSE = 0, INT4 = 1, INT8 = 2, FP8 = 3, INT4_R8 = 4, INT8_R8 = 5, FP8_R8 = 6;

struct Linear {
  int64_t kind = DENSE, group = 0, act = -1;  // act: -1 weight-only, 0 int8 / 1 FP8 per-token activations
  torch::Tensor weight, scales, zeros, bias;  // bias undefined when the layer has none

  torch::Tensor operator()(const torch::Tensor& in) const {
    const torch::Tensor x = act >= 0 ? qe::fake_quant_tokens(in, act == 1) : in;
    torch::Tensor y;
    if (kind == DENSE) y = qe::dense_gemv(x, weight, qe::DENSE_AUTO);
    else if (kind == INT4_R8) y = qk::int4_matmul_r8(x.contiguous(), weight, scales, zeros, group, -1);
    else if (kind == INT8_R8) y = qk::int8_matmul_r8(x.contiguous(), weight, scales, zeros, group, -1);
    else if (kind == FP8_R8) y = qk::fp8_matmul_r8(x.contiguous(), weight, scales, zeros, group, -1);
    else if (kind == INT4) y = qk::int4_matmul(x.contiguous(), weight, scales, zeros, group);
    else if (kind == INT8) y = qk::int8_matmul(x.contiguous(), weight, scales, zeros, group);
    else y = qk::fp8_matmul(x.contiguous(), weight, scales);
    return bias.defined() ? y + bias : y;
  }
};

// kv codes of qtoolkit/model/decode_plan.py: the KV cache as the model holds it
constexpr int64_t KV_FP32 = 0, KV_FP8 = 1, KV_INT8 = 2;

struct Layer {
  torch::Tensor input_norm, post_attn_norm, k_cache, v_cache;
  // a quantized cache (kv FP8 E4M3 bytes as uint8, or int8): a fp32 scale per slot and KV head, and the
  // checkpoint's calibrated scales [Hk] when the cache uses them (empty otherwise: each token gets its own)
  torch::Tensor k_scales, v_scales, k_static, v_static;
  Linear qkv, o, gate_up, down;
  int64_t rope = 0, window = 0, kv = KV_FP32;
};

// An optional argument of the engine ops from a bound tensor that is empty where there is none.
inline c10::optional<torch::Tensor> unless_empty(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// ---- the single-row path (a batch-1 decode step) --------------------------------------------------------------
// At one row every kernel call above pays a fork/join of the thread pool, a tensor allocation and a cold start of
// its weight stream: the default model's INT4 layers then stream at 14-22 GB/s where the LM head, one long call,
// reaches 30. The single-row path runs all layers inside one parallel region instead: each thread takes a fixed
// share of every GEMV's output rows and meets the others at a barrier where the next op needs all of them; the
// small ops are repeated by every thread on its own copy (a 576-wide norm costs less than a barrier); and
// before each barrier a thread prefetches the start of its share of the next weight, so the stream does not
// restart cold. Every output element is computed by the same kernel code as the batched path, so the two agree
// bit for bit (tests/test_decode_plan.py).

// Weights one thread prefetches of its share of the next GEMV before a barrier: as far ahead as the GEMV kernels
// keep their own prefetch (R8_PREFETCH), so the kernel's stream continues where this one stops.
constexpr int64_t NEXT_PREFETCH = 4096;

// The single-row path's barrier (6 a layer, 180 a token on the default model). libgomp's own spins up to 300,000
// pauses before it sleeps, ~10 ms on a Xeon whose pause takes ~140 cycles: when another process holds one of the
// cores, the waiting thread burns its time slice while the thread it waits for is not running, and a token took 75
// ms instead of 4 (18 ms with OMP_WAIT_POLICY=passive, which costs 3x at idle: a futex wake-up per barrier). This
// one spins for a bounded time, which covers the waits of an idle machine (tens of microseconds), then yields the
// core to whoever is runnable (measurements/2026-12-02/issue27/intel-xeon/README.md).
class RowBarrier {
 public:
  void reset(int n) {
    n_ = n;
    count_.store(0, std::memory_order_relaxed);
  }
  // The last arrival's acquire on the counter sees every arrival's writes; it publishes them with the release of
  // the new generation, which the waiters acquire.
  void wait() {
    const unsigned gen = generation_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
    for (int i = 1; generation_.load(std::memory_order_acquire) == gen; ++i) {
      _mm_pause();
      if (i % 64 == 0 && std::chrono::steady_clock::now() > deadline) sched_yield();
    }
  }

 private:
  static constexpr int SPIN_US = 50;
  int n_ = 1;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<unsigned> generation_{0};  // unsigned: wraps after 2^32 barriers, defined
};

// How many threads a single-row step runs. Every thread computes the same bits for its rows at any team size, so
// the choice changes speed only. At idle the full team is fastest; when other processes hold the cores, every
// barrier waits for a thread that is not running, and one thread, which needs no barrier, is faster: with one
// busy process beside it a token took 21 ms at two threads and 16 at one, 66 with libgomp's barrier
// (measurements/2026-12-02/issue27/intel-xeon/loaded_ab.jsonl). The team is chosen from the steps' own wall
// times: while the full team runs near its best time nothing else is tried (no cost at idle); once it runs
// PROBE_SLOWER times slower, a one-thread step is timed at most every PROBE_EVERY steps, and whichever size has the
// smaller moving average runs; on one thread the full team is retimed every PROBE_EVERY steps, so the step returns
// to it when the machine frees up.
class RowTeam {
 public:
  // the team size of the next step, `full` being torch's thread count
  int pick(int full) {
    if (full != full_) reset(full);
    if (full_ == 1 || !adaptive) return team_ = full_;
    ++step_;
    const bool due = step_ - last_probe_ >= PROBE_EVERY;
    if (team_ == full_ && due && many_ > PROBE_SLOWER * best_) return probe(1);
    if (team_ == 1 && due) return probe(full_);
    return team_;
  }
  void record(int team, double seconds) {
    if (full_ == 1 || !adaptive) return;
    double& avg = team == 1 ? one_ : many_;
    avg = avg == 0 ? seconds : (1 - ALPHA) * avg + ALPHA * seconds;
    // the best full-team time follows a slowly growing context (attention lengthens the step) but not a jump
    if (team != 1) best_ = best_ == 0 ? seconds : std::min(seconds, best_ * 1.01);
    if (one_ > 0 && one_ < SWITCH * many_) team_ = 1;
    else if (many_ < one_) team_ = full_;
  }
  int team() const { return team_; }
  bool adaptive = true;  // cleared for A/B measurements and tests (decode_plan.py)

 private:
  static constexpr double ALPHA = 0.5, PROBE_SLOWER = 1.5, SWITCH = 0.9;
  static constexpr int64_t PROBE_EVERY = 16;
  void reset(int full) {
    full_ = team_ = full;
    step_ = 0;
    last_probe_ = -PROBE_EVERY;
    one_ = many_ = best_ = 0;
  }
  int probe(int team) {
    last_probe_ = step_;
    return team;
  }
  int full_ = 0, team_ = 0;
  int64_t step_ = 0, last_probe_ = -PROBE_EVERY;
  double one_ = 0, many_ = 0, best_ = 0;
};

inline std::pair<int64_t, int64_t> share(int64_t n, int t, int P) { return {n * t / P, n * (t + 1) / P}; }

// A Linear's unit of output: a group of 8 rows for the R8 kernels, one row for dense.
inline int64_t unit_rows(const Linear& L) { return L.kind == DENSE ? 1 : 8; }
inline int64_t units(const Linear& L) { return (L.weight.size(0) + unit_rows(L) - 1) / unit_rows(L); }
inline int64_t in_features(const Linear& L) { return L.kind == INT4_R8 ? L.weight.size(1) * 2 : L.weight.size(1); }
inline int64_t unit_bytes(const Linear& L) {  // R8: 8 rows of K/2 (INT4) or K (INT8, FP8) bytes
  return L.kind == DENSE ? L.weight.size(1) * 4 : 8 * L.weight.size(1);
}

// The kernels the single-row path runs: R8 INT4/INT8/FP8 or contiguous fp32, fp32 scales and bias; quantized
// weights with or without per-token activation quantization (each thread quantizes its own copy of the row).
inline bool row_path_ok(const Linear& L) {
  const bool weight = L.kind == INT4_R8 || L.kind == FP8_R8 ? L.weight.scalar_type() == torch::kByte
                    : L.kind == INT8_R8 ? L.weight.scalar_type() == torch::kChar
                    : L.kind == DENSE && L.weight.scalar_type() == torch::kFloat && L.weight.is_contiguous();
  const bool scales = L.kind == DENSE ||
      ((L.scales.scalar_type() == torch::kFloat || (L.kind == INT4_R8 && L.scales.scalar_type() == torch::kBFloat16))
       && (L.zeros.numel() == 0 || L.zeros.scalar_type() == torch::kChar));
  const bool bias = !L.bias.defined() || (L.bias.scalar_type() == torch::kFloat && L.bias.is_contiguous());
  return (L.act < 0 || L.kind != DENSE) && weight && scales && bias;
}

inline void prefetch_units(const Linear& L, int64_t u0) {
  const char* p = static_cast<const char*>(L.weight.data_ptr()) + u0 * unit_bytes(L);
  for (int64_t o = 0; o < NEXT_PREFETCH; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

// The row as L's kernel reads it: per-token quantize-dequantized into `xq` first when L quantizes its
// activations (fake_quant_tokens' operations on one row: the batched path's bits), then for the INT4/INT8
// kernels int8 blocks in `a`. Returns the fp32 row the kernel reads (dense, FP8).
inline const float* prepare(const Linear& L, const float* x, qk::R8Activations& a, std::vector<float>& xq) {
  const int64_t K = in_features(L);
  if (L.act >= 0) {
    xq.resize(K);
    qe::fake_quant_row(x, K, L.act == 1, xq.data());
    x = xq.data();
  }
  if (L.kind == INT4_R8 || L.kind == INT8_R8) qk::quantize_r8(x, 1, K, a, L.kind == INT4_R8);
  return x;
}

// Output units [u0, u1) of y = L(x) for one row, bias included (added after the dot product, as y + bias).
void gemv_units(const Linear& L, int64_t isa, const float* x, const qk::R8Activations& a, int64_t u0, int64_t u1,
                float* y) {
  const int64_t N = L.weight.size(0), K = in_features(L);
  if (L.kind == DENSE) {
    qe::gemv_span_f32(qe::DENSE_AUTO, x, 1, K, L.weight.data_ptr<float>(), N, y, u0, u1);
  } else if (L.kind == FP8_R8) {
    qk::fp8_r8_span(qk::fp8_auto_isa(), L.weight.data_ptr<uint8_t>(), L.scales.data_ptr<float>(), N, K, x, 1, u0, u1,
                    y);
  } else {
    const int8_t* z = L.zeros.numel() ? L.zeros.data_ptr<int8_t>() : nullptr;
    if (L.kind == INT8_R8)
      qk::int8_r8_span(isa, L.weight.data_ptr<int8_t>(), L.scales.data_ptr<float>(), z, N, K, L.group, a, 1, u0, u1, y);
    else if (L.scales.scalar_type() == torch::kBFloat16)
      qk::int4_r8_span(isa, L.weight.data_ptr<uint8_t>(), L.scales.data_ptr<at::BFloat16>(), z, N, K, L.group, a, 1,
                       u0, u1, y);
    else
      qk::int4_r8_span(isa, L.weight.data_ptr<uint8_t>(), L.scales.data_ptr<float>(), z, N, K, L.group, a, 1, u0,
                       u1, y);
  }
  if (L.bias.defined()) {
    const float* b = L.bias.data_ptr<float>();
    for (int64_t n = u0 * unit_rows(L); n < std::min(N, u1 * unit_rows(L)); ++n) y[n] = y[n] + b[n];
  }
}

// One thread's buffers of the single-row path.
struct RowScratch {
  qk::R8Activations acts;
  std::vector<float> xq;  // the row quantize-dequantized per token, for Linears that quantize activations
  std::vector<float> residual, normed, q, attend_buf, rotated;
};

using Clock = std::chrono::steady_clock;

}  // namespace

// Per-layer tensors, in this order: input_norm, post_attn_norm, k_cache, v_cache, then for qkv, o, gate_up, down:
// weight, scales, zeros, bias (any tensor when the flag says none), then k_scales, v_scales, k_static, v_static
// (empty when the cache is fp32 / has no calibrated scales). Per-layer ints: rope index, window (0 = none), then
// for each Linear: kind, group, has_bias, act; then the cache's kv code.
class DecodePlan {
 public:
  static constexpr int64_t TENSORS = 4 + 4 * 4 + 4, INTS = 2 + 4 * 4 + 1;

  DecodePlan(const std::vector<torch::Tensor>& tensors, const std::vector<int64_t>& ints, int64_t heads,
             int64_t kv_heads, double eps, double scale)
      : H_(heads), Hk_(kv_heads), eps_(eps), scale_(scale) {
    TORCH_CHECK(tensors.size() % TENSORS == 0 && ints.size() % INTS == 0 &&
                tensors.size() / TENSORS == ints.size() / INTS, "tensors and ints do not describe the same layers");
    for (size_t l = 0; l < ints.size() / INTS; ++l) {
      const torch::Tensor* t = tensors.data() + l * TENSORS;
      const int64_t* n = ints.data() + l * INTS;
      Layer layer;
      layer.input_norm = t[0];
      layer.post_attn_norm = t[1];
      layer.k_cache = t[2];
      layer.v_cache = t[3];
      layer.rope = n[0];
      layer.window = n[1];
      Linear* lins[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
      for (int j = 0; j < 4; ++j) {
        lins[j]->weight = t[4 + 4 * j];
        lins[j]->scales = t[5 + 4 * j];
        lins[j]->zeros = t[6 + 4 * j];
        lins[j]->kind = n[2 + 4 * j];
        lins[j]->group = n[3 + 4 * j];
        if (n[4 + 4 * j]) lins[j]->bias = t[7 + 4 * j];
        lins[j]->act = n[5 + 4 * j];
      }
      layer.k_scales = t[20];
      layer.v_scales = t[21];
      layer.k_static = t[22];
      layer.v_static = t[23];
      layer.kv = n[18];
      TORCH_CHECK(layer.kv >= KV_FP32 && layer.kv <= KV_INT8, "kv must be 0 (fp32), 1 (fp8) or 2 (int8)");
      layers_.push_back(std::move(layer));
    }
    row_path_ = !layers_.empty();
    for (const Layer& L : layers_) {
      for (const Linear* lin : {&L.qkv, &L.o, &L.gate_up, &L.down}) row_path_ = row_path_ && row_path_ok(*lin);
      for (const torch::Tensor* n : {&L.input_norm, &L.post_attn_norm})
        row_path_ = row_path_ && n->scalar_type() == torch::kFloat && n->is_contiguous();
      row_path_ = row_path_ && row_cache_ok(L);
      // the gate and up halves of gate_up must split at a unit boundary, so a thread's gate rows meet its up rows
      row_path_ = row_path_ && units(L.gate_up) % 2 == 0 &&
                  units(L.gate_up) * unit_rows(L.gate_up) == L.gate_up.weight.size(0);
    }
  }

  // x [T, hidden] fp32 embeddings; cos/sin [ropes, T, D/2]; slots [T]; block_table/row_seq/row_last as
  // paged_attention takes them; aux_layers: EAGLE-3 taps (the residual stream entering each of these layers).
  // Returns (x, residual) after the last layer (the model adds and norms them), then one tap per aux layer.
  std::vector<torch::Tensor> run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& slots, const torch::Tensor& block_table,
                                 const torch::Tensor& row_seq, const torch::Tensor& row_last,
                                 const std::vector<int64_t>& aux_layers) {
    if (x.size(0) == 1 && row_path_ && use_row_path_)
      return run_row(x, cos, sin, slots, block_table, row_seq, row_last, aux_layers);
    torch::Tensor residual;
    std::vector<torch::Tensor> taps(aux_layers.size());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      for (size_t j = 0; j < aux_layers.size(); ++j)
        if (aux_layers[j] == static_cast<int64_t>(l)) taps[j] = residual.defined() ? x + residual : x;
      auto t0 = Clock::now();
      auto normed = qe::add_rms_norm(x.contiguous(), residual.defined() ? c10::optional<torch::Tensor>(residual)
                                                                          : c10::nullopt, L.input_norm, eps_);
      residual = normed[1];
      auto t1 = Clock::now();
      auto qkv = L.qkv(normed[0]);
      auto t2 = Clock::now();
      torch::Tensor a;
      if (L.kv == KV_FP32) {
        auto q = qe::rope_and_cache(qkv.contiguous(), cos[L.rope], sin[L.rope], L.k_cache, L.v_cache, slots, H_, Hk_);
        a = qe::paged_attention(q, L.k_cache, L.v_cache, block_table, row_seq, row_last, scale_, L.window,
                                c10::nullopt, c10::nullopt);
      } else {
        auto q = qe::rope_and_cache_quant(qkv.contiguous(), cos[L.rope], sin[L.rope], L.k_cache, L.v_cache,
                                          L.k_scales, L.v_scales, slots, H_, Hk_, L.kv == KV_FP8,
                                          unless_empty(L.k_static), unless_empty(L.v_static));
        a = qe::paged_attention(q, L.k_cache, L.v_cache, block_table, row_seq, row_last, scale_, L.window,
                                L.k_scales, L.v_scales);
      }
      auto t3 = Clock::now();
      auto o = L.o(a);
      auto t4 = Clock::now();
      normed = qe::add_rms_norm(o.contiguous(), residual, L.post_attn_norm, eps_);
      residual = normed[1];
      auto t5 = Clock::now();
      auto gate_up = L.gate_up(normed[0]);
      auto t6 = Clock::now();
      auto act = qe::silu_mul(gate_up);
      auto t7 = Clock::now();
      x = L.down(act);
      auto t8 = Clock::now();
      gemv_ += seconds(t1, t2) + seconds(t3, t4) + seconds(t5, t6) + seconds(t7, t8);
      attention_ += seconds(t2, t3);
      other_ += seconds(t0, t1) + seconds(t4, t5) + seconds(t6, t7);
    }
    std::vector<torch::Tensor> out{x, residual};
    out.insert(out.end(), taps.begin(), taps.end());
    return out;
  }

  // Seconds spent since the last reset: (weight GEMVs, attention incl. RoPE and the cache write, other ops).
  std::vector<double> times() const { return {gemv_, attention_, other_}; }
  void reset_times() { gemv_ = attention_ = other_ = 0.0; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool row_path() const { return row_path_ && use_row_path_; }
  int64_t row_team() const { return team_.team(); }
  bool adaptive_team() const { return team_.adaptive; }
  void set_adaptive_team(bool on) { team_.adaptive = on; }
  void set_row_path(bool on) { use_row_path_ = on; }

  // The single-row path (see above): one parallel region over all layers.
  std::vector<torch::Tensor> run_row(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& slots, const torch::Tensor& block_table,
                                     const torch::Tensor& row_seq, const torch::Tensor& row_last,
                                     const std::vector<int64_t>& aux_layers) {
    const Layer& L0 = layers_[0];
    const int64_t hidden = x.size(1), D = L0.k_cache.size(3), bs = L0.k_cache.size(1);
    const int64_t B = block_table.size(1), capacity = L0.k_cache.numel() / (Hk_ * D);
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous fp32");
    TORCH_CHECK(slots.scalar_type() == torch::kLong && block_table.scalar_type() == torch::kLong &&
                row_seq.scalar_type() == torch::kLong && row_last.scalar_type() == torch::kLong, "int64 indices");
    RowStep st;
    st.slot = slots.contiguous().data_ptr<int64_t>()[0];
    st.last = row_last.contiguous().data_ptr<int64_t>()[0];
    const int64_t seq = row_seq.contiguous().data_ptr<int64_t>()[0];
    TORCH_CHECK(st.slot >= 0 && st.slot < capacity, "slot out of range");
    TORCH_CHECK(st.last >= 0 && st.last / bs < B && seq >= 0 && seq < block_table.size(0), "row 0 is out of range");
    auto table = block_table.contiguous();
    st.table = table.data_ptr<int64_t>() + seq * B;
    auto cosc = cos.contiguous(), sinc = sin.contiguous();
    st.cos = cosc.data_ptr<float>();
    st.sin = sinc.data_ptr<float>();
    st.x = x.data_ptr<float>();
    st.aux = &aux_layers;
    for (size_t j = 0; j < aux_layers.size(); ++j) st.taps.push_back(torch::empty({1, hidden}, x.options()));
    const int64_t I = L0.gate_up.weight.size(0) / 2;
    qkv_.resize((H_ + 2 * Hk_) * D);
    attn_.resize(H_ * D);
    o_.resize(hidden);
    act_.resize(I);
    gate_up_.resize(2 * I);
    y_.resize(hidden);
    const int full = std::max(1, at::get_num_threads()), threads = team_.pick(full);
    scratch_.resize(full);
    for (RowScratch& r : scratch_) {
      r.residual.resize(hidden);
      r.normed.resize(hidden);
      r.q.resize(H_ * D);
      r.rotated.resize(D);
    }
    const auto start = Clock::now();
#pragma omp parallel num_threads(threads)
    {
      // the team may be smaller than asked (a nested call gets one thread): the barrier counts the real one
      if (omp_get_thread_num() == 0) barrier_.reset(omp_get_num_threads());
#pragma omp barrier
      row_thread(st, omp_get_thread_num(), omp_get_num_threads());
    }
    team_.record(threads, seconds(start, Clock::now()));
    auto out_x = torch::from_blob(y_.data(), {1, hidden}, x.options()).clone();
    auto out_res = torch::from_blob(scratch_[0].residual.data(), {1, hidden}, x.options()).clone();
    std::vector<torch::Tensor> out{out_x, out_res};
    out.insert(out.end(), st.taps.begin(), st.taps.end());
    return out;
  }

 private:
  struct RowStep {  // one single-row step's inputs, shared by its threads
    const float *x = nullptr, *cos = nullptr, *sin = nullptr;
    const int64_t* table = nullptr;
    int64_t slot = 0, last = 0;
    const std::vector<int64_t>* aux = nullptr;
    std::vector<torch::Tensor> taps;
  };

  // RoPE on this thread's query heads (thread 0 appends the row's keys and values to the cache), then attention
  // over those heads; the caller's barrier follows. A thread takes whole KV heads (their G query heads in one
  // attend call, which reads and widens each key and value row once for all G) when there are enough for every
  // thread: at a 2k-token context an FP8 cache's attention took 9.6 ms a token with single query heads spread over
  // the threads and 7.2 with whole KV heads (measurements/2026-12-02/issue27/kv-plan/README.md).
  void row_attention(const Layer& L, const RowStep& st, RowScratch& r, int t, int P) {
    const int64_t D = L.k_cache.size(3), half = D / 2, bs = L.k_cache.size(1), G = H_ / Hk_;
    const int64_t unit = Hk_ >= P ? G : 1;
    const auto [u0, u1] = share(H_ / unit, t, P);
    const int64_t h0 = u0 * unit, h1 = u1 * unit;
    const float* c = st.cos + L.rope * half;
    const float* sn = st.sin + L.rope * half;
    for (int64_t h = h0; h < h1; ++h) qe::rope_head(qkv_.data() + h * D, c, sn, half, r.q.data() + h * D);
    if (t == 0) row_append(L, st.slot, c, sn, r);
    barrier_.wait();
    const int64_t first = L.window > 0 ? std::max<int64_t>(0, st.last - L.window + 1) : 0;
    const float* ks = L.kv == KV_FP32 ? nullptr : L.k_scales.data_ptr<float>();
    const float* vs = L.kv == KV_FP32 ? nullptr : L.v_scales.data_ptr<float>();
    const float sc = static_cast<float>(scale_);
    // `unit` heads per call: a head's result does not depend on how many share the call (attend), so these are
    // the batched path's bits
    for (int64_t h = h0; h < h1; h += unit) {
      float* out = attn_.data() + h * D;
      const float* q = r.q.data() + h * D;
      if (L.kv == KV_FP8)
        qe::attend<float, uint8_t>(q, D, L.k_cache.data_ptr<uint8_t>(), L.v_cache.data_ptr<uint8_t>(), ks, vs,
                                   st.table, first, st.last, bs, Hk_, h / G, D, unit, sc, out, r.attend_buf);
      else if (L.kv == KV_INT8)
        qe::attend<float, int8_t>(q, D, L.k_cache.data_ptr<int8_t>(), L.v_cache.data_ptr<int8_t>(), ks, vs,
                                  st.table, first, st.last, bs, Hk_, h / G, D, unit, sc, out, r.attend_buf);
      else
        qe::attend<float, float>(q, D, L.k_cache.data_ptr<float>(), L.v_cache.data_ptr<float>(), nullptr, nullptr,
                                 st.table, first, st.last, bs, Hk_, h / G, D, unit, sc, out, r.attend_buf);
    }
  }

  // The row's keys (rotated) and values into the cache at `slot`: copied into an fp32 cache, or quantized with
  // rope_and_cache_quant's operations (quantize_head, after the key is rotated into fp32), so the same bytes.
  void row_append(const Layer& L, int64_t slot, const float* c, const float* sn, RowScratch& r) {
    const int64_t D = L.k_cache.size(3), half = D / 2;
    for (int64_t h = 0; h < Hk_; ++h) {
      const float* k = qkv_.data() + (H_ + h) * D;
      const float* v = qkv_.data() + (H_ + Hk_ + h) * D;
      const int64_t at = slot * Hk_ + h;
      if (L.kv == KV_FP32) {
        qe::rope_head(k, c, sn, half, L.k_cache.data_ptr<float>() + at * D);
        std::copy(v, v + D, L.v_cache.data_ptr<float>() + at * D);
        continue;
      }
      const bool fp8 = L.kv == KV_FP8;
      auto* kc = static_cast<uint8_t*>(L.k_cache.data_ptr());
      auto* vc = static_cast<uint8_t*>(L.v_cache.data_ptr());
      const float kfix = L.k_static.numel() ? L.k_static.data_ptr<float>()[h] : 0.f;
      const float vfix = L.v_static.numel() ? L.v_static.data_ptr<float>()[h] : 0.f;
      qe::rope_head(k, c, sn, half, r.rotated.data());
      qe::quantize_head(r.rotated.data(), D, fp8, kfix, kc + at * D, L.k_scales.data_ptr<float>() + at);
      qe::quantize_head(v, D, fp8, vfix, vc + at * D, L.v_scales.data_ptr<float>() + at);
    }
  }

  // The caches the single-row path reads and writes in place: contiguous fp32, or quantized with contiguous fp32
  // scales (and fp32 calibrated scales, one per KV head), head_dim within attend's widening buffer.
  bool row_cache_ok(const Layer& L) const {
    const auto want = L.kv == KV_FP32 ? torch::kFloat : L.kv == KV_FP8 ? torch::kByte : torch::kChar;
    bool ok = L.k_cache.scalar_type() == want && L.v_cache.scalar_type() == want && L.k_cache.is_contiguous() &&
              L.v_cache.is_contiguous() && L.k_cache.dim() == 4;
    if (!ok || L.kv == KV_FP32) return ok;
    for (const torch::Tensor* s : {&L.k_scales, &L.v_scales})
      ok = ok && s->scalar_type() == torch::kFloat && s->is_contiguous() && s->numel() * L.k_cache.size(3) == L.k_cache.numel();
    for (const torch::Tensor* s : {&L.k_static, &L.v_static})
      ok = ok && (s->numel() == 0 || (s->scalar_type() == torch::kFloat && s->is_contiguous() && s->numel() == Hk_));
    return ok && L.k_cache.size(3) <= 512;
  }

  // add + RMSNorm of the row into this thread's copy; layer 0 (no residual yet) takes x as the residual, and
  // EAGLE-3's taps (thread 0) take the residual stream entering the layer, x + residual as the batched path adds it.
  void row_norm(size_t l, const float* x, const torch::Tensor& weight, RowStep& st, RowScratch& r, int t) {
    const int64_t hidden = static_cast<int64_t>(r.residual.size());
    if (t == 0)
      for (size_t j = 0; j < st.aux->size(); ++j)
        if ((*st.aux)[j] == static_cast<int64_t>(l)) {
          float* tap = st.taps[j].data_ptr<float>();
          for (int64_t k = 0; k < hidden; ++k) tap[k] = l ? x[k] + r.residual[k] : x[k];
        }
    if (l == 0) std::copy(x, x + hidden, r.residual.data());
    qe::add_rms_norm_impl<float>(l ? x : r.residual.data(), l ? r.residual.data() : nullptr, weight.data_ptr<float>(),
                                 l ? r.residual.data() : nullptr, r.normed.data(), 1, hidden, static_cast<float>(eps_));
  }

  // Thread t of P in the single-row step. Shared buffers are written by one owner per element and read only
  // after the barrier that follows the write; per-thread copies (residual, normed, q) are identical in every thread.
  void row_thread(RowStep& st, int t, int P) {
    RowScratch& r = scratch_[t];
    const int64_t hidden = static_cast<int64_t>(o_.size()), I = static_cast<int64_t>(act_.size());
    const int64_t isa = qk::r8_auto_isa();
    const float* xin = st.x;
    double gemv = 0, attention = 0, other = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      auto t0 = Clock::now();
      row_norm(l, xin, L.input_norm, st, r, t);
      auto t1 = Clock::now();
      const auto [q0, q1] = share(units(L.qkv), t, P);
      const float* xq = prepare(L.qkv, r.normed.data(), r.acts, r.xq);
      gemv_units(L.qkv, isa, xq, r.acts, q0, q1, qkv_.data());
      prefetch_units(L.o, share(units(L.o), t, P).first);
      barrier_.wait();
      auto t2 = Clock::now();
      row_attention(L, st, r, t, P);
      barrier_.wait();
      auto t3 = Clock::now();
      const auto [o0, o1] = share(units(L.o), t, P);
      xq = prepare(L.o, attn_.data(), r.acts, r.xq);
      gemv_units(L.o, isa, xq, r.acts, o0, o1, o_.data());
      const int64_t gu_half = units(L.gate_up) / 2;
      const auto [g0, g1] = share(gu_half, t, P);
      prefetch_units(L.gate_up, g0);
      prefetch_units(L.gate_up, gu_half + g0);
      barrier_.wait();
      auto t4 = Clock::now();
      qe::add_rms_norm_impl<float>(o_.data(), r.residual.data(), L.post_attn_norm.data_ptr<float>(),
                                   r.residual.data(), r.normed.data(), 1, hidden, static_cast<float>(eps_));
      auto t5 = Clock::now();
      // this thread's gate rows and the up rows they multiply, then SwiGLU over them: no barrier in between
      xq = prepare(L.gate_up, r.normed.data(), r.acts, r.xq);
      gemv_units(L.gate_up, isa, xq, r.acts, g0, g1, gate_up_.data());
      gemv_units(L.gate_up, isa, xq, r.acts, gu_half + g0, gu_half + g1, gate_up_.data());
      auto t6 = Clock::now();
      const int64_t rows = unit_rows(L.gate_up);
      for (int64_t i = g0 * rows; i < std::min(I, g1 * rows); ++i)
        act_[i] = qe::silu_times(gate_up_[i], gate_up_[I + i]);
      prefetch_units(L.down, share(units(L.down), t, P).first);
      barrier_.wait();
      auto t7 = Clock::now();
      const auto [d0, d1] = share(units(L.down), t, P);
      xq = prepare(L.down, act_.data(), r.acts, r.xq);
      gemv_units(L.down, isa, xq, r.acts, d0, d1, y_.data());
      if (l + 1 < layers_.size()) prefetch_units(layers_[l + 1].qkv, share(units(layers_[l + 1].qkv), t, P).first);
      barrier_.wait();
      auto t8 = Clock::now();
      xin = y_.data();
      gemv += seconds(t1, t2) + seconds(t3, t4) + seconds(t5, t6) + seconds(t7, t8);
      attention += seconds(t2, t3);
      other += seconds(t0, t1) + seconds(t4, t5) + seconds(t6, t7);
    }
    if (t == 0) {
      gemv_ += gemv;
      attention_ += attention;
      other_ += other;
    }
  }

  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  std::vector<Layer> layers_;
  bool row_path_ = false;     // every layer fits the single-row path
  bool use_row_path_ = true;  // cleared for A/B measurements and tests (decode_plan.py)
  std::vector<float> qkv_, attn_, o_, gate_up_, act_, y_;  // the single-row path's shared buffers
  std::vector<RowScratch> scratch_;
  RowBarrier barrier_;
  RowTeam team_;
  int64_t H_, Hk_;
  double eps_, scale_;
  double gemv_ = 0.0, attention_ = 0.0, other_ = 0.0;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<const std::vector<torch::Tensor>&, const std::vector<int64_t>&, int64_t, int64_t, double,
                    double>())
      // the GIL is released while the layers run: a server's event loop keeps answering meanwhile
      .def("run", &DecodePlan::run, py::call_guard<py::gil_scoped_release>())
      .def("times", &DecodePlan::times)
      .def("reset_times", &DecodePlan::reset_times)
      .def_property_readonly("num_layers", &DecodePlan::num_layers)
      // whether a single row takes the one-parallel-region path (settable: False sends it through the batched one)
      .def_property("row_path", &DecodePlan::row_path, &DecodePlan::set_row_path)
      // the single-row path's team size for the next steps, and whether it follows the machine's load (RowTeam)
      .def_property_readonly("row_team", &DecodePlan::row_team)
      .def_property("adaptive_team", &DecodePlan::adaptive_team, &DecodePlan::set_adaptive_team);
  // RowTeam's policy alone, driven by given step times in tests
  py::class_<RowTeam>(m, "RowTeam")
      .def(py::init<>())
      .def("pick", &RowTeam::pick)
      .def("record", &RowTeam::record)
      .def_property_readonly("team", &RowTeam::team);
}
