// bfloat16 tensors in the CPU ops (csrc/additive_attention.cpp, gru.cpp, lstm.cpp): storage only.
//
// The kernel tables compute in float32 or float64; a bfloat16 call converts its inputs to float32
// once at the op's entry (exact), runs the float32 path (float32 arithmetic and accumulation) and
// rounds its outputs to bfloat16 (nearest even) at the exit. What an op keeps only for its own
// backward (the gate ops' `saved`) stays float32. The conversions are ATen's (at::Tensor::to),
// vectorised for the CPU they run on. On CPUs with AVX512-BF16 / AMX, the model's large products
// run in bfloat16 (oneDNN, under torch.autocast); these ops' products stay float32.
#pragma once

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/types.h>

#include <optional>

namespace seq2seq_fast {

inline bool is_bf16(const at::Tensor& t) {
  return t.defined() && t.scalar_type() == at::kBFloat16;
}

// float32 copy of a bfloat16 tensor; any other tensor as it is.
inline at::Tensor as_float(const at::Tensor& t) { return is_bf16(t) ? t.to(at::kFloat) : t; }

inline std::optional<at::Tensor> as_float(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return t;
  return as_float(*t);
}

// The op's output rounded to bfloat16 (an undefined tensor stays undefined).
inline at::Tensor to_bf16(const at::Tensor& t) {
  return t.defined() ? t.to(at::kBFloat16) : t;
}

// The ops' inner ATen calls (products, sums) run in the dtypes the op chose, whatever autocast
// state the caller is in: a custom op is not an autocast op, so without this an at::mm inside
// would be recast to bfloat16 under torch.autocast("cpu").
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

}  // namespace seq2seq_fast
