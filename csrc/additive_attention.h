// What the attention ops (csrc/additive_attention.cpp) share with the location-aware step
// (csrc/location_attention.cpp): the input checks, the valid keys, and the forward and backward
// passes, templates on the arithmetic type T and the tensors' element type M (float, double, or
// bfloat16 read as Bf16 with T = float). additive_attention.cpp instantiates the combinations the
// location-aware step uses.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "runtime.h"

namespace seq2seq_fast {

struct Sizes {
  int64_t B, Tq, Tk, H, Dv;
};

// query [B, Tq, H], keys [B, Tk, H], values [B, Tk, Dv], v and bias [H] of one dtype on the CPU,
// and at most one of lengths (int64 [B]) and mask (bool [B, Tk]); errors name `op`.
Sizes check_inputs(const char* op, const at::Tensor& query, const at::Tensor& keys,
                   const at::Tensor& values, const at::Tensor& v, const at::Tensor& bias,
                   const std::optional<at::Tensor>& lengths,
                   const std::optional<at::Tensor>& mask);

// Valid keys of each batch row: a prefix length (the kernels only visit s < len) and, for a
// mask, the bool row (all Tk keys are scored, masked ones dropped in the softmax).
struct KeyValidity {
  at::Tensor lengths, mask;  // contiguous copies kept alive
  const int64_t* len = nullptr;
  const bool* mask_ptr = nullptr;
  int64_t Tk = 0;
  int64_t count(int64_t b) const { return len ? len[b] : Tk; }
  const bool* row_mask(int64_t b) const { return mask_ptr ? mask_ptr + b * Tk : nullptr; }
};

KeyValidity key_validity(const char* op, const std::optional<at::Tensor>& lengths,
                         const std::optional<at::Tensor>& mask, int64_t Tk);

// A location-aware step (ESPnet AttLoc, Tacotron 2, ...; caller: seq2seq_fast/nn/convert/
// _location.py): its keys are projected + conv W^T, with conv [B*Tk, C] the location convolution
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
  // bfloat16 steps (T = float): conv's rows and its gradient's are bfloat16 (conv, dconv then
  // nullptr), widened and rounded per item; wt, w, wtp are float32 copies of the weight.
  const Bf16* conv16 = nullptr;
  Bf16* dconv16 = nullptr;
};

// The normalisations of the scores: softmax (exp(e) / sum exp(e)) or sigmoid ("smoothing":
// sigmoid(e) / sum sigmoid(e), Tacotron-style TTS and LAS-style ASR). The sigmoid one is the
// softmax of log sigmoid(e) = min(e, 0) - log1p(exp(-|e|)), so that softmax_rows serves both and
// no |e| overflows or makes a row 0/0 (sigmoid(-1e4) underflows; its log does not); lse is then
// log sum sigmoid(e) of the valid keys.
enum class Normalize : int { kSoftmax = 0, kSigmoid = 1 };

// A scalar score bias b added to every score before the normalisation: sigmoid(e + b) /
// sum sigmoid(e + b) (Coqui TTS's score layer Linear(A, 1, bias=True) under sigmoid; under a
// softmax b cancels, and is added all the same). Its gradient is the sum of the scores' gradients.
struct ScoreShift {
  double value = 0.0;
  bool given = false;
};

// The ops' schema arguments: normalize ("softmax" or "sigmoid") and the optional score bias (one
// element of a floating dtype on the CPU); errors name `op`.
Normalize parse_normalize(const char* op, c10::string_view name);
ScoreShift score_shift(const char* op, const std::optional<at::Tensor>& score_bias);

// (context, weights or an empty tensor, lse) of the attention; loc given: a location-aware step,
// `keys_in` then the projected memory.
template <typename T, typename M>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(
    const at::Tensor& query_in, const at::Tensor& keys_in, const at::Tensor& values_in,
    const at::Tensor& v_in, const at::Tensor& bias_in, const KeyValidity& kv, const Sizes& n,
    bool return_weights, const LocationTerm<T>* loc = nullptr,
    Normalize normalize = Normalize::kSoftmax, ScoreShift shift = {});

// (dquery, dkeys, dvalues, dv, dbias); dkeys_acc given: dkeys added to it (returned as is);
// want_dvalues false: no dvalues (an undefined tensor). DK: the type of the rows dkeys go to.
// grad_shift given: the score bias's gradient (the sum of every score's gradient) written to it.
template <typename T, typename M, typename DK>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const at::Tensor& grad_context, const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& query_in, const at::Tensor& keys_in, const at::Tensor& values_in,
    const at::Tensor& v_in, const at::Tensor& bias_in, const KeyValidity& kv, const Sizes& n,
    const at::Tensor& saved_weights, const at::Tensor& dkeys_acc, bool want_dvalues,
    const LocationTerm<T>* loc = nullptr, Normalize normalize = Normalize::kSoftmax,
    ScoreShift shift = {}, double* grad_shift = nullptr);

}  // namespace seq2seq_fast
