// Drawing one token per row from softmax(logits / temperature) at a given uniform number, without materialising
// the probabilities: rollout/native/sampler.py's untruncated draw (the inverse of the cumulative distribution at
// u * total) and the drawn token's log-probability, in two passes over each row's logits.
//
// torch's path writes the (B, V) float32 probabilities, sums them by blocks, accumulates and searches the block
// sums, and gathers: five passes over (B, V) and a 6-25 MB buffer a decode step. Here each row is read twice from
// cache (its maximum, then the exponentials summed by blocks of BLOCK tokens), the block holding u * total is found
// in the block sums, and only that block's exponentials are computed again and scanned. The numbers are the same
// distribution, not the same bits: the exponentials and sums are rounded in another order than torch's softmax, so a
// draw that falls within a rounding error of a boundary between two tokens may pick the other one.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "elementwise.h"
#include "ragged_decode.h"

namespace hybridflow {
namespace {

using elementwise::float_or_bf16;
using elementwise::widen;
using FloatVec = at::vec::Vectorized<float>;

constexpr int64_t BLOCK = 1024;  // tokens per block sum: a multiple of every vector width
static_assert(BLOCK % (2 * FloatVec::size()) == 0, "a block holds whole vectors");

// logits[j] / temperature in float32 for j in [start, start + 2 * FloatVec::size()): two vectors
template <typename scalar_t>
inline std::tuple<FloatVec, FloatVec> scaled_lanes(const scalar_t* row, int64_t start, float temperature, bool scale) {
  auto [low, high] = elementwise::Lanes<scalar_t>::load(row + start);
  if (scale) return {low / FloatVec(temperature), high / FloatVec(temperature)};
  return {low, high};
}

template <typename scalar_t>
inline float scaled(const scalar_t* row, int64_t j, float temperature, bool scale) {
  const float x = widen(row[j]);
  return scale ? x / temperature : x;
}

// exp(logits[j] / temperature - top) for the BLOCK-or-fewer tokens of one block, into out: vectors over the block's
// whole vectors and std::exp after them, so that the block's sum and its scan see the same values
template <typename scalar_t>
inline void block_exponentials(const scalar_t* row, int64_t start, int64_t end, float temperature, bool scale,
                               float top, float* out) {
  constexpr int64_t step = 2 * FloatVec::size();
  int64_t j = start;
  for (; j + step <= end; j += step) {
    auto [low, high] = scaled_lanes(row, j, temperature, scale);
    (low - FloatVec(top)).exp_u20().store(out + (j - start));
    (high - FloatVec(top)).exp_u20().store(out + (j - start) + FloatVec::size());
  }
  for (; j < end; ++j) out[j - start] = std::exp(scaled(row, j, temperature, scale) - top);
}

// The sum of n float32 values, in four vector accumulators (then their lanes and the values after the last whole
// group in double)
inline double sum_of(const float* values, int64_t n) {
  constexpr int64_t width = FloatVec::size();
  FloatVec acc[4] = {FloatVec(0.0f), FloatVec(0.0f), FloatVec(0.0f), FloatVec(0.0f)};
  int64_t k = 0;
  for (; k + 4 * width <= n; k += 4 * width) {
    for (int a = 0; a < 4; ++a) acc[a] = acc[a] + FloatVec::loadu(values + k + a * width);
  }
  std::array<float, width> lanes;
  ((acc[0] + acc[1]) + (acc[2] + acc[3])).store(lanes.data());
  double sum = 0.0;
  for (float lane : lanes) sum += lane;
  for (; k < n; ++k) sum += values[k];
  return sum;
}

template <typename scalar_t>
void draw_row(const scalar_t* row, int64_t vocab, float u, float temperature, int64_t* token, float* log_prob) {
  const bool scale = temperature != 1.0f;
  constexpr int64_t step = 2 * FloatVec::size();
  // pass 1: the largest scaled logit
  FloatVec top_lanes(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + step <= vocab; j += step) {
    auto [low, high] = scaled_lanes(row, j, temperature, scale);
    top_lanes = at::vec::maximum(top_lanes, at::vec::maximum(low, high));
  }
  std::array<float, FloatVec::size()> lanes;
  top_lanes.store(lanes.data());
  float top = *std::max_element(lanes.begin(), lanes.end());
  for (; j < vocab; ++j) top = std::max(top, scaled(row, j, temperature, scale));
  // pass 2: each block's sum of exponentials, and the total
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  std::vector<double> block_sums(blocks);
  alignas(64) std::array<float, BLOCK> exps;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * BLOCK, end = std::min(vocab, start + BLOCK);
    block_exponentials(row, start, end, temperature, scale, top, exps.data());
    block_sums[b] = sum_of(exps.data(), end - start);
    total += block_sums[b];
  }
  if (!(total > 0.0) || !std::isfinite(total)) {  // every logit -inf, or a NaN: the first largest, no log-prob
    int64_t first = 0;
    for (int64_t k = 0; k < vocab; ++k) {
      if (scaled(row, k, temperature, scale) == top) {
        first = k;
        break;
      }
    }
    *token = first;
    *log_prob = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // pass 3: the block whose cumulative sum reaches u * total, then the token within it
  const double target = static_cast<double>(u) * total;
  double sum = 0.0, before = 0.0;  // before: the mass ahead of the chosen block
  int64_t chosen = -1;
  for (int64_t b = 0; b < blocks; ++b) {
    if (!(block_sums[b] > 0.0)) continue;  // no mass: never chosen (u = 0 reaches its target at once)
    chosen = b;  // the last block with mass, where rounding leaves the target unreached
    before = sum;
    if (sum + block_sums[b] >= target) break;
    sum += block_sums[b];
  }
  const int64_t start = chosen * BLOCK, end = std::min(vocab, start + BLOCK);
  block_exponentials(row, start, end, temperature, scale, top, exps.data());
  int64_t pick = -1;
  double cumulative = before;
  for (int64_t k = 0; k < end - start; ++k) {
    if (exps[k] > 0.0f) pick = k;  // the block's last token with mass, where rounding leaves the target unreached
    cumulative += exps[k];
    if (exps[k] > 0.0f && cumulative >= target) {
      pick = k;
      break;
    }
  }
  *token = start + pick;
  *log_prob = static_cast<float>(scaled(row, start + pick, temperature, scale) - top - std::log(total));
}

// (tokens (B,) int64, log-probs (B,) float32) drawn from softmax(logits / temperature), row r at u[r] in [0, 1]
std::vector<at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& u, double temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "logits must be a contiguous (B, V) tensor with V > 0");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == logits.size(0) && u.is_contiguous() && u.scalar_type() == at::kFloat,
              "u must be a contiguous (B,) float32 tensor");
  TORCH_CHECK(temperature > 0.0, "temperature must be > 0, got ", temperature);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  auto log_probs = at::empty({rows}, logits.options().dtype(at::kFloat));
  float_or_bf16(logits, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* x = logits.data_ptr<scalar_t>();
    const float* uniform = u.data_ptr<float>();
    int64_t* out_tokens = tokens.data_ptr<int64_t>();
    float* out_log_probs = log_probs.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        draw_row(x + r * vocab, vocab, uniform[r], static_cast<float>(temperature), out_tokens + r,
                 out_log_probs + r);
      }
    });
  });
  return {tokens, log_probs};
}

}  // namespace

void register_sampling(pybind11::module& m) {
  m.def("sample_rows", &sample_rows, "one token per row from softmax(logits / temperature) at u, and its log-prob");
}

}  // namespace hybridflow
