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
#include <vector>

#include "additive_attention.h"
#include "bf16.h"
#include "runtime.h"

namespace seq2seq_fast {
namespace {

template <typename T>
struct ProductRange;  // the product path's limits (csrc/kernels/kernels.h)
template <>
struct ProductRange<float> {
  static constexpr float limit = kProductLimitFloat, safe_sum = kProductSafeSumFloat;
};
template <>
struct ProductRange<double> {
  static constexpr double limit = kProductLimitDouble, safe_sum = kProductSafeSumDouble;
};

// The product path pays exp() on every packed query and key element (about 14 vector operations
// per 16 elements, against 5 per element pair for the product and 18 for the rational tanh):
// it wins from two queries per work item on, and loses for one (a decoding step).
constexpr int64_t kMinQueriesForProduct = 2;

// ---- checks ----------------------------------------------------------------------------------

}  // namespace

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
      TORCH_CHECK(kv.len[b] >= 0 && kv.len[b] <= Tk, op, ": lengths must lie in [0, Tk=", Tk,
                  "], got ", kv.len[b], " at batch row ", b);
    }
  }
  if (mask.has_value()) {
    kv.mask = mask->contiguous();
    kv.mask_ptr = kv.mask.data_ptr<bool>();
  }
  return kv;
}

namespace {

// ---- per-item pieces -------------------------------------------------------------------------

// Score vectors for both paths, padded with zeros to Hp.
template <typename T>
struct ScoreVectors {
  std::vector<T> rational;  // v
  std::vector<T> product;   // -2 v
  std::vector<T> grad_product;  // 4 v: sech^2 = 4 (r - r^2)
  T sum_v = 0;              // sum v (tanh = 1 - 2r)
};

template <typename T>
ScoreVectors<T> score_vectors(const Tensor& v, int64_t H, int64_t Hp) {
  ScoreVectors<T> sv;
  sv.rational.assign(Hp, T(0));
  sv.product.assign(Hp, T(0));
  sv.grad_product.assign(Hp, T(0));
  const T* vp = v.data_ptr<T>();
  double sum = 0;
  for (int64_t h = 0; h < H; ++h) {
    sv.rational[h] = vp[h];
    sv.product[h] = T(-2) * vp[h];
    sv.grad_product[h] = T(4) * vp[h];
    sum += vp[h];
  }
  sv.sum_v = T(sum);
  return sv;
}

// Packs an item's query rows (+ bias) and its batch row's keys; picks the tanh path. The keys
// the score kernels should read are returned in `keys_out`: the packed copy, or, on the rational
// path with H already a multiple of kPadTo, the input rows themselves (a decoding step streams
// B * Tk * H keys from memory once: copying them first would read and write them twice).
template <typename T>
int pack_item(const KernelTable<T>& kt, const T* q_rows, int64_t nq, const T* k_rows, int64_t nk,
              const T* bias, int64_t H, int64_t Hp, T* qbuf, T* kbuf, const T** keys_out) {
  const T q_max = kt.pack_rows(q_rows, nq, H, bias, qbuf, Hp);
  *keys_out = kbuf;
  if (nq < kMinQueriesForProduct) {
    if (H == Hp) {
      *keys_out = k_rows;
    } else {
      kt.pack_rows(k_rows, nk, H, nullptr, kbuf, Hp);
    }
    return kRational;
  }
  const T k_max = kt.pack_rows(k_rows, nk, H, nullptr, kbuf, Hp);
  if (q_max <= ProductRange<T>::limit && k_max <= ProductRange<T>::limit) {
    kt.exp_inplace(qbuf, nq * Hp, T(2));
    kt.exp_inplace(kbuf, nk * Hp, T(2));
    return q_max + k_max <= ProductRange<T>::safe_sum ? kProduct : kProductCapped;
  }
  return kRational;
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


// ---- location term ---------------------------------------------------------------------------

// The keys rows s < nk that an item of batch row b reads (rows H long): the keys tensor's, or for
// a location-aware step (loc given, `keys` then the projected memory) projected[s] + conv[s] W^T
// formed in per-thread scratch.
template <typename T>
const T* item_keys(const KernelTable<T>& kt, const LocationTerm<T>* loc, const T* keys,
                   const Sizes& n, int64_t b, int64_t nk) {
  const T* rows = keys + b * n.Tk * n.H;
  if (loc == nullptr) return rows;
  T* out = thread_scratch<T>(Slot::kFormedKeys, n.Tk * n.H);
  kt.weighted_rows(loc->conv + b * n.Tk * loc->C, loc->C, 1, nk, loc->C, loc->wt, n.H, out);
  for (int64_t e = 0; e < nk * n.H; ++e) out[e] += rows[e];
  return out;
}

// ---- forward ---------------------------------------------------------------------------------

// One item of the forward: scores of queries [t0, t0 + nq) of batch row b against its valid keys,
// their softmax into the weights and lse, and the context rows.
template <typename T>
struct ForwardPass {
  const KernelTable<T>& kt;
  const Sizes& n;
  const KeyValidity& kv;
  Plan plan;
  int64_t Hp;
  ScoreVectors<T> sv;
  const T *qp, *kp, *bp, *valp;
  T *wp, *ctxp;
  float* lp;
  const LocationTerm<T>* loc = nullptr;  // a location-aware step: keys formed per item

  struct Scratch {
    T *qbuf, *kbuf;
  };
  Scratch make_scratch() const {
    return {thread_scratch<T>(Slot::kQueries, plan.block * Hp),
            thread_scratch<T>(Slot::kKeys, n.Tk * Hp)};
  }

  void run_item(int64_t item, Scratch& scratch) const {
    const int64_t b = item / plan.blocks_per_row;
    const int64_t t0 = (item % plan.blocks_per_row) * plan.block;
    const int64_t nq = std::min(plan.block, n.Tq - t0);
    const int64_t nk = kv.count(b);
    T* rows = wp + (b * n.Tq + t0) * n.Tk;
    if (nk > 0) {
      const T* k_rows = item_keys<T>(kt, loc, kp, n, b, nk);
      const T* kbuf = nullptr;
      const int path = pack_item<T>(kt, qp + (b * n.Tq + t0) * n.H, nq, k_rows, nk, bp, n.H, Hp,
                                    scratch.qbuf, scratch.kbuf, &kbuf);
      const bool prod = path != kRational;
      kt.scores(path, scratch.qbuf, nq, kbuf, nk, Hp,
                prod ? sv.product.data() : sv.rational.data(), prod ? sv.sum_v : T(0), rows,
                n.Tk);
    }
    softmax_rows<T>(kt, rows, nq, n.Tk, nk, kv.row_mask(b), lp + b * n.Tq + t0);
    // With lengths, only the valid prefix of the values is read (as the Triton kernel does): a
    // decoding step reads a quarter less memory on ragged batches, and a non-finite value in the
    // padding does not reach the context (a row with no valid key gets zeros, never NaN). With a
    // mask, every value is read: a masked key's zero weight times a non-finite value gives NaN, as
    // in the reference's weights @ values.
    const int64_t n_in = kv.row_mask(b) != nullptr ? n.Tk : nk;
    kt.weighted_rows(rows, n.Tk, 1, nq, n_in, valp + b * n.Tk * n.Dv, n.Dv,
                     ctxp + (b * n.Tq + t0) * n.Dv);
  }
};

}  // namespace

template <typename T>
std::tuple<Tensor, Tensor, Tensor> forward_impl(const Tensor& query_in, const Tensor& keys_in,
                                                const Tensor& values_in, const Tensor& v_in,
                                                const Tensor& bias_in, const KeyValidity& kv,
                                                const Sizes& n, bool return_weights,
                                                const LocationTerm<T>* loc) {
  const Tensor query = query_in.contiguous(), keys = keys_in.contiguous();
  const Tensor values = values_in.contiguous();
  const Tensor v = v_in.contiguous(), bias = bias_in.contiguous();
  const int64_t Hp = round_up(n.H, kPadTo);
  const auto opts = query.options();
  Tensor weights = at::empty({n.B, n.Tq, n.Tk}, opts);
  Tensor lse = at::empty({n.B, n.Tq}, opts.dtype(at::kFloat));
  Tensor context = at::empty({n.B, n.Tq, n.Dv}, opts);
  const ForwardPass<T> pass{runtime_kernels<T>(),
                            n,
                            kv,
                            make_plan(n.B, n.Tq, n.Tk, n.H),
                            Hp,
                            score_vectors<T>(v, n.H, Hp),
                            query.data_ptr<T>(),
                            keys.data_ptr<T>(),
                            bias.data_ptr<T>(),
                            values.data_ptr<T>(),
                            weights.data_ptr<T>(),
                            context.data_ptr<T>(),
                            lse.data_ptr<float>(),
                            loc};
  using Scratch = typename ForwardPass<T>::Scratch;
  for_each_item(
      pass.plan, [&] { return pass.make_scratch(); },
      [&](int64_t item, Scratch& scratch) { pass.run_item(item, scratch); });
  return {context, return_weights ? weights : at::empty({0}, opts), lse};
}

namespace {

std::tuple<Tensor, Tensor, Tensor> additive_attention_fwd(
    const Tensor& query, const Tensor& keys, const Tensor& values, const Tensor& v,
    const Tensor& bias, const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    bool return_weights) {
  const char* op = "seq2seq_fast::additive_attention_fwd";
  const NoAutocast no_autocast;
  const Sizes n = check_inputs(op, query, keys, values, v, bias, lengths, mask);
  const KeyValidity kv = key_validity(op, lengths, mask, n.Tk);
  if (n.B == 0 || n.Tq == 0) {  // no rows: nothing to compute (and no work to plan)
    const auto opts = query.options();
    return {at::zeros({n.B, n.Tq, n.Dv}, opts),
            return_weights ? at::zeros({n.B, n.Tq, n.Tk}, opts) : at::empty({0}, opts),
            at::empty({n.B, n.Tq}, opts.dtype(at::kFloat))};
  }
  if (is_bf16(query)) {  // float32 inside (bf16.h)
    auto [context, weights, lse] = forward_impl<float>(as_float(query), as_float(keys),
                                                       as_float(values), as_float(v),
                                                       as_float(bias), kv, n, return_weights);
    return {to_bf16(context), to_bf16(weights), lse};
  }
  if (query.scalar_type() == at::kDouble) {
    return forward_impl<double>(query, keys, values, v, bias, kv, n, return_weights);
  }
  return forward_impl<float>(query, keys, values, v, bias, kv, n, return_weights);
}

// ---- backward --------------------------------------------------------------------------------

// The backward's outputs and per-item partial buffers, and its one item (run_item, in named
// parts). Without saved weights (have_p false) `pp` points at a fresh buffer the items fill.
template <typename T>
struct BackwardPass {
  const KernelTable<T>& kt;
  const Sizes& n;
  const KeyValidity& kv;
  Plan plan;
  int64_t Hp;
  ScoreVectors<T> sv;
  bool have_p;  // pp holds the forward's weights (else each item recomputes its rows)
  bool acc;     // dkeys are added to dkp (grad_keys given), rows s >= length left as they are
  bool split;   // batch rows span several items: dkp holds one partial per item
  const T *qp, *kp, *bp, *valp, *dctxp, *gwp;
  T *pp, *dqp, *dkp, *dvalp;  // dvalp: nullptr when dvalues are not formed by the items
  T *dvp, *dbp;               // per item: dv partial [Hp], dbias partial [H]
  const LocationTerm<T>* loc = nullptr;  // a location-aware step (needs acc, one item per row)

  struct Scratch {
    T *qbuf, *kbuf, *de, *gq, *gk, *dps;
  };
  Scratch make_scratch() const {
    return {thread_scratch<T>(Slot::kQueries, plan.block * Hp),
            thread_scratch<T>(Slot::kKeys, n.Tk * Hp),
            thread_scratch<T>(Slot::kScoreGrads, plan.block * n.Tk),
            thread_scratch<T>(Slot::kQueryGrads, plan.block * Hp),
            thread_scratch<T>(Slot::kKeyGrads, n.Tk * Hp),
            thread_scratch<T>(Slot::kValueGrads, plan.block * n.Tk)};
  }

  // An item that owns its whole batch row zeroes the rows no valid key writes.
  void zero_unreached_rows(int64_t b, int64_t nk) const {
    if (!acc) std::fill(dkp + (b * n.Tk + nk) * n.H, dkp + (b + 1) * n.Tk * n.H, T(0));
    if (dvalp != nullptr) {
      std::fill(dvalp + (b * n.Tk + nk) * n.Dv, dvalp + (b + 1) * n.Tk * n.Dv, T(0));
    }
  }

  // dps[t, s] = dctx[t] . values[s] + grad_weights[t, s] for the item's rows, s < nk.
  void weight_grads(int64_t b, int64_t t0, int64_t nq, int64_t nk, T* dps) const {
    kt.dots(dctxp + (b * n.Tq + t0) * n.Dv, nq, valp + b * n.Tk * n.Dv, nk, n.Dv, dps, n.Tk);
    if (gwp == nullptr) return;
    const T* g = gwp + (b * n.Tq + t0) * n.Tk;
    for (int64_t t = 0; t < nq; ++t) {
      for (int64_t s = 0; s < nk; ++s) dps[t * n.Tk + s] += g[t * n.Tk + s];
    }
  }

  // de = p (dp - sum_s p dp) over the valid keys, 0 elsewhere; returns the sum of de.
  double score_grads(const T* p_rows, const T* dps, int64_t nq, int64_t nk, const bool* valid,
                     T* de) const {
    double sum_de = 0;
    for (int64_t t = 0; t < nq; ++t) {
      const T* p = p_rows + t * n.Tk;
      const T* g = dps + t * n.Tk;
      T* d = de + t * n.Tk;
      double dot = 0;
      for (int64_t s = 0; s < nk; ++s) {
        if (!valid || valid[s]) dot += double(p[s]) * double(g[s]);
      }
      for (int64_t s = 0; s < nk; ++s) {
        d[s] = (!valid || valid[s]) ? p[s] * (g[s] - T(dot)) : T(0);
        sum_de += d[s];
      }
    }
    return sum_de;
  }

  // The pass over the (query, key) pairs. Unpadded rows that the item owns get their dkeys
  // written in place, already scaled; otherwise from the item's scratch (still in cache), copied
  // or, when accumulating, added.
  void key_and_query_grads(int path, const T* qbuf, int64_t nq, const T* kbuf, int64_t nk,
                           const T* de, const T* scale, T* dk_rows, Scratch& s, T* gv) const {
    const bool add_into_rows = acc && !split;  // (split rows write their own slots)
    T* gk_out = n.H == Hp && !add_into_rows ? dk_rows : s.gk;
    std::fill(s.gq, s.gq + nq * Hp, T(0));
    kt.fused_grads(path, qbuf, nq, kbuf, nk, Hp, de, n.Tk, s.gq, gk_out, gv, scale);
    if (add_into_rows) {
      for (int64_t k = 0; k < nk; ++k) {
        const T* src = s.gk + k * Hp;
        T* dst = dk_rows + k * n.H;
        for (int64_t h = 0; h < n.H; ++h) dst[h] += src[h];
      }
    } else if (gk_out == s.gk) {
      for (int64_t k = 0; k < nk; ++k) {
        std::copy(s.gk + k * Hp, s.gk + k * Hp + n.H, dk_rows + k * n.H);
      }
    }
  }

  // A location-aware step: the item's keys gradient gk (rows s < nk, stride Hp; zero beyond H)
  // multiplied out to conv's rows of batch row b and to the item's W^T partial [C, Hp] (rows Hp
  // long: whole vectors for any C); zeros where nk == 0. conv's rows are C long: a product over
  // W's rows when C is a multiple of 8, else dots of H-long rows (no scalar tail columns).
  void location_grads(int64_t b, int64_t item, int64_t nk, const T* gk) const {
    T* dconv = loc->dconv + b * n.Tk * loc->C;
    T* dwt = loc->dw_parts + item * loc->C * Hp;
    if (nk > 0) {
      if (loc->C % 8 == 0) {
        kt.weighted_rows(gk, Hp, 1, nk, n.H, loc->w, loc->C, dconv);
      } else {
        kt.dots(gk, nk, loc->wtp, loc->C, Hp, dconv, loc->C);
      }
      kt.weighted_rows(loc->conv + b * n.Tk * loc->C, 1, loc->C, loc->C, nk, gk, Hp, dwt);
    } else {
      std::fill(dwt, dwt + loc->C * Hp, T(0));
    }
    std::fill(dconv + nk * loc->C, dconv + n.Tk * loc->C, T(0));
  }

  // dq rows from the unscaled sums, and this item's dbias partial (the sum of its dq rows).
  void query_and_bias_grads(int64_t item, const T* gq, int64_t nq, const T* scale,
                            T* dq_rows) const {
    kt.scale_rows(gq, nq, Hp, scale, dq_rows, n.H);
    T* db = dbp + item * n.H;
    std::copy(dq_rows, dq_rows + n.H, db);
    for (int64_t t = 1; t < nq; ++t) {
      for (int64_t h = 0; h < n.H; ++h) db[h] += dq_rows[t * n.H + h];
    }
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
    T* p_rows = pp + (b * n.Tq + t0) * n.Tk;
    T* dq_rows = dqp + (b * n.Tq + t0) * n.H;
    if (!split) zero_unreached_rows(b, nk);
    if (nk == 0) {
      if (!have_p) std::fill(p_rows, p_rows + nq * n.Tk, T(0));
      std::fill(dq_rows, dq_rows + nq * n.H, T(0));
      if (loc != nullptr) location_grads(b, item, 0, nullptr);
      return;
    }
    const T* k_rows = item_keys<T>(kt, loc, kp, n, b, nk);
    const T* kbuf = nullptr;
    const int path = pack_item<T>(kt, qp + (b * n.Tq + t0) * n.H, nq, k_rows, nk, bp, n.H, Hp,
                                  s.qbuf, s.kbuf, &kbuf);
    const bool prod = path != kRational;
    if (!have_p) {  // the forward's weights, recomputed: scores, then the softmax of each row
      kt.scores(path, s.qbuf, nq, kbuf, nk, Hp, prod ? sv.product.data() : sv.rational.data(),
                prod ? sv.sum_v : T(0), p_rows, n.Tk);
      softmax_rows<T>(kt, p_rows, nq, n.Tk, nk, valid, nullptr);
    }
    weight_grads(b, t0, nq, nk, s.dps);
    const double sum_de = score_grads(p_rows, s.dps, nq, nk, valid, s.de);
    // Product path: sech^2 = 4u and tanh = 1 - 2r; rational: sech^2 = u, tanh = y.
    const T* scale = prod ? sv.grad_product.data() : sv.rational.data();
    T* dk_rows = dkp + (split ? (b * plan.blocks_per_row + blk) : b) * n.Tk * n.H;
    key_and_query_grads(path, s.qbuf, nq, kbuf, nk, s.de, scale, dk_rows, s, gv);
    if (loc != nullptr) location_grads(b, item, nk, s.gk);
    if (dvalp != nullptr) {
      kt.weighted_rows(p_rows, 1, n.Tk, nk, nq, dctxp + b * n.Tq * n.Dv, n.Dv,
                       dvalp + b * n.Tk * n.Dv);
    }
    query_and_bias_grads(item, s.gq, nq, scale, dq_rows);
    if (prod) {
      for (int64_t h = 0; h < Hp; ++h) gv[h] = T(sum_de) - T(2) * gv[h];
    }
  }
};

// dv and dbias: the items' partials summed in item order (in double).
template <typename T>
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
  T* dvo = dv.data_ptr<T>();
  T* dbo = dbias.data_ptr<T>();
  for (int64_t h = 0; h < H; ++h) {
    dvo[h] = T(sum_v[h]);
    dbo[h] = T(sum_b[h]);
  }
  return {dv, dbias};
}

}  // namespace

// Gradients of every input; dkeys_acc given: dkeys added to it (returned as is); want_dvalues
// false: no dvalues (an undefined tensor).
template <typename T>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query_in,
    const Tensor& keys_in, const Tensor& values_in, const Tensor& v_in, const Tensor& bias_in,
    const KeyValidity& kv, const Sizes& n, const Tensor& saved_weights, const Tensor& dkeys_acc,
    bool want_dvalues, const LocationTerm<T>* loc) {
  const Tensor query = query_in.contiguous(), keys = keys_in.contiguous();
  const Tensor values = values_in.contiguous(), dctx = grad_context.contiguous();
  const Tensor v = v_in.contiguous(), bias = bias_in.contiguous();
  const Tensor gw = grad_weights.has_value() ? grad_weights->contiguous() : Tensor();
  const int64_t Hp = round_up(n.H, kPadTo);
  const auto opts = query.options();
  const Plan plan = make_plan(n.B, n.Tq, n.Tk, n.H);
  const bool have_p = saved_weights.defined(), acc = dkeys_acc.defined();
  const bool split = plan.blocks_per_row > 1;
  Tensor probs = have_p ? saved_weights.contiguous() : at::empty({n.B, n.Tq, n.Tk}, opts);
  Tensor dq = empty_output({n.B, n.Tq, n.H}, opts);
  Tensor dk = acc ? dkeys_acc : empty_output({n.B, n.Tk, n.H}, opts);
  // Split rows: each item's dkeys (already scaled) in its own slot, summed in order afterwards.
  Tensor dk_parts = split ? at::zeros({n.B, plan.blocks_per_row, n.Tk, n.H}, opts) : Tensor();
  // Plain buffers, no torch op: every torch op here would be one more parallel region.
  std::unique_ptr<T[]> dv_parts(new T[size_t(plan.items) * size_t(Hp)]);
  std::unique_ptr<T[]> db_parts(new T[size_t(plan.items) * size_t(n.H)]);
  const bool dvalues_in_items = want_dvalues && !split;
  Tensor dvalues = dvalues_in_items ? empty_output({n.B, n.Tk, n.Dv}, opts) : Tensor();
  const BackwardPass<T> pass{runtime_kernels<T>(), n, kv, plan, Hp, score_vectors<T>(v, n.H, Hp),
                             have_p, acc, split, query.data_ptr<T>(), keys.data_ptr<T>(),
                             bias.data_ptr<T>(), values.data_ptr<T>(), dctx.data_ptr<T>(),
                             gw.defined() ? gw.data_ptr<T>() : nullptr, probs.data_ptr<T>(),
                             dq.data_ptr<T>(), (split ? dk_parts : dk).data_ptr<T>(),
                             dvalues_in_items ? dvalues.data_ptr<T>() : nullptr, dv_parts.get(),
                             db_parts.get(), loc};
  using Scratch = typename BackwardPass<T>::Scratch;
  for_each_item(
      plan, [&] { return pass.make_scratch(); },
      [&](int64_t item, Scratch& scratch) { pass.run_item(item, scratch); });
  if (split && acc) {
    dk.add_(dk_parts.sum(1));
  } else if (split) {
    dk = dk_parts.sum(1);
  }
  auto [dv, dbias] = reduce_item_partials<T>(dv_parts.get(), db_parts.get(), plan.items, n.H, Hp,
                                             opts);
  if (want_dvalues && !dvalues_in_items) dvalues = at::bmm(probs.transpose(1, 2), dctx);
  return {dq, dk, dvalues, dv, dbias};
}

namespace {

// The backward of bfloat16 inputs: float32 inside (bf16.h). A bfloat16 dkeys_acc is accumulated
// in a float32 copy and rounded back once; a float32 one (exact sums over a decoder's steps) is
// accumulated in place.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_bf16(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query,
    const Tensor& keys, const Tensor& values, const Tensor& v, const Tensor& bias,
    const KeyValidity& kv, const Sizes& n, const Tensor& saved_weights, const Tensor& dkeys_acc,
    bool want_dvalues) {
  const Tensor acc = as_float(dkeys_acc);
  auto [dq, dk, dvalues, dv, dbias] = backward_impl<float>(
      as_float(grad_context), as_float(grad_weights), as_float(query), as_float(keys),
      as_float(values), as_float(v), as_float(bias), kv, n, as_float(saved_weights), acc,
      want_dvalues);
  if (is_bf16(dkeys_acc)) dkeys_acc.copy_(acc);
  return {to_bf16(dq), dkeys_acc.defined() ? dkeys_acc : to_bf16(dk), to_bf16(dvalues),
          to_bf16(dv), to_bf16(dbias)};
}

// The backward's argument checks and dispatch; dkeys_acc / want_dvalues as in backward_impl.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> checked_backward(
    const char* op, const Tensor& grad_context, const std::optional<Tensor>& grad_weights,
    const Tensor& query, const Tensor& keys, const Tensor& values, const Tensor& v,
    const Tensor& bias, const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const Tensor& lse, const std::optional<Tensor>& weights, const Tensor& dkeys_acc,
    bool want_dvalues) {
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
    saved_p = *weights;
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
  if (n.B == 0 || n.Tq == 0) {  // no rows: every gradient is zero
    return {at::zeros_like(query), dkeys_acc.defined() ? dkeys_acc : at::zeros_like(keys),
            want_dvalues ? at::zeros_like(values) : Tensor(), at::zeros_like(v),
            at::zeros_like(bias)};
  }
  if (is_bf16(query)) {
    return backward_bf16(grad_context, grad_weights, query, keys, values, v, bias, kv, n, saved_p,
                         dkeys_acc, want_dvalues);
  }
  if (query.scalar_type() == at::kDouble) {
    return backward_impl<double>(grad_context, grad_weights, query, keys, values, v, bias, kv, n,
                                  saved_p, dkeys_acc, want_dvalues);
  }
  return backward_impl<float>(grad_context, grad_weights, query, keys, values, v, bias, kv, n,
                               saved_p, dkeys_acc, want_dvalues);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> additive_attention_bwd(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query,
    const Tensor& keys, const Tensor& values, const Tensor& v, const Tensor& bias,
    const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const Tensor& context, const Tensor& lse, const std::optional<Tensor>& weights) {
  // context and lse are the contract's (Triton reads lse); the CPU backward forms dp . p from dp
  // and, without the forward's weights, recomputes them from the scores.
  (void)context;
  return checked_backward("seq2seq_fast::additive_attention_bwd", grad_context, grad_weights,
                          query, keys, values, v, bias, lengths, mask, lse, weights, Tensor(),
                          true);
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

// The location-aware step (csrc/location_attention.cpp) runs these with a LocationTerm.
template std::tuple<Tensor, Tensor, Tensor> forward_impl<float>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const KeyValidity&,
    const Sizes&, bool, const LocationTerm<float>*);
template std::tuple<Tensor, Tensor, Tensor> forward_impl<double>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const KeyValidity&,
    const Sizes&, bool, const LocationTerm<double>*);
template std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl<float>(
    const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const KeyValidity&, const Sizes&, const Tensor&, const Tensor&,
    bool, const LocationTerm<float>*);
template std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl<double>(
    const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const KeyValidity&, const Sizes&, const Tensor&, const Tensor&,
    bool, const LocationTerm<double>*);

}  // namespace seq2seq_fast

// The two main schemas are defined in Python (seq2seq_fast/ops/additive_attention.py); only their
// CPU kernels here.
TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("additive_attention_fwd", &seq2seq_fast::additive_attention_fwd);
  m.impl("additive_attention_bwd", &seq2seq_fast::additive_attention_bwd);
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
