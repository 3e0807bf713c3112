// The quantized projections of a decode step (decode_model, decoder_cpu.cpp): linear
// layers and a head kept as a GGUF file's blocks (kernels/quant.py's QuantizedWeight),
// multiplied as quant_linear multiplies them at few rows (quant_cpu.cpp): the input rows
// quantized once (QuantActivations), then the GEMV's items (quant_gemv_items), here as
// stages of the step's StagePlan. The same calls on the same rows give the same bits as
// the Python layers' quant_linear, whichever thread computes an item.
//
// A projection hands its tensors over in the op's three slots of a linear (weight, panels,
// bias): a quantized one puts its blocks, uint8 [out_features, row_bytes], in the weight
// slot, and their format in the panels slot: int64 [ggml_type, in_features,
// residual_pass] (kernels/decoder_layers.py `quant_format`). A quantized embedding table
// goes as [blocks, format] likewise.
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
#include "work_items.h"

namespace corestream_cpu {

inline bool is_quantized(const at::Tensor& weight) {
  return weight.defined() && weight.scalar_type() == at::kByte;
}

struct QuantFormat {
  quant::QuantMatrix matrix;
  // NOTE: the Python head's `residual_pass` (services/engine/models/linear.py), mirrored
  // so that the op gives its bits. It goes when the activations' second pass moves into
  // QuantActivations itself: then every projection has it, here as there.
  bool residual_pass;
};

// The weight that `blocks` and `format` describe, checked as quant_linear checks it.
inline QuantFormat quant_format(const at::Tensor& blocks, const at::Tensor& format,
                                const char* what) {
  TORCH_CHECK(format.scalar_type() == at::kLong && format.dim() == 1 && format.numel() == 3 &&
                  format.is_contiguous(),
              "decode_model: ", what, "'s format must be int64 [ggml_type, in_features, "
              "residual_pass], got ", format.sizes(), " ", format.scalar_type());
  const int64_t* f = format.const_data_ptr<int64_t>();
  const auto type = static_cast<quant::GgmlType>(f[0]);
  const quant::Format block = quant::format_of(type);
  const int64_t in_features = f[1];
  TORCH_CHECK(block.values > 0, "decode_model: ", what, ": GGML type ", f[0], " is not served");
  TORCH_CHECK(in_features > 0 && in_features % block.values == 0, "decode_model: ", what,
              ": type ", f[0], " takes rows of multiples of ", block.values, " values, not ",
              in_features);
  const int64_t row_bytes = in_features / block.values * block.bytes;
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(1) == row_bytes,
              "decode_model: ", what, "'s blocks must be contiguous uint8 [out_features, ",
              row_bytes, "], got ", blocks.sizes());
  return {{blocks.const_data_ptr<uint8_t>(), type, blocks.size(0), in_features, row_bytes},
          f[2] != 0};
}

// out = what rounding x to Q8_0 blocks leaves, over one row of n values (whole blocks),
// in the order of QuantizedLinear's residual pass: kernels/quant.py's quantize_q8_0
// (halves away from zero, d stored as f16), `dequantize`, and the difference. The
// product of the f16 d and q is exact in float32, so a multiply-add the compiler fuses
// rounds as the separate ops do.
template <typename T>
void q8_0_residual_row(T* out, const T* x, int64_t n) {
  for (int64_t b = 0; b < n; b += 32) {
    float values[32];
    float amax = 0.0f;
    for (int l = 0; l < 32; ++l) {
      values[l] = static_cast<float>(x[b + l]);
      amax = std::max(amax, std::fabs(values[l]));
    }
    const float d = amax / 127.0f;
    const float inverse = d == 0.0f ? 0.0f : 1.0f / d;
    const float stored = static_cast<float>(c10::Half(d));
    for (int l = 0; l < 32; ++l) {
      const float scaled = values[l] * inverse;
      const float magnitude = std::fabs(scaled);
      const float whole = std::floor(magnitude);
      const float rounded = whole + std::floor(2.0f * (magnitude - whole));
      const float q = scaled < 0.0f ? -rounded : scaled > 0.0f ? rounded : 0.0f;
      out[b + l] = static_cast<T>(values[l] - stored * q);
    }
  }
}

// Row `ids[i]` of a quantized table into out row i (T), for each of n ids. dequantize_row
// rounds each value once (one FMA); kernels/quant.py's `dequantize` rounds a product and
// then a sum, but every product there (a 4- to 8-bit q times an f16 scale, itself times a
// 6-bit one for the K-quants) is exact in float32, so the two give the same bits.
template <typename T>
void dequantize_rows(const quant::QuantMatrix& table, const int64_t* ids, int64_t n, T* out) {
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(table.cols));
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < table.rows, "decode_model: token id ", ids[i],
                " outside the embedding table's ", table.rows, " rows");
    quant::dequantize_row(table.type, table.blocks + ids[i] * table.row_bytes, row.data(),
                          table.cols);
    std::transform(row.begin(), row.end(), out + i * table.cols,
                   [](float v) { return static_cast<T>(v); });
  }
}

// One quantized projection of a planned step: out [tokens, out_features] (T) = x [tokens,
// in_features] times the weight, plus bias. What a plan keeps of it from step to step:
// the activations, sized when it is built (an item computed twice must never reallocate
// them under another thread), and float32 sums where the output needs a pass after the
// GEMV (a rounding to bfloat16, a bias, the residual pass's sum).
class QuantProjection {
 public:
  QuantProjection(const QuantFormat& format, int64_t tokens, int threads,
                  at::ScalarType dtype, bool has_bias)
      : weight_(format.matrix), residual_pass_(format.residual_pass), tokens_(tokens) {
    // As quant_linear splits its rows: enough items for the threads to share out.
    rows_per_item_ = std::clamp<int64_t>(weight_.rows / (8 * std::max(1, threads)), 4, 64);
    const auto floats = at::TensorOptions().dtype(at::kFloat);
    if (dtype != at::kFloat || has_bias || residual_pass_) {
      sums_ = at::empty({tokens, weight_.rows}, floats);
    }
    if (residual_pass_) {
      residual_rows_ = at::empty({tokens, weight_.cols}, at::TensorOptions().dtype(dtype));
      residual_sums_ = at::empty({tokens, weight_.rows}, floats);
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

  // The stages of out = x W^T + bias into `plan`: the activations quantized (one item:
  // a few rows of a few hundred values), then the GEMV by items of weight rows, each
  // finishing its outputs. x, bias (or null) and out must outlive the plan's run.
  template <typename T>
  void add_stages(StagePlan& plan, const T* x, const T* bias, T* out) {
    const int64_t tokens = tokens_, cols = weight_.cols, rows = weight_.rows;
    const quant::GgmlType type = weight_.type;
    quant::QuantActivations* activations = &x_;
    quant::QuantActivations* residual = residual_pass_ ? &residual_ : nullptr;
    T* residual_rows = residual_pass_ ? residual_rows_.mutable_data_ptr<T>() : nullptr;
    plan.add(1, [=](int64_t) {
      activations->quantize(type, x, tokens, cols, cols);
      if (residual != nullptr) {
        for (int64_t t = 0; t < tokens; ++t) {
          q8_0_residual_row(residual_rows + t * cols, x + t * cols, cols);
        }
        residual->quantize(type, residual_rows, tokens, cols, cols);
      }
    });

    float* sums = sums_.defined() ? sums_.mutable_data_ptr<float>() : nullptr;
    float* products = sums;
    if constexpr (std::is_same_v<T, float>) {
      if (sums == nullptr) {
        products = out;
      }
    }
    auto [count, gemv] = quant::quant_gemv_items(weight_, x_, products, rows, rows_per_item_);
    Item residual_gemv;
    float* residual_sums = nullptr;
    if (residual != nullptr) {
      residual_sums = residual_sums_.mutable_data_ptr<float>();
      residual_gemv =
          quant::quant_gemv_items(weight_, residual_, residual_sums, rows, rows_per_item_)
              .second;
    }
    const int64_t per_item = rows_per_item_;
    plan.add(count, [=, gemv = std::move(gemv)](int64_t i) {
      gemv(i);
      if (residual_gemv) {
        residual_gemv(i);  // the same weight rows, now in cache
      }
      if (sums == nullptr) {
        return;  // float32 outputs, written by the GEMV itself
      }
      const int64_t end = std::min(rows, (i + 1) * per_item);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t n = i * per_item; n < end; ++n) {
          // Rounded where the Python layer has a tensor of x's dtype: the GEMV's output,
          // the residual pass's, their sum, the bias's sum.
          T y = static_cast<T>(sums[t * rows + n]);
          if (residual_sums != nullptr) {
            y = static_cast<T>(static_cast<float>(y) +
                               static_cast<float>(static_cast<T>(residual_sums[t * rows + n])));
          }
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
    if (residual_pass_) {
      residual_.quantize(weight_.type, zeros.data(), tokens_, weight_.cols, weight_.cols);
    }
  }

  const quant::QuantMatrix weight_;
  const bool residual_pass_;
  const int64_t tokens_;
  int64_t rows_per_item_ = 0;
  quant::QuantActivations x_;
  quant::QuantActivations residual_;
  at::Tensor residual_rows_;
  at::Tensor sums_;
  at::Tensor residual_sums_;
};

}  // namespace corestream_cpu
