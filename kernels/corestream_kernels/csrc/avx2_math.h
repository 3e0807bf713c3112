// 8-lane float vector helpers for the AVX2 paths of the CPU kernels (CPUs with AVX2 and
// FMA but no AVX-512: Haswell to Zen 3, most cloud VMs). CORESTREAM_AVX2 is set when the
// build targets AVX2, FMA and F16C (every such CPU has all three) and not AVX-512, whose
// own paths then serve (avx512_math.h).
#pragma once

#include "avx512_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(CORESTREAM_AVX512)
#define CORESTREAM_AVX2 1

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <type_traits>

namespace corestream_cpu::avx2 {

constexpr int kLanes = 8;

// 16 bf16 holding 8 (k, k + 1) pairs as floats: the k (low halves) and the k + 1 (high
// halves). bf16 is the top half of an fp32, so each is one integer op.
inline __m256 low_halves(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }

inline __m256 high_halves(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

// 8 elements as floats (bf16 is the top half of an fp32).
inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// avx512::bf16_bits at 8 lanes.
inline __m256i bf16_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}

template <typename T>
inline __m256 round_to(__m256 x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16));
  } else {
    return x;
  }
}

inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store(c10::BFloat16* p, __m256 v) {
  const __m256i bits = bf16_bits(v);  // each < 2^16: the unsigned pack is exact
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline void store(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x lane by lane, the algorithm of corestream_cpu::exp_approx; the 2^n goes straight
// into the exponent bits (n is in [-126, 127] after the clamp).
inline __m256 exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606820309417e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace corestream_cpu::avx2

#endif
