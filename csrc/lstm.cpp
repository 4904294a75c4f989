// CPU kernels of one LSTM cell step from given gate projections (_lstm_cell_fwd / _bwd), for the
// Bahdanau decoder, which forms the projections itself (seq2seq_fast/ops/recurrent.py). The gate
// pass is a kernel-table function (kernels/kernels.h, chosen at run time like the attention's).
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>

#include "bf16.h"
#include "recurrent.h"
#include "runtime.h"

namespace seq2seq_fast {
namespace {

using at::Tensor;

// bfloat16: each row's inputs converted into L1-resident float32 rows, the float32 gate pass,
// its outputs rounded to bfloat16 (saved stays float32): no whole-tensor copy.
const Bf16* bf16_rows(const Tensor& t) {
  return reinterpret_cast<const Bf16*>(t.data_ptr<at::BFloat16>());
}
Bf16* bf16_out(const Tensor& t) { return const_cast<Bf16*>(bf16_rows(t)); }

std::tuple<Tensor, Tensor, Tensor> lstm_cell_fwd_bf16(const Tensor& gi, const Tensor& gh,
                                                      const Tensor& c_in) {
  const int64_t B = c_in.size(0), H = c_in.size(1), G = 4 * H;
  const Tensor c = c_in.contiguous();
  Tensor h = at::empty({B, H}, c.options());
  Tensor c_new = at::empty({B, H}, c.options());
  Tensor saved = at::empty({B, 5 * H}, c.options().dtype(at::kFloat));
  const auto& kt = runtime_kernels<float>();
  const Bf16 *gi_p = bf16_rows(gi), *gh_p = bf16_rows(gh), *c_p = bf16_rows(c);
  Bf16 *h_p = bf16_out(h), *cn_p = bf16_out(c_new);
  float* s_p = saved.data_ptr<float>();
  const int64_t si = gi.stride(0), sh = gh.stride(0);
  for_rows(B, 5 * H, [&](int64_t begin, int64_t end) {
    float* rows = thread_scratch<float>(Slot::kOutRows, 2 * G + 3 * H);
    float *x = rows, *y = rows + G, *cp = rows + 2 * G, *hn = cp + H, *cn = hn + H;
    for (int64_t b = begin; b < end; ++b) {
      kt.from_bf16(gi_p + b * si, G, x);
      kt.from_bf16(gh_p + b * sh, G, y);
      kt.from_bf16(c_p + b * H, H, cp);
      kt.lstm_gates_fwd(x, y, cp, hn, cn, s_p + b * 5 * H, H);
      kt.to_bf16(hn, H, h_p + b * H);
      kt.to_bf16(cn, H, cn_p + b * H);
    }
  });
  return {h, c_new, saved};
}

std::tuple<Tensor, Tensor> lstm_cell_bwd_bf16(const Tensor& grad_h_in, const Tensor& grad_c_in,
                                              const Tensor& saved, const Tensor& c_in) {
  const Tensor grad_h = grad_h_in.contiguous(), grad_c = grad_c_in.contiguous();
  const Tensor c = c_in.contiguous();
  const int64_t B = c.size(0), H = c.size(1), G = 4 * H;
  TORCH_CHECK(grad_h.sizes() == c.sizes() && grad_c.sizes() == c.sizes() && is_bf16(grad_h) &&
                  is_bf16(grad_c) && saved.dim() == 2 && saved.size(0) == B &&
                  saved.size(1) == 5 * H && saved.scalar_type() == at::kFloat &&
                  saved.is_contiguous(),
              "_lstm_cell_bwd: inconsistent saved tensors");
  Tensor d_gates = at::empty({B, G}, c.options());
  Tensor dc = at::empty({B, H}, c.options());
  const auto& kt = runtime_kernels<float>();
  const float* s_p = saved.data_ptr<float>();
  const Bf16 *c_p = bf16_rows(c), *gh_p = bf16_rows(grad_h), *gc_p = bf16_rows(grad_c);
  Bf16 *d_p = bf16_out(d_gates), *dc_p = bf16_out(dc);
  for_rows(B, 5 * H, [&](int64_t begin, int64_t end) {
    float* rows = thread_scratch<float>(Slot::kOutRows, G + 4 * H);
    float *dg = rows, *cp = rows + G, *dh = cp + H, *dcn = dh + H, *dcp = dcn + H;
    for (int64_t b = begin; b < end; ++b) {
      kt.from_bf16(c_p + b * H, H, cp);
      kt.from_bf16(gh_p + b * H, H, dh);
      kt.from_bf16(gc_p + b * H, H, dcn);
      kt.lstm_gates_bwd(s_p + b * 5 * H, cp, dh, dcn, dg, dcp, H);
      kt.to_bf16(dg, G, d_p + b * G);
      kt.to_bf16(dcp, H, dc_p + b * H);
    }
  });
  return {d_gates, dc};
}

// One LSTM cell step from its two gate projections (nn.LSTMCell's math, biases included):
// gates_in, gates_hidden [B, 4H] (rows may be strided), c [B, H] -> (h, c_new [B, H],
// saved [B, 5H]).
std::tuple<Tensor, Tensor, Tensor> lstm_cell_fwd(const Tensor& gates_in,
                                                 const Tensor& gates_hidden, const Tensor& c_in) {
  Tensor gi, gh;
  std::tie(gi, gh) = check_cell("_lstm_cell", gates_in, gates_hidden, c_in, 4);
  if (is_bf16(c_in)) return lstm_cell_fwd_bf16(gi, gh, c_in);
  const int64_t B = c_in.size(0), H = c_in.size(1);
  const Tensor c = c_in.contiguous();
  Tensor h = at::empty({B, H}, c.options());
  Tensor c_new = at::empty({B, H}, c.options());
  Tensor saved = at::empty({B, 5 * H}, c.options());
  AT_DISPATCH_FLOATING_TYPES(c.scalar_type(), "_lstm_cell_fwd", [&] {
    const auto& kt = runtime_kernels<scalar_t>();
    const scalar_t* gi_p = gi.data_ptr<scalar_t>();
    const scalar_t* gh_p = gh.data_ptr<scalar_t>();
    const scalar_t* c_p = c.data_ptr<scalar_t>();
    scalar_t* h_p = h.data_ptr<scalar_t>();
    scalar_t* cn_p = c_new.data_ptr<scalar_t>();
    scalar_t* s_p = saved.data_ptr<scalar_t>();
    const int64_t si = gi.stride(0), sh = gh.stride(0);
    for_rows(B, 5 * H, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        kt.lstm_gates_fwd(gi_p + b * si, gh_p + b * sh, c_p + b * H, h_p + b * H, cn_p + b * H,
                          s_p + b * 5 * H, H);
      }
    });
  });
  return {h, c_new, saved};
}

// grad_h, grad_c [B, H], saved, c -> (d gates [B, 4H] (of gates_in and gates_hidden alike),
// dc [B, H]).
std::tuple<Tensor, Tensor> lstm_cell_bwd(const Tensor& grad_h_in, const Tensor& grad_c_in,
                                         const Tensor& saved, const Tensor& c_in) {
  if (is_bf16(c_in)) return lstm_cell_bwd_bf16(grad_h_in, grad_c_in, saved, c_in);
  const Tensor grad_h = grad_h_in.contiguous(), grad_c = grad_c_in.contiguous();
  const Tensor c = c_in.contiguous();
  const int64_t B = c.size(0), H = c.size(1);
  TORCH_CHECK(grad_h.sizes() == c.sizes() && grad_c.sizes() == c.sizes() && saved.dim() == 2 &&
                  saved.size(0) == B && saved.size(1) == 5 * H && saved.is_contiguous(),
              "_lstm_cell_bwd: inconsistent saved tensors");
  Tensor d_gates = at::empty({B, 4 * H}, c.options());
  Tensor dc = at::empty({B, H}, c.options());
  AT_DISPATCH_FLOATING_TYPES(c.scalar_type(), "_lstm_cell_bwd", [&] {
    const auto& kt = runtime_kernels<scalar_t>();
    const scalar_t* s_p = saved.data_ptr<scalar_t>();
    const scalar_t* c_p = c.data_ptr<scalar_t>();
    const scalar_t* gh_p = grad_h.data_ptr<scalar_t>();
    const scalar_t* gc_p = grad_c.data_ptr<scalar_t>();
    scalar_t* d_p = d_gates.data_ptr<scalar_t>();
    scalar_t* dc_p = dc.data_ptr<scalar_t>();
    for_rows(B, 5 * H, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        kt.lstm_gates_bwd(s_p + b * 5 * H, c_p + b * H, gh_p + b * H, gc_p + b * H,
                          d_p + b * 4 * H, dc_p + b * H, H);
      }
    });
  });
  return {d_gates, dc};
}

}  // namespace
}  // namespace seq2seq_fast

TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def(
      "_lstm_cell_fwd(Tensor gates_in, Tensor gates_hidden, Tensor c) -> (Tensor, Tensor, "
      "Tensor)");
  m.def("_lstm_cell_bwd(Tensor grad_h, Tensor grad_c, Tensor saved, Tensor c) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_lstm_cell_fwd", &seq2seq_fast::lstm_cell_fwd);
  m.impl("_lstm_cell_bwd", &seq2seq_fast::lstm_cell_bwd);
}
