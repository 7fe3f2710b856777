// Backward, step 5: through the WY representation (parallel over chunks).
//
// U = T diag(beta) V and W = T diag(beta exp(c)) Kn with T = (I + A)^-1,
// A = strict_lower(diag(beta) Kn Kn^T (.) D). Given dU = dV_new and dW (from step 4):
//   X = T^T dU:  dv = diag(beta) X,                 dbeta += rowsum(V (.) X)
//   Y = T^T dW:  dk += diag(beta exp(c)) Y,         dbeta += rowsum(exp(c) Kn (.) Y),
//                dc += rowsum(beta exp(c) Kn (.) Y)
//   dT = dU (diag(beta) V)^T + dW (diag(beta exp(c)) Kn)^T ;  dA = -T^T dT T^T (strict lower)
//   G = dA (.) D,  E = diag(beta) G,  KK = Kn Kn^T:
//                dbeta += rowsum(G (.) KK),  dk += E Kn + E^T Kn,
//                dc += rowsum(E (.) KK) - colsum(E (.) KK)
// dv and dbeta are final here and go to the outputs; dk and dc are accumulated in workspace.
#include "cuda/chunk_bwd_internal.cuh"

namespace flashgdn::cuda::bwd {

namespace {

template <int D>
constexpr size_t wy_smem_bytes() {
  return sizeof(float) * (3 * kC * kLd + kC * (D + 1) + 5 * kC);
}

template <int D, typename TQ>
__global__ void __launch_bounds__(kThreads) wy_kernel(BwdParams P) {
  ChunkUnit u;
  if (!locate_unit(P, u)) return;
  const ChunkInfo ci = u.ci;  // copies: the lambdas below capture them
  const int64_t h = u.h, hq = u.hq, r = u.r, ls = u.ls;
  const int len = u.len;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int kLx = D + 1;

  extern __shared__ float smem[];
  float* s_T = smem;                 // [64][65]
  float* s_G = s_T + kC * kLd;       // dT, then G / E
  float* s_M = s_G + kC * kLd;       // T dT^T product, then KK
  float* s_X = s_M + kC * kLd;       // [64][D + 1]: X, then Y
  float* s_c = s_X + kC * kLx;
  float* s_ec = s_c + kC;
  float* s_beta = s_ec + kC;
  float* s_db = s_beta + kC;
  float* s_dc = s_db + kC;

  if (tid < kC) {
    s_c[tid] = P.cg[r * kC + tid];
    s_ec[tid] = expf(s_c[tid]);
    float b = 0.f;
    if (tid < len) {
      const int64_t ob = ci.b * P.beta.s0 + (ci.t0 + tid) * P.beta.s1 + h * P.beta.s2;
      b = load_as_float(P.beta.data, P.beta_dtype, ob);
    }
    s_beta[tid] = b;
  }
  const float* Tg = P.Tm + r * kC * kC;
  for (int e = tid; e < kC * kC; e += kThreads) s_T[(e / kC) * kLd + (e % kC)] = Tg[e];
  __syncthreads();

  const int64_t lds = P.Hq * D;
  const float* kn = P.kn + qk_row(P, ls, 0, hq) * D;
  const TQ* vg = static_cast<const TQ*>(P.v.data) + tok_off(P.v, ci.b, ci.t0, h);
  const float* dvg = P.dvn + r * kC * D;
  const float* dWg = P.W + r * kC * D;
  float* dkg = P.dkh + r * kC * D;

  // X = T^T dU
  block_gemm<kC, D, kC>(
      [&](int i, int j) { return s_T[j * kLd + i]; },
      [&](int j, int v) { return dvg[j * D + v]; },
      [&](int i, int v, float x) { s_X[i * kLx + v] = x; });
  __syncthreads();
  TQ* dvo = static_cast<TQ*>(P.dv.data) + tok_off(P.dv, ci.b, ci.t0, h);
  for (int i = warp; i < len; i += kThreads / 32) {
    float x = 0.f;
    for (int v = lane; v < D; v += 32) {
      const float xv = s_X[i * kLx + v];
      dvo[i * P.dv.s1 + v] = from_float<TQ>(s_beta[i] * xv);
      x += to_float(vg[i * P.v.s1 + v]) * xv;
    }
    x = warp_sum(x);
    if (lane == 0) s_db[i] = x;
  }
  __syncthreads();
  // Y = T^T dW
  block_gemm<kC, D, kC>(
      [&](int i, int j) { return s_T[j * kLd + i]; },
      [&](int j, int a) { return dWg[j * D + a]; },
      [&](int i, int a, float x) { s_X[i * kLx + a] = x; });
  // dT = dU (beta V)^T + dW (beta exp(c) Kn)^T   (concatenated reduction axis [V ; K])
  block_gemm<kC, kC, 2 * D>(
      [&](int i, int kk) { return kk < D ? dvg[i * D + kk] : dWg[i * D + (kk - D)]; },
      [&](int kk, int j) {
        if (kk < D) return j < len ? s_beta[j] * to_float(vg[j * P.v.s1 + kk]) : 0.f;
        return s_beta[j] * s_ec[j] * kn[j * lds + (kk - D)];
      },
      [&](int i, int j, float x) { s_G[i * kLd + j] = x; });
  __syncthreads();
  for (int i = warp; i < kC; i += kThreads / 32) {
    float x = 0.f;
    const float f = s_beta[i] * s_ec[i];
    for (int a = lane; a < D; a += 32) {
      const float y = s_X[i * kLx + a];
      const float kv = kn[i * lds + a];
      x += kv * y;
      dkg[i * D + a] += f * y;
    }
    x = warp_sum(x);
    if (lane == 0) {
      s_db[i] = (i < len ? s_db[i] : 0.f) + s_ec[i] * x;
      s_dc[i] = f * x;
    }
  }
  // M = dT T^T
  block_gemm<kC, kC, kC>(
      [&](int i, int kk) { return s_G[i * kLd + kk]; },
      [&](int kk, int j) { return s_T[j * kLd + kk]; },
      [&](int i, int j, float x) { s_M[i * kLd + j] = x; });
  __syncthreads();
  // G = (-T^T M) (.) D, strictly lower
  block_gemm<kC, kC, kC>(
      [&](int i, int kk) { return s_T[kk * kLd + i]; },
      [&](int kk, int j) { return s_M[kk * kLd + j]; },
      [&](int i, int j, float x) {
        s_G[i * kLd + j] = (i > j && i < len) ? -x * expf(s_c[i] - s_c[j]) : 0.f;
      });
  __syncthreads();
  // KK = Kn Kn^T
  block_gemm<kC, kC, D>(
      [&](int i, int kk) { return kn[i * lds + kk]; },
      [&](int kk, int j) { return kn[j * lds + kk]; },
      [&](int i, int j, float x) { s_M[i * kLd + j] = x; });
  __syncthreads();
  if (tid < kC) {
    const int i = tid;
    float db = 0.f, rowE = 0.f, colE = 0.f;
    for (int j = 0; j < kC; ++j) {
      const float gk = s_G[i * kLd + j] * s_M[i * kLd + j];
      db += gk;
      rowE += s_beta[i] * gk;
      colE += s_beta[j] * s_G[j * kLd + i] * s_M[j * kLd + i];
    }
    s_db[i] += db;
    s_dc[i] += rowE - colE;
  }
  __syncthreads();
  for (int e = tid; e < kC * kC; e += kThreads) {
    const int i = e / kC, j = e % kC;
    s_G[i * kLd + j] *= s_beta[i];
  }
  __syncthreads();
  // dk += E Kn + E^T Kn
  block_gemm<kC, D, 2 * kC>(
      [&](int i, int kk) { return kk < kC ? s_G[i * kLd + kk] : s_G[(kk - kC) * kLd + i]; },
      [&](int kk, int a) { return kn[(kk & (kC - 1)) * lds + a]; },
      [&](int i, int a, float x) { dkg[i * D + a] += x; });
  if (tid < kC) {
    const int i = tid;
    if (i < len) {
      const int64_t ob = ci.b * P.dbeta.s0 + (ci.t0 + i) * P.dbeta.s1 + h * P.dbeta.s2;
      store_from_float(P.dbeta.data, P.beta_dtype, ob, s_db[i]);
    }
    P.dc[r * kC + i] += i < len ? s_dc[i] : 0.f;
  }
}

template <int D, typename TQ>
void launch_typed(DimType<D, TQ>, const BwdParams& P, cudaStream_t s) {
  constexpr size_t smem = wy_smem_bytes<D>();
  FGDN_CUDA_CHECK(cudaFuncSetAttribute(wy_kernel<D, TQ>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  wy_kernel<D, TQ><<<dim3(P.slots, P.Hv), kThreads, smem, s>>>(P);
  FGDN_CHECK_LAUNCH("bwd wy");
}

}  // namespace

void launch_bwd_wy(const BwdParams& P, cudaStream_t s) {
  dispatch_dim_type(P, [&](auto c) { launch_typed(c, P, s); });
}

}  // namespace flashgdn::cuda::bwd
