// The training pass's rotary embedding of q or k as one pass forward and one backward (kernels/elementwise.py makes
// them an autograd function). transformers' apply_rotary_pos_emb computes x * cos + rotate_half(x) * sin with
// rotate_half(x) = cat(-x2, x1): six ops forward, and backward two products, a negation, two slices' zero-filled
// gradients and the adds that sum them, each a pass over the (heads, tokens, head_dim) activations.
//
// Bit for bit what those ops and their autograd backward compute: each product rounded to the dtype, then the sum
// rounded (torch's bfloat16 ops widen to float32, compute, and round; float32 ones compute in float32; nothing fused
// into one rounding: -ffp-contract=off). The backward of x's three uses (x * cos, and the halves x1 and x2 that
// rotate_half slices) is, for each element, the product term plus the one slice term that is not zero:
//   dx[j]        = g[j] * cos[j]        + (g * sin)[j + half]    for j < half
//   dx[j + half] = g[j + half] * cos[..] - (g * sin)[j]
// (autograd's third term, the other slice's zero, changes nothing but a zero's sign.)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <tuple>

#include "elementwise.h"

namespace hybridflow {
namespace {

using namespace elementwise;

// x (B, H, T, D) with unit stride along D (q or k as the attention lays them out: often a transposed view);
// cos, sin (B, T, D) contiguous, x's dtype.
void check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "x must be (B, H, T, D) with D even and contiguous along D");
  TORCH_CHECK(cos.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && cos.size(2) == x.size(3),
              "cos and sin must be contiguous (B, T, D) tensors matching x (B, H, T, D)");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must have x's dtype");
}

// For each (b, h, t) row of x and out, with that row's cos and sin: row(x_row, out_row, cos_row, sin_row, half).
template <typename scalar_t, typename Row>
void over_rows(const at::Tensor& x, const at::Tensor& out, const at::Tensor& cos, const at::Tensor& sin, Row row) {
  const int64_t heads = x.size(1), tokens = x.size(2), dim = x.size(3);
  const int64_t rows = x.size(0) * heads * tokens;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r % tokens, h = (r / tokens) % heads, b = r / (tokens * heads);
      const int64_t at = (b * tokens + t) * dim;
      row(xp + b * xs0 + h * xs1 + t * xs2, op + b * os0 + h * os1 + t * os2, cp + at, sp + at, dim / 2);
    }
  });
}

// Lanes j.. of a row's two halves, widened: the first half's (lo0, lo1) and the second's (hi0, hi1)
template <typename scalar_t>
struct Halves {
  typename Lanes<scalar_t>::FloatVec lo0, lo1, hi0, hi1;

  Halves(const scalar_t* row, int64_t j, int64_t half) {
    std::tie(lo0, lo1) = Lanes<scalar_t>::load(row + j);
    std::tie(hi0, hi1) = Lanes<scalar_t>::load(row + half + j);
  }
};

// out = x * cos + rotate_half(x) * sin, each product rounded, then the sum
at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(x, cos, sin);
  auto out = at::empty_like(x);  // x's layout (empty_like keeps a dense view's strides)
  float_or_bf16(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    using L = Lanes<scalar_t>;
    over_rows<scalar_t>(x, out, cos, sin, [&](const scalar_t* xr, scalar_t* orow, const scalar_t* c, const scalar_t* s,
                                            int64_t half) {
      int64_t j = 0;
      if (half % L::size == 0) {
        for (; j < half; j += L::size) {
          const Halves<scalar_t> xs(xr, j, half), co(c, j, half), si(s, j, half);  // xs: (x1, x2)
          auto [p0, p1] = L::round(xs.lo0 * co.lo0, xs.lo1 * co.lo1);  // x1 * cos
          auto [q0, q1] = L::round(xs.hi0.neg() * si.lo0, xs.hi1.neg() * si.lo1);  // -x2 * sin
          L::store(orow + j, p0 + q0, p1 + q1);
          auto [u0, u1] = L::round(xs.hi0 * co.hi0, xs.hi1 * co.hi1);  // x2 * cos
          auto [v0, v1] = L::round(xs.lo0 * si.hi0, xs.lo1 * si.hi1);  // x1 * sin
          L::store(orow + half + j, u0 + v0, u1 + v1);
        }
      }
      for (; j < half; ++j) {
        const float a = widen(xr[j]), b = widen(xr[half + j]);
        const float p = widen(narrow<scalar_t>(a * widen(c[j]))), q = widen(narrow<scalar_t>(-b * widen(s[j])));
        orow[j] = narrow<scalar_t>(p + q);
        const float u = widen(narrow<scalar_t>(b * widen(c[half + j])));
        const float v = widen(narrow<scalar_t>(a * widen(s[half + j])));
        orow[half + j] = narrow<scalar_t>(u + v);
      }
    });
  });
  return out;
}

// The gradient of x for the output's gradient g (B, H, T, D), written into dx (any layout contiguous along D)
void rotary_backward(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& dx) {
  check_rotary(g, cos, sin);
  TORCH_CHECK(dx.sizes() == g.sizes() && dx.scalar_type() == g.scalar_type() && dx.stride(3) == 1,
              "dx must have g's shape and dtype, contiguous along D");
  float_or_bf16(g, [&](auto tag) {
    using scalar_t = decltype(tag);
    using L = Lanes<scalar_t>;
    over_rows<scalar_t>(g, dx, cos, sin, [&](const scalar_t* gr, scalar_t* drow, const scalar_t* c, const scalar_t* s,
                                            int64_t half) {
      int64_t j = 0;
      if (half % L::size == 0) {
        for (; j < half; j += L::size) {
          const Halves<scalar_t> gs(gr, j, half), co(c, j, half), si(s, j, half);
          auto [p0, p1] = L::round(gs.lo0 * co.lo0, gs.lo1 * co.lo1);  // g * cos, first half
          auto [q0, q1] = L::round(gs.hi0 * si.hi0, gs.hi1 * si.hi1);  // (g * sin), second half: x1's slice gradient
          L::store(drow + j, p0 + q0, p1 + q1);
          auto [u0, u1] = L::round(gs.hi0 * co.hi0, gs.hi1 * co.hi1);  // g * cos, second half
          auto [v0, v1] = L::round(gs.lo0 * si.lo0, gs.lo1 * si.lo1);  // (g * sin), first half, negated: x2's
          L::store(drow + half + j, u0 + v0.neg(), u1 + v1.neg());
        }
      }
      for (; j < half; ++j) {
        const float a = widen(gr[j]), b = widen(gr[half + j]);
        const float p = widen(narrow<scalar_t>(a * widen(c[j]))), q = widen(narrow<scalar_t>(b * widen(s[half + j])));
        drow[j] = narrow<scalar_t>(p + q);
        const float u = widen(narrow<scalar_t>(b * widen(c[half + j])));
        const float v = widen(narrow<scalar_t>(a * widen(s[j])));
        drow[half + j] = narrow<scalar_t>(u + -v);
      }
    });
  });
}

}  // namespace

void register_training_rotary(pybind11::module& m) {
  m.def("rotary_forward", &rotary_forward, "x * cos + rotate_half(x) * sin, as transformers' ops round it");
  m.def("rotary_backward", &rotary_backward, "the gradient of x of rotary_forward, into dx");
}

}  // namespace hybridflow
