// CPU kernels of seq2seq_fast::additive_attention_fwd / _bwd (schemas: seq2seq_fast/ops.py).
//
//   e[b,t,s]  = sum_h v[h] tanh(query[b,t,h] + keys[b,s,h] + bias[h])
//   p[b,t,:]  = softmax of e[b,t,:] over the valid keys (masked: exactly 0; no valid key: all 0)
//   ctx[b,t]  = sum_s p[b,t,s] values[b,s]
//
// Work is split into items (batch row b, block of queries); each item packs its query rows and
// its batch row's keys into per-thread scratch padded to a multiple of 16, computes the scores with
// SIMD kernels (kernels.h; AVX-512 / AVX2 / portable chosen at run time), and the softmax of its
// rows into the [B,Tq,Tk] weights. The value-side products (context = p values,
// dp = dctx values^T, dvalues = p^T dctx) are done by the items too (SIMD kernels about as fast as
// BLAS at these sizes), so that each op is one parallel region: on a machine shared with other
// jobs every extra region can wait a scheduler slice for a descheduled thread (for_each_item).
// SEQ2SEQ_FAST_CTX=bmm switches them back to batched matmuls (for comparison; dvalues stays in
// the items for <= 8 queries, where BLAS at inner dimension Tq is slow). Nothing of size
// B*Tq*Tk*H is ever allocated: per-thread scratch is O((rows + Tk) * H), buffers O(B*Tq*Tk).
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
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernels.h"

namespace seq2seq_fast {
namespace {

using at::Tensor;

// ---- instruction-set selection ---------------------------------------------------------------

[[maybe_unused]] bool cpu_has_avx512() {
#if SEQ2SEQ_FAST_X86_SIMD
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return ok;
#else
  return false;
#endif
}

[[maybe_unused]] bool cpu_has_avx2() {
#if SEQ2SEQ_FAST_X86_SIMD
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// SEQ2SEQ_FAST_ISA=portable|avx2|avx512 forces a path (read on every call, so tests can switch);
// a path the CPU lacks falls back to the best one it has.
const KernelTable<float>& float_kernels() {
  const char* env = std::getenv("SEQ2SEQ_FAST_ISA");
  const std::string want = env ? env : "";
  if (want == "portable") return portable_float_kernels();
#if SEQ2SEQ_FAST_X86_SIMD
  if (want == "avx2" && cpu_has_avx2()) return avx2_float_kernels();
  if (want != "avx2" && cpu_has_avx512()) return avx512_float_kernels();
  if (cpu_has_avx2()) return avx2_float_kernels();
#endif
  return portable_float_kernels();
}

}  // namespace

template <>
const KernelTable<float>& runtime_kernels<float>() {
  return float_kernels();
}
template <>
const KernelTable<double>& runtime_kernels<double>() {
  return portable_double_kernels();
}

namespace {

template <typename T>
const KernelTable<T>& kernels() {
  return runtime_kernels<T>();
}

template <typename T>
T product_limit();
template <>
float product_limit<float>() {
  return kProductLimitFloat;
}
template <>
double product_limit<double>() {
  return kProductLimitDouble;
}

// The product path pays exp() on every packed query and key element (about 14 vector operations
// per 16 elements, against 5 per element pair for the product and 18 for the rational tanh):
// it wins from two queries per work item on, and loses for one (a decoding step).
constexpr int64_t kMinQueriesForProduct = 2;
// Rows of a batch row split over threads get at least this many queries each, so that the keys'
// exponentials are shared by several queries.
constexpr int64_t kMinQueriesPerBlock = 4;
// Up to this many queries, dvalues = p^T dctx is a rank-Tq update done per item (BLAS is slow at
// inner dimension Tq = 1, a decoding step); above it, one batched matmul.
constexpr int64_t kMaxQueriesForRankUpdate = 8;
// Below this many tanh evaluations per task a thread is not worth waking.
constexpr int64_t kMinWorkPerTask = 1 << 16;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Per-thread scratch that persists across calls (no page faults from fresh allocations on every
// call); slot k of the calling thread, grown to at least n elements.
// 64-byte aligned: padded rows (multiples of 16 floats) then start on a cache line, and no vector
// load or store splits one.
struct AlignedBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  ~AlignedBuffer() { std::free(data); }
};

template <typename T>
T* thread_scratch(int slot, int64_t n) {
  thread_local AlignedBuffer buffers[8];
  AlignedBuffer& buffer = buffers[slot];
  const size_t bytes = size_t(std::max<int64_t>(n, 1)) * sizeof(T);
  if (buffer.bytes < bytes) {
    std::free(buffer.data);
    const size_t rounded = (bytes + 63) / 64 * 64;
    buffer.data = std::aligned_alloc(64, rounded);
    TORCH_CHECK(buffer.data != nullptr, "seq2seq_fast: out of memory for ", rounded,
                " bytes of scratch");
    buffer.bytes = rounded;
  }
  return static_cast<T*>(buffer.data);
}

// An uninitialised output that the kernel is about to write in full. Fresh memory from the OS
// costs a page fault per 4 KiB on first write (a decoding step's dkeys and dvalues are hundreds
// of MiB, and the faults took 3/4 of that backward); on Linux, the 2 MiB-aligned interior of a
// large allocation is marked for transparent huge pages (advice only: without THP, or where the
// memory was already mapped, nothing changes).
Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  Tensor out = at::empty(sizes, opts);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const size_t bytes = out.nbytes();
  if (bytes >= 4 * kHuge) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(out.data_ptr());
    const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t last = (begin + bytes) & ~(kHuge - 1);
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return out;
}

// ---- work plan -------------------------------------------------------------------------------

struct Plan {
  int64_t blocks_per_row;  // query blocks per batch row
  int64_t block;           // queries per block
  int64_t items;           // B * blocks_per_row
  int64_t work_per_item;   // tanh evaluations in one item, at most
};

Plan make_plan(int64_t B, int64_t Tq, int64_t Tk, int64_t H) {
  if (B <= 0 || Tq <= 0) return {1, 1, 0, 1};  // no rows, no items (callers return earlier)
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t blocks = 1;
  if (B < 4 * threads) {  // too few batch rows to balance: split the queries of a row too
    blocks = std::min(ceil_div(Tq, kMinQueriesPerBlock), ceil_div(4 * threads, B));
    blocks = std::max<int64_t>(blocks, 1);
  }
  const int64_t block = ceil_div(Tq, blocks);
  blocks = ceil_div(Tq, block);
  return {blocks, block, B * blocks, std::max<int64_t>(1, block * Tk * H)};
}

// Contention back-off. A parallel region ends with a barrier that waits for every thread of the
// team; when the OS has descheduled one of them (another job holds the core) that wait lasts a
// scheduler slice, whatever the other threads did meanwhile: measured here, a 0.7 ms forward took
// 8 ms at 2 threads with the other core busy (1.2 ms on one thread). So each region checks how
// long the calling thread waited after its own last item; when that wait exceeds half of its own
// working time (plus 100 us), the next calls run on the calling thread alone for kBackoff, and
// then try the team again. On an idle machine the wait is at most one item and nothing changes.
// SEQ2SEQ_FAST_BACKOFF=0 turns this off (always the whole team; for comparison).
constexpr std::chrono::milliseconds kBackoff{20};
std::atomic<int64_t> g_alone_until_ns{0};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool backoff_enabled() {
  const char* env = std::getenv("SEQ2SEQ_FAST_BACKOFF");
  return !(env != nullptr && std::string(env) == "0");
}

// Runs fn(item, scratch) for every item. Threads take items from a shared counter, so a thread
// that the OS deschedules does not hold the others back until the final barrier (see above).
// Every item writes only its own outputs and partial buffers: results do not depend on which
// thread ran an item. Tiny work runs inline, without waking a thread.
template <typename MakeScratch, typename Fn>
void for_each_item(const Plan& plan, MakeScratch make_scratch, Fn fn) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t by_work = std::max<int64_t>(1, plan.items * plan.work_per_item / kMinWorkPerTask);
  const int64_t tasks = std::min({threads, by_work, plan.items});
  const bool backoff = backoff_enabled();
  const int64_t start = now_ns();
  if (tasks <= 1 || at::in_parallel_region() ||
      (backoff && start < g_alone_until_ns.load(std::memory_order_relaxed))) {
    auto scratch = make_scratch();
    for (int64_t item = 0; item < plan.items; ++item) fn(item, scratch);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> caller_done{0};
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make_scratch();
    for (int64_t task = begin; task < end; ++task) {
      for (int64_t item = next.fetch_add(1); item < plan.items; item = next.fetch_add(1)) {
        fn(item, scratch);
      }
    }
    if (at::get_thread_num() == 0) caller_done.store(now_ns(), std::memory_order_relaxed);
  });
  const int64_t finish = now_ns();
  const int64_t done = caller_done.load(std::memory_order_relaxed);
  if (backoff && done > 0) {
    const int64_t waited = finish - done, worked = done - start;
    if (waited > worked / 2 + 100000) {
      g_alone_until_ns.store(finish + std::chrono::nanoseconds(kBackoff).count(),
                             std::memory_order_relaxed);
    }
  }
}

// ---- checks ----------------------------------------------------------------------------------

struct Sizes {
  int64_t B, Tq, Tk, H, Dv;
};

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
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, op,
              ": CPU kernel supports float32 and float64, got ", dtype);
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
  const T limit = product_limit<T>();
  const bool in_range = kt.pack_rows(q_rows, nq, H, bias, qbuf, Hp, limit);
  *keys_out = kbuf;
  if (nq < kMinQueriesForProduct) {
    if (H == Hp) {
      *keys_out = k_rows;
    } else {
      kt.pack_rows(k_rows, nk, H, nullptr, kbuf, Hp, limit);
    }
    return kRational;
  }
  if (kt.pack_rows(k_rows, nk, H, nullptr, kbuf, Hp, limit) && in_range) {
    kt.exp_inplace(qbuf, nq * Hp, T(2));
    kt.exp_inplace(kbuf, nk * Hp, T(2));
    return kProduct;
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
  T* x = thread_scratch<T>(6, round_up(std::max<int64_t>(nk, 1), kPadTo));
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

// ---- forward ---------------------------------------------------------------------------------

template <typename T>
std::tuple<Tensor, Tensor, Tensor> forward_impl(const Tensor& query_in, const Tensor& keys_in,
                                                const Tensor& values_in, const Tensor& v_in,
                                                const Tensor& bias_in, const KeyValidity& kv,
                                                const Sizes& n, bool return_weights) {
  const Tensor query = query_in.contiguous(), keys = keys_in.contiguous();
  const Tensor v = v_in.contiguous(), bias = bias_in.contiguous();
  const auto& kt = kernels<T>();
  const int64_t Hp = round_up(n.H, kPadTo);
  const auto opts = query.options();
  Tensor weights = at::empty({n.B, n.Tq, n.Tk}, opts);
  Tensor lse = at::empty({n.B, n.Tq}, opts.dtype(at::kFloat));
  const char* ctx_env = std::getenv("SEQ2SEQ_FAST_CTX");
  const bool context_in_items = !(ctx_env && std::string(ctx_env) == "bmm");
  const Tensor values = context_in_items ? values_in.contiguous() : values_in;
  Tensor context = context_in_items ? at::empty({n.B, n.Tq, n.Dv}, opts) : Tensor();
  const T* valp = context_in_items ? values.data_ptr<T>() : nullptr;
  T* ctxp = context_in_items ? context.data_ptr<T>() : nullptr;
  const ScoreVectors<T> sv = score_vectors<T>(v, n.H, Hp);
  const Plan plan = make_plan(n.B, n.Tq, n.Tk, n.H);
  const T* qp = query.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* bp = bias.data_ptr<T>();
  T* wp = weights.data_ptr<T>();
  float* lp = lse.data_ptr<float>();

  struct Scratch {
    T *qbuf, *kbuf;
  };
  auto make_scratch = [&] {
    return Scratch{thread_scratch<T>(0, plan.block * Hp), thread_scratch<T>(1, n.Tk * Hp)};
  };
  for_each_item(plan, make_scratch, [&](int64_t item, Scratch& scratch) {
    {
      T* qbuf = scratch.qbuf;
      const int64_t b = item / plan.blocks_per_row;
      const int64_t t0 = (item % plan.blocks_per_row) * plan.block;
      const int64_t nq = std::min(plan.block, n.Tq - t0);
      if (nq <= 0) return;
      const int64_t nk = kv.count(b);
      T* rows = wp + (b * n.Tq + t0) * n.Tk;
      if (nk > 0) {
        const T* kbuf = nullptr;
        const int path = pack_item<T>(kt, qp + (b * n.Tq + t0) * n.H, nq, kp + b * n.Tk * n.H,
                                      nk, bp, n.H, Hp, qbuf, scratch.kbuf, &kbuf);
        const bool prod = path == kProduct;
        kt.scores(path, qbuf, nq, kbuf, nk, Hp,
                  prod ? sv.product.data() : sv.rational.data(), prod ? sv.sum_v : T(0), rows,
                  n.Tk);
      }
      softmax_rows<T>(kt, rows, nq, n.Tk, nk, kv.row_mask(b), lp + b * n.Tq + t0);
      if (ctxp != nullptr) {
        // With lengths, only the valid prefix of the values is read (as the Triton kernel does):
        // a decoding step reads a quarter less memory on ragged batches, and a non-finite value
        // in the padding does not reach the context (a row with no valid key gets zeros, never
        // NaN). With a mask, every value is read: a masked key's zero weight times a non-finite
        // value gives NaN, as in the reference's weights @ values.
        const int64_t n_in = kv.row_mask(b) != nullptr ? n.Tk : nk;
        kt.weighted_rows(rows, n.Tk, 1, nq, n_in, valp + b * n.Tk * n.Dv, n.Dv,
                         ctxp + (b * n.Tq + t0) * n.Dv);
      }
    }
  });

  if (!context_in_items) context = at::bmm(weights, values_in);
  return {context, return_weights ? weights : at::empty({0}, opts), lse};
}

std::tuple<Tensor, Tensor, Tensor> additive_attention_fwd(
    const Tensor& query, const Tensor& keys, const Tensor& values, const Tensor& v,
    const Tensor& bias, const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    bool return_weights) {
  const char* op = "seq2seq_fast::additive_attention_fwd";
  const Sizes n = check_inputs(op, query, keys, values, v, bias, lengths, mask);
  const KeyValidity kv = key_validity(op, lengths, mask, n.Tk);
  if (n.B == 0 || n.Tq == 0) {  // no rows: nothing to compute (and no work to plan)
    const auto opts = query.options();
    return {at::zeros({n.B, n.Tq, n.Dv}, opts),
            return_weights ? at::zeros({n.B, n.Tq, n.Tk}, opts) : at::empty({0}, opts),
            at::empty({n.B, n.Tq}, opts.dtype(at::kFloat))};
  }
  if (query.scalar_type() == at::kDouble) {
    return forward_impl<double>(query, keys, values, v, bias, kv, n, return_weights);
  }
  return forward_impl<float>(query, keys, values, v, bias, kv, n, return_weights);
}

// ---- backward --------------------------------------------------------------------------------

template <typename T>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl(
    const Tensor& grad_context, const std::optional<Tensor>& grad_weights, const Tensor& query_in,
    const Tensor& keys_in, const Tensor& values_in, const Tensor& v_in, const Tensor& bias_in,
    const KeyValidity& kv, const Sizes& n, const Tensor& saved_weights,
    const Tensor& dkeys_acc = Tensor(), bool want_dvalues = true) {
  const Tensor query = query_in.contiguous(), keys = keys_in.contiguous();
  const Tensor v = v_in.contiguous(), bias = bias_in.contiguous();
  const Tensor dctx = grad_context.contiguous();
  const auto& kt = kernels<T>();
  const int64_t Hp = round_up(n.H, kPadTo);
  const auto opts = query.options();

  // dp[b,t,s] = dctx[b,t] . values[b,s] + grad_weights[b,t,s]: inside the items (one parallel
  // region for the whole backward), or one batched matmul when SEQ2SEQ_FAST_CTX=bmm.
  const char* ctx_env = std::getenv("SEQ2SEQ_FAST_CTX");
  const bool use_bmm = ctx_env && std::string(ctx_env) == "bmm";
  const Tensor values = use_bmm ? values_in : values_in.contiguous();
  const Tensor gw = grad_weights.has_value() ? grad_weights->contiguous() : Tensor();
  Tensor dp;
  if (use_bmm) {
    dp = at::bmm(dctx, values_in.transpose(1, 2));
    if (gw.defined()) dp.add_(gw);
    dp = dp.contiguous();
  }
  // With the forward's weights, one pass computes y and accumulates the gradients; without
  // them, the scores are recomputed and re-normalised first (probs).
  const bool have_p = saved_weights.defined();
  Tensor probs = have_p ? saved_weights.contiguous() : at::empty({n.B, n.Tq, n.Tk}, opts);
  Tensor dq = empty_output({n.B, n.Tq, n.H}, opts);
  // Accumulating (dkeys_acc given): dkeys are added to it, rows s >= length left as they are.
  // Otherwise a fresh output whose rows s >= length are zeroed by their item.
  const bool acc = dkeys_acc.defined();
  Tensor dk = acc ? dkeys_acc : empty_output({n.B, n.Tk, n.H}, opts);
  const Plan plan = make_plan(n.B, n.Tq, n.Tk, n.H);
  const bool split = plan.blocks_per_row > 1;
  // Split rows: each item's dkeys (already scaled) in its own slot, summed in order afterwards.
  Tensor dk_parts = split ? at::zeros({n.B, plan.blocks_per_row, n.Tk, n.H}, opts) : Tensor();
  // Per item: its dv contribution (Hp) and its dbias contribution (sum of its dq rows, H), each
  // item writing its own rows; summed in item order afterwards. Plain buffers, no torch op:
  // every torch op here would be one more parallel region (see for_each_item).
  std::unique_ptr<T[]> dv_parts(new T[size_t(plan.items) * size_t(Hp)]);
  std::unique_ptr<T[]> db_parts(new T[size_t(plan.items) * size_t(n.H)]);
  const bool dvalues_in_items =
      want_dvalues && !split && (n.Tq <= kMaxQueriesForRankUpdate || !use_bmm);
  Tensor dvalues = dvalues_in_items ? empty_output({n.B, n.Tk, n.Dv}, opts) : Tensor();
  T* dvalp = dvalues_in_items ? dvalues.data_ptr<T>() : nullptr;
  const T* dctxp = dctx.data_ptr<T>();

  const ScoreVectors<T> sv = score_vectors<T>(v, n.H, Hp);
  const T* qp = query.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* bp = bias.data_ptr<T>();
  const T* dpp = use_bmm ? dp.data_ptr<T>() : nullptr;
  const T* valp = use_bmm ? nullptr : values.data_ptr<T>();
  const T* gwp = gw.defined() ? gw.data_ptr<T>() : nullptr;
  T* pp = probs.data_ptr<T>();
  T* dqp = dq.data_ptr<T>();
  T* dkp = split ? dk_parts.data_ptr<T>() : dk.data_ptr<T>();
  T* dvp = dv_parts.get();
  T* dbp = db_parts.get();

  struct Scratch {
    T *qbuf, *kbuf, *de, *gq, *gk, *dps;
  };
  auto make_scratch = [&] {
    return Scratch{thread_scratch<T>(0, plan.block * Hp), thread_scratch<T>(1, n.Tk * Hp),
                   thread_scratch<T>(3, plan.block * n.Tk),
                   thread_scratch<T>(4, plan.block * Hp), thread_scratch<T>(5, n.Tk * Hp),
                   thread_scratch<T>(7, plan.block * n.Tk)};
  };
  for_each_item(plan, make_scratch, [&](int64_t item, Scratch& scratch) {
    T* qbuf = scratch.qbuf;
    T* de = scratch.de;
    T* gq = scratch.gq;
    T* gk = scratch.gk;
    T* dps = scratch.dps;
    const int64_t b = item / plan.blocks_per_row;
    const int64_t blk = item % plan.blocks_per_row;
    const int64_t t0 = blk * plan.block;
    const int64_t nq = std::min(plan.block, n.Tq - t0);
    std::fill(dvp + item * Hp, dvp + (item + 1) * Hp, T(0));  // this item's partial sums
    std::fill(dbp + item * n.H, dbp + (item + 1) * n.H, T(0));
    if (nq <= 0) return;
    const int64_t nk = kv.count(b);
    const bool* valid = kv.row_mask(b);
    T* p_rows = pp + (b * n.Tq + t0) * n.Tk;
    T* dq_rows = dqp + (b * n.Tq + t0) * n.H;
    if (!split) {  // this item owns the whole batch row b: zero what no key writes
      T* dk_rows = dkp + b * n.Tk * n.H;
      if (!acc) std::fill(dk_rows + nk * n.H, dk_rows + n.Tk * n.H, T(0));
      if (dvalp != nullptr) {
        T* dval_rows = dvalp + b * n.Tk * n.Dv;
        std::fill(dval_rows + nk * n.Dv, dval_rows + n.Tk * n.Dv, T(0));
      }
    }
    if (nk == 0) {
      if (!have_p) std::fill(p_rows, p_rows + nq * n.Tk, T(0));
      std::fill(dq_rows, dq_rows + nq * n.H, T(0));
      return;
    }
    const T* kbuf = nullptr;
    const int path = pack_item<T>(kt, qp + (b * n.Tq + t0) * n.H, nq, kp + b * n.Tk * n.H, nk,
                                  bp, n.H, Hp, qbuf, scratch.kbuf, &kbuf);
    const bool prod = path == kProduct;
    // dp rows of this item (valid prefix s < nk; masked keys get de = 0 below).
    const T* dp_rows;
    if (dpp != nullptr) {
      dp_rows = dpp + (b * n.Tq + t0) * n.Tk;
    } else {
      kt.dots(dctxp + (b * n.Tq + t0) * n.Dv, nq, valp + b * n.Tk * n.Dv, nk, n.Dv, dps, n.Tk);
      if (gwp != nullptr) {
        const T* g = gwp + (b * n.Tq + t0) * n.Tk;
        for (int64_t t = 0; t < nq; ++t) {
          for (int64_t s = 0; s < nk; ++s) dps[t * n.Tk + s] += g[t * n.Tk + s];
        }
      }
      dp_rows = dps;
    }
    std::fill(gq, gq + nq * Hp, T(0));
    T* gv = dvp + item * Hp;
    // Product path: sech^2 = 4u and tanh = 1 - 2r; rational: sech^2 = u, tanh = y.
    const T* scale = prod ? sv.grad_product.data() : sv.rational.data();
    T* dk_rows =
        split ? dkp + (b * plan.blocks_per_row + blk) * n.Tk * n.H : dkp + b * n.Tk * n.H;
    if (!have_p) {  // the forward's weights, recomputed: scores, then the softmax of each row
      kt.scores(path, qbuf, nq, kbuf, nk, Hp, prod ? sv.product.data() : sv.rational.data(),
                prod ? sv.sum_v : T(0), p_rows, n.Tk);
      softmax_rows<T>(kt, p_rows, nq, n.Tk, nk, valid, nullptr);
    }
    // de = p (dp - sum_s p dp) over the valid keys, 0 elsewhere.
    double sum_de = 0;
    for (int64_t t = 0; t < nq; ++t) {
      const T* p = p_rows + t * n.Tk;
      const T* g = dp_rows + t * n.Tk;
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
    // Unpadded rows: dkeys are written in place, already scaled (accumulating: added from the
    // item's scratch, which is still in cache).
    const bool add_into_rows = acc && !split;  // (split rows write their own slots)
    T* gk_out = n.H == Hp && !add_into_rows ? dk_rows : gk;
    kt.fused_grads(path, qbuf, nq, kbuf, nk, Hp, de, n.Tk, gq, gk_out, gv, scale);
    if (add_into_rows) {
      for (int64_t s = 0; s < nk; ++s) {
        const T* src = gk + s * Hp;
        T* dst = dk_rows + s * n.H;
        for (int64_t h = 0; h < n.H; ++h) dst[h] += src[h];
      }
    } else if (gk_out == gk) {
      for (int64_t s = 0; s < nk; ++s) std::copy(gk + s * Hp, gk + s * Hp + n.H, dk_rows + s * n.H);
    }
    if (dvalp != nullptr) {
      kt.weighted_rows(p_rows, 1, n.Tk, nk, nq, dctxp + b * n.Tq * n.Dv, n.Dv,
                       dvalp + b * n.Tk * n.Dv);
    }
    kt.scale_rows(gq, nq, Hp, scale, dq_rows, n.H);
    T* db = dbp + item * n.H;
    std::copy(dq_rows, dq_rows + n.H, db);
    for (int64_t t = 1; t < nq; ++t) {
      for (int64_t h = 0; h < n.H; ++h) db[h] += dq_rows[t * n.H + h];
    }
    if (prod) {
      for (int64_t h = 0; h < Hp; ++h) gv[h] = T(sum_de) - T(2) * gv[h];
    }
  });

  if (split && acc) {
    dk.add_(dk_parts.sum(1));
  } else if (split) {
    dk = dk_parts.sum(1);
  }
  Tensor dv = at::empty({n.H}, opts), dbias = at::empty({n.H}, opts);
  {
    std::vector<double> sum_v(n.H, 0.0), sum_b(n.H, 0.0);
    for (int64_t item = 0; item < plan.items; ++item) {
      const T* pv = dvp + item * Hp;
      const T* pb = dbp + item * n.H;
      for (int64_t h = 0; h < n.H; ++h) {
        sum_v[h] += pv[h];
        sum_b[h] += pb[h];
      }
    }
    T* dvo = dv.data_ptr<T>();
    T* dbo = dbias.data_ptr<T>();
    for (int64_t h = 0; h < n.H; ++h) {
      dvo[h] = T(sum_v[h]);
      dbo[h] = T(sum_b[h]);
    }
  }
  if (!dvalues_in_items && want_dvalues) dvalues = at::bmm(probs.transpose(1, 2), dctx);
  return {dq, dk, dvalues, dv, dbias};
}

// The backward's argument checks and dispatch; dkeys_acc / want_dvalues as in backward_impl.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> checked_backward(
    const char* op, const Tensor& grad_context, const std::optional<Tensor>& grad_weights,
    const Tensor& query, const Tensor& keys, const Tensor& values, const Tensor& v,
    const Tensor& bias, const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask,
    const Tensor& lse, const std::optional<Tensor>& weights, const Tensor& dkeys_acc,
    bool want_dvalues) {
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
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == n.B && lse.size(1) == n.Tq, op,
              ": lse must be [B, Tq], got ", lse.sizes());
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
    TORCH_CHECK(dkeys_acc.sizes() == keys.sizes() && dkeys_acc.scalar_type() == keys.scalar_type() &&
                    dkeys_acc.device().is_cpu() && dkeys_acc.is_contiguous(),
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
  (void)context;  // dp . p is formed from dp directly; context is part of the contract only
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
    const std::optional<Tensor>& lengths, const std::optional<Tensor>& mask, const Tensor& lse,
    const std::optional<Tensor>& weights, const Tensor& grad_keys) {
  auto grads = checked_backward("seq2seq_fast::_additive_attention_bwd_accumulate", grad_context,
                                grad_weights, query, keys, values, v, bias, lengths, mask, lse,
                                weights, grad_keys, false);
  return {std::get<0>(grads), std::get<3>(grads), std::get<4>(grads)};
}

// ---- test hooks ------------------------------------------------------------------------------

// tanh(x + y) elementwise exactly as the kernels evaluate it. path: 0 = product (needs
// |x|, |y| <= the product limit), 1 = rational. Lets tests bound the error against torch.tanh.
Tensor fast_tanh(const Tensor& x, const Tensor& y, int64_t path) {
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type(),
              "_fast_tanh: x and y must have one shape and dtype");
  TORCH_CHECK(path == kProduct || path == kRational, "_fast_tanh: path must be 0 or 1");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto& kt = kernels<T>();
    const int64_t numel = x.numel();
    const int64_t padded = round_up(std::max<int64_t>(numel, 1), kPadTo);
    Tensor a = at::zeros({padded}, x.options()), b = at::zeros({padded}, x.options());
    a.narrow(0, 0, numel).copy_(x.reshape(-1));
    b.narrow(0, 0, numel).copy_(y.reshape(-1));
    if (path == kProduct) {
      kt.exp_inplace(a.data_ptr<T>(), padded, T(2));
      kt.exp_inplace(b.data_ptr<T>(), padded, T(2));
    }
    Tensor out = at::empty({padded}, x.options());
    kt.tanh_pairs(int(path), a.data_ptr<T>(), b.data_ptr<T>(), out.data_ptr<T>(), padded);
    return out.narrow(0, 0, numel).reshape(x.sizes()).clone();
  };
  if (x.scalar_type() == at::kDouble) return run(double{});
  TORCH_CHECK(x.scalar_type() == at::kFloat, "_fast_tanh: float32 or float64, got ",
              x.scalar_type());
  return run(float{});
}

std::string cpu_isa() { return float_kernels().name; }

}  // namespace


}  // namespace seq2seq_fast

// The two main schemas are defined in Python (seq2seq_fast/ops.py); only their CPU kernels here.
TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("additive_attention_fwd", &seq2seq_fast::additive_attention_fwd);
  m.impl("additive_attention_bwd", &seq2seq_fast::additive_attention_bwd);
}

// Private ops of the C++ extension: test and benchmark hooks, and the accumulating backward
// (seq2seq_fast/stepwise.py).
TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def("_fast_tanh(Tensor x, Tensor y, int path) -> Tensor");
  m.def("_cpu_isa() -> str", &seq2seq_fast::cpu_isa);
  m.def(
      "_additive_attention_bwd_accumulate(Tensor grad_context, Tensor? grad_weights, "
      "Tensor query, Tensor keys, Tensor values, Tensor v, Tensor bias, Tensor? lengths, "
      "Tensor? mask, Tensor lse, Tensor? weights, Tensor(a!) grad_keys) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_fast_tanh", &seq2seq_fast::fast_tanh);
  m.impl("_additive_attention_bwd_accumulate", &seq2seq_fast::additive_attention_bwd_accumulate);
}

// `from seq2seq_fast import _C` loads the library (running the registrations above).
extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}
