// The training attention's scale, causal mask, float32 softmax and rounding (engine/packing.py
// grouped_causal_attention) as one kernel each way (kernels/elementwise.py causal_softmax makes them an autograd
// function): four torch ops over the (rows, kv heads, G * L, L) scores forward and four backward, each a pass over
// them in float32. Bit for bit what those ops and autograd's backward through them compute (tests/kernels/
// test_elementwise.py, on 1 and 2 threads).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "elementwise.h"

namespace hybridflow {
namespace {

using namespace elementwise;

// sum_j x[j] * y[j] as ATen's map2_reduce_all sums it in torch's softmax backward: vectors of lanes, the tail's
// lanes set apart, then the lanes reduced. How torch's build rounds the tail's product and sum differs with where its
// loop runs: called in line (one thread, or already inside a parallel region: at::parallel_for calls it directly),
// the tail's multiply and add are one fused multiply-add; run by the thread pool, they round apart, as every vector
// before the tail does in both (found by comparing with torch's kernel on 1 and 2 threads).
inline float map2_reduce_sum(const float* x, const float* y, int64_t size, bool inline_call) {
  using FloatVec = Vectorized<float>;
  if (size < FloatVec::size()) {
    const FloatVec products = FloatVec::loadu(x, size) * FloatVec::loadu(y, size);
    return at::vec::vec_reduce_all<float>([](FloatVec& u, FloatVec& v) { return u + v; }, products, size);
  }
  int64_t d = FloatVec::size();
  FloatVec acc = FloatVec::loadu(x) * FloatVec::loadu(y);
  for (; d < size - (size % FloatVec::size()); d += FloatVec::size())
    acc = acc + FloatVec::loadu(x + d) * FloatVec::loadu(y + d);
  if (size - d > 0) {
    const FloatVec xs = FloatVec::loadu(x + d, size - d), ys = FloatVec::loadu(y + d, size - d);
    acc = FloatVec::set(acc, inline_call ? at::vec::fmadd(xs, ys, acc) : acc + xs * ys, size - d);
  }
  return at::vec::vec_reduce_all<float>([](FloatVec& u, FloatVec& v) { return u + v; }, acc);
}

// The training attention's softmax (engine/packing.py grouped_causal_attention): scores (R, L) of the query rows of
// (rows, kv heads, groups, Q) products over L keys; bias (L, L) float32, 0 on and below the diagonal, -inf above.
// Query j of a row is at key position j (offsets empty: Q = L), or at offsets[row] + j (offsets (rows,) int64: the
// queries of each row start offsets[row] keys in; positions past the last key take its mask row). Returns (probs,
// probs32): torch.softmax(torch.add(bias_rows, scores, alpha=scale), -1) in float32 (kept for the backward, as
// autograd keeps it) and rounded to the scores' dtype, bias_rows the bias's rows at the queries' positions. torch's
// add with alpha is one multiply-add (its kernel's vec::fmadd) and its float32 softmax is ATen's vectorised
// reductions and maps, as here.
std::tuple<at::Tensor, at::Tensor> causal_softmax_forward(const at::Tensor& scores, const at::Tensor& bias, double scale,
                                                          const at::Tensor& offsets, int64_t queries) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous(), "scores must be a contiguous (R, L) tensor");
  const int64_t rows = scores.size(0), length = scores.size(1);
  TORCH_CHECK(bias.dim() == 2 && bias.size(0) == length && bias.size(1) == length && bias.is_contiguous() &&
                  bias.scalar_type() == at::kFloat,
              "bias must be a contiguous (L, L) float32 tensor");
  const bool offset = offsets.numel() > 0;
  TORCH_CHECK(!offset || (offsets.dim() == 1 && offsets.is_contiguous() && offsets.scalar_type() == at::kLong &&
                          queries > 0 && rows % (offsets.size(0) * queries) == 0),
              "offsets must be a contiguous (rows,) int64 tensor whose rows each hold a whole number of ", queries,
              "-query blocks of the scores");
  TORCH_CHECK(offset || queries == length, "without offsets the queries are the keys: ", queries, " != ", length);
  const int64_t per_row = offset ? rows / offsets.size(0) : rows;
  const int64_t* starts = offset ? offsets.data_ptr<int64_t>() : nullptr;
  auto probs32 = at::empty({rows, length}, scores.options().dtype(at::kFloat));
  auto probs = scores.scalar_type() == at::kFloat ? probs32 : at::empty_like(scores);
  float_or_bf16(scores, [&](auto tag) {
    using scalar_t = decltype(tag);
    using FloatVec = Vectorized<float>;
    const scalar_t* in = scores.data_ptr<scalar_t>();
    const float* b = bias.data_ptr<float>();
    float* p32 = probs32.data_ptr<float>();
    scalar_t* p = probs.data_ptr<scalar_t>();
    const float alpha = static_cast<float>(scale);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = in + r * length;
        const int64_t position = offset ? std::min(starts[r / per_row] + r % queries, length - 1) : r % length;
        const float* bias_row = b + position * length;
        float* x = p32 + r * length;
        for (int64_t j = 0; j < length; ++j) x[j] = std::fma(widen(row[j]), alpha, bias_row[j]);
        const float max_val = at::vec::reduce_all<float>(
            [](FloatVec& u, FloatVec& v) { return at::vec::maximum(u, v); }, x, length);
        at::vec::map([max_val](FloatVec v) { return (v - FloatVec(max_val)).exp(); }, x, x, length);
        const float inverse = 1 / at::vec::reduce_all<float>([](FloatVec u, FloatVec v) { return u + v; }, x, length);
        at::vec::map([inverse](FloatVec v) { return v * FloatVec(inverse); }, x, x, length);
        if constexpr (!std::is_same_v<scalar_t, float>) {
          scalar_t* out = p + r * length;
          for (int64_t j = 0; j < length; ++j) out[j] = narrow<scalar_t>(x[j]);
        }
      }
    });
  });
  return {probs, probs32};
}

// The backward of causal_softmax_forward for the rounded probabilities' gradient: the scores' gradient, as
// autograd computes it through the cast (widened), torch's softmax backward ((g - sum(g * p)) * p, its sum ATen's
// vectorised map-reduce) and the add's alpha (times scale), rounded to the scores' dtype.
at::Tensor causal_softmax_backward(const at::Tensor& grad, const at::Tensor& probs32, double scale) {
  TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous() && probs32.sizes() == grad.sizes() &&
                  probs32.is_contiguous() && probs32.scalar_type() == at::kFloat,
              "grad and probs32 must be contiguous (R, L) tensors, probs32 float32");
  const int64_t rows = grad.size(0), length = grad.size(1);
  auto out = at::empty_like(grad);
  float_or_bf16(grad, [&](auto tag) {
    using scalar_t = decltype(tag);
    using FloatVec = Vectorized<float>;
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const float* p = probs32.data_ptr<float>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const float alpha = static_cast<float>(scale);
    const bool inline_call = at::get_num_threads() == 1 || at::in_parallel_region();  // torch's loop: called in line
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(std::is_same_v<scalar_t, float> ? 0 : length);
      std::vector<float> result(length);
      for (int64_t r = begin; r < end; ++r) {
        const float* gr;
        if constexpr (std::is_same_v<scalar_t, float>) {
          gr = g + r * length;
        } else {
          for (int64_t j = 0; j < length; ++j) widened[j] = widen(g[r * length + j]);
          gr = widened.data();
        }
        const float* pr = p + r * length;
        const float sum = map2_reduce_sum(gr, pr, length, inline_call);
        at::vec::map2([sum](FloatVec x, FloatVec y) { return (x - FloatVec(sum)) * y; }, result.data(), gr, pr,
                      length);
        scalar_t* orow = o + r * length;
        for (int64_t j = 0; j < length; ++j) orow[j] = narrow<scalar_t>(result[j] * alpha);
      }
    });
  });
  return out;
}

}  // namespace

void register_training_softmax(pybind11::module& m) {
  m.def("causal_softmax_forward", &causal_softmax_forward, "the training attention's scaled, masked softmax");
  m.def("causal_softmax_backward", &causal_softmax_backward, "its scores' gradient");
}

}  // namespace hybridflow
