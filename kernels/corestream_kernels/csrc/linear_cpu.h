// The linear layer of the CPU kernels (linear_cpu.cpp), for the other ops that call it,
// and the test for an optional tensor argument they share.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

#include "work_items.h"

namespace corestream_cpu {

// An optional tensor argument is given: the ops take an empty tensor for "none".
inline bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// x @ weight^T + bias, x [M, K]. weight [N, K] is plain or packed for oneDNN
// (kernels/corestream_kernels/cpu_linear.py); panels, if not empty, is a packed weight's bytes as
// kernels/corestream_kernels/cpu_linear.py's `weight_panels` gives them, used for up to a few rows of x.
// bias is [N] or empty.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& panels,
                  const at::Tensor& bias);

// The most rows of x for which `linear` reads a weight's panels (when it has them).
int64_t max_panel_rows(at::ScalarType dtype);

// The rows oneDNN's matmul runs for `rows` rows of x: a bucket (linear_cpu.cpp).
int64_t onednn_rows(int64_t rows);

// panel_linear's work as items, for callers that hand them out themselves (StagePlan):
// (number of panels, item p writing panel p's columns of out [M, N] for every row of x).
// The tensors must outlive the items.
std::pair<int64_t, Item> panel_items(const at::Tensor& x, const at::Tensor& panels,
                                     const at::Tensor& bias, const at::Tensor& out);

}  // namespace corestream_cpu
