// The AVX-512 work item of paged_decode (paged_attention_cpu.cpp, whose header comment
// tells the design): one sequence's query heads, for a range of kv heads, over its cached
// tokens in tiles of 16. Defined only under CORESTREAM_AVX512 (avx512_math.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "avx512_math.h"
#include "paged_attention_cpu.h"
#include "tile_walk.h"

#ifdef CORESTREAM_AVX512
namespace corestream_cpu::paged_avx512 {

namespace vec = corestream_cpu::avx512;

// q . k for one query head against the K rows of 16 tokens (`rows[t]` + `kv_offset`
// elements into the cache): the 16 scores in one vector. Each token's products gather in
// one vector of partial sums; the 16 vectors are then summed all at once.
template <typename T, int kChunks>
inline __m512 tile_scores(const float* __restrict q, const T* __restrict key_cache,
                          const int64_t* rows, int64_t kv_offset, __mmask16 tail) {
  __m512 qv[kChunks];
#pragma GCC unroll 16
  for (int c = 0; c < kChunks; ++c) qv[c] = _mm512_loadu_ps(q + c * vec::kLanes);
  __m512 partial[vec::kLanes];
#pragma GCC unroll 16
  for (int t = 0; t < vec::kLanes; ++t) {
    const T* k = key_cache + rows[t] + kv_offset;
    __m512 sum = _mm512_mul_ps(qv[0], vec::load(k, kChunks == 1 ? tail : 0xFFFF));
#pragma GCC unroll 16
    for (int c = 1; c < kChunks; ++c) {
      const __mmask16 mask = c == kChunks - 1 ? tail : 0xFFFF;
      sum = _mm512_fmadd_ps(qv[c], vec::load(k + c * vec::kLanes, mask), sum);
    }
    partial[t] = sum;
  }
  return vec::sum_each(partial);
}

#ifdef CORESTREAM_AVX512_BF16
// tile_scores for bf16 with the CPU's bf16 dot products: q (bf16, as stored) against the K
// rows with no conversion to fp32, two elements per lane and instruction, products and
// sums in fp32.
template <int kChunks>
inline __m512 tile_scores_bf16(const c10::BFloat16* __restrict q,
                               const c10::BFloat16* __restrict key_cache, const int64_t* rows,
                               int64_t kv_offset, int64_t dim) {
  constexpr int kPairs = (kChunks + 1) / 2;  // vectors of 32 elements
  const __mmask32 tail = vec::first_lanes32(dim - (kPairs - 1) * 2 * vec::kLanes);
  __m512bh qv[kPairs];
#pragma GCC unroll 16
  for (int c = 0; c < kPairs; ++c) {
    qv[c] = vec::load_pairs(q + c * 2 * vec::kLanes, c == kPairs - 1 ? tail : ~__mmask32{0});
  }
  __m512 partial[vec::kLanes];
#pragma GCC unroll 16
  for (int t = 0; t < vec::kLanes; ++t) {
    const c10::BFloat16* k = key_cache + rows[t] + kv_offset;
    __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < kPairs; ++c) {
      const __mmask32 mask = c == kPairs - 1 ? tail : ~__mmask32{0};
      sum = _mm512_dpbf16_ps(sum, qv[c], vec::load_pairs(k + c * 2 * vec::kLanes, mask));
    }
    partial[t] = sum;
  }
  return vec::sum_each(partial);
}
#endif

inline void prefetch(const void* begin, int64_t bytes) {
  const char* p = static_cast<const char*>(begin);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T0);
}

// acc[h] = acc[h] * shrink[h] + sum over t < n of probs[h][t] * V row t, for kHeads query
// heads of one kv head. The accumulators stay in registers across the tile's tokens and
// each V row is loaded once for all kHeads heads. acc rows are kChunks * 16 floats apart,
// probs rows 16.
//
// Token t's turn also prefetches the K and V rows of the next tile's token t, if
// t < prefetch_n: spread over the work rather than all at once, the prefetches never
// exhaust the core's fill buffers, and they arrive a tile ahead of their use. (Rows are
// prefetched rounded up to whole vectors; a prefetch past a row's end is harmless.)
template <typename T, int kChunks, int kHeads>
inline void accumulate_values(float* __restrict acc, const float* __restrict probs,
                              const float* shrink, const T* key_cache,
                              const T* __restrict value_cache, const int64_t* rows,
                              const int64_t* upcoming, int64_t prefetch_n, int64_t kv_offset,
                              int64_t n, __mmask16 tail) {
  constexpr int kPadded = kChunks * vec::kLanes;
  constexpr int64_t kRowBytes = kPadded * static_cast<int64_t>(sizeof(T));
  __m512 sum[kHeads][kChunks];
#pragma GCC unroll 16
  for (int h = 0; h < kHeads; ++h) {
    const __m512 factor = _mm512_set1_ps(shrink[h]);
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) {
      sum[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * kPadded + c * vec::kLanes), factor);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    if (t < prefetch_n) {
      prefetch(key_cache + upcoming[t] + kv_offset, kRowBytes);
      prefetch(value_cache + upcoming[t] + kv_offset, kRowBytes);
    }
    const T* v = value_cache + rows[t] + kv_offset;
    __m512 row[kChunks];
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) {
      row[c] = vec::load(v + c * vec::kLanes, c == kChunks - 1 ? tail : 0xFFFF);
    }
#pragma GCC unroll 16
    for (int h = 0; h < kHeads; ++h) {
      const __m512 p = _mm512_set1_ps(probs[h * vec::kLanes + t]);
#pragma GCC unroll 16
      for (int c = 0; c < kChunks; ++c) sum[h][c] = _mm512_fmadd_ps(p, row[c], sum[h][c]);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) {
      _mm512_storeu_ps(acc + h * kPadded + c * vec::kLanes, sum[h][c]);
    }
  }
}

using TileWalk = corestream_cpu::TileWalk<vec::kLanes>;

// The online-softmax step of one tile for `heads` heads: probs[h] holds the tile's scores
// on entry and their weights on return, relative to the new running max; shrink[h] is
// exp(old max - new max), the factor for the accumulator and sum built against the old
// max. Heads run apart from their scores so that their dependency chains overlap. Slots
// past the tile's end repeat its first token's score, so they leave the max as it is;
// their weights are zeroed.
inline void softmax_step(float* __restrict probs, int64_t heads, __mmask16 valid,
                         float* running_max, float* running_sum, float* shrink) {
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 scores = _mm512_loadu_ps(probs + h * vec::kLanes);
    const float new_max = std::max(running_max[h], _mm512_reduce_max_ps(scores));
    const __m512 p =
        _mm512_maskz_mov_ps(valid, vec::exp(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
    shrink[h] = new_max > running_max[h] ? std::exp(running_max[h] - new_max) : 1.0f;
    running_sum[h] = running_sum[h] * shrink[h] + _mm512_reduce_add_ps(p);
    running_max[h] = new_max;
    _mm512_storeu_ps(probs + h * vec::kLanes, p);
  }
}

// accumulate_values for all `heads` heads, `group` per kv head, in passes of up to four
// heads of one kv head. The first pass of each kv head prefetches its rows of the next
// tile (upcoming[t], t < upcoming_n).
template <typename T, int kChunks>
inline void accumulate_tile(float* acc, const float* probs, const float* shrink,
                            int64_t heads, int64_t group, int64_t dim, const T* key_cache,
                            const T* value_cache, const int64_t* rows, int64_t n,
                            const int64_t* upcoming, int64_t upcoming_n, __mmask16 tail) {
  // Heads whose accumulators fit in registers together.
  constexpr int kMaxPass = kChunks <= 4 ? 4 : kChunks <= 8 ? 2 : 1;
  constexpr int64_t kPadded = kChunks * vec::kLanes;
  for (int64_t h = 0; h < heads;) {
    const int64_t left = group - h % group;
    const int64_t kv_offset = h / group * dim;
    const int64_t prefetch_n = h % group == 0 ? upcoming_n : 0;
    float* acc_h = acc + h * kPadded;
    const float* probs_h = probs + h * vec::kLanes;
    if constexpr (kMaxPass >= 4) {
      if (left >= 4) {
        accumulate_values<T, kChunks, 4>(acc_h, probs_h, shrink + h, key_cache, value_cache,
                                         rows, upcoming, prefetch_n, kv_offset, n, tail);
        h += 4;
        continue;
      }
    }
    if constexpr (kMaxPass >= 2) {
      if (left >= 2) {
        accumulate_values<T, kChunks, 2>(acc_h, probs_h, shrink + h, key_cache, value_cache,
                                         rows, upcoming, prefetch_n, kv_offset, n, tail);
        h += 2;
        continue;
      }
    }
    accumulate_values<T, kChunks, 1>(acc_h, probs_h, shrink + h, key_cache, value_cache, rows,
                                     upcoming, prefetch_n, kv_offset, n, tail);
    h += 1;
  }
}

// attend_one with AVX-512, for head_dim in ((kChunks - 1) * 16, kChunks * 16]. The walk
// goes by tiles of 16 consecutive tokens rather than by blocks, so the vectors stay full
// whatever the block size. Per tile: every head's 16 scores in one vector (tile_scores),
// the online softmax on whole vectors (softmax_step), then the V rows weighted into the
// accumulators (accumulate_tile), which also prefetches the next tile. scratch holds
// heads * (2 * kChunks + 1) * 16 floats. T is the query's and output's type, C the cache's
// (T, or float16 under a float32 query).
template <typename T, typename C, int kChunks>
void attend_one_avx512(
    const DecodeShape& s,
    const T* q,
    T* out,
    const C* __restrict key_cache,
    const C* __restrict value_cache,
    const int32_t* block_table,
    const TokenSpan& span,
    int64_t kv_begin,
    int64_t kv_end,
    float* __restrict scratch) {
  constexpr int64_t kPadded = kChunks * vec::kLanes;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t heads = (kv_end - kv_begin) * group;
  const int64_t dim = s.head_dim;
  const __mmask16 tail = vec::first_lanes(dim - (kChunks - 1) * vec::kLanes);
#ifdef CORESTREAM_AVX512_BF16
  constexpr bool kBf16Dot = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>;
#else
  constexpr bool kBf16Dot = false;
#endif
  // The query as tile_scores takes it: bf16 as stored for bf16 dot products, else fp32.
  using QueryElement = std::conditional_t<kBf16Dot, T, float>;
  QueryElement* __restrict qs = reinterpret_cast<QueryElement*>(scratch);  // [heads, kPadded]
  float* __restrict acc = scratch + heads * kPadded;  // [heads, kPadded], unnormalized output
  float* __restrict probs = acc + heads * kPadded;  // [heads, 16], the tile's scores/weights
  float running_max[kMaxHeads];
  float running_sum[kMaxHeads];
  float shrink[kMaxHeads];

  for (int64_t h = 0; h < heads; ++h) {
    const T* qh = q + h * s.q_head_stride;
    if constexpr (kBf16Dot) {
      std::copy(qh, qh + dim, qs + h * kPadded);
    } else {
      for (int64_t c = 0; c < kChunks; ++c) {
        const __m512 qc = vec::load(qh + c * vec::kLanes, c == kChunks - 1 ? tail : 0xFFFF);
        _mm512_storeu_ps(qs + h * kPadded + c * vec::kLanes, qc);
      }
    }
    std::fill(acc + h * kPadded, acc + (h + 1) * kPadded, 0.0f);
    running_max[h] = -std::numeric_limits<float>::infinity();
    running_sum[h] = 0.0f;
  }

  const __m512 scale = _mm512_set1_ps(s.scale);
  const int64_t first_token = span.begin, seq_len = span.end;
  TileWalk walk(block_table, s.block_size, s.num_kv_heads, kv_begin, dim, first_token);
  int64_t rows_buffer[2][vec::kLanes];
  int64_t* rows = rows_buffer[0];
  int64_t* upcoming = rows_buffer[1];
  int64_t n = std::min<int64_t>(vec::kLanes, seq_len - first_token);
  if (n > 0) walk.next(rows, n);
  for (int64_t start = first_token; start < seq_len; start += vec::kLanes) {
    const int64_t upcoming_n =
        std::clamp<int64_t>(seq_len - start - vec::kLanes, 0, vec::kLanes);
    if (upcoming_n > 0) walk.next(upcoming, upcoming_n);
    for (int64_t h = 0; h < heads; ++h) {
      __m512 scores;
      if constexpr (kBf16Dot) {
        scores = tile_scores_bf16<kChunks>(qs + h * kPadded, key_cache, rows, h / group * dim,
                                           dim);
      } else {
        scores = tile_scores<C, kChunks>(qs + h * kPadded, key_cache, rows, h / group * dim,
                                         tail);
      }
      _mm512_storeu_ps(probs + h * vec::kLanes, _mm512_mul_ps(scores, scale));
    }
    softmax_step(probs, heads, vec::first_lanes(n), running_max, running_sum, shrink);
    accumulate_tile<C, kChunks>(acc, probs, shrink, heads, group, dim, key_cache, value_cache,
                                rows, n, upcoming, upcoming_n, tail);
    std::swap(rows, upcoming);
    n = upcoming_n;
  }

  finish_item(out, s.o_head_stride, acc, kPadded, running_max, running_sum, heads, dim,
              span.partial);
}

}  // namespace corestream_cpu::paged_avx512
#endif  // CORESTREAM_AVX512
