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
// same bytes (kernels/corestream_kernels/cpu_linear.py hands it a plain tensor that aliases oneDNN's buffer,
// after checking the layout) one panel at a time, each panel front to back:
//
//   float32:  panels [P, Kp, 64]      panel p, row k, lane j = W[64p + j, k]
//   bfloat16: panels [P, Kp/2, 64, 2] the same, with k and k+1 side by side (the pairs
//                                     AVX512-BF16's dot product takes)
//
// where P = ceil(N / 64) and Kp >= K; padding is zero. Each panel row is four 16-lane
// vectors (AVX-512) or eight 8-lane ones (AVX2), multiplied into up to kRowsPerPass rows
// of x held in registers. Accumulation is in float32 in the order of k, so results differ
// from oneDNN's in rounding only. bfloat16 pairs go to the CPU's bf16 dot products where it
// has them (AVX512-BF16); elsewhere each 32-bit pair is split into two floats in registers
// (one shift, one mask: bf16 is the top half of an fp32) and multiplied in float32, as
// llama.cpp does on such CPUs.
//
// Where oneDNN cannot take a weight (bfloat16 on a CPU without AVX-512 BW/VL/DQ or
// AVX-NE-CONVERT: oneDNN refuses to pack it, and torch's own bf16 GEMM runs at a fifth of
// float32's speed there), kernels/corestream_kernels/cpu_linear.py lays the panels out itself and keeps no
// other copy of the weight: then every call, prefill's many rows too, reads the panels,
// with the rows split into blocks so that both cores share a layer of few panels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "avx2_math.h"
#include "avx512_math.h"
#include "cpu_math.h"
#include "linear_cpu.h"
#include "work_items.h"

namespace {

constexpr int64_t kPanelWidth = 64;

// out[r, j] = bias[j] + sums[r][j] for the panel's first `width` columns, rounded to T as
// torch rounds (cpu_math.h): for the paths whose sums come out of registers as floats.
template <int R, typename T>
inline void finish_sums(const float (&sums)[R][kPanelWidth], const T* bias, int64_t width,
                        T* out, int64_t out_stride) {
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      const float b = bias != nullptr ? corestream_cpu::to_float(bias[j]) : 0.0f;
      out[r * out_stride + j] = corestream_cpu::from_float<T>(sums[r][j] + b);
    }
  }
}

#ifdef CORESTREAM_AVX512

constexpr int kVectors = kPanelWidth / 16;
// Rows of x per pass over a panel: 4 rows x 4 vectors of accumulators, 4 of weights.
constexpr int kRowsPerPass = 4;

// out[r, j] = bias[j] + acc[r][j] for the panel's first `width` columns.
template <int R, typename T>
inline void finish(const __m512 (&acc)[R][kVectors], const T* bias, int64_t width, T* out,
                   int64_t out_stride) {
  for (int v = 0; v < kVectors; ++v) {
    const int64_t lanes = std::clamp<int64_t>(width - 16 * v, 0, 16);
    if (lanes == 0) {
      break;
    }
    const __mmask16 mask = corestream_cpu::avx512::first_lanes(lanes);
    const __m512 b = bias != nullptr ? corestream_cpu::avx512::load(bias + 16 * v, mask)
                                     : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      corestream_cpu::avx512::store(out + r * out_stride + 16 * v,
                                    _mm512_add_ps(acc[r][v], b), mask);
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
  finish<R>(acc, bias, width, out, out_stride);
}

#ifdef CORESTREAM_AVX512_BF16

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
  finish<R>(acc, bias, width, out, out_stride);
}

#else  // AVX-512 without the bf16 dot products (Skylake-SP, Cascade Lake)

// R rows of x [R, K] times one bfloat16 panel [Kp/2, 64, 2], each pair split into floats.
template <int R>
void panel_rows(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* panel,
                int64_t k_size, const c10::BFloat16* bias, int64_t width, c10::BFloat16* out,
                int64_t out_stride) {
  using corestream_cpu::to_float;
  __m512 acc[R][kVectors];
  clear(acc);
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t q = 0; 2 * q < k_size; ++q) {
    const c10::BFloat16* w = panel + q * 2 * kPanelWidth;
    // An odd K's last pair holds padding for k + 1: x[K] is never read.
    const bool whole = 2 * q + 1 < k_size;
    __m512 even_x[R], odd_x[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      even_x[r] = _mm512_set1_ps(to_float(x[r * x_stride + 2 * q]));
      odd_x[r] = whole ? _mm512_set1_ps(to_float(x[r * x_stride + 2 * q + 1]))
                       : _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) {
      const __m512i pairs = _mm512_loadu_si512(w + 32 * v);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm512_fmadd_ps(even, even_x[r], acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(odd, odd_x[r], acc[r][v]);
      }
    }
  }
  alignas(64) float sums[R][kPanelWidth];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVectors; ++v) {
      _mm512_store_ps(sums[r] + 16 * v, acc[r][v]);
    }
  }
  finish_sums<R>(sums, bias, width, out, out_stride);
}

#endif  // CORESTREAM_AVX512_BF16

#elif defined(CORESTREAM_AVX2)

// Sixteen 8-lane registers: one row against a whole panel row (8 accumulators), or up to
// three rows against half of it (12), the halves one after the other.
constexpr int kRowsPerPass = 3;
constexpr int kHalf = kPanelWidth / 2;

// sums[r][c0 + 8v + j] = acc[r][v][j].
template <int R, int V>
inline void store_sums(const __m256 (&acc)[R][V], int c0, float (&sums)[R][kPanelWidth]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums[r] + c0 + 8 * v, acc[r][v]);
  }
}

// sums[r][c0 + j] for R rows of x and V vectors of 8 columns of a float32 panel from
// column c0.
template <int R, int V>
inline void panel_block(const float* x, int64_t x_stride, const float* panel, int64_t k_size,
                        int c0, float (&sums)[R][kPanelWidth]) {
  __m256 acc[R][V] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w = panel + k * kPanelWidth + c0;
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_set1_ps(x[r * x_stride + k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        acc[r][v] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8 * v), xr, acc[r][v]);
      }
    }
  }
  store_sums(acc, c0, sums);
}

// The same for a bfloat16 panel [Kp/2, 64, 2]: each load is 8 columns' (k, k + 1) pairs,
// split into two float vectors. x is float32 here (`rows_as_floats`), K even.
template <int R, int V>
inline void panel_block(const float* x, int64_t x_stride, const c10::BFloat16* panel,
                        int64_t k_size, int c0, float (&sums)[R][kPanelWidth]) {
  namespace vec = corestream_cpu::avx2;
  __m256 acc[R][V] = {};
  for (int64_t q = 0; 2 * q < k_size; ++q) {
    const c10::BFloat16* w = panel + q * 2 * kPanelWidth + 2 * c0;
    __m256 even_x[R], odd_x[R];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      even_x[r] = _mm256_broadcast_ss(x + r * x_stride + 2 * q);
      odd_x[r] = _mm256_broadcast_ss(x + r * x_stride + 2 * q + 1);
    }
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * v));
      const __m256 even = vec::low_halves(pairs);
      const __m256 odd = vec::high_halves(pairs);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm256_fmadd_ps(even, even_x[r], acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(odd, odd_x[r], acc[r][v]);
      }
    }
  }
  store_sums(acc, c0, sums);
}

// x's R rows as panel_block reads them, and their stride: float32 as they are; bfloat16
// widened once per call into a buffer, K padded to even with a zero. (Broadcast from a
// bf16 scalar, each use cost four instructions beside the FMAs, from a float one load.)
template <int R>
inline std::pair<const float*, int64_t> rows_as_floats(const float* x, int64_t x_stride,
                                                       int64_t) {
  return {x, x_stride};
}

template <int R>
inline std::pair<const float*, int64_t> rows_as_floats(const c10::BFloat16* x,
                                                       int64_t x_stride, int64_t k_size) {
  thread_local std::vector<float> buffer;
  const int64_t k_even = (k_size + 1) & ~int64_t{1};
  if (static_cast<int64_t>(buffer.size()) < R * k_even) buffer.resize(R * k_even);
  for (int r = 0; r < R; ++r) {
    float* row = buffer.data() + r * k_even;
#pragma omp simd
    for (int64_t k = 0; k < k_size; ++k) row[k] = corestream_cpu::to_float(x[r * x_stride + k]);
    if (k_even > k_size) row[k_size] = 0.0f;
  }
  return {buffer.data(), k_even};
}

// R rows of x [R, K] times one panel (float32 or bfloat16, as above).
template <int R, typename T>
void panel_rows(const T* x, int64_t x_stride, const T* panel, int64_t k_size, const T* bias,
                int64_t width, T* out, int64_t out_stride) {
  alignas(32) float sums[R][kPanelWidth];
  const auto [rows, stride] = rows_as_floats<R>(x, x_stride, k_size);
  if constexpr (R == 1) {
    panel_block<1, kPanelWidth / 8>(rows, stride, panel, k_size, 0, sums);
  } else {
    panel_block<R, kHalf / 8>(rows, stride, panel, k_size, 0, sums);
    if (width > kHalf) {
      panel_block<R, kHalf / 8>(rows, stride, panel, k_size, kHalf, sums);
    }
  }
  finish_sums<R>(sums, bias, width, out, out_stride);
}

#endif  // CORESTREAM_AVX512 / CORESTREAM_AVX2

#if defined(CORESTREAM_AVX512) || defined(CORESTREAM_AVX2)
#define CORESTREAM_PANELS 1

// Rows of x per item when many rows share a layer of few panels (prefill through panels):
// a multiple of every kRowsPerPass, and enough rows that a panel's stream from memory is
// paid over many passes.
constexpr int64_t kRowsPerItem = 96;

// The panels' items: item i is panel i / blocks's outputs for block i % blocks of
// `rows_per_item` rows of x (all of them in one block for decode steps). Each panel is one
// contiguous stream of 64 x K weights; consecutive items share a panel.
template <typename T>
std::pair<int64_t, corestream_cpu::Item> panel_item(const at::Tensor& x, const at::Tensor& panels,
                                                    const at::Tensor& bias, int64_t n_size,
                                                    const at::Tensor& out,
                                                    int64_t rows_per_item) {
  const int64_t m_size = x.size(0);
  const int64_t k_size = x.size(1);
  const T* x_data = x.const_data_ptr<T>();
  const T* w_data = panels.const_data_ptr<T>();
  const T* b_data = corestream_cpu::present(bias) ? bias.const_data_ptr<T>() : nullptr;
  T* out_data = out.mutable_data_ptr<T>();
  const int64_t panel_elements = panels.stride(0);
  const int64_t blocks = std::max<int64_t>(1, (m_size + rows_per_item - 1) / rows_per_item);
  corestream_cpu::Item item = [=](int64_t i) {
    const int64_t p = i / blocks;
    const int64_t column = p * kPanelWidth;
    const int64_t width = std::min(kPanelWidth, n_size - column);
    const T* panel = w_data + p * panel_elements;
    const T* panel_bias = b_data != nullptr ? b_data + column : nullptr;
    const int64_t first = (i % blocks) * rows_per_item;
    const int64_t end = std::min(m_size, first + rows_per_item);
    for (int64_t m = first; m < end; m += kRowsPerPass) {
      const T* xm = x_data + m * k_size;
      T* om = out_data + m * n_size + column;
      switch (std::min<int64_t>(kRowsPerPass, end - m)) {
        case 1: panel_rows<1>(xm, k_size, panel, k_size, panel_bias, width, om, n_size); break;
        case 2: panel_rows<2>(xm, k_size, panel, k_size, panel_bias, width, om, n_size); break;
        case 3: panel_rows<3>(xm, k_size, panel, k_size, panel_bias, width, om, n_size); break;
        default:
          if constexpr (kRowsPerPass >= 4) {
            panel_rows<kRowsPerPass>(xm, k_size, panel, k_size, panel_bias, width, om, n_size);
          }
      }
    }
  };
  return {panels.size(0) * blocks, std::move(item)};
}

#endif  // CORESTREAM_PANELS

// Whether this build has the kernel for `dtype`: every AVX-512 or AVX2 build has both.
bool panel_linear_supported(c10::ScalarType dtype) {
#ifdef CORESTREAM_PANELS
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  (void)dtype;
  return false;
#endif
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
                                                             const at::Tensor& out,
                                                             int64_t rows_per_item) {
#ifdef CORESTREAM_PANELS
  if (x.scalar_type() == at::kFloat) {
    return panel_item<float>(x, panels, bias, out.size(1), out, rows_per_item);
  }
  if (x.scalar_type() == at::kBFloat16) {
    return panel_item<c10::BFloat16>(x, panels, bias, out.size(1), out, rows_per_item);
  }
#endif
  (void)panels, (void)bias, (void)out, (void)rows_per_item;
  TORCH_CHECK(false, "panel_linear: no kernel for ", x.scalar_type(), " in this build");
}

// x [M, K] contiguous; panels as above; bias [N] or empty; out [M, N].
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& bias,
                        int64_t out_features) {
  check_panel_args(x, panels, bias, out_features);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
#ifdef CORESTREAM_PANELS
  const int64_t rows_per_item = kRowsPerItem;
#else
  const int64_t rows_per_item = 1;
#endif
  const auto [num_items, item] = checked_panel_items(x, panels, bias, out, rows_per_item);
  // Threads take items one at a time, not a fixed share each: on a machine with few
  // cores the frontend and other processes preempt one thread or another every token,
  // and with fixed shares the others would wait at the end of every layer for the
  // preempted one's share; this way they take it over.
  corestream_cpu::run_items(num_items, item);
  return out;
}

// A weight whose values live only in its panels (kernels/corestream_kernels/cpu_linear.py's
// `panels_only_weight`): its shape, with every stride zero and nothing behind it.
bool panels_only(const at::Tensor& weight) {
  return weight.dim() == 2 && weight.stride(0) == 0 && weight.stride(1) == 0 &&
         weight.numel() > 1;
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
  // Decode steps: every row in one item per panel, which streams the panel once.
  return checked_panel_items(x, panels, bias, out, std::max<int64_t>(1, x.size(0)));
}

// oneDNN builds (JIT-compiles) one matmul primitive per row count and keeps up to 1,024 of
// them, ~0.6 MiB and ~5 ms to build each, whatever the weight: prefills of every length
// grew an engine by hundreds of MiB over hours (the soak, benchmarks/soak, found it).
// Row counts go up to a bucket instead, eight per doubling (at most 12.5% padding rows,
// whose outputs are dropped), so that a model's calls share a few dozen primitives.
int64_t onednn_rows(int64_t rows) {
  if (rows <= 8) return rows;
  int64_t step = 8;
  while (step * 16 < rows) step *= 2;
  return (rows + step - 1) / step * step;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& panels,
                  const at::Tensor& bias) {
  if (present(panels) && panels_only(weight)) {
    // Every call reads the panels: rows flattened to 2-D as F.linear would treat them.
    const int64_t in_features = weight.size(1);
    TORCH_CHECK(x.size(-1) == in_features, "linear: x has ", x.size(-1),
                " features, the weight ", in_features);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    const at::Tensor rows = x.reshape({-1, in_features}).contiguous();
    return panel_linear(rows, panels, bias, weight.size(0)).view(shape);
  }
  if (present(panels) && x.dim() == 2 && x.is_contiguous() &&
      x.size(0) <= max_panel_rows(x.scalar_type())) {
    return panel_linear(x, panels, bias, weight.size(0));
  }
  TORCH_CHECK(!panels_only(weight), "linear: a panels-only weight came without its panels");
  if (weight.is_mkldnn()) {
    // Looked up only here: a torch without oneDNN packs nothing and lacks the op.
    static const auto packed_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, c10::string_view,
                              c10::List<std::optional<at::Scalar>>,
                              std::optional<c10::string_view>)>();
    const int64_t in_features = x.size(-1);
    const at::Tensor rows = x.reshape({-1, in_features});
    const int64_t bucket = onednn_rows(rows.size(0));
    at::Tensor padded = rows;
    if (bucket != rows.size(0)) {
      padded = at::zeros({bucket, in_features}, x.options());
      padded.narrow(0, 0, rows.size(0)).copy_(rows);
    }
    const at::Tensor out = packed_linear.call(
        padded, weight, present(bias) ? std::optional<at::Tensor>(bias) : std::nullopt,
        "none", c10::List<std::optional<at::Scalar>>(), "");
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = out.size(1);
    return out.narrow(0, 0, rows.size(0)).reshape(shape);
  }
  return present(bias) ? at::addmm(bias, x, weight.t()) : at::mm(x, weight.t());
}

}  // namespace corestream_cpu

TORCH_LIBRARY_FRAGMENT(corestream_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor panels, Tensor bias) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor bias, int out_features) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("panel_linear_supported(ScalarType dtype) -> bool", &panel_linear_supported);
  m.def("onednn_rows(int rows) -> int", &corestream_cpu::onednn_rows);
}

TORCH_LIBRARY_IMPL(corestream_cpu, CPU, m) {
  m.impl("linear", &corestream_cpu::linear);
  m.impl("panel_linear", &panel_linear);
}

// Weights packed for oneDNN (kernels/corestream_kernels/cpu_linear.py) carry this key; the op is the same.
TORCH_LIBRARY_IMPL(corestream_cpu, MkldnnCPU, m) { m.impl("linear", &corestream_cpu::linear); }
