// Per-token pre/post processing done inside the kernel, in float32 (the scalar formulas, shared
// with the CUDA backend, are in common/numerics.h):
//   l2norm:  x^ = x * r,  r = 1 / sqrt(sum x^2 + 1e-6)          (q and k, per token and q/k head)
//            dx = r * (dx^ - x^ (x^ . dx^))                      (its reverse mode)
//   gate:    g = -exp(A_log) * softplus(a + dt_bias), then the floor g_eff = max(g, -128)
//            da = dg * (-exp(A_log)) * sigmoid(a + dt_bias)  (1 instead of sigmoid for x > 20)
//            dA_log = dg * g,  ddt_bias = da;  dg = 0 where the floor applied
#pragma once

#include <cmath>
#include <cstdint>

#include "common/numerics.h"

namespace flashgdn::cpu {

// sum_i a_i b_i in a fixed order: 8 interleaved partial sums (lane i % 8), then combined
// pairwise; vectorisable and the same on every thread.
inline float dot8(const float* a, const float* b, int64_t n) {
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) s[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) s[l] += a[i] * b[i];
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

// r = 1 / sqrt(sum x^2 + eps), right for any finite row (rescaled where the sum overflows)
inline float l2norm_rnorm(const float* x, int64_t n) {
  return flashgdn::l2norm_rnorm(
      dot8(x, x, n),
      [&] {
        float m = 0.f;
        for (int64_t i = 0; i < n; ++i) m = std::fmax(m, std::fabs(x[i]));
        return m;
      },
      [&](float s) {
        float ss = 0.f;
        for (int64_t i = 0; i < n; ++i) ss += (s * x[i]) * (s * x[i]);
        return ss;
      });
}

// In place: dx <- r * (dx^ - x^ (x^ . dx^)) where xhat = x * r.
inline void l2norm_backward(const float* xhat, float r, float* dx, int64_t n) {
  const float dot = dot8(xhat, dx, n);
  for (int64_t i = 0; i < n; ++i) dx[i] = r * (dx[i] - xhat[i] * dot);
}

// The gate a token's recurrence uses: the given g, or -exp(A_log) softplus(a + dt_bias) with
// gate_in_kernel; not yet floored.
inline float gate_of(float raw, bool gate_in_kernel, float A_log, float dt_bias) {
  return gate_in_kernel ? gate_from_activation(raw + dt_bias, A_log) : raw;
}

}  // namespace flashgdn::cpu
