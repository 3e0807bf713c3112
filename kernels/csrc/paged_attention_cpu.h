// The shape of one paged_decode call (paged_attention_cpu.cpp), shared with the AVX-512
// work item in paged_attention_avx512.h.
#pragma once

#include <cstdint>

namespace corestream_cpu {

// Query heads; sizes the per-head softmax state kept on the stack.
constexpr int64_t kMaxHeads = 256;

struct DecodeShape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_seq_stride, q_head_stride, o_seq_stride, o_head_stride;
  int64_t window;  // sliding window in tokens; 0 = none
  float scale;
};

}  // namespace corestream_cpu
