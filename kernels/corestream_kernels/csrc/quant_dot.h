// Dot products of GGUF weight rows with activations quantized to 8 bits, and the
// GEMV over a weight's rows built on them: the decode path of quant_linear
// (quant_cpu.cpp), for any op that holds a QuantMatrix (decode_model, later).
//
// At one to a few rows a linear layer is a pass over its weight, so it runs at the speed
// the weight streams from memory; a 4-bit weight is an eighth of float32's bytes. The
// activation rows are quantized once per call to 8-bit blocks (Q8Block: 32 values, for
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; Q8KBlock: 256 values with sums per 16, for the
// K-quants), in two passes (QuantActivations says why), and each weight block meets them
// as integers, as llama.cpp does with one pass:
//
//   dot(block) = d_w d_x sum_l q_w[l] q_x[l]  (+ the block's offset: -8 d_w d_x sum q_x
//                for Q4_0, -16 d_w d_x sum q_x for Q5_0, m_w d_x sum q_x for Q4_1 and
//                Q5_1, and for the K-quants the mins or the -32 from the sums per 16
//                values)
//
// The integer sums go 32 bytes at a time: unsigned weight bytes times signed activation
// bytes, summed in fours into int32 lanes (`dot_u8s8`: one vpdpbusd with AVX512-VNNI or
// AVX-VNNI, else vpmaddubsw + vpmaddwd; no pair of products reaches the int16 limit,
// since weights are at most 6 bits unsigned, or Q8_0's |q| <= 128 with the sign moved
// onto the activation, times |q_x| <= 127). The K-quants' per-sub-block scales multiply
// in with vpmaddwd (vpdpwssd with VNNI). The vectors are 256-bit in AVX2 and AVX-512
// builds alike: the pass is bound by memory, not by vector width (benchmarks/
// quant_gemv.py). Builds without AVX2 take the portable loops.
//
// Up to kRowsPerPass activation rows share each unpacked weight block, so decode batches
// pay the unpacking once per weight block, not once per row.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "quant_blocks.h"
#include "work_items.h"

#if defined(__AVX2__) && defined(__FMA__)
#define CORESTREAM_QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace corestream_cpu::quant {

constexpr int kRowsPerPass = 4;

#ifdef CORESTREAM_QUANT_AVX2

// acc + sums of four products u[i] s[i] (u unsigned, s signed bytes) per int32 lane.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// acc + sums of pairs of u[i] s[i] (bytes, as dot_u8s8), each pair times scale's lane.
inline __m256i scaled_dot(__m256i acc, __m256i u, __m256i s, __m256i scale) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, pairs, scale);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, pairs, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// 16 bytes of nibbles as 32 values: the low nibbles (values 0-15), then the high ones.
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes),
                          _mm256_set1_epi8(15));
}

// 32 bits as 32 bytes: byte j is 16 where bit j of `bits` is set, else 0 (Q5's fifth bits).
inline __m256i fifth_bits(uint32_t bits) {
  // Byte j takes the byte holding bit j (shuffles stay within 128-bit lanes: the low lane
  // needs bytes 0-1 of the word, the high lane bytes 2-3), then tests its bit.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

#endif  // CORESTREAM_QUANT_AVX2

// Each kind below adds block b of a weight row times block b of R activation rows to
// acc[r] (the scaled integer sums) and offset[r] (the block's constant term); `dot_rows`
// runs them over a row, two blocks at a time into two sets of accumulators, so that
// consecutive blocks do not wait on one another's additions.

#ifdef CORESTREAM_QUANT_AVX2
using Acc = __m256;
inline Acc zero_acc() { return _mm256_setzero_ps(); }
inline float total(Acc acc) { return hsum(acc); }
inline void add_scaled(Acc& acc, float scale, __m256i sums) {
  acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(sums), acc);
}
#else
using Acc = float;
inline Acc zero_acc() { return 0.0f; }
inline float total(Acc acc) { return acc; }
inline void add_scaled(Acc& acc, float scale, int32_t sum) {
  acc += scale * static_cast<float>(sum);
}
#endif

// A Q8Block's value l in steps of d / 256 (256 q + lo), and that step's size in d.
constexpr float kLoStep = 1.0f / 256.0f;
inline int32_t wide(const Q8Block& a, int l) { return 256 * a.q[l] + a.lo[l]; }

#ifdef CORESTREAM_QUANT_AVX2
// Sums of fours of unsigned weight bytes u times the block's values in steps of d / 256:
// 256 (u . q) + u . lo, per int32 lane. No lane overflows: |u . q| <= 4 * 128 * 127.
inline __m256i fused_dot(__m256i u, const Q8Block& a) {
  const __m256i high = dot_u8s8(_mm256_setzero_si256(), u, load32(a.q));
  return dot_u8s8(_mm256_slli_epi32(high, 8), u, load32(a.lo));
}
#endif

// Q4_0 (x = d (q - 8)), Q4_1 (kMin: x = d q + m), and Q5_0 (x = d (q - 16)) and Q5_1
// (kMin) with kFifthBit: the same nibbles, after 4 bytes qh that give each value a fifth
// bit.
template <bool kMin, bool kFifthBit>
struct DotQ4Q5 {
  using Act = Q8Block;
  static constexpr int64_t kHeader = (kMin ? 4 : 2) + (kFifthBit ? 4 : 0);
  static constexpr int64_t kBytes = kHeader + 16;
  static constexpr float kCentre = kFifthBit ? -16.0f : -8.0f;  // without a min

  template <int R>
  static void block(const uint8_t* row, const Act* const (&x)[R], int64_t b, Acc (&acc)[R],
                    float (&offset)[R]) {
    const uint8_t* p = row + kBytes * b;
    const float d = half_at(p);
    const float m = kMin ? half_at(p + 2) : 0.0f;
    const uint32_t qh = kFifthBit ? u32_at(p + kHeader - 4) : 0;
    const uint8_t* qs = p + kHeader;
#ifdef CORESTREAM_QUANT_AVX2
    const __m256i low = nibbles16(qs);
    const __m256i q = kFifthBit ? _mm256_or_si256(low, fifth_bits(qh)) : low;
#endif
    for (int r = 0; r < R; ++r) {
      const Act& a = x[r][b];
#ifdef CORESTREAM_QUANT_AVX2
      const __m256i sums = fused_dot(q, a);
#else
      int32_t sums = 0;
      for (int l = 0; l < 16; ++l) {
        const int first = (qs[l] & 15) | (((qh >> l) & 1) << 4);
        const int second = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        sums += first * wide(a, l) + second * wide(a, l + 16);
      }
#endif
      add_scaled(acc[r], d * a.d * kLoStep, sums);
      offset[r] += (kMin ? m : kCentre * d) * a.d_sum;
    }
  }
};

struct DotQ8_0 {
  using Act = Q8Block;
  template <int R>
  static void block(const uint8_t* row, const Act* const (&x)[R], int64_t b, Acc (&acc)[R],
                    float (&)[R]) {
    const uint8_t* p = row + 34 * b;
    const float d = half_at(p);
#ifdef CORESTREAM_QUANT_AVX2
    const __m256i q = load32(p + 2);
    const __m256i magnitude = _mm256_sign_epi8(q, q);  // |q| as unsigned bytes
#else
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
#endif
    for (int r = 0; r < R; ++r) {
      const Act& a = x[r][b];
#ifdef CORESTREAM_QUANT_AVX2
      // q_w q_x = |q_w| (sign(q_w) q_x)
      const __m256i high = dot_u8s8(_mm256_setzero_si256(), magnitude,
                                    _mm256_sign_epi8(load32(a.q), q));
      const __m256i sums = dot_u8s8(_mm256_slli_epi32(high, 8), magnitude,
                                    _mm256_sign_epi8(load32(a.lo), q));
#else
      int32_t sums = 0;
      for (int l = 0; l < 32; ++l) sums += q[l] * wide(a, l);
#endif
      add_scaled(acc[r], d * a.d * kLoStep, sums);
    }
  }
};

// Q4_K and Q5_K (kFifthBit): sub-block s of 32 values has scale sc[s] and min mins[s].
template <bool kFifthBit>
struct DotQ45_K {
  using Act = Q8KBlock;
  static constexpr int64_t kBytes = kFifthBit ? 176 : 144;

  template <int R>
  static void block(const uint8_t* row, const Act* const (&x)[R], int64_t b, Acc (&acc)[R],
                    float (&offset)[R]) {
    const uint8_t* p = row + kBytes * b;
    const float d = half_at(p), dmin = half_at(p + 2);
    uint8_t sc[8], mins[8];
    k_scales(p + 4, sc, mins);
    const uint8_t* qh = p + 16;
    const uint8_t* qs = p + (kFifthBit ? 48 : 16);
#ifdef CORESTREAM_QUANT_AVX2
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = load32(qs + 32 * j);
      __m256i lo = _mm256_and_si256(bytes, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      if constexpr (kFifthBit) {
        // Bit s of each qh byte, moved to bit 4 (shifts of 16-bit lanes, masked per byte).
        const __m256i high = load32(qh), one = _mm256_set1_epi8(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(
            _mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(
            _mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4));
      }
      const __m256i scale_lo = _mm256_set1_epi16(sc[2 * j]);
      const __m256i scale_hi = _mm256_set1_epi16(sc[2 * j + 1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* q8 = x[r][b].q + 64 * j;
        sums[r] = scaled_dot(sums[r], lo, load32(q8), scale_lo);
        sums[r] = scaled_dot(sums[r], hi, load32(q8 + 32), scale_hi);
      }
    }
#endif
    for (int r = 0; r < R; ++r) {
      const Act& a = x[r][b];
      int32_t min_sum = 0;
      for (int s = 0; s < 8; ++s) min_sum += mins[s] * (a.sums[2 * s] + a.sums[2 * s + 1]);
      offset[r] -= dmin * a.d * static_cast<float>(min_sum);
#ifdef CORESTREAM_QUANT_AVX2
      add_scaled(acc[r], d * a.d, sums[r]);
#else
      int32_t sum = 0;
      for (int s = 0; s < 8; ++s) {
        const uint8_t* bytes = qs + 32 * (s / 2);
        int32_t sub = 0;
        for (int l = 0; l < 32; ++l) {
          int q = (s & 1) ? bytes[l] >> 4 : bytes[l] & 15;
          if (kFifthBit) q |= ((qh[l] >> s) & 1) << 4;
          sub += q * a.q[32 * s + l];
        }
        sum += sc[s] * sub;
      }
      add_scaled(acc[r], d * a.d, sum);
#endif
    }
  }
};

struct DotQ6_K {
  using Act = Q8KBlock;
  template <int R>
  static void block(const uint8_t* row, const Act* const (&x)[R], int64_t b, Acc (&acc)[R],
                    float (&offset)[R]) {
    const uint8_t* p = row + 210 * b;
    const float d = half_at(p + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
#ifdef CORESTREAM_QUANT_AVX2
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(p + 64 * h), ql1 = load32(p + 64 * h + 32);
      const __m256i qh = load32(p + 128 + 32 * h);
      // Values 32 t + l of this half, t = 0..3, unsigned 0..63 (q + 32).
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, low4),
                          _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4)),
          _mm256_or_si256(_mm256_and_si256(ql1, low4),
                          _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(12)), 2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                          _mm256_and_si256(qh, _mm256_set1_epi8(48))),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                          _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(-64)), 2)),
      };
      for (int t = 0; t < 4; ++t) {
        // int16 lanes 0-7 hold values 0-15 of these 32, lanes 8-15 values 16-31.
        const int i = 8 * h + 2 * t;
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[i + 1]), _mm_set1_epi16(sc[i]));
        for (int r = 0; r < R; ++r) {
          sums[r] = scaled_dot(sums[r], q[t], load32(x[r][b].q + 128 * h + 32 * t), scale);
        }
      }
    }
#endif
    for (int r = 0; r < R; ++r) {
      const Act& a = x[r][b];
      int32_t shift = 0;  // the -32 of every value: 32 sum_i sc[i] sums[i]
      for (int i = 0; i < 16; ++i) shift += sc[i] * a.sums[i];
      offset[r] -= 32.0f * d * a.d * static_cast<float>(shift);
#ifdef CORESTREAM_QUANT_AVX2
      add_scaled(acc[r], d * a.d, sums[r]);
#else
      int32_t sum = 0;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = p + 64 * h;
        const uint8_t* qh = p + 128 + 32 * h;
        for (int t = 0; t < 4; ++t) {
          int32_t sub[2] = {0, 0};
          for (int l = 0; l < 32; ++l) {
            const int low = t < 2 ? ql[32 * (t & 1) + l] & 15 : ql[32 * (t & 1) + l] >> 4;
            const int q = low | (((qh[l] >> (2 * t)) & 3) << 4);
            sub[l / 16] += q * a.q[128 * h + 32 * t + l];
          }
          sum += sc[8 * h + 2 * t] * sub[0] + sc[8 * h + 2 * t + 1] * sub[1];
        }
      }
      add_scaled(acc[r], d * a.d, sum);
#endif
    }
  }
};

// out[r] = row . x[r] for R activation rows, over `blocks` blocks of Kind.
template <typename Kind, int R>
inline void dot_rows(const uint8_t* row, const typename Kind::Act* const (&x)[R],
                     int64_t blocks, float* out) {
  Acc acc[2][R];
  float offset[2][R] = {};
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = zero_acc();
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    Kind::template block<R>(row, x, b, acc[0], offset[0]);
    Kind::template block<R>(row, x, b + 1, acc[1], offset[1]);
  }
  if (b < blocks) Kind::template block<R>(row, x, b, acc[0], offset[0]);
  for (int r = 0; r < R; ++r) {
    out[r] = total(acc[0][r]) + total(acc[1][r]) + (offset[0][r] + offset[1][r]);
  }
}

// Activation rows as a QuantMatrix of `type` reads them: 8-bit blocks (Q8Block for
// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q8KBlock for the K-quants) or, for F32/F16/BF16 weights,
// floats.
//
// Each row is quantized twice: once, then what that rounding left out (at most half a
// step of the first scale) once more. One 8-bit pass alone errs by about 1e-3 of a
// layer's output; over a real model (SmolLM2-135M Q4_1, 20 prompts x 64 positions
// teacher-forced) its greedy tokens agreed with float activations' in 97.5% of positions,
// two passes in 99.9%, and the prefill, which multiplies float activations, agrees with
// decode to the same degree. A Q8Block holds both passes (the second in steps of 1/256
// of the first's), which the dot kernels sum as one 16-bit value, so the second pass costs
// one more integer dot product per block and row. A K-quant's activations take the second
// pass as a quantized row of its own (kPasses rows per row of x, neighbours in the dot
// kernels' passes so that they share each unpacked weight block): their sums per
// super-block would overflow int32 at 16 bits.
class QuantActivations {
 public:
  static constexpr int64_t kPasses = 2;

  // x [m, k], row r at x + r x_stride; T float or c10::BFloat16.
  template <typename T>
  void quantize(GgmlType type, const T* x, int64_t m, int64_t k, int64_t x_stride) {
    size(type, m, k);
    quantize_rows(x, 0, m, x_stride);
  }

  // quantize() in two steps, so that threads may share the rows: size for x [m, k] once,
  // then quantize rows [r0, r1) of it (disjoint ranges on any threads).
  void size(GgmlType type, int64_t m, int64_t k) {
    // Every member is written its final value only: a plan's late thread may redo this
    // while others already read the result (see quantize_passes).
    rows_ = m;
    cols_ = k;
    type_ = type;
    passes_ = is_k_quant(type) ? kPasses : 1;
    floats_.resize(static_cast<size_t>(m * k));
    if (is_k_quant(type)) {
      q8k_.resize(static_cast<size_t>(kPasses * m * (k / kQK)));
    } else if (!is_float(type)) {
      q8_.resize(static_cast<size_t>(m * (k / 32)));
    }
  }

  template <typename T>
  void quantize_rows(const T* x, int64_t r0, int64_t r1, int64_t x_stride) {
    const int64_t k = cols_;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < k; ++i) floats_[r * k + i] = to_float_(x[r * x_stride + i]);
    }
    if (is_float(type_)) return;
    if (is_k_quant(type_)) {
      quantize_passes(r0, r1, k, q8k_.data());
    } else {
      for (int64_t r = r0; r < r1; ++r) quantize_row(&floats_[r * k], k, &q8_[r * (k / 32)]);
    }
  }

  // Logical rows (x's); the dot products run over quantized_rows() of blocks, passes()
  // consecutive ones per row of x.
  int64_t rows() const { return rows_; }
  int64_t passes() const { return passes_; }
  int64_t quantized_rows() const { return passes_ * rows_; }
  const float* floats(int64_t r) const { return floats_.data() + r * cols_; }
  const Q8Block* blocks(int64_t q, const Q8Block*) const {
    return q8_.data() + q * (cols_ / 32);
  }
  const Q8KBlock* blocks(int64_t q, const Q8KBlock*) const {
    return q8k_.data() + q * (cols_ / kQK);
  }

 private:
  static float to_float_(float v) { return v; }
  static float to_float_(c10::BFloat16 v) { return static_cast<float>(v); }

  // NOTE: the residual lives in a buffer of the calling thread's: a decode step's plan may
  // run this item on two threads at once (work_items.h), which must then write the same
  // bits into the blocks, never meet in a scratch buffer.
  void quantize_passes(int64_t r0, int64_t r1, int64_t k, Q8KBlock* out) {
    const int64_t per_row = k / kQK;
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(k));
    for (int64_t r = r0; r < r1; ++r) {
      float* residual = scratch.data();
      std::copy_n(&floats_[r * k], k, residual);
      for (int64_t pass = 0; pass < kPasses; ++pass) {
        Q8KBlock* blocks = out + (kPasses * r + pass) * per_row;
        quantize_row(residual, k, blocks);
        if (pass + 1 == kPasses) break;
        for (int64_t b = 0; b < per_row; ++b) {
          for (int64_t l = 0; l < kQK; ++l) {
            residual[b * kQK + l] -= blocks[b].d * blocks[b].q[l];
          }
        }
      }
    }
  }

  int64_t rows_ = 0, cols_ = 0, passes_ = 1;
  GgmlType type_ = GgmlType::F32;
  std::vector<float> floats_;
  std::vector<Q8Block> q8_;
  std::vector<Q8KBlock> q8k_;
};

namespace detail {

// Quantized rows [q0, q0 + R) of x times weight row n, the passes of each x row summed
// and written once (never added into `out`: a plan may run an item on two threads at
// once, and both must write the same bits). q0 and R are multiples of x.passes(), so a
// row's passes never straddle two calls.
template <typename Kind, int R>
inline void rows_pass(const QuantMatrix& w, const QuantActivations& x, int64_t q0, int64_t n,
                      float* out, int64_t out_stride) {
  using Act = typename Kind::Act;
  const Act* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x.blocks(q0 + r, static_cast<const Act*>(nullptr));
  float sums[R];
  dot_rows<Kind, R>(w.blocks + n * w.row_bytes, rows, w.cols / format_of(w.type).values, sums);
  const int64_t passes = x.passes();
  for (int64_t r = 0; r < R; r += passes) {
    float y = sums[r];
    for (int64_t p = 1; p < passes; ++p) y += sums[r + p];
    out[(q0 + r) / passes * out_stride + n] = y;
  }
}

template <typename Kind>
void gemv_rows(const QuantMatrix& w, const QuantActivations& x, int64_t n_begin,
               int64_t n_end, float* out, int64_t out_stride) {
  const int64_t m = x.quantized_rows();
  static_assert(kRowsPerPass % QuantActivations::kPasses == 0);
  for (int64_t n = n_begin; n < n_end; ++n) {
    // The weight row streams from memory once; the other passes find it in L1.
    for (int64_t q = 0; q < m; q += kRowsPerPass) {
      switch (std::min<int64_t>(kRowsPerPass, m - q)) {
        case 1: rows_pass<Kind, 1>(w, x, q, n, out, out_stride); break;
        case 2: rows_pass<Kind, 2>(w, x, q, n, out, out_stride); break;
        case 3: rows_pass<Kind, 3>(w, x, q, n, out, out_stride); break;
        default: rows_pass<Kind, 4>(w, x, q, n, out, out_stride); break;
      }
    }
  }
}

// F32/F16/BF16 weights: each row widened to floats (in a thread's buffer) and dotted.
inline void float_gemv_rows(const QuantMatrix& w, const QuantActivations& x,
                            int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(w.cols));
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w.blocks + n * w.row_bytes;
    const float* values = reinterpret_cast<const float*>(row);
    if (w.type != GgmlType::F32) {
      dequantize_row(w.type, row, buffer.data(), w.cols);
      values = buffer.data();
    }
    for (int64_t r = 0; r < x.rows(); ++r) {
      const float* xr = x.floats(r);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < w.cols; ++k) sum += values[k] * xr[k];
      out[r * out_stride + n] = sum;
    }
  }
}

}  // namespace detail

// out[r * out_stride + n] = w.row(n) . x.row(r) for n in [n_begin, n_end) and every row
// of x (quantized for w.type), w in the file's layout (quant_groups.h takes grouped ones):
// one work item of a GEMV; items of disjoint row ranges may run on different threads.
inline void quant_gemv_rows(const QuantMatrix& w, const QuantActivations& x, int64_t n_begin,
                            int64_t n_end, float* out, int64_t out_stride) {
  switch (w.type) {
    case GgmlType::Q4_0:
      detail::gemv_rows<DotQ4Q5<false, false>>(w, x, n_begin, n_end, out, out_stride);
      break;
    case GgmlType::Q4_1:
      detail::gemv_rows<DotQ4Q5<true, false>>(w, x, n_begin, n_end, out, out_stride);
      break;
    case GgmlType::Q5_0:
      detail::gemv_rows<DotQ4Q5<false, true>>(w, x, n_begin, n_end, out, out_stride);
      break;
    case GgmlType::Q5_1:
      detail::gemv_rows<DotQ4Q5<true, true>>(w, x, n_begin, n_end, out, out_stride);
      break;
    case GgmlType::Q8_0: detail::gemv_rows<DotQ8_0>(w, x, n_begin, n_end, out, out_stride); break;
    case GgmlType::Q4_K:
      detail::gemv_rows<DotQ45_K<false>>(w, x, n_begin, n_end, out, out_stride);
      break;
    case GgmlType::Q5_K:
      detail::gemv_rows<DotQ45_K<true>>(w, x, n_begin, n_end, out, out_stride);
      break;
    case GgmlType::Q6_K: detail::gemv_rows<DotQ6_K>(w, x, n_begin, n_end, out, out_stride); break;
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      detail::float_gemv_rows(w, x, n_begin, n_end, out, out_stride);
      break;
  }
}

}  // namespace corestream_cpu::quant
