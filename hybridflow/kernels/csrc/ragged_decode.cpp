// Decode attention over each sequence's real length (rollout/native/ragged_attention.py).
//
// One query token per sequence b, its G query heads per kv head h, against positions 0..lengths[b]-1 of
// cache slot slots[b], kv head h: keys and values are read in place from the (S, Hkv, T, D) cache layer, whatever
// T (the slot's preallocated length) is. Two passes with a softmax between them (torch's, or in `ragged_attend` its
// steps in the same task):
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
#include "ragged_tasks.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace hybridflow {
namespace {

using namespace ragged;

// GROUPS and DIM: compile-time sizes for the common shapes (accumulators stay in registers); 0 = read at run time
template <typename scalar_t, int64_t GROUPS, int64_t DIM>
void scores_kernel(const scalar_t* q, const scalar_t* k, const int64_t* lengths, const int64_t* slots, float* scores,
                   int64_t batch, int64_t kv_heads, int64_t groups_, int64_t dim_, int64_t slot_stride,
                   int64_t head_stride, int64_t width, float scale) {
  const int64_t groups = GROUPS ? GROUPS : groups_, dim = DIM ? DIM : dim_;
  for_each_head<GROUPS, DIM>(batch, kv_heads, groups, dim, [&](int64_t task, int64_t b, int64_t h, float* query,
                                                             float* row) {
    scores_task(q + task * groups * dim, k + slots[b] * slot_stride + h * head_stride, lengths[b], groups, dim,
                scores + task * groups * width, width, scale, query, row);
  });
}

template <typename scalar_t, int64_t GROUPS, int64_t DIM>
void values_kernel(const float* probs, const scalar_t* v, const int64_t* lengths, const int64_t* slots, scalar_t* out,
                   int64_t batch, int64_t kv_heads, int64_t groups_, int64_t dim_, int64_t slot_stride,
                   int64_t head_stride, int64_t width) {
  const int64_t groups = GROUPS ? GROUPS : groups_, dim = DIM ? DIM : dim_;
  for_each_head<GROUPS, DIM>(batch, kv_heads, groups, dim, [&](int64_t task, int64_t b, int64_t h, float* acc,
                                                             float* row) {
    values_task<scalar_t, GROUPS, DIM>(probs + task * groups * width, v + slots[b] * slot_stride + h * head_stride, lengths[b], groups, dim,
                width, out + task * groups * dim, acc, row);
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

using ragged::with_shape;

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
  m.def("attend", &hybridflow::ragged_attend, "both passes and the softmax between them, in one call");
  hybridflow::register_fused(m);
  hybridflow::register_training(m);
  hybridflow::register_training_softmax(m);
  hybridflow::register_packed_rows(m);
  hybridflow::register_training_rotary(m);
  hybridflow::register_sampling(m);
}
