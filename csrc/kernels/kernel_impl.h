// Kernel bodies shared by every instruction set. Included (inside a per-ISA namespace, after that
// ISA's SIMD wrapper `S` is defined) by portable.cpp, avx2.cpp, avx512.cpp.
// No #include here: system headers are included by the translation unit before its target pragma,
// so no inline library function is ever compiled with wider instructions than the default.
//
// S provides: T, V (one vector), W (lanes), QB/KB (register tile), load/store/set1/zero, add/mul,
// fma(a,b,c) = a*b + c, fnma(a,b,c) = c - a*b, rcp (~full precision), tanh (clamped rational),
// exp, cap, absmax/hmax, hsum, and for kProductBf16 exp2_lowp (2^t to 7.6e-5 relative for any t:
// NaN stays NaN, 2^inf = inf, 2^-inf = 0) and rcp_lowp (1/d for d >= 1 to 2^-14 relative or
// better, 1/inf = 0). load/store also take Bf16 rows (kernels.h): converted in registers, so
// every kernel that is a template on the type of its rows (M / K / X below: T or Bf16) reads
// bfloat16 with the same arithmetic.

// One element of a T or bfloat16 row, as T (the scalar tails of the row loops).
inline typename S::T scalar(typename S::T x) { return x; }
inline typename S::T scalar(Bf16 x) { return typename S::T(bf16_to_float(x)); }

// Hints that the cache line at p will be read (prefetch_line) or written (prefetch_line_for_write)
// soon; no-ops where the compiler has no prefetch.
inline void prefetch_line([[maybe_unused]] const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#endif
}
inline void prefetch_line_for_write([[maybe_unused]] const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 1, 3);
#endif
}

// kProductCapped: 1 + A B is capped at 2^120 before the reciprocal. An item takes it when its
// ranges allow A B to overflow (max |a| + max |b| above the safe sum, kernels.h): the SIMD
// reciprocal's Newton step would turn 1 / inf into inf * 0 = NaN. The cap keeps the reciprocal's
// argument and result normal: 1 / (1 + 2^120) = 7.5e-37, so tanh = 1 - 2r rounds to 1 and the
// derivative r - r^2 errs by under 1e-36 where its true value is smaller still. NaN passes the
// cap unchanged (S::cap returns x when either operand is NaN).
template <typename T>
constexpr T product_cap() {
  return T(0x1p120);
}

template <int P>
inline typename S::V elem(typename S::V a, typename S::V b, typename S::V one,
                          [[maybe_unused]] typename S::V cap) {
  if constexpr (P == kProduct) {
    return S::rcp(S::fma(a, b, one));  // r = 1 / (1 + e^{2a} e^{2b}); tanh(a + b) = 1 - 2r
  } else if constexpr (P == kProductCapped) {
    return S::rcp(S::cap(S::fma(a, b, one), cap));
  } else if constexpr (P == kProductBf16) {  // a = 2 log2(e) (q + bias), b a key as it is
    const auto t = S::fma(b, S::set1(typename S::T(S2S_TWO_LOG2E)), a);
    return S::rcp_lowp(S::add(S::exp2_lowp(t), one));
  } else {
    return S::tanh(S::add(a, b));
  }
}

// u = sech^2 / 4 = r - r^2 (product path) or sech^2 = 1 - tanh^2 (rational path).
template <int P>
inline typename S::V deriv(typename S::V y, typename S::V one) {
  if constexpr (P != kRational) {
    return S::fnma(y, y, y);
  } else {
    return S::fnma(y, y, one);
  }
}

// STREAM (one query, keys read from memory: kStreamed): the rows `ahead` (KB of them, a later
// tile's) are prefetched a cache line per load, so they arrive while this tile computes.
template <int P, int QB, int KB, typename K, bool STREAM = false>
void score_tile(const typename S::T* A, const K* Bk, int64_t Hp,
                const typename S::T* veff, typename S::T offset, typename S::T* out, int64_t ldo,
                const K* ahead = nullptr) {
  using V = typename S::V;
  using T = typename S::T;
  const V one = S::set1(T(1));
  const V cap = S::set1(product_cap<T>());
  V acc[QB][KB];
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j] = S::zero();
  for (int64_t h = 0; h < Hp; h += S::W) {
    const V vv = S::load(veff + h);
    V a[QB];
    for (int i = 0; i < QB; ++i) a[i] = S::load(A + i * Hp + h);
    for (int j = 0; j < KB; ++j) {
      if constexpr (STREAM) prefetch_line(ahead + j * Hp + h);
      const V b = S::load(Bk + j * Hp + h);
      for (int i = 0; i < QB; ++i) {
        acc[i][j] = S::fma(vv, elem<P>(a[i], b, one, cap), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < KB; ++j) out[i * ldo + j] = offset + S::hsum(acc[i][j]);
}

// The rows two tiles of KB after row s, or row s's own where fewer are left (already in cache).
template <int KB, typename K>
const K* tile_ahead(const K* Bk, int64_t s, int64_t nk, int64_t Hp) {
  return Bk + (s + 3 * KB <= nk ? s + 2 * KB : s) * Hp;
}

// One query (a decoding step) takes wider key tiles where the registers allow (S::KB1): v and
// the query are loaded once per KB1 keys, and the loop has more independent chains.
template <int P, int QB, typename K, bool STREAM = false>
void score_cols(const typename S::T* A, const K* Bk, int64_t nk, int64_t Hp,
                const typename S::T* veff, typename S::T offset, typename S::T* out, int64_t ldo) {
  constexpr int KB = QB == 1 ? S::KB1 : S::KB;
  int64_t s = 0;
  for (; s + KB <= nk; s += KB)
    score_tile<P, QB, KB, K, STREAM>(A, Bk + s * Hp, Hp, veff, offset, out + s, ldo,
                                     tile_ahead<KB>(Bk, s, nk, Hp));
  if constexpr (KB > S::KB) {
    for (; s + S::KB <= nk; s += S::KB)
      score_tile<P, QB, S::KB>(A, Bk + s * Hp, Hp, veff, offset, out + s, ldo);
  }
  for (; s < nk; ++s) score_tile<P, QB, 1>(A, Bk + s * Hp, Hp, veff, offset, out + s, ldo);
}

template <int P, typename K>
void scores_rows(const typename S::T* A, int64_t nq, const K* Bk, int64_t nk,
                 int64_t Hp, const typename S::T* veff, typename S::T offset, typename S::T* out,
                 int64_t ldo, int flags) {
  if (nq == 1 && (flags & kStreamed)) {
    score_cols<P, 1, K, true>(A, Bk, nk, Hp, veff, offset, out, ldo);
    return;
  }
  for (int64_t t = 0; t < nq; t += S::QB) {
    const int64_t qn = nq - t < S::QB ? nq - t : S::QB;
    const auto* a = A + t * Hp;
    auto* o = out + t * ldo;
    switch (qn) {
      case 1: score_cols<P, 1>(a, Bk, nk, Hp, veff, offset, o, ldo); break;
      case 2: score_cols<P, 2>(a, Bk, nk, Hp, veff, offset, o, ldo); break;
      case 3: score_cols<P, 3>(a, Bk, nk, Hp, veff, offset, o, ldo); break;
      default: score_cols<P, 4>(a, Bk, nk, Hp, veff, offset, o, ldo); break;
    }
  }
}

template <typename K>
void scores(int path, const typename S::T* A, int64_t nq, const K* Bk, int64_t nk,
            int64_t Hp, const typename S::T* veff, typename S::T offset, typename S::T* out,
            int64_t ldo, int flags) {
  switch (path) {
    case kProduct: scores_rows<kProduct>(A, nq, Bk, nk, Hp, veff, offset, out, ldo, flags); break;
    case kProductCapped:
      scores_rows<kProductCapped>(A, nq, Bk, nk, Hp, veff, offset, out, ldo, flags);
      break;
    case kProductBf16:
      scores_rows<kProductBf16>(A, nq, Bk, nk, Hp, veff, offset, out, ldo, flags);
      break;
    default: scores_rows<kRational>(A, nq, Bk, nk, Hp, veff, offset, out, ldo, flags); break;
  }
}

// One pass for the backward when the softmax weights are known (saved by the forward): y is
// computed and consumed in registers, never stored:
//   u = y - y^2 (kProduct, = sech^2 / 4) or 1 - y^2 (kRational, = sech^2)
//   gq[t] += d u,  gv += d y,  gk[s] = kscale * sum_t d u (written scaled, overwritten)
// DIRECT: the tile holds every query of the item, so each gk row is complete when the tile ends:
// it is written straight away (no zeroing, reloading or second scaling pass over gk). ADD (with
// DIRECT): gk[s] += kscale * sum_t d u instead (kAddGrads). STREAM (kStreamed): the key rows and
// gk rows of a later tile (`ahead`, `gk_ahead`) are prefetched a line per load, as in score_tile.
template <int P, int QB, int KB, bool DIRECT, typename K, bool ADD = false, bool STREAM = false>
void fused_grad_tile(const typename S::T* A, const K* Bk, int64_t Hp,
                     const typename S::T* de, int64_t ldd, typename S::T* gq, typename S::T* gk,
                     typename S::T* gv, const typename S::T* kscale, const K* ahead = nullptr,
                     const typename S::T* gk_ahead = nullptr) {
  static_assert(DIRECT || !ADD, "kAddGrads adds complete rows (one query tile)");
  using V = typename S::V;
  using T = typename S::T;
  const V one = S::set1(T(1));
  const V cap = S::set1(product_cap<T>());
  V d[QB][KB];
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < KB; ++j) d[i][j] = S::set1(de[i * ldd + j]);
  for (int64_t h = 0; h < Hp; h += S::W) {
    V a[QB], gqa[QB];
    for (int i = 0; i < QB; ++i) {
      a[i] = S::load(A + i * Hp + h);
      gqa[i] = S::load(gq + i * Hp + h);
    }
    V gva[2] = {S::load(gv + h), S::zero()};
    for (int j = 0; j < KB; ++j) {
      if constexpr (STREAM) {
        prefetch_line(ahead + j * Hp + h);
        prefetch_line_for_write(gk_ahead + j * Hp + h);
      }
      const V b = S::load(Bk + j * Hp + h);
      V gka = DIRECT ? S::zero() : S::load(gk + j * Hp + h);
      for (int i = 0; i < QB; ++i) {
        const V y = elem<P>(a[i], b, one, cap);
        const V u = deriv<P>(y, one);
        gqa[i] = S::fma(d[i][j], u, gqa[i]);
        gka = S::fma(d[i][j], u, gka);
        gva[(i + j) & 1] = S::fma(d[i][j], y, gva[(i + j) & 1]);
      }
      if constexpr (ADD) {
        S::store(gk + j * Hp + h, S::fma(gka, S::load(kscale + h), S::load(gk + j * Hp + h)));
      } else {
        S::store(gk + j * Hp + h, DIRECT ? S::mul(gka, S::load(kscale + h)) : gka);
      }
    }
    for (int i = 0; i < QB; ++i) S::store(gq + i * Hp + h, gqa[i]);
    S::store(gv + h, S::add(gva[0], gva[1]));
  }
}

template <int P, int QB, bool DIRECT, typename K, bool ADD = false, bool STREAM = false>
void fused_grad_cols(const typename S::T* A, const K* Bk, int64_t nk, int64_t Hp,
                     const typename S::T* de, int64_t ldd, typename S::T* gq, typename S::T* gk,
                     typename S::T* gv, const typename S::T* kscale) {
  constexpr int KB = S::KB;
  int64_t s = 0;
  for (; s + KB <= nk; s += KB)
    fused_grad_tile<P, QB, KB, DIRECT, K, ADD, STREAM>(A, Bk + s * Hp, Hp, de + s, ldd, gq,
                                                       gk + s * Hp, gv, kscale,
                                                       tile_ahead<KB>(Bk, s, nk, Hp),
                                                       tile_ahead<KB>(gk, s, nk, Hp));
  for (; s < nk; ++s)
    fused_grad_tile<P, QB, 1, DIRECT, K, ADD>(A, Bk + s * Hp, Hp, de + s, ldd, gq, gk + s * Hp,
                                              gv, kscale);
}

// fused_grad_cols over the query tiles of nq queries (S::QB at a time, the last one shorter).
template <int P, bool DIRECT, bool ADD, typename K>
void query_tiles(const typename S::T* A, int64_t nq, const K* Bk, int64_t nk, int64_t Hp,
                 const typename S::T* de, int64_t ldd, typename S::T* gq, typename S::T* gk,
                 typename S::T* gv, const typename S::T* kscale) {
  for (int64_t t = 0; t < nq; t += S::QB) {
    const int64_t qn = nq - t < S::QB ? nq - t : S::QB;
    const auto* a = A + t * Hp;
    const auto* d = de + t * ldd;
    auto* g = gq + t * Hp;
    switch (qn) {
      case 1: fused_grad_cols<P, 1, DIRECT, K, ADD>(a, Bk, nk, Hp, d, ldd, g, gk, gv, kscale); break;
      case 2: fused_grad_cols<P, 2, DIRECT, K, ADD>(a, Bk, nk, Hp, d, ldd, g, gk, gv, kscale); break;
      case 3: fused_grad_cols<P, 3, DIRECT, K, ADD>(a, Bk, nk, Hp, d, ldd, g, gk, gv, kscale); break;
      default:
        fused_grad_cols<P, S::QB, DIRECT, K, ADD>(a, Bk, nk, Hp, d, ldd, g, gk, gv, kscale);
        break;
    }
  }
}

template <int P, typename K>
void fused_grads_rows(const typename S::T* A, int64_t nq, const K* Bk, int64_t nk,
                      int64_t Hp, const typename S::T* de, int64_t ldd, typename S::T* gq,
                      typename S::T* gk, typename S::T* gv, const typename S::T* kscale,
                      int flags) {
  using T = typename S::T;
  const bool add = flags & kAddGrads;
  if (nq == 1 && (flags & kStreamed)) {
    if (add) {
      fused_grad_cols<P, 1, true, K, true, true>(A, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale);
    } else {
      fused_grad_cols<P, 1, true, K, false, true>(A, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale);
    }
    return;
  }
  if (add) {  // each query tile's rows are complete: the tiles add in turn
    query_tiles<P, true, true>(A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale);
    return;
  }
  if (nq <= S::QB) {  // one query tile: every gk row is final when written
    query_tiles<P, true, false>(A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale);
    return;
  }
  for (int64_t i = 0; i < nk * Hp; ++i) gk[i] = T(0);
  query_tiles<P, false, false>(A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale);
  for (int64_t s = 0; s < nk; ++s)
    for (int64_t h = 0; h < Hp; h += S::W)
      S::store(gk + s * Hp + h, S::mul(S::load(gk + s * Hp + h), S::load(kscale + h)));
}

template <typename K>
void fused_grads(int path, const typename S::T* A, int64_t nq, const K* Bk,
                 int64_t nk, int64_t Hp, const typename S::T* de, int64_t ldd, typename S::T* gq,
                 typename S::T* gk, typename S::T* gv, const typename S::T* kscale, int flags) {
  switch (path) {
    case kProduct:
      fused_grads_rows<kProduct>(A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale, flags);
      break;
    case kProductCapped:
      fused_grads_rows<kProductCapped>(A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale, flags);
      break;
    case kProductBf16:
      fused_grads_rows<kProductBf16>(A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale, flags);
      break;
    default:
      fused_grads_rows<kRational>(A, nq, Bk, nk, Hp, de, ldd, gq, gk, gv, kscale, flags);
      break;
  }
}

template <typename M>
typename S::T pack_rows(const M* src, int64_t rows, int64_t H, const typename S::T* add,
                        typename S::T* dst, int64_t Hp) {
  using V = typename S::V;
  using T = typename S::T;
  V big = S::zero();
  T tail = T(0);
  for (int64_t r = 0; r < rows; ++r) {
    const M* x = src + r * H;
    T* y = dst + r * Hp;
    int64_t h = 0;
    for (; h + S::W <= H; h += S::W) {
      V xv = S::load(x + h);
      if (add != nullptr) xv = S::add(xv, S::load(add + h));
      S::store(y + h, xv);
      big = S::absmax(xv, big);
    }
    for (; h < H; ++h) {
      const T xs = add != nullptr ? scalar(x[h]) + add[h] : scalar(x[h]);
      y[h] = xs;
      const T ax = xs < T(0) ? -xs : xs;
      tail = ax > tail ? ax : tail;  // NaN compares false and does not count
    }
    for (; h < Hp; ++h) y[h] = T(0);
  }
  const T vec = S::hmax(big);
  return vec > tail ? vec : tail;
}

void scale_rows(const typename S::T* src, int64_t rows, int64_t Hp, const typename S::T* scale,
                typename S::T* dst, int64_t H) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto* x = src + r * Hp;
    auto* y = dst + r * H;
    int64_t h = 0;
    for (; h + S::W <= H; h += S::W) S::store(y + h, S::mul(S::load(x + h), S::load(scale + h)));
    for (; h < H; ++h) y[h] = x[h] * scale[h];
  }
}

// out[o * D + d] = sum_{i < n_in} w[o * so + i * si] x[i * D + d] for o < n_out (overwrites).
template <int OB, typename X>
void weighted_rows_block(const typename S::T* w, int64_t so, int64_t si, int64_t n_in,
                         const X* x, int64_t D, typename S::T* out) {
  using V = typename S::V;
  using T = typename S::T;
  int64_t d = 0;
  for (; d + 2 * S::W <= D; d += 2 * S::W) {
    V acc[OB][2];
    for (int o = 0; o < OB; ++o) acc[o][0] = acc[o][1] = S::zero();
    for (int64_t i = 0; i < n_in; ++i) {
      const V x0 = S::load(x + i * D + d);
      const V x1 = S::load(x + i * D + d + S::W);
      for (int o = 0; o < OB; ++o) {
        const V wo = S::set1(w[o * so + i * si]);
        acc[o][0] = S::fma(wo, x0, acc[o][0]);
        acc[o][1] = S::fma(wo, x1, acc[o][1]);
      }
    }
    for (int o = 0; o < OB; ++o) {
      S::store(out + o * D + d, acc[o][0]);
      S::store(out + o * D + d + S::W, acc[o][1]);
    }
  }
  for (; d + S::W <= D; d += S::W) {
    V acc[OB];
    for (int o = 0; o < OB; ++o) acc[o] = S::zero();
    for (int64_t i = 0; i < n_in; ++i) {
      const V xv = S::load(x + i * D + d);
      for (int o = 0; o < OB; ++o) acc[o] = S::fma(S::set1(w[o * so + i * si]), xv, acc[o]);
    }
    for (int o = 0; o < OB; ++o) S::store(out + o * D + d, acc[o]);
  }
  for (; d < D; ++d) {
    for (int o = 0; o < OB; ++o) {
      T acc = T(0);
      for (int64_t i = 0; i < n_in; ++i) acc += w[o * so + i * si] * scalar(x[i * D + d]);
      out[o * D + d] = acc;
    }
  }
}

// out += sum_{r < R} w[r * si] x[r * D + .] over D, one sweep of the L1-resident out for R rows;
// with `next` (R rows that the following sweep reads) each of their cache lines is prefetched
// as this sweep reaches its column: bfloat16 rows are consumed at twice the bytes per
// instruction, faster than the hardware prefetchers ramp up on a new group of streams.
template <int R, typename X>
void add_weighted_rows(const typename S::T* w, int64_t si, const X* x, int64_t D,
                       const X* next, typename S::T* out) {
  using V = typename S::V;
  constexpr int64_t kLine = 64 / int64_t(sizeof(X));  // elements per cache line
  V wr[R];
  for (int r = 0; r < R; ++r) wr[r] = S::set1(w[r * si]);
  const int64_t Dv = D / S::W * S::W;
  for (int64_t d = 0; d < Dv; d += S::W) {
    if (next != nullptr && d % kLine == 0) {
      for (int r = 0; r < R; ++r) prefetch_line(next + r * D + d);
    }
    V acc = S::load(out + d);
    for (int r = 0; r < R; ++r) acc = S::fma(wr[r], S::load(x + r * D + d), acc);
    S::store(out + d, acc);
  }
  for (int64_t d = Dv; d < D; ++d) {
    for (int r = 0; r < R; ++r) out[d] += w[r * si] * scalar(x[r * D + d]);
  }
}

// One output row, x read row by row (eight rows per sweep of the L1-resident output): for few
// outputs (a decoding step's context) x streams from memory in address order, which the hardware
// prefetchers follow, instead of n_in interleaved streams.
template <typename X>
void weighted_row_stream(const typename S::T* w, int64_t si, int64_t n_in, const X* x, int64_t D,
                         typename S::T* out) {
  using T = typename S::T;
  for (int64_t d = 0; d < D; ++d) out[d] = T(0);
  int64_t i = 0;
  for (; i + 8 <= n_in; i += 8) {
    const X* next = i + 16 <= n_in ? x + (i + 8) * D : nullptr;
    add_weighted_rows<8>(w + i * si, si, x + i * D, D, next, out);
  }
  const X* none = nullptr;
  for (; i + 4 <= n_in; i += 4) add_weighted_rows<4>(w + i * si, si, x + i * D, D, none, out);
  for (; i < n_in; ++i) add_weighted_rows<1>(w + i * si, si, x + i * D, D, none, out);
}

template <typename X>
void weighted_rows(const typename S::T* w, int64_t so, int64_t si, int64_t n_out, int64_t n_in,
                   const X* x, int64_t D, typename S::T* out) {
  if (n_out < 4) {
    for (int64_t o = 0; o < n_out; ++o) weighted_row_stream(w + o * so, si, n_in, x, D, out + o * D);
    return;
  }
  int64_t o = 0;
  for (; o + 4 <= n_out; o += 4) weighted_rows_block<4>(w + o * so, so, si, n_in, x, D, out + o * D);
  for (; o < n_out; ++o) weighted_rows_block<1>(w + o * so, so, si, n_in, x, D, out + o * D);
}

// out[i * ldo + j] = sum_d a[i * D + d] b[j * D + d] for i < na, j < nb.
template <int IB, int JB, typename M>
void dots_block(const M* a, const M* b, int64_t D, typename S::T* out, int64_t ldo) {
  using V = typename S::V;
  using T = typename S::T;
  V acc[IB][JB];
  for (int i = 0; i < IB; ++i)
    for (int j = 0; j < JB; ++j) acc[i][j] = S::zero();
  int64_t d = 0;
  for (; d + S::W <= D; d += S::W) {
    V av[IB];
    for (int i = 0; i < IB; ++i) av[i] = S::load(a + i * D + d);
    for (int j = 0; j < JB; ++j) {
      const V bv = S::load(b + j * D + d);
      for (int i = 0; i < IB; ++i) acc[i][j] = S::fma(av[i], bv, acc[i][j]);
    }
  }
  for (int i = 0; i < IB; ++i) {
    for (int j = 0; j < JB; ++j) {
      T sum = S::hsum(acc[i][j]);
      for (int64_t e = d; e < D; ++e) sum += scalar(a[i * D + e]) * scalar(b[j * D + e]);
      out[i * ldo + j] = sum;
    }
  }
}

template <typename M>
void dots(const M* a, int64_t na, const M* b, int64_t nb, int64_t D, typename S::T* out,
          int64_t ldo) {
  constexpr int IB = S::QB;  // the score tile's register budget: 4 x 4 (AVX-512) or 2 x 4
  int64_t i = 0;
  for (; i + IB <= na; i += IB) {
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) dots_block<IB, 4>(a + i * D, b + j * D, D, out + i * ldo + j, ldo);
    for (; j < nb; ++j) dots_block<IB, 1>(a + i * D, b + j * D, D, out + i * ldo + j, ldo);
  }
  for (; i < na; ++i) {
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) dots_block<1, 4>(a + i * D, b + j * D, D, out + i * ldo + j, ldo);
    for (; j < nb; ++j) dots_block<1, 1>(a + i * D, b + j * D, D, out + i * ldo + j, ldo);
  }
}

void exp_inplace(typename S::T* p, int64_t n, typename S::T scale) {
  const auto sv = S::set1(scale);
  int64_t i = 0;
  for (; i + S::W <= n; i += S::W) S::store(p + i, S::exp(S::mul(S::load(p + i), sv)));
  for (; i < n; ++i) p[i] = std::exp(scale * p[i]);
}

void tanh_pairs(int path, const typename S::T* a, const typename S::T* b, typename S::T* out,
                int64_t n) {
  using V = typename S::V;
  using T = typename S::T;
  const V one = S::set1(T(1));
  const V cap = S::set1(product_cap<T>());
  const V two = S::set1(T(2));
  for (int64_t i = 0; i + S::W <= n; i += S::W) {
    const V x = S::load(a + i);
    const V y = S::load(b + i);
    if (path == kProduct) {
      S::store(out + i, S::fnma(two, elem<kProduct>(x, y, one, cap), one));
    } else if (path == kProductCapped) {
      S::store(out + i, S::fnma(two, elem<kProductCapped>(x, y, one, cap), one));
    } else if (path == kProductBf16) {
      S::store(out + i, S::fnma(two, elem<kProductBf16>(x, y, one, cap), one));
    } else {
      S::store(out + i, elem<kRational>(x, y, one, cap));
    }
  }
}

// GRU gates of one row (csrc/gru.cpp has the equations): saved = [r | z | n | gh_n].
void gru_gates_fwd(const typename S::T* __restrict__ gx, const typename S::T* __restrict__ gh,
                   const typename S::T* __restrict__ hp, typename S::T* __restrict__ h,
                   typename S::T* __restrict__ saved, int64_t H) {
  using T = typename S::T;
  T* r = saved;  // r, then z: sigmoid(a) = 1 / (1 + exp(-a))
  for (int64_t j = 0; j < 2 * H; ++j) r[j] = -(gx[j] + gh[j]);
  exp_inplace(r, 2 * H, T(1));
  for (int64_t j = 0; j < 2 * H; ++j) r[j] = T(1) / (T(1) + r[j]);
  const T* z = saved + H;
  T* n = saved + 2 * H;  // tanh(a) = 1 - 2 / (1 + exp(2a))
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

void gru_gates_bwd(const typename S::T* __restrict__ saved, const typename S::T* __restrict__ hp,
                   const typename S::T* __restrict__ go, typename S::T* __restrict__ c,
                   typename S::T* __restrict__ dx, typename S::T* __restrict__ dg, int64_t H) {
  using T = typename S::T;
  const T* r = saved;
  const T* z = saved + H;
  const T* n = saved + 2 * H;
  const T* ghn = saved + 3 * H;
  for (int64_t j = 0; j < H; ++j) {
    const T dh = go[j] + c[j];
    const T dn = dh * (T(1) - z[j]) * (T(1) - n[j] * n[j]);
    const T dz = dh * (hp[j] - n[j]) * z[j] * (T(1) - z[j]);
    const T dr = dn * ghn[j] * r[j] * (T(1) - r[j]);
    dx[j] = dr;
    dx[H + j] = dz;
    dx[2 * H + j] = dn;
    dg[j] = dr;
    dg[H + j] = dz;
    dg[2 * H + j] = dn * r[j];
    c[j] = dh * z[j];
  }
}

// LSTM gates of one row (csrc/lstm.cpp): gates = gi + gh = [i | f | g | o] (4H), c (H) ->
// h, c_new (H), saved = [i | f | g | o | tanh(c_new)] (5H).
void lstm_gates_fwd(const typename S::T* __restrict__ gi, const typename S::T* __restrict__ gh,
                    const typename S::T* __restrict__ c, typename S::T* __restrict__ h,
                    typename S::T* __restrict__ c_new, typename S::T* __restrict__ saved,
                    int64_t H) {
  using T = typename S::T;
  T* a = saved;  // i, f, g, o: sigmoid(x) = 1 / (1 + exp(-x)), tanh(x) = 1 - 2 / (1 + exp(2x))
  for (int64_t j = 0; j < 4 * H; ++j) a[j] = gi[j] + gh[j];
  exp_inplace(a, 2 * H, T(-1));
  exp_inplace(a + 2 * H, H, T(2));
  exp_inplace(a + 3 * H, H, T(-1));
  for (int64_t j = 0; j < 4 * H; ++j) a[j] = T(1) / (T(1) + a[j]);
  T* tc = saved + 4 * H;
  for (int64_t j = 0; j < H; ++j) {
    a[2 * H + j] = T(1) - T(2) * a[2 * H + j];
    c_new[j] = a[H + j] * c[j] + a[j] * a[2 * H + j];
    tc[j] = c_new[j];
  }
  exp_inplace(tc, H, T(2));
  for (int64_t j = 0; j < H; ++j) {
    tc[j] = T(1) - T(2) / (T(1) + tc[j]);
    h[j] = a[3 * H + j] * tc[j];
  }
}

// Its backward: dh, dc (gradients of h and c_new) -> d_gates (4H, of gi and of gh alike) and
// dc_prev (H).
void lstm_gates_bwd(const typename S::T* __restrict__ saved, const typename S::T* __restrict__ c,
                    const typename S::T* __restrict__ dh, const typename S::T* __restrict__ dc,
                    typename S::T* __restrict__ d_gates, typename S::T* __restrict__ dc_prev,
                    int64_t H) {
  using T = typename S::T;
  const T* i = saved;
  const T* f = saved + H;
  const T* g = saved + 2 * H;
  const T* o = saved + 3 * H;
  const T* tc = saved + 4 * H;
  for (int64_t j = 0; j < H; ++j) {
    const T dct = dc[j] + dh[j] * o[j] * (T(1) - tc[j] * tc[j]);
    d_gates[j] = dct * g[j] * i[j] * (T(1) - i[j]);
    d_gates[H + j] = dct * c[j] * f[j] * (T(1) - f[j]);
    d_gates[2 * H + j] = dct * i[j] * (T(1) - g[j] * g[j]);
    d_gates[3 * H + j] = dh[j] * tc[j] * o[j] * (T(1) - o[j]);
    dc_prev[j] = dct * f[j];
  }
}

// bfloat16 rows to and from T, a vector at a time (the tails element by element).
void to_bf16(const typename S::T* src, int64_t n, Bf16* dst) {
  int64_t i = 0;
  for (; i + S::W <= n; i += S::W) S::store(dst + i, S::load(src + i));
  for (; i < n; ++i) dst[i] = float_to_bf16(float(src[i]));
}

void from_bf16(const Bf16* src, int64_t n, typename S::T* dst) {
  int64_t i = 0;
  for (; i + S::W <= n; i += S::W) S::store(dst + i, S::load(src + i));
  for (; i < n; ++i) dst[i] = scalar(src[i]);
}

const KernelTable<typename S::T>& table(const char* name) {
  using T = typename S::T;
  static const KernelTable<T> t{name,
                                pack_rows<T>,
                                exp_inplace,
                                scale_rows,
                                weighted_rows<T>,
                                dots<T>,
                                scores<T>,
                                fused_grads<T>,
                                tanh_pairs,
                                gru_gates_fwd,
                                gru_gates_bwd,
                                lstm_gates_fwd,
                                lstm_gates_bwd,
                                pack_rows<Bf16>,
                                scores<Bf16>,
                                fused_grads<Bf16>,
                                weighted_rows<Bf16>,
                                dots<Bf16>,
                                to_bf16,
                                from_bf16};
  return t;
}
