// The shape of one paged_decode call (paged_attention_cpu.cpp), shared with the AVX-512
// work item in paged_attention_avx512.h, and the call's work as items.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

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

// A decode work item's share of one sequence: the cached tokens [begin, end) (the window
// already applied), and, where the sequence's tokens are split over several items, where
// the item's unnormalized result goes for merge_chunks (null: the item has all of them and
// writes the output itself). `partial` holds, per query head of the item, dim + 2 floats
// partial_stride(dim) apart: the accumulator, then the running max and sum.
struct TokenSpan {
  int64_t begin, end;
  float* partial;
};

inline int64_t partial_stride(int64_t dim) { return dim + 2; }

// The end of a work item: its heads' output, or its partial result (see TokenSpan).
template <typename T>
inline void finish_item(T* out, int64_t o_head_stride, const float* acc, int64_t acc_stride,
                        const float* running_max, const float* running_sum, int64_t heads,
                        int64_t dim, float* partial) {
  if (partial == nullptr) {
    write_normalized(out, o_head_stride, acc, acc_stride, running_sum, heads, dim);
    return;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* p = partial + h * partial_stride(dim);
    std::copy(acc + h * acc_stride, acc + h * acc_stride + dim, p);
    p[dim] = running_max[h];
    p[dim + 1] = running_sum[h];
  }
}

// One sequence's output from its `chunks` partial results (chunk c's for head h at
// partials + (c heads + h) partial_stride(dim)): each rescaled to the largest running max,
// as the online softmax rescales its accumulator from tile to tile.
template <typename T>
inline void merge_chunks(T* out, int64_t o_head_stride, const float* partials, int64_t chunks,
                         int64_t heads, int64_t dim) {
  const int64_t stride = partial_stride(dim);
  for (int64_t h = 0; h < heads; ++h) {
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) {
      max = std::max(max, partials[(c * heads + h) * stride + dim]);
    }
    float acc[kMaxHeadDim] = {};
    float sum = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = partials + (c * heads + h) * stride;
      if (p[dim + 1] == 0.0f) continue;  // no tokens (or none of weight): nothing to add
      const float factor = std::exp(p[dim] - max);
      sum += p[dim + 1] * factor;
      for (int64_t d = 0; d < dim; ++d) acc[d] += p[d] * factor;
    }
    write_normalized(out + h * o_head_stride, o_head_stride, acc, dim, &sum, 1, dim);
  }
}

// out and query [rows, H, D] alike (unit stride over D, D <= kMaxHeadDim, H a multiple
// of Hkv), the caches [num_blocks, block_size, Hkv, D] contiguous and alike, of the
// query's dtype or cache_type_served's float16 under float32, and a window >= 0 (0 =
// none): what both attention ops (paged_decode, paged_prefill) take.
void check_paged_tensors(const at::Tensor& out, const at::Tensor& query,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         int64_t window);

// block_tables [num_seqs, max_blocks] and seq_lens [num_seqs]: int32, contiguous, a row and
// a length per sequence, as paged_decode reads them.
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_seqs);

// paged_decode's work as stages of items, to run in order, (number of items, item) each:
// the items (per sequence, per sequence and kv head, or per chunk of a kv head's tokens),
// then, for chunks, their merge per sequence. For callers that hand them out themselves
// (StagePlan); the tensors must outlive the items.
std::vector<std::pair<int64_t, Item>> paged_decode_items(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    double scale, int64_t window);

}  // namespace corestream_cpu
