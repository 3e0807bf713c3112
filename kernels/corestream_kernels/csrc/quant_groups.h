// The GEMV of a grouped weight (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K rows interleaved
// in groups of 16: quant_blocks.h): each vector lane computes one output feature, so that
// a block of 16 (or 8) rows costs what quant_dot.h spends on one row's block.
//
// Why: quant_dot.h's kernels dot one weight row's 32-value block with an activation
// block in a vector of its own: unpack, two integer dot products, a conversion, the
// scales read and multiplied as scalars, an FMA, a scalar offset; about 18 instructions
// per block and activation row, then a horizontal sum per row. On SmolLM2-135M's
// projections that ran at 10-30% of the machine's read bandwidth at one row, and grew
// linearly with the rows (benchmarks/quant_gemv.py): bound by instructions, not memory.
// Here a lane holds four values of one row, and the activation's matching four values
// are broadcast to every lane (vpdpbusd's embedded broadcast), so the 8 dot products of a
// block serve 16 rows, the 16 rows' scales convert in one instruction, and the sums stay
// in their lanes until they are stored: about 22 instructions per block, row of
// activations and 16 weight rows.
//
// The integer sums are exact and the same as quant_dot.h's (256 (w . q) + w . lo, in
// int32); the float sums over blocks run in another order, so the two kernels agree to
// float32 rounding, not bit for bit. Q8_0's signed bytes meet vpdpbusd (unsigned times
// signed) as q + 128 (a flipped sign bit), whose extra 128 sum(x) is taken off in integers
// (Q8Block::sum); without 512-bit VNNI they keep quant_dot.h's sign trick (vpmaddubsw
// saturates at q + 128).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "quant_blocks.h"
#include "quant_dot.h"
#include "work_items.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CORESTREAM_GROUPS_ZMM 1
#endif

namespace corestream_cpu::quant {

namespace groups {

inline int32_t word_at(const int8_t* p, int k) {
  int32_t v;
  std::memcpy(&v, p + 4 * k, sizeof(v));
  return v;
}

// What differs between the grouped types: kHeader bytes before the payload (d, then m),
// whether the payload is nibbles (4 words, each giving values 4k..4k+3 in its low
// nibbles and 16+4k..16+4k+3 in its high ones, as GGUF's Q4 bytes do) or Q8_0's 8 words
// of signed bytes, and the constant term: d (q - 8) for Q4_0, d q + m for Q4_1.
template <GgmlType kType>
struct Group {
  static constexpr bool kMin = kType == GgmlType::Q4_1 || kType == GgmlType::Q5_1;
  static constexpr bool kFifthBit = kType == GgmlType::Q5_0 || kType == GgmlType::Q5_1;
  static constexpr bool kNibbles = kType != GgmlType::Q8_0;
  static constexpr int64_t kHeader = group_header_bytes(kType);
  static constexpr int64_t kQh = kHeader - 4;  // qh's offset in the header (Q5 types)
  static constexpr int64_t kBlockBytes = kGroupRows * format_of(kType).bytes;
  // The offset's weight per row: m (Q4_1, Q5_1), -8 d (Q4_0), -16 d (Q5_0), none (Q8_0).
  static constexpr float kCentre = kType == GgmlType::Q4_0   ? -8.0f
                                   : kType == GgmlType::Q5_0 ? -16.0f
                                                             : 1.0f;
};

// Bit 4k + t of a lane's qh is the fifth bit of its value 4k + t, which word k of the
// payload carries in byte t: for each word k, a shuffle puts qh's byte k / 2 in all four
// bytes of the lane, and byte t tests bit t + 4 (k % 2) of it.
inline int64_t qh_spread(int k) {  // shuffle indices within 128 bits: byte k / 2 of each dword
  const int64_t b = k / 2;
  const int64_t dword0 = 0x01010101 * b, dword1 = 0x01010101 * (4 + b);
  return dword0 | (dword1 << 32);
}
inline int64_t qh_spread_high(int k) {
  const int64_t b = k / 2;
  return (0x01010101 * (8 + b)) | ((0x01010101 * (12 + b)) << 32);
}
inline int32_t qh_bits(int k) {  // byte t: bit t + 4 (k % 2)
  const uint32_t shift = 4 * (k % 2);
  return static_cast<int32_t>((0x08040201u << shift));
}

// How far ahead of the block being summed its successors are fetched. Measured on the
// Zen 4 machine, Q4_1 at 4 rows: the 49152 x 576 head 1.79 -> 1.09 ms with 2 KB ahead, as
// the hardware prefetcher alone left the loads waiting (1 row: 1.08 -> 1.01 ms).
constexpr int64_t kPrefetchBytes = 2048;

#ifdef CORESTREAM_GROUPS_ZMM

// Rows of 16 lanes: R activation rows times one group (blocks of 16 rows) into out[r][0,
// 16).
template <GgmlType kType, int R>
void group_zmm(const uint8_t* group, int64_t blocks, const Q8Block* const (&x)[R],
               float* const (&out)[R]) {
  using G = Group<kType>;
  __m512 acc[R], offset[R];
  for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = group + b * G::kBlockBytes;
    for (int64_t line = 0; line < G::kBlockBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + line), _MM_HINT_T0);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 m = G::kMin
        ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))
        : d;
    const uint8_t* payload = p + kGroupRows * G::kHeader;
    // w[k] lane j: the four unsigned values of row j that meet activation word k.
    __m512i w[8];
    if constexpr (G::kNibbles) {
      for (int i = 0; i < 4; ++i) {
        const __m512i bytes = _mm512_loadu_si512(payload + 64 * i);
        w[i] = _mm512_and_si512(bytes, low4);
        w[4 + i] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      }
      if constexpr (G::kFifthBit) {
        const __m512i qh = _mm512_loadu_si512(p + kGroupRows * G::kQh);
        for (int k = 0; k < 8; ++k) {
          const __m512i spread = _mm512_shuffle_epi8(
              qh, _mm512_set_epi64(qh_spread_high(k), qh_spread(k), qh_spread_high(k),
                                   qh_spread(k), qh_spread_high(k), qh_spread(k),
                                   qh_spread_high(k), qh_spread(k)));
          const __mmask64 set = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(qh_bits(k)));
          w[k] = _mm512_mask_add_epi8(w[k], set, w[k], _mm512_set1_epi8(16));
        }
      }
    } else {
      for (int k = 0; k < 8; ++k) {
        w[k] = _mm512_xor_si512(_mm512_loadu_si512(payload + 64 * k), _mm512_set1_epi8(-128));
      }
    }
    for (int r = 0; r < R; ++r) {
      const Q8Block& a = x[r][b];
      // Two chains each for q and lo, so that consecutive products need not wait.
      __m512i high[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      __m512i low[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int k = 0; k < 8; ++k) {
        high[k & 1] = _mm512_dpbusd_epi32(high[k & 1], w[k], _mm512_set1_epi32(word_at(a.q, k)));
        low[k & 1] = _mm512_dpbusd_epi32(low[k & 1], w[k], _mm512_set1_epi32(word_at(a.lo, k)));
      }
      __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(high[0], high[1]), 8),
                                      _mm512_add_epi32(low[0], low[1]));
      if constexpr (!G::kNibbles) {
        sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(128 * a.sum));  // the q + 128
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d * kLoStep));
      acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc[r]);
      if constexpr (G::kNibbles) {
        offset[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.d_sum), offset[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out[r], _mm512_fmadd_ps(_mm512_set1_ps(G::kCentre), offset[r], acc[r]));
  }
}

#endif  // CORESTREAM_GROUPS_ZMM

#ifdef CORESTREAM_QUANT_AVX2

// Rows of 8 lanes: half `part` (rows 8 part .. 8 part + 7) of a group, as group_zmm.
template <GgmlType kType, int R>
void group_ymm(const uint8_t* group, int64_t blocks, int part, const Q8Block* const (&x)[R],
               float* const (&out)[R]) {
  using G = Group<kType>;
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  constexpr bool kFlipSign = true;  // dpbusd does not saturate: Q8_0 as q + 128
#else
  constexpr bool kFlipSign = false;  // vpmaddubsw would: |q| times sign(q) x instead
#endif
  __m256 acc[R], offset[R];
  for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = group + b * G::kBlockBytes;
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * part)));
    const __m256 m = G::kMin
        ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * part)))
        : d;
    const uint8_t* payload = p + kGroupRows * G::kHeader + 32 * part;
    __m256i high[R], low[R], qh;
    if constexpr (G::kFifthBit) qh = load32(p + kGroupRows * G::kQh + 32 * part);
    for (int r = 0; r < R; ++r) high[r] = low[r] = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      __m256i w, sign;
      if constexpr (G::kNibbles) {
        const __m256i bytes = load32(payload + 64 * (k & 3));
        w = k < 4 ? _mm256_and_si256(bytes, low4)
                  : _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        if constexpr (G::kFifthBit) {
          const __m256i spread = _mm256_shuffle_epi8(
              qh, _mm256_set_epi64x(qh_spread_high(k), qh_spread(k), qh_spread_high(k),
                                    qh_spread(k)));
          const __m256i bits = _mm256_set1_epi32(qh_bits(k));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
          w = _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
      } else if constexpr (kFlipSign) {
        w = _mm256_xor_si256(load32(payload + 64 * k), _mm256_set1_epi8(-128));
      } else {
        sign = load32(payload + 64 * k);
        w = _mm256_sign_epi8(sign, sign);
      }
      for (int r = 0; r < R; ++r) {
        __m256i q = _mm256_set1_epi32(word_at(x[r][b].q, k));
        __m256i lo = _mm256_set1_epi32(word_at(x[r][b].lo, k));
        if constexpr (!G::kNibbles && !kFlipSign) {
          q = _mm256_sign_epi8(q, sign);
          lo = _mm256_sign_epi8(lo, sign);
        }
        high[r] = dot_u8s8(high[r], w, q);
        low[r] = dot_u8s8(low[r], w, lo);
      }
    }
    for (int r = 0; r < R; ++r) {
      const Q8Block& a = x[r][b];
      __m256i sums = _mm256_add_epi32(_mm256_slli_epi32(high[r], 8), low[r]);
      if constexpr (!G::kNibbles && kFlipSign) {
        sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(128 * a.sum));
      }
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d * kLoStep));
      acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[r]);
      if constexpr (G::kNibbles) {
        offset[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.d_sum), offset[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out[r], _mm256_fmadd_ps(_mm256_set1_ps(G::kCentre), offset[r], acc[r]));
  }
}

#endif  // CORESTREAM_QUANT_AVX2

// Q4_K (256 values a block: 8 sub-blocks of 32, each with a six-bit scale and min, packed
// in 12 bytes; quant_blocks.h). The header is d, dmin and the 12 scale bytes as three
// words per row; the payload 32 words per row, word c of 64-value chunk j = c / 8 holding
// values 64 j + 4 (c % 8) + t in its low nibbles and 64 j + 32 + 4 (c % 8) + t in its high
// ones (sub-blocks 2 j and 2 j + 1). Each sub-block's integer sums are multiplied by its
// scale per lane (vpmulld), the mins by the activation's sums per 16 values, both kept in
// int32 until the block's end (at most 31M: no overflow), then scaled once by d and dmin.
// The activations of a K-quant weight come in two quantized passes (QuantActivations):
// R counts those rows, in pairs.
constexpr int64_t kQ4KBlockBytes = kGroupRows * 144;

inline int32_t k_sum(const Q8KBlock& a, int s) {  // the activation's q summed over sub-block s
  return a.sums[2 * s] + a.sums[2 * s + 1];
}

#ifdef CORESTREAM_GROUPS_ZMM

// Sub-block s's scale and min per lane, from the three scale words of 16 rows.
inline void q4k_scale_zmm(const __m512i (&words)[3], int s, __m512i& scale, __m512i& min) {
  const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
  const __m512i two = _mm512_set1_epi32(3);
  if (s < 4) {
    scale = _mm512_and_si512(_mm512_srli_epi32(words[0], 8 * s), six);
    min = _mm512_and_si512(_mm512_srli_epi32(words[1], 8 * s), six);
    return;
  }
  const unsigned t = 8 * (s - 4);
  const __m512i scale_high = _mm512_and_si512(_mm512_srli_epi32(words[0], t + 6), two);
  const __m512i min_high = _mm512_and_si512(_mm512_srli_epi32(words[1], t + 6), two);
  scale = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(words[2], t), four),
                          _mm512_slli_epi32(scale_high, 4));
  min = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(words[2], t + 4), four),
                        _mm512_slli_epi32(min_high, 4));
}

template <int R>
void group_q4k_zmm(const uint8_t* group, int64_t blocks, const Q8KBlock* const (&x)[R],
                   __m512 (&result)[R]) {
  __m512 acc[R], offset[R];
  for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = group + b * kQ4KBlockBytes;
    for (int64_t line = 0; line < kQ4KBlockBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + line), _MM_HINT_T0);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 dmin =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    const __m512i words[3] = {_mm512_loadu_si512(p + 64), _mm512_loadu_si512(p + 128),
                              _mm512_loadu_si512(p + 192)};
    const uint8_t* payload = p + 256;
    __m512i sums[R], mins[R];
    for (int r = 0; r < R; ++r) sums[r] = mins[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i low[R], high[R];
      for (int r = 0; r < R; ++r) low[r] = high[r] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i bytes = _mm512_loadu_si512(payload + 64 * (8 * j + c));
        const __m512i lo = _mm512_and_si512(bytes, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        for (int r = 0; r < R; ++r) {
          low[r] = _mm512_dpbusd_epi32(low[r], lo,
                                       _mm512_set1_epi32(word_at(x[r][b].q, 16 * j + c)));
          high[r] = _mm512_dpbusd_epi32(high[r], hi,
                                        _mm512_set1_epi32(word_at(x[r][b].q, 16 * j + 8 + c)));
        }
      }
      __m512i scale[2], min[2];
      q4k_scale_zmm(words, 2 * j, scale[0], min[0]);
      q4k_scale_zmm(words, 2 * j + 1, scale[1], min[1]);
      for (int r = 0; r < R; ++r) {
        const Q8KBlock& a = x[r][b];
        const __m512i scaled = _mm512_add_epi32(_mm512_mullo_epi32(low[r], scale[0]),
                                                _mm512_mullo_epi32(high[r], scale[1]));
        const __m512i mins_j =
            _mm512_add_epi32(_mm512_mullo_epi32(min[0], _mm512_set1_epi32(k_sum(a, 2 * j))),
                             _mm512_mullo_epi32(min[1], _mm512_set1_epi32(k_sum(a, 2 * j + 1))));
        sums[r] = _mm512_add_epi32(sums[r], scaled);
        mins[r] = _mm512_add_epi32(mins[r], mins_j);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x[r][b].d);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sums[r]), acc[r]);
      offset[r] = _mm512_fmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(mins[r]), offset[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = _mm512_sub_ps(acc[r], offset[r]);
}

#endif  // CORESTREAM_GROUPS_ZMM

#ifdef CORESTREAM_QUANT_AVX2

inline void q4k_scale_ymm(const __m256i (&words)[3], int s, __m256i& scale, __m256i& min) {
  const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15);
  const __m256i two = _mm256_set1_epi32(3);
  if (s < 4) {
    scale = _mm256_and_si256(_mm256_srli_epi32(words[0], 8 * s), six);
    min = _mm256_and_si256(_mm256_srli_epi32(words[1], 8 * s), six);
    return;
  }
  const int t = 8 * (s - 4);
  const __m256i scale_high = _mm256_and_si256(_mm256_srli_epi32(words[0], t + 6), two);
  const __m256i min_high = _mm256_and_si256(_mm256_srli_epi32(words[1], t + 6), two);
  scale = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(words[2], t), four),
                          _mm256_slli_epi32(scale_high, 4));
  min = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(words[2], t + 4), four),
                        _mm256_slli_epi32(min_high, 4));
}

template <int R>
void group_q4k_ymm(const uint8_t* group, int64_t blocks, int part,
                   const Q8KBlock* const (&x)[R], __m256 (&result)[R]) {
  __m256 acc[R], offset[R];
  for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = group + b * kQ4KBlockBytes;
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * part)));
    const __m256 dmin =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * part)));
    const __m256i words[3] = {load32(p + 64 + 32 * part), load32(p + 128 + 32 * part),
                              load32(p + 192 + 32 * part)};
    const uint8_t* payload = p + 256 + 32 * part;
    __m256i sums[R], mins[R];
    for (int r = 0; r < R; ++r) sums[r] = mins[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i low[R], high[R];
      for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i bytes = load32(payload + 64 * (8 * j + c));
        const __m256i lo = _mm256_and_si256(bytes, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        for (int r = 0; r < R; ++r) {
          low[r] = dot_u8s8(low[r], lo, _mm256_set1_epi32(word_at(x[r][b].q, 16 * j + c)));
          high[r] = dot_u8s8(high[r], hi, _mm256_set1_epi32(word_at(x[r][b].q, 16 * j + 8 + c)));
        }
      }
      __m256i scale[2], min[2];
      q4k_scale_ymm(words, 2 * j, scale[0], min[0]);
      q4k_scale_ymm(words, 2 * j + 1, scale[1], min[1]);
      for (int r = 0; r < R; ++r) {
        const Q8KBlock& a = x[r][b];
        const __m256i scaled = _mm256_add_epi32(_mm256_mullo_epi32(low[r], scale[0]),
                                                _mm256_mullo_epi32(high[r], scale[1]));
        const __m256i mins_j =
            _mm256_add_epi32(_mm256_mullo_epi32(min[0], _mm256_set1_epi32(k_sum(a, 2 * j))),
                             _mm256_mullo_epi32(min[1], _mm256_set1_epi32(k_sum(a, 2 * j + 1))));
        sums[r] = _mm256_add_epi32(sums[r], scaled);
        mins[r] = _mm256_add_epi32(mins[r], mins_j);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(x[r][b].d);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sums[r]), acc[r]);
      offset[r] = _mm256_fmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins[r]), offset[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = _mm256_sub_ps(acc[r], offset[r]);
}

#endif  // CORESTREAM_QUANT_AVX2

// P x rows (2 P quantized rows, their passes) from x row x0 times group g0 / 16 of a
// K-quant weight into out rows x0.. at columns g0..: each output its row's passes summed.
template <GgmlType kType, int P>
void k_pass(const QuantMatrix& w, const QuantActivations& x, int64_t x0, int64_t g0,
            float* out, int64_t out_stride);

// The K-quant grouped GEMV over x rows in tiles that stay in L2.
template <GgmlType kType>
void k_rows(const QuantMatrix& w, const QuantActivations& x, int64_t n_begin, int64_t n_end,
            float* out, int64_t out_stride) {
  const int64_t m = x.rows();
  constexpr int64_t kTile = 32;  // x rows whose blocks (2 passes, 292 bytes a block) stay in L2
  for (int64_t t = 0; t < m; t += kTile) {
    const int64_t tile_end = std::min(m, t + kTile);
    for (int64_t g = n_begin; g < n_end; g += kGroupRows) {
      for (int64_t q = t; q < tile_end; q += 2) {
        if (tile_end - q >= 2) {
          k_pass<kType, 2>(w, x, q, g, out, out_stride);
        } else {
          k_pass<kType, 1>(w, x, q, g, out, out_stride);
        }
      }
    }
  }
}

// Q6_K (256 values a block: 16 sub-blocks of 16 with an int8 scale each, 6-bit values
// q - 32 from 4 bits of ql and 2 of qh; quant_blocks.h). Grouped, every 4 bytes of the
// block are a field (32 words of ql, 16 of qh, 4 of scales), then d. Word (h, t, c) of
// values 128 h + 32 t + 4 c + (0..3): ql word 16 h + 8 (t % 2) + c, nibble t / 2, and qh
// word 8 h + c, bits 2 t and 2 t + 1 of each byte; values 0..63, so the -32 is taken off
// in integers with the activation's sums per 16 values. Sub-block i's sums times its
// scale per lane (vpmulld), all in int32 (at most about 400M), then scaled once by d.
constexpr int64_t kQ6KBlockBytes = kGroupRows * 210;

#ifdef CORESTREAM_GROUPS_ZMM

template <int R>
void group_q6k_zmm(const uint8_t* group, int64_t blocks, const Q8KBlock* const (&x)[R],
                   __m512 (&result)[R]) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15), low2 = _mm512_set1_epi8(3);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = group + b * kQ6KBlockBytes;
    for (int64_t line = 0; line < kQ6KBlockBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + line), _MM_HINT_T0);
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kGroupRows * 208)));
    const uint8_t* ql = p;
    const uint8_t* qh = p + kGroupRows * 128;
    const uint8_t* scales = p + kGroupRows * 192;
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < 4; ++t) {
        // Sub-blocks 8 h + 2 t (c < 4) and 8 h + 2 t + 1 (c >= 4).
        __m512i part[2][R];
        for (int r = 0; r < R; ++r) part[0][r] = part[1][r] = _mm512_setzero_si512();
        for (int c = 0; c < 8; ++c) {
          const __m512i low_bytes = _mm512_loadu_si512(ql + 64 * (16 * h + 8 * (t % 2) + c));
          const __m512i high_bytes = _mm512_loadu_si512(qh + 64 * (8 * h + c));
          const __m512i low = _mm512_and_si512(_mm512_srli_epi16(low_bytes, 4 * (t / 2)), low4);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(high_bytes, 2 * t), low2);
          const __m512i w = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
          for (int r = 0; r < R; ++r) {
            __m512i& s = part[c / 4][r];
            s = _mm512_dpbusd_epi32(
                s, w, _mm512_set1_epi32(word_at(x[r][b].q, 32 * h + 8 * t + c)));
          }
        }
        for (int k = 0; k < 2; ++k) {
          const int i = 8 * h + 2 * t + k;  // the sub-block
          // Its int8 scale per lane: byte i % 4 of scale word i / 4, sign-extended.
          const __m512i word = _mm512_loadu_si512(scales + 64 * (i / 4));
          const __m512i scale = _mm512_srai_epi32(_mm512_slli_epi32(word, 24 - 8 * (i % 4)), 24);
          for (int r = 0; r < R; ++r) {
            const __m512i shifted = _mm512_sub_epi32(
                part[k][r], _mm512_set1_epi32(32 * x[r][b].sums[i]));  // q - 32
            sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(shifted, scale));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[r][b].d)),
                               _mm512_cvtepi32_ps(sums[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = acc[r];
}

#endif  // CORESTREAM_GROUPS_ZMM

#ifdef CORESTREAM_QUANT_AVX2

template <int R>
void group_q6k_ymm(const uint8_t* group, int64_t blocks, int part_of_group,
                   const Q8KBlock* const (&x)[R], __m256 (&result)[R]) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
  const int64_t lanes = 32 * part_of_group;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = group + b * kQ6KBlockBytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(p + kGroupRows * 208 + 16 * part_of_group)));
    const uint8_t* ql = p + lanes;
    const uint8_t* qh = p + kGroupRows * 128 + lanes;
    const uint8_t* scales = p + kGroupRows * 192 + lanes;
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < 4; ++t) {
        __m256i part[2][R];
        for (int r = 0; r < R; ++r) part[0][r] = part[1][r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i low_bytes = load32(ql + 64 * (16 * h + 8 * (t % 2) + c));
          const __m256i high_bytes = load32(qh + 64 * (8 * h + c));
          const __m256i low = _mm256_and_si256(_mm256_srli_epi16(low_bytes, 4 * (t / 2)), low4);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(high_bytes, 2 * t), low2);
          const __m256i w = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
          for (int r = 0; r < R; ++r) {
            __m256i& s = part[c / 4][r];
            s = dot_u8s8(s, w, _mm256_set1_epi32(word_at(x[r][b].q, 32 * h + 8 * t + c)));
          }
        }
        for (int k = 0; k < 2; ++k) {
          const int i = 8 * h + 2 * t + k;
          const __m256i word = load32(scales + 64 * (i / 4));
          const __m256i scale = _mm256_srai_epi32(_mm256_slli_epi32(word, 24 - 8 * (i % 4)), 24);
          for (int r = 0; r < R; ++r) {
            const __m256i shifted =
                _mm256_sub_epi32(part[k][r], _mm256_set1_epi32(32 * x[r][b].sums[i]));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_mullo_epi32(shifted, scale));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[r][b].d)),
                               _mm256_cvtepi32_ps(sums[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = acc[r];
}

#endif  // CORESTREAM_QUANT_AVX2

template <GgmlType kType, int P>
void k_pass(const QuantMatrix& w, const QuantActivations& x, int64_t x0, int64_t g0,
            float* out, int64_t out_stride) {
  constexpr int R = 2 * P;
  static_assert(QuantActivations::kPasses == 2);
  static_assert(kType == GgmlType::Q4_K || kType == GgmlType::Q6_K);
  const uint8_t* group = w.blocks + g0 * w.row_bytes;
  const int64_t blocks = w.cols / kQK;
  const Q8KBlock* rows[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = x.blocks(2 * x0 + r, static_cast<const Q8KBlock*>(nullptr));
  }
#if defined(CORESTREAM_GROUPS_ZMM)
  __m512 result[R];
  if constexpr (kType == GgmlType::Q4_K) {
    group_q4k_zmm<R>(group, blocks, rows, result);
  } else {
    group_q6k_zmm<R>(group, blocks, rows, result);
  }
  for (int i = 0; i < P; ++i) {
    _mm512_storeu_ps(out + (x0 + i) * out_stride + g0,
                     _mm512_add_ps(result[2 * i], result[2 * i + 1]));
  }
#elif defined(CORESTREAM_QUANT_AVX2)
  for (int part = 0; part < 2; ++part) {
    __m256 result[R];
    if constexpr (kType == GgmlType::Q4_K) {
      group_q4k_ymm<R>(group, blocks, part, rows, result);
    } else {
      group_q6k_ymm<R>(group, blocks, part, rows, result);
    }
    for (int i = 0; i < P; ++i) {
      _mm256_storeu_ps(out + (x0 + i) * out_stride + g0 + 8 * part,
                       _mm256_add_ps(result[2 * i], result[2 * i + 1]));
    }
  }
#else
  (void)group;
  (void)blocks;
#endif
}

#ifdef CORESTREAM_GROUPS_ZMM
// Activation rows that share each unpacked weight block: with 8, their accumulators and
// offsets and the block's unpacked words take 24 of the 32 registers. Against 4, the
// batch-32 decode step of SmolLM2 took 42.2, 44.7 ms instead of 48.1, 46.0 (Q4_K_M, mostly
// Q5_0, whose fifth bits cost most to unpack) and 38.4, 38.0 instead of 38.9, 40.9 (Q8_0),
// alternated on 2 cores (AMD EPYC, Zen 4; benchmarks/decode_step.py --workloads decode32).
constexpr int kRowsPerPass = 8;
#else
constexpr int kRowsPerPass = 2;  // 16 vector registers
#endif

// R activation rows from x row q0 times group g0 / 16, into out rows q0.. at columns g0...
template <GgmlType kType, int R>
void group_pass(const QuantMatrix& w, const QuantActivations& x, int64_t q0, int64_t g0,
                float* out, int64_t out_stride) {
  const uint8_t* group = w.blocks + g0 * w.row_bytes;
  const int64_t blocks = w.cols / 32;
  const Q8Block* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x.blocks(q0 + r, static_cast<const Q8Block*>(nullptr));
#if defined(CORESTREAM_GROUPS_ZMM)
  float* outs[R];
  for (int r = 0; r < R; ++r) outs[r] = out + (q0 + r) * out_stride + g0;
  group_zmm<kType, R>(group, blocks, rows, outs);
#elif defined(CORESTREAM_QUANT_AVX2)
  for (int part = 0; part < 2; ++part) {
    float* outs[R];
    for (int r = 0; r < R; ++r) outs[r] = out + (q0 + r) * out_stride + g0 + 8 * part;
    group_ymm<kType, R>(group, blocks, part, rows, outs);
  }
#else
  (void)group;
  (void)blocks;
  static_assert(R > 0);
#endif
}

// group_pass for `rows` rows (1 to R).
template <GgmlType kType, int R = kRowsPerPass>
void rows_pass(int64_t rows, const QuantMatrix& w, const QuantActivations& x, int64_t q0,
               int64_t g0, float* out, int64_t out_stride) {
  if constexpr (R > 1) {
    if (rows < R) {
      rows_pass<kType, R - 1>(rows, w, x, q0, g0, out, out_stride);
      return;
    }
  }
  group_pass<kType, R>(w, x, q0, g0, out, out_stride);
}

// Activation rows per tile of a many-row call: their blocks (76 bytes per 32 values)
// stay in L2 while the item's weight groups pass over them.
constexpr int64_t kRowTile = 64;

template <GgmlType kType>
void grouped_rows(const QuantMatrix& w, const QuantActivations& x, int64_t n_begin,
                  int64_t n_end, float* out, int64_t out_stride) {
  const int64_t m = x.rows();
  for (int64_t t = 0; t < m; t += kRowTile) {
    const int64_t tile_end = std::min(m, t + kRowTile);
    for (int64_t g = n_begin; g < n_end; g += kGroupRows) {
      // The group's blocks stream from memory once; later passes find them in L1/L2.
      for (int64_t q = t; q < tile_end; q += kRowsPerPass) {
        rows_pass<kType>(std::min<int64_t>(kRowsPerPass, tile_end - q), w, x, q, g, out,
                         out_stride);
      }
    }
  }
}

}  // namespace groups

// out[r * out_stride + n] = w.row(n) . x.row(r) for n in [n_begin, n_end) (multiples of
// kGroupRows) of a grouped w, every row of x. Builds without AVX2 gather each row into the
// file's layout and take quant_dot.h's portable loops.
inline void grouped_gemv_rows(const QuantMatrix& w, const QuantActivations& x,
                              int64_t n_begin, int64_t n_end, float* out,
                              int64_t out_stride) {
#if defined(CORESTREAM_GROUPS_ZMM) || defined(CORESTREAM_QUANT_AVX2)
  switch (w.type) {
    case GgmlType::Q4_0:
      groups::grouped_rows<GgmlType::Q4_0>(w, x, n_begin, n_end, out, out_stride);
      return;
    case GgmlType::Q4_1:
      groups::grouped_rows<GgmlType::Q4_1>(w, x, n_begin, n_end, out, out_stride);
      return;
    case GgmlType::Q5_0:
      groups::grouped_rows<GgmlType::Q5_0>(w, x, n_begin, n_end, out, out_stride);
      return;
    case GgmlType::Q5_1:
      groups::grouped_rows<GgmlType::Q5_1>(w, x, n_begin, n_end, out, out_stride);
      return;
    case GgmlType::Q8_0:
      groups::grouped_rows<GgmlType::Q8_0>(w, x, n_begin, n_end, out, out_stride);
      return;
    case GgmlType::Q4_K:
      groups::k_rows<GgmlType::Q4_K>(w, x, n_begin, n_end, out, out_stride);
      return;
    case GgmlType::Q6_K:
      groups::k_rows<GgmlType::Q6_K>(w, x, n_begin, n_end, out, out_stride);
      return;
    default:
      break;
  }
#endif
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(static_cast<size_t>(w.row_bytes));
  for (int64_t n = n_begin; n < n_end; ++n) {
    const QuantMatrix row{gguf_row(w, n, scratch.data()), w.type, 1, w.cols, w.row_bytes};
    quant_gemv_rows(row, x, 0, 1, out + n, out_stride);
  }
}

// Output features per GEMV item for `threads` threads: about four items each, enough for
// them to share out (a preempted thread's share goes to the others), each long enough
// that taking it costs little beside it; whole groups of a grouped weight. Eight items a
// thread, at most 64 rows each, made SmolLM2 Q4_1's batch-1 step ~10% slower on 2 cores
// (benchmarks/decode_step.py, alternated): each item pays the atomic that hands it out,
// the done flag the other thread polls, and a cold start of its weight stream.
inline int64_t gemv_item_rows(const QuantMatrix& w, int64_t threads) {
  const int64_t rows = std::clamp<int64_t>(w.rows / (4 * std::max<int64_t>(1, threads)), 4, 1024);
  return w.grouped ? (rows + kGroupRows - 1) / kGroupRows * kGroupRows : rows;
}

// The GEMV of w (either layout) by x (quantized for it) into out [x.rows(), w.rows] (row
// stride out_stride) as work items for run_items or a StagePlan stage: (number of items,
// item i computing outputs [i rows_per_item, (i + 1) rows_per_item)), rows_per_item from
// gemv_item_rows. w, x and out must outlive the items.
inline std::pair<int64_t, Item> quant_gemv_items(const QuantMatrix& w, const QuantActivations& x,
                                                 float* out, int64_t out_stride,
                                                 int64_t rows_per_item) {
  const int64_t count = (w.rows + rows_per_item - 1) / rows_per_item;
  return {count, [&w, &x, out, out_stride, rows_per_item](int64_t i) {
            const int64_t begin = i * rows_per_item, end = std::min(w.rows, begin + rows_per_item);
            if (w.grouped) {
              grouped_gemv_rows(w, x, begin, end, out, out_stride);
            } else {
              quant_gemv_rows(w, x, begin, end, out, out_stride);
            }
          }};
}

}  // namespace corestream_cpu::quant
