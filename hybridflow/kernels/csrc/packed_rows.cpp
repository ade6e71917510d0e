// The packed attention's moves between the packed sequence and its rows (engine/packing.py, kernels/packed_rows.py):
// q, k and v gathered from their tokens straight into the layouts the batched matmuls take ((rows, heads, L, d); k
// as (rows, heads, d, L)), and the output back to its tokens, with their backwards. torch's ops do each in two passes
// (index_select, then a copy into the matmul's layout), and backward zero-fill and index_add_ one slot at a time.
//
// Bit for bit torch's (tests/kernels/test_packed_rows.py): the gathers copy, and a token's gradient is index_add_'s,
// its slots' gradients added in slot order to a zero, each sum rounded to the dtype (a shared prompt's token sums
// the gradients of every row that holds it; the slots after a row's end point at token 0 and add their zeros).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>

#include "elementwise.h"

namespace hybridflow {
namespace {

using namespace elementwise;

void check_slots(const at::Tensor& slots, int64_t tokens, const char* name) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), name,
              ": a contiguous int64 vector");
  const int64_t* s = slots.data_ptr<int64_t>();
  const auto [low, high] = std::minmax_element(s, s + slots.numel());
  TORCH_CHECK(slots.numel() == 0 || (*low >= 0 && *high < tokens), name, ": an index out of [0, ", tokens, ")");
}

// x (tokens, heads, d), d contiguous; slots (rows * length,): the token of each row's slot ->
// (rows, heads, length, d), or with `transpose` (rows, heads, d, length), contiguous
at::Tensor rows_gather(const at::Tensor& x, const at::Tensor& slots, int64_t rows, bool transpose) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rows_gather: x must be (tokens, heads, d) with d contiguous");
  TORCH_CHECK(rows > 0 && slots.numel() % rows == 0, "rows_gather: slots must hold rows * length entries");
  check_slots(slots, x.size(0), "rows_gather: slots");
  const int64_t heads = x.size(1), d = x.size(2), length = slots.numel() / rows;
  auto out = transpose ? at::empty({rows, heads, d, length}, x.options())
                       : at::empty({rows, heads, length, d}, x.options());
  float_or_bf16(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = x.data_ptr<scalar_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
    at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / heads, j = task % heads;
        scalar_t* block = dst + task * length * d;
        for (int64_t l = 0; l < length; ++l) {
          const scalar_t* from = src + slot[r * length + l] * token_stride + j * head_stride;
          if (transpose) {
            for (int64_t e = 0; e < d; ++e) block[e * length + l] = from[e];
          } else {
            std::memcpy(block + l * d, from, d * sizeof(scalar_t));
          }
        }
      }
    });
  });
  return out;
}

// rows_gather's backward: grad (rows, heads, length, d), or with `transpose` (rows, heads, d, length), contiguous ->
// (heads, tokens, d): zero, then each slot's gradient added to its token's, in slot order, rounded after each sum
at::Tensor rows_scatter_add(const at::Tensor& grad, const at::Tensor& slots, int64_t tokens, bool transpose) {
  TORCH_CHECK(grad.dim() == 4 && grad.is_contiguous(), "rows_scatter_add: grad must be contiguous (rows, heads, ., .)");
  const int64_t rows = grad.size(0), heads = grad.size(1);
  const int64_t length = transpose ? grad.size(3) : grad.size(2), d = transpose ? grad.size(2) : grad.size(3);
  TORCH_CHECK(slots.numel() == rows * length, "rows_scatter_add: slots must hold rows * length entries");
  check_slots(slots, tokens, "rows_scatter_add: slots");
  auto out = at::zeros({heads, tokens, d}, grad.options());
  float_or_bf16(grad, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    // a task: one head's span of d; every slot in order, so each value sums as index_add_ sums it
    constexpr int64_t span = 32;
    const int64_t spans = (d + span - 1) / span;
    at::parallel_for(0, heads * spans, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t j = task / spans, e0 = (task % spans) * span, e1 = std::min(d, e0 + span);
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* block = g + (r * heads + j) * length * d;
          for (int64_t l = 0; l < length; ++l) {
            scalar_t* to = dst + (j * tokens + slot[r * length + l]) * d;
            if (transpose) {
              for (int64_t e = e0; e < e1; ++e) to[e] = narrow<scalar_t>(widen(to[e]) + widen(block[e * length + l]));
            } else {
              const scalar_t* from = block + l * d;
              for (int64_t e = e0; e < e1; ++e) to[e] = narrow<scalar_t>(widen(to[e]) + widen(from[e]));
            }
          }
        }
      }
    });
  });
  return out;
}

// y (rows, heads, length, d) contiguous; real (tokens,): the slot whose output each token takes -> (tokens, heads, d)
at::Tensor rows_to_tokens(const at::Tensor& y, const at::Tensor& real) {
  TORCH_CHECK(y.dim() == 4 && y.is_contiguous(), "rows_to_tokens: y must be contiguous (rows, heads, length, d)");
  const int64_t heads = y.size(1), length = y.size(2), d = y.size(3), tokens = real.numel();
  check_slots(real, y.size(0) * length, "rows_to_tokens: real");
  auto out = at::empty({tokens, heads, d}, y.options());
  float_or_bf16(y, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = y.data_ptr<scalar_t>();
    const int64_t* slot = real.data_ptr<int64_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int64_t r = slot[n] / length, l = slot[n] % length;
        for (int64_t j = 0; j < heads; ++j)
          std::memcpy(dst + (n * heads + j) * d, src + ((r * heads + j) * length + l) * d, d * sizeof(scalar_t));
      }
    });
  });
  return out;
}

// rows_to_tokens' backward: grad (tokens, heads, d) contiguous -> (rows, heads, length, d): zero, and at each token's
// slot zero plus its gradient (as index_add_ into zeros gives it: a gradient of -0 comes out +0)
at::Tensor tokens_to_rows(const at::Tensor& grad, const at::Tensor& real, int64_t rows, int64_t length) {
  TORCH_CHECK(grad.dim() == 3 && grad.is_contiguous(), "tokens_to_rows: grad must be contiguous (tokens, heads, d)");
  const int64_t tokens = grad.size(0), heads = grad.size(1), d = grad.size(2);
  TORCH_CHECK(real.numel() == tokens, "tokens_to_rows: real must hold one slot per token");
  check_slots(real, rows * length, "tokens_to_rows: real");
  auto out = at::zeros({rows, heads, length, d}, grad.options());
  float_or_bf16(grad, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const int64_t* slot = real.data_ptr<int64_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int64_t r = slot[n] / length, l = slot[n] % length;
        for (int64_t j = 0; j < heads; ++j) {
          const scalar_t* from = g + (n * heads + j) * d;
          scalar_t* to = dst + ((r * heads + j) * length + l) * d;
          for (int64_t e = 0; e < d; ++e) to[e] = narrow<scalar_t>(0.0f + widen(from[e]));
        }
      }
    });
  });
  return out;
}

}  // namespace

void register_packed_rows(pybind11::module& m) {
  m.def("rows_gather", &rows_gather, "the packed tokens' q, k or v in the rows' matmul layout");
  m.def("rows_scatter_add", &rows_scatter_add, "rows_gather's backward: each token's slots summed as index_add_ does");
  m.def("rows_to_tokens", &rows_to_tokens, "the rows' attention output at each packed token");
  m.def("tokens_to_rows", &tokens_to_rows, "rows_to_tokens' backward");
}

}  // namespace hybridflow
