// What the recurrent-cell ops share (csrc/gru.cpp, lstm.cpp).
#pragma once

#include <torch/types.h>

#include <utility>

namespace seq2seq_fast {

// A cell op's inputs: gate projections [B, gates * H] (unit stride along the row), the state
// [B, H]; float32/64 CPU tensors of one dtype. Returns the projections with unit inner stride.
std::pair<at::Tensor, at::Tensor> check_cell(const char* op, const at::Tensor& gates_in,
                                             const at::Tensor& gates_hidden,
                                             const at::Tensor& state, int64_t gates);

}  // namespace seq2seq_fast
