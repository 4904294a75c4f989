// AVX2 + FMA float kernels (x86-64 without AVX-512). Same structure as avx512.cpp.
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "tanh_coeffs.h"

#if SEQ2SEQ_FAST_X86_SIMD
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace seq2seq_fast {
namespace avx2 {

struct S {
  using T = float;
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int QB = 2;  // 16 ymm registers: 2 x 4 tile
  static constexpr int KB = 4;
  static constexpr int KB1 = 4;  // one query: 1 x 4 (16 registers)
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  // bfloat16: widen to 32 bits and shift into the high half (exact).
  static inline V load(const Bf16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // Round to nearest even (add 0x7FFF plus the kept lowest bit, keep the high half); NaN -> 0x7FC0.
  // The 32-bit results fit 16 bits, so the saturating pack is exact (it interleaves the halves).
  static inline void store(Bf16* p, V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  // 12-bit estimate + one Newton step: relative error < 1.4e-7.
  static inline V rcp(V d) {
    const V r = _mm256_rcp_ps(d);
    return _mm256_fmadd_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(1.0f)), r);
  }
  static inline float hsum(V x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // min(x, hi), NaN kept: min returns its second operand when either is NaN.
  static inline V cap(V x, V hi) { return _mm256_min_ps(hi, x); }
  static inline V clamp(V x, float lo, float hi) {
    return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x));
  }
  static inline V tanh(V x) {
    x = clamp(x, -float(S2S_TANH_CLAMP), float(S2S_TANH_CLAMP));
    const V x2 = mul(x, x);
    V p = fma(set1(float(S2S_TANH_P4)), x2, set1(float(S2S_TANH_P3)));
    V q = fma(set1(float(S2S_TANH_Q4)), x2, set1(float(S2S_TANH_Q3)));
    p = fma(p, x2, set1(float(S2S_TANH_P2)));
    q = fma(q, x2, set1(float(S2S_TANH_Q2)));
    p = fma(p, x2, set1(float(S2S_TANH_P1)));
    q = fma(q, x2, set1(float(S2S_TANH_Q1)));
    p = fma(p, x2, set1(1.0f));
    q = fma(q, x2, set1(1.0f));
    return mul(mul(x, p), rcp(q));
  }
  // 2^t = 2^n p(t - n), n = floor(t), t clamped to [-127, 127] (NaN kept) so that 2^n is built
  // from its exponent bits (0 at -127) and 1 + 2^t stays finite for the Newton reciprocal.
  static inline V exp2_lowp(V t) {
    t = clamp(t, -127.0f, 127.0f);
    const V n = _mm256_floor_ps(t);
    const V f = _mm256_sub_ps(t, n);
    V p = fma(set1(float(S2S_EXP2_C3)), f, set1(float(S2S_EXP2_C2)));
    p = fma(p, f, set1(float(S2S_EXP2_C1)));
    p = fma(p, f, set1(float(S2S_EXP2_C0)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                            _mm256_set1_epi32(127)), 23);
    return mul(p, _mm256_castsi256_ps(bits));
  }
  // The 12-bit estimate errs by up to 3.7e-4: the Newton step is kept.
  static inline V rcp_lowp(V d) { return rcp(d); }
  // exp(x) for x below -87 (where 2^n would leave the normal floats) is 0, -inf included: a
  // masked or -inf score gets weight exactly 0 (the true value is below 1.7e-38 anyway).
  static inline V exp(V x) {
    const V under = _mm256_cmp_ps(x, set1(-87.0f), _CMP_LT_OQ);  // false for NaN
    return _mm256_andnot_ps(under, exp_clamped(x));
  }
  static inline V exp_clamped(V x) {
    x = clamp(x, -87.0f, 88.3f);  // keeps 2^n a normal float built from its exponent bits
    const V n = _mm256_round_ps(mul(x, set1(float(S2S_LOG2E))),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = fnma(n, set1(float(S2S_LN2_HI)), x);
    r = fnma(n, set1(float(S2S_LN2_LO)), r);
    V p = fma(set1(1.0f / 5040), r, set1(1.0f / 720));
    p = fma(p, r, set1(1.0f / 120));
    p = fma(p, r, set1(1.0f / 24));
    p = fma(p, r, set1(1.0f / 6));
    p = fma(p, r, set1(0.5f));
    p = fma(p, r, set1(1.0f));
    p = fma(p, r, set1(1.0f));
    // n in [-126, 128]: split 2^n = 2^(n/2) 2^(n - n/2) so both halves are normal.
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const V s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const V s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return mul(mul(p, s1), s2);
  }
  // max(|x|, m), NaN ignored: max returns its second operand when either is NaN.
  static inline V absmax(V x, V m) {
    return _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), m);
  }
  static inline float hmax(V x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
};

#include "kernel_impl.h"

}  // namespace avx2

const KernelTable<float>& avx2_float_kernels() { return avx2::table("avx2"); }

}  // namespace seq2seq_fast

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // x86-64
