// GGUF's weight blocks (kernels/corestream_kernels/quant.py describes them for Python) and the 8-bit blocks
// the activations are quantized to for the integer dot products (quant_dot.h).
//
// Weight blocks, by byte offset (values per block / bytes per block):
//   Q8_0 (32/34):   d f16 | 32 int8 q                               x = d q
//   Q4_0 (32/18):   d f16 | 16 bytes: value j < 16 the low nibble of byte j, value
//                   j >= 16 the high nibble of byte j - 16         x = d (q - 8)
//   Q4_1 (32/20):   d f16 | m f16 | nibbles as Q4_0                x = d q + m
//   Q5_0 (32/22):   d f16 | qh 4 bytes: bit j the fifth bit of value j (little-endian) |
//                   nibbles as Q4_0                                x = d (q - 16)
//   Q5_1 (32/24):   d f16 | m f16 | qh | nibbles                   x = d q + m
//   Q4_K (256/144): d f16 | dmin f16 | 12 bytes of 8 six-bit scales and mins | 128 bytes:
//                   per 64 values 32 bytes, low nibbles the first 32, high the next;
//                   sub-block s of 32 values: x = d sc[s] q - dmin m[s]
//   Q5_K (256/176): as Q4_K with 32 bytes qh before the nibbles: value 32 s + l has
//                   its fifth bit in bit s of qh[l]
//   Q6_K (256/210): ql 128 | qh 64 | 16 int8 scales | d f16; per 128 values (half h),
//                   value 32 t + l has low bits from ql[64 h + 32 (t & 1) + l] (nibble
//                   t / 2) and high bits (qh[32 h + l] >> 2 t) & 3; x = d sc[i / 16] (q - 32)
//   F32, F16, BF16: one value per element.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace corestream_cpu::quant {

// GGML's type numbers, as GGUF files store them.
enum class GgmlType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
  Q6_K = 14, BF16 = 30,
};

constexpr int64_t kQK = 256;  // values per K-quant block

struct Format {
  int64_t values;  // per block
  int64_t bytes;   // per block
};

// The block format of `type`; {0, 0} for a type not served here.
constexpr Format format_of(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return {1, 4};
    case GgmlType::F16: return {1, 2};
    case GgmlType::BF16: return {1, 2};
    case GgmlType::Q8_0: return {32, 34};
    case GgmlType::Q4_0: return {32, 18};
    case GgmlType::Q4_1: return {32, 20};
    case GgmlType::Q5_0: return {32, 22};
    case GgmlType::Q5_1: return {32, 24};
    case GgmlType::Q4_K: return {kQK, 144};
    case GgmlType::Q5_K: return {kQK, 176};
    case GgmlType::Q6_K: return {kQK, 210};
  }
  return {0, 0};
}

inline bool is_k_quant(GgmlType type) {
  return type == GgmlType::Q4_K || type == GgmlType::Q5_K || type == GgmlType::Q6_K;
}

inline bool is_float(GgmlType type) {
  return type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__) || defined(__AVX2__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

inline float bf16_at(const uint8_t* p) {
  uint16_t half;
  std::memcpy(&half, p, sizeof(half));
  const uint32_t bits = uint32_t{half} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Q4_K's and Q5_K's twelve scale bytes as eight six-bit scales and eight mins.
inline void k_scales(const uint8_t* b, uint8_t (&sc)[8], uint8_t (&mins)[8]) {
  for (int s = 0; s < 4; ++s) {
    sc[s] = b[s] & 63;
    mins[s] = b[s + 4] & 63;
    sc[s + 4] = (b[s + 8] & 0x0F) | ((b[s] >> 6) << 4);
    mins[s + 4] = (b[s + 8] >> 4) | ((b[s + 4] >> 6) << 4);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// y[i] = scale q[i] + offset for 16 bytes q (unsigned, or signed if kSigned).
template <bool kSigned>
inline void affine16(__m128i q, float scale, float offset, float* y) {
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  const __m128i high = _mm_srli_si128(q, 8);
  const __m256i lo32 = kSigned ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
  const __m256i hi32 = kSigned ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high);
  _mm256_storeu_ps(y, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(lo32), o));
  _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(hi32), o));
}
#endif

// y[i] = scale q[i] + offset for n values q (bytes: unsigned, or signed if kSigned).
template <bool kSigned>
inline void affine(const uint8_t* q, int n, float scale, float offset, float* y) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int i = 0; i < n; i += 16) {
    affine16<kSigned>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)), scale, offset,
                      y + i);
  }
#else
  for (int i = 0; i < n; ++i) {
    const int v = kSigned ? static_cast<int>(static_cast<int8_t>(q[i])) : q[i];
    y[i] = scale * static_cast<float>(v) + offset;
  }
#endif
}

// A row of `k` values (whole blocks) as floats. d * sc and dmin * m are rounded to float
// first, as ggml does, but the rest is one FMA per value, so this agrees with
// kernels/corestream_kernels/quant.py's `dequantize` to a rounding, not bit for bit.
inline void dequantize_row(GgmlType type, const uint8_t* row, float* out, int64_t k) {
  const Format f = format_of(type);
  const int64_t blocks = k / f.values;
  uint8_t values[kQK];  // one block's q, unpacked to a byte each
  switch (type) {
    case GgmlType::F32:
      std::memcpy(out, row, static_cast<size_t>(k) * sizeof(float));
      return;
    case GgmlType::F16: {
      int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
      for (; i + 8 <= k; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i));
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
      }
#endif
      for (; i < k; ++i) out[i] = half_at(row + 2 * i);
      return;
    }
    case GgmlType::BF16: {
      for (int64_t i = 0; i < k; ++i) out[i] = bf16_at(row + 2 * i);
      return;
    }
    case GgmlType::Q8_0:
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = row + 34 * b;
        affine<true>(p + 2, 32, half_at(p), 0.0f, out + 32 * b);
      }
      return;
    case GgmlType::Q4_0:
    case GgmlType::Q4_1: {
      const bool q4_1 = type == GgmlType::Q4_1;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = row + f.bytes * b;
        const float d = half_at(p);
        const float m = q4_1 ? half_at(p + 2) : -8.0f * d;
        const uint8_t* qs = p + (q4_1 ? 4 : 2);
        for (int l = 0; l < 16; ++l) {
          values[l] = qs[l] & 15;
          values[l + 16] = qs[l] >> 4;
        }
        affine<false>(values, 32, d, m, out + 32 * b);
      }
      return;
    }
    case GgmlType::Q5_0:
    case GgmlType::Q5_1: {
      const bool q5_1 = type == GgmlType::Q5_1;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = row + f.bytes * b;
        const float d = half_at(p);
        const float m = q5_1 ? half_at(p + 2) : -16.0f * d;
        const uint32_t qh = u32_at(p + (q5_1 ? 4 : 2));
        const uint8_t* qs = p + (q5_1 ? 8 : 6);
        for (int l = 0; l < 16; ++l) {
          values[l] = (qs[l] & 15) | (((qh >> l) & 1) << 4);
          values[l + 16] = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        }
        affine<false>(values, 32, d, m, out + 32 * b);
      }
      return;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool q5 = type == GgmlType::Q5_K;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = row + f.bytes * b;
        const float d = half_at(p), dmin = half_at(p + 2);
        uint8_t sc[8], mins[8];
        k_scales(p + 4, sc, mins);
        const uint8_t* qh = p + 16;
        const uint8_t* qs = p + (q5 ? 48 : 16);
        for (int j = 0; j < 4; ++j) {
          for (int l = 0; l < 32; ++l) {
            values[64 * j + l] = qs[32 * j + l] & 15;
            values[64 * j + 32 + l] = qs[32 * j + l] >> 4;
          }
        }
        if (q5) {
          for (int s = 0; s < 8; ++s) {
            for (int l = 0; l < 32; ++l) values[32 * s + l] |= ((qh[l] >> s) & 1) << 4;
          }
        }
        for (int s = 0; s < 8; ++s) {
          affine<false>(values + 32 * s, 32, d * sc[s], -(dmin * mins[s]),
                        out + kQK * b + 32 * s);
        }
      }
      return;
    }
    case GgmlType::Q6_K:
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = row + 210 * b;
        const float d = half_at(p + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = p + 64 * h;
          const uint8_t* qh = p + 128 + 32 * h;
          for (int l = 0; l < 32; ++l) {
            const int base = 128 * h + l;
            values[base] = static_cast<uint8_t>((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
            values[base + 32] =
                static_cast<uint8_t>((ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            values[base + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            values[base + 96] =
                static_cast<uint8_t>((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          }
        }
        for (int i = 0; i < 16; ++i) {
          affine<true>(values + 16 * i, 16, d * static_cast<float>(sc[i]), 0.0f,
                       out + kQK * b + 16 * i);
        }
      }
      return;
  }
}

// Rows in groups: a weight whose decode GEMV computes kGroupRows output features at once,
// one per vector lane (quant_groups.h), has its rows' bytes interleaved in groups of
// kGroupRows rows, block by block. Block b of a group holds, field by field in the block's
// order, that field of every row of the group side by side: each f16 (d, m, dmin) a field
// of 2 bytes, and every other 4 bytes (the Q5 types' qh, Q4_K's scales, the payload: the
// nibbles, Q8_0's bytes) a field of its own. So one vector load takes the same four values
// of 16 (or 8) rows, and one conversion the scales of all of them. It is a permutation of
// the file's bytes, of the same size; kernels/corestream_kernels/quant.py's `group_rows` makes it, `gguf_row`
// undoes it for a row.
constexpr int64_t kGroupRows = 16;

inline bool groupable(GgmlType type) {
  return type == GgmlType::Q4_0 || type == GgmlType::Q4_1 || type == GgmlType::Q5_0 ||
         type == GgmlType::Q5_1 || type == GgmlType::Q8_0 || type == GgmlType::Q4_K ||
         type == GgmlType::Q6_K;
}

// Bytes of a block's header: f16 d, f16 m (Q4_1, Q5_1), 4 bytes qh (Q5_0, Q5_1); Q4_K's
// f16 d and dmin and 12 bytes of scales.
constexpr int64_t group_header_bytes(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_1: return 4;
    case GgmlType::Q5_0: return 6;
    case GgmlType::Q5_1: return 8;
    case GgmlType::Q4_K: return 16;
    case GgmlType::Q6_K: return 0;  // fields of 4 bytes, then d: group_field_bytes
    default: return 2;
  }
}

// The width of the field that starts at byte `offset` of a block: an f16 (d, m, dmin) 2,
// anything else (qh, Q4_K's scales, the payload's words) 4. Q6_K keeps its d last.
constexpr int64_t group_field_bytes(GgmlType type, int64_t offset) {
  if (type == GgmlType::Q6_K) return offset == 208 ? 2 : 4;
  if (offset >= group_header_bytes(type)) return 4;
  if (type == GgmlType::Q4_K) return offset < 4 ? 2 : 4;
  const bool q5 = type == GgmlType::Q5_0 || type == GgmlType::Q5_1;
  return q5 && offset + 4 == group_header_bytes(type) ? 4 : 2;
}

// A weight as its blocks: row n of `rows` (output features) starts at blocks + n
// row_bytes and holds `cols` values (input features, whole blocks); or, `grouped`, rows
// [16 g, 16 g + 16) fill bytes [16 g, 16 g + 16) row_bytes in the layout above.
struct QuantMatrix {
  const uint8_t* blocks;
  GgmlType type;
  int64_t rows;
  int64_t cols;
  int64_t row_bytes;
  bool grouped = false;
};

// Row n of w in the file's layout: in place, or, for a grouped w, gathered into scratch
// (row_bytes bytes).
inline const uint8_t* gguf_row(const QuantMatrix& w, int64_t n, uint8_t* scratch) {
  if (!w.grouped) return w.blocks + n * w.row_bytes;
  const int64_t bytes = format_of(w.type).bytes;
  const int64_t lane = n % kGroupRows;
  const uint8_t* group = w.blocks + (n - lane) * w.row_bytes;
  for (int64_t b = 0; b < w.row_bytes / bytes; ++b) {
    const uint8_t* in = group + b * kGroupRows * bytes;
    uint8_t* out = scratch + b * bytes;
    for (int64_t field = 0, width; field < bytes; field += width) {
      width = group_field_bytes(w.type, field);
      std::memcpy(out + field, in + kGroupRows * field + width * lane, width);
    }
  }
  return scratch;
}

// An activation block of 32 values for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights, to about
// 15 bits: x ~= d (q + lo / 256), q the 8-bit rounding of x / d and lo that of what it left
// out (at most half a step), in steps of d / 256. The dot kernels sum 256 q + lo in int32.
struct Q8Block {
  float d;
  float d_sum;  // d / 256 sum(256 q + lo): the block's x summed, for the weights' offsets
  int32_t sum;  // sum(256 q + lo), for offsets taken in integers (quant_groups.h's Q8_0)
  int8_t q[32];
  int8_t lo[32];
};

// An activation block of 256 values for the K-quants: x ~= d q.
struct Q8KBlock {
  float d;
  int16_t sums[16];  // of q, per 16 values
  int8_t q[kQK];
};

// The vector code below fuses x - d q as the compiler fuses the loop's (-ffp-contract=fast,
// GCC's default for C++), so that both give the same bits.
#if defined(__AVX2__) && defined(__FMA__)
#define CORESTREAM_QUANTIZE_AVX2 1
namespace vector_quantize {

// max(|x[i]|) over 32 values, NaNs skipped as std::max(amax, |x|) skips them.
inline float amax32(const float* x) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    // max_ps returns its second operand when either is NaN.
    m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + 8 * i), magnitude), m);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// The low byte of each int32 lane, sign-extended: what a cast to int8 keeps.
inline __m256i low_byte(__m256i v) { return _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24); }

// Four vectors of int32 in [-128, 127] as 32 int8, in order.
inline void store_bytes(int8_t* out, const __m256i (&v)[4]) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                            _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// q[i] = int8(lrint(x[i] * inverse)) for 32 values: cvtps rounds to nearest even as lrint
// does; into `rounded` as int32 too.
inline void round32(const float* x, float inverse, int8_t* q, __m256i (&rounded)[4]) {
  const __m256 scale = _mm256_set1_ps(inverse);
  for (int i = 0; i < 4; ++i) {
    rounded[i] = low_byte(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), scale)));
  }
  store_bytes(q, rounded);
}

inline int32_t sum_lanes(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
}

}  // namespace vector_quantize
#endif

// q = round(x / d) with d = max|x| / 127, so |q| <= 127 (the dot products' sign trick
// needs q != -128). n values; out's q has n slots. A NaN is skipped by the max and gives
// q = 0 (the low byte of lrint's result), in the vector code as in the loop.
inline float quantize_values(const float* x, int64_t n, int8_t* q) {
#ifdef CORESTREAM_QUANTIZE_AVX2
  if (n % 32 == 0) {  // the loops below in vectors, the same bits
    namespace vq = vector_quantize;
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i += 32) amax = std::max(amax, vq::amax32(x + i));
    const float d = amax / 127.0f;
    __m256i rounded[4];
    for (int64_t i = 0; i < n; i += 32) vq::round32(x + i, d > 0.0f ? 1.0f / d : 0.0f, q + i, rounded);
    return d;
  }
#endif
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    q[i] = static_cast<int8_t>(std::lrint(x[i] * inverse));
  }
  return d;
}

// d / 256 is exact; a residual of exactly half a step (256 / 2 = 128 of them) would not
// fit an int8 and is clamped to 127, an error of d / 256.
inline void quantize_row(const float* x, int64_t k, Q8Block* out) {
  for (int64_t b = 0; b < k / 32; ++b) {
    Q8Block& block = out[b];
    const float* xb = x + 32 * b;
#ifdef CORESTREAM_QUANTIZE_AVX2
    // The loop below in vectors, the same bits.
    namespace vq = vector_quantize;
    const float d = vq::amax32(xb) / 127.0f;
    __m256i q[4], lo[4];
    vq::round32(xb, d > 0.0f ? 1.0f / d : 0.0f, block.q, q);
    const __m256 step = _mm256_set1_ps(d);
    const __m256 scale = _mm256_set1_ps(d > 0.0f ? 256.0f / d : 0.0f);
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256 residual = _mm256_fnmadd_ps(step, _mm256_cvtepi32_ps(q[i]),
                                               _mm256_loadu_ps(xb + 8 * i));
      lo[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(residual, scale)),
                                                _mm256_set1_epi32(-127)),
                               _mm256_set1_epi32(127));
      sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_slli_epi32(q[i], 8), lo[i]));
    }
    vq::store_bytes(block.lo, lo);
    const int32_t total = vq::sum_lanes(sum);
#else
    const float d = quantize_values(xb, 32, block.q);
    const float inverse = d > 0.0f ? 256.0f / d : 0.0f;
    int32_t total = 0;
    for (int l = 0; l < 32; ++l) {
      const float residual = xb[l] - d * static_cast<float>(block.q[l]);
      const long lo = std::clamp(std::lrint(residual * inverse), -127L, 127L);
      block.lo[l] = static_cast<int8_t>(lo);
      total += 256 * block.q[l] + block.lo[l];
    }
#endif
    block.d = d;
    block.sum = total;
    block.d_sum = d / 256.0f * static_cast<float>(total);
  }
}

inline void quantize_row(const float* x, int64_t k, Q8KBlock* out) {
  for (int64_t b = 0; b < k / kQK; ++b) {
    Q8KBlock& block = out[b];
    block.d = quantize_values(x + kQK * b, kQK, block.q);
    for (int i = 0; i < 16; ++i) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += block.q[16 * i + l];
      block.sums[i] = static_cast<int16_t>(sum);
    }
  }
}

}  // namespace corestream_cpu::quant
