// CPU kernels of the GRU recurrence (seq2seq_fast/ops/recurrent.py): one op for the forward over
// all time steps, one for the backward, so a GRU layer costs one matrix product and one fused gate
// pass per step instead of a dozen small ops and autograd nodes. Also one GRU cell step from given
// gate projections (_gru_cell_*) for the Bahdanau decoder, which forms them itself (the LSTM cell's
// twin is csrc/lstm.cpp).
//
// With gx = x W_ih^T + b_ih [B, T, 3H] precomputed (one product over all steps, by the caller)
// and gh_t = h_{t-1} W_hh^T + b_hh, the gates are PyTorch's (nn.GRU, "linear before reset"):
//   r = sigmoid(gx_r + gh_r),  z = sigmoid(gx_z + gh_z),  n = tanh(gx_n + r * gh_n),
//   h_t = n + z * (h_{t-1} - n) = (1 - z) n + z h_{t-1}.
// The forward keeps (r, z, n, gh_n) per step [B, T, 4H] for the backward, which walks the steps
// backwards with one product per step (dh_{t-1} += dgh_t W_hh) and forms dW_hh = sum_t dgh_t^T
// h_{t-1} and db_hh as one product / one sum over all steps at the end.
//
// The gate passes are kernel-table functions (csrc/kernels/kernels.h, compiled per instruction set and
// chosen at run time like the attention's): sigmoid(a) = 1 / (1 + exp(-a)) and
// tanh(a) = 1 - 2 / (1 + exp(2a)) with the tables' exp; inf and NaN propagate as in torch (exp
// saturates, 1 / (1 + inf) = 0).
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <tuple>
#include <utility>

#include "bf16.h"
#include "recurrent.h"
#include "runtime.h"

namespace seq2seq_fast {

using at::Tensor;

// A cell op's inputs: gate projections [B, gates * H] (unit stride along the row), the state
// [B, H]; float32/64 CPU tensors of one dtype. Returns the projections with unit inner stride.
std::pair<Tensor, Tensor> check_cell(const char* op, const Tensor& gates_in,
                                     const Tensor& gates_hidden, const Tensor& state,
                                     int64_t gates) {
  TORCH_CHECK(state.dim() == 2 && state.size(1) > 0, op, ": the state must be [B, H], got ",
              state.sizes());
  const auto dtype = state.scalar_type();
  TORCH_CHECK(state.device().is_cpu() &&
                  (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16),
              op, ": float32, float64 or bfloat16 CPU tensors, got ", dtype);
  const int64_t B = state.size(0), G = gates * state.size(1);
  for (const Tensor* t : {&gates_in, &gates_hidden}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->size(1) == G, op,
                ": gate projections must be [B=", B, ", ", gates, "H=", G, "], got ", t->sizes());
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == state.scalar_type(), op,
                ": tensors must be on the CPU with one dtype");
  }
  return {gates_in.stride(1) == 1 ? gates_in : gates_in.contiguous(),
          gates_hidden.stride(1) == 1 ? gates_hidden : gates_hidden.contiguous()};
}

namespace {

void check_gru(const Tensor& gx, const Tensor& h0, const Tensor& w_hh,
               const c10::optional<Tensor>& b_hh) {
  TORCH_CHECK(gx.dim() == 3, "_gru_recurrence: gx must be [B, T, 3H], got ", gx.sizes());
  const int64_t B = gx.size(0), G = gx.size(2);
  TORCH_CHECK(G % 3 == 0 && G > 0, "_gru_recurrence: gx's last size must be 3H, got ", G);
  const int64_t H = G / 3;
  TORCH_CHECK(h0.dim() == 2 && h0.size(0) == B && h0.size(1) == H,
              "_gru_recurrence: h0 must be [B=", B, ", H=", H, "], got ", h0.sizes());
  TORCH_CHECK(w_hh.dim() == 2 && w_hh.size(0) == G && w_hh.size(1) == H,
              "_gru_recurrence: w_hh must be [3H=", G, ", H=", H, "], got ", w_hh.sizes());
  // bfloat16 gx and h0 may come with float32 w_hh and b_hh (the recurrent product in float32).
  const auto weight_dtype = w_hh.scalar_type();
  const bool weight_ok = weight_dtype == gx.scalar_type() ||
                         (is_bf16(gx) && weight_dtype == at::kFloat);
  TORCH_CHECK(weight_ok && w_hh.device().is_cpu(), "_gru_recurrence: w_hh must be a CPU tensor of ",
              "gx's dtype (or float32 for bfloat16 gx), got ", weight_dtype);
  TORCH_CHECK(!b_hh.has_value() || (b_hh->dim() == 1 && b_hh->size(0) == G &&
                                    b_hh->device().is_cpu() &&
                                    b_hh->scalar_type() == weight_dtype),
              "_gru_recurrence: b_hh must be a CPU [3H=", G, "] tensor of w_hh's dtype");
  for (const Tensor* t : {&gx, &h0}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == gx.scalar_type(),
                "_gru_recurrence: gx and h0 must be CPU tensors of one dtype");
  }
  const auto dtype = gx.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16,
              "_gru_recurrence: float32, float64 or bfloat16, got ", dtype);
}

// bfloat16 gx and h0 (w_hh, b_hh bfloat16 or float32): the state, the gates and the per-step
// product h W_hh^T in float32 (at a batch like 64 that product is faster in float32 than in
// bfloat16, and the state keeps float32 accuracy over the steps). gx is read and hs written a row
// at a time through L1-resident float32 rows (the tables' from_bf16 / to_bf16): no whole-tensor
// copy. saved [B, T, 5H] float32 is [r | z | n | gh_n | h_t]: h_t in float32 is the next step's
// product input and the backward's.
std::tuple<Tensor, Tensor> gru_recurrence_fwd_bf16(const Tensor& gx_in, const Tensor& h0_in,
                                                   const Tensor& w_hh,
                                                   const c10::optional<Tensor>& b_hh) {
  const Tensor gx = gx_in.contiguous();
  const int64_t B = gx.size(0), T_ = gx.size(1), G = gx.size(2), H = G / 3;
  const auto f32 = gx.options().dtype(at::kFloat);
  Tensor hs = at::empty({B, T_, H}, gx.options());
  Tensor saved = at::empty({B, T_, 5 * H}, f32);
  Tensor gh = at::empty({B, G}, f32);
  const Tensor h0 = h0_in.to(at::kFloat).contiguous();  // [B, H]: a state, not a sequence
  const Tensor w_t = w_hh.to(at::kFloat).t();            // no copy for float32 weights
  const Tensor bias = b_hh.has_value() ? b_hh->to(at::kFloat) : Tensor();
  const auto& kt = runtime_kernels<float>();
  const Bf16* gx_p = reinterpret_cast<const Bf16*>(gx.data_ptr<at::BFloat16>());
  Bf16* h_p = reinterpret_cast<Bf16*>(hs.data_ptr<at::BFloat16>());
  float* s_p = saved.data_ptr<float>();
  const float* gh_p = gh.data_ptr<float>();
  for (int64_t t = 0; t < T_; ++t) {
    const Tensor h_prev = t == 0 ? h0 : saved.select(1, t - 1).narrow(1, 4 * H, H);
    if (bias.defined()) {
      at::addmm_out(gh, bias, h_prev, w_t);
    } else {
      at::mm_out(gh, h_prev, w_t);
    }
    const float* hp_p = h_prev.data_ptr<float>();
    const int64_t hp_stride = h_prev.stride(0);
    for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
      float* gx_row = thread_scratch<float>(Slot::kOutRows, G);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t bt = b * T_ + t;
        float* s_row = s_p + bt * 5 * H;
        kt.from_bf16(gx_p + bt * G, G, gx_row);
        kt.gru_gates_fwd(gx_row, gh_p + b * G, hp_p + b * hp_stride, s_row + 4 * H, s_row, H);
        kt.to_bf16(s_row + 4 * H, H, h_p + bt * H);
      }
    });
  }
  return {hs, saved};
}

std::tuple<Tensor, Tensor> gru_recurrence_fwd(const Tensor& gx_in, const Tensor& h0_in,
                                              const Tensor& w_hh,
                                              const c10::optional<Tensor>& b_hh) {
  const NoAutocast no_autocast;
  check_gru(gx_in, h0_in, w_hh, b_hh);
  if (is_bf16(gx_in)) return gru_recurrence_fwd_bf16(gx_in, h0_in, w_hh, b_hh);
  const Tensor gx = gx_in.contiguous(), h0 = h0_in.contiguous();
  const int64_t B = gx.size(0), T_ = gx.size(1), G = gx.size(2), H = G / 3;
  Tensor hs = at::empty({B, T_, H}, gx.options());
  Tensor saved = at::empty({B, T_, 4 * H}, gx.options());
  Tensor gh = at::empty({B, G}, gx.options());
  const Tensor w_t = w_hh.t();
  AT_DISPATCH_FLOATING_TYPES(gx.scalar_type(), "_gru_recurrence_fwd", [&] {
    for (int64_t t = 0; t < T_; ++t) {
      const Tensor h_prev = t == 0 ? h0 : hs.select(1, t - 1);  // [B, H], row stride T*H
      if (b_hh.has_value()) {
        at::addmm_out(gh, *b_hh, h_prev, w_t);
      } else {
        at::mm_out(gh, h_prev, w_t);
      }
      const scalar_t* gx_p = gx.data_ptr<scalar_t>();
      const scalar_t* gh_p = gh.data_ptr<scalar_t>();
      const scalar_t* hp_p = h_prev.data_ptr<scalar_t>();
      const int64_t hp_stride = h_prev.stride(0);
      scalar_t* h_p = hs.data_ptr<scalar_t>();
      scalar_t* s_p = saved.data_ptr<scalar_t>();
      const auto& kt = runtime_kernels<scalar_t>();
      for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t bt = b * T_ + t;
          kt.gru_gates_fwd(gx_p + bt * G, gh_p + b * G, hp_p + b * hp_stride, h_p + bt * H,
                           s_p + bt * 4 * H, H);
        }
      });
    }
  });
  return {hs, saved};
}

// grad_hs [B, T, H] (gradient of every output, the last state's included) -> (dgx [B, T, 3H],
// dh0 [B, H], dw_hh [3H, H], db_hh [3H] (empty without bias)).
// The backward of gru_recurrence_fwd_bf16: the carried gradient, the gates' gradients dgh and
// the weight gradient sums in float32 (dW_hh, db_hh returned in w_hh's dtype); grad_hs read and dgx
// written a row at a time through L1-resident float32 rows.
std::tuple<Tensor, Tensor, Tensor, Tensor> gru_recurrence_bwd_bf16(const Tensor& grad_hs_in,
                                                                   const Tensor& h0_in,
                                                                   const Tensor& hs,
                                                                   const Tensor& saved,
                                                                   const Tensor& w_hh,
                                                                   bool has_bias) {
  const Tensor grad_hs = grad_hs_in.contiguous();
  const int64_t B = hs.size(0), T_ = hs.size(1), H = hs.size(2), G = 3 * H;
  TORCH_CHECK(grad_hs.sizes() == hs.sizes() && is_bf16(grad_hs) && saved.dim() == 3 &&
                  saved.size(0) == B && saved.size(1) == T_ && saved.size(2) == 5 * H &&
                  saved.scalar_type() == at::kFloat && saved.is_contiguous(),
              "_gru_recurrence_bwd: inconsistent saved tensors");
  const auto f32 = hs.options().dtype(at::kFloat);
  const auto wopts = w_hh.options();
  Tensor dgx = at::empty({B, T_, G}, hs.options());
  Tensor dgh = at::empty({B, T_, G}, f32);
  Tensor carry = at::zeros({B, H}, f32);  // dL/dh_t from the steps after t
  if (T_ == 0) {
    return {dgx, carry.to(h0_in.scalar_type()), at::zeros({G, H}, wopts),
            has_bias ? at::zeros({G}, wopts) : at::empty({0}, wopts)};
  }
  const Tensor h0 = h0_in.to(at::kFloat).contiguous();
  const Tensor w = w_hh.to(at::kFloat);
  const auto& kt = runtime_kernels<float>();
  const Bf16* go_p = reinterpret_cast<const Bf16*>(grad_hs.data_ptr<at::BFloat16>());
  Bf16* dgx_p = reinterpret_cast<Bf16*>(dgx.data_ptr<at::BFloat16>());
  const float* s_p = saved.data_ptr<float>();
  float* dgh_p = dgh.data_ptr<float>();
  float* c_p = carry.data_ptr<float>();
  for (int64_t t = T_ - 1; t >= 0; --t) {
    const Tensor h_prev = t == 0 ? h0 : saved.select(1, t - 1).narrow(1, 4 * H, H);
    const float* hp_p = h_prev.data_ptr<float>();
    const int64_t hp_stride = h_prev.stride(0);
    for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
      float* go = thread_scratch<float>(Slot::kOutRows, H + G);
      float* dx = go + H;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t bt = b * T_ + t;
        kt.from_bf16(go_p + bt * H, H, go);
        kt.gru_gates_bwd(s_p + bt * 5 * H, hp_p + b * hp_stride, go, c_p + b * H, dx,
                         dgh_p + bt * G, H);
        kt.to_bf16(dx, G, dgx_p + bt * G);
      }
    });
    carry.addmm_(dgh.select(1, t), w);  // + dgh_t W_hh
  }
  const Tensor h_prev_all =
      at::cat({h0.unsqueeze(1), saved.narrow(1, 0, T_ - 1).narrow(2, 4 * H, H)}, 1);
  Tensor dw = at::mm(dgh.view({B * T_, G}).t(), h_prev_all.reshape({B * T_, H}));
  Tensor db = has_bias ? dgh.sum(at::IntArrayRef{0, 1}) : at::empty({0}, f32);
  return {dgx, carry.to(h0_in.scalar_type()), dw.to(w_hh.scalar_type()),
          db.to(w_hh.scalar_type())};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> gru_recurrence_bwd(const Tensor& grad_hs_in,
                                                              const Tensor& h0_in,
                                                              const Tensor& hs,
                                                              const Tensor& saved,
                                                              const Tensor& w_hh, bool has_bias) {
  const NoAutocast no_autocast;
  if (is_bf16(hs)) {
    return gru_recurrence_bwd_bf16(grad_hs_in, h0_in, hs, saved, w_hh, has_bias);
  }
  const Tensor grad_hs = grad_hs_in.contiguous(), h0 = h0_in.contiguous();
  const int64_t B = hs.size(0), T_ = hs.size(1), H = hs.size(2), G = 3 * H;
  TORCH_CHECK(grad_hs.sizes() == hs.sizes() && saved.size(2) == 4 * H && hs.is_contiguous() &&
                  saved.is_contiguous(),
              "_gru_recurrence_bwd: inconsistent saved tensors");
  Tensor dgx = at::empty({B, T_, G}, hs.options());
  Tensor dgh = at::empty({B, T_, G}, hs.options());
  Tensor carry = at::zeros({B, H}, hs.options());  // dL/dh_t from the steps after t
  if (T_ == 0) {  // no step: nothing reaches h0 or the weights
    return {dgx, carry, at::zeros({G, H}, hs.options()),
            has_bias ? at::zeros({G}, hs.options()) : at::empty({0}, hs.options())};
  }
  AT_DISPATCH_FLOATING_TYPES(hs.scalar_type(), "_gru_recurrence_bwd", [&] {
    for (int64_t t = T_ - 1; t >= 0; --t) {
      const Tensor h_prev = t == 0 ? h0 : hs.select(1, t - 1);
      const scalar_t* dh_out = grad_hs.data_ptr<scalar_t>();
      const scalar_t* s_p = saved.data_ptr<scalar_t>();
      const scalar_t* hp_p = h_prev.data_ptr<scalar_t>();
      const int64_t hp_stride = h_prev.stride(0);
      scalar_t* c_p = carry.data_ptr<scalar_t>();
      scalar_t* dgx_p = dgx.data_ptr<scalar_t>();
      scalar_t* dgh_p = dgh.data_ptr<scalar_t>();
      const auto& kt = runtime_kernels<scalar_t>();
      for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t bt = b * T_ + t;
          kt.gru_gates_bwd(s_p + bt * 4 * H, hp_p + b * hp_stride, dh_out + bt * H, c_p + b * H,
                           dgx_p + bt * G, dgh_p + bt * G, H);
        }
      });
      carry.addmm_(dgh.select(1, t), w_hh);  // + dgh_t W_hh
    }
  });
  Tensor h_prev_all = at::cat({h0.unsqueeze(1), hs.narrow(1, 0, T_ - 1)}, 1);
  Tensor dw = at::mm(dgh.view({B * T_, G}).t(), h_prev_all.view({B * T_, H}));
  Tensor db = has_bias ? dgh.sum(at::IntArrayRef{0, 1}) : at::empty({0}, hs.options());
  return {dgx, carry, dw, db};
}

// bfloat16 cells: each row's inputs converted into L1-resident float32 rows, the float32 gate
// pass, its outputs rounded to bfloat16 (saved stays float32): no whole-tensor copy.
const Bf16* bf16_rows(const Tensor& t) {
  return reinterpret_cast<const Bf16*>(t.data_ptr<at::BFloat16>());
}

std::tuple<Tensor, Tensor> gru_cell_fwd_bf16(const Tensor& gi, const Tensor& gh,
                                             const Tensor& h_in) {
  const int64_t B = h_in.size(0), H = h_in.size(1), G = 3 * H;
  const Tensor h = h_in.contiguous();
  Tensor h_new = at::empty({B, H}, h.options());
  Tensor saved = at::empty({B, 4 * H}, h.options().dtype(at::kFloat));
  const auto& kt = runtime_kernels<float>();
  const Bf16 *gi_p = bf16_rows(gi), *gh_p = bf16_rows(gh), *h_p = bf16_rows(h);
  Bf16* out_p = const_cast<Bf16*>(bf16_rows(h_new));
  float* s_p = saved.data_ptr<float>();
  const int64_t si = gi.stride(0), sh = gh.stride(0);
  for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
    float* rows = thread_scratch<float>(Slot::kOutRows, 2 * G + 2 * H);
    float *x = rows, *y = rows + G, *hp = rows + 2 * G, *hn = hp + H;
    for (int64_t b = begin; b < end; ++b) {
      kt.from_bf16(gi_p + b * si, G, x);
      kt.from_bf16(gh_p + b * sh, G, y);
      kt.from_bf16(h_p + b * H, H, hp);
      kt.gru_gates_fwd(x, y, hp, hn, s_p + b * 4 * H, H);
      kt.to_bf16(hn, H, out_p + b * H);
    }
  });
  return {h_new, saved};
}

std::tuple<Tensor, Tensor, Tensor> gru_cell_bwd_bf16(const Tensor& grad_h_in, const Tensor& saved,
                                                     const Tensor& h_in) {
  const Tensor grad_h = grad_h_in.contiguous(), h = h_in.contiguous();
  const int64_t B = h.size(0), H = h.size(1), G = 3 * H;
  TORCH_CHECK(grad_h.sizes() == h.sizes() && is_bf16(grad_h) && saved.dim() == 2 &&
                  saved.size(0) == B && saved.size(1) == 4 * H &&
                  saved.scalar_type() == at::kFloat && saved.is_contiguous(),
              "_gru_cell_bwd: inconsistent saved tensors");
  Tensor d_in = at::empty({B, G}, h.options());
  Tensor d_hidden = at::empty({B, G}, h.options());
  Tensor dh = at::empty({B, H}, h.options());
  const auto& kt = runtime_kernels<float>();
  const float* s_p = saved.data_ptr<float>();
  const Bf16 *h_p = bf16_rows(h), *g_p = bf16_rows(grad_h);
  Bf16* di_p = const_cast<Bf16*>(bf16_rows(d_in));
  Bf16* dg_p = const_cast<Bf16*>(bf16_rows(d_hidden));
  Bf16* dh_p = const_cast<Bf16*>(bf16_rows(dh));
  for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
    float* rows = thread_scratch<float>(Slot::kOutRows, 2 * G + 3 * H);
    float *dx = rows, *dg = rows + G, *hp = rows + 2 * G, *go = hp + H, *c = go + H;
    for (int64_t b = begin; b < end; ++b) {
      kt.from_bf16(h_p + b * H, H, hp);
      kt.from_bf16(g_p + b * H, H, go);
      std::fill(c, c + H, 0.0f);
      kt.gru_gates_bwd(s_p + b * 4 * H, hp, go, c, dx, dg, H);
      kt.to_bf16(dx, G, di_p + b * G);
      kt.to_bf16(dg, G, dg_p + b * G);
      kt.to_bf16(c, H, dh_p + b * H);
    }
  });
  return {d_in, d_hidden, dh};
}

// One GRU cell step from its two gate projections (nn.GRUCell's math, biases included), for a
// decoder that forms the projections itself (the Bahdanau decoder):
// gates_in, gates_hidden [B, 3H] (rows may be strided), h [B, H] -> (h_new [B, H], saved [B, 4H]).
std::tuple<Tensor, Tensor> gru_cell_fwd(const Tensor& gates_in, const Tensor& gates_hidden,
                                        const Tensor& h_in) {
  Tensor gi, gh;
  std::tie(gi, gh) = check_cell("_gru_cell", gates_in, gates_hidden, h_in, 3);
  if (is_bf16(h_in)) return gru_cell_fwd_bf16(gi, gh, h_in);
  const int64_t B = h_in.size(0), H = h_in.size(1);
  const Tensor h = h_in.contiguous();
  Tensor h_new = at::empty({B, H}, h.options());
  Tensor saved = at::empty({B, 4 * H}, h.options());
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "_gru_cell_fwd", [&] {
    const auto& kt = runtime_kernels<scalar_t>();
    const scalar_t* gi_p = gi.data_ptr<scalar_t>();
    const scalar_t* gh_p = gh.data_ptr<scalar_t>();
    const scalar_t* h_p = h.data_ptr<scalar_t>();
    scalar_t* out_p = h_new.data_ptr<scalar_t>();
    scalar_t* s_p = saved.data_ptr<scalar_t>();
    const int64_t si = gi.stride(0), sh = gh.stride(0);
    for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        kt.gru_gates_fwd(gi_p + b * si, gh_p + b * sh, h_p + b * H, out_p + b * H,
                         s_p + b * 4 * H, H);
      }
    });
  });
  return {h_new, saved};
}

// grad_h [B, H], saved, h -> (d gates_in [B, 3H], d gates_hidden [B, 3H], dh [B, H] through z;
// the part through gates_hidden is the caller's product's backward).
std::tuple<Tensor, Tensor, Tensor> gru_cell_bwd(const Tensor& grad_h_in, const Tensor& saved,
                                                const Tensor& h_in) {
  if (is_bf16(h_in)) return gru_cell_bwd_bf16(grad_h_in, saved, h_in);
  const Tensor grad_h = grad_h_in.contiguous(), h = h_in.contiguous();
  const int64_t B = h.size(0), H = h.size(1), G = 3 * H;
  TORCH_CHECK(grad_h.sizes() == h.sizes() && saved.dim() == 2 && saved.size(0) == B &&
                  saved.size(1) == 4 * H && saved.is_contiguous(),
              "_gru_cell_bwd: inconsistent saved tensors");
  Tensor d_in = at::empty({B, G}, h.options());
  Tensor d_hidden = at::empty({B, G}, h.options());
  Tensor dh = at::zeros({B, H}, h.options());
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "_gru_cell_bwd", [&] {
    const auto& kt = runtime_kernels<scalar_t>();
    const scalar_t* s_p = saved.data_ptr<scalar_t>();
    const scalar_t* h_p = h.data_ptr<scalar_t>();
    const scalar_t* g_p = grad_h.data_ptr<scalar_t>();
    scalar_t* dh_p = dh.data_ptr<scalar_t>();
    scalar_t* di_p = d_in.data_ptr<scalar_t>();
    scalar_t* dg_p = d_hidden.data_ptr<scalar_t>();
    for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        kt.gru_gates_bwd(s_p + b * 4 * H, h_p + b * H, g_p + b * H, dh_p + b * H, di_p + b * G,
                         dg_p + b * G, H);
      }
    });
  });
  return {d_in, d_hidden, dh};
}

}  // namespace
}  // namespace seq2seq_fast

TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def("_gru_recurrence_fwd(Tensor gx, Tensor h0, Tensor w_hh, Tensor? b_hh) -> (Tensor, Tensor)");
  m.def(
      "_gru_recurrence_bwd(Tensor grad_hs, Tensor h0, Tensor hs, Tensor saved, Tensor w_hh, "
      "bool has_bias) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("_gru_cell_fwd(Tensor gates_in, Tensor gates_hidden, Tensor h) -> (Tensor, Tensor)");
  m.def("_gru_cell_bwd(Tensor grad_h, Tensor saved, Tensor h) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_gru_recurrence_fwd", &seq2seq_fast::gru_recurrence_fwd);
  m.impl("_gru_recurrence_bwd", &seq2seq_fast::gru_recurrence_bwd);
  m.impl("_gru_cell_fwd", &seq2seq_fast::gru_cell_fwd);
  m.impl("_gru_cell_bwd", &seq2seq_fast::gru_cell_bwd);
}
