// A decode step's work between the matmuls, fused (rollout/native/fused_layers.py): the rotary embedding, the
// key/value store and the attention of a layer in one call; the residual add with the next RMSNorm; SiLU(gate) * up.
//
// Bit for bit what model.py's torch ops compute, not merely close: every elementwise op rounds to the tensor's
// dtype where torch's does (bf16 products and sums are computed in float32 and rounded to nearest even, as
// torch's Vectorized<BFloat16> kernels do), the exponential is ATen's own vectorised one (Sleef, built for the CPU
// capability torch dispatches to here), RMSNorm's mean of squares is torch's own call, and the attention is
// ragged_decode.cpp's one-call form (its softmax follows torch's kernel step for step).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mean.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>

#include "elementwise.h"
#include "ragged_decode.h"

namespace hybridflow {
namespace {

using at::vec::Vectorized;
using namespace elementwise;

// x * cos + rotate_half(x) * sin over one head of D values, each product and the sum rounded to scalar_t (model.py
// `rotate`: x * cos, cat(-x2, x1) * sin, then their sum, three torch ops); out may not alias x
template <typename scalar_t>
inline void rotate_head(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, scalar_t* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < dim; ++j) {
    const float turned = j < half ? -widen(x[j + half]) : widen(x[j - half]);
    const scalar_t a = narrow<scalar_t>(widen(x[j]) * widen(cos[j]));
    const scalar_t b = narrow<scalar_t>(turned * widen(sin[j]));
    out[j] = narrow<scalar_t>(widen(a) + widen(b));
  }
}

// qkv (B, Q + 2K) after the projection; cos/sin the rotary tables (T, D); positions, slots, lengths (B,) int64;
// k_layer/v_layer one cache layer (S, Hkv, T, D). Rotates q and k, stores k and v at each sequence's position of its
// slot, and returns the attention over positions 0..lengths[b]-1: (B, Hq * D).
at::Tensor rope_store_attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& positions, at::Tensor k_layer, at::Tensor v_layer,
                             const at::Tensor& slots, const at::Tensor& lengths, int64_t width, double scale,
                             int64_t q_heads) {
  const int64_t batch = qkv.size(0), kv_heads = k_layer.size(1), dim = k_layer.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (q_heads + 2 * kv_heads) * dim,
              "qkv must be (B, (Hq + 2 Hkv) * D) with contiguous rows");
  TORCH_CHECK(q_heads % kv_heads == 0 && dim % 2 == 0, "query heads must be a multiple of kv heads, D even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == dim && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must be contiguous (T, D) tables of qkv's dtype");
  TORCH_CHECK(k_layer.scalar_type() == qkv.scalar_type() && v_layer.sizes() == k_layer.sizes() &&
                  v_layer.strides() == k_layer.strides() && v_layer.scalar_type() == k_layer.scalar_type(),
              "the cache layers must match each other and qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == batch,
              "positions must be a contiguous int64 (B,) tensor");
  check_slots_and_lengths(slots, lengths, batch, k_layer.size(0), width, k_layer.size(2));
  const int64_t* position = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(position[b] >= 0 && position[b] < k_layer.size(2) && position[b] < cos.size(0),
                "every position must be within the cache and the rotary tables");
  auto q = at::empty({batch, kv_heads, q_heads / kv_heads, dim}, qkv.options());
  check_layer(k_layer, q, lengths);
  float_or_bf16(qkv, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = qkv.data_ptr<scalar_t>();
    const scalar_t* cos_t = cos.data_ptr<scalar_t>();
    const scalar_t* sin_t = sin.data_ptr<scalar_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    scalar_t* q_out = q.data_ptr<scalar_t>();
    scalar_t* k_cache = k_layer.data_ptr<scalar_t>();
    scalar_t* v_cache = v_layer.data_ptr<scalar_t>();
    const int64_t slot_stride = k_layer.stride(0), head_stride = k_layer.stride(1), row = qkv.stride(0);
    at::parallel_for(0, batch, 16, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* x = in + b * row;
        const scalar_t* c = cos_t + position[b] * dim;
        const scalar_t* s = sin_t + position[b] * dim;
        for (int64_t h = 0; h < q_heads; ++h) rotate_head(x + h * dim, c, s, q_out + (b * q_heads + h) * dim, dim);
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t at_row = slot[b] * slot_stride + h * head_stride + position[b] * dim;
          rotate_head(x + (q_heads + h) * dim, c, s, k_cache + at_row, dim);
          const scalar_t* v = x + (q_heads + kv_heads + h) * dim;
          std::copy(v, v + dim, v_cache + at_row);
        }
      }
    });
  });
  return ragged_attend(q, k_layer, v_layer, lengths, slots, width, scale).view({batch, q_heads * dim});
}

// x + delta rounded to x's dtype (the residual stream), and RMSNorm of it: normalised in float32, rounded, then
// scaled by weight (model.py `rms_norm`; its mean of squares is torch's own reduction). Returns (sum, normed).
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.sizes() == x.sizes() && delta.is_contiguous() &&
                  delta.scalar_type() == x.scalar_type(),
              "x and delta must be contiguous (N, H) tensors of one dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous (H,) tensor of x's dtype");
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto sum = at::empty_like(x);
  auto squares = at::empty({rows, hidden}, x.options().dtype(at::kFloat));
  float_or_bf16(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    using Vec = Vectorized<scalar_t>;
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* d = delta.data_ptr<scalar_t>();
    scalar_t* s = sum.data_ptr<scalar_t>();
    float* sq = squares.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * hidden; i < end * hidden;) {
        if (i + Vec::size() <= end * hidden) {  // vectors: the sum rounded as torch's add, then squared in float32
          const Vec total = Vec::loadu(a + i) + Vec::loadu(d + i);
          total.store(s + i);
          if constexpr (std::is_same_v<scalar_t, float>) {
            (total * total).store(sq + i);
          } else {
            auto [low, high] = at::vec::convert_to_float<scalar_t>(total);
            (low * low).store(sq + i);
            (high * high).store(sq + i + Vectorized<float>::size());
          }
          i += Vec::size();
        } else {
          s[i] = narrow<scalar_t>(widen(a[i]) + widen(d[i]));
          const float f = widen(s[i]);
          sq[i] = f * f;
          ++i;
        }
      }
    });
  });
  auto mean = at::mean(squares, {-1}, true);  // (N, 1) float32, torch's order of summation
  auto normed = at::empty_like(x);
  float_or_bf16(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    using Vec = Vectorized<scalar_t>;
    using FloatVec = Vectorized<float>;
    const scalar_t* s = sum.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const float* m = mean.data_ptr<float>();
    scalar_t* out = normed.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float inverse = 1.0f / std::sqrt(m[r] + static_cast<float>(eps));
        const scalar_t* sr = s + r * hidden;
        scalar_t* o = out + r * hidden;
        int64_t j = 0;
        for (; j + Vec::size() <= hidden; j += Vec::size()) {  // x * inverse rounded, then times the weight rounded
          if constexpr (std::is_same_v<scalar_t, float>) {
            (Vec::loadu(w + j) * (Vec::loadu(sr + j) * FloatVec(inverse))).store(o + j);
          } else {
            auto [low, high] = at::vec::convert_to_float<scalar_t>(Vec::loadu(sr + j));
            const Vec scaled =
                at::vec::convert_from_float<scalar_t>(low * FloatVec(inverse), high * FloatVec(inverse));
            (Vec::loadu(w + j) * scaled).store(o + j);
          }
        }
        for (; j < hidden; ++j) {
          const scalar_t scaled = narrow<scalar_t>(widen(sr[j]) * inverse);
          o[j] = narrow<scalar_t>(widen(w[j]) * widen(scaled));
        }
      }
    });
  });
  return {sum, normed};
}

// SiLU(gate) * up of a (N, 2I) gate | up product: (N, I). Vectorized as torch's silu and mul kernels are (in float32
// with ATen's exponential, rounded after each op), row by row (torch's loops over the strided gate half go row by
// row): elements past a row's last full pair of vectors go through the scalar formula torch uses for them.
template <typename scalar_t>
void silu_mul_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t inner) {
  using Vec = Vectorized<scalar_t>;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = in + r * 2 * inner;
      const scalar_t* up = gate + inner;
      scalar_t* o = out + r * inner;
      silu_span(
          gate, inner, [&](int64_t j, const Vec& activated) { (activated * Vec::loadu(up + j)).store(o + j); },
          [&](int64_t j, float activated) {
            o[j] = narrow<scalar_t>(widen(narrow<scalar_t>(activated)) * widen(up[j]));
          });
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous (N, 2I) tensor");
  const int64_t inner = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inner}, gate_up.options());
  float_or_bf16(gate_up, [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inner);
  });
  return out;
}

}  // namespace

void register_fused(pybind11::module& m) {
  m.def("rope_store_attend", &rope_store_attend, "rotary, the key/value store and ragged attention of one layer");
  m.def("add_rms_norm", &add_rms_norm, "the residual add and the RMSNorm after it");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
}

}  // namespace hybridflow
