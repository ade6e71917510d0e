// The ragged decode kernels' per-task loops, shared by ragged_decode.cpp (the two passes apart) and
// ragged_attend.cpp (both in one call): one task is one sequence's kv head, its G query heads together.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace hybridflow::ragged {

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

// One task's scores: out[g, t] = scale * <q[g], k[t]> for t < n, -inf for n <= t < width (query, row: scratch)
template <typename scalar_t>
void scores_task(const scalar_t* qp, const scalar_t* kp, int64_t n, int64_t groups, int64_t dim, float* out,
                 int64_t width, float scale, float* query, float* row) {
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
}

#if defined(__AVX512F__)
// 16 values of a row as float32 (bf16 widened by a shift)
inline __m512 load_16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_16(const c10::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}

// values_task for shapes known at compile time: the G x D accumulators stay in registers, the same fused
// multiply-adds in the same order (t ascending), so the same numbers as the generic loop
template <typename scalar_t, int64_t GROUPS, int64_t DIM>
void values_task_avx512(const float* p, const scalar_t* vp, int64_t n, int64_t width, scalar_t* out, float* acc_out) {
  constexpr int64_t vectors = DIM / 16;
  __m512 acc[GROUPS][vectors];
  for (int64_t g = 0; g < GROUPS; ++g)
    for (int64_t j = 0; j < vectors; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 row[vectors];
    for (int64_t j = 0; j < vectors; ++j) row[j] = load_16(vp + t * DIM + 16 * j);
    for (int64_t g = 0; g < GROUPS; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * width + t]);
      for (int64_t j = 0; j < vectors; ++j) acc[g][j] = _mm512_fmadd_ps(w, row[j], acc[g][j]);
    }
  }
  for (int64_t g = 0; g < GROUPS; ++g)
    for (int64_t j = 0; j < vectors; ++j) _mm512_storeu_ps(acc_out + g * DIM + 16 * j, acc[g][j]);
  for (int64_t i = 0; i < GROUPS * DIM; ++i) out[i] = static_cast<scalar_t>(acc_out[i]);
}
#endif

// One task's output: out[g] = sum over t < n of p[g, t] * v[t], in float32 (acc, row: scratch)
template <typename scalar_t, int64_t GROUPS, int64_t DIM>
void values_task(const float* p, const scalar_t* vp, int64_t n, int64_t groups, int64_t dim, int64_t width,
                 scalar_t* out, float* acc, float* row) {
#if defined(__AVX512F__)
  if constexpr (GROUPS > 0 && DIM > 0 && DIM % 16 == 0 &&
                (std::is_same<scalar_t, float>::value || std::is_same<scalar_t, c10::BFloat16>::value)) {
    values_task_avx512<scalar_t, GROUPS, DIM>(p, vp, n, width, out, acc);
    return;
  }
#endif
  for (int64_t i = 0; i < groups * dim; ++i) acc[i] = 0.f;
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
  for (int64_t i = 0; i < groups * dim; ++i) out[i] = static_cast<scalar_t>(acc[i]);
}


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

}  // namespace hybridflow::ragged
