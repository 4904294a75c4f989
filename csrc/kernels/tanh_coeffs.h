// Coefficients shared by every instruction set (no includes; see kernel_impl.h).
//
// Rational tanh: tanh(x) ~ x P(x^2) / Q(x^2) on |x| <= 9 (x clamped there; tanh(9) = 1 - 3e-8),
// P, Q of degree 4 in x^2 with P(0) = Q(0) = 1, fitted to the minimax error (IRLS on a dense grid).
// Q has only negative real roots in x^2, so it is >= 1 on the whole range.
// Approximation error 2.1e-8 (float64 evaluation). Evaluated in float32 with FMA and a
// Newton-refined reciprocal, the max |error| against tanh over a dense grid of every float32
// magnitude (step 2^-12 up to 16, log-spaced beyond, +-inf) is 3.0e-7 (AVX-512), 3.1e-7 (AVX2),
// 3.4e-7 (portable); tests/test_ops.py::test_tanh_error_bound asserts < 1e-6 on every path.
// The product path tanh(a + b) = 1 - 2 / (1 + e^{2a} e^{2b}) (kernels.h) measures <= 3.2e-7 over
// |a|, |b| <= 40, including sums that cancel.
#pragma once
#define S2S_TANH_CLAMP 9.0
#define S2S_TANH_P1 1.3380410314e-01
#define S2S_TANH_P2 3.4948673939e-03
#define S2S_TANH_P3 2.0597828085e-05
#define S2S_TANH_P4 1.3340374174e-08
#define S2S_TANH_Q1 4.6713727780e-01
#define S2S_TANH_Q2 2.5874209747e-02
#define S2S_TANH_Q3 3.2844807611e-04
#define S2S_TANH_Q4 7.7704278303e-07
// exp(x) = 2^n e^r, n = round(x / ln 2), r = x - n ln2 (Cody-Waite split), |r| <= 0.347,
// e^r by its degree-7 Taylor polynomial (truncation 5e-9 relative): about 2 ulp in float32.
#define S2S_LOG2E 1.44269504088896341
#define S2S_LN2_HI 0.693359375
#define S2S_LN2_LO -2.12194440e-4
// kProductBf16 (kernels.h): 2^f on [0, 1) by a degree-3 polynomial fitted to the minimax relative
// error (IRLS on a dense grid): 7.6e-5 relative. With 2^t = 2^floor(t) 2^f and a 14-bit
// reciprocal (no Newton step), tanh(x) = 1 - 2 / (1 + 2^t), t = 2 log2(e) x, errs by at most
// 1.0e-4 absolute (AVX-512; tests/ops/test_ops.py::test_tanh_error_bound asserts < 2e-4 on every
// path): under the effect of the bfloat16 inputs' 2^-9 relative rounding (2^-9 |x| sech^2 x) for
// |x| >~ 0.05, not nearer 0, where tanh(x) ~ x is smaller than the error's scale.
#define S2S_TWO_LOG2E 2.88539008177792681
#define S2S_EXP2_C0 9.999247252633797e-01
#define S2S_EXP2_C1 6.958362130003172e-01
#define S2S_EXP2_C2 2.2606560260642106e-01
#define S2S_EXP2_C3 7.802290634598685e-02
