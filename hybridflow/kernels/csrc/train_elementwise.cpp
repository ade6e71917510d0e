// The training pass's RMSNorm and SiLU(gate) * up as fused forward and backward kernels (kernels/elementwise.py
// makes them autograd functions). transformers' modules run each as a chain of torch ops (RMSNorm: a cast, the
// square, the mean, the reciprocal square root, two products, a cast back; about twice as many in the backward):
// every op a pass over the (tokens, hidden) activations, most of them in float32.
//
// Bit for bit what that chain and its autograd backward compute, not merely close: each value is rounded where
// torch's op rounds it; the reductions (RMSNorm's mean of squares, its backward's row sums, the weight gradient's
// sum over tokens) are torch's own calls on the same products; SiLU uses ATen's vectorised exponential over the
// same spans torch's elementwise loops split a contiguous tensor into (at::parallel_for with its grain), the scalar
// formula on the elements after each span's last full pair of vectors, as torch does.

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE: how torch splits an elementwise op over threads
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "elementwise.h"

namespace hybridflow {
namespace {

using namespace elementwise;

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (N, H) tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous (H,) tensor of x's dtype");
}

// transformers' RMSNorm: w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype). Returns (out, inverse): inverse (N,)
// float32 is each row's rsqrt, kept for the backward.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto squares = at::empty({rows, hidden}, x.options().dtype(at::kFloat));
  auto out = at::empty_like(x);
  auto inverse = at::empty({rows}, x.options().dtype(at::kFloat));
  float_or_bf16(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    using L = Lanes<scalar_t>;
    const scalar_t* a = x.data_ptr<scalar_t>();
    float* sq = squares.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * hidden; i < end * hidden;) {  // x32 * x32, torch's pow(2)
        if (i + L::size <= end * hidden) {
          auto [low, high] = L::load(a + i);
          (low * low).store(sq + i);
          (high * high).store(sq + i + L::FloatVec::size());
          i += L::size;
        } else {
          const float f = widen(a[i]);
          sq[i++] = f * f;
        }
      }
    });
    const auto mean = at::mean(squares, {-1});  // torch's order of summation
    const float* m = mean.data_ptr<float>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    float* inv = inverse.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float rs = 1.0f / std::sqrt(m[r] + static_cast<float>(eps));  // torch's rsqrt, vectorised or not
        const typename L::FloatVec scale(rs);
        inv[r] = rs;
        const scalar_t* ar = a + r * hidden;
        scalar_t* orow = o + r * hidden;
        int64_t j = 0;
        for (; j + L::size <= hidden; j += L::size) {  // x32 * rsqrt rounded, then times the weight rounded
          auto [a0, a1] = L::load(ar + j);
          auto [s0, s1] = L::round(a0 * scale, a1 * scale);
          auto [w0, w1] = L::load(w + j);
          L::store(orow + j, w0 * s0, w1 * s1);
        }
        for (; j < hidden; ++j) {
          const scalar_t scaled = narrow<scalar_t>(widen(ar[j]) * rs);
          orow[j] = narrow<scalar_t>(widen(w[j]) * widen(scaled));
        }
      }
    });
  });
  return {out, inverse};
}

// The backward of rms_norm_forward for the output's gradient dy (N, H): (dx, dweight), each as autograd computes
// them through transformers' ops:
//   dh = (dy * w) rounded, in float32;  drow = sum_j dh * x32 (torch's row sum);
//   dvar = (-0.5 * drow) * inverse^3 (rsqrt's backward), then / H (the mean's), times 2 * x32 (the square's);
//   dx = (dh * inverse + dvar / H * 2 x32) rounded;  dweight = sum over rows of (dy * out_normed) rounded (torch's).
//
// With ``split`` (float32) dx comes as its two terms, (dh * inverse, dvar / H * 2 x32), for autograd to add: in
// float32 transformers' cast is no op, so x's gradient is the sum of the product's and the square's backward
// and whatever else uses x (the residual add), added in that order; in bfloat16 the cast's backward adds the two
// terms first, as here. Without ``weight_grad`` dweight is left undefined (the caller sums the weight's gradient
// itself: over a gradient whose memory is laid out otherwise than x's, torch sums in that layout's order).
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& inverse, bool split, bool weight_grad) {
  check_rows(x, weight);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type(),
              "dy must be a contiguous tensor of x's shape and dtype");
  TORCH_CHECK(!split || x.scalar_type() == at::kFloat, "split is for float32 (a bfloat16 cast adds the terms)");
  TORCH_CHECK(inverse.dim() == 1 && inverse.size(0) == x.size(0) && inverse.scalar_type() == at::kFloat &&
                  inverse.is_contiguous(),
              "inverse must be rms_norm_forward's (N,) float32 rows");
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto row_products = at::empty({rows, hidden}, x.options().dtype(at::kFloat));
  auto weight_products = weight_grad ? at::empty_like(x) : at::Tensor();
  auto dx = at::empty_like(x);
  auto dx_square = split ? at::empty_like(x) : at::Tensor();
  at::Tensor dweight;
  float_or_bf16(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* g = dy.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const float* inv = inverse.data_ptr<float>();
    float* rp = row_products.data_ptr<float>();
    scalar_t* wp = weight_grad ? weight_products.data_ptr<scalar_t>() : nullptr;
    using L = Lanes<scalar_t>;
    using FloatVec = typename L::FloatVec;
    // dh = dy * weight rounded (the weight product's backward), widened: 32 values from (i, j), or one
    const auto weighted = [&](int64_t i, int64_t j) {
      auto [g0, g1] = L::load(g + i);
      auto [w0, w1] = L::load(w + j);
      return L::round(g0 * w0, g1 * w1);
    };
    const auto weighted_one = [&](int64_t i, int64_t j) {
      return widen(narrow<scalar_t>(widen(g[i]) * widen(w[j])));
    };
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const FloatVec scale(inv[r]);
        int64_t j = 0;
        for (; j + L::size <= hidden; j += L::size) {
          const int64_t i = r * hidden + j;
          auto [dh0, dh1] = weighted(i, j);
          auto [f0, f1] = L::load(a + i);
          (dh0 * f0).store(rp + i);
          (dh1 * f1).store(rp + i + FloatVec::size());
          if (weight_grad) {
            auto [g0, g1] = L::load(g + i);
            auto [n0, n1] = L::round(f0 * scale, f1 * scale);
            L::store(wp + i, g0 * n0, g1 * n1);
          }
        }
        for (; j < hidden; ++j) {
          const int64_t i = r * hidden + j;
          const float f = widen(a[i]);
          rp[i] = weighted_one(i, j) * f;
          if (weight_grad) wp[i] = narrow<scalar_t>(widen(g[i]) * widen(narrow<scalar_t>(f * inv[r])));
        }
      }
    });
    const auto row_sums = at::sum(row_products, {1});  // torch's sum_to over the broadcast rsqrt
    if (weight_grad) dweight = at::sum(weight_products, {0});  // and over the tokens, for the weight
    const float* rs = row_sums.data_ptr<float>();
    scalar_t* d = dx.data_ptr<scalar_t>();
    scalar_t* ds = split ? dx_square.data_ptr<scalar_t>() : nullptr;
    const float count = static_cast<float>(hidden);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float cube = inv[r] * inv[r] * inv[r];
        const float per_square = ((-0.5f * rs[r]) * cube) / count;
        const FloatVec scale(inv[r]), square(per_square), two(2.0f);
        int64_t j = 0;
        for (; j + L::size <= hidden; j += L::size) {
          const int64_t i = r * hidden + j;
          auto [dh0, dh1] = weighted(i, j);
          auto [f0, f1] = L::load(a + i);
          if (split) {
            L::store(d + i, dh0 * scale, dh1 * scale);
            L::store(ds + i, square * (two * f0), square * (two * f1));
          } else {
            L::store(d + i, dh0 * scale + square * (two * f0), dh1 * scale + square * (two * f1));
          }
        }
        for (; j < hidden; ++j) {
          const int64_t i = r * hidden + j;
          const float f = widen(a[i]);
          const float dh = weighted_one(i, j);
          if (split) {
            d[i] = narrow<scalar_t>(dh * inv[r]);
            ds[i] = narrow<scalar_t>(per_square * (2.0f * f));
          } else {
            d[i] = narrow<scalar_t>(dh * inv[r] + per_square * (2.0f * f));
          }
        }
      }
    });
  });
  if (split) return {dx, dx_square, dweight};
  return {dx, dweight};
}

void check_pair(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.is_contiguous() && up.is_contiguous() && gate.sizes() == up.sizes() &&
                  gate.scalar_type() == up.scalar_type(),
              "gate and up must be contiguous tensors of one shape and dtype");
}

// SiLU(gate) * up, each op rounded as torch rounds it
at::Tensor silu_mul_forward(const at::Tensor& gate, const at::Tensor& up) {
  check_pair(gate, up);
  auto out = at::empty_like(gate);
  float_or_bf16(gate, [&](auto tag) {
    using scalar_t = decltype(tag);
    using Vec = Vectorized<scalar_t>;
    const scalar_t* g = gate.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      silu_span(
          g + begin, end - begin,
          [&](int64_t j, const Vec& s) { (s * Vec::loadu(u + begin + j)).store(o + begin + j); },
          [&](int64_t j, float s) {
            o[begin + j] = narrow<scalar_t>(widen(narrow<scalar_t>(s)) * widen(u[begin + j]));
          });
    });
  });
  return out;
}

// The backward of silu_mul_forward for the output's gradient dout: (dgate, dup), as autograd computes them:
//   dup = dout * SiLU(gate) rounded (SiLU rounded first: the forward's value);
//   dgate = torch's silu_backward(dout * up rounded, gate): grad * sigmoid * (1 + gate * (1 - sigmoid)), with
//   1 + gate * (1 - sigmoid) in one rounding (torch's build contracts that product and sum into a fused multiply-add).
// SiLU = gate / (1 + e) and sigmoid = 1 / (1 + e) share one e = exp(-gate): ATen's vectorised exponential on the
// vectors of torch's spans, std::exp on their tails, as in torch's two kernels.
std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& dout, const at::Tensor& gate,
                                                     const at::Tensor& up) {
  check_pair(gate, up);
  check_pair(dout, gate);
  auto dgate = at::empty_like(gate);
  auto dup = at::empty_like(up);
  float_or_bf16(gate, [&](auto tag) {
    using scalar_t = decltype(tag);
    using L = Lanes<scalar_t>;
    using FloatVec = typename L::FloatVec;
    const scalar_t* g = gate.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    const scalar_t* d = dout.data_ptr<scalar_t>();
    scalar_t* dg = dgate.data_ptr<scalar_t>();
    scalar_t* du = dup.data_ptr<scalar_t>();
    const FloatVec one(1.0f);
    at::parallel_for(0, gate.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      const int64_t n = end - begin;
      const int64_t whole = n - n % (2 * Vectorized<scalar_t>::size());  // torch's loops: two vectors at a time
      for (int64_t j = 0; j < whole; j += L::size) {
        const int64_t i = begin + j;
        auto [x0, x1] = L::load(g + i);
        auto [d0, d1] = L::load(d + i);
        auto [u0, u1] = L::load(u + i);
        const FloatVec e0 = x0.neg().exp(), e1 = x1.neg().exp();
        auto [s0, s1] = L::round(x0 / (one + e0), x1 / (one + e1));
        L::store(du + i, d0 * s0, d1 * s1);
        auto [grad0, grad1] = L::round(d0 * u0, d1 * u1);
        const FloatVec sigmoid0 = one / (one + e0), sigmoid1 = one / (one + e1);
        L::store(dg + i, grad0 * sigmoid0 * at::vec::fmadd(x0, one - sigmoid0, one),
                 grad1 * sigmoid1 * at::vec::fmadd(x1, one - sigmoid1, one));
      }
      for (int64_t j = whole; j < n; ++j) {
        const int64_t i = begin + j;
        const float x = widen(g[i]), e = std::exp(-x);
        du[i] = narrow<scalar_t>(widen(d[i]) * widen(narrow<scalar_t>(x / (1.0f + e))));
        const float grad = widen(narrow<scalar_t>(widen(d[i]) * widen(u[i])));
        const float sigmoid = 1.0f / (1.0f + e);
        dg[i] = narrow<scalar_t>(grad * sigmoid * std::fma(x, 1.0f - sigmoid, 1.0f));
      }
    });
  });
  return {dgate, dup};
}

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
// (rows, kv heads, groups, L) products, each row's query at position r % L; bias (L, L) float32, 0 on and below the
// diagonal, -inf above. Returns (probs, probs32): torch.softmax(torch.add(bias, scores, alpha=scale), -1) in float32
// (kept for the backward, as autograd keeps it) and rounded to the scores' dtype. torch's add with alpha is one
// multiply-add (its kernel's vec::fmadd) and its float32 softmax is ATen's vectorised reductions and maps, as here.
std::tuple<at::Tensor, at::Tensor> causal_softmax_forward(const at::Tensor& scores, const at::Tensor& bias, double scale) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous(), "scores must be a contiguous (R, L) tensor");
  const int64_t rows = scores.size(0), length = scores.size(1);
  TORCH_CHECK(bias.dim() == 2 && bias.size(0) == length && bias.size(1) == length && bias.is_contiguous() &&
                  bias.scalar_type() == at::kFloat,
              "bias must be a contiguous (L, L) float32 tensor");
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
        const float* bias_row = b + (r % length) * length;
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

void register_training(pybind11::module& m) {
  m.def("rms_norm_forward", &rms_norm_forward, "transformers' RMSNorm, and each row's rsqrt for the backward");
  m.def("rms_norm_backward", &rms_norm_backward, "the RMSNorm's input and weight gradients");
  m.def("silu_mul_forward", &silu_mul_forward, "SiLU(gate) * up");
  m.def("silu_mul_backward", &silu_mul_backward, "the gradients of SiLU(gate) * up for gate and up");
  m.def("causal_softmax_forward", &causal_softmax_forward, "the training attention's scaled, masked softmax");
  m.def("causal_softmax_backward", &causal_softmax_backward, "its scores' gradient");
}

}  // namespace hybridflow
