// bfloat16 tensors in the CPU ops (csrc/additive_attention.cpp, gru.cpp, lstm.cpp).
//
// The kernels read bfloat16 rows themselves and write bfloat16 outputs: bfloat16 -> float32 is a
// 16-bit shift in registers (kernels/kernels.h: Bf16 and the tables' *_bf16 entries, every
// instruction set), float32 -> bfloat16 rounds to nearest even; arithmetic and accumulation are
// float32. No op copies a whole tensor to float32 around a kernel: an item's or a row's outputs
// are formed in cache-resident float32 scratch and rounded into the output. What an op keeps only
// for its own backward (the gate ops' `saved`) and the recurrent state are float32.
#pragma once

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/types.h>

namespace seq2seq_fast {

inline bool is_bf16(const at::Tensor& t) {
  return t.defined() && t.scalar_type() == at::kBFloat16;
}

// The ops' inner ATen calls (products, sums) run in the dtypes the op chose, whatever autocast
// state the caller is in: a custom op is not an autocast op, so without this an at::mm inside
// would be recast to bfloat16 under torch.autocast("cpu").
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

}  // namespace seq2seq_fast
