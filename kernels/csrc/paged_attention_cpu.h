// The shape of one paged_decode call (paged_attention_cpu.cpp), shared with the AVX-512
// work item in paged_attention_avx512.h, and the call's work as items.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

#include "work_items.h"

namespace corestream_cpu {

// Query heads; sizes the per-head softmax state kept on the stack.
constexpr int64_t kMaxHeads = 256;

struct DecodeShape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_seq_stride, q_head_stride, o_seq_stride, o_head_stride;
  int64_t window;  // sliding window in tokens; 0 = none
  float scale;
};

// block_tables [num_seqs, max_blocks] and seq_lens [num_seqs]: int32, contiguous, a row and
// a length per sequence, as paged_decode reads them.
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_seqs);

// paged_decode's work as items (one per sequence and kv head, or per sequence), for
// callers that hand them out themselves (StagePlan); the tensors must outlive the items.
std::pair<int64_t, Item> paged_decode_items(const at::Tensor& out, const at::Tensor& query,
                                            const at::Tensor& key_cache,
                                            const at::Tensor& value_cache,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double scale,
                                            int64_t window);

}  // namespace corestream_cpu
