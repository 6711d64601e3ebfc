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
#include <cpuid.h>
#include <immintrin.h>
#include <strings.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#define QTOOLKIT_NO_MODULE
namespace qk {
#include "cpu_kernels.cpp"
}
namespace qe {
#include "cpu_engine_ops.cpp"
}

namespace {

// kind codes of kernels/dispatch.py GemvSpec
constexpr int64_t DENSE = 0, INT4 = 1, INT8 = 2, FP8 = 3, INT4_R8 = 4, INT8_R8 = 5;

struct Linear {
  int64_t kind = DENSE, group = 0, act = -1;  // act: -1 weight-only, 0 int8 / 1 FP8 per-token activations
  torch::Tensor weight, scales, zeros, bias;  // bias undefined when the layer has none

  torch::Tensor operator()(const torch::Tensor& in) const {
    const torch::Tensor x = act >= 0 ? qe::fake_quant_tokens(in, act == 1) : in;
    torch::Tensor y;
    if (kind == DENSE) y = qe::dense_gemv(x, weight);
    else if (kind == INT4_R8) y = qk::int4_matmul_r8(x.contiguous(), weight, scales, zeros, group, -1);
    else if (kind == INT8_R8) y = qk::int8_matmul_r8(x.contiguous(), weight, scales, zeros, group, -1);
    else if (kind == INT4) y = qk::int4_matmul(x.contiguous(), weight, scales, zeros, group);
    else if (kind == INT8) y = qk::int8_matmul(x.contiguous(), weight, scales, zeros, group);
    else y = qk::fp8_matmul(x.contiguous(), weight, scales);
    return bias.defined() ? y + bias : y;
  }
};

struct Layer {
  torch::Tensor input_norm, post_attn_norm, k_cache, v_cache;
  Linear qkv, o, gate_up, down;
  int64_t rope = 0, window = 0;
};

using Clock = std::chrono::steady_clock;

}  // namespace

// Per-layer tensors, in this order: input_norm, post_attn_norm, k_cache, v_cache, then for qkv, o, gate_up, down:
// weight, scales, zeros, bias (any tensor when the flag says none). Per-layer ints: rope index, window (0 = none),
// then for each Linear: kind, group, has_bias, act.
class DecodePlan {
 public:
  static constexpr int64_t TENSORS = 4 + 4 * 4, INTS = 2 + 4 * 4;

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
      layers_.push_back(std::move(layer));
    }
  }

  // x [T, hidden] fp32 embeddings; cos/sin [ropes, T, D/2]; slots [T]; block_table/row_seq/row_last as
  // paged_attention takes them; aux_layers: EAGLE-3 taps (the residual stream entering each of these layers).
  // Returns (x, residual) after the last layer (the model adds and norms them), then one tap per aux layer.
  std::vector<torch::Tensor> run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& slots, const torch::Tensor& block_table,
                                 const torch::Tensor& row_seq, const torch::Tensor& row_last,
                                 const std::vector<int64_t>& aux_layers) {
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
      auto q = qe::rope_and_cache(qkv.contiguous(), cos[L.rope], sin[L.rope], L.k_cache, L.v_cache, slots, H_, Hk_);
      auto a = qe::paged_attention(q, L.k_cache, L.v_cache, block_table, row_seq, row_last, scale_, L.window,
                                   c10::nullopt, c10::nullopt);  // the plan runs fp32 caches only
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

 private:
  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  std::vector<Layer> layers_;
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
      .def_property_readonly("num_layers", &DecodePlan::num_layers);
}
