// Per-chunk load and intra-chunk quantities shared by the CPU forward and backward
// (formulas in chunk_common.h).
#include "cpu/chunk_common.h"

#include <cmath>

#include "common/dtype.h"
#include "cpu/chunk_math.h"
#include "cpu/gate.h"

namespace flashgdn::cpu {

namespace {
constexpr int64_t C = kChunk;
inline size_t sz(int64_t n) { return static_cast<size_t>(n); }
}  // namespace

ChunkBuf::ChunkBuf(int64_t K_, int64_t V_)
    : K(K_), V(V_), q(sz(C * K_)), k(sz(C * K_)), v(sz(C * V_)), rq(sz(C)), rk(sz(C)), a(sz(C)), g(sz(C)),
      beta(sz(C)), c(sz(C)), e(sz(C)), f(sz(C)), D(sz(C * C)), KKt(sz(C * C)), Ab(sz(C * C)),
      Tm(sz(C * C)), M(sz(C * C)), X(sz(C * K_)), W(sz(C * K_)), Qe(sz(C * K_)),
      Kf(sz(C * K_)), Y(sz(C * V_)), U(sz(C * V_)), KT(sz(K_ * C)) {}

float load_qk_row(const void* base, fgdn_dtype dt, int64_t off, int64_t K, bool l2norm,
                  float* xhat) {
  load_row(base, dt, off, K, xhat);
  if (!l2norm) return 1.f;
  const float r = l2norm_rnorm(xhat, K);  // r = 1 / sqrt(sum x^2 + 1e-6)
  for (int64_t d = 0; d < K; ++d) xhat[d] *= r;
  return r;
}

void load_chunk(const Problem& p, const fgdn_inputs& in, const Pair& pr, int64_t tc, int64_t m,
                ChunkBuf& buf) {
  const int64_t K = buf.K, V = buf.V;
  buf.m = m;
  const float A_log = p.gate_in_kernel ? static_cast<const float*>(in.A_log.data)[pr.h] : 0.f;
  const float dt_bias =
      (p.gate_in_kernel && p.has_dt_bias) ? static_cast<const float*>(in.dt_bias.data)[pr.h] : 0.f;
  for (int64_t r = 0; r < m; ++r) {
    const int64_t t = pr.t0 + tc + r;
    buf.rq[sz(r)] = load_qk_row(in.q.data, p.qkv_dtype, tok_off(in.q, pr.b, t, pr.hq), K,
                                p.l2norm, &buf.q[sz(r * K)]);
    buf.rk[sz(r)] = load_qk_row(in.k.data, p.qkv_dtype, tok_off(in.k, pr.b, t, pr.hq), K,
                                p.l2norm, &buf.k[sz(r * K)]);
    load_row(in.v.data, p.qkv_dtype, tok_off(in.v, pr.b, t, pr.h), V, &buf.v[sz(r * V)]);
    const float raw = load_float(in.g.data, p.g_dtype, gate_off(in.g, pr.b, t, pr.h));
    buf.a[sz(r)] = raw;
    // g = -exp(A_log) * softplus(a + dt_bias) with gate_in_kernel, else the given g
    buf.g[sz(r)] = gate_of(raw, p.gate_in_kernel, A_log, dt_bias);
    buf.beta[sz(r)] = load_float(in.beta.data, p.beta_dtype, gate_off(in.beta, pr.b, t, pr.h));
  }
  // c_i = g_1 + ... + g_i (local to the chunk) of the floored gates max(g, -128), so that a
  // reset (g = -inf) keeps c finite (common/numerics.h); e_i = exp(c_i), f_i = exp(c_m - c_i)
  double acc = 0.0;
  for (int64_t r = 0; r < m; ++r) {
    acc += gate_floor(buf.g[sz(r)]);
    buf.c[sz(r)] = acc;
  }
  const double cm = m > 0 ? buf.c[sz(m - 1)] : 0.0;
  for (int64_t r = 0; r < m; ++r) {
    buf.e[sz(r)] = std::exp(static_cast<float>(buf.c[sz(r)]));
    buf.f[sz(r)] = std::exp(static_cast<float>(cm - buf.c[sz(r)]));
  }
  buf.gamma = std::exp(static_cast<float>(cm));
}

void chunk_intra(ChunkBuf& buf) {
  const int64_t K = buf.K, V = buf.V, m = buf.m;
  // K^T, then K K^T  [m x m]
  transpose(m, K, buf.k.data(), K, buf.KT.data(), C);
  gemm_nn(m, m, K, 1.f, buf.k.data(), K, buf.KT.data(), C, false, buf.KKt.data(), C);
  // D_ij = exp(c_i - c_j) for j <= i (0 above the diagonal)
  // Ab_ij = beta_i (k_i . k_j) D_ij for j < i
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      const float d = j <= i ? std::exp(static_cast<float>(buf.c[sz(i)] - buf.c[sz(j)])) : 0.f;
      buf.D[sz(i * C + j)] = d;
      buf.Ab[sz(i * C + j)] = j < i ? buf.beta[sz(i)] * buf.KKt[sz(i * C + j)] * d : 0.f;
    }
  }
  // Tm = (I + Ab)^{-1}
  unit_lower_inverse(m, buf.Ab.data(), C, buf.Tm.data(), C);
  // X = diag(beta) (K (.) e), Y = diag(beta) V, Qe = Q (.) e, Kf = K (.) f
  for (int64_t i = 0; i < m; ++i) {
    const float be = buf.beta[sz(i)] * buf.e[sz(i)];
    const float ei = buf.e[sz(i)], fi = buf.f[sz(i)], bi = buf.beta[sz(i)];
    for (int64_t d = 0; d < K; ++d) {
      const float kd = buf.k[sz(i * K + d)];
      buf.X[sz(i * K + d)] = be * kd;
      buf.Kf[sz(i * K + d)] = fi * kd;
      buf.Qe[sz(i * K + d)] = ei * buf.q[sz(i * K + d)];
    }
    for (int64_t d = 0; d < V; ++d) buf.Y[sz(i * V + d)] = bi * buf.v[sz(i * V + d)];
  }
  // W = Tm X, U = Tm Y
  gemm_nn(m, K, m, 1.f, buf.Tm.data(), C, buf.X.data(), K, false, buf.W.data(), K);
  gemm_nn(m, V, m, 1.f, buf.Tm.data(), C, buf.Y.data(), V, false, buf.U.data(), V);
  // M = lower((Q K^T) (.) D), diagonal included
  gemm_nn(m, m, K, 1.f, buf.q.data(), K, buf.KT.data(), C, false, buf.M.data(), C);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) buf.M[sz(i * C + j)] *= buf.D[sz(i * C + j)];
}

}  // namespace flashgdn::cpu
