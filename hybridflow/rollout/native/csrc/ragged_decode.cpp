// Decode attention over each sequence's real length (rollout/native/ragged_attention.py).
//
// One query token per sequence b, its G query heads per kv head h, against positions 0..lengths[b]-1 of
// cache slot slots[b], kv head h: keys and values are read in place from the (S, Hkv, T, D) cache layer, whatever
// T (the slot's preallocated length) is. Two passes with torch's softmax between them:
//   scores[b, h, g, t] = scale * <q[b, h, g], k[b, h, t]>       (t < lengths[b]; -inf beyond)
//   out[b, h, g]       = sum_t probs[b, h, g, t] * v[b, h, t]    (t < lengths[b])
// Products are summed in float32; each task (b, h) reads its rows once, for all G heads.

// The few ATen headers it uses and the pybind11 glue, not <torch/extension.h> (all of torch's C++ API): the first
// use's build takes half the time (10 against 20 s on 2 cores).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "ragged_decode.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace hybridflow {
namespace {

// float32 of a stored value; bfloat16 is the upper half of a float32, widened by a shift (vectorises)
inline float widen(float x) { return x; }
inline float widen(double x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// r[j] = sum of the 16 lanes of a[j], j = 0..15, as one vector: a tree of in-lane unpacks and 128-bit shuffles
// (about 3 instructions per sum instead of a horizontal reduction each).
inline __m512 sum_lanes_16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// <q, k> of one query head against one key row, as a 16-lane vector of partial sums
template <typename scalar_t>
inline __m512 dot_lanes(const scalar_t* q, const scalar_t* k, int64_t dim);

template <>
inline __m512 dot_lanes<float>(const float* q, const float* k, int64_t dim) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  return acc;
}

template <>
inline __m512 dot_lanes<c10::BFloat16>(const c10::BFloat16* q, const c10::BFloat16* k, int64_t dim) {
  __m512 acc = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  for (int64_t d = 0; d < dim; d += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
#else
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 qf = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(q + d))), 16));
    const __m512 kf = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(k + d))), 16));
    acc = _mm512_fmadd_ps(qf, kf, acc);
  }
#endif
  return acc;
}

// scores of one task (a sequence's kv head): 16 key rows at a time, their 16 dot products summed as one vector
template <typename scalar_t>
void scores_task_avx512(const scalar_t* q, const scalar_t* k, int64_t n, int64_t groups, int64_t dim, float* out,
                        int64_t width, float scale) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 acc[16];
  for (int64_t g = 0; g < groups; ++g) {
    const scalar_t* qg = q + g * dim;
    float* og = out + g * width;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      for (int j = 0; j < 16; ++j) acc[j] = dot_lanes<scalar_t>(qg, k + (t + j) * dim, dim);
      _mm512_storeu_ps(og + t, _mm512_mul_ps(sum_lanes_16(acc), scale_v));
    }
    for (; t < n; ++t) og[t] = _mm512_reduce_add_ps(dot_lanes<scalar_t>(qg, k + t * dim, dim)) * scale;
  }
}

template <typename scalar_t>
constexpr bool has_avx512_scores(int64_t dim) {
  return std::is_same<scalar_t, c10::BFloat16>::value ? dim % 32 == 0 : std::is_same<scalar_t, float>::value && dim % 16 == 0;
}
#endif

// A thread's float32 buffer of `count` values: on the stack when its size is known at compile time (FIXED > 0)
template <int64_t FIXED>
struct Scratch {
  alignas(64) float fixed[FIXED ? FIXED : 1];
  std::vector<float> grown;
  explicit Scratch(int64_t count) : grown(FIXED ? 0 : count) {}
  float* data() { return FIXED ? fixed : grown.data(); }
};

// Runs task(index, b, h, group_rows, row) for every (sequence b, kv head h) of the batch, index = b * kv_heads + h,
// on the threads of at::parallel_for; each thread's scratch: group_rows, groups * dim floats, and row, dim floats
// (on the stack when GROUPS and DIM are known at compile time).
template <int64_t GROUPS, int64_t DIM, typename Task>
void for_each_head(int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, Task task) {
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch<GROUPS && DIM ? GROUPS * DIM : 0> group_rows(groups * dim);
    Scratch<DIM> row(dim);
    for (int64_t index = begin; index < end; ++index)
      task(index, index / kv_heads, index % kv_heads, group_rows.data(), row.data());
  });
}

// GROUPS and DIM: compile-time sizes for the common shapes (accumulators stay in registers); 0 = read at run time
template <typename scalar_t, int64_t GROUPS, int64_t DIM>
void scores_kernel(const scalar_t* q, const scalar_t* k, const int64_t* lengths, const int64_t* slots, float* scores,
                   int64_t batch,
                   int64_t kv_heads, int64_t groups_, int64_t dim_, int64_t slot_stride, int64_t head_stride,
                   int64_t width, float scale) {
  const int64_t groups = GROUPS ? GROUPS : groups_, dim = DIM ? DIM : dim_;
  for_each_head<GROUPS, DIM>(batch, kv_heads, groups, dim, [&](int64_t task, int64_t b, int64_t h, float* query,
                                                             float* row) {
    const int64_t n = lengths[b];
    const scalar_t* qp = q + task * groups * dim;
    const scalar_t* kp = k + slots[b] * slot_stride + h * head_stride;
    float* out = scores + task * groups * width;
#if defined(__AVX512F__)
    const bool vectorised = has_avx512_scores<scalar_t>(dim);
#else
    const bool vectorised = false;
#endif
    if (vectorised) {
#if defined(__AVX512F__)
      scores_task_avx512<scalar_t>(qp, kp, n, groups, dim, out, width, scale);
#endif
    } else {
      for (int64_t i = 0; i < groups * dim; ++i) query[i] = widen(qp[i]) * scale;
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* kr = kp + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] = widen(kr[d]);
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = query + g * dim;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < dim; ++d) sum = std::fma(qg[d], row[d], sum);
          out[g * width + t] = sum;
        }
      }
    }
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t t = n; t < width; ++t) out[g * width + t] = -std::numeric_limits<float>::infinity();
  });
}

template <typename scalar_t, int64_t GROUPS, int64_t DIM>
void values_kernel(const float* probs, const scalar_t* v, const int64_t* lengths, const int64_t* slots, scalar_t* out,
                   int64_t batch,
                   int64_t kv_heads, int64_t groups_, int64_t dim_, int64_t slot_stride, int64_t head_stride,
                   int64_t width) {
  const int64_t groups = GROUPS ? GROUPS : groups_, dim = DIM ? DIM : dim_;
  for_each_head<GROUPS, DIM>(batch, kv_heads, groups, dim, [&](int64_t task, int64_t b, int64_t h, float* acc,
                                                             float* row) {
    const int64_t n = lengths[b];
    for (int64_t i = 0; i < groups * dim; ++i) acc[i] = 0.f;
    const scalar_t* vp = v + slots[b] * slot_stride + h * head_stride;
    const float* p = probs + task * groups * width;
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* vr = vp + t * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) row[d] = widen(vr[d]);
      for (int64_t g = 0; g < groups; ++g) {
        const float w = p[g * width + t];
        float* ag = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ag[d] = std::fma(w, row[d], ag[d]);
      }
    }
    scalar_t* op = out + task * groups * dim;
    for (int64_t i = 0; i < groups * dim; ++i) op[i] = static_cast<scalar_t>(acc[i]);
  });
}

}  // namespace

void check_layer(const at::Tensor& cache, const at::Tensor& q, const at::Tensor& lengths) {
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 && cache.stride(2) == cache.size(3),
              "a cache layer must be (S, Hkv, T, D) with contiguous rows");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.scalar_type() == cache.scalar_type(),
              "queries must be a contiguous (B, Hkv, G, D) tensor of the cache's dtype");
  TORCH_CHECK(q.size(1) == cache.size(1) && q.size(3) == cache.size(3),
              "queries and cache disagree on kv heads or head dim");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == q.size(0) && lengths.scalar_type() == at::kLong &&
                  lengths.is_contiguous(),
              "lengths must be a contiguous int64 (B,) tensor");
}

// every sequence's slot is one of the cache's, and its length in 1..width (width <= the cache's positions):
// a plain loop over B values, run on each call, since the kernels index memory by them
void check_slots_and_lengths(const at::Tensor& slots, const at::Tensor& lengths, int64_t batch,
                             int64_t num_slots, int64_t width, int64_t positions) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == batch && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be a contiguous int64 (B,) tensor");
  TORCH_CHECK(width <= positions, "width exceeds the cache's positions");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "every slot must be one of the cache's");
    TORCH_CHECK(length[b] >= 1 && length[b] <= width, "every length must be in 1..width");
  }
}

namespace {

// Calls use(groups, dim) as std::integral_constant values: the query's own (G, D) when the kernels have a build
// for it (its loops unrolled at compile time), else (0, 0), the build that reads both at run time.
template <typename Use>
void with_shape(int64_t groups, int64_t dim, Use use) {
  using G1 = std::integral_constant<int64_t, 1>;
  using G3 = std::integral_constant<int64_t, 3>;
  using G4 = std::integral_constant<int64_t, 4>;
  using G7 = std::integral_constant<int64_t, 7>;
  using D64 = std::integral_constant<int64_t, 64>;
  using D128 = std::integral_constant<int64_t, 128>;
  using Any = std::integral_constant<int64_t, 0>;
  if (dim == 64 && groups == 3) use(G3{}, D64{});
  else if (dim == 64 && groups == 1) use(G1{}, D64{});
  else if (dim == 64 && groups == 4) use(G4{}, D64{});
  else if (dim == 128 && groups == 1) use(G1{}, D128{});
  else if (dim == 128 && groups == 4) use(G4{}, D128{});
  else if (dim == 128 && groups == 7) use(G7{}, D128{});
  else use(Any{}, Any{});
}

}  // namespace

// q (B, Hkv, G, D); k_layer (S, Hkv, T, D); lengths (B,) with 1 <= lengths <= T; width >= max(lengths);
// slots (B,): the cache slot of each query (several may share one: consecutive tokens of a sequence in an extend).
at::Tensor ragged_scores(at::Tensor q, at::Tensor k_layer, at::Tensor lengths, at::Tensor slots, int64_t width,
                  double scale) {
  check_layer(k_layer, q, lengths);
  check_slots_and_lengths(slots, lengths, q.size(0), k_layer.size(0), width, k_layer.size(2));
  auto out = at::empty({q.size(0), q.size(1), q.size(2), width}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "ragged_scores", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k_layer.data_ptr<scalar_t>(), lengths.data_ptr<int64_t>(),
             slots.data_ptr<int64_t>(), out.data_ptr<float>(),
             q.size(0), q.size(1), q.size(2), q.size(3), k_layer.stride(0), k_layer.stride(1), width,
             static_cast<float>(scale));
    };
    with_shape(q.size(2), q.size(3), [&](auto groups, auto dim) {
      run(scores_kernel<scalar_t, decltype(groups)::value, decltype(dim)::value>);
    });
  });
  return out;
}

// probs (B, Hkv, G, width) float32; v_layer (S, Hkv, T, D); returns (B, Hkv, G, D) in the cache's dtype.
at::Tensor ragged_values(at::Tensor probs, at::Tensor v_layer, at::Tensor lengths, at::Tensor slots) {
  TORCH_CHECK(probs.dim() == 4 && probs.is_contiguous() && probs.scalar_type() == at::kFloat,
              "probs must be a contiguous float32 (B, Hkv, G, width) tensor");
  auto out = at::empty({probs.size(0), probs.size(1), probs.size(2), v_layer.size(3)}, v_layer.options());
  check_layer(v_layer, out, lengths);
  check_slots_and_lengths(slots, lengths, probs.size(0), v_layer.size(0), probs.size(3), v_layer.size(2));
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, v_layer.scalar_type(), "ragged_values", [&] {
    auto run = [&](auto kernel) {
      kernel(probs.data_ptr<float>(), v_layer.data_ptr<scalar_t>(), lengths.data_ptr<int64_t>(),
             slots.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), probs.size(0), probs.size(1), probs.size(2), v_layer.size(3),
             v_layer.stride(0), v_layer.stride(1), probs.size(3));
    };
    with_shape(probs.size(2), v_layer.size(3), [&](auto groups, auto dim) {
      run(values_kernel<scalar_t, decltype(groups)::value, decltype(dim)::value>);
    });
  });
  return out;
}

}  // namespace hybridflow

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scores", &hybridflow::ragged_scores, "scale * q.k over each sequence's real length; -inf beyond");
  m.def("values", &hybridflow::ragged_values, "probs-weighted sum of each sequence's real value rows");
  hybridflow::register_fused(m);
}
