// 16-lane float vector helpers for the AVX-512 paths of the CPU kernels. Include only
// under CORESTREAM_AVX512 (set here when the build targets AVX-512 F, BW and VL): the
// portable code beside each use is the fallback for other machines.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CORESTREAM_AVX512 1

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace corestream_cpu::avx512 {

constexpr int kLanes = 16;

// The first `n` lanes, for n in [0, 16].
inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>((uint32_t{1} << n) - 1);
}

// 16 elements as floats; lanes outside `mask` are zero and their memory is not read.
inline __m512 load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

inline __m512 load(const c10::BFloat16* p, __mmask16 mask) {
  // bf16 is the top half of an fp32.
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load(const c10::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// x rounded to bf16 as from_float<c10::BFloat16> rounds (nearest even, NaN a quiet NaN),
// the 16-bit patterns in the low halves of lanes. With AVX512-BF16 one instruction
// (vcvtneps2bf16) rounds the same, except that it flushes denormals to zero, as oneDNN's
// bf16 outputs already are; without it, integer ops round them as the portable code does
// (they were a third of a SiLU row's time).
inline __m512i bf16_bits(__m512 x) {
#ifdef __AVX512BF16__
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
#endif
}

// x rounded to T's precision and back (round_to<T>'s 16 lanes).
template <typename T>
inline __m512 round_to(__m512 x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
  } else {
    return x;
  }
}

// The lanes of `mask` stored as T (rounded as bf16_bits); other memory untouched.
inline void store(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }

inline void store(c10::BFloat16* p, __m512 v, __mmask16 mask) {
#ifdef __AVX512BF16__
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
#else
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(bf16_bits(v)));
#endif
}

inline void store(c10::Half* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

#ifdef __AVX512BF16__
#define CORESTREAM_AVX512_BF16 1

// The first `n` lanes of 32, for n in [0, 32].
inline __mmask32 first_lanes32(int64_t n) {
  return static_cast<__mmask32>((uint64_t{1} << n) - 1);
}

// 32 bf16 as 16 pairs for the bf16 dot-product instructions; lanes outside `mask` are
// zero and their memory is not read.
inline __m512bh load_pairs(const c10::BFloat16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}
#endif

// {sum(v[0]), ..., sum(v[15])}: sixteen horizontal sums for the price of about three
// vector ops each, by adding halves of ever smaller width across pairs of vectors (a
// transpose folded into the additions) instead of reducing each vector alone.
inline __m512 sum_each(const __m512 (&v)[16]) {
  // Halves of 256 bits: x[i]'s 128-bit lanes hold [v[2i], v[2i], v[2i+1], v[2i+1]].
  __m512 x[8];
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  // Halves of 128 bits: 128-bit lane j of y[i] holds v[4i + j].
  __m512 y[4];
  for (int i = 0; i < 4; ++i) {
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  }
  // Within 128-bit lanes: lane j of z[i] holds v[8i + j] twice, then v[8i + 4 + j] twice.
  __m512 z[2];
  for (int i = 0; i < 2; ++i) {
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  }
  // Element 4j + k now holds sum(v[j + 4k]); one permute puts sum(v[t]) at t.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                    _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i order =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// e^x lane by lane, the algorithm of corestream_cpu::exp_approx (about 2e-7 relative
// error, x clamped to [-87, 88]); scalef applies the 2^n exactly.
inline __m512 exp(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606820309417e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace corestream_cpu::avx512

#endif
