// Decode attention in one call (ragged_attention.py `decode_attention` in float32 and bfloat16): for each sequence's
// kv head, its scores, the softmax torch's kernel computes over them (step for step, so the same numbers as
// ragged_decode.cpp's two passes with torch.softmax between them) and the values sum, on one thread, the values
// fetched while the scores are computed and the next task's keys while the values are summed.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#include "ragged_decode.h"
#include "ragged_tasks.h"

namespace hybridflow {
namespace {

using namespace ragged;

// Asks for `count` values from x into the cache, one request per 64-byte line (a hint: nothing waits for it)
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* x, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(x);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
    __builtin_prefetch(bytes + offset, 0, 3);
}

// Both passes and the softmax between them in one task per (sequence, kv head): the scores stay in the thread's
// buffer. ``softmax_row`` rounds a row of scores to scalar_t and replaces it with torch's softmax of the rounded row,
// rounded again and widened (the two passes' Python glue: scores.to(dtype).softmax(-1).float()).
template <typename scalar_t, int64_t GROUPS, int64_t DIM, typename Softmax>
void attend_kernel(const scalar_t* q, const scalar_t* k, const scalar_t* v, const int64_t* lengths,
                   const int64_t* slots, scalar_t* out, int64_t batch, int64_t kv_heads, int64_t groups_, int64_t dim_,
                   int64_t slot_stride, int64_t head_stride, int64_t width, float scale, Softmax softmax_row) {
  const int64_t groups = GROUPS ? GROUPS : groups_, dim = DIM ? DIM : dim_;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch<GROUPS && DIM ? GROUPS * DIM : 0> group_rows(groups * dim);
    Scratch<DIM> row(dim);
    std::vector<float> scores(groups * width), softmax_buffer(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, n = lengths[b];
      const int64_t at = slots[b] * slot_stride + h * head_stride;
      prefetch_rows(v + at, n * dim);  // the values stream in while the scores are computed
      if (task + 1 < end) {  // and the next task's keys while this one's values are summed
        const int64_t next_b = (task + 1) / kv_heads, next_h = (task + 1) % kv_heads;
        prefetch_rows(k + slots[next_b] * slot_stride + next_h * head_stride, lengths[next_b] * dim);
      }
      scores_task(q + task * groups * dim, k + at, n, groups, dim, scores.data(), width, scale, group_rows.data(),
                  row.data());
      for (int64_t g = 0; g < groups; ++g) softmax_row(scores.data() + g * width, width, softmax_buffer.data());
      values_task<scalar_t, GROUPS, DIM>(scores.data(), v + at, n, groups, dim, width, out + task * groups * dim, group_rows.data(),
                  row.data());
    }
  });
}

using FloatVec = at::vec::Vectorized<float>;

// torch's softmax of a row of `width` scores rounded to bfloat16 (its CPU kernel for a bf16 last dimension: the max,
// exp(x - max) in vectors of 16 with ATen's exponential and the scalar std::exp past them, their sum, then x times
// 1/sum rounded to bf16), replacing the row with the rounded probabilities widened to float32
inline void softmax_row_bf16(float* x, int64_t width, float* buffer) {
  using Bf16Vec = at::vec::Vectorized<c10::BFloat16>;
  constexpr int64_t pair = Bf16Vec::size();  // two float vectors
  FloatVec max_vec(-std::numeric_limits<float>::infinity());
  int64_t d = 0;
  for (; d < width - width % pair; d += pair) {  // round to bf16 and back, in vectors
    const Bf16Vec rounded =
        at::vec::convert_float_bfloat16(FloatVec::loadu(x + d), FloatVec::loadu(x + d + FloatVec::size()));
    auto [low, high] = at::vec::convert_bfloat16_float(rounded);
    max_vec = at::vec::maximum(max_vec, at::vec::maximum(low, high));
    low.store(buffer + d);
    high.store(buffer + d + FloatVec::size());
  }
  float max_val = at::vec::vec_reduce_all([](FloatVec& a, FloatVec& b) { return at::vec::maximum(a, b); }, max_vec);
  for (; d < width; ++d) {
    buffer[d] = static_cast<float>(c10::BFloat16(x[d]));
    max_val = std::max(max_val, buffer[d]);
  }
  FloatVec sum_vec(0.f);
  d = 0;
  for (; d < width - width % FloatVec::size(); d += FloatVec::size()) {
    const FloatVec e = (FloatVec::loadu(buffer + d) - FloatVec(max_val)).exp();
    sum_vec += e;
    e.store(buffer + d);
  }
  float sum = at::vec::vec_reduce_all([](FloatVec& a, FloatVec& b) { return a + b; }, sum_vec);
  for (; d < width; ++d) {
    const float e = std::exp(buffer[d] - max_val);
    sum += e;
    buffer[d] = e;
  }
  sum = 1 / sum;
  const FloatVec inverse(sum);
  d = 0;
  for (; d < width - width % pair; d += pair) {
    const Bf16Vec rounded = at::vec::convert_float_bfloat16(FloatVec::loadu(buffer + d) * inverse,
                                                            FloatVec::loadu(buffer + d + FloatVec::size()) * inverse);
    auto [low, high] = at::vec::convert_bfloat16_float(rounded);
    low.store(x + d);
    high.store(x + d + FloatVec::size());
  }
  for (; d < width; ++d) x[d] = static_cast<float>(c10::BFloat16(buffer[d] * sum));
}

// torch's softmax of a float32 row (its CPU kernel: ATen's vectorised reductions and maps), in place
inline void softmax_row_float(float* x, int64_t width, float*) {
  const float max_val =
      at::vec::reduce_all<float>([](FloatVec& a, FloatVec& b) { return at::vec::maximum(a, b); }, x, width);
  at::vec::map([max_val](FloatVec v) { return (v - FloatVec(max_val)).exp(); }, x, x, width);
  const float sum = 1 / at::vec::reduce_all<float>([](FloatVec a, FloatVec b) { return a + b; }, x, width);
  at::vec::map([sum](FloatVec v) { return v * FloatVec(sum); }, x, x, width);
}

}  // namespace

// The two passes and the softmax between them in one call, bit for bit
// ragged_values(scores.to(dtype).softmax(-1).float()) of ragged_scores' scores: (B, Hkv, G, D) in q's dtype.
at::Tensor ragged_attend(at::Tensor q, at::Tensor k_layer, at::Tensor v_layer, at::Tensor lengths, at::Tensor slots,
                         int64_t width, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "the one-call attention takes float32 or bfloat16, not ", q.scalar_type());
  check_layer(k_layer, q, lengths);
  check_layer(v_layer, q, lengths);
  TORCH_CHECK(v_layer.sizes() == k_layer.sizes() && v_layer.strides() == k_layer.strides(),
              "keys and values must be cache layers of one layout");
  check_slots_and_lengths(slots, lengths, q.size(0), k_layer.size(0), width, k_layer.size(2));
  auto out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "ragged_attend", [&] {
    with_shape(q.size(2), q.size(3), [&](auto groups, auto dim) {
      auto run = [&](auto softmax_row) {
        attend_kernel<scalar_t, decltype(groups)::value, decltype(dim)::value>(
            q.data_ptr<scalar_t>(), k_layer.data_ptr<scalar_t>(), v_layer.data_ptr<scalar_t>(),
            lengths.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0), q.size(1),
            q.size(2), q.size(3), k_layer.stride(0), k_layer.stride(1), width, static_cast<float>(scale),
            softmax_row);
      };
      if (std::is_same<scalar_t, c10::BFloat16>::value) run(softmax_row_bf16);
      else run(softmax_row_float);
    });
  });
  return out;
}

}  // namespace hybridflow
