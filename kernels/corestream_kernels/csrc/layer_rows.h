// One row (or one head) of the small per-layer ops, shared by the ops of layers_cpu.cpp
// and the planned decode step of decoder_cpu.cpp, so that both compute the same bits.
// The arithmetic follows transformers' order: norms and rotations in float32, and in
// bfloat16 a rounding wherever torch would store an intermediate tensor.
#pragma once

#include <cstdint>

namespace corestream_cpu {

// Each is compiled once, in layers_cpu.cpp, and never inlined: a copy inlined elsewhere
// could vectorize a sum differently (another order, other bits) or fuse a multiply-add
// the other copy keeps apart. T is float or c10::BFloat16.

// out = weight * T(x / rms(x)) over one row of n elements, as transformers' LlamaRMSNorm:
// the normalized row is cast to T before the scale.
template <typename T>
void normalize_row(T* out, const T* x, const T* weight, int64_t n, float eps);

// sum = T(residual + x): the residual stream is a tensor of the model's dtype. sum may be
// residual.
template <typename T>
void add_row(T* sum, const T* residual, const T* x, int64_t n);

// out[d] = silu(gate[d]) * up[d], silu's output rounded to T as torch stores it.
template <typename T>
void silu_mul_row(T* out, const T* gate, const T* up, int64_t n);

// One head of dim elements rotated: x' = x * cos + swap_halves(x) * sin, with cos and sin
// laid out as kernels/corestream_kernels/rotary.py builds them ([cos, cos] and [-sin, sin] over the halves).
// Written to out and, if not null, also to also_out (a key cache: T, or float16 under a
// float32 x); out may be x.
template <typename T, typename C = T>
void rotate_head(T* out, C* also_out, const T* x, const float* c, const float* s, int64_t dim);

}  // namespace corestream_cpu
