// CPU kernels of the location convolution of location-aware attention (_location_conv_fwd /
// _location_conv_bwd; caller: seq2seq_fast/nn/convert/_location.py):
//
//   out[b*T + t, c] = sum_{i, k} w[c, i, k] x[b, i, t + k - K/2]     (zero outside [0, T))
//
// features x [B, Cin, T], weight w [C, Cin, K] (K odd: conv1d with padding K // 2, no bias), out
// [B*T, C] (frames as rows, ready for the location dense layer's product). These convolutions are
// tiny (Cin = 1-2 channels of previous / cumulative weights, K = 15-201 taps, C = 10-32 filters):
// through conv1d, or im2col + mm + col2im, a step spends most of its time on copies, padding and
// the ops' overheads rather than on its B*T*Cin*K*C multiply-adds.
//
// Here each batch row is one work item: its frames are copied once into a time-major padded
// buffer X [T + K - 1, Cin], so that frame t's window is the Cin*K consecutive elements from
// X + t*Cin, and the weight is laid out as W2 [K*Cin, C] (W2[k*Cin + i, c] = w[c, i, k]; filters
// padded with zeros to a multiple of 8, so that the products run on whole vectors). Then
//   forward:  out_b = windows(X) W2          one weighted_rows call (row stride Cin)
//   dW2     += windows(X)^T g_b              one weighted_rows call (per-row partials, summed in
//                                            row order: bitwise reproducible for any threads)
//   dX      += diagonals of g_b W2^T         weighted_rows, then each frame's row added into its
//                                            window
// with the SIMD kernels of the attention (kernels/kernels.h).
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>
#include <vector>

#include "runtime.h"

namespace seq2seq_fast {
namespace {

using at::Tensor;

struct ConvSizes {
  int64_t B, Cin, T, C, K;
  int64_t J;   // K * Cin, the window length
  int64_t Cp;  // C rounded up to a multiple of 8: whole vectors in the products over filters
  int64_t Jp;  // J likewise, for the features' gradient
};

ConvSizes check_conv(const char* op, const Tensor& x, const Tensor& w) {
  TORCH_CHECK(x.dim() == 3, op, ": features must be [B, Cin, T], got ", x.sizes());
  TORCH_CHECK(w.dim() == 3, op, ": weight must be [C, Cin, K], got ", w.sizes());
  TORCH_CHECK(w.size(1) == x.size(1), op, ": weight ", w.sizes(), " does not match features ",
              x.sizes(), " (Cin)");
  TORCH_CHECK(w.size(2) % 2 == 1, op, ": the kernel width must be odd, got ", w.size(2));
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              op, ": features and weight must both be float32 or float64, got ", x.scalar_type(),
              " and ", w.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors expected");
  const int64_t C = w.size(0);
  const int64_t J = w.size(1) * w.size(2);
  return {x.size(0), x.size(1), x.size(2), C, w.size(2), J, round_up(C, 8), round_up(J, 8)};
}

// The weight as W2 [J, Cp] (W2[k*Cin + i, c] = w[c, i, k], zero for c >= C) and as W2^T [C, Jp]
// (zero for j >= J).
template <typename T>
void window_weights(const Tensor& w, const ConvSizes& n, std::vector<T>& w2, std::vector<T>& w2t) {
  const T* wp = w.data_ptr<T>();
  w2.assign(size_t(n.J * n.Cp), T(0));
  w2t.assign(size_t(n.C * n.Jp), T(0));
  for (int64_t c = 0; c < n.C; ++c)
    for (int64_t i = 0; i < n.Cin; ++i)
      for (int64_t k = 0; k < n.K; ++k) {
        const T value = wp[(c * n.Cin + i) * n.K + k];
        w2[(k * n.Cin + i) * n.Cp + c] = value;
        w2t[c * n.Jp + k * n.Cin + i] = value;
      }
}

// X [T + K - 1, Cin] of batch row b: X[u, i] = x[b, i, u - K/2], zero outside the frames.
template <typename T>
void padded_frames(const T* x, const ConvSizes& n, int64_t b, T* X) {
  const int64_t pad = n.K / 2;
  std::fill(X, X + (n.T + n.K - 1) * n.Cin, T(0));
  for (int64_t i = 0; i < n.Cin; ++i) {
    const T* row = x + (b * n.Cin + i) * n.T;
    for (int64_t t = 0; t < n.T; ++t) X[(t + pad) * n.Cin + i] = row[t];
  }
}

// Batch rows per parallel task: enough multiply-adds to be worth a thread.
int64_t rows_per_task(const ConvSizes& n) {
  return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, n.T * n.J * n.Cp));
}

Tensor location_conv_fwd(const Tensor& features, const Tensor& weight) {
  const char* op = "seq2seq_fast::_location_conv_fwd";
  const ConvSizes n = check_conv(op, features, weight);
  const Tensor x = features.contiguous(), w = weight.contiguous();
  Tensor out = at::empty({n.B * n.T, n.C}, x.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "_location_conv_fwd", [&] {
    const auto& kt = runtime_kernels<scalar_t>();
    std::vector<scalar_t> w2, w2t;
    window_weights<scalar_t>(w, n, w2, w2t);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, n.B, rows_per_task(n), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> X(static_cast<size_t>((n.T + n.K - 1) * n.Cin));
      std::vector<scalar_t> rows(n.Cp == n.C ? 0 : static_cast<size_t>(n.T * n.Cp));
      for (int64_t b = begin; b < end; ++b) {
        padded_frames(xp, n, b, X.data());
        scalar_t* dst = outp + b * n.T * n.C;
        if (n.Cp == n.C) {
          kt.weighted_rows(X.data(), n.Cin, 1, n.T, n.J, w2.data(), n.C, dst);
          continue;
        }
        kt.weighted_rows(X.data(), n.Cin, 1, n.T, n.J, w2.data(), n.Cp, rows.data());
        for (int64_t t = 0; t < n.T; ++t)
          std::copy(rows.data() + t * n.Cp, rows.data() + t * n.Cp + n.C, dst + t * n.C);
      }
    });
  });
  return out;
}

// grad [B*T, C] -> (dfeatures [B, Cin, T], dweight [C, Cin, K]); one not asked for is an empty
// tensor.
std::tuple<Tensor, Tensor> location_conv_bwd(const Tensor& grad_in, const Tensor& features,
                                             const Tensor& weight, bool need_features,
                                             bool need_weight) {
  const char* op = "seq2seq_fast::_location_conv_bwd";
  const ConvSizes n = check_conv(op, features, weight);
  TORCH_CHECK(grad_in.dim() == 2 && grad_in.size(0) == n.B * n.T && grad_in.size(1) == n.C &&
                  grad_in.scalar_type() == features.scalar_type() && grad_in.device().is_cpu(),
              op, ": grad must be [B*T, C]=[", n.B * n.T, ", ", n.C, "] of the features' dtype, got ",
              grad_in.sizes(), " ", grad_in.scalar_type());
  const Tensor x = features.contiguous(), w = weight.contiguous(), g = grad_in.contiguous();
  Tensor dx = need_features ? at::zeros(x.sizes(), x.options()) : at::empty({0}, x.options());
  Tensor dw = need_weight ? at::zeros(w.sizes(), w.options()) : at::empty({0}, x.options());
  if (n.B * n.T == 0 || n.C == 0 || !(need_features || need_weight)) return {dx, dw};
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "_location_conv_bwd", [&] {
    const auto& kt = runtime_kernels<scalar_t>();
    std::vector<scalar_t> w2, w2t;
    window_weights<scalar_t>(w, n, w2, w2t);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* dxp = need_features ? dx.data_ptr<scalar_t>() : nullptr;
    // dW2 of each batch row [J, Cp], summed in row order afterwards
    std::vector<scalar_t> parts(need_weight ? static_cast<size_t>(n.B * n.J * n.Cp) : 0);
    const int64_t padded = (n.T + n.K - 1) * n.Cin, pad = n.K / 2;
    at::parallel_for(0, n.B, rows_per_task(n), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> X(static_cast<size_t>(padded));
      std::vector<scalar_t> M(need_features ? static_cast<size_t>(n.T * n.Jp) : 0);
      std::vector<scalar_t> grows(n.Cp == n.C ? 0 : static_cast<size_t>(n.T * n.Cp), 0);
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* gb = gp + b * n.T * n.C;
        if (n.Cp != n.C) {  // the rows padded with zero filters
          for (int64_t t = 0; t < n.T; ++t)
            std::copy(gb + t * n.C, gb + (t + 1) * n.C, grows.data() + t * n.Cp);
          gb = grows.data();
        }
        if (need_weight) {  // dW2 = windows^T g
          padded_frames(xp, n, b, X.data());
          kt.weighted_rows(X.data(), 1, n.Cin, n.J, n.T, gb, n.Cp, parts.data() + b * n.J * n.Cp);
        }
        if (need_features) {  // M = g W2^T [T, J]; each frame's row added into its window
          kt.weighted_rows(gb, n.Cp, 1, n.T, n.C, w2t.data(), n.Jp, M.data());
          std::fill(X.begin(), X.end(), scalar_t(0));
          for (int64_t t = 0; t < n.T; ++t) {
            scalar_t* dst = X.data() + t * n.Cin;
            const scalar_t* src = M.data() + t * n.Jp;
            for (int64_t j = 0; j < n.J; ++j) dst[j] += src[j];
          }
          for (int64_t i = 0; i < n.Cin; ++i) {
            scalar_t* row = dxp + (b * n.Cin + i) * n.T;
            for (int64_t t = 0; t < n.T; ++t) row[t] = X[(t + pad) * n.Cin + i];
          }
        }
      }
    });
    if (need_weight) {
      std::vector<double> sum(static_cast<size_t>(n.J * n.Cp), 0.0);
      for (int64_t b = 0; b < n.B; ++b) {
        const scalar_t* p = parts.data() + b * n.J * n.Cp;
        for (int64_t e = 0; e < n.J * n.Cp; ++e) sum[e] += p[e];
      }
      scalar_t* dwp = dw.data_ptr<scalar_t>();
      for (int64_t c = 0; c < n.C; ++c)
        for (int64_t i = 0; i < n.Cin; ++i)
          for (int64_t k = 0; k < n.K; ++k)
            dwp[(c * n.Cin + i) * n.K + k] = scalar_t(sum[(k * n.Cin + i) * n.Cp + c]);
    }
  });
  return {dx, dw};
}

}  // namespace
}  // namespace seq2seq_fast

TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def("_location_conv_fwd(Tensor features, Tensor weight) -> Tensor");
  m.def(
      "_location_conv_bwd(Tensor grad, Tensor features, Tensor weight, bool need_features, "
      "bool need_weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_location_conv_fwd", &seq2seq_fast::location_conv_fwd);
  m.impl("_location_conv_bwd", &seq2seq_fast::location_conv_bwd);
}
