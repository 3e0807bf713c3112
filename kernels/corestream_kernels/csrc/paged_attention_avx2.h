// The AVX2 work item of paged_decode (paged_attention_cpu.cpp, whose header comment tells
// the design), for CPUs with AVX2 and FMA but no AVX-512 (Zen 3, Haswell to Ice Lake
// clients): the AVX-512 item's plan (paged_attention_avx512.h) in 8-lane vectors. One
// sequence's query heads, for a range of kv heads, over its cached tokens in tiles of 8:
// each head's 8 scores in one vector, the online softmax on whole vectors, the V rows
// weighted into accumulators held in registers. bf16 rows are widened to fp32 in
// registers (one shift: bf16 is the top half of an fp32). Head sizes are multiples of 8;
// others take the portable code. Defined only under CORESTREAM_AVX2 (avx2_math.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "avx2_math.h"
#include "paged_attention_cpu.h"
#include "tile_walk.h"

#ifdef CORESTREAM_AVX2
namespace corestream_cpu::paged_avx2 {

constexpr int kTile = 8;
// Accumulator chunks (8 floats each) per pass over a tile: at most 8 of the 16 registers,
// in passes of equal size.
constexpr int group_of(int chunks) {
  int group = chunks < 8 ? chunks : 8;
  while (chunks % group != 0) --group;
  return group;
}

// {sum(v[0]), ..., sum(v[7])}: pairwise adds within 128-bit lanes, then the halves.
inline __m256 sum_each(const __m256 (&v)[kTile]) {
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // ab's low half holds lanes 0-3 of v[0..3], its high half lanes 4-7; cd likewise.
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

using avx2::exp;
using avx2::load;
using avx2::reduce_add;
using avx2::reduce_max;

// q . k for one query head (fp32, kChunks * 8 elements) against the K rows of 8 tokens:
// the 8 scores in one vector.
template <typename T, int kChunks>
inline __m256 tile_scores(const float* __restrict q, const T* __restrict key_cache,
                          const int64_t* rows, int64_t kv_offset) {
  __m256 partial[kTile];
#pragma GCC unroll 8
  for (int t = 0; t < kTile; ++t) {
    const T* k = key_cache + rows[t] + kv_offset;
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(q), load(k));
#pragma GCC unroll 32
    for (int c = 1; c < kChunks; ++c) {
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), load(k + 8 * c), sum);
    }
    partial[t] = sum;
  }
  return sum_each(partial);
}

inline void prefetch_row(const void* begin, int64_t bytes) {
  const char* p = static_cast<const char*>(begin);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T0);
}

// acc[:kGroup * 8] = acc * shrink + sum over t < n of probs[t] * V row t [c0 :], one query
// head (of kv head at kv_offset), its accumulators in registers across the tile. Token t's turn also prefetches the
// next tile's token t (K and V rows of `row_bytes`) if t < prefetch_n: spread over the
// work, the prefetches arrive a tile ahead without exhausting the fill buffers.
template <typename T, int kGroup>
inline void accumulate_values(float* __restrict acc, const float* __restrict probs,
                              float shrink, const T* key_cache,
                              const T* __restrict value_cache, const int64_t* rows,
                              const int64_t* upcoming, int64_t prefetch_n, int64_t kv_offset,
                              int64_t c0, int64_t row_bytes, int64_t n) {
  __m256 sum[kGroup];
  const __m256 factor = _mm256_set1_ps(shrink);
#pragma GCC unroll 8
  for (int c = 0; c < kGroup; ++c) sum[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), factor);
  for (int64_t t = 0; t < n; ++t) {
    if (t < prefetch_n) {
      prefetch_row(key_cache + upcoming[t] + kv_offset, row_bytes);
      prefetch_row(value_cache + upcoming[t] + kv_offset, row_bytes);
    }
    const T* v = value_cache + rows[t] + kv_offset + c0;
    const __m256 p = _mm256_set1_ps(probs[t]);
#pragma GCC unroll 8
    for (int c = 0; c < kGroup; ++c) sum[c] = _mm256_fmadd_ps(p, load(v + 8 * c), sum[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < kGroup; ++c) _mm256_storeu_ps(acc + 8 * c, sum[c]);
}

// attend_one with AVX2, for head_dim == kChunks * 8; scratch holds
// heads * (2 * kChunks + 1) * 8 floats. T is the query's and output's type, C the cache's.
template <typename T, typename C, int kChunks>
void attend_one_avx2(
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
  constexpr int64_t kDim = kChunks * 8;
  constexpr int kGroup = group_of(kChunks);
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t heads = (kv_end - kv_begin) * group;
  float* __restrict qs = scratch;                // [heads, kDim], fp32
  float* __restrict acc = qs + heads * kDim;     // [heads, kDim], unnormalized output
  float* __restrict probs = acc + heads * kDim;  // [heads, 8], the tile's scores/weights
  float running_max[kMaxHeads];
  float running_sum[kMaxHeads];

  for (int64_t h = 0; h < heads; ++h) {
    const T* qh = q + h * s.q_head_stride;
    for (int c = 0; c < kChunks; ++c) _mm256_storeu_ps(qs + h * kDim + 8 * c, load(qh + 8 * c));
    std::fill(acc + h * kDim, acc + (h + 1) * kDim, 0.0f);
    running_max[h] = -std::numeric_limits<float>::infinity();
    running_sum[h] = 0.0f;
  }

  const __m256 scale = _mm256_set1_ps(s.scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t first_token = span.begin, seq_len = span.end;
  TileWalk<kTile> walk(block_table, s.block_size, s.num_kv_heads, kv_begin, kDim, first_token);
  int64_t rows_buffer[2][kTile];
  int64_t* rows = rows_buffer[0];
  int64_t* upcoming = rows_buffer[1];
  int64_t n = std::min<int64_t>(kTile, seq_len - first_token);
  if (n > 0) walk.next(rows, n);
  for (int64_t start = first_token; start < seq_len; start += kTile) {
    const int64_t upcoming_n = std::clamp<int64_t>(seq_len - start - kTile, 0, kTile);
    if (upcoming_n > 0) walk.next(upcoming, upcoming_n);
    // Slots past the tile's end repeat its first token: their scores leave the max as it
    // is, and their weights are zeroed.
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    for (int64_t h = 0; h < heads; ++h) {
      const __m256 scores = _mm256_mul_ps(
          tile_scores<C, kChunks>(qs + h * kDim, key_cache, rows, h / group * kDim), scale);
      const float new_max = std::max(running_max[h], reduce_max(scores));
      const __m256 p =
          _mm256_and_ps(valid, exp(_mm256_sub_ps(scores, _mm256_set1_ps(new_max))));
      const float shrink = new_max > running_max[h] ? std::exp(running_max[h] - new_max) : 1.0f;
      running_sum[h] = running_sum[h] * shrink + reduce_add(p);
      running_max[h] = new_max;
      _mm256_storeu_ps(probs + h * kTile, p);
      // The first query head of each kv head prefetches that kv head's next tile.
      const bool first = h % group == 0;
      for (int64_t c0 = 0; c0 < kDim; c0 += 8 * kGroup) {
        accumulate_values<C, kGroup>(acc + h * kDim + c0, probs + h * kTile, shrink, key_cache,
                                     value_cache, rows, upcoming,
                                     first && c0 == 0 ? upcoming_n : 0, h / group * kDim, c0,
                                     kDim * static_cast<int64_t>(sizeof(C)), n);
      }
    }
    std::swap(rows, upcoming);
    n = upcoming_n;
  }

  finish_item(out, s.o_head_stride, acc, kDim, running_max, running_sum, heads, kDim,
              span.partial);
}

}  // namespace corestream_cpu::paged_avx2
#endif  // CORESTREAM_AVX2
