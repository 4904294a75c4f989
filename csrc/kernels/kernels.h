// Plain-pointer compute kernels of the CPU additive attention, one table per instruction set.
//
// The kernels know nothing about torch: the ops (csrc/additive_attention.cpp, gru.cpp, lstm.cpp)
// allocate, pack rows per work item and call through a table chosen at run time by
// csrc/runtime.cpp (AVX-512, AVX2+FMA or portable C++). Each table is compiled in its own
// translation unit here (portable.cpp, avx2.cpp, avx512.cpp; bodies in kernel_impl.h) with its own
// target options, so a binary built on one x86-64 runs on any other and the portable one builds
// on aarch64.
//
// Two ways to evaluate tanh(a + b) for the score e = sum_h v_h tanh(a_h + b_h):
//   kProduct:  rows are packed as A = exp(2a), B = exp(2b), so tanh(a + b) = 1 - 2 r with
//              r = 1 / (1 + A B): one FMA, a reciprocal and one Newton step per element. Used when
//              no |a|, |b| of a work item exceeds kProductLimit: then A and B are normal floats,
//              and A B over- or underflows only where tanh(a + b) rounds to +-1 anyway. NaN
//              stays on this path (it poisons exactly its own row); +-inf takes the rational one.
//              Used as it is when max |a| + max |b| <= kProductSafeSum (A B stays below 2^126).
//              Not used when max |a| + max |b| < kProductMinSum: its absolute error would be
//              large relative to tanh(a + b) ~ a + b there.
//   kProductCapped: the same with 1 + A B capped at 2^120 before the reciprocal (one min more),
//              for items within the limit whose A B could overflow to inf: a SIMD reciprocal's
//              Newton step turns 1 / inf into NaN (this was the NaN of 0.1.0 for a + b in
//              ~44..80 with two or more queries per item).
//   kRational: tanh(a + b) by a clamped rational function of a + b; any finite input, NaN and inf.
//   kProductBf16: bfloat16 rows with one query per item (a decoding step, which the rational path
//              would bind to its ~16 vector operations per element): A = 2 log2(e) a packed, B the
//              rows as they are, r = 1 / (1 + 2^{A + 2 log2(e) B}) with a degree-3 2^f and a
//              14-bit reciprocal (about 9 operations); y = r as on the product path (tanh = 1 - 2r,
//              u = r - r^2). Its error (<= 1e-4 in tanh, absolute, tanh_coeffs.h) is below the
//              effect of the inputs' own rounding (2^-9 |x| sech^2 x) only for |x| >~ 0.05;
//              nearer 0 it is coarser than that (a blend of x - x^3/3 there would cost the step
//              ~5 more operations per element on ~9). Scores err by up to 1e-4 sum_h |v_h|, so
//              a large v (peaked rows) makes the step's weights err by several times the
//              bfloat16 rounding. Any input: +-inf give +-1, NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

// x86-64 SIMD paths (AVX2, AVX-512) exist on x86-64 with GCC or Clang; elsewhere (aarch64, or
// -DSEQ2SEQ_FAST_NO_X86_SIMD to check that build here) only the portable kernels are compiled.
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(SEQ2SEQ_FAST_NO_X86_SIMD)
#define SEQ2SEQ_FAST_X86_SIMD 1
#else
#define SEQ2SEQ_FAST_X86_SIMD 0
#endif

namespace seq2seq_fast {

enum TanhPath : int { kProduct = 0, kRational = 1, kProductCapped = 2, kProductBf16 = 3 };

// Flags of scores and fused_grads (bits of their `flags` argument):
//   kStreamed: Bk is read from memory once per call (a decoding step's keys, read where they
//     are, not a packed copy in cache). With one query the kernels prefetch the key rows two
//     tiles ahead (fused_grads: and the gk rows it writes), so that the loads of later tiles
//     overlap this tile's arithmetic instead of waiting on memory at each tile.
//   kAddGrads: fused_grads adds kscale * (sum over its queries of d u) into gk instead of
//     overwriting it (a decoder's keys' gradient summed over its steps in place).
enum KernelFlags : int { kStreamed = 1, kAddGrads = 2 };

// bfloat16 storage: the upper 16 bits of a float32 (c10::BFloat16's layout, so a tensor's
// data_ptr<at::BFloat16>() can be read as Bf16). To float32: a 16-bit shift, exact. From float32:
// round to nearest even; NaN becomes the quiet NaN 0x7FC0 (as c10 rounds).
struct Bf16 {
  uint16_t bits;
};

inline float bf16_to_float(Bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline Bf16 float_to_bf16(float f) {
  if (f != f) return Bf16{0x7FC0};
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return Bf16{uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

template <typename T>
struct KernelTable {
  const char* name;
  // dst[r * Hp + h] = src[r * H + h] + (add ? add[h] : 0) for h < H, 0 for H <= h < Hp.
  // Returns the largest packed |value| (inf included; NaN does not count; 0 for no rows).
  T (*pack_rows)(const T* src, int64_t rows, int64_t H, const T* add, T* dst, int64_t Hp);
  // p[i] = exp(scale * p[i]) for i < n; exp(-inf) = 0, NaN stays NaN.
  void (*exp_inplace)(T* p, int64_t n, T scale);
  // dst[r * H + h] = src[r * Hp + h] * scale[h] for r < rows, h < H.
  void (*scale_rows)(const T* src, int64_t rows, int64_t Hp, const T* scale, T* dst, int64_t H);
  // out[o * D + d] = sum_{i < n_in} w[o * so + i * si] x[i * D + d] for o < n_out, d < D:
  // context = p values (o = query) and dvalues = p^T dctx (o = key) inside the work items.
  void (*weighted_rows)(const T* w, int64_t so, int64_t si, int64_t n_out, int64_t n_in,
                        const T* x, int64_t D, T* out);
  // out[i * ldo + j] = a[i] . b[j] (rows D long) for i < na, j < nb: dp = dctx values^T.
  void (*dots)(const T* a, int64_t na, const T* b, int64_t nb, int64_t D, T* out, int64_t ldo);
  // out[t * ldo + s] = offset + sum_h veff[h] * y[t,s,h] for t < nq, s < nk, where
  // y = f(A[t], B[s]) = r = 1/(1 + A B) (kProduct; veff = -2 v, offset = sum v; kProductBf16 the
  // same r from A = 2 log2(e) a and B = b) or tanh(A + B) (kRational; veff = v).
  void (*scores)(int path, const T* A, int64_t nq, const T* Bk, int64_t nk, int64_t Hp,
                 const T* veff, T offset, T* out, int64_t ldo, int flags);
  // The backward's one pass over the (query, key) pairs, y as above computed in registers, with
  // d = de[t * ldd + s] (A, Bk packed as for scores):
  //   u = y - y^2 (kProduct, = sech^2 / 4) or 1 - y^2 (kRational, = sech^2)
  //   gq[t] += d u,  gv += d y,  gk[s] = kscale * (sum over t of d u)   (rows Hp long; gk
  //   overwritten, nk rows; with kAddGrads added to)
  void (*fused_grads)(int path, const T* A, int64_t nq, const T* Bk, int64_t nk, int64_t Hp,
                      const T* de, int64_t ldd, T* gq, T* gk, T* gv, const T* kscale, int flags);
  // out[i] = tanh(a[i] + b[i]) as the kernels evaluate it (test hook); n a multiple of 16.
  // kProduct expects a, b already mapped to exp(2a), exp(2b); kProductBf16 a mapped to
  // 2 log2(e) a.
  void (*tanh_pairs)(int path, const T* a, const T* b, T* out, int64_t n);
  // One row of a GRU step (csrc/gru.cpp): from gx = W_ih x + b_ih and gh = W_hh h + b_hh (3H each,
  // gates r, z, n) and h_prev = hp (H): h (H) and saved = [r | z | n | gh_n] (4H), with
  // r = sigmoid(gx_r + gh_r), z = sigmoid(gx_z + gh_z), n = tanh(gx_n + r gh_n),
  // h = n + z (hp - n).
  void (*gru_gates_fwd)(const T* gx, const T* gh, const T* hp, T* h, T* saved, int64_t H);
  // Its backward: go = dL/dh from the output, c = dL/dh from the later steps on entry and the
  // part of dL/dhp through z on exit (the caller adds dg W_hh); dx = dL/dgx, dg = dL/dgh (3H).
  void (*gru_gates_bwd)(const T* saved, const T* hp, const T* go, T* c, T* dx, T* dg, int64_t H);
  // One row of an LSTM cell step: gates = gi + gh = [i | f | g | o] (4H, biases included), c (H)
  // -> c_new = sigmoid(f) c + sigmoid(i) tanh(g), h = sigmoid(o) tanh(c_new), and
  // saved = [sigmoid(i) | sigmoid(f) | tanh(g) | sigmoid(o) | tanh(c_new)] (5H).
  void (*lstm_gates_fwd)(const T* gi, const T* gh, const T* c, T* h, T* c_new, T* saved,
                         int64_t H);
  // Its backward: dh, dc = dL/dh, dL/dc_new -> d_gates (4H; gi's and gh's alike), dc_prev (H).
  void (*lstm_gates_bwd)(const T* saved, const T* c, const T* dh, const T* dc, T* d_gates,
                         T* dc_prev, int64_t H);

  // bfloat16 storage, T arithmetic: the kernels above with their large operands read as bfloat16
  // rows, converted in registers (the arithmetic is the same template code). Outputs are T rows;
  // to_bf16 rounds a (cache-resident) row segment to the bfloat16 output.
  T (*pack_rows_bf16)(const Bf16* src, int64_t rows, int64_t H, const T* add, T* dst, int64_t Hp);
  void (*scores_bf16)(int path, const T* A, int64_t nq, const Bf16* Bk, int64_t nk, int64_t Hp,
                      const T* veff, T offset, T* out, int64_t ldo, int flags);
  void (*fused_grads_bf16)(int path, const T* A, int64_t nq, const Bf16* Bk, int64_t nk,
                           int64_t Hp, const T* de, int64_t ldd, T* gq, T* gk, T* gv,
                           const T* kscale, int flags);
  void (*weighted_rows_bf16)(const T* w, int64_t so, int64_t si, int64_t n_out, int64_t n_in,
                             const Bf16* x, int64_t D, T* out);
  void (*dots_bf16)(const Bf16* a, int64_t na, const Bf16* b, int64_t nb, int64_t D, T* out,
                    int64_t ldo);
  // dst[i] = src[i] rounded to bfloat16 (nearest even), dst[i] = src[i] as T, for i < n.
  void (*to_bf16)(const T* src, int64_t n, Bf16* dst);
  void (*from_bf16)(const Bf16* src, int64_t n, T* dst);
};

// Largest |a|, |b| for the product path: exp(+-2a) stays a normal float (e^80 = 5.5e34).
constexpr float kProductLimitFloat = 40.0f;
constexpr double kProductLimitDouble = 150.0;
// Largest max |a| + max |b| for the uncapped product path: A B <= e^86 = 2.2e37 < 2^126 (floats;
// the exp is within a few ulp). In double e^(2 * 300) is far from overflow: never capped.
constexpr float kProductSafeSumFloat = 43.0f;
constexpr double kProductSafeSumDouble = 300.0;
// Smallest max |a| + max |b| for the product path. Its tanh errs by up to 3.2e-7 absolute
// (tanh_coeffs.h) however small a + b is, while tanh(x) ~ x near 0: an item whose pre-activations
// all lie within +-M has tanh relative errors of 3.2e-7 / M and more, and a large v turns them
// into score errors (0.1.0: 1e-2 in the weights at |a|, |b| ~ 1e-5). Below M = 1/4 the rational
// path, accurate relative to tanh near 0, is taken: there the product's error would pass 1.3e-6
// of the largest pre-activation. Not higher: the rational path costs ~3x per element (the whole
// op 1.5x), and projections early in training have maxima of about 0.5 to 2 over an item (a
// threshold of 2 slowed such calls by 50%). Between 1/4 and 2 the product path's error is 3 to
// 20 times float32's own rounding of a + b (2^-24 M), 1e-6 of the scores' scale at most.
// The same bound serves float64 (its product path errs by ~1e-15 absolute).
constexpr float kProductMinSumFloat = 0.25f;
constexpr double kProductMinSumDouble = 0.25;
// Rows are padded to a multiple of this many elements (the widest vector, 16 floats).
constexpr int64_t kPadTo = 16;

// The tables, one per instruction set and type (runtime.h picks one at run time).
const KernelTable<float>& portable_float_kernels();
const KernelTable<double>& portable_double_kernels();
#if SEQ2SEQ_FAST_X86_SIMD
const KernelTable<float>& avx2_float_kernels();
const KernelTable<float>& avx512_float_kernels();
#endif

}  // namespace seq2seq_fast
