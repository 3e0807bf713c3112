// The cache rows of a sequence's tokens, a tile of kTile consecutive tokens at a time: the
// walk of the vector work items of paged_decode (paged_attention_avx512.h: tiles of 16,
// paged_attention_avx2.h: tiles of 8), which go by tiles rather than by blocks so that
// their vectors stay full whatever the block size.
#pragma once

#include <algorithm>
#include <cstdint>

namespace corestream_cpu {

template <int kTile>
class TileWalk {
 public:
  TileWalk(const int32_t* block_table, int64_t block_size, int64_t num_kv_heads,
           int64_t kv_begin, int64_t head_dim, int64_t first_token)
      : table_(block_table), block_size_(block_size), num_kv_heads_(num_kv_heads),
        kv_begin_(kv_begin), head_dim_(head_dim), block_(first_token / block_size),
        offset_(first_token % block_size) {}

  // rows[t], t < n: where the next n tokens' rows for kv head kv_begin start, in
  // elements. Slots from n on repeat the first row, so reading them stays in the cache.
  void next(int64_t* rows, int64_t n) {
    for (int64_t t = 0; t < n; ++t) {
      rows[t] = ((table_[block_] * block_size_ + offset_) * num_kv_heads_ + kv_begin_) *
                head_dim_;
      if (++offset_ == block_size_) {
        offset_ = 0;
        ++block_;
      }
    }
    std::fill(rows + n, rows + kTile, rows[0]);
  }

 private:
  const int32_t* table_;
  int64_t block_size_, num_kv_heads_, kv_begin_, head_dim_, block_, offset_;
};

}  // namespace corestream_cpu
