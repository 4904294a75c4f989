// AVX-512 (F + DQ) float kernels. Compiled with a target pragma after every system header, and
// only called after the CPU reported AVX-512 at run time (csrc/runtime.cpp).
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "tanh_coeffs.h"

#if SEQ2SEQ_FAST_X86_SIMD
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma")
#endif

namespace seq2seq_fast {
namespace avx512 {

struct S {
  using T = float;
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int QB = 4;  // 4 queries x 4 keys: 16 accumulators + 8 operands in 32 registers
  static constexpr int KB = 4;
  static constexpr int KB1 = 8;  // one query: 1 x 8 (8 accumulators)
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  // bfloat16: widen to 32 bits and shift into the high half (exact).
  static inline V load(const Bf16* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i w = _mm512_cvtepu16_epi32(half);
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // Round to nearest even (add 0x7FFF plus the kept lowest bit, keep the high half); NaN -> 0x7FC0.
  static inline void store(Bf16* p, V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  // 14-bit estimate + one Newton step: relative error < 2^-23 + rounding.
  static inline V rcp(V d) {
    const V r = _mm512_rcp14_ps(d);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
  }
  static inline float hsum(V x) { return _mm512_reduce_add_ps(x); }
  // min(x, hi), NaN kept: min returns its second operand when either is NaN.
  static inline V cap(V x, V hi) { return _mm512_min_ps(hi, x); }
  // Clamp keeping NaN: max/min return their second operand when either is NaN.
  static inline V clamp(V x, float lo, float hi) {
    return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x));
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
  // 2^t = 2^floor(t) p(t - floor(t)): vreduceps gives t - floor(t) (0 for +-inf, NaN for NaN),
  // vscalefps multiplies by 2^floor(t) (inf for t = inf, 0 for -inf; NaN stays NaN).
  static inline V exp2_lowp(V t) {
    const V f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    V p = fma(set1(float(S2S_EXP2_C3)), f, set1(float(S2S_EXP2_C2)));
    p = fma(p, f, set1(float(S2S_EXP2_C1)));
    p = fma(p, f, set1(float(S2S_EXP2_C0)));
    return _mm512_scalef_ps(p, t);
  }
  // The 14-bit estimate alone (1 / inf = 0, no Newton step to turn it into NaN).
  static inline V rcp_lowp(V d) { return _mm512_rcp14_ps(d); }
  // exp(x) below -104 (under half the smallest denormal) is 0, -inf included.
  static inline V exp(V x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, set1(-104.0f), _CMP_LT_OQ);  // not NaN
    return _mm512_maskz_mov_ps(__mmask16(~under), exp_clamped(x));
  }
  static inline V exp_clamped(V x) {
    x = clamp(x, -104.0f, 88.7f);  // keeps NaN; scalef handles results down to the denormals
    const V n = _mm512_roundscale_ps(mul(x, set1(float(S2S_LOG2E))),
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
    return _mm512_scalef_ps(p, n);
  }
  // max(|x|, m), NaN ignored: max returns its second operand when either is NaN.
  static inline V absmax(V x, V m) { return _mm512_max_ps(_mm512_abs_ps(x), m); }
  static inline float hmax(V x) { return _mm512_reduce_max_ps(x); }
};

#include "kernel_impl.h"

}  // namespace avx512

const KernelTable<float>& avx512_float_kernels() { return avx512::table("avx512"); }

}  // namespace seq2seq_fast

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // x86-64
