// The small per-layer ops of a decoder on CPU: RMSNorm (alone, and fused with the
// residual add before it), SiLU-and-mul, and rotary embedding fused with the KV-cache
// write.
//
// In a single-stream decode these ops touch a few KiB each, so what torch spends on them
// is dispatch: its RMSNorm alone is six ops on CPU (pow, mean, add, rsqrt, mul, cast).
// Each op here is one call that reads its input once. The arithmetic follows the torch
// code in kernels/ (itself transformers' order): norms and rotations in float32, and in
// bfloat16 a rounding to bfloat16 wherever torch would store an intermediate tensor, so
// results match torch's to the last bit or within one rounding.
//
// Rows go to torch's intra-op threads in ranges of at least kGrainElements elements, so
// a decode's single row never leaves the calling thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "avx2_math.h"
#include "cpu_math.h"
#include "layer_rows.h"

namespace corestream_cpu {

// out = weight * T(x / rms(x)) over one row of n elements, as transformers' LlamaRMSNorm:
// the normalized row is cast to T before the scale.
template <typename T>
__attribute__((noinline)) void normalize_row(T* out, const T* x, const T* weight, int64_t n,
                                             float eps) {
  float sum = 0.0f;
#if defined(CORESTREAM_AVX512)
  // 16 partial sums, then theirs: another order of additions than the loop below (and
  // than torch's), a difference within float32 rounding.
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += avx512::kLanes) {
    const __m512 v =
        avx512::load(x + d, avx512::first_lanes(std::min<int64_t>(avx512::kLanes, n - d)));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  sum = _mm512_reduce_add_ps(squares);
#else
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) {
    const float v = to_float(x[d]);
    sum += v * v;
  }
#endif
  const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  int64_t start = 0;
#if defined(CORESTREAM_AVX512)
  // The roundings in vectors, bf16_bits' (as silu_mul_row's).
  const __m512 scale = _mm512_set1_ps(inv_rms);
  for (int64_t d = 0; d < n; d += avx512::kLanes) {
    const __mmask16 mask = avx512::first_lanes(std::min<int64_t>(avx512::kLanes, n - d));
    const __m512 normalized = avx512::round_to<T>(_mm512_mul_ps(avx512::load(x + d, mask), scale));
    avx512::store(out + d, _mm512_mul_ps(avx512::load(weight + d, mask), normalized), mask);
  }
  start = n;
#endif
#pragma omp simd
  for (int64_t d = start; d < n; ++d) {
    out[d] = from_float<T>(to_float(weight[d]) * round_to<T>(to_float(x[d]) * inv_rms));
  }
}

// sum = T(residual + x).
template <typename T>
__attribute__((noinline)) void add_row(T* sum, const T* residual, const T* x, int64_t n) {
  int64_t start = 0;
#if defined(CORESTREAM_AVX512)
  for (int64_t d = 0; d < n; d += avx512::kLanes) {
    const __mmask16 mask = avx512::first_lanes(std::min<int64_t>(avx512::kLanes, n - d));
    avx512::store(sum + d, _mm512_add_ps(avx512::load(residual + d, mask),
                                         avx512::load(x + d, mask)), mask);
  }
  start = n;
#endif
#pragma omp simd
  for (int64_t d = start; d < n; ++d) {
    sum[d] = from_float<T>(to_float(residual[d]) + to_float(x[d]));
  }
}

// out[d] = silu(gate[d]) * up[d], silu's output rounded to T as torch stores it. The
// vector paths compute the same bits as the portable loop (same exp, same roundings);
// written out because the compiler's version of that loop emulated each bf16 rounding
// and conversion lane by lane, at about twice the instructions.
template <typename T>
__attribute__((noinline)) void silu_mul_row(T* out, const T* gate, const T* up, int64_t n) {
  int64_t start = 0;
#if defined(CORESTREAM_AVX512)
  for (int64_t d = 0; d < n; d += avx512::kLanes) {
    const __mmask16 mask = avx512::first_lanes(std::min<int64_t>(avx512::kLanes, n - d));
    const __m512 g = avx512::load(gate + d, mask);
    const __m512 e = avx512::exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu =
        avx512::round_to<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    avx512::store(out + d, _mm512_mul_ps(silu, avx512::load(up + d, mask)), mask);
  }
  start = n;
#elif defined(CORESTREAM_AVX2)
  for (; start + avx2::kLanes <= n; start += avx2::kLanes) {
    const __m256 g = avx2::load(gate + start);
    const __m256 e = avx2::exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu =
        avx2::round_to<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    avx2::store(out + start, _mm256_mul_ps(silu, avx2::load(up + start)));
  }
#endif
#pragma omp simd
  for (int64_t d = start; d < n; ++d) {
    const float g = to_float(gate[d]);
    const float silu = round_to<T>(g / (1.0f + exp_approx(-g)));
    out[d] = from_float<T>(silu * to_float(up[d]));
  }
}

// One head of dim elements rotated: x' = x * cos + swap_halves(x) * sin, with cos and sin
// laid out as kernels/corestream_kernels/rotary.py builds them ([cos, cos] and [-sin, sin] over the halves).
// Written to out and, if not null, also to also_out (of T or C); out may be x.
template <typename T, typename C>
__attribute__((noinline)) void rotate_head(T* out, C* also_out, const T* x, const float* c,
                                           const float* s, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t start = 0;
#if defined(CORESTREAM_AVX512)
  // The portable loop's arithmetic, with bf16_bits' rounding (as silu_mul_row's).
  for (int64_t d = 0; d < half; d += avx512::kLanes) {
    const __mmask16 mask = avx512::first_lanes(std::min<int64_t>(avx512::kLanes, half - d));
    const __m512 first = avx512::load(x + d, mask);
    const __m512 second = avx512::load(x + d + half, mask);
    const __m512 new_first = _mm512_fmadd_ps(first, avx512::load(c + d, mask),
                                             _mm512_mul_ps(second, avx512::load(s + d, mask)));
    const __m512 new_second =
        _mm512_fmadd_ps(second, avx512::load(c + d + half, mask),
                        _mm512_mul_ps(first, avx512::load(s + d + half, mask)));
    avx512::store(out + d, new_first, mask);
    avx512::store(out + d + half, new_second, mask);
    if (also_out != nullptr) {
      avx512::store(also_out + d, new_first, mask);
      avx512::store(also_out + d + half, new_second, mask);
    }
  }
  start = half;
#elif defined(CORESTREAM_AVX2)
  for (; start + avx2::kLanes <= half; start += avx2::kLanes) {
    const int64_t d = start;
    const __m256 first = avx2::load(x + d);
    const __m256 second = avx2::load(x + d + half);
    const __m256 new_first = _mm256_fmadd_ps(first, avx2::load(c + d),
                                             _mm256_mul_ps(second, avx2::load(s + d)));
    const __m256 new_second = _mm256_fmadd_ps(second, avx2::load(c + d + half),
                                              _mm256_mul_ps(first, avx2::load(s + d + half)));
    avx2::store(out + d, new_first);
    avx2::store(out + d + half, new_second);
    if (also_out != nullptr) {
      avx2::store(also_out + d, new_first);
      avx2::store(also_out + d + half, new_second);
    }
  }
#endif
#pragma omp simd
  for (int64_t d = start; d < half; ++d) {
    const float first = to_float(x[d]);
    const float second = to_float(x[d + half]);
    const T new_first = from_float<T>(first * c[d] + second * s[d]);
    const T new_second = from_float<T>(second * c[d + half] + first * s[d + half]);
    out[d] = new_first;
    out[d + half] = new_second;
    if (also_out != nullptr) {
      if constexpr (std::is_same_v<T, C>) {
        also_out[d] = new_first;
        also_out[d + half] = new_second;
      } else {
        also_out[d] = from_float<C>(to_float(new_first));
        also_out[d + half] = from_float<C>(to_float(new_second));
      }
    }
  }
}

#define CORESTREAM_ROWS(T)                                                                  \
  template void normalize_row<T>(T*, const T*, const T*, int64_t, float);                  \
  template void add_row<T>(T*, const T*, const T*, int64_t);                                \
  template void silu_mul_row<T>(T*, const T*, const T*, int64_t);                           \
  template void rotate_head<T>(T*, T*, const T*, const float*, const float*, int64_t);
CORESTREAM_ROWS(float)
CORESTREAM_ROWS(c10::BFloat16)
#undef CORESTREAM_ROWS
template void rotate_head<float, c10::Half>(float*, c10::Half*, const float*, const float*,
                                            const float*, int64_t);

}  // namespace corestream_cpu

namespace {

using corestream_cpu::add_row;
using corestream_cpu::normalize_row;
using corestream_cpu::rotate_head;
using corestream_cpu::silu_mul_row;

constexpr int64_t kGrainElements = 16384;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// Calls f with a value of the C++ type of `dtype` (float or c10::BFloat16).
template <typename F>
void dispatch_dtype(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, " supports float32 and bfloat16, not ", dtype);
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.stride(-1) == 1, op, ": the normalized (last) dim must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              op, ": weight must be a contiguous [", x.size(-1), "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight dtype ",
              weight.scalar_type(), " differs from the input's ", x.scalar_type());
}

// x: [N, H] or [N, M, H] with any strides but a contiguous last dim (e.g. the q heads of
// a fused projection); returns a contiguous tensor of the same shape.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rms_norm: x must be 2-D or 3-D, got ", x.sizes());
  check_norm_args(x, weight, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1);
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t outer_stride = x.stride(0);
  const int64_t inner_stride = x.dim() == 3 ? x.stride(1) : 0;
  const int64_t rows = x.size(0) * inner;
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* src = x.const_data_ptr<T>();
    const T* w = weight.const_data_ptr<T>();
    T* dst = out.mutable_data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = src + (r / inner) * outer_stride + (r % inner) * inner_stride;
        normalize_row(dst + r * n, row, w, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// In place, both [N, H] with contiguous rows: residual = T(residual + x), then
// x = rms_norm(residual). The add is rounded to T before the norm reads it, as in
// transformers, where the residual stream is a tensor of the model's dtype.
void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                  double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(),
              "add_rms_norm: x and residual must be the same [N, H], got ", x.sizes(), " and ",
              residual.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "add_rms_norm: residual dtype ",
              residual.scalar_type(), " differs from x's ", x.scalar_type());
  TORCH_CHECK(residual.stride(-1) == 1, "add_rms_norm: residual rows must be contiguous");
  check_norm_args(x, weight, "add_rms_norm");
  const int64_t n = x.size(1);
  const int64_t x_stride = x.stride(0);
  const int64_t r_stride = residual.stride(0);
  dispatch_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* xs = x.mutable_data_ptr<T>();
    T* rs = residual.mutable_data_ptr<T>();
    const T* w = weight.const_data_ptr<T>();
    at::parallel_for(0, x.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* xr = xs + r * x_stride;
        T* rr = rs + r * r_stride;
        add_row(rr, rr, xr, n);
        normalize_row(xr, rr, w, n, static_cast<float>(eps));
      }
    });
  });
}

// x: [N, 2I], gate then up, contiguous rows; returns [N, I] = silu(gate) * up, with
// silu's output rounded to T as torch stores it before the product.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [N, 2 * I], got ", x.sizes());
  TORCH_CHECK(x.stride(1) == 1, "silu_and_mul: rows must be contiguous");
  const int64_t half = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), half}, x.options());
  dispatch_dtype(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = x.const_data_ptr<T>();
    T* dst = out.mutable_data_ptr<T>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, x.size(0), grain_rows(2 * half), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = src + r * stride;
        silu_mul_row(dst + r * half, gate, gate + half, half);
      }
    });
  });
  return out;
}

// Rotates q and k heads in place and stores keys and values in the paged cache.
// qk: [T, Hq + Hkv, D], q heads then k heads, any token and head strides, contiguous D;
// value: [T, Hkv, D], likewise. cos, sin: [T, D] float32, contiguous, laid out as
// kernels/corestream_kernels/rotary.py builds them: cos = [cos, cos], sin = [-sin, sin] over the two halves,
// so that x' = x * cos + swap_halves(x) * sin.
// key_cache, value_cache: [num_blocks, block_size, Hkv, D], contiguous, qk's dtype (or
// float16 under a float32 qk);
// slot_mapping: [T] int64, the cache slot of each token.
void rotary_store_kv(const at::Tensor& qk, const at::Tensor& value, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(qk.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4,
              "rotary_store_kv: qk and value [T, heads, D], caches 4-D");
  const int64_t tokens = qk.size(0);
  const int64_t dim = qk.size(2);
  const int64_t kv_heads = key_cache.size(2);
  const int64_t q_heads = qk.size(1) - kv_heads;
  TORCH_CHECK(dim % 2 == 0, "rotary_store_kv: head_dim must be even, got ", dim);
  TORCH_CHECK(q_heads >= 0 && key_cache.size(3) == dim,
              "rotary_store_kv: qk ", qk.sizes(), " does not end in the cache's ", kv_heads,
              " kv heads of size ", key_cache.size(3));
  TORCH_CHECK(value.size(0) == tokens && value.size(1) == kv_heads && value.size(2) == dim,
              "rotary_store_kv: value must be [", tokens, ", ", kv_heads, ", ", dim, "], got ",
              value.sizes());
  TORCH_CHECK(qk.stride(2) == 1 && value.stride(2) == 1,
              "rotary_store_kv: head_dim must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "rotary_store_kv: caches must be contiguous and alike");
  TORCH_CHECK(qk.scalar_type() == value.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "rotary_store_kv: qk and value must share a dtype, and the caches theirs");
  const bool half_cache = key_cache.scalar_type() == at::kHalf;
  TORCH_CHECK(corestream_cpu::cache_type_served(qk.scalar_type(), key_cache.scalar_type()),
              "rotary_store_kv: the caches must have qk's dtype (or float16 under a float32 "
              "qk), not ", key_cache.scalar_type(), " under ", qk.scalar_type());
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() &&
                    table->numel() == tokens * dim,
                "rotary_store_kv: cos and sin must be contiguous float32 [", tokens, ", ", dim,
                "]");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "rotary_store_kv: slot_mapping must be contiguous int64 [", tokens, "]");
  // Checked before anything is written, so a bad slot leaves qk and the caches as they were.
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rotary_store_kv: slot_mapping[", t,
                "] = ", slots[t], " outside the cache's ", num_slots, " slots");
  }
  auto store = [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    T* qk_data = qk.mutable_data_ptr<T>();
    const T* v_data = value.const_data_ptr<T>();
    C* k_cache = key_cache.mutable_data_ptr<C>();
    C* v_cache = value_cache.mutable_data_ptr<C>();
    const float* cos_data = cos.const_data_ptr<float>();
    const float* sin_data = sin.const_data_ptr<float>();
    const int64_t row_elements = (q_heads + 2 * kv_heads) * dim;
    at::parallel_for(0, tokens, grain_rows(row_elements), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slots[t];
        const float* c = cos_data + t * dim;
        const float* s = sin_data + t * dim;
        C* cached_keys = k_cache + slot * kv_heads * dim;
        for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
          T* x = qk_data + t * qk.stride(0) + h * qk.stride(1);
          // Keys are also stored in the cache; queries only rotate in place.
          rotate_head<T, C>(x, h >= q_heads ? cached_keys + (h - q_heads) * dim : nullptr, x, c,
                            s, dim);
        }
        C* cached_values = v_cache + slot * kv_heads * dim;
        for (int64_t h = 0; h < kv_heads; ++h) {
          const T* v = v_data + t * value.stride(0) + h * value.stride(1);
          corestream_cpu::convert_row(v, cached_values + h * dim, dim);
        }
      }
    });
  };
  if (half_cache) {
    store(float{}, c10::Half{});
    return;
  }
  dispatch_dtype(qk.scalar_type(), "rotary_store_kv", [&](auto tag) { store(tag, tag); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corestream_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "rotary_store_kv(Tensor(a!) qk, Tensor value, Tensor cos, Tensor sin, "
      "Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(corestream_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_store_kv", &rotary_store_kv);
}
