// Portable kernels (any CPU, any compiler flags): float with the same rational tanh and Newton
// reciprocal semantics as the SIMD paths, double with std::tanh / std::exp and exact division.
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "tanh_coeffs.h"

namespace seq2seq_fast {

namespace portable_common {
template <typename Tp>
struct Scalar {
  using T = Tp;
  using V = Tp;
  static constexpr int W = 1;
  static constexpr int QB = 2;
  static constexpr int KB = 4;
  static constexpr int KB1 = 4;
  static inline V load(const T* p) { return *p; }
  static inline void store(T* p, V x) { *p = x; }
  static inline V load(const Bf16* p) { return T(bf16_to_float(*p)); }
  static inline void store(Bf16* p, V x) { *p = float_to_bf16(float(x)); }
  static inline V set1(T x) { return x; }
  static inline V zero() { return T(0); }
  static inline V add(V a, V b) { return a + b; }
  static inline V mul(V a, V b) { return a * b; }
  static inline V fma(V a, V b, V c) { return a * b + c; }
  static inline V fnma(V a, V b, V c) { return c - a * b; }
  static inline V rcp(V d) { return T(1) / d; }
  static inline V cap(V x, V hi) { return x > hi ? hi : x; }  // NaN compares false: stays NaN
  static inline T hsum(V x) { return x; }
  static inline V absmax(V x, V m) {  // NaN compares false and does not count
    const T ax = x < T(0) ? -x : x;
    return ax > m ? ax : m;
  }
  static inline T hmax(V x) { return x; }
  static inline V exp(V x) { return std::exp(x); }
  // 2^t = 2^n p(t - n), n = floor(t), t clamped to [-127, 127]; NaN stays NaN.
  static inline V exp2_lowp(V t) {
    if (t != t) return t;
    t = t < T(-127) ? T(-127) : (t > T(127) ? T(127) : t);
    const T n = std::floor(t);
    const T f = t - n;
    const T p = ((T(S2S_EXP2_C3) * f + T(S2S_EXP2_C2)) * f + T(S2S_EXP2_C1)) * f + T(S2S_EXP2_C0);
    return std::ldexp(p, int(n));
  }
  static inline V rcp_lowp(V d) { return T(1) / d; }
};
}  // namespace portable_common

namespace portable_f32 {
struct S : portable_common::Scalar<float> {
  static inline float tanh(float x) {
    const float c = float(S2S_TANH_CLAMP);
    x = x < -c ? -c : (x > c ? c : x);  // NaN compares false and stays NaN
    const float x2 = x * x;
    const float p = (((float(S2S_TANH_P4) * x2 + float(S2S_TANH_P3)) * x2 + float(S2S_TANH_P2)) * x2 +
                     float(S2S_TANH_P1)) * x2 + 1.0f;
    const float q = (((float(S2S_TANH_Q4) * x2 + float(S2S_TANH_Q3)) * x2 + float(S2S_TANH_Q2)) * x2 +
                     float(S2S_TANH_Q1)) * x2 + 1.0f;
    return x * p / q;
  }
};
#include "kernel_impl.h"
}  // namespace portable_f32

namespace portable_f64 {
struct S : portable_common::Scalar<double> {
  static inline double tanh(double x) { return std::tanh(x); }
};
#include "kernel_impl.h"
}  // namespace portable_f64

const KernelTable<float>& portable_float_kernels() { return portable_f32::table("portable"); }
const KernelTable<double>& portable_double_kernels() { return portable_f64::table("portable"); }

}  // namespace seq2seq_fast
