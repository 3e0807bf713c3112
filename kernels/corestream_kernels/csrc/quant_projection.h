// The quantized projections of a decode step (decode_model, decoder_cpu.cpp): linear
// layers and a head kept as a GGUF file's blocks (kernels/corestream_kernels/quant.py's QuantizedWeight),
// multiplied as quant_linear multiplies them at few rows (quant_cpu.cpp): the input rows
// quantized once (QuantActivations), then the GEMV's items (quant_gemv_items), here as
// stages of the step's StagePlan. The same calls on the same rows give the same bits as
// the Python layers' quant_linear, whichever thread computes an item.
//
// A projection hands its tensors over in the op's three slots of a linear (weight, panels,
// bias): a quantized one puts its blocks, uint8 [out_features, row_bytes], in the weight
// slot, and their format in the panels slot: int64 [ggml_type, in_features, grouped]
// (kernels/corestream_kernels/decoder_layers.py `quant_format`; grouped: rows interleaved as quant_blocks.h
// says). A quantized embedding table goes as [blocks, format] likewise.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "quant_blocks.h"
#include "quant_dot.h"
#include "quant_groups.h"
#include "work_items.h"

namespace corestream_cpu {

inline bool is_quantized(const at::Tensor& weight) {
  return weight.defined() && weight.scalar_type() == at::kByte;
}

// The weight that `blocks` and `format` describe, checked as quant_linear checks it.
inline quant::QuantMatrix quant_format(const at::Tensor& blocks, const at::Tensor& format,
                                       const char* what) {
  TORCH_CHECK(format.scalar_type() == at::kLong && format.dim() == 1 && format.numel() == 3 &&
                  format.is_contiguous(),
              "decode_model: ", what, "'s format must be int64 [ggml_type, in_features, "
              "grouped], got ", format.sizes(), " ", format.scalar_type());
  const int64_t* f = format.const_data_ptr<int64_t>();
  const auto type = static_cast<quant::GgmlType>(f[0]);
  const quant::Format block = quant::format_of(type);
  const int64_t in_features = f[1];
  const bool grouped = f[2] != 0;
  TORCH_CHECK(block.values > 0, "decode_model: ", what, ": GGML type ", f[0], " is not served");
  TORCH_CHECK(in_features > 0 && in_features % block.values == 0, "decode_model: ", what,
              ": type ", f[0], " takes rows of multiples of ", block.values, " values, not ",
              in_features);
  const int64_t row_bytes = in_features / block.values * block.bytes;
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(1) == row_bytes,
              "decode_model: ", what, "'s blocks must be contiguous uint8 [out_features, ",
              row_bytes, "], got ", blocks.sizes());
  TORCH_CHECK(!grouped || (quant::groupable(type) && blocks.size(0) % quant::kGroupRows == 0),
              "decode_model: ", what, ": rows of type ", f[0], " in groups of ",
              quant::kGroupRows, " need a groupable type and a multiple of ",
              quant::kGroupRows, " rows, not ", blocks.size(0));
  return {blocks.const_data_ptr<uint8_t>(), type, blocks.size(0), in_features, row_bytes,
          grouped};
}

// Row `ids[i]` of a quantized table into out row i (T), for each of n ids. dequantize_row
// rounds each value once (one FMA); kernels/corestream_kernels/quant.py's `dequantize` rounds a product and
// then a sum, but every product there (a 4- to 8-bit q times an f16 scale, itself times a
// 6-bit one for the K-quants) is exact in float32, so the two give the same bits.
template <typename T>
void dequantize_rows(const quant::QuantMatrix& table, const int64_t* ids, int64_t n, T* out) {
  thread_local std::vector<float> row;
  thread_local std::vector<uint8_t> scratch;
  row.resize(static_cast<size_t>(table.cols));
  scratch.resize(static_cast<size_t>(table.row_bytes));
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < table.rows, "decode_model: token id ", ids[i],
                " outside the embedding table's ", table.rows, " rows");
    quant::dequantize_row(table.type, quant::gguf_row(table, ids[i], scratch.data()),
                          row.data(), table.cols);
    std::transform(row.begin(), row.end(), out + i * table.cols,
                   [](float v) { return static_cast<T>(v); });
  }
}

// One quantized projection of a planned step: out [tokens, out_features] (T) = x [tokens,
// in_features] times the weight, plus bias. What a plan keeps of it from step to step:
// the activations, sized when it is built (an item computed twice must never reallocate
// them under another thread), and float32 sums where the output needs a pass after the
// GEMV (a rounding to bfloat16, a bias).
class QuantProjection {
 public:
  QuantProjection(const quant::QuantMatrix& weight, int64_t tokens, int threads,
                  at::ScalarType dtype, bool has_bias)
      : weight_(weight), tokens_(tokens) {
    rows_per_item_ = quant::gemv_item_rows(weight_, threads);  // as quant_linear splits
    const auto floats = at::TensorOptions().dtype(at::kFloat);
    if (dtype != at::kFloat || has_bias) {
      sums_ = at::empty({tokens, weight_.rows}, floats);
    }
    if (dtype == at::kFloat) {
      size_activations<float>();
    } else {
      size_activations<c10::BFloat16>();
    }
  }

  QuantProjection(const QuantProjection&) = delete;
  QuantProjection& operator=(const QuantProjection&) = delete;

  const quant::QuantMatrix& weight() const { return weight_; }

  // The stages of out = x W^T + bias into `plan`: the activations quantized (items of a
  // few rows), then the GEMV by items of weight rows, each finishing its outputs. x, bias
  // (or null) and out must outlive the plan's run.
  template <typename T>
  void add_stages(StagePlan& plan, const T* x, const T* bias, T* out) {
    const int64_t tokens = tokens_, cols = weight_.cols, rows = weight_.rows;
    quant::QuantActivations* activations = &x_;  // sized for these rows when built
    constexpr int64_t kRowsPerItem = 8;  // ~0.3 us a row of 576 values
    plan.add((tokens + kRowsPerItem - 1) / kRowsPerItem, [=](int64_t i) {
      activations->quantize_rows(x, i * kRowsPerItem, std::min(tokens, (i + 1) * kRowsPerItem),
                                 cols);
    });

    float* sums = sums_.defined() ? sums_.mutable_data_ptr<float>() : nullptr;
    float* products = sums;
    if constexpr (std::is_same_v<T, float>) {
      if (sums == nullptr) {
        products = out;
      }
    }
    auto [count, gemv] = quant::quant_gemv_items(weight_, x_, products, rows, rows_per_item_);
    const int64_t per_item = rows_per_item_;
    plan.add(count, [=, gemv = std::move(gemv)](int64_t i) {
      gemv(i);
      if (sums == nullptr) {
        return;  // float32 outputs, written by the GEMV itself
      }
      const int64_t end = std::min(rows, (i + 1) * per_item);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t n = i * per_item; n < end; ++n) {
          // Rounded where the Python layer has a tensor of x's dtype: the GEMV's output,
          // the bias's sum.
          T y = static_cast<T>(sums[t * rows + n]);
          if (bias != nullptr) {
            y = static_cast<T>(static_cast<float>(y) + static_cast<float>(bias[n]));
          }
          out[t * rows + n] = y;
        }
      }
    });
  }

 private:
  template <typename T>
  void size_activations() {
    const std::vector<T> zeros(static_cast<size_t>(tokens_ * weight_.cols), T(0.0f));
    x_.quantize(weight_.type, zeros.data(), tokens_, weight_.cols, weight_.cols);
  }

  const quant::QuantMatrix weight_;
  const int64_t tokens_;
  int64_t rows_per_item_ = 0;
  quant::QuantActivations x_;
  at::Tensor sums_;
};

}  // namespace corestream_cpu
