// Torch-free check of the CPU kernel tables (csrc/kernels/kernels.h) against plain double loops.
//
// Built and run by tests/reliability/test_portability.py: natively (every table this CPU supports) and, cross-
// compiled for aarch64 with Zig, under qemu-aarch64 (the portable tables: what an aarch64 build of
// the extension runs). Prints one line per table and check; exits 1 on the first failure.
//
// No C++ library beyond headers (no std::vector or std::string): linked with -nostdlib++, the
// aarch64 build needs only Zig's musl, not a cross-built libc++ as well (half the build time).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <limits>  // header only

#include "kernels/kernels.h"

using namespace seq2seq_fast;

namespace {

int g_checks = 0;

// A malloc'd array (a minimal stand-in for std::vector).
template <typename T>
struct Buf {
  T* p = nullptr;
  size_t n = 0;
  explicit Buf(size_t size, T fill = T()) : p(static_cast<T*>(malloc(sizeof(T) * (size + 1)))), n(size) {
    if (p == nullptr) abort();
    for (size_t i = 0; i < n; ++i) p[i] = fill;
  }
  Buf(const Buf& other) : Buf(other.n) { memcpy(p, other.p, sizeof(T) * n); }
  template <typename U>
  explicit Buf(const Buf<U>& other) : Buf(other.n) {
    for (size_t i = 0; i < n; ++i) p[i] = T(other.p[i]);
  }
  Buf& operator=(const Buf&) = delete;
  ~Buf() { free(p); }
  T& operator[](size_t i) { return p[i]; }
  const T& operator[](size_t i) const { return p[i]; }
  T* data() { return p; }
  const T* data() const { return p; }
  size_t size() const { return n; }
};

// Deterministic normals: xorshift64* and Box-Muller.
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double uniform() {  // (0, 1)
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return (double((state * 0x2545F4914F6CDD1Dull) >> 11) + 0.5) / 9007199254740992.0;
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  double normal() { return sqrt(-2.0 * log(uniform())) * cos(6.283185307179586 * uniform()); }
};

[[noreturn]] void fail(const char* table, const char* what, double got, double want,
                       int64_t index) {
  printf("FAIL %s %s: index %lld got %.9g want %.9g\n", table, what,
         static_cast<long long>(index), got, want);
  exit(1);
}

template <typename T>
double tol() {
  return sizeof(T) == 4 ? 2e-5 : 1e-11;
}

// |got - want| <= tol * (1 + |want|), NaN only where NaN is expected.
template <typename T>
void expect_close(const char* table, const char* what, const T* got, const Buf<double>& want,
                  double scale_tol = 1.0) {
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = double(got[i]), w = want[i];
    if (isnan(w) != isnan(g)) fail(table, what, g, w, int64_t(i));
    if (isnan(w)) continue;
    if (!(fabs(g - w) <= scale_tol * tol<T>() * (1.0 + fabs(w)))) fail(table, what, g, w, int64_t(i));
  }
  ++g_checks;
}

template <typename T>
void randomize(Buf<T>& out, Rng& gen, double scale) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = T(scale * gen.normal());
}

template <typename T>
void check_tanh(const char* name, const KernelTable<T>& kt) {
  const int64_t n = 4096;
  Buf<T> a(n), b(n), out(n);
  Buf<double> want(n);
  Rng gen(1);
  for (int64_t i = 0; i < n; ++i) {
    a[i] = T(i % 2 ? gen.uniform(-30.0, 30.0) : gen.uniform(-3.0, 3.0));
    b[i] = T(gen.uniform(-3.0, 3.0));
  }
  a[0] = std::numeric_limits<T>::infinity();
  a[1] = -std::numeric_limits<T>::infinity();
  a[2] = std::numeric_limits<T>::quiet_NaN();
  for (int64_t i = 0; i < n; ++i) want[i] = tanh(double(a[i]) + double(b[i]));
  kt.tanh_pairs(kRational, a.data(), b.data(), out.data(), n);
  expect_close<T>(name, "tanh rational", out.data(), want, 0.05);  // 1e-6 for float
  // Product path: inputs mapped to exp(2a), exp(2b), within the product limit.
  for (int64_t i = 0; i < n; ++i) {
    const double x = gen.uniform(-12.0, 12.0), y = gen.uniform(-12.0, 12.0);
    want[i] = tanh(x + y);
    a[i] = T(exp(2.0 * x));
    b[i] = T(exp(2.0 * y));
  }
  kt.tanh_pairs(kProduct, a.data(), b.data(), out.data(), n);
  expect_close<T>(name, "tanh product", out.data(), want, 0.05);
  // The bfloat16 rows' product path: a mapped to 2 log2(e) a; |error| <= 1.5e-4 by design.
  for (int64_t i = 0; i < n; ++i) {
    const double x = gen.uniform(-12.0, 12.0), y = gen.uniform(-12.0, 12.0);
    want[i] = tanh(x + y);
    a[i] = T(x * 2.88539008177792681);
    b[i] = T(y);
  }
  a[0] = std::numeric_limits<T>::infinity();
  want[0] = 1.0;
  a[1] = -std::numeric_limits<T>::infinity();
  want[1] = -1.0;
  a[2] = std::numeric_limits<T>::quiet_NaN();
  want[2] = std::numeric_limits<double>::quiet_NaN();
  kt.tanh_pairs(kProductBf16, a.data(), b.data(), out.data(), n);
  expect_close<T>(name, "tanh bfloat16 rows' product", out.data(), want, 1.5e-4 / tol<T>());
}

template <typename T>
void check_rows(const char* name, const KernelTable<T>& kt) {
  Rng gen(2);
  char what[128];
  const int64_t rows = 5, H = 21, Hp = 32;
  Buf<T> src(rows * H), add(H), dst(rows * Hp, T(7));
  randomize(src, gen, 2.0);
  randomize(add, gen, 1.0);
  Buf<double> want(rows * Hp);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) want[r * Hp + h] = double(src[r * H + h]) + double(add[h]);
  double want_max = 0;
  for (int64_t i = 0; i < rows * Hp; ++i) want_max = fabs(want[i]) > want_max ? fabs(want[i]) : want_max;
  const T got_max = kt.pack_rows(src.data(), rows, H, add.data(), dst.data(), Hp);
  if (fabs(double(got_max) - want_max) > 1e-6 * (1 + want_max))
    fail(name, "pack_rows largest |value|", want_max, double(got_max), 0);
  expect_close<T>(name, "pack_rows", dst.data(), want);  // padding h >= H must be 0
  src[7] = T(-100);
  src[8] = std::numeric_limits<T>::quiet_NaN();  // NaN does not count
  if (kt.pack_rows(src.data(), rows, H, nullptr, dst.data(), Hp) != T(100))
    fail(name, "pack_rows largest |value| with -100 and NaN", 100, 0, 7);
  ++g_checks;

  Buf<T> e(37);
  randomize(e, gen, 3.0);
  e[3] = -std::numeric_limits<T>::infinity();
  Buf<double> ewant(e.size());
  for (size_t i = 0; i < e.size(); ++i) ewant[i] = exp(0.5 * double(e[i]));
  kt.exp_inplace(e.data(), int64_t(e.size()), T(0.5));
  expect_close<T>(name, "exp_inplace", e.data(), ewant);
  // Far below the range (a softmax's -inf or masked score): exactly 0, and NaN stays NaN.
  Buf<T> low(2 * kPadTo, -std::numeric_limits<T>::infinity());
  for (size_t i = 0; i < low.size(); i += 3) low[i] = T(sizeof(T) == 4 ? -200 : -1000);
  low[5] = std::numeric_limits<T>::quiet_NaN();
  kt.exp_inplace(low.data(), int64_t(low.size()), T(1));
  Buf<double> lwant(low.size(), 0.0);
  lwant[5] = std::numeric_limits<double>::quiet_NaN();
  expect_close<T>(name, "exp_inplace far below", low.data(), lwant, 0.0);

  Buf<T> scale(Hp), packed(rows * Hp), scaled(rows * H);
  randomize(scale, gen, 1.0);
  randomize(packed, gen, 1.0);
  Buf<double> swant(rows * H);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) swant[r * H + h] = double(packed[r * Hp + h]) * double(scale[h]);
  kt.scale_rows(packed.data(), rows, Hp, scale.data(), scaled.data(), H);
  expect_close<T>(name, "scale_rows", scaled.data(), swant);

  // w read row by row (context = p values) and transposed (dvalues = p^T dctx).
  const int64_t outs[] = {1, 2, 3, 5, 9};
  for (int64_t k = 0; k < 10; ++k) {
    const int64_t n_out = outs[k % 5], n_in = 7, D = 45;
    const int64_t so = k < 5 ? n_in : 1, si = k < 5 ? 1 : n_out;
    Buf<T> w(n_out * n_in), x(n_in * D), out(n_out * D);
    randomize(w, gen, 1.0);
    randomize(x, gen, 1.0);
    Buf<double> want2(n_out * D);
    for (int64_t o = 0; o < n_out; ++o)
      for (int64_t i = 0; i < n_in; ++i)
        for (int64_t d = 0; d < D; ++d)
          want2[o * D + d] += double(w[o * so + i * si]) * double(x[i * D + d]);
    kt.weighted_rows(w.data(), so, si, n_out, n_in, x.data(), D, out.data());
    snprintf(what, sizeof what, "weighted_rows n_out=%lld%s", static_cast<long long>(n_out),
             k < 5 ? "" : " transposed");
    expect_close<T>(name, what, out.data(), want2);
  }

  const int64_t na = 3, nb = 6, D = 29, ldo = 8;
  Buf<T> a(na * D), b(nb * D), out(na * ldo);
  randomize(a, gen, 1.0);
  randomize(b, gen, 1.0);
  Buf<double> dwant(na * ldo);
  for (int64_t i = 0; i < na; ++i)
    for (int64_t j = 0; j < nb; ++j)
      for (int64_t d = 0; d < D; ++d) dwant[i * ldo + j] += double(a[i * D + d]) * double(b[j * D + d]);
  kt.dots(a.data(), na, b.data(), nb, D, out.data(), ldo);
  expect_close<T>(name, "dots", out.data(), dwant);
}

// scores and fused_grads on packed rows, both tanh paths, over query/key counts that cover every
// register-tile remainder, against the formulas of kernels.h in double.
template <typename T>
void check_pairs(const char* name, const KernelTable<T>& kt) {
  Rng gen(3);
  char what[160];
  const int64_t hps[] = {16, 48}, nks[] = {1, 3, 4, 5, 9, 29};  // 29: whole tiles ahead
  const int paths[] = {kRational, kProduct, kProductCapped};
  for (int path : paths) {
    const char* pname =
        path == kProduct ? "product" : (path == kProductCapped ? "capped product" : "rational");
    for (int64_t Hp : hps) {
      for (int64_t nq = 1; nq <= 6; ++nq) {
        for (int64_t nk : nks) {
          Buf<T> a(nq * Hp), b(nk * Hp), v(Hp);
          randomize(a, gen, 1.0);
          randomize(b, gen, 1.0);
          randomize(v, gen, 0.3);
          auto y = [&](int64_t t, int64_t s, int64_t h) {  // y as the kernels define it
            const double x = double(a[t * Hp + h]) + double(b[s * Hp + h]);
            return path != kRational ? 1.0 / (1.0 + exp(2.0 * x)) : tanh(x);
          };
          Buf<T> A(a), B(b);  // packed rows: exp(2a), exp(2b) for the product path
          if (path != kRational) {
            for (size_t i = 0; i < A.size(); ++i) A[i] = T(exp(2.0 * double(a[i])));
            for (size_t i = 0; i < B.size(); ++i) B[i] = T(exp(2.0 * double(b[i])));
          }
          const int64_t ldo = nk + 2;
          Buf<T> out(nq * ldo);
          Buf<double> want(nq * ldo);
          for (int64_t t = 0; t < nq; ++t)
            for (int64_t s = 0; s < nk; ++s) {
              double e = 0;
              for (int64_t h = 0; h < Hp; ++h) e += double(v[h]) * y(t, s, h);
              want[t * ldo + s] = e + 0.25;
            }
          // flags: 0, kStreamed (one query: rows ahead prefetched), kAddGrads (gk added to)
          for (int flags = 0; flags < 4; ++flags) {
            kt.scores(path, A.data(), nq, B.data(), nk, Hp, v.data(), T(0.25), out.data(), ldo,
                      flags & kStreamed);
            snprintf(what, sizeof what, "scores %s nq=%lld nk=%lld Hp=%lld flags=%d", pname,
                     static_cast<long long>(nq), static_cast<long long>(nk),
                     static_cast<long long>(Hp), flags & kStreamed);
            expect_close<T>(name, what, out.data(), want, 4.0);

            Buf<T> de(nq * ldo), kscale(Hp), gq(nq * Hp), gv(Hp), gk(nk * Hp, T(9));
            randomize(de, gen, 1.0);
            randomize(kscale, gen, 1.0);
            randomize(gq, gen, 1.0);  // accumulated into
            randomize(gv, gen, 1.0);  // accumulated into; gk is overwritten, or added to
            if (flags & kAddGrads) randomize(gk, gen, 1.0);
            Buf<double> wq(gq), wv(gv), wk(nk * Hp);
            if (flags & kAddGrads)
              for (size_t i = 0; i < wk.size(); ++i) wk[i] = double(gk[i]);
            for (int64_t t = 0; t < nq; ++t)
              for (int64_t s = 0; s < nk; ++s)
                for (int64_t h = 0; h < Hp; ++h) {
                  const double yy = y(t, s, h), d = double(de[t * ldo + s]);
                  const double u = path != kRational ? yy - yy * yy : 1.0 - yy * yy;
                  wq[t * Hp + h] += d * u;
                  wk[s * Hp + h] += d * u * double(kscale[h]);
                  wv[h] += d * yy;
                }
            kt.fused_grads(path, A.data(), nq, B.data(), nk, Hp, de.data(), ldo, gq.data(),
                           gk.data(), gv.data(), kscale.data(), flags);
            snprintf(what, sizeof what, "fused_grads %s nq=%lld nk=%lld Hp=%lld flags=%d", pname,
                     static_cast<long long>(nq), static_cast<long long>(nk),
                     static_cast<long long>(Hp), flags);
            const size_t len = strlen(what);
            snprintf(what + len, sizeof what - len, " (gq)");
            expect_close<T>(name, what, gq.data(), wq, 4.0);
            snprintf(what + len, sizeof what - len, " (gk)");
            expect_close<T>(name, what, gk.data(), wk, 4.0);
            snprintf(what + len, sizeof what - len, " (gv)");
            expect_close<T>(name, what, gv.data(), wv, 4.0);
          }
        }
      }
    }
  }
}

// The GRU gate passes (csrc/gru.cpp) against the same equations in double precision, H not a
// multiple of the vector width, with saturating inputs in the first row.
template <typename T>
void check_gru(const char* name, const KernelTable<T>& kt) {
  Rng gen(7);
  const int64_t H = 37;
  Buf<T> gx(3 * H), gh(3 * H), hp(H), go(H);
  randomize(gx, gen, 2.0);
  randomize(gh, gen, 2.0);
  randomize(hp, gen, 1.0);
  randomize(go, gen, 1.0);
  gx[0] = T(200);
  gx[1] = T(-200);
  gx[H] = T(1e30);
  gx[2 * H] = T(-1e30);
  Buf<T> h(H), saved(4 * H);
  kt.gru_gates_fwd(gx.data(), gh.data(), hp.data(), h.data(), saved.data(), H);
  Buf<double> r(H), z(H), n(H), hw(H), cw(H), dxw(3 * H), dgw(3 * H);
  for (int64_t j = 0; j < H; ++j) {
    r[j] = 1.0 / (1.0 + exp(-(double(gx[j]) + double(gh[j]))));
    z[j] = 1.0 / (1.0 + exp(-(double(gx[H + j]) + double(gh[H + j]))));
    n[j] = tanh(double(gx[2 * H + j]) + r[j] * double(gh[2 * H + j]));
    hw[j] = (1.0 - z[j]) * n[j] + z[j] * double(hp[j]);
  }
  expect_close<T>(name, "gru_gates_fwd h", h.data(), hw);
  Buf<double> saved_want(4 * H);
  for (int64_t j = 0; j < H; ++j) {
    saved_want[j] = r[j];
    saved_want[H + j] = z[j];
    saved_want[2 * H + j] = n[j];
    saved_want[3 * H + j] = double(gh[2 * H + j]);
  }
  expect_close<T>(name, "gru_gates_fwd saved", saved.data(), saved_want);

  Buf<T> c(H), dx(3 * H), dg(3 * H);
  randomize(c, gen, 1.0);
  for (int64_t j = 0; j < H; ++j) {
    const double dh = double(go[j]) + double(c[j]);
    const double dn = dh * (1.0 - z[j]) * (1.0 - n[j] * n[j]);
    const double dz = dh * (double(hp[j]) - n[j]) * z[j] * (1.0 - z[j]);
    const double dr = dn * double(gh[2 * H + j]) * r[j] * (1.0 - r[j]);
    dxw[j] = dgw[j] = dr;
    dxw[H + j] = dgw[H + j] = dz;
    dxw[2 * H + j] = dn;
    dgw[2 * H + j] = dn * r[j];
    cw[j] = dh * z[j];
  }
  kt.gru_gates_bwd(saved.data(), hp.data(), go.data(), c.data(), dx.data(), dg.data(), H);
  expect_close<T>(name, "gru_gates_bwd dx", dx.data(), dxw, 4.0);
  expect_close<T>(name, "gru_gates_bwd dg", dg.data(), dgw, 4.0);
  expect_close<T>(name, "gru_gates_bwd c", c.data(), cw, 4.0);
}

// The LSTM gate passes against the same equations in double precision.
template <typename T>
void check_lstm(const char* name, const KernelTable<T>& kt) {
  Rng gen(11);
  const int64_t H = 29;
  Buf<T> gi(4 * H), gh(4 * H), c(H), dh(H), dc(H);
  randomize(gi, gen, 2.0);
  randomize(gh, gen, 2.0);
  randomize(c, gen, 1.0);
  randomize(dh, gen, 1.0);
  randomize(dc, gen, 1.0);
  gi[0] = T(300);
  gi[H + 1] = T(-300);
  gi[2 * H + 2] = T(1e30);
  gi[3 * H + 3] = T(-1e30);
  Buf<T> h(H), c_new(H), saved(5 * H), d_gates(4 * H), dc_prev(H);
  kt.lstm_gates_fwd(gi.data(), gh.data(), c.data(), h.data(), c_new.data(), saved.data(), H);
  Buf<double> hw(H), cw(H), sw(5 * H), dgw(4 * H), dcw(H);
  for (int64_t j = 0; j < H; ++j) {
    const double i = 1.0 / (1.0 + exp(-(double(gi[j]) + double(gh[j]))));
    const double f = 1.0 / (1.0 + exp(-(double(gi[H + j]) + double(gh[H + j]))));
    const double g = tanh(double(gi[2 * H + j]) + double(gh[2 * H + j]));
    const double o = 1.0 / (1.0 + exp(-(double(gi[3 * H + j]) + double(gh[3 * H + j]))));
    cw[j] = f * double(c[j]) + i * g;
    const double tc = tanh(cw[j]);
    hw[j] = o * tc;
    sw[j] = i;
    sw[H + j] = f;
    sw[2 * H + j] = g;
    sw[3 * H + j] = o;
    sw[4 * H + j] = tc;
    const double dct = double(dc[j]) + double(dh[j]) * o * (1.0 - tc * tc);
    dgw[j] = dct * g * i * (1.0 - i);
    dgw[H + j] = dct * double(c[j]) * f * (1.0 - f);
    dgw[2 * H + j] = dct * i * (1.0 - g * g);
    dgw[3 * H + j] = double(dh[j]) * tc * o * (1.0 - o);
    dcw[j] = dct * f;
  }
  expect_close<T>(name, "lstm_gates_fwd h", h.data(), hw);
  expect_close<T>(name, "lstm_gates_fwd c", c_new.data(), cw);
  expect_close<T>(name, "lstm_gates_fwd saved", saved.data(), sw);
  kt.lstm_gates_bwd(saved.data(), c.data(), dh.data(), dc.data(), d_gates.data(), dc_prev.data(),
                    H);
  expect_close<T>(name, "lstm_gates_bwd d_gates", d_gates.data(), dgw, 4.0);
  expect_close<T>(name, "lstm_gates_bwd dc", dc_prev.data(), dcw, 4.0);
}

// Every element equal (bitwise for non-NaN values; NaN where NaN).
void expect_equal(const char* table, const char* what, const float* got, const float* want,
                  int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (isnan(want[i]) ? !isnan(got[i]) : memcmp(&got[i], &want[i], sizeof(float)) != 0)
      fail(table, what, got[i], want[i], i);
  }
  ++g_checks;
}

// bfloat16 rows (float tables): exact widening; narrowing rounds to nearest even, NaN to 0x7FC0,
// in the vector body and the scalar tail alike; and every *_bf16 kernel gives exactly what its
// float twin gives on the widened rows (the same arithmetic on the same values).
void check_bf16(const char* name, const KernelTable<float>& kt) {
  static const uint32_t cases[][2] = {
      {0x3F800000u, 0x3F80}, {0x3F808000u, 0x3F80}, {0x3F818000u, 0x3F82},
      {0x3F808001u, 0x3F81}, {0xBF817FFFu, 0xBF81}, {0x7F800000u, 0x7F80},
      {0xFF800000u, 0xFF80}, {0x7F7FFFFFu, 0x7F80}, {0x80000001u, 0x8000},
      {0x7FC00001u, 0x7FC0}, {0xFFFFFFFFu, 0x7FC0}, {0x00000000u, 0x0000}};
  const int64_t n = 37, ncases = int64_t(sizeof(cases) / sizeof(cases[0]));
  Buf<float> src(n);
  Buf<Bf16> narrow(n);
  for (int64_t i = 0; i < n; ++i) memcpy(&src[i], &cases[i % ncases][0], sizeof(float));
  kt.to_bf16(src.data(), n, narrow.data());
  for (int64_t i = 0; i < n; ++i) {
    if (narrow[i].bits != cases[i % ncases][1]) {
      fail(name, "to_bf16 bits", narrow[i].bits, cases[i % ncases][1], i);
    }
  }
  ++g_checks;
  Buf<float> wide(n);
  kt.from_bf16(narrow.data(), n, wide.data());
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t want = uint32_t(narrow[i].bits) << 16;
    uint32_t got;
    memcpy(&got, &wide[i], sizeof got);
    if (got != want) fail(name, "from_bf16 bits", got, want, i);
  }
  ++g_checks;

  Rng gen(7);
  const int64_t rows = 6, H = 32, Hp = 32, D = 37;
  auto bf16_rows = [&](int64_t count, double scale, Buf<Bf16>& b, Buf<float>& f) {
    Buf<float> r{size_t(count)};
    randomize(r, gen, scale);
    kt.to_bf16(r.data(), count, b.data());
    kt.from_bf16(b.data(), count, f.data());
  };
  Buf<Bf16> qb(rows * H), kb(rows * H), xb(rows * D);
  Buf<float> qf(rows * H), kf(rows * H), xf(rows * D);
  bf16_rows(rows * H, 1.0, qb, qf);
  bf16_rows(rows * H, 1.0, kb, kf);
  bf16_rows(rows * D, 1.0, xb, xf);
  Buf<float> add(H), got(rows * Hp), want(rows * Hp);
  randomize(add, gen, 0.3);
  const float max_got = kt.pack_rows_bf16(qb.data(), rows, H, add.data(), got.data(), Hp);
  const float max_want = kt.pack_rows(qf.data(), rows, H, add.data(), want.data(), Hp);
  expect_equal(name, "pack_rows_bf16", got.data(), want.data(), rows * Hp);
  expect_equal(name, "pack_rows_bf16 max", &max_got, &max_want, 1);
  Buf<float> v(Hp), scores_got(rows * rows), scores_want(rows * rows);
  randomize(v, gen, 0.2);
  Buf<float> qexp(qf);  // the product paths' packed queries: exp(2a)
  kt.exp_inplace(qexp.data(), rows * Hp, 2.0f);
  const int paths[] = {kRational, kProduct, kProductCapped};
  for (int path : paths) {
    const float* A = path == kRational ? qf.data() : qexp.data();
    // kernels on bf16 keys read the rows as they are (the rational path of a decoding step)
    kt.scores_bf16(path, A, rows, kb.data(), rows, Hp, v.data(), 0.5f, scores_got.data(), rows,
                   0);
    kt.scores(path, A, rows, kf.data(), rows, Hp, v.data(), 0.5f, scores_want.data(), rows, 0);
    expect_equal(name, "scores_bf16", scores_got.data(), scores_want.data(), rows * rows);
    Buf<float> de(rows * rows), gq1(rows * Hp), gq2(rows * Hp), gk1(rows * Hp), gk2(rows * Hp);
    Buf<float> gv1(Hp), gv2(Hp);
    randomize(de, gen, 1.0);
    kt.fused_grads_bf16(path, A, rows, kb.data(), rows, Hp, de.data(), rows, gq1.data(),
                        gk1.data(), gv1.data(), v.data(), 0);
    kt.fused_grads(path, A, rows, kf.data(), rows, Hp, de.data(), rows, gq2.data(), gk2.data(),
                   gv2.data(), v.data(), 0);
    expect_equal(name, "fused_grads_bf16 gq", gq1.data(), gq2.data(), rows * Hp);
    expect_equal(name, "fused_grads_bf16 gk", gk1.data(), gk2.data(), rows * Hp);
    expect_equal(name, "fused_grads_bf16 gv", gv1.data(), gv2.data(), Hp);
  }
  Buf<float> w(rows * rows), ctx_got(rows * D), ctx_want(rows * D);
  randomize(w, gen, 1.0);
  const int64_t n_outs[] = {1, rows};  // the streaming and the blocked loop
  for (int64_t n_out : n_outs) {
    kt.weighted_rows_bf16(w.data(), rows, 1, n_out, rows, xb.data(), D, ctx_got.data());
    kt.weighted_rows(w.data(), rows, 1, n_out, rows, xf.data(), D, ctx_want.data());
    expect_equal(name, "weighted_rows_bf16", ctx_got.data(), ctx_want.data(), n_out * D);
  }
  Buf<float> dots_got(rows * rows), dots_want(rows * rows);
  kt.dots_bf16(xb.data(), rows, xb.data(), rows, D, dots_got.data(), rows);
  kt.dots(xf.data(), rows, xf.data(), rows, D, dots_want.data(), rows);
  expect_equal(name, "dots_bf16", dots_got.data(), dots_want.data(), rows * rows);
}

void check_bf16(const char*, const KernelTable<double>&) {}  // bfloat16 runs on the float tables

template <typename T>
void check_table(const char* name, const KernelTable<T>& kt) {
  const int before = g_checks;
  check_tanh<T>(name, kt);
  check_rows<T>(name, kt);
  check_pairs<T>(name, kt);
  check_gru<T>(name, kt);
  check_lstm<T>(name, kt);
  check_bf16(name, kt);
  printf("ok %s: %d checks\n", name, g_checks - before);
}

}  // namespace

int main() {
  check_table<float>("portable float", portable_float_kernels());
  check_table<double>("portable double", portable_double_kernels());
#if SEQ2SEQ_FAST_X86_SIMD
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    check_table<float>("avx2 float", avx2_float_kernels());
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"))
    check_table<float>("avx512 float", avx512_float_kernels());
#endif
  printf("all %d checks passed\n", g_checks);
  return 0;
}
