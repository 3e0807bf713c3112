// Prefill attention read straight from the block-paged KV cache, on CPU: every sequence of
// a batch with two or more query rows (whole prompts, and chunks after a cached prefix) in
// one call.
//
// Why not torch: the torch path gathers each sequence's blocks into a dense tensor and runs
// SDPA one sequence per call. At the shapes pooling and short prompts have (tens to a few
// hundred tokens, head size 64) a call's fixed costs and the gather dominate, and SDPA's
// two threads share one short sequence; measured ~60 GFLOP/s (benchmarks/pooling.py notes).
// Here the batch is one parallel region of independent items, each read from the cache in
// place.
//
// The plan is flash attention's, for a CPU:
// - An item is one sequence, one kv head and a tile of consecutive query positions: the
//   rows of the item are those positions times the kv head's group of query heads, so
//   every key and value row it loads serves the whole group. Items hold 64 to 256 rows,
//   more where the sequence's rows see more keys (kMinItemRows).
// - Keys go in tiles of kKeys, from the first any row of the item may see to the last;
//   a tile's keys and values are laid out for the arithmetic (below) once per item and
//   stay in L1 for all its rows.
// - Scores: kScoreRows rows against the tile's keys at once, their kKeys sums each in
//   registers (vectors over the key axis), the query values broadcast.
// - Causal mask and sliding window per row as a range of the tile's keys; online softmax
//   per row (running max and sum, the accumulator rescaled when the max grows), the
//   row's kKeys scores in two vector registers (`weights`).
// - Values: kValueRows rows' accumulators for a chunk of the head in registers while the
//   tile's probabilities weight the tile's value rows.
// Two arithmetics: FloatDots (fp32 whatever the cache's dtype: bf16 and float16 widened on
// load, the keys transposed per tile; the compiler's vectors, on any CPU) and, for bf16
// caches under bf16 queries on CPUs with AVX512-BF16, Bf16Dots (the CPU's bf16 pair dot
// products on the stored values, probabilities rounded to bf16 for the value products:
// twice the fp32 rate). Outputs are rounded to the query's dtype once. The cache has the
// query's dtype, or float16 under a float32 query (--kv-cache-dtype).
//
// Items are handed out by run_items, longest first, so a long prompt's last tiles do not
// start at the end of the region. Registered as corestream_cpu::paged_prefill.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "avx2_math.h"
#include "avx512_math.h"
#include "cpu_math.h"
#include "paged_attention_cpu.h"
#include "work_items.h"

namespace {

using corestream_cpu::exp_approx;
using corestream_cpu::kMaxHeadDim;
using corestream_cpu::from_float;
using corestream_cpu::to_float;
#ifdef CORESTREAM_AVX512
namespace vec = corestream_cpu::avx512;
#elif defined(CORESTREAM_AVX2)
namespace avx2 = corestream_cpu::avx2;
#endif

// Vector registers set the blocking: sixteen 512-bit ones, or sixteen 256-bit ones.
#if defined(__AVX512F__)
constexpr int kKeys = 32;       // keys per tile: two vectors of scores per row
constexpr int kScoreRows = 6;   // 12 accumulators
constexpr int kValueChunk = 64; // floats of a row's accumulator per pass: four vectors
constexpr int kValueRows = 3;   // 12 accumulators
#else
constexpr int kKeys = 16;
constexpr int kScoreRows = 5;   // 10 accumulators of 8 floats
constexpr int kValueChunk = 32;
constexpr int kValueRows = 2;   // 8 accumulators
#endif
// Query rows of an item (positions times the group): enough that each key tile's load
// serves many rows, and few enough that the diagonal (where a tile's first rows see fewer
// keys than its last) stays a small part of the item's work: an eighth of the keys its
// sequence's last row sees, within these bounds.
constexpr int64_t kMinItemRows = 64;
constexpr int64_t kMaxItemRows = 256;

struct PrefillShape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_tok_stride, q_head_stride, o_tok_stride, o_head_stride;
  int64_t window;  // sliding window in tokens; 0 = none
  float scale;
};

// One item: sequence seq, kv head kv, query rows [first, last) of its chunk.
struct Tile {
  int64_t seq, kv, first, last, cost;
};

// scores[r][j] = q[r] . kt[:, j] for kR rows; q rows dim apart, kt d-major with kKeys keys.
template <int kR, int kD>
inline void score_rows(const float* __restrict q, const float* __restrict kt,
                       float* __restrict scores, int64_t dim) {
  const int64_t d_end = kD > 0 ? kD : dim;
  float acc[kR][kKeys] = {};
  for (int64_t d = 0; d < d_end; ++d) {
    const float* __restrict k = kt + d * kKeys;
    for (int i = 0; i < kR; ++i) {
      const float qv = q[i * d_end + d];
#pragma omp simd
      for (int j = 0; j < kKeys; ++j) acc[i][j] += qv * k[j];
    }
  }
  for (int i = 0; i < kR; ++i) {
#pragma omp simd
    for (int j = 0; j < kKeys; ++j) scores[i * kKeys + j] = acc[i][j];
  }
}

// acc[r][c0:c0+kC] += sum over j < n of p[r][j] * v[j][c0:c0+kC], for kR rows.
template <int kR, int kC>
inline void weigh_rows(const float* __restrict p, const float* __restrict v,
                       float* __restrict acc, int64_t n, int64_t dim, int64_t c0) {
  float a[kR][kC];
  for (int i = 0; i < kR; ++i) {
#pragma omp simd
    for (int c = 0; c < kC; ++c) a[i][c] = acc[i * dim + c0 + c];
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict vj = v + j * dim + c0;
    for (int i = 0; i < kR; ++i) {
      const float pj = p[i * kKeys + j];
#pragma omp simd
      for (int c = 0; c < kC; ++c) a[i][c] += pj * vj[c];
    }
  }
  for (int i = 0; i < kR; ++i) {
#pragma omp simd
    for (int c = 0; c < kC; ++c) acc[i * dim + c0 + c] = a[i][c];
  }
}

// The value pass for kR rows over the whole head: in chunks of kValueChunk where the head
// size is known and a multiple of it, else of 16 with the rest one float at a time.
template <int kR, int kD>
inline void weigh_head(const float* p, const float* v, float* acc, int64_t n, int64_t dim) {
  if constexpr (kD > 0 && kD % kValueChunk == 0) {
    for (int64_t c0 = 0; c0 < kD; c0 += kValueChunk) {
      weigh_rows<kR, kValueChunk>(p, v, acc, n, kD, c0);
    }
  } else if constexpr (kD > 0 && kD < kValueChunk) {
    weigh_rows<kR, kD>(p, v, acc, n, kD, 0);
  } else {
    int64_t c0 = 0;
    for (; c0 + 16 <= dim; c0 += 16) weigh_rows<kR, 16>(p, v, acc, n, dim, c0);
    for (; c0 < dim; ++c0) weigh_rows<kR, 1>(p, v, acc, n, dim, c0);
  }
}

// The arithmetic of an item in fp32, on any CPU: query rows widened and scaled once, each
// tile's keys widened and transposed (d-major), its values widened.
template <typename T, int kD>
class FloatDots {
 public:
  static int64_t scratch_floats(int64_t rows, int64_t dim) {
    return rows * dim + 2 * dim * kKeys;
  }

  FloatDots(float* scratch, int64_t rows, int64_t dim, float scale)
      : dim_(kD > 0 ? kD : dim), scale_(scale), qf_(scratch), kt_(qf_ + rows * dim_),
        vt_(kt_ + dim_ * kKeys) {}

  void load_query(int64_t r, const T* q) {
    float* __restrict qr = qf_ + r * dim_;
#pragma omp simd
    for (int64_t d = 0; d < dim_; ++d) qr[d] = to_float(q[d]) * scale_;
  }

  template <typename C>
  void load_key(int64_t j, const C* __restrict k, const C* __restrict v) {
    for (int64_t d = 0; d < dim_; ++d) kt_[d * kKeys + j] = to_float(k[d]);
    float* __restrict vj = vt_ + j * dim_;
#pragma omp simd
    for (int64_t d = 0; d < dim_; ++d) vj[d] = to_float(v[d]);
  }

  // Key slots from n on: zeros, so their scores are finite (and masked).
  void end_tile(int64_t n) {
    for (int64_t d = 0; d < dim_ && n < kKeys; ++d) {
      std::fill(kt_ + d * kKeys + n, kt_ + (d + 1) * kKeys, 0.0f);
    }
  }

  // scores[r][:kKeys] for rows [first, rows).
  void scores(int64_t first, int64_t rows, float* scores) const {
    int64_t r = first;
    for (; r + kScoreRows <= rows; r += kScoreRows) {
      score_rows<kScoreRows, kD>(qf_ + r * dim_, kt_, scores + r * kKeys, dim_);
    }
    for (; r < rows; ++r) score_rows<1, kD>(qf_ + r * dim_, kt_, scores + r * kKeys, dim_);
  }

  // acc[r] += probs[r] . values for rows [first, rows), over the tile's first n keys.
  void weigh(int64_t first, int64_t rows, const float* probs, float* acc, int64_t n) const {
    int64_t r = first;
    for (; r + kValueRows <= rows; r += kValueRows) {
      weigh_head<kValueRows, kD>(probs + r * kKeys, vt_, acc + r * dim_, n, dim_);
    }
    for (; r < rows; ++r) weigh_head<1, kD>(probs + r * kKeys, vt_, acc + r * dim_, n, dim_);
  }

 private:
  int64_t dim_;
  float scale_;
  float* __restrict qf_;  // [rows, dim]
  float* __restrict kt_;  // [dim, kKeys]
  float* __restrict vt_;  // [kKeys, dim]
};

#ifdef CORESTREAM_AVX512_BF16

// The arithmetic of an item for bf16 on CPUs with bf16 dot products (AVX512-BF16): pairs of
// bf16 multiplied and summed into fp32 lanes, twice the fp32 rate. Query rows stay bf16 as
// stored (the scale goes on the fp32 scores); a tile's keys are copied as pairs of head
// elements, key-minor, and its values as pairs of keys, head-minor; the probabilities are
// rounded to bf16 for the values' products, as bf16 flash attention does. Head sizes that
// are multiples of 16 (kKeys is 32 here).
class Bf16Dots {
 public:
  static int64_t scratch_floats(int64_t rows, int64_t dim) {
    // Words: query pairs rows * dim / 2, key pairs dim / 2 * kKeys, staged values
    // kKeys * dim / 2, value pairs kKeys / 2 * dim, probability pairs rows * kKeys / 2.
    return rows * dim / 2 + dim / 2 * kKeys + kKeys * dim / 2 + kKeys / 2 * dim +
           rows * kKeys / 2;
  }

  Bf16Dots(float* scratch, int64_t rows, int64_t dim, float scale)
      : dim_(dim), half_(dim / 2), scale_(scale),
        qp_(reinterpret_cast<uint32_t*>(scratch)),
        kp_(qp_ + rows * half_),
        staged_(kp_ + half_ * kKeys),
        vp_(staged_ + kKeys * half_),
        pp_(vp_ + kKeys / 2 * dim) {}

  void load_query(int64_t r, const c10::BFloat16* q) { copy_row(qp_ + r * half_, q); }

  void load_key(int64_t j, const c10::BFloat16* k, const c10::BFloat16* v) {
    alignas(64) uint32_t words[kMaxHeadDim / 2];
    copy_row(words, k);
    for (int64_t p = 0; p < half_; ++p) kp_[p * kKeys + j] = words[p];
    copy_row(staged_ + j * half_, v);
  }

  // Slots from n on are zeros (the cache past a sequence's end may hold anything, NaN
  // included, and 0 * NaN is NaN); then the values' key pairs, interleaved.
  void end_tile(int64_t n) {
    for (int64_t p = 0; p < half_ && n < kKeys; ++p) {
      std::fill(kp_ + p * kKeys + n, kp_ + (p + 1) * kKeys, 0u);
    }
    std::fill(staged_ + n * half_, staged_ + kKeys * half_, 0u);
    // Lane 2i of the result: element i of a's 16, lane 2i + 1: element i of b's.
    static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46,
                                          15, 47};
    const __m512i low = _mm512_loadu_si512(kLow);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    const int64_t pairs = (n + 1) / 2;
    for (int64_t t = 0; t < pairs; ++t) {
      const uint32_t* a = staged_ + 2 * t * half_;
      const uint32_t* b = a + half_;
      uint32_t* out = vp_ + t * dim_;
      for (int64_t d = 0; d < dim_; d += 32) {
        const __mmask32 mask = vec::first_lanes32(std::min<int64_t>(32, dim_ - d));
        const __m512i va = _mm512_maskz_loadu_epi16(mask, a + d / 2);
        const __m512i vb = _mm512_maskz_loadu_epi16(mask, b + d / 2);
        _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(va, low, vb));
        if (d + 16 < dim_) {
          _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(va, high, vb));
        }
      }
    }
  }

  void scores(int64_t first, int64_t rows, float* scores) const {
    int64_t r = first;
    for (; r + kScoreRows <= rows; r += kScoreRows) score_block<kScoreRows>(r, scores);
    for (; r < rows; ++r) score_block<1>(r, scores);
  }

  void weigh(int64_t first, int64_t rows, const float* probs, float* acc, int64_t n) const {
    for (int64_t r = first; r < rows; ++r) {
      const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(probs + r * kKeys + 16),
                                                 _mm512_loadu_ps(probs + r * kKeys));
      _mm512_storeu_si512(pp_ + r * kKeys / 2, (__m512i)pairs);
    }
    const int64_t pairs = (n + 1) / 2;
    int64_t r = first;
    for (; r + kValueRows <= rows; r += kValueRows) weigh_rows<kValueRows>(r, acc, pairs);
    for (; r < rows; ++r) weigh_rows<1>(r, acc, pairs);
  }

 private:
  // A row of the head's dim_ values, in vectors: memcpy of a length known only at run
  // time is a call into libc, and these rows are short (128 bytes at head size 64), three
  // to a key: the calls were a quarter of the kernel's time at the pooling benchmark's
  // shapes.
  void copy_row(uint32_t* dst, const c10::BFloat16* src) const {
    for (int64_t d = 0; d < dim_; d += 32) {
      const __mmask32 mask = vec::first_lanes32(std::min<int64_t>(32, dim_ - d));
      _mm512_mask_storeu_epi16(dst + d / 2, mask, _mm512_maskz_loadu_epi16(mask, src + d));
    }
  }

  template <int kR>
  void score_block(int64_t r, float* scores) const {
    __m512 sum[kR][2];
    for (int i = 0; i < kR; ++i) sum[i][0] = sum[i][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < half_; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp_ + p * kKeys);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp_ + p * kKeys + 16);
      for (int i = 0; i < kR; ++i) {
        const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp_[(r + i) * half_ + p]));
        sum[i][0] = _mm512_dpbf16_ps(sum[i][0], q, k0);
        sum[i][1] = _mm512_dpbf16_ps(sum[i][1], q, k1);
      }
    }
    const __m512 scale = _mm512_set1_ps(scale_);
    for (int i = 0; i < kR; ++i) {
      _mm512_storeu_ps(scores + (r + i) * kKeys, _mm512_mul_ps(sum[i][0], scale));
      _mm512_storeu_ps(scores + (r + i) * kKeys + 16, _mm512_mul_ps(sum[i][1], scale));
    }
  }

  // acc rows [r, r + kR) += their bf16 probabilities . the values, four vectors of the
  // head at a time (then what is left: 1-3 vectors).
  template <int kR>
  void weigh_rows(int64_t r, float* acc, int64_t pairs) const {
    int64_t c0 = 0;
    for (; c0 + 64 <= dim_; c0 += 64) weigh_chunk<kR, 4>(r, acc, pairs, c0);
    switch ((dim_ - c0) / 16) {
      case 1: return weigh_chunk<kR, 1>(r, acc, pairs, c0);
      case 2: return weigh_chunk<kR, 2>(r, acc, pairs, c0);
      case 3: return weigh_chunk<kR, 3>(r, acc, pairs, c0);
      default: return;
    }
  }

  // Accumulators of kR rows times kC vectors of 16 from c0, in registers over the tile.
  template <int kR, int kC>
  void weigh_chunk(int64_t r, float* acc, int64_t pairs, int64_t c0) const {
    __m512 a[kR][kC];
    for (int i = 0; i < kR; ++i) {
      for (int c = 0; c < kC; ++c) a[i][c] = _mm512_loadu_ps(acc + (r + i) * dim_ + c0 + 16 * c);
    }
    for (int64_t t = 0; t < pairs; ++t) {
      __m512bh v[kC];
      for (int c = 0; c < kC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp_ + t * dim_ + c0 + 16 * c);
      for (int i = 0; i < kR; ++i) {
        const __m512bh p =
            (__m512bh)_mm512_set1_epi32(static_cast<int>(pp_[(r + i) * kKeys / 2 + t]));
        for (int c = 0; c < kC; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], p, v[c]);
      }
    }
    for (int i = 0; i < kR; ++i) {
      for (int c = 0; c < kC; ++c) _mm512_storeu_ps(acc + (r + i) * dim_ + c0 + 16 * c, a[i][c]);
    }
  }

  int64_t dim_, half_;
  float scale_;
  uint32_t* __restrict qp_;      // [rows, dim / 2]: query rows as pairs
  uint32_t* __restrict kp_;      // [dim / 2, kKeys]: the tile's keys as pairs of elements
  uint32_t* __restrict staged_;  // [kKeys, dim / 2]: the tile's value rows as stored
  uint32_t* __restrict vp_;      // [kKeys / 2, dim]: the values as pairs of keys
  uint32_t* __restrict pp_;      // [rows, kKeys / 2]: probabilities as pairs of keys
};
#endif  // CORESTREAM_AVX512_BF16

// A row's scores p[0:kKeys] become its weights relative to new_max, the larger of
// row_max and its largest score in [lo, hi) (lo < hi); weights outside [lo, hi) are zero,
// and tile_sum is their sum.
inline void weights(float* __restrict p, int64_t lo, int64_t hi, float row_max,
                    float& new_max, float& tile_sum) {
#ifdef CORESTREAM_AVX512
  // kKeys is two vectors here; the masked max and sum in registers, where the portable
  // loops below compile to a scalar max and a scalar sum (about a quarter of the item's
  // time at head size 64).
  static_assert(kKeys == 2 * vec::kLanes);
  const uint32_t upto = hi >= 32 ? ~uint32_t{0} : (uint32_t{1} << hi) - 1;
  const uint32_t seen = upto & ~((uint32_t{1} << lo) - 1);
  const __mmask16 m0 = static_cast<__mmask16>(seen), m1 = static_cast<__mmask16>(seen >> 16);
  const __m512 s0 = _mm512_loadu_ps(p), s1 = _mm512_loadu_ps(p + vec::kLanes);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 top = _mm512_max_ps(_mm512_mask_mov_ps(neg_inf, m0, s0),
                                   _mm512_mask_mov_ps(neg_inf, m1, s1));
  new_max = std::max(row_max, _mm512_reduce_max_ps(top));
  const __m512 shift = _mm512_set1_ps(new_max);
  const __m512 e0 = _mm512_maskz_mov_ps(m0, vec::exp(_mm512_sub_ps(s0, shift)));
  const __m512 e1 = _mm512_maskz_mov_ps(m1, vec::exp(_mm512_sub_ps(s1, shift)));
  _mm512_storeu_ps(p, e0);
  _mm512_storeu_ps(p + vec::kLanes, e1);
  tile_sum = _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
#elif defined(CORESTREAM_AVX2)
  // The same in two 8-lane vectors (kKeys is 16 here), the masks by comparing lane
  // numbers with [lo, hi).
  static_assert(kKeys == 2 * avx2::kLanes);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i first = _mm256_set1_epi32(static_cast<int>(lo) - 1);
  const __m256i end = _mm256_set1_epi32(static_cast<int>(hi));
  const __m256i lane1 = _mm256_add_epi32(lane, _mm256_set1_epi32(avx2::kLanes));
  const __m256 m0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane, first),
                                                         _mm256_cmpgt_epi32(end, lane)));
  const __m256 m1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane1, first),
                                                         _mm256_cmpgt_epi32(end, lane1)));
  const __m256 s0 = _mm256_loadu_ps(p), s1 = _mm256_loadu_ps(p + avx2::kLanes);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 top = _mm256_max_ps(_mm256_blendv_ps(neg_inf, s0, m0),
                                   _mm256_blendv_ps(neg_inf, s1, m1));
  new_max = std::max(row_max, avx2::reduce_max(top));
  const __m256 shift = _mm256_set1_ps(new_max);
  const __m256 e0 = _mm256_and_ps(m0, avx2::exp(_mm256_sub_ps(s0, shift)));
  const __m256 e1 = _mm256_and_ps(m1, avx2::exp(_mm256_sub_ps(s1, shift)));
  _mm256_storeu_ps(p, e0);
  _mm256_storeu_ps(p + avx2::kLanes, e1);
  tile_sum = avx2::reduce_add(_mm256_add_ps(e0, e1));
#else
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j < hi; ++j) tile_max = std::max(tile_max, p[j]);
  new_max = std::max(row_max, tile_max);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < kKeys; ++j) {
    const float e = exp_approx(p[j] - new_max);
    p[j] = (j >= lo && j < hi) ? e : 0.0f;
    sum += p[j];
  }
  tile_sum = sum;
#endif
}

// One item's attention. q, out: the sequence's first query token, at the item's first
// kv head's first query head. scratch: the row state, then Dots' own. T is the query's
// and output's type, C the cache's.
template <typename T, typename C, typename Dots>
void attend_tile(const PrefillShape& s, const Tile& tile, const T* q, T* out,
                 const C* __restrict key_cache, const C* __restrict value_cache,
                 const int32_t* table, int64_t seq_len, int64_t q_len, float* scratch) {
  const int64_t dim = s.head_dim;
  const int64_t group = s.group;
  const int64_t positions = tile.last - tile.first;
  const int64_t rows = positions * group;
  const int64_t prefix = seq_len - q_len;
  float* __restrict acc = scratch;                   // [rows, dim], unnormalized output
  float* __restrict probs = acc + rows * dim;        // [rows, kKeys]
  float* __restrict row_max = probs + rows * kKeys;  // [rows]
  float* __restrict row_sum = row_max + rows;        // [rows]
  Dots dots(row_sum + rows, rows, dim, s.scale);

  // Row r is position tile.first + r / group, head r % group of the kv head's group.
  for (int64_t i = 0; i < positions; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      dots.load_query(r, q + (tile.first + i) * s.q_tok_stride + g * s.q_head_stride);
      std::fill(acc + r * dim, acc + (r + 1) * dim, 0.0f);
      row_max[r] = -std::numeric_limits<float>::infinity();
      row_sum[r] = 0.0f;
    }
  }

  const int64_t token_stride = s.num_kv_heads * dim;
  const int64_t first_pos = prefix + tile.first;  // of the item's first row
  const int64_t key_end = prefix + tile.last;     // one past the last row's position
  const int64_t key_begin = s.window > 0 ? std::max<int64_t>(0, first_pos - s.window + 1) : 0;
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeys) {
    const int64_t n = std::min<int64_t>(kKeys, key_end - k0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = k0 + j;
      const int64_t row =
          (static_cast<int64_t>(table[pos / s.block_size]) * s.block_size + pos % s.block_size) *
              token_stride + tile.kv * dim;
      dots.load_key(j, key_cache + row, value_cache + row);
    }
    dots.end_tile(n);

    // Rows whose position comes before this tile see none of it: start past them.
    const int64_t first_row = std::max<int64_t>(0, k0 - first_pos) * group;
    dots.scores(first_row, rows, probs);

    for (int64_t r = first_row; r < rows; ++r) {
      // This row sees keys [lo, hi) of the tile: up to its own position, and with a window
      // only the last `window` of those.
      const int64_t pos = first_pos + r / group;
      const int64_t lo =
          s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1 - k0) : 0;
      const int64_t hi = std::min<int64_t>(n, pos + 1 - k0);
      float* __restrict p = probs + r * kKeys;
      if (hi <= lo) {
        std::fill(p, p + kKeys, 0.0f);
        continue;
      }
      float new_max, tile_sum;
      weights(p, lo, hi, row_max[r], new_max, tile_sum);
      if (new_max > row_max[r]) {
        const float shrink = std::exp(row_max[r] - new_max);
        row_sum[r] *= shrink;
        float* __restrict ar = acc + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ar[d] *= shrink;
        row_max[r] = new_max;
      }
      row_sum[r] += tile_sum;
    }

    dots.weigh(first_row, rows, probs, acc, n);
  }

  for (int64_t i = 0; i < positions; ++i) {
    T* oi = out + (tile.first + i) * s.o_tok_stride;
    corestream_cpu::write_normalized(oi, s.o_head_stride, acc + i * group * dim, dim,
                                     row_sum + i * group, group, dim);
  }
}

template <typename T, typename C, typename Dots>
void run_tiles(const PrefillShape& s, const std::vector<Tile>& tiles, const T* query, T* out,
               const C* key_cache, const C* value_cache, const int32_t* tables,
               const int32_t* seq_lens, const int32_t* starts, int64_t max_rows) {
  // The row state (accumulators, probabilities, max and sum), then the arithmetic's own.
  const int64_t floats =
      max_rows * (s.head_dim + kKeys + 2) + Dots::scratch_floats(max_rows, s.head_dim);
  corestream_cpu::run_items(static_cast<int64_t>(tiles.size()), [&](int64_t i) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
    const Tile& tile = tiles[i];
    const int64_t start = starts[tile.seq];
    const int64_t head = tile.kv * s.group;
    attend_tile<T, C, Dots>(s, tile, query + start * s.q_tok_stride + head * s.q_head_stride,
                         out + start * s.o_tok_stride + head * s.o_head_stride, key_cache,
                         value_cache, tables + tile.seq * s.max_blocks, seq_lens[tile.seq],
                         starts[tile.seq + 1] - start, scratch.data());
  });
}

template <typename T, typename C>
void dispatch(const PrefillShape& s, const std::vector<Tile>& tiles, const at::Tensor& out,
              const at::Tensor& query, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const int32_t* tables, const int32_t* lens,
              const int32_t* starts, int64_t max_rows) {
  const T* q = query.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const C* k = key_cache.const_data_ptr<C>();
  const C* v = value_cache.const_data_ptr<C>();
#ifdef CORESTREAM_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
    if (s.head_dim % 16 == 0) {
      return run_tiles<T, C, Bf16Dots>(s, tiles, q, o, k, v, tables, lens, starts, max_rows);
    }
  }
#endif
  switch (s.head_dim) {
    case 64:
      return run_tiles<T, C, FloatDots<T, 64>>(s, tiles, q, o, k, v, tables, lens, starts,
                                               max_rows);
    case 128:
      return run_tiles<T, C, FloatDots<T, 128>>(s, tiles, q, o, k, v, tables, lens, starts,
                                                max_rows);
    default:
      return run_tiles<T, C, FloatDots<T, 0>>(s, tiles, q, o, k, v, tables, lens, starts,
                                              max_rows);
  }
}

// out, query: [T, H, D] (any row strides, unit stride over D).
// key_cache, value_cache: [num_blocks, block_size, Hkv, D], contiguous.
// block_tables: [B, max_blocks] int32; seq_lens: [B] int32, cached tokens per sequence
// after this step; query_start_loc: [B + 1] int32, each sequence's query rows.
// window: attend only to the last `window` positions up to each row's own; 0 = all.
// Writes the rows of every sequence with two or more query rows; others are left as
// they are (decodes: paged_decode's).
void paged_prefill(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                   double scale, int64_t window) {
  corestream_cpu::check_paged_tensors(out, query, key_cache, value_cache, window);
  const int64_t num_seqs = seq_lens.size(0);
  corestream_cpu::check_block_tables(block_tables, seq_lens, num_seqs);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.dim() == 1 && query_start_loc.size(0) == num_seqs + 1,
              "query_start_loc must be [B + 1] int32, contiguous");

  PrefillShape s{};
  s.num_heads = query.size(1);
  s.head_dim = query.size(2);
  s.block_size = key_cache.size(1);
  s.num_kv_heads = key_cache.size(2);
  s.max_blocks = block_tables.size(1);
  s.q_tok_stride = query.stride(0);
  s.q_head_stride = query.stride(1);
  s.o_tok_stride = out.stride(0);
  s.o_head_stride = out.stride(1);
  s.scale = static_cast<float>(scale);
  s.window = window;
  s.group = s.num_heads / s.num_kv_heads;

  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0),
              "query_start_loc must run from 0 to the query's rows");
  const int64_t num_cache_blocks = key_cache.size(0);
  std::vector<Tile> tiles;
  int64_t max_rows = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = starts[seq + 1] - starts[seq];
    const int64_t seq_len = lens[seq];
    TORCH_CHECK(q_len >= 0, "query_start_loc must not decrease");
    if (q_len < 2) continue;
    TORCH_CHECK(seq_len >= q_len, "seq_lens[", seq, "] = ", seq_len, " is shorter than its ",
                q_len, " query rows");
    const int64_t used_blocks = (seq_len + s.block_size - 1) / s.block_size;
    TORCH_CHECK(used_blocks <= s.max_blocks, "seq_lens[", seq, "] = ", seq_len,
                " exceeds its block table");
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int32_t block = tables[seq * s.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_cache_blocks, "block id ", block,
                  " out of range for ", num_cache_blocks, " blocks");
    }
    const int64_t prefix = seq_len - q_len;
    const int64_t last_keys = s.window > 0 ? std::min(seq_len, s.window) : seq_len;
    const int64_t item_rows =
        std::clamp<int64_t>(last_keys * s.group / 8, kMinItemRows, kMaxItemRows);
    const int64_t positions = std::max<int64_t>(1, (item_rows + s.group - 1) / s.group);
    max_rows = std::max(max_rows, std::min(positions, q_len) * s.group);
    for (int64_t first = 0; first < q_len; first += positions) {
      const int64_t last = std::min(q_len, first + positions);
      const int64_t keys_seen = s.window > 0 ? std::min<int64_t>(prefix + last, s.window +
                                                                     last - first)
                                             : prefix + last;
      for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
        tiles.push_back({seq, kv, first, last, keys_seen * (last - first)});
      }
    }
  }
  if (tiles.empty()) return;
  // Longest first: the region ends when its last item does.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  if (query.scalar_type() == at::kFloat) {
    if (key_cache.scalar_type() == at::kHalf) {
      return dispatch<float, c10::Half>(s, tiles, out, query, key_cache, value_cache, tables,
                                        lens, starts, max_rows);
    }
    return dispatch<float, float>(s, tiles, out, query, key_cache, value_cache, tables, lens,
                                  starts, max_rows);
  }
  TORCH_CHECK(query.scalar_type() == at::kBFloat16,
              "paged_prefill supports float32 and bfloat16, not ", query.scalar_type());
  dispatch<c10::BFloat16, c10::BFloat16>(s, tiles, out, query, key_cache, value_cache, tables,
                                         lens, starts, max_rows);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corestream_cpu, m) {
  m.def(
      "paged_prefill(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "int window) -> ()");
}

TORCH_LIBRARY_IMPL(corestream_cpu, CPU, m) {
  m.impl("paged_prefill", &paged_prefill);
}
