// 8-lane float vector helpers for the AVX2 paths of the CPU kernels (CPUs with AVX2 and
// FMA but no AVX-512: Haswell to Zen 3, most cloud VMs). CORESTREAM_AVX2 is set when the
// build targets AVX2 and FMA and not AVX-512, whose own paths then serve (avx512_math.h).
#pragma once

#include "avx512_math.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(CORESTREAM_AVX512)
#define CORESTREAM_AVX2 1

#include <immintrin.h>

namespace corestream_cpu::avx2 {

constexpr int kLanes = 8;

// 16 bf16 holding 8 (k, k + 1) pairs as floats: the k (low halves) and the k + 1 (high
// halves). bf16 is the top half of an fp32, so each is one integer op.
inline __m256 low_halves(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }

inline __m256 high_halves(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

}  // namespace corestream_cpu::avx2

#endif
