// Decode attention read straight from the block-paged KV cache, on CPU.
//
// Built on first use by kernels/corestream_kernels/cpu_extension.py (torch.utils.cpp_extension), with
// -O3 -march=native -fopenmp. Two implementations of one work item:
// - attend_one_avx512 (paged_attention_avx512.h), where the build targets AVX-512 (F,
//   BW, VL): tiles of 16 tokens, each query head's 16 scores summed in one go
//   (avx512_math.h), bf16 scores by the CPU's bf16 dot products where it has them, the
//   next tile prefetched while this one runs. (A dot product per (token, head) that ends
//   in its own horizontal sum, a serial chain of shuffles and adds per score, held the
//   portable code to about half the memory bandwidth: benchmarks/decode_attention.py.)
// - attend_one_avx2 (paged_attention_avx2.h), where the build targets AVX2 and FMA but not
//   AVX-512: the same plan in 8-lane vectors and tiles of 8 tokens, bf16 widened in
//   registers.
// - attend_one, portable: plain `omp simd` loops that the compiler vectorizes for the
//   build machine, common head sizes compile-time constants so those loops unroll fully.
//   It serves other machines, and head sizes the AVX-512 code has no instance for.
//
// One work item is one sequence (or, in small batches, one (sequence, kv head), and with
// too few of those to share out evenly, a chunk of a (sequence, kv head)'s tokens, whose
// unnormalized results a second stage merges): each GQA group of query heads shares every
// K and V row it loads, so each cached token is read from memory exactly once, and in
// address order within a block. Within an item the softmax is streamed block by block or
// tile by tile (running max, running sum, rescaled accumulator), so nothing is gathered
// and the scratch space does not grow with the context. Sequences differ in length, so
// items are handed out dynamically to torch's intra-op threads rather than in fixed
// contiguous ranges.
//
// The cache has the query's dtype, or float16 under a float32 query (--kv-cache-dtype:
// widened in registers as it is read, F16C's conversion; the arithmetic stays fp32).
//
// With a sliding window W the query (at position seq_len - 1) sees only the last W
// cached tokens: the walk starts at position seq_len - W, inside its block, so a long
// context costs no more than W tokens.
//
// Registered as the torch op corestream_cpu::paged_decode; the light headers (no
// torch/extension.h, no pybind11) keep the first-use build short.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_math.h"
#include "paged_attention_avx2.h"
#include "paged_attention_avx512.h"
#include "paged_attention_cpu.h"
#include "work_items.h"

namespace {

// Partial sums per dot product: two AVX-512 registers' worth, four AVX2 ones.
constexpr int64_t kLanes = 32;

using corestream_cpu::DecodeShape;
using corestream_cpu::exp_approx;
using corestream_cpu::kMaxHeads;
using corestream_cpu::to_float;
using corestream_cpu::TokenSpan;
#ifdef CORESTREAM_AVX512
using corestream_cpu::paged_avx512::attend_one_avx512;
namespace vec = corestream_cpu::avx512;
#endif

// q . k over dim elements. With dim known at compile time the sum is kept in kLanes
// independent partial sums: one running sum would make every multiply-add wait on the
// previous one.
template <typename T, int kDim>
inline float dot_product(const float* __restrict q, const T* __restrict k, int64_t dim) {
  if constexpr (kDim > 0 && kDim % kLanes == 0) {
    float partial[kLanes] = {};
    for (int64_t d0 = 0; d0 < kDim; d0 += kLanes) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) partial[l] += q[d0 + l] * to_float(k[d0 + l]);
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
    return sum;
  } else {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < dim; ++d) sum += q[d] * to_float(k[d]);
    return sum;
  }
}

// acc[:dim] += sum over t < n of p[t] * rows[t * stride :][:dim]. With dim known at
// compile time the accumulator lives in registers for the whole loop instead of going
// through memory once per row.
template <typename T, int kDim>
inline void accumulate_rows(float* __restrict acc, const float* __restrict p,
                            const T* __restrict rows, int64_t n, int64_t stride, int64_t dim) {
  if constexpr (kDim > 0) {
    float local[kDim];
#pragma omp simd
    for (int64_t d = 0; d < kDim; ++d) local[d] = acc[d];
    for (int64_t t = 0; t < n; ++t) {
      const T* row = rows + t * stride;
      const float pt = p[t];
#pragma omp simd
      for (int64_t d = 0; d < kDim; ++d) local[d] += pt * to_float(row[d]);
    }
#pragma omp simd
    for (int64_t d = 0; d < kDim; ++d) acc[d] = local[d];
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const T* row = rows + t * stride;
      const float pt = p[t];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[d] += pt * to_float(row[d]);
    }
  }
}

// Attention of one sequence's query heads for kv heads [kv_begin, kv_end) over its cached
// tokens. q, out: the first of those query heads, rows q_head_stride / o_head_stride
// apart. scratch holds heads * (2 * head_dim + block_size) floats, heads being
// (kv_end - kv_begin) * group. kDim is head_dim when fixed at compile time, else 0. T is
// the query's and output's type, C the cache's.
template <typename T, typename C, int kDim>
void attend_one(
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
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t heads = (kv_end - kv_begin) * group;
  const int64_t dim = kDim > 0 ? kDim : s.head_dim;
  const int64_t bs = s.block_size;
  float* __restrict qf = scratch;                // [heads, dim], pre-scaled
  float* __restrict acc = qf + heads * dim;      // [heads, dim], unnormalized output
  float* __restrict scores = acc + heads * dim;  // [heads, block_size]
  float running_max[kMaxHeads];
  float running_sum[kMaxHeads];

  for (int64_t h = 0; h < heads; ++h) {
    const T* qh = q + h * s.q_head_stride;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] = to_float(qh[d]) * s.scale;
    std::fill(acc + h * dim, acc + (h + 1) * dim, 0.0f);
    running_max[h] = -std::numeric_limits<float>::infinity();
    running_sum[h] = 0.0f;
  }

  // A block is [block_size, num_kv_heads, head_dim]; this item reads its kv heads' rows.
  const int64_t token_stride = s.num_kv_heads * dim;
  const int64_t first_token = span.begin, seq_len = span.end;
  const int64_t num_blocks = (seq_len + bs - 1) / bs;
  for (int64_t b = first_token / bs; b < num_blocks; ++b) {
    const int64_t block = block_table[b];
    // This block's visible tokens are [skip, skip + n) of its rows.
    const int64_t skip = std::max<int64_t>(0, first_token - b * bs);
    const int64_t n = std::min(bs, seq_len - b * bs) - skip;
    const int64_t base = ((block * bs + skip) * s.num_kv_heads + kv_begin) * dim;
    const C* __restrict k = key_cache + base;
    const C* __restrict v = value_cache + base;

    // Tokens outer: each K row is loaded once and dotted with its whole query group.
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t kv = 0, h = 0; kv < kv_end - kv_begin; ++kv) {
        const C* kt = k + t * token_stride + kv * dim;
        for (int64_t g = 0; g < group; ++g, ++h) {
          scores[h * bs + t] = dot_product<C, kDim>(qf + h * dim, kt, dim);
        }
      }
    }

    // Scores become probabilities relative to the new running max; the accumulator
    // and sum, built against the old max, shrink by exp(old - new).
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = scores + h * bs;
      float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sh[t]);
      const float new_max = std::max(running_max[h], block_max);
      float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = 0; t < n; ++t) {
        sh[t] = exp_approx(sh[t] - new_max);
        block_sum += sh[t];
      }
      if (new_max > running_max[h]) {
        const float shrink = std::exp(running_max[h] - new_max);
        running_sum[h] *= shrink;
        float* ah = acc + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ah[d] *= shrink;
        running_max[h] = new_max;
      }
      running_sum[h] += block_sum;
    }

    // Heads outer: a head's accumulator stays in registers across the block's tokens,
    // and the V rows it reads (one block's worth) are still in L1 for the next head.
    for (int64_t h = 0; h < heads; ++h) {
      accumulate_rows<C, kDim>(acc + h * dim, scores + h * bs, v + h / group * dim, n,
                               token_stride, dim);
    }
  }

  corestream_cpu::finish_item(out, s.o_head_stride, acc, dim, running_max, running_sum, heads,
                              dim, span.partial);
}


using Stages = std::vector<std::pair<int64_t, corestream_cpu::Item>>;

// Token chunks per (sequence, kv head) item: one where the items alone keep the threads
// busy; else enough for the items to split evenly over the threads, two or more each, so
// that no thread waits long for another's last item (one sequence with three kv heads on
// two threads: two chunks, six items).
int64_t token_chunks(int64_t items, int64_t threads) {
  if (threads <= 1 || items >= 4 * threads) {
    return 1;
  }
  constexpr int64_t kMaxChunks = 16;
  for (int64_t chunks = 1; chunks < kMaxChunks; ++chunks) {
    if (items * chunks >= 2 * threads && items * chunks % threads == 0) {
      return chunks;
    }
  }
  return kMaxChunks;
}

// kAttend is attend_one, attend_one_avx512 or attend_one_avx2, instantiated for T and C;
// each item gets scratch_per_head floats per query head of the item. Returns the stages:
// the items, then, where a sequence's tokens are split over items, the merge per sequence.
template <typename T, typename C, auto kAttend>
Stages decode_items_of(
    const DecodeShape& s,
    const T* query,
    T* out,
    const C* key_cache,
    const C* value_cache,
    const int32_t* block_tables,
    const int32_t* seq_lens,
    int64_t num_cache_blocks,
    int64_t scratch_per_head) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t threads = at::get_num_threads();
  // Whole sequences read each block front to back; with too few sequences to keep every
  // thread busy, each kv head becomes its own item instead, and with too few of those,
  // each chunk of a kv head's tokens (flash-decoding's split).
  const int64_t kv_per_item = s.num_seqs >= 4 * threads ? s.num_kv_heads : 1;
  const int64_t kv_items = s.num_kv_heads / kv_per_item;
  const int64_t chunks = kv_per_item == 1 ? token_chunks(s.num_seqs * kv_items, threads) : 1;
  const int64_t items_per_seq = kv_items * chunks;
  const int64_t scratch_floats = kv_per_item * group * scratch_per_head;
  const int64_t stride = corestream_cpu::partial_stride(s.head_dim);
  const int64_t seq_partials = chunks * s.num_heads * stride;
  // The chunks' results, kept by the items for as long as a plan keeps them.
  const auto partials = chunks > 1 ? std::make_shared<std::vector<float>>(
                                         static_cast<size_t>(s.num_seqs * seq_partials))
                                   : nullptr;
  auto item = [=](int64_t item) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < scratch_floats) {
      scratch.resize(scratch_floats);
    }
    const int64_t seq = item / items_per_seq;
    const int64_t kv_begin = item % items_per_seq / chunks * kv_per_item;
    const int64_t chunk = item % chunks;
    const int64_t seq_len = seq_lens[seq];
    const int32_t* table = block_tables + seq * s.max_blocks;
    const int64_t used_blocks = (seq_len + s.block_size - 1) / s.block_size;
    TORCH_CHECK(seq_len >= 0 && used_blocks <= s.max_blocks,
                "seq_lens[", seq, "] = ", seq_len, " exceeds its block table");
    for (int64_t b = 0; b < used_blocks; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_cache_blocks,
                  "block id ", table[b], " out of range for ", num_cache_blocks, " blocks");
    }
    const int64_t head = kv_begin * group;
    // With a sliding window W the query (at position seq_len - 1) sees the last W tokens.
    const int64_t first = s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
    TokenSpan span{first, seq_len, nullptr};
    if (chunks > 1) {
      // Chunk boundaries on whole tiles of the vector items' walk (16 tokens, 8 for AVX2).
      constexpr int64_t kTile = 16;
      const int64_t visible = seq_len - first;
      span.begin = first + visible * chunk / chunks / kTile * kTile;
      span.end = chunk + 1 == chunks ? seq_len
                                     : first + visible * (chunk + 1) / chunks / kTile * kTile;
      span.partial = partials->data() + seq * seq_partials + (chunk * s.num_heads + head) * stride;
    }
    kAttend(
        s,
        query + seq * s.q_seq_stride + head * s.q_head_stride,
        out + seq * s.o_seq_stride + head * s.o_head_stride,
        key_cache,
        value_cache,
        table,
        span,
        kv_begin,
        kv_begin + kv_per_item,
        scratch.data());
  };
  Stages stages{{s.num_seqs * items_per_seq, item}};
  if (chunks > 1) {
    stages.emplace_back(s.num_seqs, [=](int64_t seq) {
      corestream_cpu::merge_chunks(out + seq * s.o_seq_stride, s.o_head_stride,
                                   partials->data() + seq * seq_partials, chunks, s.num_heads,
                                   s.head_dim);
    });
  }
  return stages;
}

template <typename T, typename C>
Stages decode_dispatch(
    const DecodeShape& s, const at::Tensor& out, const at::Tensor& query,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const int32_t* tables,
    const int32_t* lens) {
  const T* q = query.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const C* k = key_cache.const_data_ptr<C>();
  const C* v = value_cache.const_data_ptr<C>();
  const int64_t blocks = key_cache.size(0);
#ifdef CORESTREAM_AVX512
  // Head sizes up to 128 in steps of 16, and 256; others take the portable code.
  const int64_t chunks = (s.head_dim + vec::kLanes - 1) / vec::kLanes;
  const int64_t avx512_scratch = (2 * chunks + 1) * vec::kLanes;
  auto avx512 = [&](auto chunk_count) {
    constexpr int kChunks = decltype(chunk_count)::value;
    return decode_items_of<T, C, attend_one_avx512<T, C, kChunks>>(s, q, o, k, v, tables, lens,
                                                                   blocks, avx512_scratch);
  };
  using std::integral_constant;
  switch (chunks) {
    case 1: return avx512(integral_constant<int, 1>{});
    case 2: return avx512(integral_constant<int, 2>{});
    case 3: return avx512(integral_constant<int, 3>{});
    case 4: return avx512(integral_constant<int, 4>{});
    case 5: return avx512(integral_constant<int, 5>{});
    case 6: return avx512(integral_constant<int, 6>{});
    case 8: return avx512(integral_constant<int, 8>{});
    case 16: return avx512(integral_constant<int, 16>{});
    default: break;
  }
#elif defined(CORESTREAM_AVX2)
  // Head sizes 32, 64, 80, 96, 128 and 256; others take the portable code.
  auto avx2 = [&](auto chunk_count) {
    constexpr int kChunks = decltype(chunk_count)::value;
    return decode_items_of<T, C, corestream_cpu::paged_avx2::attend_one_avx2<T, C, kChunks>>(
        s, q, o, k, v, tables, lens, blocks, (2 * kChunks + 1) * 8);
  };
  using std::integral_constant;
  switch (s.head_dim) {
    case 32: return avx2(integral_constant<int, 4>{});
    case 64: return avx2(integral_constant<int, 8>{});
    case 80: return avx2(integral_constant<int, 10>{});
    case 96: return avx2(integral_constant<int, 12>{});
    case 128: return avx2(integral_constant<int, 16>{});
    case 256: return avx2(integral_constant<int, 32>{});
    default: break;
  }
#endif
  const int64_t scratch = 2 * s.head_dim + s.block_size;
  switch (s.head_dim) {
    case 64:
      return decode_items_of<T, C, attend_one<T, C, 64>>(s, q, o, k, v, tables, lens, blocks,
                                                         scratch);
    case 128:
      return decode_items_of<T, C, attend_one<T, C, 128>>(s, q, o, k, v, tables, lens, blocks,
                                                          scratch);
    default:
      return decode_items_of<T, C, attend_one<T, C, 0>>(s, q, o, k, v, tables, lens, blocks,
                                                        scratch);
  }
}

}  // namespace

namespace corestream_cpu {

void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_seqs) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables must be contiguous");
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs,
              "one block table row and one length per sequence");
}

void check_paged_tensors(const at::Tensor& out, const at::Tensor& query,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         int64_t window) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [rows, H, D], cache 4-D");
  TORCH_CHECK(out.sizes() == query.sizes(), "out must match query");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "cache must be contiguous");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "out must have the query's dtype and the caches one dtype");
  TORCH_CHECK(corestream_cpu::cache_type_served(query.scalar_type(), key_cache.scalar_type()),
              "the caches must have the query's dtype (or float16 under a float32 query), not ",
              key_cache.scalar_type(), " under ", query.scalar_type());
  TORCH_CHECK(key_cache.size(3) == query.size(2), "cache head_dim differs from query's");
  TORCH_CHECK(query.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  TORCH_CHECK(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0,
              "heads must be a multiple of kv heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 = no window), got ", window);
}

std::vector<std::pair<int64_t, Item>> paged_decode_items(
    const at::Tensor& out,
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    double scale,
    int64_t window) {
  check_paged_tensors(out, query, key_cache, value_cache, window);
  check_block_tables(block_tables, seq_lens, query.size(0));

  DecodeShape s{};
  s.num_seqs = query.size(0);
  s.num_heads = query.size(1);
  s.head_dim = query.size(2);
  s.block_size = key_cache.size(1);
  s.num_kv_heads = key_cache.size(2);
  s.max_blocks = block_tables.size(1);
  s.q_seq_stride = query.stride(0);
  s.q_head_stride = query.stride(1);
  s.o_seq_stride = out.stride(0);
  s.o_head_stride = out.stride(1);
  s.scale = static_cast<float>(scale);
  TORCH_CHECK(s.num_heads <= kMaxHeads, "more than ", kMaxHeads, " query heads");
  s.window = window;
  if (s.num_seqs == 0) {
    return {};
  }
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  if (query.scalar_type() == at::kFloat) {
    if (key_cache.scalar_type() == at::kHalf) {
      return decode_dispatch<float, c10::Half>(s, out, query, key_cache, value_cache, tables,
                                               lens);
    }
    return decode_dispatch<float, float>(s, out, query, key_cache, value_cache, tables, lens);
  }
  TORCH_CHECK(query.scalar_type() == at::kBFloat16,
              "paged_decode supports float32 and bfloat16, not ", query.scalar_type());
  return decode_dispatch<c10::BFloat16, c10::BFloat16>(s, out, query, key_cache, value_cache,
                                                       tables, lens);
}

}  // namespace corestream_cpu

namespace {

// out, query: [B, H, D] (any row strides, unit stride over D).
// key_cache, value_cache: [num_blocks, block_size, Hkv, D], contiguous.
// block_tables: [B, max_blocks] int32, contiguous; seq_lens: [B] int32.
// window: attend only to the last `window` cached tokens; 0 = all of them.
void paged_decode(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, int64_t window) {
  // Threads pull items until none are left, so a thread that drew short sequences keeps
  // working instead of waiting at the barrier.
  for (const auto& [num_items, item] : corestream_cpu::paged_decode_items(
           out, query, key_cache, value_cache, block_tables, seq_lens, scale, window)) {
    corestream_cpu::run_items(num_items, item);
  }
}

}  // namespace

// The other files of the extension add their ops with TORCH_LIBRARY_FRAGMENT.
TORCH_LIBRARY(corestream_cpu, m) {
  m.def(
      "paged_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(corestream_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
}
