// Linear layers on CPU: `linear` (linear_cpu.h) picks, per call, oneDNN's matmul on a
// weight packed for it at load, or, for a few rows, `panel_linear` below on the same
// bytes; a plain weight goes to at::addmm / at::mm as F.linear sends it.
//
// panel_linear: y = x @ W^T + b for a few rows of x, reading W in oneDNN's packed layout.
//
// At one to a few rows a linear layer is a pass over its weight, so its speed is the
// speed at which the weight streams from memory. oneDNN's matmul on a packed weight
// streamed it at about half the machine's read bandwidth for one row (AMD EPYC, AVX-512),
// so decode steps of one stream went at half the speed they could. This kernel walks the
// same bytes (kernels/cpu_linear.py hands it a plain tensor that aliases oneDNN's buffer,
// after checking the layout) one panel at a time, each panel front to back:
//
//   float32:  panels [P, Kp, 64]      panel p, row k, lane j = W[64p + j, k]
//   bfloat16: panels [P, Kp/2, 64, 2] the same, with k and k+1 side by side (the pairs
//                                     AVX512-BF16's dot product takes)
//
// where P = ceil(N / 64) and Kp >= K; padding is zero. Each panel row is four 16-lane
// vectors, multiplied into up to kRowsPerPass rows of x held in registers. Accumulation
// is in float32 in the order of k, so results differ from oneDNN's in rounding only.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "avx512_math.h"
#include "linear_cpu.h"
#include "work_items.h"

namespace {

constexpr int64_t kPanelWidth = 64;

#ifdef CORESTREAM_AVX512

constexpr int kVectors = kPanelWidth / 16;
// Rows of x per pass over a panel: 4 rows x 4 vectors of accumulators, 4 of weights.
constexpr int kRowsPerPass = 4;

// out[r, j] = bias[j] + acc[r][j] for the panel's first `width` columns.
template <int R, typename T, typename Store>
inline void finish(const __m512 (&acc)[R][kVectors], const T* bias, int64_t width, T* out,
                   int64_t out_stride, Store store) {
  for (int v = 0; v < kVectors; ++v) {
    const int64_t lanes = std::clamp<int64_t>(width - 16 * v, 0, 16);
    if (lanes == 0) {
      break;
    }
    const __mmask16 mask = corestream_cpu::avx512::first_lanes(lanes);
    const __m512 b = bias != nullptr ? corestream_cpu::avx512::load(bias + 16 * v, mask)
                                     : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      store(out + r * out_stride + 16 * v, _mm512_add_ps(acc[r][v], b), mask);
    }
  }
}

template <int R>
inline void clear(__m512 (&acc)[R][kVectors]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) {
      acc[r][v] = _mm512_setzero_ps();
    }
  }
}

inline void store_f32(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }

// R rows of x [R, K] (row stride x_stride) times one float32 panel [Kp, 64].
template <int R>
void panel_rows(const float* x, int64_t x_stride, const float* panel, int64_t k_size,
                const float* bias, int64_t width, float* out, int64_t out_stride) {
  __m512 acc[R][kVectors];
  clear(acc);
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w = panel + k * kPanelWidth;
    __m512 wv[kVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) {
      wv[v] = _mm512_loadu_ps(w + 16 * v);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        acc[r][v] = _mm512_fmadd_ps(wv[v], xr, acc[r][v]);
      }
    }
  }
  finish<R>(acc, bias, width, out, out_stride, store_f32);
}

#ifdef CORESTREAM_AVX512_BF16

inline void store_bf16(c10::BFloat16* p, __m512 v, __mmask16 mask) {
  // Round to nearest even, as oneDNN and torch round a float32 result to bfloat16.
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// x[k] and x[k + 1] as one 32-bit lane, x[k] in the low half as the panels pair them.
inline __m512bh pair(const c10::BFloat16* row, int64_t k) {
  int32_t bits;
  std::memcpy(&bits, row + k, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// x[k] alone, for an odd K's last pair, whose second weight is padding.
inline __m512bh last(const c10::BFloat16* row, int64_t k) {
  uint16_t bits;
  std::memcpy(&bits, row + k, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// R rows of x [R, K] times one bfloat16 panel [Kp/2, 64, 2].
template <int R>
void panel_rows(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* panel,
                int64_t k_size, const c10::BFloat16* bias, int64_t width, c10::BFloat16* out,
                int64_t out_stride) {
  __m512 acc[R][kVectors];
  clear(acc);
  for (int64_t q = 0; 2 * q < k_size; ++q) {
    const c10::BFloat16* w = panel + q * 2 * kPanelWidth;
    __m512bh wv[kVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) {
      wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const c10::BFloat16* row = x + r * x_stride;
      // An odd K's last k goes alone: reading x[K] would run past the row.
      const __m512bh xr = 2 * q + 1 < k_size ? pair(row, 2 * q) : last(row, 2 * q);
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xr);
      }
    }
  }
  finish<R>(acc, bias, width, out, out_stride, store_bf16);
}

#endif  // CORESTREAM_AVX512_BF16

// The panels' items: item p is panel p's outputs for every row of x. Each panel is one
// contiguous stream of 64 x K weights.
template <typename T>
corestream_cpu::Item panel_item(const at::Tensor& x, const at::Tensor& panels,
                                const at::Tensor& bias, int64_t n_size, const at::Tensor& out) {
  const int64_t m_size = x.size(0);
  const int64_t k_size = x.size(1);
  const T* x_data = x.const_data_ptr<T>();
  const T* w_data = panels.const_data_ptr<T>();
  const T* b_data = corestream_cpu::present(bias) ? bias.const_data_ptr<T>() : nullptr;
  T* out_data = out.mutable_data_ptr<T>();
  const int64_t panel_elements = panels.stride(0);
  return [=](int64_t p) {
    const int64_t column = p * kPanelWidth;
    const int64_t width = std::min(kPanelWidth, n_size - column);
    const T* panel = w_data + p * panel_elements;
    const T* panel_bias = b_data != nullptr ? b_data + column : nullptr;
    for (int64_t m = 0; m < m_size; m += kRowsPerPass) {
      const T* xm = x_data + m * k_size;
      T* om = out_data + m * n_size + column;
      switch (std::min<int64_t>(kRowsPerPass, m_size - m)) {
        case 1: panel_rows<1>(xm, k_size, panel, k_size, panel_bias, width, om, n_size); break;
        case 2: panel_rows<2>(xm, k_size, panel, k_size, panel_bias, width, om, n_size); break;
        case 3: panel_rows<3>(xm, k_size, panel, k_size, panel_bias, width, om, n_size); break;
        default: panel_rows<4>(xm, k_size, panel, k_size, panel_bias, width, om, n_size);
      }
    }
  };
}

#endif  // CORESTREAM_AVX512

// Whether this build has the kernel for `dtype`.
bool panel_linear_supported(c10::ScalarType dtype) {
#ifdef CORESTREAM_AVX512
  if (dtype == at::kFloat) {
    return true;
  }
#endif
#ifdef CORESTREAM_AVX512_BF16
  if (dtype == at::kBFloat16) {
    return true;
  }
#endif
  return false;
}

void check_panel_args(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& bias,
                      int64_t out_features) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(panel_linear_supported(dtype), "panel_linear: no kernel for ", dtype,
              " in this build");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "panel_linear: x must be 2-D, contiguous");
  TORCH_CHECK(panels.scalar_type() == dtype && panels.is_contiguous(),
              "panel_linear: panels must be contiguous, of x's dtype");
  // Consecutive k per panel lane: bfloat16 panels pair them.
  const int64_t pair = dtype == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(panels.dim() == (pair == 2 ? 4 : 3) && panels.size(2) == kPanelWidth &&
                  (pair == 1 || panels.size(3) == pair),
              "panel_linear: panels must be ",
              pair == 2 ? "[P, K/2, 64, 2]" : "[P, K, 64]", " for ", dtype, ", not ",
              panels.sizes());
  TORCH_CHECK(panels.size(1) * pair >= x.size(1), "panel_linear: x has ", x.size(1),
              " columns, the panels ", panels.size(1) * pair, " rows");
  TORCH_CHECK(panels.size(0) * kPanelWidth >= out_features &&
                  (panels.size(0) - 1) * kPanelWidth < out_features,
              "panel_linear: ", panels.size(0), " panels cannot hold ", out_features,
              " outputs");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == out_features &&
                                    bias.scalar_type() == dtype && bias.is_contiguous()),
              "panel_linear: bias must be empty or [", out_features, "] of x's dtype");
}

// The items of x @ panels + bias into out, the arguments checked (check_panel_args).
std::pair<int64_t, corestream_cpu::Item> checked_panel_items(const at::Tensor& x,
                                                             const at::Tensor& panels,
                                                             const at::Tensor& bias,
                                                             const at::Tensor& out) {
#ifdef CORESTREAM_AVX512
  if (x.scalar_type() == at::kFloat) {
    return {panels.size(0), panel_item<float>(x, panels, bias, out.size(1), out)};
  }
#endif
#ifdef CORESTREAM_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16) {
    return {panels.size(0), panel_item<c10::BFloat16>(x, panels, bias, out.size(1), out)};
  }
#endif
  TORCH_CHECK(false, "panel_linear: no kernel for ", x.scalar_type(), " in this build");
}

// x [M, K] contiguous; panels as above; bias [N] or empty; out [M, N].
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& bias,
                        int64_t out_features) {
  check_panel_args(x, panels, bias, out_features);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  const auto [num_panels, item] = checked_panel_items(x, panels, bias, out);
  // Threads take panels one at a time, not a fixed share each: on a machine with few
  // cores the frontend and other processes preempt one thread or another every token,
  // and with fixed shares the others would wait at the end of every layer for the
  // preempted one's share; this way they take it over.
  corestream_cpu::run_items(num_panels, item);
  return out;
}

}  // namespace

namespace corestream_cpu {

// Beyond these rows panel_linear's passes over each panel, kRowsPerPass rows at a time,
// cost more than the weight's stream from memory saves (benchmarks/cpu_linear.py).
int64_t max_panel_rows(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 16 : 8; }

std::pair<int64_t, Item> panel_items(const at::Tensor& x, const at::Tensor& panels,
                                     const at::Tensor& bias, const at::Tensor& out) {
  const int64_t out_features = out.size(1);
  check_panel_args(x, panels, bias, out_features);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "panel_linear: out must be a contiguous [", x.size(0), ", N] of x's dtype");
  return checked_panel_items(x, panels, bias, out);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& panels,
                  const at::Tensor& bias) {
  if (present(panels) && x.dim() == 2 && x.is_contiguous() &&
      x.size(0) <= max_panel_rows(x.scalar_type())) {
    return panel_linear(x, panels, bias, weight.size(0));
  }
  if (weight.is_mkldnn()) {
    // Looked up only here: a torch without oneDNN packs nothing and lacks the op.
    static const auto packed_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, c10::string_view,
                              c10::List<std::optional<at::Scalar>>,
                              std::optional<c10::string_view>)>();
    return packed_linear.call(x, weight,
                              present(bias) ? std::optional<at::Tensor>(bias) : std::nullopt,
                              "none", c10::List<std::optional<at::Scalar>>(), "");
  }
  return present(bias) ? at::addmm(bias, x, weight.t()) : at::mm(x, weight.t());
}

}  // namespace corestream_cpu

TORCH_LIBRARY_FRAGMENT(corestream_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor panels, Tensor bias) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor bias, int out_features) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("panel_linear_supported(ScalarType dtype) -> bool", &panel_linear_supported);
}

TORCH_LIBRARY_IMPL(corestream_cpu, CPU, m) {
  m.impl("linear", &corestream_cpu::linear);
  m.impl("panel_linear", &panel_linear);
}

// Weights packed for oneDNN (kernels/cpu_linear.py) carry this key; the op is the same.
TORCH_LIBRARY_IMPL(corestream_cpu, MkldnnCPU, m) { m.impl("linear", &corestream_cpu::linear); }
