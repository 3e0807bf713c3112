// Every decoder layer of a decode-only step on CPU, in one call.
//
// Where each sequence feeds one token, a layer's work is a few small matmuls and the ops
// of layers_cpu.cpp and paged_attention_cpu.cpp, and in Python the glue between them
// (module calls, op dispatch from Python, views) costs as much as a fifth of the step.
// Here the same ops run in the same order from C++: matmuls through the same
// corestream_cpu::linear the Python layers call (linear_cpu.h), or for a GGUF model's
// quantized layers the same quantized GEMV as quant_linear (quant_projection.h), and the
// extension's ops through the dispatcher, so the results are those of the Python layers
// bit for bit (services/engine/models/llama.py is the reference;
// tests/kernels/test_cpu_decoder.py compares them). The gaps between parallel
// regions also shrink from tens of microseconds to a few, short enough for torch's
// OpenMP workers to keep spinning instead of going to sleep and being woken per op.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "layer_rows.h"
#include "linear_cpu.h"
#include "paged_attention_cpu.h"
#include "quant_projection.h"
#include "work_items.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// The tensors of one layer in `weights`, in this order; an absent one (a bias the
// checkpoint lacks, q/k norms of families without them) is an empty tensor. A projection
// kept quantized has its blocks in the weight slot and their format in the panels slot
// (quant_projection.h).
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

using corestream_cpu::is_quantized;
using corestream_cpu::present;

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
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                      int64_t, bool)>
      quant_linear;
  int64_t quant_gemv_max_rows;  // the most rows quant_linear quantizes the activations of
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
        find("corestream_cpu::quant_linear")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                              int64_t, bool)>(),
        find("corestream_cpu::quant_gemv_max_rows").typed<int64_t(bool)>().call(false),
    };
  }();
  return handles;
}

// x @ weight^T + bias, as the Python layer computes it: `Linear` (corestream_cpu::linear)
// or `QuantizedLinear` (quant_linear).
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& panels,
                   const at::Tensor& bias) {
  if (!is_quantized(weight)) {
    return corestream_cpu::linear(x, weight, panels, bias);
  }
  const corestream_cpu::quant::QuantMatrix w =
      corestream_cpu::quant_format(weight, panels, "a projection");
  const at::Tensor y = ops().quant_linear.call(x, weight, static_cast<int64_t>(w.type), w.rows,
                                               w.cols, w.grouped);
  return present(bias) ? y + bias : y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor* w, Slot weight, Slot panels,
                  Slot bias) {
  return project(x, w[weight], w[panels], w[bias]);
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

// The most rows for which a projection's work can be items of a StagePlan (work_items.h):
// those for which `linear` reads a float weight's panels (corestream_cpu::max_panel_rows),
// or quant_linear runs its GEMV; 0 for a float weight without panels.
int64_t plannable_rows(const at::Tensor& weight, const at::Tensor& panels, at::ScalarType dtype) {
  if (is_quantized(weight)) {
    return corestream_cpu::quant_format(weight, panels, "a projection").grouped
               ? std::numeric_limits<int64_t>::max()
               : ops().quant_gemv_max_rows;
  }
  return present(panels) ? corestream_cpu::max_panel_rows(dtype) : 0;
}

// The most sequences for which all of a step's parallel work can be items of one
// StagePlan: the fewest rows any linear of the layers takes there.
int64_t plannable_rows(at::TensorList weights, at::ScalarType dtype) {
  int64_t rows = std::numeric_limits<int64_t>::max();
  for (size_t layer = 0; layer < weights.size() / kSlotsPerLayer; ++layer) {
    const at::Tensor* w = weights.data() + layer * kSlotsPerLayer;
    for (const auto& [weight, panels] : {std::pair{kQkvWeight, kQkvPanels},
                                         {kOWeight, kOPanels},
                                         {kGateUpWeight, kGateUpPanels},
                                         {kDownWeight, kDownPanels}}) {
      rows = std::min(rows, plannable_rows(w[weight], w[panels], dtype));
    }
  }
  return rows;
}

void check_norm_weight(const at::Tensor& weight, int64_t size, at::ScalarType dtype,
                       const char* what) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.is_contiguous() &&
                  weight.scalar_type() == dtype,
              "decode_model: ", what, " must be a contiguous [", size, "] of ", dtype,
              ", got ", weight.sizes(), " ", weight.scalar_type());
}

// The index of the first largest value of row[0, n), as torch.argmax picks it: a NaN
// counts as larger than any number, so the first NaN if there is one.
template <typename T>
int64_t first_argmax(const T* row, int64_t n) {
  int64_t best = 0;
  float best_value = static_cast<float>(row[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float value = static_cast<float>(row[i]);
    if (std::isnan(value)) {
      return i;
    }
    if (value > best_value) {
      best = i;
      best_value = value;
    }
  }
  return best;
}

// What a planned step runs on: the step's inputs, staged into tensors of its own, every
// stage's output buffer, and the plan over them (work_items.h). Built once for a batch of
// `tokens` sequences and run again step after step: building it (some fifty tensors and
// seventy stages for an 8-layer model) cost ~0.2 ms a step on the cold caches a step
// starts with, measured on 2 cores (AMD EPYC) with the benchmark checkpoint.
struct PlannedStep {
  int64_t tokens = 0;
  // This step's sequences: the first `active` of the plan's rows. The rest are padding
  // (a smaller batch run on a kept plan): their rows are computed and dropped, their keys
  // and values not stored, their lengths 0.
  int64_t active = 0;
  int threads = 0;
  at::Tensor residual;  // the step's embeddings [B, hidden]
  at::Tensor cos_sin;   // its rotation rows [2, B, head_dim], float32
  at::Tensor slots;     // [B] int64
  at::Tensor tables;    // [B, width] int32; a step copies in as many columns as it has
  at::Tensor lens;      // [B] int32
  std::vector<at::Tensor> buffers;  // every stage's output
  // The final norm's inputs (T*): the last layer's residual stream and MLP output.
  const void* last_residual = nullptr;
  const void* last_mlp_out = nullptr;
  at::Tensor final_sum;  // their sum; only the normed result leaves the step
  int64_t layer_stages = 0;  // the plan's stages that the next step runs again
  // The quantized projections' state, which their items refer to (a deque: it never
  // moves them); a quantized head's is `head`, whose stages each step adds anew.
  std::deque<corestream_cpu::QuantProjection> projections;
  corestream_cpu::QuantProjection* head = nullptr;
  corestream_cpu::StagePlan plan;
};

// A quantized projection of `step` from in_features to out_features, checked.
corestream_cpu::QuantProjection& quant_projection(PlannedStep& step, const at::Tensor& blocks,
                                                  const at::Tensor& format,
                                                  const at::Tensor& bias, int64_t in_features,
                                                  int64_t out_features, const char* what) {
  const corestream_cpu::quant::QuantMatrix f = corestream_cpu::quant_format(blocks, format, what);
  const at::ScalarType dtype = step.residual.scalar_type();
  TORCH_CHECK(f.cols == in_features && f.rows == out_features, "decode_model: ",
              what, " is [", f.rows, ", ", f.cols, "], not [", out_features,
              ", ", in_features, "]");
  TORCH_CHECK(!present(bias) || (bias.numel() == out_features && bias.is_contiguous() &&
                                 bias.scalar_type() == dtype),
              "decode_model: ", what, "'s bias must be a contiguous [", out_features, "] of ",
              dtype);
  return step.projections.emplace_back(f, step.tokens, step.threads, dtype, present(bias));
}

// out = x @ weight^T + bias as stages of `step.plan`: a float weight's panels
// (panel_items), or a quantized weight's GEMV (quant_projection.h).
template <typename T>
void plan_linear(PlannedStep& step, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& panels, const at::Tensor& bias, const at::Tensor& out,
                 const char* what) {
  if (!is_quantized(weight)) {
    auto [items, item] = corestream_cpu::panel_items(x, panels, bias, out);
    step.plan.add(items, std::move(item));
    return;
  }
  quant_projection(step, weight, panels, bias, x.size(1), out.size(1), what)
      .add_stages<T>(step.plan, x.const_data_ptr<T>(),
                     present(bias) ? bias.const_data_ptr<T>() : nullptr,
                     out.mutable_data_ptr<T>());
}

// Per token: sum = T(residual + x), then normed = norm(sum): the pre-attention norm of
// every layer but the first, the post-attention norm, and the final norm.
template <typename T>
void add_and_norm(corestream_cpu::StagePlan& plan, int64_t tokens, int64_t size,
                  float epsilon, const T* residual, const T* x, T* sum, T* normed,
                  const at::Tensor& weight) {
  const T* w = weight.const_data_ptr<T>();
  plan.add(tokens, [=](int64_t t) {
    corestream_cpu::add_row(sum + t * size, residual + t * size, x + t * size, size);
    corestream_cpu::normalize_row(normed + t * size, sum + t * size, w, size, epsilon);
  });
}

// decode_layers as stages of `step.plan`, over `step`'s staged inputs: the same row
// functions (layer_rows.h), panels (panel_items) and attention items (paged_decode_items)
// as the ops, in the same order, so the same bits, but each stage writes a buffer of its
// own, so that any stage's item may run twice. T is the model's dtype, C the KV cache's.
template <typename T, typename C>
void plan_layers(PlannedStep& step, const std::vector<at::Tensor>& weights,
                 const std::vector<at::Tensor>& kv_caches, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, double scale,
                 const std::vector<int64_t>& windows, double eps) {
  using corestream_cpu::normalize_row;
  using corestream_cpu::rotate_head;
  const int64_t tokens = step.tokens;
  const int64_t size = step.residual.size(1);
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  const int64_t dim = head_dim;
  const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * dim;
  const float epsilon = static_cast<float>(eps);
  const at::ScalarType dtype = step.residual.scalar_type();
  TORCH_CHECK(dim % 2 == 0, "decode_model: head_dim must be even, got ", dim);

  auto buffer = [&](at::IntArrayRef sizes) -> at::Tensor {
    return step.buffers.emplace_back(at::empty(sizes, step.residual.options()));
  };
  auto data = [](const at::Tensor& t) { return t.mutable_data_ptr<T>(); };
  corestream_cpu::StagePlan& plan = step.plan;
  const int64_t* slots = step.slots.const_data_ptr<int64_t>();
  const float* cos_data = step.cos_sin.const_data_ptr<float>();
  const float* sin_data = cos_data + tokens * dim;
  const T* residual = step.residual.const_data_ptr<T>();
  const T* mlp_out = nullptr;  // the previous layer's down projection
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kSlotsPerLayer;
    const at::Tensor& cache = kv_caches[layer];
    check_norm_weight(w[kInputNorm], size, dtype, "input_layernorm");
    check_norm_weight(w[kPostNorm], size, dtype, "post_attention_layernorm");
    const bool qk_norms = present(w[kQNorm]);
    if (qk_norms) {
      check_norm_weight(w[kQNorm], dim, dtype, "q_norm");
      check_norm_weight(w[kKNorm], dim, dtype, "k_norm");
    }

    // The input norm, after the previous layer's residual add.
    const at::Tensor normed = buffer({tokens, size});
    if (mlp_out == nullptr) {
      const T* input_norm = w[kInputNorm].const_data_ptr<T>();
      T* out = data(normed);
      plan.add(tokens, [=](int64_t t) {
        normalize_row(out + t * size, residual + t * size, input_norm, size, epsilon);
      });
    } else {
      T* sum = data(buffer({tokens, size}));
      add_and_norm(plan, tokens, size, epsilon, residual, mlp_out, sum, data(normed),
                   w[kInputNorm]);
      residual = sum;
    }

    // q, k and v.
    const at::Tensor qkv = buffer({tokens, qkv_width});
    plan_linear<T>(step, normed, w[kQkvWeight], w[kQkvPanels], w[kQkvBias], qkv, "qkv_proj");

    // Per token: q and k normed per head (Qwen3), rotated; q to its buffer, k and v to
    // the cache.
    const at::Tensor query = buffer({tokens, num_heads, dim});
    const at::Tensor key_cache = cache.select(0, 0);
    const at::Tensor value_cache = cache.select(0, 1);
    const T* qkv_data = data(qkv);
    T* query_data = data(query);
    C* keys = key_cache.mutable_data_ptr<C>();
    C* values = value_cache.mutable_data_ptr<C>();
    const T* q_norm = qk_norms ? w[kQNorm].const_data_ptr<T>() : nullptr;
    const T* k_norm = qk_norms ? w[kKNorm].const_data_ptr<T>() : nullptr;
    const int64_t* active = &step.active;
    plan.add(tokens, [=](int64_t t) {
      if (t >= *active) {
        return;  // a padding row: no slot of its own to store into
      }
      thread_local std::vector<T> head;
      head.resize(dim);
      const T* row = qkv_data + t * qkv_width;
      const float* c = cos_data + t * dim;
      const float* s = sin_data + t * dim;
      C* slot_keys = keys + slots[t] * num_kv_heads * dim;
      C* slot_values = values + slots[t] * num_kv_heads * dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        const T* x = row + h * dim;
        const T* weight = h < num_heads ? q_norm : k_norm;
        if (weight != nullptr) {
          normalize_row(head.data(), x, weight, dim, epsilon);
          x = head.data();
        }
        if (h < num_heads) {
          rotate_head(query_data + (t * num_heads + h) * dim, static_cast<T*>(nullptr), x, c, s,
                      dim);
        } else if constexpr (std::is_same_v<T, C>) {
          rotate_head(slot_keys + (h - num_heads) * dim, static_cast<T*>(nullptr), x, c, s, dim);
        } else {  // rotated in T, stored in the cache's type
          rotate_head<T, C>(head.data(), slot_keys + (h - num_heads) * dim, x, c, s, dim);
        }
      }
      const T* v = row + (num_heads + num_kv_heads) * dim;
      corestream_cpu::convert_row(v, slot_values, num_kv_heads * dim);
    });

    const at::Tensor attn = buffer({tokens, num_heads, dim});
    for (auto& [attn_items, attn_item] : corestream_cpu::paged_decode_items(
             attn, query, key_cache, value_cache, step.tables, step.lens, scale,
             windows[layer])) {
      plan.add(attn_items, std::move(attn_item));
    }

    const at::Tensor projected = buffer({tokens, size});
    plan_linear<T>(step, attn.view({tokens, num_heads * dim}), w[kOWeight], w[kOPanels],
                   w[kOBias], projected, "o_proj");

    // The post-attention norm, after the residual add.
    T* sum = data(buffer({tokens, size}));
    const at::Tensor post_normed = buffer({tokens, size});
    add_and_norm(plan, tokens, size, epsilon, residual, data(projected), sum,
                 data(post_normed), w[kPostNorm]);
    residual = sum;

    const int64_t gate_up_width = w[kGateUpWeight].size(0);
    const int64_t intermediate = gate_up_width / 2;
    const at::Tensor gate_up = buffer({tokens, gate_up_width});
    plan_linear<T>(step, post_normed, w[kGateUpWeight], w[kGateUpPanels], w[kGateUpBias],
                   gate_up, "gate_up_proj");

    const at::Tensor activated = buffer({tokens, intermediate});
    const T* gate_up_data = data(gate_up);
    T* activated_data = data(activated);
    plan.add(tokens, [=](int64_t t) {
      const T* row = gate_up_data + t * gate_up_width;
      corestream_cpu::silu_mul_row(activated_data + t * intermediate, row, row + intermediate,
                                   intermediate);
    });

    const at::Tensor down = buffer({tokens, size});
    plan_linear<T>(step, activated, w[kDownWeight], w[kDownPanels], w[kDownBias], down,
                   "down_proj");
    mlp_out = data(down);
  }
  step.last_residual = residual;
  step.last_mlp_out = mlp_out;
  step.final_sum = buffer({tokens, size});
  step.layer_stages = plan.num_stages();
}

// The plan's last stages, anew for each step: the final norm, after the last residual
// add, and the head, into output tensors of the step's own, which the caller keeps.
template <typename T>
std::vector<at::Tensor> plan_outputs(PlannedStep& step, const at::Tensor& final_norm,
                                     double eps, const std::vector<at::Tensor>& head) {
  step.plan.rearm(step.layer_stages);
  const int64_t tokens = step.tokens;
  const int64_t size = step.residual.size(1);
  const at::Tensor result = at::empty({tokens, size}, step.residual.options());
  std::vector<at::Tensor> outputs{result};
  add_and_norm(step.plan, tokens, size, static_cast<float>(eps),
               static_cast<const T*>(step.last_residual),
               static_cast<const T*>(step.last_mlp_out), step.final_sum.mutable_data_ptr<T>(),
               result.mutable_data_ptr<T>(), final_norm);
  // The head's panels, or its blocks and format: its logits too.
  if (!head.empty() && present(head[1])) {
    const at::Tensor logits = outputs.emplace_back(
        at::empty({tokens, head[0].size(0)}, step.residual.options()));
    if (step.head != nullptr) {
      step.head->add_stages<T>(step.plan, result.const_data_ptr<T>(),
                               present(head[2]) ? head[2].const_data_ptr<T>() : nullptr,
                               logits.mutable_data_ptr<T>());
    } else {
      auto [head_items, head_item] = corestream_cpu::panel_items(result, head[1], head[2], logits);
      step.plan.add(head_items, std::move(head_item));
    }
    // And each row's argmax, the token a greedy request takes (the sampler's argmax).
    const at::Tensor greedy = outputs.emplace_back(
        at::empty({tokens}, at::TensorOptions().dtype(at::kLong)));
    const int64_t vocab = logits.size(1);
    const T* rows = logits.const_data_ptr<T>();
    int64_t* tokens_out = greedy.mutable_data_ptr<int64_t>();
    step.plan.add(tokens, [=](int64_t t) {
      tokens_out[t] = first_argmax(rows + t * vocab, vocab);
    });
  }
  return outputs;
}

// A model's decode-only step with the arguments that stay the same from step to step
// bound once (the extension module's DecodeModel, see kernels/corestream_kernels/decoder_layers.py):
// the embedding of input_ids [B] (`embedding`: [table], or a quantized table's [blocks,
// format], see quant_projection.h, whose rows are dequantized into the model's dtype,
// final_norm's), the rotation rows of positions [B] from rotary_table [2, max_positions,
// head_dim] (cos and sin, laid out as RotaryEmbedding.cos_sin hands them over),
// decode_layers, the final norm, and with `head` = [weight, panels, bias] (as `linear`
// takes them, or a quantized head's [blocks, format, bias]; or empty) the head. forward
// returns [final hidden states [B, hidden]], or with a head [those, logits [B, vocab],
// each row's argmax [B] int64] (a greedy step's tokens, without a sampler in Python).
// Each piece is the op the Python model runs, in its order, so the bits are the same;
// what goes is the Python between them, which after the weights have streamed through
// the caches costs some 0.2 ms a step (services/engine/models/llama.py,
// LlamaModel.forward).
//
// With a few sequences, where every linear reads panels or is quantized, the layers and
// the final norm run as one StagePlan in one parallel region instead of a fork and join
// per linear and attention: a thread preempted by another process then delays the step
// by about its share of the time it is away, not by all of it (work_items.h). The plan of
// the last batch size is kept, with its buffers: a step of the same size, or up to a
// sixteenth smaller (padded: PlannedStep::active), stages its inputs into it and runs it
// again. Bound here, and called through pybind11 rather than torch's
// dispatcher, a step's call takes its five tensors and no more: the dispatcher's
// conversion of a hundred-odd weights each way, or even a TorchScript class method's
// call, cost ~0.1 ms a step on the cold caches after the op.
class DecodeModel {
 public:
  DecodeModel(std::vector<at::Tensor> embedding, at::Tensor rotary_table,
              std::vector<at::Tensor> weights, std::vector<at::Tensor> kv_caches,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
              std::vector<int64_t> windows, at::Tensor final_norm, double eps,
              std::vector<at::Tensor> head)
      : embedding_(embedding.empty() ? at::Tensor() : embedding[0]),
        rotary_table_(std::move(rotary_table)),
        weights_(std::move(weights)),
        kv_caches_(std::move(kv_caches)),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        scale_(scale),
        windows_(std::move(windows)),
        final_norm_(std::move(final_norm)),
        eps_(eps),
        head_(std::move(head)) {
    TORCH_CHECK(head_.empty() || head_.size() == 3,
                "decode_model: head must be [weight, panels, bias] or empty, got ",
                head_.size(), " tensors");
    TORCH_CHECK(embedding.size() == (is_quantized(embedding_) ? 2u : 1u),
                "decode_model: embedding must be [table] or [blocks, format], got ",
                embedding.size(), " tensors");
    if (is_quantized(embedding_)) {
      quant_table_ = corestream_cpu::quant_format(embedding_, embedding[1], "the embedding");
    }
    dtype_ = quant_table_ ? final_norm_.scalar_type() : embedding_.scalar_type();
    hidden_size_ = quant_table_ ? quant_table_->cols : embedding_.size(1);
    TORCH_CHECK(rotary_table_.dim() == 3 && rotary_table_.size(0) == 2,
                "decode_model: rotary_table must be [2, max_positions, head_dim], got ",
                rotary_table_.sizes());
    const auto num_layers = static_cast<int64_t>(kv_caches_.size());
    if (num_layers > 0 &&
        static_cast<int64_t>(weights_.size()) == num_layers * kSlotsPerLayer &&
        static_cast<int64_t>(windows_.size()) == num_layers && num_kv_heads_ > 0 &&
        num_heads_ % num_kv_heads_ == 0) {
      plannable_rows_ = plannable_rows(weights_, dtype_);
      if (!head_.empty() && present(head_[1])) {  // a head the plan runs
        plannable_rows_ = std::min(plannable_rows_, plannable_rows(head_[0], head_[1], dtype_));
      }
    }
  }

  std::vector<at::Tensor> forward(const at::Tensor& input_ids, const at::Tensor& positions,
                                  const at::Tensor& slot_mapping,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens) {
    TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes(),
                "decode_model: input_ids and positions must be [B], got ", input_ids.sizes(),
                " and ", positions.sizes());
    const int64_t tokens = input_ids.size(0);
    const int threads = at::get_num_threads();
    const at::ScalarType dtype = dtype_;  // the model's
    // A forward never differentiates; outside inference mode, the staging copies' out=
    // would refuse the model's parameters, which require grad.
    const at::NoGradGuard no_grad;
    std::lock_guard<std::mutex> guard(lock_);
    if (tokens <= plannable_rows_ && threads > 1 && !at::in_parallel_region() &&
        corestream_cpu::stage_plan_counters().enabled.load() &&
        (dtype == at::kFloat || dtype == at::kBFloat16)) {
      check_step_inputs(tokens, slot_mapping, block_tables, seq_lens);
      if (!planned_ || !serves(*planned_, tokens) || planned_->threads != threads ||
          block_tables.size(1) > planned_->tables.size(1)) {
        planned_.reset();  // its memory first, before the next one's
        planned_ = plan(tokens, threads, block_tables.size(1));
      }
      stage_inputs(*planned_, tokens, input_ids, positions, slot_mapping, block_tables,
                   seq_lens);
      std::vector<at::Tensor> outputs = dtype == at::kFloat
                                            ? run_planned<float>(*planned_, threads)
                                            : run_planned<c10::BFloat16>(*planned_, threads);
      if (tokens < planned_->tokens) {  // padded: the step's own rows
        for (at::Tensor& output : outputs) output = output.narrow(0, 0, tokens);
      }
      return outputs;
    }
    at::Tensor residual;
    if (quant_table_) {
      residual = at::empty({tokens, hidden_size_}, final_norm_.options());
      embed_quantized(residual, input_ids);
    } else {
      residual = at::embedding(embedding_, input_ids);
    }
    const at::Tensor cos_sin = rotary_table_.index_select(1, positions);
    at::Tensor x = decode_layers(residual, weights_, kv_caches_, cos_sin.select(0, 0).unsqueeze(1),
                                 cos_sin.select(0, 1).unsqueeze(1), slot_mapping, block_tables,
                                 seq_lens, num_heads_, num_kv_heads_, head_dim_, scale_,
                                 windows_, eps_);
    ops().add_rms_norm.call(x, residual, final_norm_, eps_);
    std::vector<at::Tensor> outputs{x};
    if (!head_.empty()) {
      add_head_outputs(outputs);
    }
    return outputs;
  }

  // A greedy decode step from the scheduler's own numbers (Python lists): each
  // sequence's next token, the argmax of its logits. The model must have its head. A
  // step built in Python would cost ~0.2 ms of numpy, tensors and dispatch on the caches
  // the weights have just streamed through; here the five tensors take microseconds.
  std::vector<int64_t> greedy(const std::vector<int64_t>& input_ids,
                              const std::vector<int64_t>& positions,
                              const std::vector<int64_t>& slot_mapping,
                              const std::vector<std::vector<int32_t>>& block_tables,
                              const std::vector<int32_t>& seq_lens) {
    TORCH_CHECK(head_.size() == 3, "decode_model: greedy needs the model's head");
    const auto tokens = static_cast<int64_t>(input_ids.size());
    TORCH_CHECK(positions.size() == input_ids.size() && slot_mapping.size() == input_ids.size() &&
                    block_tables.size() == input_ids.size() &&
                    seq_lens.size() == input_ids.size(),
                "decode_model: greedy needs one token, position, slot, block table and "
                "length per sequence");
    const int64_t num_blocks = kv_caches_.empty() ? 0 : kv_caches_[0].size(1);
    size_t width = 1;
    for (const auto& row : block_tables) {
      width = std::max(width, row.size());
      for (const int32_t block : row) {
        TORCH_CHECK(block >= 0 && block < num_blocks, "decode_model: block ", block,
                    " outside the cache's ", num_blocks, " blocks");
      }
    }
    const auto longs = at::TensorOptions().dtype(at::kLong);
    const auto ints = at::TensorOptions().dtype(at::kInt);
    at::Tensor ids = at::empty({tokens}, longs);
    at::Tensor pos = at::empty({tokens}, longs);
    at::Tensor slots = at::empty({tokens}, longs);
    at::Tensor lens = at::empty({tokens}, ints);
    // Padded with block 0, as the runner pads: masked out by seq_lens.
    at::Tensor tables = at::zeros({tokens, static_cast<int64_t>(width)}, ints);
    std::copy(input_ids.begin(), input_ids.end(), ids.mutable_data_ptr<int64_t>());
    std::copy(positions.begin(), positions.end(), pos.mutable_data_ptr<int64_t>());
    std::copy(slot_mapping.begin(), slot_mapping.end(), slots.mutable_data_ptr<int64_t>());
    std::copy(seq_lens.begin(), seq_lens.end(), lens.mutable_data_ptr<int32_t>());
    int32_t* table_data = tables.mutable_data_ptr<int32_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      std::copy(block_tables[t].begin(), block_tables[t].end(), table_data + t * width);
    }
    const std::vector<at::Tensor> outputs = forward(ids, pos, slots, tables, lens);
    const at::Tensor argmax = outputs.at(2).contiguous();
    const int64_t* found = argmax.const_data_ptr<int64_t>();
    return std::vector<int64_t>(found, found + tokens);
  }

 private:
  std::unique_ptr<PlannedStep> plan(int64_t tokens, int threads, int64_t table_width) {
    const at::Tensor& first_cache = kv_caches_[0];
    for (size_t layer = 0; layer < kv_caches_.size(); ++layer) {
      const at::Tensor& cache = kv_caches_[layer];
      TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                      cache.sizes() == first_cache.sizes() &&
                      cache.size(3) == num_kv_heads_ && cache.size(4) == head_dim_ &&
                      cache.scalar_type() == first_cache.scalar_type() &&
                      corestream_cpu::cache_type_served(dtype_, cache.scalar_type()),
                  "decode_model: layer ", layer, "'s cache must be a contiguous [2, blocks, "
                  "block_size, ", num_kv_heads_, ", ", head_dim_, "] of ", dtype_,
                  " (or float16 under float32) like the first layer's");
    }
    TORCH_CHECK(rotary_table_.scalar_type() == at::kFloat && rotary_table_.size(2) == head_dim_,
                "decode_model: the rotary table must be float32 [2, max_positions, ",
                head_dim_, "]");
    const int64_t size = hidden_size_;
    check_norm_weight(final_norm_, size, dtype_, "the final norm");
    // Wide enough for any sequence the rotary table has positions for: a growing
    // sequence then keeps its plan.
    const int64_t block_size = first_cache.size(2);
    const int64_t width = std::max(table_width,
                                   (rotary_table_.size(1) + block_size - 1) / block_size);
    // Normal tensors, not inference ones, whatever mode this first step runs in: the
    // later steps that write into them may run outside inference mode.
    const c10::InferenceMode normal_tensors(false);
    auto step = std::make_unique<PlannedStep>();
    step->tokens = tokens;
    step->threads = threads;
    step->residual = at::empty({tokens, size}, final_norm_.options());
    step->cos_sin = at::empty({2, tokens, head_dim_}, rotary_table_.options());
    step->slots = at::empty({tokens}, at::TensorOptions().dtype(at::kLong));
    step->tables = at::zeros({tokens, width}, at::TensorOptions().dtype(at::kInt));
    step->lens = at::zeros({tokens}, at::TensorOptions().dtype(at::kInt));
    if (dtype_ == at::kFloat && first_cache.scalar_type() == at::kHalf) {
      plan_layers<float, c10::Half>(*step, weights_, kv_caches_, num_heads_, num_kv_heads_,
                                    head_dim_, scale_, windows_, eps_);
    } else if (dtype_ == at::kFloat) {
      plan_layers<float, float>(*step, weights_, kv_caches_, num_heads_, num_kv_heads_,
                                head_dim_, scale_, windows_, eps_);
    } else {
      plan_layers<c10::BFloat16, c10::BFloat16>(*step, weights_, kv_caches_, num_heads_,
                                                num_kv_heads_, head_dim_, scale_, windows_,
                                                eps_);
    }
    if (!head_.empty() && is_quantized(head_[0])) {  // its stages come with each step's
      step->head = &quant_projection(*step, head_[0], head_[1], head_[2], size,
                                     head_[0].size(0), "the head");
    }
    corestream_cpu::stage_plan_counters().plans_built.fetch_add(1, std::memory_order_relaxed);
    return step;
  }

  // The head's logits of the final hidden states outputs[0], and each row's argmax, where
  // the plan did not compute them.
  void add_head_outputs(std::vector<at::Tensor>& outputs) const {
    outputs.push_back(project(outputs[0], head_[0], head_[1], head_[2]));
    outputs.push_back(outputs.back().argmax(-1));
  }

  // The step's inputs checked as the ops would check them.
  void check_step_inputs(int64_t tokens, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == tokens,
                "decode_model: slot_mapping must be contiguous int64 [", tokens, "]");
    TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1,
                "one block table row and one length per sequence");
    corestream_cpu::check_block_tables(block_tables, seq_lens, tokens);
  }

  // Whether a kept plan runs a step of `tokens` sequences: its own size, or up to a
  // sixteenth fewer, padded. At full load the batch goes down by one whenever a request
  // finishes and up again when the next joins, and building a plan anew cost ~10% of a
  // step (SmolLM2 Q4_K_M at 32 sequences: 47.3 -> 51.9 ms a step with the size
  // alternating 31/32, in process), more than the padding rows' GEMV rows do.
  static bool serves(const PlannedStep& step, int64_t tokens) {
    return tokens <= step.tokens && step.tokens - tokens <= step.tokens / 16;
  }

  // The step's inputs (`tokens` sequences) into the plan's tensors, the values checked
  // against the cache; rows past them padding (see PlannedStep::active).
  void stage_inputs(PlannedStep& step, int64_t tokens, const at::Tensor& input_ids,
                    const at::Tensor& positions, const at::Tensor& slot_mapping,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    const int64_t num_slots = kv_caches_[0].size(1) * kv_caches_[0].size(2);
    const int64_t block_size = kv_caches_[0].size(2);
    const int64_t width = block_tables.size(1);
    const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
    const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "decode_model: slot_mapping[", t,
                  "] = ", slots[t], " outside the cache's ", num_slots, " slots");
      TORCH_CHECK(lens[t] >= 0 && (lens[t] + block_size - 1) / block_size <= width,
                  "seq_lens[", t, "] = ", lens[t], " exceeds its block table");
    }
    step.active = tokens;
    at::Tensor residual = step.residual.narrow(0, 0, tokens);
    if (quant_table_) {
      embed_quantized(residual, input_ids);
    } else {
      at::index_select_out(residual, embedding_, 0, input_ids);
    }
    // Padding rows: zeros (finite, so no NaN or denormal slows their arithmetic), no
    // keys or values to attend to.
    if (tokens < step.tokens) {
      step.residual.narrow(0, tokens, step.tokens - tokens).zero_();
    }
    if (tokens == step.tokens) {
      at::index_select_out(step.cos_sin, rotary_table_, 1, positions);
    } else {  // a view across dim 1 is not contiguous: no out= into it
      step.cos_sin.narrow(1, 0, tokens).copy_(rotary_table_.index_select(1, positions));
    }
    std::copy(slots, slots + tokens, step.slots.mutable_data_ptr<int64_t>());
    std::copy(lens, lens + tokens, step.lens.mutable_data_ptr<int32_t>());
    std::fill(step.lens.mutable_data_ptr<int32_t>() + tokens,
              step.lens.mutable_data_ptr<int32_t>() + step.tokens, 0);
    const int32_t* rows = block_tables.const_data_ptr<int32_t>();
    int32_t* staged = step.tables.mutable_data_ptr<int32_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      std::copy(rows + t * width, rows + (t + 1) * width, staged + t * step.tables.size(1));
    }
  }

  // The rows of input_ids of the quantized table into out [B, hidden] (the model's dtype).
  void embed_quantized(const at::Tensor& out, const at::Tensor& input_ids) const {
    const at::Tensor ids = input_ids.to(at::kLong).contiguous();
    if (dtype_ == at::kFloat) {
      corestream_cpu::dequantize_rows(*quant_table_, ids.const_data_ptr<int64_t>(),
                                      ids.numel(), out.mutable_data_ptr<float>());
    } else {
      corestream_cpu::dequantize_rows(*quant_table_, ids.const_data_ptr<int64_t>(),
                                      ids.numel(), out.mutable_data_ptr<c10::BFloat16>());
    }
  }

  template <typename T>
  std::vector<at::Tensor> run_planned(PlannedStep& step, int threads) {
    std::vector<at::Tensor> outputs = plan_outputs<T>(step, final_norm_, eps_, head_);
    auto& counters = corestream_cpu::stage_plan_counters();
    counters.plans.fetch_add(1, std::memory_order_relaxed);
    counters.stages.fetch_add(step.plan.num_stages(), std::memory_order_relaxed);
#pragma omp parallel num_threads(threads)
    step.plan.run(omp_get_thread_num(), omp_get_num_threads());
    step.plan.rethrow();
    if (head_.size() == 3 && outputs.size() == 1) {  // a head without panels
      add_head_outputs(outputs);
    }
    return outputs;
  }

  const at::Tensor embedding_;  // the table, or a quantized one's blocks
  std::optional<corestream_cpu::quant::QuantMatrix> quant_table_;
  at::ScalarType dtype_;  // the model's
  int64_t hidden_size_;
  const at::Tensor rotary_table_;
  const std::vector<at::Tensor> weights_;
  const std::vector<at::Tensor> kv_caches_;
  const int64_t num_heads_;
  const int64_t num_kv_heads_;
  const int64_t head_dim_;
  const double scale_;
  const std::vector<int64_t> windows_;
  const at::Tensor final_norm_;
  const double eps_;
  const std::vector<at::Tensor> head_;
  int64_t plannable_rows_ = 0;  // the most sequences a step runs as one StagePlan
  std::mutex lock_;  // one step at a time: the plan and its buffers are shared
  std::unique_ptr<PlannedStep> planned_;
};

// decode_model as an op, binding its arguments for one call (tests, and callers that
// have not bound them): every call plans anew.
std::vector<at::Tensor> decode_model(
    const at::Tensor& input_ids,
    const at::Tensor& positions,
    at::TensorList embedding,
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
    double eps,
    at::TensorList head) {
  return DecodeModel(embedding.vec(), rotary_table, weights.vec(), kv_caches.vec(), num_heads,
                     num_kv_heads, head_dim, scale, windows.vec(), final_norm, eps, head.vec())
      .forward(input_ids, positions, slot_mapping, block_tables, seq_lens);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corestream_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) hidden, Tensor[] weights, Tensor[] kv_caches, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, int head_dim, float scale, int[] windows, float eps) -> Tensor");
  m.def(
      "decode_model(Tensor input_ids, Tensor positions, Tensor[] embedding, Tensor rotary_table, "
      "Tensor[] weights, Tensor[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, float scale, "
      "int[] windows, Tensor final_norm, float eps, Tensor[] head) -> Tensor[]");
  // [plans run, stages run, items computed again after another thread was late, plans
  // built, nanoseconds threads waited at stage ends] in this process.
  m.def("stage_plan_counters() -> int[]", [] {
    const auto& c = corestream_cpu::stage_plan_counters();
    return std::vector<int64_t>{c.plans.load(), c.stages.load(), c.items_retaken.load(),
                                c.plans_built.load(), c.wait_ns.load()};
  });
  // For benchmarks: off, decode_model forks a region per op as decode_layers does.
  m.def("set_stage_plans_enabled(bool enabled) -> ()", [](bool enabled) {
    corestream_cpu::stage_plan_counters().enabled.store(enabled);
  });
  // Test hook: threads other than a region's first take the first item of every stage
  // and start each item this many microseconds late, as if preempted.
  m.def("set_stage_plan_late_us(int microseconds) -> ()", [](int64_t microseconds) {
    corestream_cpu::stage_plan_counters().late_us.store(microseconds);
  });
}

TORCH_LIBRARY_IMPL(corestream_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_model", &decode_model);
}

// Weights packed for oneDNN (kernels/corestream_kernels/cpu_linear.py) carry this key; the ops are the same.
TORCH_LIBRARY_IMPL(corestream_cpu, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_model", &decode_model);
}

// The extension is also a Python module (kernels/corestream_kernels/cpu_extension.py): the bound model, whose
// forward releases the GIL like an op, so that the engine's other threads run meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeModel>(m, "DecodeModel")
      .def(pybind11::init<std::vector<at::Tensor>, at::Tensor, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, int64_t, int64_t, int64_t, double,
                          std::vector<int64_t>, at::Tensor, double, std::vector<at::Tensor>>())
      .def("forward", &DecodeModel::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("greedy", &DecodeModel::greedy,
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
