// Scalar numerics every backend shares, for host and device code (nvcc compiles them for both):
// the gate floor, the in-kernel gate and its derivatives, the in-kernel l2norm factor.
//
// Gate floor. The documented domain is g <= 0, and g = -inf is a hard reset (exp(g) = 0: the
// state is forgotten). The chunked algorithm forms in-chunk cumulative sums c_i = g_1 + .. + g_i
// and differences c_i - c_j: with an infinite g those are -inf - (-inf) = NaN. Every kernel
// therefore uses
//     g_eff = g < -128 ? -128 : g
// after the gate is formed (the raw g, or the in-kernel gate) and before the cumulative sum.
// exp(-128) ~ 2.6e-56 is 0 in float32 (the smallest subnormal is ~1.4e-45 = exp(-103.3)), and
// so is every exp(c_i - c_j) across a floored token: a gate below -128 is an exact reset for
// every float32 computation. The cost: the cumulative sums stay finite but grow by 128 per
// floored token, so after r floored tokens in a chunk a float32 sum rounds each later addition
// at ulp(128 r) (1.5e-5 for r = 1) instead of at the scale of the ordinary gates: an exponent
// c_i - c_j of two later tokens is off by at most ulp(128 r) / 2 per token between them (the
// CPU backend sums in double and loses nothing).
// The floor's derivative is 0 below -128, which is also the exact gradient of a reset
// (dg = <dS~, S~> = exp(g) <dS~, S_prev> = 0). NaN stays NaN (no fmaxf, which drops NaN).
//
// In-kernel gate: g = -exp(A_log) softplus(x), x = a + dt_bias, with softplus(x) = log1p(exp(x))
// for x <= 20 and x above (torch's threshold). In float32 exp(A_log) overflows for A_log > 88.7
// and softplus(x) underflows to 0 for x < -103: the product is then inf * 0 = NaN. Where a
// factor is not a normal float the gate is formed in log space instead,
//     g = -exp(A_log + log softplus(x)),
// which is -inf (then floored: a reset) or a tiny value (no decay) as the exact gate is.
//
// l2norm: r = 1 / sqrt(sum x^2 + 1e-6). The float32 sum of squares overflows for a finite row of
// norm above ~1.8e19 (r would be 0 and x r = 0). Such a row is summed again scaled by an exact
// power of two, s = 2^-ilogb(max |x|):  r = s / sqrt(sum (s x)^2)  (there eps / max|x|^2 <
// 1e-36 is below the rounding of a sum that is >= 1). r is then right for every finite row
// (a subnormal float, so with fewer significant bits, beyond norms of ~1e37).
#pragma once

#include <float.h>
#include <math.h>

#include "common/host_device.h"

#define FGDN_HD FGDN_HOST_DEVICE inline

namespace flashgdn {

// ---- gate floor ---------------------------------------------------------------------------------
constexpr float kGateFloor = -128.f;

// g_eff = max(g, -128), keeping NaN.
FGDN_HD float gate_floor(float g) { return g < kGateFloor ? kGateFloor : g; }
// Whether the floor replaced g (its derivative there is 0).
FGDN_HD bool gate_floored(float g) { return g < kGateFloor; }

// ---- in-kernel gate -----------------------------------------------------------------------------
constexpr float kSoftplusThreshold = 20.f;

FGDN_HD bool is_normal_finite(float x) { return x >= FLT_MIN && x <= FLT_MAX; }

// softplus(x) = log1p(exp(x)) for x <= 20, x above
FGDN_HD float softplus(float x) { return x <= kSoftplusThreshold ? log1pf(expf(x)) : x; }

// d softplus / dx = sigmoid(x) (1 above the threshold, matching the linear branch)
FGDN_HD float softplus_grad(float x) {
  return x <= kSoftplusThreshold ? 1.f / (1.f + expf(-x)) : 1.f;
}

// log softplus(x), finite wherever softplus(x) is positive. Below -20,
// log log1p(e^x) = x + log(1 - e^x / 2 + ..) = x - O(e^x) with e^x < 2.1e-9: x itself.
FGDN_HD float log_softplus(float x) {
  if (x > kSoftplusThreshold) return logf(x);
  if (x < -kSoftplusThreshold) return x;
  return logf(log1pf(expf(x)));
}

// log softplus'(x) = log sigmoid(x) = -log1p(exp(-x)) (0 above the threshold).
FGDN_HD float log_softplus_grad(float x) {
  if (x > kSoftplusThreshold) return 0.f;
  return x < 0.f ? x - log1pf(expf(x)) : -log1pf(expf(-x));
}

// -exp(A_log) * f(x) with f(x) = exp(log_f): the product where both factors are normal floats
// (one rounding each), else in log space (no inf * 0).
FGDN_HD float neg_exp_times(float A_log, float f, float log_f) {
  const float A = expf(A_log);
  if (is_normal_finite(A) && is_normal_finite(f)) return -(A * f);
  return -expf(A_log + log_f);
}

// g = -exp(A_log) softplus(x), x = a + dt_bias (not floored).
FGDN_HD float gate_from_activation(float x, float A_log) {
  return neg_exp_times(A_log, softplus(x), log_softplus(x));
}

// Chain rule through the in-kernel gate, given dg = dL/dg at g = gate_from_activation(x, A_log)
// (dg = 0 for a floored token: the floor's derivative is 0):
//   dx = dg (-exp(A_log) sigmoid(x))   (= da = the token's share of d dt_bias)
//   dA_log = dg g
// A zero dg gives zeros even where exp(A_log) is infinite (no 0 * inf). For a token that is not
// floored, |exp(A_log) sigmoid(x)| <= |g| <= 128 (sigmoid <= softplus), so a finite dg gives
// finite results.
struct GateGrad {
  float dx;
  float dA_log;
};
FGDN_HD GateGrad gate_activation_backward(float dg, float x, float A_log, float g) {
  if (dg == 0.f) return GateGrad{0.f, 0.f};
  return GateGrad{dg * neg_exp_times(A_log, softplus_grad(x), log_softplus_grad(x)), dg * g};
}

// ---- in-kernel l2norm ---------------------------------------------------------------------------
constexpr float kL2NormEps = 1e-6f;

// r = 1 / sqrt(sum x^2 + 1e-6) of a row, given ss = its float32 sum of squares, and (called only
// when ss overflowed) max_abs() = max |x_i| and sum_sq_scaled(s) = sum (s x_i)^2 in float32.
template <class MaxAbs, class SumSqScaled>
FGDN_HD float l2norm_rnorm(float ss, MaxAbs max_abs, SumSqScaled sum_sq_scaled) {
  if (!(ss > FLT_MAX)) return 1.f / sqrtf(ss + kL2NormEps);  // finite (or NaN: stays NaN)
  const float m = max_abs();
  if (!(m <= FLT_MAX)) return 0.f;  // an infinite element (or NaN): 1 / sqrt(inf), as unscaled
  const float s = ldexpf(1.f, -ilogbf(m));  // m s in [1, 2); exact for every element
  return s / sqrtf(sum_sq_scaled(s));
}

}  // namespace flashgdn
