// CPU kernels of the location-aware attention step (_location_attention_fwd / _bwd; caller:
// seq2seq_fast/nn/convert/_location.py): the attention of csrc/additive_attention.cpp with keys
// projected + conv W^T formed per work item (its LocationTerm), never materialised.
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <optional>
#include <tuple>
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
// place), conv [B*Tk, C], weight [H, C]; float32 or float64.
LocationSizes check_location(const char* op, const Tensor& query, const Tensor& projected,
                             const Tensor& conv, const Tensor& weight, const Tensor& values,
                             const Tensor& v, const Tensor& bias,
                             const std::optional<Tensor>& lengths,
                             const std::optional<Tensor>& mask) {
  const Sizes n = check_inputs(op, query, projected, values, v, bias, lengths, mask);
  TORCH_CHECK(n.Tq == 1, op, ": one query per batch row (a decoder step), got query ",
              query.sizes());
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kDouble, op,
              ": float32 or float64 expected, got ", query.scalar_type());
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

// One location-aware step: (context [B, 1, Dv], weights [B, 1, Tk]) of query against the keys
// projected + conv weight^T, which are never materialised.
std::tuple<Tensor, Tensor> location_attention_fwd(const Tensor& query, const Tensor& projected,
                                                  const Tensor& conv_in, const Tensor& weight_in,
                                                  const Tensor& values, const Tensor& v,
                                                  const Tensor& bias,
                                                  const std::optional<Tensor>& lengths,
                                                  const std::optional<Tensor>& mask) {
  const char* op = "seq2seq_fast::_location_attention_fwd";
  const NoAutocast no_autocast;
  const LocationSizes sizes = check_location(op, query, projected, conv_in, weight_in, values, v,
                                             bias, lengths, mask);
  const Sizes& n = sizes.n;
  const int64_t C = sizes.C;
  const KeyValidity kv = key_validity(op, lengths, mask, n.Tk);
  const auto opts = query.options();
  if (n.B == 0) return {at::zeros({n.B, n.Tq, n.Dv}, opts), at::zeros({n.B, n.Tq, n.Tk}, opts)};
  const Tensor conv = conv_in.contiguous(), weight = weight_in.contiguous();
  const Tensor wt = weight.t().contiguous();
  std::tuple<Tensor, Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "_location_attention_fwd", [&] {
    const LocationTerm<scalar_t> loc{conv.data_ptr<scalar_t>(), wt.data_ptr<scalar_t>(), C,
                                     nullptr, nullptr, nullptr, nullptr};
    auto [context, weights, lse] =
        forward_impl<scalar_t, scalar_t>(query, projected, values, v, bias, kv, n, true, &loc);
    out = {context, weights};
  });
  return out;
}

// Its backward: the keys gradient is added into grad_projected (in place; a decoder's steps sum
// there) and multiplied out to conv's and weight's; no values gradient (the caller forms it once
// for all steps, as for _additive_attention_bwd_accumulate). Returns (dquery, dconv, dweight, dv,
// dbias).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> location_attention_bwd(
    const Tensor& grad_context_in, const std::optional<Tensor>& grad_weights,
    const Tensor& query, const Tensor& projected, const Tensor& conv_in, const Tensor& weight_in,
    const Tensor& values, const Tensor& v, const Tensor& bias,
    const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const Tensor& weights, const Tensor& grad_projected) {
  const char* op = "seq2seq_fast::_location_attention_bwd";
  const NoAutocast no_autocast;
  const LocationSizes sizes = check_location(op, query, projected, conv_in, weight_in, values, v,
                                             bias, lengths, mask);
  const Sizes& n = sizes.n;
  const int64_t C = sizes.C;
  const std::vector<int64_t> ctx_shape{n.B, n.Tq, n.Dv};
  TORCH_CHECK(grad_context_in.sizes() == at::IntArrayRef(ctx_shape) &&
                  grad_context_in.scalar_type() == query.scalar_type(),
              op, ": grad_context must be [B, 1, Dv]=[", n.B, ", 1, ", n.Dv, "] of query's dtype, got ",
              grad_context_in.sizes(), " ", grad_context_in.scalar_type());
  const std::vector<int64_t> p_shape{n.B, n.Tq, n.Tk};
  TORCH_CHECK(weights.sizes() == at::IntArrayRef(p_shape) && weights.scalar_type() == query.scalar_type(), op,
              ": weights must be the forward's [B, 1, Tk]=[", n.B, ", 1, ", n.Tk, "], got ",
              weights.sizes());
  TORCH_CHECK(!grad_weights.has_value() ||
                  (grad_weights->sizes() == at::IntArrayRef(p_shape) &&
                   grad_weights->scalar_type() == query.scalar_type()),
              op, ": grad_weights must be [B, 1, Tk] of query's dtype, got ",
              grad_weights.has_value() ? grad_weights->sizes() : at::IntArrayRef());
  TORCH_CHECK(grad_projected.sizes() == projected.sizes() &&
                  grad_projected.scalar_type() == query.scalar_type() &&
                  grad_projected.device().is_cpu() && grad_projected.is_contiguous(),
              op, ": grad_projected must be a contiguous CPU tensor of projected's shape ",
              projected.sizes(), " and dtype, got ", grad_projected.sizes(), " ",
              grad_projected.scalar_type());
  const KeyValidity kv = key_validity(op, lengths, mask, n.Tk);
  const auto opts = query.options();
  Tensor dconv = at::empty({n.B * n.Tk, C}, opts);
  if (n.B == 0) {
    return {at::zeros_like(query), dconv, at::zeros_like(weight_in), at::zeros_like(v),
            at::zeros_like(bias)};
  }
  const Plan plan = make_plan(n.B, n.Tq, n.Tk, n.H);
  TORCH_CHECK(plan.blocks_per_row == 1, op, ": internal: a step's batch row split over items");
  const Tensor conv = conv_in.contiguous(), weight = weight_in.contiguous();
  const Tensor wt = weight.t().contiguous();
  Tensor dweight = at::empty({n.H, C}, opts);
  std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "_location_attention_bwd", [&] {
    const int64_t Hp = round_up(n.H, kPadTo);
    std::vector<scalar_t> dw_parts(static_cast<size_t>(plan.items * C * Hp));
    std::vector<scalar_t> wtp(static_cast<size_t>(C * Hp), scalar_t(0));
    const scalar_t* wtr = wt.data_ptr<scalar_t>();
    for (int64_t c = 0; c < C; ++c) std::copy(wtr + c * n.H, wtr + (c + 1) * n.H, &wtp[c * Hp]);
    const LocationTerm<scalar_t> loc{conv.data_ptr<scalar_t>(),  wtr,        C,
                                     weight.data_ptr<scalar_t>(), wtp.data(), dconv.data_ptr<scalar_t>(),
                                     dw_parts.data()};
    auto [dq, dk, dvalues, dv, dbias] =
        backward_impl<scalar_t, scalar_t, scalar_t>(grad_context_in, grad_weights, query,
                                                    projected, values, v, bias, kv, n, weights,
                                                    grad_projected, false, &loc);
    std::vector<double> sum(static_cast<size_t>(C * Hp), 0.0);  // item order: reproducible
    for (int64_t item = 0; item < plan.items; ++item) {
      const scalar_t* part = dw_parts.data() + item * C * Hp;
      for (int64_t e = 0; e < C * Hp; ++e) sum[e] += part[e];
    }
    scalar_t* dwp = dweight.data_ptr<scalar_t>();  // [H, C] from W^T's [C, Hp]
    for (int64_t h = 0; h < n.H; ++h)
      for (int64_t c = 0; c < C; ++c) dwp[h * C + c] = scalar_t(sum[c * Hp + h]);
    out = {dq, dconv, dweight, dv, dbias};
  });
  return out;
}

}  // namespace
}  // namespace seq2seq_fast

// A location-aware decoder step (private; caller seq2seq_fast/nn/convert/_location.py, fake
// kernels in seq2seq_fast/ops/additive_attention.py).
TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def(
      "_location_attention_fwd(Tensor query, Tensor projected, Tensor conv, Tensor weight, "
      "Tensor values, Tensor v, Tensor bias, Tensor? lengths, Tensor? mask) -> (Tensor, Tensor)");
  m.def(
      "_location_attention_bwd(Tensor grad_context, Tensor? grad_weights, Tensor query, "
      "Tensor projected, Tensor conv, Tensor weight, Tensor values, Tensor v, Tensor bias, "
      "Tensor? lengths, Tensor? mask, Tensor weights, Tensor(a!) grad_projected) -> (Tensor, "
      "Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_location_attention_fwd", &seq2seq_fast::location_attention_fwd);
  m.impl("_location_attention_bwd", &seq2seq_fast::location_attention_bwd);
}
