// quant_linear: y = x @ W^T for a weight W kept as GGUF blocks (kernels/corestream_kernels/quant.py's
// QuantizedWeight), never dequantized whole.
//
// - Up to kMaxGemvRows rows of x (decode steps): x is quantized to 8-bit blocks once (two
//   passes: the value, then its rounding residual; about 15 bits in all), and the output
//   rows are split into items of a few weight rows that threads take one at a time
//   (work_items.h), each a pass over those rows' blocks with integer dot products
//   (quant_dot.h; quant_groups.h for rows grouped by 16). The weight streams from memory
//   once per call.
// - More rows (prefill) of a weight in the file's layout (grouped rows take the GEMV at
//   every row count: see takes_gemv): the weight is dequantized to float32 for the call
//   (a layer's weight, freed at its end: never the whole model's) and at::mm multiplies x
//   by it. x is not quantized on this path, so it is exact to float32 rounding; the
//   two-pass GEMV differs from it by about 2e-5 of the output's norm, so a prompt's greedy
//   tokens do not depend on how its prefill was chunked.
//
// x float32 or bfloat16 [..., K]; the output has x's dtype, rounded once from float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_math.h"
#include "quant_blocks.h"
#include "quant_dot.h"
#include "quant_groups.h"
#include "work_items.h"

namespace {

using corestream_cpu::quant::format_of;
using corestream_cpu::quant::GgmlType;
using corestream_cpu::quant::QuantActivations;
using corestream_cpu::quant::QuantMatrix;

// The most rows of x that go to the GEMV; beyond, the dequantized weight is multiplied by
// every row at once. The GEMV's cost grows with the rows (about 0.25 ms per row for a 4096 x
// 4096 Q4 weight on 2 Zen 4 cores), the other's is dequantization plus at::mm's GEMM; the
// crossover was not measurable on the busy machine this was written on
// (benchmarks/quant_gemv.py --prefill measures it).
constexpr int64_t kMaxGemvRows = 32;

QuantMatrix checked_matrix(const at::Tensor& blocks, int64_t ggml_type, int64_t out_features,
                           int64_t in_features, bool grouped) {
  const auto type = static_cast<GgmlType>(ggml_type);
  const auto format = format_of(type);
  TORCH_CHECK(format.values > 0, "quant_linear: GGML type ", ggml_type, " is not served");
  TORCH_CHECK(in_features > 0 && in_features % format.values == 0, "quant_linear: type ",
              ggml_type, " takes rows of multiples of ", format.values, " values, not ",
              in_features);
  const int64_t row_bytes = in_features / format.values * format.bytes;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.dim() == 2 && blocks.size(0) == out_features &&
                  blocks.size(1) == row_bytes,
              "quant_linear: blocks must be contiguous uint8 [", out_features, ", ",
              row_bytes, "], not ", blocks.sizes(), " ", blocks.scalar_type());
  TORCH_CHECK(!grouped || (corestream_cpu::quant::groupable(type) &&
                           out_features % corestream_cpu::quant::kGroupRows == 0),
              "quant_linear: rows in groups of ", corestream_cpu::quant::kGroupRows,
              " need type Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K or Q6_K and a multiple of ",
              corestream_cpu::quant::kGroupRows, " rows, not type ", ggml_type, " with ",
              out_features);
  return {blocks.const_data_ptr<uint8_t>(), type, out_features, in_features, row_bytes,
          grouped};
}

// Whether quant_linear takes the GEMV for m rows of x: always for grouped rows, whose
// kernel keeps up with the dequantized weight's float32 GEMM at every row count measured
// (33-256 rows of SmolLM2's and a 4096 x 4096 projection in Q4_1: 1.0-3x faster;
// benchmarks/quant_gemv.py --prefill), and gives every row the same bits whatever the
// others; up to kMaxGemvRows for the file's layout.
bool takes_gemv(const QuantMatrix& w, int64_t m) { return w.grouped || m <= kMaxGemvRows; }

template <typename T>
void gemv(const QuantMatrix& w, const at::Tensor& x, at::Tensor& out) {
  const int64_t m = x.size(0);
  QuantActivations activations;
  activations.size(w.type, m, w.cols);
  const T* data = x.const_data_ptr<T>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    activations.quantize_rows(data, begin, end, x.stride(0));
  });
  // Sums go to a float32 buffer (the output itself for float32 x), rounded once after.
  at::Tensor sums = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(),
                                                                      out.options().dtype(at::kFloat));
  float* sums_data = sums.mutable_data_ptr<float>();
  const auto [num_items, item] = corestream_cpu::quant::quant_gemv_items(
      w, activations, sums_data, w.rows,
      corestream_cpu::quant::gemv_item_rows(w, at::get_num_threads()));
  corestream_cpu::run_items(num_items, item);
  if (!sums.is_same(out)) out.copy_(sums);
}

// w as float32 [rows, cols] into out.
void dequantize_into(const QuantMatrix& w, float* out) {
  at::parallel_for(0, w.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(static_cast<size_t>(w.row_bytes));
    for (int64_t n = begin; n < end; ++n) {
      corestream_cpu::quant::dequantize_row(
          w.type, corestream_cpu::quant::gguf_row(w, n, scratch.data()), out + n * w.cols,
          w.cols);
    }
  });
}

// x [M, K] float32 times w dequantized, into out [M, N] float32. The float32 copy lives
// for this call only (one layer's weight, never the model's).
// NOTE: tiles of a few hundred rows (dequantized, then at::mm per tile, either with
// at::mm's threads between parallel dequantizations or single-threaded inside one region)
// ran 5-50x slower than this on 2 busy cores: many small GEMMs alternating with parallel
// regions. A tiled path needs a GEMM micro-kernel of our own (see the report of #37).
void dequantized_mm(const QuantMatrix& w, const at::Tensor& x, at::Tensor& out) {
  at::Tensor weight = at::empty({w.rows, w.cols}, x.options());
  float* data = weight.mutable_data_ptr<float>();
  dequantize_into(w, data);
  at::mm_out(out, x, weight.t());
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type,
                        int64_t out_features, int64_t in_features, bool grouped) {
  const QuantMatrix w = checked_matrix(blocks, ggml_type, out_features, in_features, grouped);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16, not ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == in_features, "quant_linear: x has ", x.size(-1),
              " features, the weight ", in_features);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  const at::Tensor rows = x.reshape({-1, in_features}).contiguous();
  at::Tensor out = at::empty({rows.size(0), out_features}, x.options());
  if (rows.size(0) == 0) return out.view(shape);
  if (takes_gemv(w, rows.size(0))) {
    if (x.scalar_type() == at::kFloat) {
      gemv<float>(w, rows, out);
    } else {
      gemv<c10::BFloat16>(w, rows, out);
    }
  } else if (x.scalar_type() == at::kFloat) {
    dequantized_mm(w, rows, out);
  } else {
    at::Tensor wide = at::empty(out.sizes(), out.options().dtype(at::kFloat));
    dequantized_mm(w, rows.to(at::kFloat), wide);
    out.copy_(wide);
  }
  return out.view(shape);
}

// The weight as float32 [out, in], by the C++ dequantization (for tests).
at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t ggml_type, int64_t out_features,
                            int64_t in_features, bool grouped) {
  const QuantMatrix w = checked_matrix(blocks, ggml_type, out_features, in_features, grouped);
  at::Tensor out = at::empty({out_features, in_features}, blocks.options().dtype(at::kFloat));
  dequantize_into(w, out.mutable_data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corestream_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor blocks, int ggml_type, int out_features, "
        "int in_features, bool grouped=False) -> Tensor");
  m.def("quant_dequantize(Tensor blocks, int ggml_type, int out_features, int in_features, "
        "bool grouped=False) -> Tensor");
  // The most rows of x quant_linear runs its GEMV for (see takes_gemv).
  m.def("quant_gemv_max_rows(bool grouped=False) -> int", [](bool grouped) {
    return grouped ? std::numeric_limits<int64_t>::max() : kMaxGemvRows;
  });
}

TORCH_LIBRARY_IMPL(corestream_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
