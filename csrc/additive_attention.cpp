// CPU kernels of the additive-attention ops (schemas: seq2seq_fast/ops/additive_attention.py).
//
//   e[b,t,s]  = sum_h v[h] tanh(query[b,t,h] + keys[b,s,h] + bias[h])
//   p[b,t,:]  = softmax of e[b,t,:] over the valid keys (masked: exactly 0; no valid key: all 0)
//   ctx[b,t]  = sum_s p[b,t,s] values[b,s]
//
// Work is split into items (batch row b, block of queries: runtime.h's Plan); each item packs its
// query rows and its batch row's keys into per-thread scratch padded to a multiple of 16, computes
// the scores with SIMD kernels (kernels/kernels.h; AVX-512 / AVX2 / portable chosen at run time),
// the softmax of its rows into the [B,Tq,Tk] weights, and the value-side products (context =
// p values, dp = dctx values^T, dvalues = p^T dctx; SIMD kernels about as fast as BLAS at these
// sizes), so that each op is one parallel region: on a machine shared with other jobs every extra
// region can wait a scheduler slice for a descheduled thread (runtime.h's for_each_item). Nothing
// of size B*Tq*Tk*H is ever allocated: per-thread scratch is O((rows + Tk) * H), buffers
// O(B*Tq*Tk).
//
// Backward, given the forward's weights p (what autograd passes on CPU): forms
// de = p (dp - sum_s p dp) first, then makes one pass over the (query, key) pairs that computes
// y (r = 1/(1 + e^{2a} e^{2b}) or tanh) in registers and accumulates
//   dq[t] += de sech^2 v,  dk[s] += de sech^2 v,  dv += de tanh,  dbias = sum_t dq[t].
// With one query tile per item (a decoding step) each dkeys row is final when its tile ends and is
// written straight to the output. Without p (a direct call of the op), each item first recomputes
// its rows of p as the forward does (scores, then the softmax from the row maximum and sum: equal
// to exp(e - lse), but float64 stays exact although lse is float32).
// dkeys of a batch row that is split over several items goes through per-item partial buffers
// reduced in a fixed order (only when B is small, so they stay O(threads * Tk * H)); dv and dbias
// partials are per item; threads take whole items: results are bitwise reproducible run to run
// for a fixed thread count.
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "additive_attention.h"
#include "bf16.h"
#include "kernels/tanh_coeffs.h"
#include "runtime.h"

namespace seq2seq_fast {
namespace {

using at::Tensor;

template <typename T>
struct ProductRange;  // the product path's limits (csrc/kernels/kernels.h)
template <>
struct ProductRange<float> {
  static constexpr float limit = kProductLimitFloat, safe_sum = kProductSafeSumFloat;
  static constexpr float min_sum = kProductMinSumFloat;
};
template <>
struct ProductRange<double> {
  static constexpr double limit = kProductLimitDouble, safe_sum = kProductSafeSumDouble;
  static constexpr double min_sum = kProductMinSumDouble;
};

// The product path pays exp() on every packed query and key element (about 14 vector operations
// per 16 elements, against 5 per element pair for the product and 18 for the rational tanh):
// it wins from two queries per work item on, and loses for one (a decoding step).
constexpr int64_t kMinQueriesForProduct = 2;

}  // namespace

// ---- checks ----------------------------------------------------------------------------------

Sizes check_inputs(const char* op, const Tensor& query, const Tensor& keys, const Tensor& values,
                   const Tensor& v, const Tensor& bias, const std::optional<Tensor>& lengths,
                   const std::optional<Tensor>& mask) {
  TORCH_CHECK(query.dim() == 3, op, ": query must be [B, Tq, H], got ", query.sizes());
  TORCH_CHECK(keys.dim() == 3, op, ": keys must be [B, Tk, H], got ", keys.sizes());
  TORCH_CHECK(values.dim() == 3, op, ": values must be [B, Tk, Dv], got ", values.sizes());
  const Sizes n{keys.size(0), query.size(1), keys.size(1), keys.size(2), values.size(2)};
  TORCH_CHECK(query.size(0) == n.B && query.size(2) == n.H, op, ": query ", query.sizes(),
              " does not match keys ", keys.sizes());
  TORCH_CHECK(values.size(0) == n.B && values.size(1) == n.Tk, op, ": values ", values.sizes(),
              " does not match keys ", keys.sizes());
  TORCH_CHECK(v.dim() == 1 && v.size(0) == n.H, op, ": v must be [H=", n.H, "], got ", v.sizes());
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n.H, op, ": bias must be [H=", n.H, "], got ",
              bias.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16, op,
              ": CPU kernel supports float32, float64 and bfloat16, got ", dtype);
  for (const Tensor* t : {&query, &keys, &values, &v, &bias}) {
    TORCH_CHECK(t->scalar_type() == dtype, op, ": all inputs must share query's dtype ", dtype,
                ", got ", t->scalar_type());
    TORCH_CHECK(t->device().is_cpu(), op, ": CPU kernel got a tensor on ", t->device());
  }
  TORCH_CHECK(!(lengths.has_value() && mask.has_value()), op,
              ": pass either lengths or mask, not both");
  if (lengths.has_value()) {
    TORCH_CHECK(lengths->scalar_type() == at::kLong && lengths->dim() == 1 &&
                    lengths->size(0) == n.B,
                op, ": lengths must be int64 [B=", n.B, "], got ", lengths->scalar_type(), " ",
                lengths->sizes());
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == n.B &&
                    mask->size(1) == n.Tk,
                op, ": mask must be bool [B=", n.B, ", Tk=", n.Tk, "], got ", mask->scalar_type(),
                " ", mask->sizes());
  }
  return n;
}

KeyValidity key_validity(const char* op, const std::optional<Tensor>& lengths,
                         const std::optional<Tensor>& mask, int64_t Tk) {
  KeyValidity kv;
  kv.Tk = Tk;
  if (lengths.has_value()) {
    kv.lengths = lengths->contiguous();
    kv.len = kv.lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < kv.lengths.numel(); ++b) {
      // a ValueError in Python, as the eager check raises (torch.compile skips that one: it
      // cannot read values while tracing)
      TORCH_CHECK_VALUE(kv.len[b] >= 0 && kv.len[b] <= Tk, op, ": lengths must lie in [0, Tk=",
                        Tk, "], got ", kv.len[b], " at batch row ", b);
    }
  }
  if (mask.has_value()) {
    kv.mask = mask->contiguous();
    kv.mask_ptr = kv.mask.data_ptr<bool>();
  }
  return kv;
}

namespace {

// ---- storage and arithmetic types ------------------------------------------------------------
//
// M is the tensors' element type (float, double, or bfloat16 read as Bf16, kernels.h); T the
// arithmetic's (float for bfloat16). With M = T every call below is the plain kernel and the
// outputs are written in place. With M = Bf16 the kernels read the bfloat16 rows themselves
// (converted in registers) and each item's outputs are formed as T rows in per-thread scratch,
// then rounded into the bfloat16 outputs: no whole-tensor float32 copy is ever made.

template <typename M>
const M* in_ptr(const Tensor& t) {
  if constexpr (std::is_same_v<M, Bf16>) {
    return reinterpret_cast<const Bf16*>(t.data_ptr<at::BFloat16>());
  } else {
    return t.data_ptr<M>();
  }
}

template <typename M>
M* out_ptr(const Tensor& t) {
  return const_cast<M*>(in_ptr<M>(t));
}

inline float to_compute(Bf16 x) { return bf16_to_float(x); }
template <typename T>
T to_compute(T x) {
  return x;
}

template <typename M, typename T>
M to_storage(T x) {
  if constexpr (std::is_same_v<M, Bf16>) {
    return float_to_bf16(float(x));
  } else {
    return M(x);
  }
}

// The kernel entries by the type of the rows they read (T: the plain one; Bf16: its twin).
template <typename T>
T pack_rows_of(const KernelTable<T>& kt, const T* src, int64_t rows, int64_t H, const T* add,
               T* dst, int64_t Hp) {
  return kt.pack_rows(src, rows, H, add, dst, Hp);
}
inline float pack_rows_of(const KernelTable<float>& kt, const Bf16* src, int64_t rows, int64_t H,
                          const float* add, float* dst, int64_t Hp) {
  return kt.pack_rows_bf16(src, rows, H, add, dst, Hp);
}
template <typename T>
void scores_of(const KernelTable<T>& kt, int path, const T* A, int64_t nq, const T* Bk, int64_t nk,
               int64_t Hp, const T* veff, T offset, T* out, int64_t ldo, int flags) {
  kt.scores(path, A, nq, Bk, nk, Hp, veff, offset, out, ldo, flags);
}
inline void scores_of(const KernelTable<float>& kt, int path, const float* A, int64_t nq,
                      const Bf16* Bk, int64_t nk, int64_t Hp, const float* veff, float offset,
                      float* out, int64_t ldo, int flags) {
  kt.scores_bf16(path, A, nq, Bk, nk, Hp, veff, offset, out, ldo, flags);
}
template <typename T>
void fused_grads_of(const KernelTable<T>& kt, int path, const T* A, int64_t nq, const T* Bk,
                    int64_t nk, int64_t Hp, const T* de, int64_t ldd, T* gq, T* gk, T* gv,
                    const T* kscale, int flags) {
  kt.fused_grads(path, A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale, flags);
}
inline void fused_grads_of(const KernelTable<float>& kt, int path, const float* A, int64_t nq,
                           const Bf16* Bk, int64_t nk, int64_t Hp, const float* de, int64_t ldd,
                           float* gq, float* gk, float* gv, const float* kscale, int flags) {
  kt.fused_grads_bf16(path, A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale, flags);
}
template <typename T>
void weighted_rows_of(const KernelTable<T>& kt, const T* w, int64_t so, int64_t si, int64_t n_out,
                      int64_t n_in, const T* x, int64_t D, T* out) {
  kt.weighted_rows(w, so, si, n_out, n_in, x, D, out);
}
inline void weighted_rows_of(const KernelTable<float>& kt, const float* w, int64_t so, int64_t si,
                             int64_t n_out, int64_t n_in, const Bf16* x, int64_t D, float* out) {
  kt.weighted_rows_bf16(w, so, si, n_out, n_in, x, D, out);
}
template <typename T>
void dots_of(const KernelTable<T>& kt, const T* a, int64_t na, const T* b, int64_t nb, int64_t D,
             T* out, int64_t ldo) {
  kt.dots(a, na, b, nb, D, out, ldo);
}
inline void dots_of(const KernelTable<float>& kt, const Bf16* a, int64_t na, const Bf16* b,
                    int64_t nb, int64_t D, float* out, int64_t ldo) {
  kt.dots_bf16(a, na, b, nb, D, out, ldo);
}

// Rows that the value-side products read once per block of four outputs (context = p values,
// dps = dctx values^T, dvalues = p^T dctx): with several blocks (kWidenFrom or more query rows in
// the item) bfloat16 rows are widened once into the item's float32 scratch, so that the products
// do not widen each row once per block; with fewer (a decoding step streams each row once) they
// are read where they are and widened in registers. T rows are used where they are.
constexpr int64_t kWidenFrom = 4;
template <typename T>
const T* widened(const KernelTable<T>&, const T* rows, int64_t, T*) {
  return rows;
}
inline const float* widened(const KernelTable<float>& kt, const Bf16* rows, int64_t n,
                            float* scratch) {
  kt.from_bf16(rows, n, scratch);
  return scratch;
}

// dst[i] = src[i] (T rows into an output of type M: copied, or rounded to bfloat16).
template <typename T>
void store_rows(const KernelTable<T>&, const T* src, int64_t n, T* dst) {
  std::copy(src, src + n, dst);
}
inline void store_rows(const KernelTable<float>& kt, const float* src, int64_t n, Bf16* dst) {
  kt.to_bf16(src, n, dst);
}

// dst[i] += src[i] (a bfloat16 dst is rounded once per call).
template <typename T>
void add_rows(const T* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}
inline void add_rows(const float* src, int64_t n, Bf16* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(bf16_to_float(dst[i]) + src[i]);
}

// A [H] vector (bias) in the arithmetic's type.
template <typename T, typename M>
std::vector<T> compute_vector(const Tensor& t) {
  const M* p = in_ptr<M>(t);
  std::vector<T> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = T(to_compute(p[i]));
  return out;
}

// ---- per-item pieces -------------------------------------------------------------------------

// Score vectors for both paths, padded with zeros to Hp.
template <typename T>
struct ScoreVectors {
  std::vector<T> rational;  // v
  std::vector<T> product;   // -2 v
  std::vector<T> grad_product;  // 4 v: sech^2 = 4 (r - r^2)
  T sum_v = 0;              // sum v (tanh = 1 - 2r)
};

template <typename T, typename M>
ScoreVectors<T> score_vectors(const Tensor& v, int64_t H, int64_t Hp) {
  ScoreVectors<T> sv;
  sv.rational.assign(Hp, T(0));
  sv.product.assign(Hp, T(0));
  sv.grad_product.assign(Hp, T(0));
  const M* vp = in_ptr<M>(v);
  double sum = 0;
  for (int64_t h = 0; h < H; ++h) {
    const T vh = T(to_compute(vp[h]));
    sv.rational[h] = vh;
    sv.product[h] = T(-2) * vh;
    sv.grad_product[h] = T(4) * vh;
    sum += vh;
  }
  sv.sum_v = T(sum);
  return sv;
}

// The keys an item's kernels read: packed rows (T, Hp long), or the input rows themselves (M,
// H = Hp long; a decoding step, one query per item on the rational path or kProductBf16: it
// streams B * Tk * H keys from memory once, and copying them first would read and write them
// twice).
template <typename T, typename M>
struct ItemKeys {
  int path;
  const T* packed;
  const M* raw;
};

// One query of bfloat16 rows: kProductBf16 (kernels.h), its packed query scaled by 2 log2(e).
template <typename T>
int one_query_path(T* qbuf, int64_t nq, int64_t Hp, bool bf16) {
  if (!bf16) return kRational;
  for (int64_t e = 0; e < nq * Hp; ++e) qbuf[e] *= T(S2S_TWO_LOG2E);
  return kProductBf16;
}

// Packs an item's query rows (+ bias) and its batch row's keys; picks the tanh path.
template <typename T, typename M>
ItemKeys<T, M> pack_item(const KernelTable<T>& kt, const M* q_rows, int64_t nq, const M* k_rows,
                         int64_t nk, const T* bias, int64_t H, int64_t Hp, T* qbuf, T* kbuf) {
  const T q_max = pack_rows_of(kt, q_rows, nq, H, bias, qbuf, Hp);
  if (nq < kMinQueriesForProduct) {
    const int path = one_query_path(qbuf, nq, Hp, std::is_same_v<M, Bf16>);
    if (H == Hp) return {path, nullptr, k_rows};
    pack_rows_of(kt, k_rows, nk, H, static_cast<const T*>(nullptr), kbuf, Hp);
    return {path, kbuf, nullptr};
  }
  const T k_max = pack_rows_of(kt, k_rows, nk, H, static_cast<const T*>(nullptr), kbuf, Hp);
  // (small pre-activations: the rational path, accurate relative to tanh near 0; kernels.h)
  if (q_max <= ProductRange<T>::limit && k_max <= ProductRange<T>::limit &&
      q_max + k_max >= ProductRange<T>::min_sum) {
    kt.exp_inplace(qbuf, nq * Hp, T(2));
    kt.exp_inplace(kbuf, nk * Hp, T(2));
    return {q_max + k_max <= ProductRange<T>::safe_sum ? kProduct : kProductCapped, kbuf, nullptr};
  }
  return {kRational, kbuf, nullptr};
}

// The scores of an item's packed queries against its keys (out [nq, ldo]).
template <typename T, typename M>
void item_scores(const KernelTable<T>& kt, const ItemKeys<T, M>& keys, const ScoreVectors<T>& sv,
                 const T* qbuf, int64_t nq, int64_t nk, int64_t Hp, T* out, int64_t ldo) {
  const bool prod = keys.path != kRational;
  const T* veff = prod ? sv.product.data() : sv.rational.data();
  const T offset = prod ? sv.sum_v : T(0);
  if (keys.raw != nullptr) {
    scores_of(kt, keys.path, qbuf, nq, keys.raw, nk, Hp, veff, offset, out, ldo, kStreamed);
  } else {
    kt.scores(keys.path, qbuf, nq, keys.packed, nk, Hp, veff, offset, out, ldo, 0);
  }
}
// In place: scores -> softmax weights over the valid keys of each of nq rows (row stride Tk;
// keys s >= nk were not scored). Writes lse (max + log sum exp; +inf for a row with no valid
// key, whose weights are all 0). NaN scores make their row NaN.
template <typename T>
void softmax_rows(const KernelTable<T>& kt, T* rows, int64_t nq, int64_t Tk, int64_t nk,
                  const bool* valid, float* lse) {
  // exp runs on a padded copy so that no element takes the scalar tail.
  T* x = thread_scratch<T>(Slot::kSoftmaxRow, round_up(std::max<int64_t>(nk, 1), kPadTo));
  const int64_t padded = round_up(nk, kPadTo);
  for (int64_t t = 0; t < nq; ++t) {
    T* row = rows + t * Tk;
    T m = -std::numeric_limits<T>::infinity();
    bool any = false;
    for (int64_t s = 0; s < nk; ++s) {
      if (valid && !valid[s]) continue;
      any = true;
      const T e = row[s];
      if (e > m || e != e) m = (m != m) ? m : e;  // NaN is sticky
    }
    if (!any) {
      std::fill(row, row + Tk, T(0));
      if (lse) lse[t] = std::numeric_limits<float>::infinity();
      continue;
    }
    for (int64_t s = 0; s < nk; ++s) x[s] = row[s] - m;
    std::fill(x + nk, x + padded, T(0));
    kt.exp_inplace(x, padded, T(1));
    double sum = 0;
    if (valid) {
      for (int64_t s = 0; s < nk; ++s) {
        if (!valid[s]) x[s] = T(0);
        sum += x[s];
      }
    } else {
      for (int64_t s = 0; s < nk; ++s) sum += x[s];
    }
    const T inv = T(1.0 / sum);
    for (int64_t s = 0; s < nk; ++s) row[s] = x[s] * inv;
    std::fill(row + nk, row + Tk, T(0));
    if (lse) lse[t] = static_cast<float>(static_cast<double>(m) + std::log(sum));
  }
}


// In place, rows s < nk of nq rows (stride Tk): e -> log sigmoid(e); with one_minus (backward)
// also 1 - sigmoid(e) = exp(log sigmoid(-e)) into one_minus (same layout). NaN stays NaN.
template <typename T>
void log_sigmoid_rows(T* rows, int64_t nq, int64_t Tk, int64_t nk, T* one_minus) {
  for (int64_t t = 0; t < nq; ++t) {
    T* row = rows + t * Tk;
    for (int64_t s = 0; s < nk; ++s) {
      const T e = row[s];
      const T tail = std::log1p(std::exp(-std::abs(e)));
      row[s] = (e < T(0) ? e : T(0)) - tail;  // (NaN: tail is NaN)
      if (one_minus) one_minus[t * Tk + s] = std::exp((e > T(0) ? -e : T(0)) - tail);
    }
  }
}

// The scores of rows s < nk of nq rows (stride Tk), in place, into what softmax_rows normalises:
// e + b where a score bias is given, then, for the sigmoid normalisation, log sigmoid of that
// (one_minus: also 1 - sigmoid(e + b), for the backward).
template <typename T>
void prepare_scores(T* rows, int64_t nq, int64_t Tk, int64_t nk, Normalize normalize,
                    ScoreShift shift, T* one_minus) {
  if (shift.given) {
    const T b = T(shift.value);
    for (int64_t t = 0; t < nq; ++t) {
      T* row = rows + t * Tk;
      for (int64_t s = 0; s < nk; ++s) row[s] += b;
    }
  }
  if (normalize == Normalize::kSigmoid) log_sigmoid_rows<T>(rows, nq, Tk, nk, one_minus);
}

// ---- location term ---------------------------------------------------------------------------

// conv's rows s < nk of batch row b as T rows: in place, or (bfloat16 conv) widened into
// per-thread scratch.
template <typename T>
const T* location_conv_rows(const KernelTable<T>& kt, const LocationTerm<T>& loc, const Sizes& n,
                            int64_t b, int64_t nk) {
  if (loc.conv16 == nullptr) return loc.conv + b * n.Tk * loc.C;
  T* out = thread_scratch<T>(Slot::kLocationRows, n.Tk * loc.C);
  kt.from_bf16(loc.conv16 + b * n.Tk * loc.C, nk * loc.C, out);
  return out;
}

// An item's packed queries and keys (pack_item): the keys tensor's rows of batch row b, or for a
// location-aware step (loc given, `keys` then the projected memory) projected[s] + conv[s] W^T
// formed as T rows in per-thread scratch. A bfloat16 step packs its float32 keys as they are (one
// query: kProductBf16, as pack_item picks for it).
template <typename T, typename M>
ItemKeys<T, M> item_keys(const KernelTable<T>& kt, const LocationTerm<T>* loc, const M* q_rows,
                         int64_t nq, const M* keys, const Sizes& n, int64_t b, int64_t nk,
                         const T* bias, int64_t Hp, T* qbuf, T* kbuf) {
  const M* rows = keys + b * n.Tk * n.H;
  if (loc == nullptr) return pack_item<T, M>(kt, q_rows, nq, rows, nk, bias, n.H, Hp, qbuf, kbuf);
  T* formed = thread_scratch<T>(Slot::kFormedKeys, n.Tk * n.H);
  kt.weighted_rows(location_conv_rows(kt, *loc, n, b, nk), loc->C, 1, nk, loc->C, loc->wt, n.H,
                   formed);
  for (int64_t e = 0; e < nk * n.H; ++e) formed[e] += T(to_compute(rows[e]));
  if constexpr (std::is_same_v<T, M>) {
    return pack_item<T, M>(kt, q_rows, nq, formed, nk, bias, n.H, Hp, qbuf, kbuf);
  } else {
    TORCH_CHECK(nq < kMinQueriesForProduct, "seq2seq_fast: internal: a location-aware step of ",
                nq, " queries");
    pack_rows_of(kt, q_rows, nq, n.H, bias, qbuf, Hp);
    kt.pack_rows(formed, nk, n.H, static_cast<const T*>(nullptr), kbuf, Hp);
    return {one_query_path(qbuf, nq, Hp, true), kbuf, nullptr};
  }
}

// ---- forward ---------------------------------------------------------------------------------

// One item of the forward: scores of queries [t0, t0 + nq) of batch row b against its valid keys,
// their softmax into the weights and lse, and the context rows.
template <typename T, typename M>
struct ForwardPass {
  static constexpr bool kInPlace = std::is_same_v<T, M>;  // outputs formed where they belong
  const KernelTable<T>& kt;
  const Sizes& n;
  const KeyValidity& kv;
  Plan plan;
  int64_t Hp;
  ScoreVectors<T> sv;
  const M *qp, *kp;
  const T* bp;
  const M* valp;
  M *wp, *ctxp;
  float* lp;
  const LocationTerm<T>* loc = nullptr;  // a location-aware step: keys formed per item
  Normalize normalize = Normalize::kSoftmax;
  ScoreShift shift = {};

  struct Scratch {
    T *qbuf, *kbuf;
    T *prows, *orows;  // bfloat16 outputs: the item's weights and context rows before rounding
    T* vrows;          // bfloat16: the batch row's values widened (kWidenFrom queries or more)
  };
  Scratch make_scratch() const {
    Scratch s{thread_scratch<T>(Slot::kQueries, plan.block * Hp),
              thread_scratch<T>(Slot::kKeys, n.Tk * Hp), nullptr, nullptr, nullptr};
    if constexpr (!kInPlace) {
      s.prows = thread_scratch<T>(Slot::kWeightRows, plan.block * n.Tk);
      s.orows = thread_scratch<T>(Slot::kOutRows, plan.block * n.Dv);
      if (plan.block >= kWidenFrom) s.vrows = thread_scratch<T>(Slot::kValueRows, n.Tk * n.Dv);
    }
    return s;
  }

  void run_item(int64_t item, Scratch& scratch) const {
    const int64_t b = item / plan.blocks_per_row;
    const int64_t t0 = (item % plan.blocks_per_row) * plan.block;
    const int64_t nq = std::min(plan.block, n.Tq - t0);
    const int64_t nk = kv.count(b);
    M* w_out = wp + (b * n.Tq + t0) * n.Tk;
    M* ctx_out = ctxp + (b * n.Tq + t0) * n.Dv;
    T* rows = scratch.prows;
    T* ctx = scratch.orows;
    if constexpr (kInPlace) {
      rows = w_out;
      ctx = ctx_out;
    }
    if (nk > 0) {
      const ItemKeys<T, M> keys = item_keys<T, M>(kt, loc, qp + (b * n.Tq + t0) * n.H, nq, kp, n,
                                                  b, nk, bp, Hp, scratch.qbuf, scratch.kbuf);
      item_scores(kt, keys, sv, scratch.qbuf, nq, nk, Hp, rows, n.Tk);
      prepare_scores<T>(rows, nq, n.Tk, nk, normalize, shift, nullptr);
    }
    softmax_rows<T>(kt, rows, nq, n.Tk, nk, kv.row_mask(b), lp + b * n.Tq + t0);
    // With lengths, only the valid prefix of the values is read (as the Triton kernel does): a
    // decoding step reads a quarter less memory on ragged batches, and a non-finite value in the
    // padding does not reach the context (a row with no valid key gets zeros, never NaN). With a
    // mask, every value is read: a masked key's zero weight times a non-finite value gives NaN, as
    // in the reference's weights @ values.
    const int64_t n_in = kv.row_mask(b) != nullptr ? n.Tk : nk;
    const M* vals = valp + b * n.Tk * n.Dv;
    if (nq >= kWidenFrom) {
      kt.weighted_rows(rows, n.Tk, 1, nq, n_in, widened(kt, vals, n_in * n.Dv, scratch.vrows),
                       n.Dv, ctx);
    } else {
      weighted_rows_of(kt, rows, n.Tk, 1, nq, n_in, vals, n.Dv, ctx);
    }
    if constexpr (!kInPlace) {
      store_rows(kt, rows, nq * n.Tk, w_out);
      store_rows(kt, ctx, nq * n.Dv, ctx_out);
    }
  }
};

}  // namespace

// softmax or sigmoid (the header's Normalize), from the op's schema argument.
Normalize parse_normalize(const char* op, c10::string_view name) {
  if (name == "softmax") return Normalize::kSoftmax;
  if (name == "sigmoid") return Normalize::kSigmoid;
  TORCH_CHECK(false, op, ": normalize must be 'softmax' or 'sigmoid', got '", std::string(name),
              "'");
}

// The ops' optional score bias: one element of a floating dtype on the CPU ([] or [1]).
ScoreShift score_shift(const char* op, const std::optional<Tensor>& score_bias) {
  if (!score_bias.has_value()) return {};
  const Tensor& b = *score_bias;
  TORCH_CHECK(b.numel() == 1 && b.dim() <= 1 && b.is_floating_point() && b.device().is_cpu(), op,
              ": score_bias must be a one-element floating CPU tensor ([] or [1]), got ",
              b.sizes(), " ", b.scalar_type(), " on ", b.device());
  return {b.item<double>(), true};
}

template <typename T, typename M>
std::tuple<Tensor, Tensor, Tensor> forward_impl(const Tensor& query_in, const Tensor& keys_in,
                                                const Tensor& values_in, const Tensor& v_in,
                                                const Tensor& bias_in, const KeyValidity& kv,
                                                const Sizes& n, bool return_weights,
                                                const LocationTerm<T>* loc, Normalize normalize,
                                                ScoreShift shift) {
  const Tensor query = query_in.contiguous(), keys = keys_in.contiguous();
  const Tensor values = values_in.contiguous();
  const Tensor v = v_in.contiguous(), bias = bias_in.contiguous();
  const int64_t Hp = round_up(n.H, kPadTo);
  const auto opts = query.options();
  Tensor weights = at::empty({n.B, n.Tq, n.Tk}, opts);
  Tensor lse = at::empty({n.B, n.Tq}, opts.dtype(at::kFloat));
  Tensor context = at::empty({n.B, n.Tq, n.Dv}, opts);
  const std::vector<T> bias_c = compute_vector<T, M>(bias);
  const ForwardPass<T, M> pass{runtime_kernels<T>(),
                               n,
                               kv,
                               make_plan(n.B, n.Tq, n.Tk, n.H),
                               Hp,
                               score_vectors<T, M>(v, n.H, Hp),
                               in_ptr<M>(query),
                               in_ptr<M>(keys),
                               bias_c.data(),
                               in_ptr<M>(values),
                               out_ptr<M>(weights),
                               out_ptr<M>(context),
                               lse.data_ptr<float>(),
                               loc,
                               normalize,
                               shift};
  using Scratch = typename ForwardPass<T, M>::Scratch;
  for_each_item(
      pass.plan, [&] { return pass.make_scratch(); },
      [&](int64_t item, Scratch& scratch) { pass.run_item(item, scratch); });
  return {context, return_weights ? weights : at::empty({0}, opts), lse};
}

namespace {

std::tuple<Tensor, Tensor, Tensor> additive_attention_fwd(
    const Tensor& query, const Tensor& keys, const Tensor& values, const Tensor& v,
    const Tensor& bias, const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    bool return_weights, c10::string_view normalize_name,
    const std::optional<Tensor>& score_bias) {
  const char* op = "seq2seq_fast::additive_attention_fwd";
  const NoAutocast no_autocast;
  const Sizes n = check_inputs(op, query, keys, values, v, bias, lengths, mask);
  const Normalize normalize = parse_normalize(op, normalize_name);
  const ScoreShift shift = score_shift(op, score_bias);
  const KeyValidity kv = key_validity(op, lengths, mask, n.Tk);
  if (n.B == 0 || n.Tq == 0) {  // no rows: nothing to compute (and no work to plan)
    const auto opts = query.options();
    return {at::zeros({n.B, n.Tq, n.Dv}, opts),
            return_weights ? at::zeros({n.B, n.Tq, n.Tk}, opts) : at::empty({0}, opts),
            at::empty({n.B, n.Tq}, opts.dtype(at::kFloat))};
  }
  if (is_bf16(query)) {  // bfloat16 rows, float32 arithmetic
    return forward_impl<float, Bf16>(query, keys, values, v, bias, kv, n, return_weights, nullptr,
                                     normalize, shift);
  }
  if (query.scalar_type() == at::kDouble) {
    return forward_impl<double, double>(query, keys, values, v, bias, kv, n, return_weights,
                                        nullptr, normalize, shift);
  }
  return forward_impl<float, float>(query, keys, values, v, bias, kv, n, return_weights, nullptr,
                                    normalize, shift);
}

// ---- backward --------------------------------------------------------------------------------

// The backward's outputs and per-item partial buffers, and its one item (run_item, in named
// parts). Without saved weights (have_p false) each item computes its rows of p (into `pp` when
// M = T, which then points at a fresh buffer). DK: the type of the rows dkeys go to (M, or T for
// a float32 grad_keys of bfloat16 keys and for the split rows' partials).
template <typename T, typename M, typename DK>
struct BackwardPass {
  static constexpr bool kInPlace = std::is_same_v<T, M>;
  const KernelTable<T>& kt;
  const Sizes& n;
  const KeyValidity& kv;
  Plan plan;
  int64_t Hp;
  ScoreVectors<T> sv;
  bool have_p;  // pp holds the forward's weights (else each item recomputes its rows)
  bool acc;     // dkeys are added to dkp (grad_keys given), rows s >= length left as they are
  bool split;   // batch rows span several items: dkp holds one partial per item
  const M *qp, *kp;
  const T* bp;
  const M *valp, *dctxp, *gwp;
  M* pp;  // the weights: saved, or (M = T) filled by the items; bfloat16: rounded rows written
          // only when the caller needs them (nullptr otherwise)
  M* dqp;
  DK* dkp;
  M* dvalp;                   // nullptr when dvalues are not formed by the items
  T *dvp, *dbp;               // per item: dv partial [Hp], dbias partial [H]
  const LocationTerm<T>* loc = nullptr;  // a location-aware step (needs acc, one item per row)
  Normalize normalize = Normalize::kSoftmax;  // sigmoid: p recomputed (have_p false)
  ScoreShift shift = {};
  double* shift_parts = nullptr;  // per item: the sum of its score gradients (score bias given)

  struct Scratch {
    T *qbuf, *kbuf, *de, *gq, *gk, *dps;
    T *prows, *orows;  // bfloat16: the item's weights as T; its dvalues / dquery rows
    T *vrows, *grows;  // bfloat16: values and dctx rows widened (kWidenFrom queries or more)
  };
  Scratch make_scratch() const {
    Scratch s{thread_scratch<T>(Slot::kQueries, plan.block * Hp),
              thread_scratch<T>(Slot::kKeys, n.Tk * Hp),
              thread_scratch<T>(Slot::kScoreGrads, plan.block * n.Tk),
              thread_scratch<T>(Slot::kQueryGrads, plan.block * Hp),
              thread_scratch<T>(Slot::kKeyGrads, n.Tk * Hp),
              thread_scratch<T>(Slot::kValueGrads, plan.block * n.Tk),
              nullptr,
              nullptr,
              nullptr,
              nullptr};
    if constexpr (!kInPlace) {
      if (plan.block >= kWidenFrom) {
        s.vrows = thread_scratch<T>(Slot::kValueRows, n.Tk * n.Dv);
        s.grows = thread_scratch<T>(Slot::kGradRows, plan.block * n.Dv);
      }
      s.prows = thread_scratch<T>(Slot::kWeightRows, plan.block * n.Tk);
      s.orows = thread_scratch<T>(Slot::kOutRows,
                                  std::max(plan.block * n.H, (split ? 0 : n.Tk) * n.Dv));
    }
    return s;
  }

  // An item that owns its whole batch row zeroes the rows no valid key writes.
  void zero_unreached_rows(int64_t b, int64_t nk) const {
    if (!acc) std::fill(dkp + (b * n.Tk + nk) * n.H, dkp + (b + 1) * n.Tk * n.H, DK{});
    if (dvalp != nullptr) {
      std::fill(dvalp + (b * n.Tk + nk) * n.Dv, dvalp + (b + 1) * n.Tk * n.Dv, M{});
    }
  }

  // dps[t, s] = dctx[t] . values[s] + grad_weights[t, s] for the item's rows, s < nk.
  // bfloat16 with kWidenFrom queries or more: the dctx rows are left widened in s.grows.
  void weight_grads(int64_t b, int64_t t0, int64_t nq, int64_t nk, T* dps, Scratch& s) const {
    const M* dctx = dctxp + (b * n.Tq + t0) * n.Dv;
    const M* vals = valp + b * n.Tk * n.Dv;
    if (nq >= kWidenFrom) {
      kt.dots(widened(kt, dctx, nq * n.Dv, s.grows), nq, widened(kt, vals, nk * n.Dv, s.vrows),
              nk, n.Dv, dps, n.Tk);
    } else {
      dots_of(kt, dctx, nq, vals, nk, n.Dv, dps, n.Tk);
    }
    if (gwp == nullptr) return;
    const M* g = gwp + (b * n.Tq + t0) * n.Tk;
    for (int64_t t = 0; t < nq; ++t) {
      for (int64_t s = 0; s < nk; ++s) dps[t * n.Tk + s] += T(to_compute(g[t * n.Tk + s]));
    }
  }

  // de = p (dp - sum_s p dp) over the valid keys, 0 elsewhere; returns the sum of de. With
  // factor (sigmoid normalisation, p = softmax of log sigmoid(e)): de times factor =
  // 1 - sigmoid(e), the derivative of log sigmoid(e); that is sigmoid'(e) / S (dp - sum_s p dp),
  // S = sum sigmoid.
  //
  // p is renormalised here (in double: p / sum p, the mean of dp under it): bfloat16 weights (the
  // forward's, saved rounded) sum to 1 only within ~2^-9, and a peaked row's top weight rounds to
  // 1 (1 - p_top, which its score's gradient is proportional to, is lost). With sum p = 1 again,
  // the top score's gradient becomes p_top sum_{s != top} p_s (dp_top - dp_s) of the smaller
  // weights, which bfloat16 keeps to 2^-9 relative, and the row's score gradients sum to 0 as the
  // softmax's do; float32 / float64 weights are changed by their own rounding only. O(Tk) a row.
  double score_grads(const T* p_rows, const T* dps, int64_t nq, int64_t nk, const bool* valid,
                     T* de, const T* factor = nullptr) const {
    double sum_de = 0;
    for (int64_t t = 0; t < nq; ++t) {
      const T* p = p_rows + t * n.Tk;
      const T* g = dps + t * n.Tk;
      T* d = de + t * n.Tk;
      double dot = 0, total = 0;
      for (int64_t s = 0; s < nk; ++s) {
        if (!valid || valid[s]) {
          dot += double(p[s]) * double(g[s]);
          total += double(p[s]);
        }
      }
      // (a row with no valid key, or all its weights 0: de = 0)
      const double inv = total > 0 ? 1.0 / total : 0.0, mean = dot * inv;
      for (int64_t s = 0; s < nk; ++s) {
        d[s] = (!valid || valid[s]) ? T(double(p[s]) * inv * (double(g[s]) - mean)) : T(0);
        if (factor != nullptr) d[s] *= factor[t * n.Tk + s];
        sum_de += d[s];
      }
    }
    return sum_de;
  }

  // The pass over the (query, key) pairs. Unpadded T rows that the item owns get their dkeys
  // written in place, already scaled, or, when accumulating, added there by the kernel
  // (kAddGrads: a decoder step's keys' gradient goes into the sum over the steps without a pass
  // through scratch); otherwise (and for a location-aware step, whose pass reads s.gk) from the
  // item's scratch (still in cache), copied (rounded for bfloat16) or added.
  void key_and_query_grads(const ItemKeys<T, M>& keys, const T* qbuf, int64_t nq, int64_t nk,
                           const T* de, const T* scale, DK* dk_rows, Scratch& s, T* gv) const {
    const bool add_into_rows = acc && !split;  // (split rows write their own slots)
    T* gk_out = s.gk;
    int flags = keys.raw != nullptr ? kStreamed : 0;
    if constexpr (std::is_same_v<DK, T>) {
      if (n.H == Hp && loc == nullptr) {  // (a location-aware step reads s.gk afterwards)
        gk_out = dk_rows;
        if (add_into_rows) flags |= kAddGrads;
      }
    }
    std::fill(s.gq, s.gq + nq * Hp, T(0));
    if (keys.raw != nullptr) {
      fused_grads_of(kt, keys.path, qbuf, nq, keys.raw, nk, Hp, de, n.Tk, s.gq, gk_out, gv, scale,
                     flags);
    } else {
      kt.fused_grads(keys.path, qbuf, nq, keys.packed, nk, Hp, de, n.Tk, s.gq, gk_out, gv, scale,
                     flags);
    }
    if (gk_out != s.gk) return;
    if (add_into_rows) {
      for (int64_t k = 0; k < nk; ++k) add_rows(s.gk + k * Hp, n.H, dk_rows + k * n.H);
    } else {
      for (int64_t k = 0; k < nk; ++k) store_rows(kt, s.gk + k * Hp, n.H, dk_rows + k * n.H);
    }
  }

  // A location-aware step: the item's keys gradient gk (rows s < nk, stride Hp; zero beyond H)
  // multiplied out to conv's rows of batch row b and to the item's W^T partial [C, Hp] (rows Hp
  // long: whole vectors for any C); zeros where nk == 0. conv's rows are C long: a product over
  // W's rows when C is a multiple of 8, else dots of H-long rows (no scalar tail columns).
  void location_grads(int64_t b, int64_t item, int64_t nk, const T* gk) const {
    // bfloat16 conv: the rows formed in per-thread scratch, then rounded into dconv16
    T* dconv = loc->dconv16 != nullptr ? thread_scratch<T>(Slot::kLocationGrads, n.Tk * loc->C)
                                       : loc->dconv + b * n.Tk * loc->C;
    T* dwt = loc->dw_parts + item * loc->C * Hp;
    if (nk > 0) {
      if (loc->C % 8 == 0) {
        kt.weighted_rows(gk, Hp, 1, nk, n.H, loc->w, loc->C, dconv);
      } else {
        kt.dots(gk, nk, loc->wtp, loc->C, Hp, dconv, loc->C);
      }
      kt.weighted_rows(location_conv_rows(kt, *loc, n, b, nk), 1, loc->C, loc->C, nk, gk, Hp,
                       dwt);
    } else {
      std::fill(dwt, dwt + loc->C * Hp, T(0));
    }
    std::fill(dconv + nk * loc->C, dconv + n.Tk * loc->C, T(0));
    if (loc->dconv16 != nullptr) kt.to_bf16(dconv, n.Tk * loc->C, loc->dconv16 + b * n.Tk * loc->C);
  }

  // dq rows from the unscaled sums, and this item's dbias partial (the sum of its dq rows, as T).
  void query_and_bias_grads(int64_t item, const T* gq, int64_t nq, const T* scale, M* dq_out,
                            Scratch& s) const {
    T* dq_rows = s.orows;
    if constexpr (kInPlace) dq_rows = dq_out;
    kt.scale_rows(gq, nq, Hp, scale, dq_rows, n.H);
    T* db = dbp + item * n.H;
    std::copy(dq_rows, dq_rows + n.H, db);
    for (int64_t t = 1; t < nq; ++t) {
      for (int64_t h = 0; h < n.H; ++h) db[h] += dq_rows[t * n.H + h];
    }
    if constexpr (!kInPlace) store_rows(kt, dq_rows, nq * n.H, dq_out);
  }

  void run_item(int64_t item, Scratch& s) const {
    const int64_t b = item / plan.blocks_per_row;
    const int64_t blk = item % plan.blocks_per_row;
    const int64_t t0 = blk * plan.block;
    const int64_t nq = std::min(plan.block, n.Tq - t0);
    T* gv = dvp + item * Hp;  // this item's partial sums
    std::fill(gv, gv + Hp, T(0));
    std::fill(dbp + item * n.H, dbp + (item + 1) * n.H, T(0));
    const int64_t nk = kv.count(b);
    const bool* valid = kv.row_mask(b);
    M* p_out = pp != nullptr ? pp + (b * n.Tq + t0) * n.Tk : nullptr;
    T* p_rows = s.prows;
    if constexpr (kInPlace) p_rows = p_out;
    M* dq_rows = dqp + (b * n.Tq + t0) * n.H;
    if (!split) zero_unreached_rows(b, nk);
    if (shift_parts != nullptr) shift_parts[item] = 0.0;
    if (nk == 0) {
      if (!have_p && p_out != nullptr) std::fill(p_out, p_out + nq * n.Tk, M{});
      std::fill(dq_rows, dq_rows + nq * n.H, M{});
      if (loc != nullptr) location_grads(b, item, 0, nullptr);
      return;
    }
    const ItemKeys<T, M> keys = item_keys<T, M>(kt, loc, qp + (b * n.Tq + t0) * n.H, nq, kp, n, b,
                                                nk, bp, Hp, s.qbuf, s.kbuf);
    const bool prod = keys.path != kRational;
    T* one_minus = nullptr;  // sigmoid normalisation: 1 - sigmoid(e) of the item's rows
    if (!have_p) {  // the forward's weights, recomputed: scores, then the softmax of each row
      item_scores(kt, keys, sv, s.qbuf, nq, nk, Hp, p_rows, n.Tk);
      if (normalize == Normalize::kSigmoid) {
        one_minus = thread_scratch<T>(Slot::kSigmoidRows, nq * n.Tk);
      }
      prepare_scores<T>(p_rows, nq, n.Tk, nk, normalize, shift, one_minus);
      softmax_rows<T>(kt, p_rows, nq, n.Tk, nk, valid, nullptr);
      if constexpr (!kInPlace) {
        if (p_out != nullptr) store_rows(kt, p_rows, nq * n.Tk, p_out);
      }
    } else if constexpr (!kInPlace) {
      kt.from_bf16(p_out, nq * n.Tk, p_rows);
    }
    weight_grads(b, t0, nq, nk, s.dps, s);
    const double sum_de = score_grads(p_rows, s.dps, nq, nk, valid, s.de, one_minus);
    if (shift_parts != nullptr) shift_parts[item] = sum_de;
    // Product path: sech^2 = 4u and tanh = 1 - 2r; rational: sech^2 = u, tanh = y.
    const T* scale = prod ? sv.grad_product.data() : sv.rational.data();
    DK* dk_rows = dkp + (split ? (b * plan.blocks_per_row + blk) : b) * n.Tk * n.H;
    key_and_query_grads(keys, s.qbuf, nq, nk, s.de, scale, dk_rows, s, gv);
    if (loc != nullptr) location_grads(b, item, nk, s.gk);
    if (dvalp != nullptr) {
      M* dval_out = dvalp + b * n.Tk * n.Dv;
      T* dval_rows = s.orows;
      if constexpr (kInPlace) dval_rows = dval_out;
      // (an item that forms dvalues holds its whole batch row: t0 = 0, the rows weight_grads read)
      const M* dctx = dctxp + b * n.Tq * n.Dv;
      if constexpr (!kInPlace) {
        if (nq >= kWidenFrom) {
          kt.weighted_rows(p_rows, 1, n.Tk, nk, nq, s.grows, n.Dv, dval_rows);
        } else {
          weighted_rows_of(kt, p_rows, 1, n.Tk, nk, nq, dctx, n.Dv, dval_rows);
        }
      } else {
        weighted_rows_of(kt, p_rows, 1, n.Tk, nk, nq, dctx, n.Dv, dval_rows);
      }
      if constexpr (!kInPlace) store_rows(kt, dval_rows, nk * n.Dv, dval_out);
    }
    query_and_bias_grads(item, s.gq, nq, scale, dq_rows, s);
    if (prod) {
      for (int64_t h = 0; h < Hp; ++h) gv[h] = T(sum_de) - T(2) * gv[h];
    }
  }
};

// dv and dbias: the items' partials summed in item order (in double).
template <typename T, typename M>
std::pair<Tensor, Tensor> reduce_item_partials(const T* dvp, const T* dbp, int64_t items,
                                               int64_t H, int64_t Hp,
                                               const at::TensorOptions& opts) {
  std::vector<double> sum_v(H, 0.0), sum_b(H, 0.0);
  for (int64_t item = 0; item < items; ++item) {
    for (int64_t h = 0; h < H; ++h) {
      sum_v[h] += dvp[item * Hp + h];
      sum_b[h] += dbp[item * H + h];
    }
  }
  Tensor dv = at::empty({H}, opts), dbias = at::empty({H}, opts);
  M* dvo = out_ptr<M>(dv);
  M* dbo = out_ptr<M>(dbias);
  for (int64_t h = 0; h < H; ++h) {
    dvo[h] = to_storage<M>(T(sum_v[h]));
    dbo[h] = to_storage<M>(T(sum_b[h]));
  }
  return {dv, dbias};
}

}  // namespace

// Gradients of every input; dkeys_acc given: dkeys added to it (returned as is); want_dvalues
// false: no dvalues (an undefined tensor).
template <typename T, typename M, typename DK>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query_in,
    const Tensor& keys_in, const Tensor& values_in, const Tensor& v_in, const Tensor& bias_in,
    const KeyValidity& kv, const Sizes& n, const Tensor& saved_weights, const Tensor& dkeys_acc,
    bool want_dvalues, const LocationTerm<T>* loc, Normalize normalize, ScoreShift shift,
    double* grad_shift) {
  constexpr bool kInPlace = std::is_same_v<T, M>;
  const Tensor query = query_in.contiguous(), keys = keys_in.contiguous();
  const Tensor values = values_in.contiguous(), dctx = grad_context.contiguous();
  const Tensor v = v_in.contiguous(), bias = bias_in.contiguous();
  const Tensor gw = grad_weights.has_value() ? grad_weights->contiguous() : Tensor();
  const int64_t Hp = round_up(n.H, kPadTo);
  const auto opts = query.options();
  const auto compute_opts = opts.dtype(c10::CppTypeToScalarType<T>::value);
  const Plan plan = make_plan(n.B, n.Tq, n.Tk, n.H);
  const bool have_p = saved_weights.defined(), acc = dkeys_acc.defined();
  const bool split = plan.blocks_per_row > 1;
  const bool dvalues_in_items = want_dvalues && !split;
  // Without saved weights: a buffer for the items' rows (M = T: where they are formed; bfloat16:
  // only when the values' gradient needs them whole, below).
  Tensor probs = have_p ? saved_weights.contiguous()
                        : (kInPlace || (want_dvalues && split) ? at::empty({n.B, n.Tq, n.Tk}, opts)
                                                               : Tensor());
  Tensor dq = empty_output({n.B, n.Tq, n.H}, opts);
  Tensor dk = acc ? dkeys_acc : empty_output({n.B, n.Tk, n.H}, opts);
  // Split rows: each item's dkeys (already scaled) in its own slot, summed in order afterwards.
  Tensor dk_parts =
      split ? at::zeros({n.B, plan.blocks_per_row, n.Tk, n.H}, compute_opts) : Tensor();
  using DKElement = std::conditional_t<std::is_same_v<DK, Bf16>, at::BFloat16, DK>;
  constexpr auto dk_dtype = c10::CppTypeToScalarType<DKElement>::value;
  TORCH_CHECK((split ? dk_parts : dk).scalar_type() == dk_dtype,
              "seq2seq_fast: internal: dkeys rows of an unexpected dtype");
  // Plain buffers, no torch op: every torch op here would be one more parallel region.
  std::unique_ptr<T[]> dv_parts(new T[size_t(plan.items) * size_t(Hp)]);
  std::unique_ptr<T[]> db_parts(new T[size_t(plan.items) * size_t(n.H)]);
  Tensor dvalues = dvalues_in_items ? empty_output({n.B, n.Tk, n.Dv}, opts) : Tensor();
  std::vector<double> shift_parts(grad_shift != nullptr ? size_t(plan.items) : size_t(0));
  const std::vector<T> bias_c = compute_vector<T, M>(bias);
  const BackwardPass<T, M, DK> pass{runtime_kernels<T>(),
                                    n,
                                    kv,
                                    plan,
                                    Hp,
                                    score_vectors<T, M>(v, n.H, Hp),
                                    have_p,
                                    acc,
                                    split,
                                    in_ptr<M>(query),
                                    in_ptr<M>(keys),
                                    bias_c.data(),
                                    in_ptr<M>(values),
                                    in_ptr<M>(dctx),
                                    gw.defined() ? in_ptr<M>(gw) : nullptr,
                                    probs.defined() ? out_ptr<M>(probs) : nullptr,
                                    out_ptr<M>(dq),
                                    out_ptr<DK>(split ? dk_parts : dk),
                                    dvalues_in_items ? out_ptr<M>(dvalues) : nullptr,
                                    dv_parts.get(),
                                    db_parts.get(),
                                    loc,
                                    normalize,
                                    shift,
                                    grad_shift != nullptr ? shift_parts.data() : nullptr};
  using Scratch = typename BackwardPass<T, M, DK>::Scratch;
  for_each_item(
      plan, [&] { return pass.make_scratch(); },
      [&](int64_t item, Scratch& scratch) { pass.run_item(item, scratch); });
  if (split && acc) {
    dk.add_(dk_parts.sum(1));
  } else if (split) {
    if constexpr (std::is_same_v<M, Bf16>) {
      // Summed in float32 in block order and rounded once into the bfloat16 rows: no float32
      // [B, Tk, H] temporary beyond what float32 needs (the partials).
      const T* parts = dk_parts.data_ptr<T>();
      M* out = out_ptr<M>(dk);
      const int64_t row = n.Tk * n.H, blocks = plan.blocks_per_row;
      at::parallel_for(0, n.B * n.Tk, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const T* first = parts + (r / n.Tk) * blocks * row + (r % n.Tk) * n.H;
          for (int64_t h = 0; h < n.H; ++h) {
            T sum = first[h];
            for (int64_t blk = 1; blk < blocks; ++blk) sum += first[blk * row + h];
            out[r * n.H + h] = to_storage<M>(sum);
          }
        }
      });
    } else {
      at::sum_out(dk, dk_parts, {1});
    }
  }
  auto [dv, dbias] = reduce_item_partials<T, M>(dv_parts.get(), db_parts.get(), plan.items, n.H,
                                                Hp, opts);
  if (want_dvalues && !dvalues_in_items) dvalues = at::bmm(probs.transpose(1, 2), dctx);
  if (grad_shift != nullptr) {  // in item order: reproducible
    double sum = 0.0;
    for (const double part : shift_parts) sum += part;
    *grad_shift = sum;
  }
  return {dq, dk, dvalues, dv, dbias};
}

// The passes the location-aware step (csrc/location_attention.cpp) calls.
template std::tuple<Tensor, Tensor, Tensor> forward_impl<float, float>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const KeyValidity&,
    const Sizes&, bool, const LocationTerm<float>*, Normalize, ScoreShift);
template std::tuple<Tensor, Tensor, Tensor> forward_impl<double, double>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const KeyValidity&,
    const Sizes&, bool, const LocationTerm<double>*, Normalize, ScoreShift);
template std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl<float, float, float>(
    const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const KeyValidity&, const Sizes&, const Tensor&, const Tensor&,
    bool, const LocationTerm<float>*, Normalize, ScoreShift, double*);
template std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>
backward_impl<double, double, double>(const Tensor&, const std::optional<Tensor>&, const Tensor&,
                                      const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const KeyValidity&, const Sizes&, const Tensor&,
                                      const Tensor&, bool, const LocationTerm<double>*,
                                      Normalize, ScoreShift, double*);
template std::tuple<Tensor, Tensor, Tensor> forward_impl<float, Bf16>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const KeyValidity&,
    const Sizes&, bool, const LocationTerm<float>*, Normalize, ScoreShift);
template std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl<float, Bf16, float>(
    const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const KeyValidity&, const Sizes&, const Tensor&, const Tensor&,
    bool, const LocationTerm<float>*, Normalize, ScoreShift, double*);
template std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl<float, Bf16, Bf16>(
    const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const KeyValidity&, const Sizes&, const Tensor&, const Tensor&,
    bool, const LocationTerm<float>*, Normalize, ScoreShift, double*);

namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> checked_backward(
    const char* op, const Tensor& grad_context, const std::optional<Tensor>& grad_weights,
    const Tensor& query, const Tensor& keys, const Tensor& values, const Tensor& v,
    const Tensor& bias, const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const Tensor& lse, const std::optional<Tensor>& weights, const Tensor& dkeys_acc,
    bool want_dvalues, Normalize normalize = Normalize::kSoftmax, ScoreShift shift = {},
    double* grad_shift = nullptr) {
  const NoAutocast no_autocast;
  const Sizes n = check_inputs(op, query, keys, values, v, bias, lengths, mask);
  TORCH_CHECK(grad_context.dim() == 3 && grad_context.size(0) == n.B &&
                  grad_context.size(1) == n.Tq && grad_context.size(2) == n.Dv,
              op, ": grad_context must be [B, Tq, Dv]=[", n.B, ", ", n.Tq, ", ", n.Dv, "], got ",
              grad_context.sizes());
  TORCH_CHECK(grad_context.scalar_type() == query.scalar_type(), op,
              ": grad_context must have query's dtype, got ", grad_context.scalar_type());
  if (grad_weights.has_value()) {
    TORCH_CHECK(grad_weights->dim() == 3 && grad_weights->size(0) == n.B &&
                    grad_weights->size(1) == n.Tq && grad_weights->size(2) == n.Tk,
                op, ": grad_weights must be [B, Tq, Tk]=[", n.B, ", ", n.Tq, ", ", n.Tk,
                "], got ", grad_weights->sizes());
    TORCH_CHECK(grad_weights->scalar_type() == query.scalar_type(), op,
                ": grad_weights must have query's dtype, got ", grad_weights->scalar_type());
  }
  // lse: checked for the public op's contract (Triton reads it; the CPU backward does not)
  TORCH_CHECK(!lse.defined() || (lse.dim() == 2 && lse.size(0) == n.B && lse.size(1) == n.Tq),
              op, ": lse must be [B, Tq], got ", lse.sizes());
  // weights: the forward's softmax weights (optional; an empty tensor counts as absent).
  Tensor saved_p;
  if (weights.has_value() && weights->numel() > 0) {
    TORCH_CHECK(weights->dim() == 3 && weights->size(0) == n.B && weights->size(1) == n.Tq &&
                    weights->size(2) == n.Tk,
                op, ": weights must be [B, Tq, Tk]=[", n.B, ", ", n.Tq, ", ", n.Tk, "], got ",
                weights->sizes());
    TORCH_CHECK(weights->scalar_type() == query.scalar_type(), op,
                ": weights must have query's dtype, got ", weights->scalar_type());
    // sigmoid normalisation: the backward needs 1 - sigmoid(e) too; it recomputes the scores
    if (normalize == Normalize::kSoftmax) saved_p = *weights;
  }
  if (dkeys_acc.defined()) {
    // bfloat16 keys: grad_keys may be float32 (exact sums over many calls)
    const bool dtype_ok = dkeys_acc.scalar_type() == keys.scalar_type() ||
                          (is_bf16(keys) && dkeys_acc.scalar_type() == at::kFloat);
    TORCH_CHECK(dkeys_acc.sizes() == keys.sizes() && dtype_ok && dkeys_acc.device().is_cpu() &&
                    dkeys_acc.is_contiguous(),
                op, ": grad_keys must be a contiguous CPU tensor of keys' shape ", keys.sizes(),
                " and dtype ", keys.scalar_type(), ", got ", dkeys_acc.sizes(), " ",
                dkeys_acc.scalar_type(), (dkeys_acc.is_contiguous() ? "" : " (not contiguous)"));
  }
  const KeyValidity kv = key_validity(op, lengths, mask, n.Tk);
  if (grad_shift != nullptr) *grad_shift = 0.0;
  if (n.B == 0 || n.Tq == 0) {  // no rows: every gradient is zero
    // (contiguous, as every output: zeros_like would keep a transposed input's strides)
    const auto zeros = [](const Tensor& t) { return at::zeros(t.sizes(), t.options()); };
    return {zeros(query), dkeys_acc.defined() ? dkeys_acc : zeros(keys),
            want_dvalues ? zeros(values) : Tensor(), zeros(v), zeros(bias)};
  }
  if (is_bf16(query)) {  // bfloat16 rows, float32 arithmetic; dkeys rows float32 or bfloat16
    const bool float_dkeys = make_plan(n.B, n.Tq, n.Tk, n.H).blocks_per_row > 1 ||
                             (dkeys_acc.defined() && dkeys_acc.scalar_type() == at::kFloat);
    if (float_dkeys) {
      return backward_impl<float, Bf16, float>(grad_context, grad_weights, query, keys, values, v,
                                               bias, kv, n, saved_p, dkeys_acc, want_dvalues,
        nullptr, normalize, shift, grad_shift);
    }
    return backward_impl<float, Bf16, Bf16>(grad_context, grad_weights, query, keys, values, v,
                                            bias, kv, n, saved_p, dkeys_acc, want_dvalues,
        nullptr, normalize, shift, grad_shift);
  }
  if (query.scalar_type() == at::kDouble) {
    return backward_impl<double, double, double>(grad_context, grad_weights, query, keys, values,
                                                 v, bias, kv, n, saved_p, dkeys_acc, want_dvalues,
        nullptr, normalize, shift, grad_shift);
  }
  return backward_impl<float, float, float>(grad_context, grad_weights, query, keys, values, v,
                                            bias, kv, n, saved_p, dkeys_acc, want_dvalues,
        nullptr, normalize, shift, grad_shift);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> additive_attention_bwd(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query,
    const Tensor& keys, const Tensor& values, const Tensor& v, const Tensor& bias,
    const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const Tensor& context, const Tensor& lse, const std::optional<Tensor>& weights,
    c10::string_view normalize_name) {
  // context and lse are the contract's (Triton reads lse); the CPU backward forms dp . p from dp
  // and, without the forward's weights (or with the sigmoid normalisation), recomputes them from
  // the scores.
  (void)context;
  const char* op = "seq2seq_fast::additive_attention_bwd";
  return checked_backward(op, grad_context, grad_weights, query, keys, values, v, bias, lengths,
                          mask, lse, weights, Tensor(), true, parse_normalize(op, normalize_name));
}

// The backward with a score bias (the overload additive_attention_bwd.score_bias): the five
// gradients of additive_attention_bwd, then the score bias's, of its shape and dtype.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> additive_attention_bwd_score_bias(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query,
    const Tensor& keys, const Tensor& values, const Tensor& v, const Tensor& bias,
    const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const Tensor& context, const Tensor& lse, const std::optional<Tensor>& weights,
    c10::string_view normalize_name, const Tensor& score_bias) {
  (void)context;
  const char* op = "seq2seq_fast::additive_attention_bwd.score_bias";
  const ScoreShift shift = score_shift(op, score_bias);
  double grad_shift = 0.0;
  auto [dq, dk, dvalues, dv, dbias] = checked_backward(
      op, grad_context, grad_weights, query, keys, values, v, bias, lengths, mask, lse, weights,
      Tensor(), true, parse_normalize(op, normalize_name), shift, &grad_shift);
  return {dq, dk, dvalues, dv, dbias, at::full_like(score_bias, grad_shift)};
}

// The backward of one call among many that attend to the same keys and values (a decoder's
// steps): dkeys are added to grad_keys in place and dvalues are not formed (the caller forms
// them once for all calls from their weights and grad_context: one batched product instead of a
// [B, Tk, Dv] tensor per call, written and then summed by autograd). Returns (dquery, dv, dbias).
std::tuple<Tensor, Tensor, Tensor> additive_attention_bwd_accumulate(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query,
    const Tensor& keys, const Tensor& values, const Tensor& v, const Tensor& bias,
    const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const std::optional<Tensor>& weights, const Tensor& grad_keys) {
  auto grads = checked_backward("seq2seq_fast::_additive_attention_bwd_accumulate", grad_context,
                                grad_weights, query, keys, values, v, bias, lengths, mask,
                                Tensor(), weights, grad_keys, false);
  return {std::get<0>(grads), std::get<3>(grads), std::get<4>(grads)};
}


}  // namespace
}  // namespace seq2seq_fast

// The two main schemas are defined in Python (seq2seq_fast/ops/additive_attention.py); only their
// CPU kernels here.
TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("additive_attention_fwd", &seq2seq_fast::additive_attention_fwd);
  m.impl("additive_attention_bwd", &seq2seq_fast::additive_attention_bwd);
  m.impl("additive_attention_bwd.score_bias", &seq2seq_fast::additive_attention_bwd_score_bias);
}

// The accumulating backward is private to the extension (CPU only; its caller is
// seq2seq_fast/nn/stepwise.py, its fake kernel in seq2seq_fast/ops/additive_attention.py).
TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def(
      "_additive_attention_bwd_accumulate(Tensor grad_context, Tensor? grad_weights, "
      "Tensor query, Tensor keys, Tensor values, Tensor v, Tensor bias, Tensor? lengths, "
      "Tensor? mask, Tensor? weights, Tensor(a!) grad_keys) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_additive_attention_bwd_accumulate", &seq2seq_fast::additive_attention_bwd_accumulate);
}
