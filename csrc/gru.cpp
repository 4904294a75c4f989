// CPU kernels of the GRU recurrence (seq2seq_fast/gru.py): one op for the forward over all time
// steps, one for the backward, so a GRU layer costs one matrix product and one fused gate pass
// per step instead of a dozen small ops and autograd nodes.
//
// With gx = x W_ih^T + b_ih [B, T, 3H] precomputed (one product over all steps, by the caller)
// and gh_t = h_{t-1} W_hh^T + b_hh, the gates are PyTorch's (nn.GRU, "linear before reset"):
//   r = sigmoid(gx_r + gh_r),  z = sigmoid(gx_z + gh_z),  n = tanh(gx_n + r * gh_n),
//   h_t = n + z * (h_{t-1} - n) = (1 - z) n + z h_{t-1}.
// The forward keeps (r, z, n, gh_n) per step [B, T, 4H] for the backward, which walks the steps
// backwards with one product per step (dh_{t-1} += dgh_t W_hh) and forms dW_hh = sum_t dgh_t^T
// h_{t-1} and db_hh as one product / one sum over all steps at the end.
//
// sigmoid(a) = 1 / (1 + exp(-a)) and tanh(a) = 1 - 2 / (1 + exp(2a)), exp from the SIMD tables
// (csrc/kernels.h) for float32, std::exp for float64: inf and NaN propagate as in torch
// (exp saturates, 1 / (1 + inf) = 0).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <tuple>

namespace seq2seq_fast {

void exp_floats(float* p, int64_t n, float scale);  // additive_attention.cpp

namespace {

using at::Tensor;

void exp_inplace(float* p, int64_t n, float scale) { exp_floats(p, n, scale); }
void exp_inplace(double* p, int64_t n, double scale) {
  for (int64_t i = 0; i < n; ++i) p[i] = std::exp(scale * p[i]);
}

// Rows [begin, end) of one step's gate pass; small steps run on the calling thread (a parallel
// region costs more than the pass).
template <typename F>
void for_rows(int64_t rows, int64_t row_work, const F& f) {
  if (rows * row_work < 32768) {
    f(0, rows);
  } else {
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / row_work), f);
  }
}

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
  TORCH_CHECK(!b_hh.has_value() || (b_hh->dim() == 1 && b_hh->size(0) == G),
              "_gru_recurrence: b_hh must be [3H=", G, "]");
  for (const Tensor* t : {&gx, &h0, &w_hh}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == gx.scalar_type(),
                "_gru_recurrence: tensors must be on the CPU with one dtype");
  }
  TORCH_CHECK(gx.scalar_type() == at::kFloat || gx.scalar_type() == at::kDouble,
              "_gru_recurrence: float32 or float64, got ", gx.scalar_type());
}

template <typename T>
void gates_forward(const T* gx, const T* gh, const T* hp, T* h, T* saved, int64_t H) {
  T* r = saved;  // r and z side by side: [r | z | n | gh_n]
  for (int64_t j = 0; j < 2 * H; ++j) r[j] = -(gx[j] + gh[j]);
  exp_inplace(r, 2 * H, T(1));
  for (int64_t j = 0; j < 2 * H; ++j) r[j] = T(1) / (T(1) + r[j]);
  const T* z = saved + H;
  T* n = saved + 2 * H;
  T* ghn = saved + 3 * H;
  for (int64_t j = 0; j < H; ++j) {
    ghn[j] = gh[2 * H + j];
    n[j] = gx[2 * H + j] + r[j] * ghn[j];
  }
  exp_inplace(n, H, T(2));
  for (int64_t j = 0; j < H; ++j) {
    n[j] = T(1) - T(2) / (T(1) + n[j]);
    h[j] = n[j] + z[j] * (hp[j] - n[j]);
  }
}

std::tuple<Tensor, Tensor> gru_recurrence_fwd(const Tensor& gx_in, const Tensor& h0_in,
                                              const Tensor& w_hh,
                                              const c10::optional<Tensor>& b_hh) {
  check_gru(gx_in, h0_in, w_hh, b_hh);
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
      for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t bt = b * T_ + t;
          gates_forward(gx_p + bt * G, gh_p + b * G, hp_p + b * hp_stride, h_p + bt * H,
                        s_p + bt * 4 * H, H);
        }
      });
    }
  });
  return {hs, saved};
}

// grad_hs [B, T, H] (gradient of every output, the last state's included) -> (dgx [B, T, 3H],
// dh0 [B, H], dw_hh [3H, H], db_hh [3H] (empty without bias)).
std::tuple<Tensor, Tensor, Tensor, Tensor> gru_recurrence_bwd(const Tensor& grad_hs_in,
                                                              const Tensor& h0_in,
                                                              const Tensor& hs,
                                                              const Tensor& saved,
                                                              const Tensor& w_hh, bool has_bias) {
  const Tensor grad_hs = grad_hs_in.contiguous(), h0 = h0_in.contiguous();
  const int64_t B = hs.size(0), T_ = hs.size(1), H = hs.size(2), G = 3 * H;
  TORCH_CHECK(grad_hs.sizes() == hs.sizes() && saved.size(2) == 4 * H && hs.is_contiguous() &&
                  saved.is_contiguous(),
              "_gru_recurrence_bwd: inconsistent saved tensors");
  Tensor dgx = at::empty({B, T_, G}, hs.options());
  Tensor dgh = at::empty({B, T_, G}, hs.options());
  Tensor carry = at::zeros({B, H}, hs.options());  // dL/dh_t from the steps after t
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
      for_rows(B, 4 * H, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t bt = b * T_ + t;
          const scalar_t* r = s_p + bt * 4 * H;
          const scalar_t* z = r + H;
          const scalar_t* n = r + 2 * H;
          const scalar_t* ghn = r + 3 * H;
          const scalar_t* hp = hp_p + b * hp_stride;
          const scalar_t* go = dh_out + bt * H;
          scalar_t* c = c_p + b * H;
          scalar_t* dx = dgx_p + bt * G;
          scalar_t* dg = dgh_p + bt * G;
          for (int64_t j = 0; j < H; ++j) {
            const scalar_t dh = go[j] + c[j];
            const scalar_t dn = dh * (scalar_t(1) - z[j]) * (scalar_t(1) - n[j] * n[j]);
            const scalar_t dz = dh * (hp[j] - n[j]) * z[j] * (scalar_t(1) - z[j]);
            const scalar_t dr = dn * ghn[j] * r[j] * (scalar_t(1) - r[j]);
            dx[j] = dr;
            dx[H + j] = dz;
            dx[2 * H + j] = dn;
            dg[j] = dr;
            dg[H + j] = dz;
            dg[2 * H + j] = dn * r[j];
            c[j] = dh * z[j];
          }
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

}  // namespace
}  // namespace seq2seq_fast

TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def("_gru_recurrence_fwd(Tensor gx, Tensor h0, Tensor w_hh, Tensor? b_hh) -> (Tensor, Tensor)");
  m.def(
      "_gru_recurrence_bwd(Tensor grad_hs, Tensor h0, Tensor hs, Tensor saved, Tensor w_hh, "
      "bool has_bias) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_gru_recurrence_fwd", &seq2seq_fast::gru_recurrence_fwd);
  m.impl("_gru_recurrence_bwd", &seq2seq_fast::gru_recurrence_bwd);
}
