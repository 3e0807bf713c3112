// Every decoder layer of a decode-only step on CPU, in one call.
//
// Where each sequence feeds one token, a layer's work is a few small matmuls and the ops
// of layers_cpu.cpp and paged_attention_cpu.cpp, and in Python the glue between them
// (module calls, op dispatch from Python, views) costs as much as a fifth of the step.
// Here the same ops run in the same order from C++: matmuls through the same
// corestream_cpu::linear the Python layers call (linear_cpu.h), and the
// extension's ops through the dispatcher, so the results are those of the Python layers
// bit for bit (services/engine/models/llama.py is the reference;
// tests/kernels/test_cpu_decoder.py compares them). The gaps between parallel
// regions also shrink from tens of microseconds to a few, short enough for torch's
// OpenMP workers to keep spinning instead of going to sleep and being woken per op.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "linear_cpu.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace {

// The tensors of one layer in `weights`, in this order; an absent one (a bias the
// checkpoint lacks, q/k norms of families without them) is an empty tensor.
enum Slot : int64_t {
  kInputNorm,
  kQkvWeight,
  kQkvPanels,
  kQkvBias,
  kQNorm,
  kKNorm,
  kOWeight,
  kOPanels,
  kOBias,
  kPostNorm,
  kGateUpWeight,
  kGateUpPanels,
  kGateUpBias,
  kDownWeight,
  kDownPanels,
  kDownBias,
  kSlotsPerLayer,
};

using corestream_cpu::present;

at::Tensor linear(const at::Tensor& x, const at::Tensor* w, Slot weight, Slot panels,
                  Slot bias) {
  return corestream_cpu::linear(x, w[weight], w[panels], w[bias]);
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&)>
      rotary_store_kv;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                int64_t)>
      paged_decode;
};

// Looked up on first use: by then the extension's other files have registered them.
const Ops& ops() {
  static const Ops handles = [] {
    auto& d = c10::Dispatcher::singleton();
    auto find = [&](const char* name) { return d.findSchemaOrThrow(name, ""); };
    return Ops{
        find("corestream_cpu::rms_norm")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
        find("corestream_cpu::add_rms_norm")
            .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(),
        find("corestream_cpu::silu_and_mul").typed<at::Tensor(const at::Tensor&)>(),
        find("corestream_cpu::rotary_store_kv")
            .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&)>(),
        find("corestream_cpu::paged_decode")
            .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                        int64_t)>(),
    };
  }();
  return handles;
}

// hidden: the step's embeddings [B, hidden], one token per sequence, contiguous; on
// return it holds the residual stream before the last layer's MLP output, which is what
// this returns: the pair the Python layers hand to the final norm. weights: kSlotsPerLayer
// tensors per layer (see Slot), linear weights [out, in] in any layout. kv_caches: one
// [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer. cos, sin,
// slot_mapping: as rotary_store_kv takes them; block_tables [B, max_blocks] and seq_lens
// [B] int32, as paged_decode takes them. windows: each layer's sliding window, 0 = none.
at::Tensor decode_layers(
    const at::Tensor& hidden,
    at::TensorList weights,
    at::TensorList kv_caches,
    const at::Tensor& cos,
    const at::Tensor& sin,
    const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_dim,
    double scale,
    at::IntArrayRef windows,
    double eps) {
  const auto num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kSlotsPerLayer,
              "decode_layers: ", kSlotsPerLayer, " weights per layer for ", num_layers,
              " layers, got ", weights.size());
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(windows.size()) == num_layers,
              "decode_layers: at least one layer, and one window per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.size(0) == seq_lens.size(0),
              "decode_layers: hidden must be a contiguous [B, hidden_size] with one token per "
              "sequence, got ", hidden.sizes(), " for ", seq_lens.size(0), " sequences");
  const Ops& op = ops();
  const int64_t tokens = hidden.size(0);
  const int64_t qk_heads = num_heads + num_kv_heads;
  const at::Tensor& residual = hidden;
  at::Tensor x;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kSlotsPerLayer;
    if (layer == 0) {
      x = op.rms_norm.call(residual, w[kInputNorm], eps);
    } else {
      op.add_rms_norm.call(x, residual, w[kInputNorm], eps);
    }
    at::Tensor qkv = linear(x, w, kQkvWeight, kQkvPanels, kQkvBias)
                         .view({tokens, qk_heads + num_kv_heads, head_dim});
    at::Tensor qk = qkv.narrow(1, 0, qk_heads);
    const at::Tensor v = qkv.narrow(1, qk_heads, num_kv_heads);
    if (present(w[kQNorm])) {
      qk = at::cat({op.rms_norm.call(qk.narrow(1, 0, num_heads), w[kQNorm], eps),
                    op.rms_norm.call(qk.narrow(1, num_heads, num_kv_heads), w[kKNorm], eps)},
                   1);
    }
    const at::Tensor& cache = kv_caches[layer];
    const at::Tensor key_cache = cache.select(0, 0);
    const at::Tensor value_cache = cache.select(0, 1);
    op.rotary_store_kv.call(qk, v, cos, sin, key_cache, value_cache, slot_mapping);
    at::Tensor attn = at::empty({tokens, num_heads, head_dim}, x.options());
    op.paged_decode.call(attn, qk.narrow(1, 0, num_heads), key_cache, value_cache,
                         block_tables, seq_lens, scale, windows[layer]);
    x = linear(attn.view({tokens, num_heads * head_dim}), w, kOWeight, kOPanels, kOBias);
    op.add_rms_norm.call(x, residual, w[kPostNorm], eps);
    x = linear(op.silu_and_mul.call(linear(x, w, kGateUpWeight, kGateUpPanels, kGateUpBias)),
               w, kDownWeight, kDownPanels, kDownBias);
  }
  return x;
}

// The whole model of a decode-only step but the head: the embedding of input_ids [B],
// the rotation rows of positions [B] from rotary_table [2, max_positions, head_dim] (cos
// and sin, laid out as RotaryEmbedding.cos_sin hands them over), decode_layers, and the
// final norm. Returns the final hidden states [B, hidden]. Each piece is the op the
// Python model runs, in its order, so the bits are the same; what goes is the Python
// between them, which after the weights have streamed through the caches costs some
// 0.2 ms a step (services/engine/models/llama.py, LlamaModel.forward).
at::Tensor decode_model(
    const at::Tensor& input_ids,
    const at::Tensor& positions,
    const at::Tensor& embedding,
    const at::Tensor& rotary_table,
    at::TensorList weights,
    at::TensorList kv_caches,
    const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_dim,
    double scale,
    at::IntArrayRef windows,
    const at::Tensor& final_norm,
    double eps) {
  TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes(),
              "decode_model: input_ids and positions must be [B], got ", input_ids.sizes(),
              " and ", positions.sizes());
  TORCH_CHECK(rotary_table.dim() == 3 && rotary_table.size(0) == 2,
              "decode_model: rotary_table must be [2, max_positions, head_dim], got ",
              rotary_table.sizes());
  const at::Tensor residual = at::embedding(embedding, input_ids);
  const at::Tensor cos_sin = rotary_table.index_select(1, positions);
  at::Tensor x = decode_layers(residual, weights, kv_caches, cos_sin.select(0, 0).unsqueeze(1),
                               cos_sin.select(0, 1).unsqueeze(1), slot_mapping, block_tables,
                               seq_lens, num_heads, num_kv_heads, head_dim, scale, windows, eps);
  ops().add_rms_norm.call(x, residual, final_norm, eps);
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corestream_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) hidden, Tensor[] weights, Tensor[] kv_caches, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, int head_dim, float scale, int[] windows, float eps) -> Tensor");
  m.def(
      "decode_model(Tensor input_ids, Tensor positions, Tensor embedding, Tensor rotary_table, "
      "Tensor[] weights, Tensor[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, float scale, "
      "int[] windows, Tensor final_norm, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(corestream_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_model", &decode_model);
}

// Weights packed for oneDNN (kernels/cpu_linear.py) carry this key; the ops are the same.
TORCH_LIBRARY_IMPL(corestream_cpu, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_model", &decode_model);
}
