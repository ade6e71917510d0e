// What fused_decode.cpp uses of ragged_decode.cpp: the ragged kernels' two passes and their input checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

namespace hybridflow {

void check_layer(const at::Tensor& cache, const at::Tensor& q, const at::Tensor& lengths);
void check_slots_and_lengths(const at::Tensor& slots, const at::Tensor& lengths, int64_t batch, int64_t num_slots,
                             int64_t width, int64_t positions);
at::Tensor ragged_scores(at::Tensor q, at::Tensor k_layer, at::Tensor lengths, at::Tensor slots, int64_t width,
                         double scale);
at::Tensor ragged_values(at::Tensor probs, at::Tensor v_layer, at::Tensor lengths, at::Tensor slots);
at::Tensor ragged_attend(at::Tensor q, at::Tensor k_layer, at::Tensor v_layer, at::Tensor lengths, at::Tensor slots,
                         int64_t width, double scale);
void register_fused(pybind11::module& m);     // fused_decode.cpp's functions, in the same module
void register_training(pybind11::module& m);  // train_elementwise.cpp's
void register_training_softmax(pybind11::module& m);  // train_softmax.cpp's
void register_packed_rows(pybind11::module& m);  // packed_rows.cpp's
void register_training_rotary(pybind11::module& m);  // train_rotary.cpp's
void register_sampling(pybind11::module& m);  // sampling.cpp's

}  // namespace hybridflow
