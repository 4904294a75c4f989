// CPU kernels of the location-aware attention step (_location_attention_fwd / _bwd; caller:
// seq2seq_fast/nn/convert/_location.py): the attention of csrc/additive_attention.cpp with keys
// projected + conv W^T formed per work item (its LocationTerm), never materialised. float32,
// float64, or bfloat16 (csrc/bf16.h: rows read and written as bfloat16, float32 arithmetic; the
// weight W, parameter-sized, is copied to float32 as the float32 op copies its transpose).
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "additive_attention.h"
#include "bf16.h"
#include "runtime.h"

namespace seq2seq_fast {
namespace {

using at::Tensor;

// ---- location-aware steps ---------------------------------------------------------------------

struct LocationSizes {
  Sizes n;
  int64_t C;
};

// The checks of a location-aware step's inputs: query [B, 1, H], projected [B, Tk, H] (in keys'
// place), conv [B*Tk, C], weight [H, C]; float32, float64 or bfloat16.
LocationSizes check_location(const char* op, const Tensor& query, const Tensor& projected,
                             const Tensor& conv, const Tensor& weight, const Tensor& values,
                             const Tensor& v, const Tensor& bias,
                             const std::optional<Tensor>& lengths,
                             const std::optional<Tensor>& mask) {
  const Sizes n = check_inputs(op, query, projected, values, v, bias, lengths, mask);
  TORCH_CHECK(n.Tq == 1, op, ": one query per batch row (a decoder step), got query ",
              query.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == n.H, op, ": weight must be [H=", n.H,
              ", C], got ", weight.sizes());
  const int64_t C = weight.size(1);
  TORCH_CHECK(conv.dim() == 2 && conv.size(0) == n.B * n.Tk && conv.size(1) == C, op,
              ": conv must be [B*Tk, C]=[", n.B * n.Tk, ", ", C, "], got ", conv.sizes());
  for (const Tensor* t : {&conv, &weight}) {
    TORCH_CHECK(t->scalar_type() == query.scalar_type() && t->device().is_cpu(), op,
                ": conv and weight must be CPU tensors of query's dtype ", query.scalar_type(),
                ", got ", t->scalar_type(), " on ", t->device());
  }
  return {n, C};
}

// A step's weight W [H, C] as the passes read it, in T: W^T [C, H], W [H, C] and W^T with rows
// padded to Hp [C, Hp] (the backward's).
template <typename T>
struct LocationWeight {
  Tensor w, wt;
  std::vector<T> wtp;
  LocationWeight(const Tensor& weight, int64_t H, int64_t Hp, bool padded) {
    w = weight.to(c10::CppTypeToScalarType<T>::value).contiguous();
    wt = w.t().contiguous();
    if (!padded) return;
    const int64_t C = w.size(1);
    wtp.assign(static_cast<size_t>(C * Hp), T(0));
    const T* wtr = wt.data_ptr<T>();
    for (int64_t c = 0; c < C; ++c) std::copy(wtr + c * H, wtr + (c + 1) * H, &wtp[c * Hp]);
  }
};

// conv's rows for the LocationTerm: T rows, or bfloat16 ones (conv16).
template <typename T, typename M>
void set_conv(LocationTerm<T>& loc, const Tensor& conv, const Tensor& dconv) {
  if constexpr (std::is_same_v<T, M>) {
    loc.conv = conv.data_ptr<T>();
    if (dconv.defined()) loc.dconv = dconv.data_ptr<T>();
  } else {
    loc.conv16 = reinterpret_cast<const Bf16*>(conv.data_ptr<at::BFloat16>());
    if (dconv.defined()) loc.dconv16 = reinterpret_cast<Bf16*>(dconv.data_ptr<at::BFloat16>());
  }
}

template <typename T, typename M>
std::tuple<Tensor, Tensor> location_forward(const Tensor& query, const Tensor& projected,
                                            const Tensor& conv, const Tensor& weight,
                                            const Tensor& values, const Tensor& v,
                                            const Tensor& bias, const KeyValidity& kv,
                                            const Sizes& n, int64_t C, Normalize normalize,
                                            ScoreShift shift) {
  const LocationWeight<T> w(weight, n.H, 0, false);
  const T* wt = w.wt.template data_ptr<T>();
  LocationTerm<T> loc{nullptr, wt, C, nullptr, nullptr, nullptr, nullptr};
  set_conv<T, M>(loc, conv, Tensor());
  auto [context, weights, lse] =
      forward_impl<T, M>(query, projected, values, v, bias, kv, n, true, &loc, normalize, shift);
  return {context, weights};
}

// One location-aware step: (context [B, 1, Dv], weights [B, 1, Tk]) of query against the keys
// projected + conv weight^T, which are never materialised.
std::tuple<Tensor, Tensor> location_attention_fwd(const Tensor& query, const Tensor& projected,
                                                  const Tensor& conv_in, const Tensor& weight,
                                                  const Tensor& values, const Tensor& v,
                                                  const Tensor& bias,
                                                  const std::optional<Tensor>& lengths,
                                                  const std::optional<Tensor>& mask,
                                                  c10::string_view normalize_name,
                                                  const std::optional<Tensor>& score_bias) {
  const char* op = "seq2seq_fast::_location_attention_fwd";
  const NoAutocast no_autocast;
  const Normalize normalize = parse_normalize(op, normalize_name);
  const ScoreShift shift = score_shift(op, score_bias);
  const LocationSizes sizes = check_location(op, query, projected, conv_in, weight, values, v,
                                             bias, lengths, mask);
  const Sizes& n = sizes.n;
  const KeyValidity kv = key_validity(op, lengths, mask, n.Tk);
  const auto opts = query.options();
  if (n.B == 0) return {at::zeros({n.B, n.Tq, n.Dv}, opts), at::zeros({n.B, n.Tq, n.Tk}, opts)};
  const Tensor conv = conv_in.contiguous();
  if (is_bf16(query)) {  // bfloat16 rows, float32 arithmetic
    return location_forward<float, Bf16>(query, projected, conv, weight, values, v, bias, kv, n,
                                         sizes.C, normalize, shift);
  }
  if (query.scalar_type() == at::kDouble) {
    return location_forward<double, double>(query, projected, conv, weight, values, v, bias, kv,
                                            n, sizes.C, normalize, shift);
  }
  return location_forward<float, float>(query, projected, conv, weight, values, v, bias, kv, n,
                                        sizes.C, normalize, shift);
}

// The backward's work once checked (DK: grad_projected's element type).
template <typename T, typename M, typename DK>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> location_backward(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query,
    const Tensor& projected, const Tensor& conv, const Tensor& weight, const Tensor& values,
    const Tensor& v, const Tensor& bias, const KeyValidity& kv, const Sizes& n, int64_t C,
    const Tensor& weights, const Tensor& grad_projected, const Plan& plan, Normalize normalize,
    ScoreShift shift, double* grad_shift) {
  const auto opts = query.options();
  const int64_t Hp = round_up(n.H, kPadTo);
  Tensor dconv = at::empty({n.B * n.Tk, C}, opts);
  const LocationWeight<T> w(weight, n.H, Hp, true);
  std::vector<T> dw_parts(static_cast<size_t>(plan.items * C * Hp));
  const T* wt = w.wt.template data_ptr<T>();
  LocationTerm<T> loc{nullptr, wt, C, w.w.template data_ptr<T>(), w.wtp.data(), nullptr,
                      dw_parts.data()};
  set_conv<T, M>(loc, conv, dconv);
  auto [dq, dk, dvalues, dv, dbias] =
      // (the sigmoid normalisation recomputes the weights: it needs 1 - sigmoid(e) too)
      backward_impl<T, M, DK>(grad_context, grad_weights, query, projected, values, v, bias, kv, n,
                              normalize == Normalize::kSoftmax ? weights : Tensor(),
                              grad_projected, false, &loc, normalize, shift, grad_shift);
  std::vector<double> sum(static_cast<size_t>(C * Hp), 0.0);  // item order: reproducible
  for (int64_t item = 0; item < plan.items; ++item) {
    const T* part = dw_parts.data() + item * C * Hp;
    for (int64_t e = 0; e < C * Hp; ++e) sum[e] += part[e];
  }
  Tensor dweight = at::empty({n.H, C}, opts);  // [H, C] from W^T's [C, Hp]
  if constexpr (std::is_same_v<T, M>) {
    T* dwp = dweight.data_ptr<T>();
    for (int64_t h = 0; h < n.H; ++h)
      for (int64_t c = 0; c < C; ++c) dwp[h * C + c] = T(sum[c * Hp + h]);
  } else {
    Bf16* dwp = reinterpret_cast<Bf16*>(dweight.data_ptr<at::BFloat16>());
    for (int64_t h = 0; h < n.H; ++h)
      for (int64_t c = 0; c < C; ++c) dwp[h * C + c] = float_to_bf16(float(sum[c * Hp + h]));
  }
  return {dq, dconv, dweight, dv, dbias};
}

// Its backward: the keys gradient is added into grad_projected (in place; a decoder's steps sum
// there; for bfloat16 inputs it may be float32: exact sums over the steps) and multiplied out to
// conv's and weight's; no values gradient (the caller forms it once for all steps, as for
// _additive_attention_bwd_accumulate). Returns (dquery, dconv, dweight, dv, dbias).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> checked_location_bwd(
    const char* op, const Tensor& grad_context_in, const std::optional<Tensor>& grad_weights,
    const Tensor& query, const Tensor& projected, const Tensor& conv_in, const Tensor& weight,
    const Tensor& values, const Tensor& v, const Tensor& bias,
    const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const Tensor& weights, const Tensor& grad_projected, Normalize normalize, ScoreShift shift,
    double* grad_shift) {
  const NoAutocast no_autocast;
  const LocationSizes sizes = check_location(op, query, projected, conv_in, weight, values, v,
                                             bias, lengths, mask);
  const Sizes& n = sizes.n;
  const int64_t C = sizes.C;
  const std::vector<int64_t> ctx_shape{n.B, n.Tq, n.Dv};
  TORCH_CHECK(grad_context_in.sizes() == at::IntArrayRef(ctx_shape) &&
                  grad_context_in.scalar_type() == query.scalar_type(),
              op, ": grad_context must be [B, 1, Dv]=[", n.B, ", 1, ", n.Dv,
              "] of query's dtype, got ", grad_context_in.sizes(), " ",
              grad_context_in.scalar_type());
  const std::vector<int64_t> p_shape{n.B, n.Tq, n.Tk};
  TORCH_CHECK(weights.sizes() == at::IntArrayRef(p_shape) &&
                  weights.scalar_type() == query.scalar_type(),
              op, ": weights must be the forward's [B, 1, Tk]=[", n.B, ", 1, ", n.Tk, "], got ",
              weights.sizes());
  TORCH_CHECK(!grad_weights.has_value() ||
                  (grad_weights->sizes() == at::IntArrayRef(p_shape) &&
                   grad_weights->scalar_type() == query.scalar_type()),
              op, ": grad_weights must be [B, 1, Tk] of query's dtype, got ",
              grad_weights.has_value() ? grad_weights->sizes() : at::IntArrayRef());
  const bool float_acc = is_bf16(query) && grad_projected.scalar_type() == at::kFloat;
  TORCH_CHECK(grad_projected.sizes() == projected.sizes() &&
                  (grad_projected.scalar_type() == query.scalar_type() || float_acc) &&
                  grad_projected.device().is_cpu() && grad_projected.is_contiguous(),
              op, ": grad_projected must be a contiguous CPU tensor of projected's shape ",
              projected.sizes(), " and dtype (or float32 for bfloat16), got ",
              grad_projected.sizes(), " ", grad_projected.scalar_type());
  const KeyValidity kv = key_validity(op, lengths, mask, n.Tk);
  if (grad_shift != nullptr) *grad_shift = 0.0;
  if (n.B == 0) {
    const auto zeros = [](const Tensor& t) { return at::zeros(t.sizes(), t.options()); };
    return {zeros(query), at::empty({0, C}, query.options()), zeros(weight), zeros(v),
            zeros(bias)};
  }
  const Plan plan = make_plan(n.B, n.Tq, n.Tk, n.H);
  TORCH_CHECK(plan.blocks_per_row == 1, op, ": internal: a step's batch row split over items");
  const Tensor conv = conv_in.contiguous();
  if (is_bf16(query)) {  // bfloat16 rows, float32 arithmetic
    if (float_acc) {
      return location_backward<float, Bf16, float>(grad_context_in, grad_weights, query,
                                                   projected, conv, weight, values, v, bias, kv,
                                                   n, C, weights, grad_projected, plan, normalize, shift, grad_shift);
    }
    return location_backward<float, Bf16, Bf16>(grad_context_in, grad_weights, query, projected,
                                                conv, weight, values, v, bias, kv, n, C, weights,
                                                grad_projected, plan, normalize, shift, grad_shift);
  }
  if (query.scalar_type() == at::kDouble) {
    return location_backward<double, double, double>(grad_context_in, grad_weights, query,
                                                     projected, conv, weight, values, v, bias, kv,
                                                     n, C, weights, grad_projected, plan, normalize, shift, grad_shift);
  }
  return location_backward<float, float, float>(grad_context_in, grad_weights, query, projected,
                                                conv, weight, values, v, bias, kv, n, C, weights,
                                                grad_projected, plan, normalize, shift, grad_shift);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> location_attention_bwd(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query,
    const Tensor& projected, const Tensor& conv, const Tensor& weight, const Tensor& values,
    const Tensor& v, const Tensor& bias, const std::optional<Tensor>& lengths,
    const std::optional<Tensor>& mask, const Tensor& weights, const Tensor& grad_projected,
    c10::string_view normalize_name) {
  const char* op = "seq2seq_fast::_location_attention_bwd";
  return checked_location_bwd(op, grad_context, grad_weights, query, projected, conv, weight,
                              values, v, bias, lengths, mask, weights, grad_projected,
                              parse_normalize(op, normalize_name), {}, nullptr);
}

// With a score bias: the five gradients, then the score bias's (its shape and dtype).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> location_attention_bwd_score_bias(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query,
    const Tensor& projected, const Tensor& conv, const Tensor& weight, const Tensor& values,
    const Tensor& v, const Tensor& bias, const std::optional<Tensor>& lengths,
    const std::optional<Tensor>& mask, const Tensor& weights, const Tensor& grad_projected,
    c10::string_view normalize_name, const Tensor& score_bias) {
  const char* op = "seq2seq_fast::_location_attention_bwd.score_bias";
  double grad_shift = 0.0;
  auto [dq, dconv, dweight, dv, dbias] = checked_location_bwd(
      op, grad_context, grad_weights, query, projected, conv, weight, values, v, bias, lengths,
      mask, weights, grad_projected, parse_normalize(op, normalize_name),
      score_shift(op, score_bias), &grad_shift);
  return {dq, dconv, dweight, dv, dbias, at::full_like(score_bias, grad_shift)};
}

}  // namespace
}  // namespace seq2seq_fast

// A location-aware decoder step (private; caller seq2seq_fast/nn/convert/_location.py, fake
// kernels in seq2seq_fast/ops/additive_attention.py).
TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def(
      "_location_attention_fwd(Tensor query, Tensor projected, Tensor conv, Tensor weight, "
      "Tensor values, Tensor v, Tensor bias, Tensor? lengths, Tensor? mask, "
      "str normalize=\"softmax\", Tensor? score_bias=None) -> (Tensor, Tensor)");
  m.def(
      "_location_attention_bwd(Tensor grad_context, Tensor? grad_weights, Tensor query, "
      "Tensor projected, Tensor conv, Tensor weight, Tensor values, Tensor v, Tensor bias, "
      "Tensor? lengths, Tensor? mask, Tensor weights, Tensor(a!) grad_projected, "
      "str normalize=\"softmax\") -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "_location_attention_bwd.score_bias(Tensor grad_context, Tensor? grad_weights, "
      "Tensor query, Tensor projected, Tensor conv, Tensor weight, Tensor values, Tensor v, "
      "Tensor bias, Tensor? lengths, Tensor? mask, Tensor weights, Tensor(a!) grad_projected, "
      "str normalize, Tensor score_bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_location_attention_fwd", &seq2seq_fast::location_attention_fwd);
  m.impl("_location_attention_bwd", &seq2seq_fast::location_attention_bwd);
  m.impl("_location_attention_bwd.score_bias", &seq2seq_fast::location_attention_bwd_score_bias);
}
