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
// Head size; sizes the kernels' per-row scratch on the stack.
constexpr int64_t kMaxHeadDim = 256;

struct DecodeShape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_seq_stride, q_head_stride, o_seq_stride, o_head_stride;
  int64_t window;  // sliding window in tokens; 0 = none
  float scale;
};

// out head h (o_head_stride apart) = acc head h (acc_stride floats apart) / running_sum[h],
// the online softmax's last step for `heads` heads of `dim` elements.
template <typename T>
inline void write_normalized(T* out, int64_t o_head_stride, const float* acc,
                             int64_t acc_stride, const float* running_sum, int64_t heads,
                             int64_t dim) {
  for (int64_t h = 0; h < heads; ++h) {
    // An empty sequence has nothing to attend to: zeros, not 0/0.
    const float inv = running_sum[h] > 0.0f ? 1.0f / running_sum[h] : 0.0f;
    T* oh = out + h * o_head_stride;
    for (int64_t d = 0; d < dim; ++d) oh[d] = static_cast<T>(acc[h * acc_stride + d] * inv);
  }
}

// out and query [rows, H, D] alike (unit stride over D, D <= kMaxHeadDim, H a multiple
// of Hkv), the caches [num_blocks, block_size, Hkv, D] contiguous and alike, all of one
// dtype, and a window >= 0 (0 = none): what both attention ops (paged_decode,
// paged_prefill) take.
void check_paged_tensors(const at::Tensor& out, const at::Tensor& query,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         int64_t window);

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
