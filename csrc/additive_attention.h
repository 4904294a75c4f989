// What the attention's CPU kernels (csrc/additive_attention.cpp) share with the location-aware
// step (csrc/location_attention.cpp): the sizes and key validity of a call, their checks, and the
// forward and backward passes, which take a LocationTerm to form a location-aware step's keys.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace seq2seq_fast {

using at::Tensor;

struct Sizes {
  int64_t B, Tq, Tk, H, Dv;
};

Sizes check_inputs(const char* op, const Tensor& query, const Tensor& keys, const Tensor& values,
                   const Tensor& v, const Tensor& bias, const std::optional<Tensor>& lengths,
                   const std::optional<Tensor>& mask);

// Valid keys of each batch row: a prefix length (the kernels only visit s < len) and, for a
// mask, the bool row (all Tk keys are scored, masked ones dropped in the softmax).
struct KeyValidity {
  Tensor lengths, mask;  // contiguous copies kept alive
  const int64_t* len = nullptr;
  const bool* mask_ptr = nullptr;
  int64_t Tk = 0;
  int64_t count(int64_t b) const { return len ? len[b] : Tk; }
  const bool* row_mask(int64_t b) const { return mask_ptr ? mask_ptr + b * Tk : nullptr; }
};

KeyValidity key_validity(const char* op, const std::optional<Tensor>& lengths,
                         const std::optional<Tensor>& mask, int64_t Tk);

// A location-aware step (ESPnet AttLoc, Tacotron 2, ...; caller: seq2seq_fast/ops/
// location_attention.py): its keys are projected + conv W^T, with conv [B*Tk, C] the location convolution
// of the previous weights and W [H, C] the location dense layer's weight. Each item forms its batch
// row's keys in per-thread scratch (cache-resident) instead of reading a [B, Tk, H] keys tensor
// that an addmm wrote; the backward forms them again and multiplies its keys gradient out to
// conv's gradient (rows) and W's (per-item partials, summed in item order).
template <typename T>
struct LocationTerm {
  const T* conv;  // [B*Tk, C]
  const T* wt;    // W^T [C, H]
  int64_t C;
  const T* w;    // backward: W [H, C]
  const T* wtp;  // backward: W^T with rows padded to Hp [C, Hp]
  T* dconv;      // backward: [B*Tk, C], written in full
  T* dw_parts;   // backward: W^T's gradient per item [items, C, Hp]
};

// One forward / backward over all work items (csrc/additive_attention.cpp); loc: a
// location-aware step's keys, formed per item (else the keys tensor is read).
template <typename T>
std::tuple<Tensor, Tensor, Tensor> forward_impl(const Tensor& query_in, const Tensor& keys_in,
                                                const Tensor& values_in, const Tensor& v_in,
                                                const Tensor& bias_in, const KeyValidity& kv,
                                                const Sizes& n, bool return_weights,
                                                const LocationTerm<T>* loc = nullptr);

template <typename T>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query_in,
    const Tensor& keys_in, const Tensor& values_in, const Tensor& v_in, const Tensor& bias_in,
    const KeyValidity& kv, const Sizes& n, const Tensor& saved_weights, const Tensor& dkeys_acc,
    bool want_dvalues, const LocationTerm<T>* loc = nullptr);

}  // namespace seq2seq_fast
