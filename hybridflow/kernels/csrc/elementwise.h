// What fused_decode.cpp and train_elementwise.cpp share: the dtype dispatch, float32 <-> dtype with torch's
// rounding, and SiLU over a contiguous span computed as torch's CPU kernels compute it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <type_traits>
#include <tuple>

namespace hybridflow::elementwise {

using at::vec::Vectorized;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename scalar_t>
inline scalar_t narrow(float x) { return static_cast<scalar_t>(x); }  // BFloat16: round to nearest even

// Calls use(value) with a value of the tensor's dtype: float32 and bfloat16, the compute dtypes
template <typename Use>
void float_or_bf16(const at::Tensor& tensor, Use use) {
  if (tensor.scalar_type() == at::kBFloat16) use(c10::BFloat16{});
  else if (tensor.scalar_type() == at::kFloat) use(float{});
  else TORCH_CHECK(false, "the fused ops take float32 or bfloat16 tensors, not ", tensor.scalar_type());
}

// 32 values of scalar_t as two vectors of float32 lanes: loaded widened, stored rounded to scalar_t (as torch's
// Vectorized<BFloat16> ops round their float32 results), or rounded and widened again where torch rounds between ops
template <typename scalar_t>
struct Lanes {
  using FloatVec = Vectorized<float>;
  static constexpr int64_t size = 2 * FloatVec::size();

  static std::tuple<FloatVec, FloatVec> load(const scalar_t* p) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      return {FloatVec::loadu(p), FloatVec::loadu(p + FloatVec::size())};
    } else {
      static_assert(Vectorized<scalar_t>::size() == size, "a bfloat16 vector widens to two float32 vectors");
      return at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p));
    }
  }
  static void store(scalar_t* p, const FloatVec& low, const FloatVec& high) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      low.store(p);
      high.store(p + FloatVec::size());
    } else {
      at::vec::convert_from_float<scalar_t>(low, high).store(p);
    }
  }
  static std::tuple<FloatVec, FloatVec> round(const FloatVec& low, const FloatVec& high) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      return {low, high};
    } else {
      return at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(low, high));
    }
  }
};

// SiLU of a vector of float32 lanes, as torch's vectorised silu kernel computes it (ATen's exponential)
inline Vectorized<float> silu_lanes(const Vectorized<float>& g) {
  return g / (Vectorized<float>(1.0f) + g.neg().exp());
}

// SiLU(gate[i]) rounded to scalar_t, i in [0, n), handed to emit(i, vectorised_value) a vector at a time or
// emit_scalar(i, float value) element by element: torch's elementwise loops take two vectors of scalar_t at a time
// and run the scalar formula (std::exp) on the elements after the last full pair, so a span of torch's own split
// gives torch's bits.
template <typename scalar_t, typename EmitVec, typename EmitScalar>
inline void silu_span(const scalar_t* gate, int64_t n, EmitVec emit, EmitScalar emit_scalar) {
  using Vec = Vectorized<scalar_t>;
  constexpr int64_t step = 2 * Vec::size();
  const int64_t whole = n - n % step;
  for (int64_t j = 0; j < whole; j += Vec::size()) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      emit(j, silu_lanes(Vec::loadu(gate + j)));
    } else {
      auto [g0, g1] = at::vec::convert_to_float<scalar_t>(Vec::loadu(gate + j));
      emit(j, at::vec::convert_from_float<scalar_t>(silu_lanes(g0), silu_lanes(g1)));
    }
  }
  for (int64_t j = whole; j < n; ++j) {
    const float g = widen(gate[j]);
    emit_scalar(j, g / (1.0f + std::exp(-g)));
  }
}

}  // namespace hybridflow::elementwise
