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

}  // namespace

void register_training(pybind11::module& m) {
  m.def("rms_norm_forward", &rms_norm_forward, "transformers' RMSNorm, and each row's rsqrt for the backward");
  m.def("rms_norm_backward", &rms_norm_backward, "the RMSNorm's input and weight gradients");
  m.def("silu_mul_forward", &silu_mul_forward, "SiLU(gate) * up");
  m.def("silu_mul_backward", &silu_mul_backward, "the gradients of SiLU(gate) * up for gate and up");
}

}  // namespace hybridflow
