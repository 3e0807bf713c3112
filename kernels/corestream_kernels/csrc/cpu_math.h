// Scalar helpers shared by the CPU kernels, written so that `omp simd` loops over them
// vectorize (libm's expf and c10's BFloat16 conversions are calls the compiler cannot
// turn into vector code).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace corestream_cpu {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of an fp32.
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Whether the attention and KV-cache ops take a cache of `cache` under activations of
// `activations`: the same dtype, or float16 under float32 (--kv-cache-dtype).
inline bool cache_type_served(c10::ScalarType activations, c10::ScalarType cache) {
  return cache == activations || (activations == c10::kFloat && cache == c10::kHalf);
}

// IEEE half (a float16 KV cache): F16C's conversion where the build has it.
inline float to_float(c10::Half x) {
#ifdef __F16C__
  return _cvtsh_ss(x.x);
#else
  return static_cast<float>(x);
#endif
}

template <typename T>
inline T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

// Round to nearest even, NaN kept a (quiet) NaN: the rounding torch's own casts do.
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(std::isnan(x) ? 0x7FC0u : rounded);
  return out;
}

// Round to nearest even, as torch's casts.
template <>
inline c10::Half from_float<c10::Half>(float x) {
#ifdef __F16C__
  return c10::Half(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT), c10::Half::from_bits());
#else
  return c10::Half(x);
#endif
}

// dst[i] = src[i] in D's type (a plain copy where the types are the same).
template <typename S, typename D>
inline void convert_row(const S* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::copy(src, src + n, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(src[i]));
  }
}

// Rounds x to T's precision and back: the value torch would store between two ops.
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// e^x to about 2e-7 relative error, for x in [-87, 88] (clamped to it outside). x = n ln2
// + r with |r| <= ln2 / 2, e^r by its Taylor series to degree 6 (truncation error below
// 1.2e-7), 2^n written straight into the exponent bits.
#pragma omp declare simd notinbranch
inline float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 split so that n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.428606820309417e-06f;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * kLog2e);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace corestream_cpu
