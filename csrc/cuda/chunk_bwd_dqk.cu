// Backward, step 4: per-chunk gradients of the output and state terms (parallel over chunks).
//
// With dPD = scale lower(dO V_new^T) (.) D (diagonal included), S0 = h[chunk], dS = dh[chunk]:
//   dq  = scale diag(exp(c)) dO S0^T + dPD Kn
//   dk  = (V_new dS^T) (.) exp(c_L - c) + dPD^T Qn       (per value head; WY part added later)
//   dW  = -dV_new S0^T                                   (overwrites W)
//   dc_i = Qn_i . dq_inter_i - Kn_i . dk_inter_i + sum_{j<i} L_ij - sum_{j>i} L_ji
//          + [i = L - 1] (exp(c_L) <dS, S0> + sum_j Kn_j . dk_inter_j),  L = dPD (.) Qn Kn^T
// The pair terms are added to dc_i and subtracted from dc_j with the same fp32 value (the
// diagonal left out), so that they cancel in the reverse cumulative sum of dg to rounding.
// (the gradient w.r.t. the in-chunk cumulative gate c of the output and state terms).
#include "cuda/chunk_bwd_internal.cuh"

namespace flashgdn::cuda::bwd {

namespace {

// Three CTAs an SM (80 registers): at the default bound ptxas took D = 64 to 64 registers and
// spilled (bench/results/sass/README.md, step 13).
template <int D, typename TQ>
__global__ void __launch_bounds__(kThreads, 3) dqk_kernel(BwdParams P) {
  ChunkUnit u;
  if (!locate_unit(P, u)) return;
  const ChunkInfo ci = u.ci;  // copies: the lambdas below capture them
  const int64_t h = u.h, hq = u.hq, r = u.r, ls = u.ls, state_row = u.state_row;
  const int len = u.len;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  __shared__ float s_c[kC], s_q[kC], s_e[kC], s_kdot[kC], s_qdot[kC], s_pair[kC];
  __shared__ float s_red[kThreads / 32];
  __shared__ float s_dP[kC * kLd];
  __shared__ float s_QK[kC * kLd];

  if (tid < kC) s_c[tid] = P.cg[r * kC + tid];
  __syncthreads();
  const float cL = s_c[len - 1];
  if (tid < kC) {
    s_q[tid] = tid < len ? P.scale * expf(s_c[tid]) : 0.f;
    s_e[tid] = tid < len ? expf(cL - s_c[tid]) : 0.f;
  }
  __syncthreads();

  const int64_t lds = P.Hq * D;
  const float* kn = P.kn + qk_row(P, ls, 0, hq) * D;
  const float* qn = P.qn + qk_row(P, ls, 0, hq) * D;
  const TQ* dog = static_cast<const TQ*>(P.d_o.data) + tok_off(P.d_o, ci.b, ci.t0, h);
  const float* vng = P.vn + r * kC * D;
  const float* dvg = P.dvn + r * kC * D;
  const float* hg = P.h + state_row * D * D;
  const float* dhg = P.dh + r * D * D;
  float* dqg = P.dqh + r * kC * D;
  float* dkg = P.dkh + r * kC * D;
  float* dWg = P.W + r * kC * D;

  // dPD
  block_gemm<kC, kC, D>(
      [&](int i, int v) { return i < len ? to_float(dog[i * P.d_o.s1 + v]) : 0.f; },
      [&](int v, int j) { return vng[j * D + v]; },
      [&](int i, int j, float x) {
        s_dP[i * kLd + j] = (j <= i && i < len) ? P.scale * expf(s_c[i] - s_c[j]) * x : 0.f;
      });
  __syncthreads();
  // QK = Qn Kn^T (for the pair terms of dc)
  block_gemm<kC, kC, D>(
      [&](int i, int kk) { return qn[i * lds + kk]; },
      [&](int kk, int j) { return kn[j * lds + kk]; },
      [&](int i, int j, float x) { s_QK[i * kLd + j] = x; });
  // dq (inter) = diag(scale exp(c)) dO S0^T
  block_gemm<kC, D, D>(
      [&](int i, int v) { return i < len ? s_q[i] * to_float(dog[i * P.d_o.s1 + v]) : 0.f; },
      [&](int v, int a) { return hg[a * D + v]; },
      [&](int i, int a, float x) { dqg[i * D + a] = x; });
  // dk (inter) = diag(exp(c_L - c)) V_new dS^T
  block_gemm<kC, D, D>(
      [&](int j, int v) { return vng[j * D + v]; },
      [&](int v, int a) { return dhg[a * D + v]; },
      [&](int j, int a, float x) { dkg[j * D + a] = s_e[j] * x; });
  __syncthreads();
  for (int i = warp; i < kC; i += kThreads / 32) {  // Qn_i . dq_inter_i, Kn_i . dk_inter_i
    float x = 0.f, y = 0.f;
    for (int a = lane; a < D; a += 32) {
      x += qn[i * lds + a] * dqg[i * D + a];
      y += kn[i * lds + a] * dkg[i * D + a];
    }
    x = warp_sum(x);
    y = warp_sum(y);
    if (lane == 0) s_qdot[i] = x, s_kdot[i] = y;
  }
  if (tid < kC) {  // pair terms L_ij = dPD_ij QK_ij: +L to dc_i, -L to dc_j (diagonal left out)
    const int i = tid;
    float row = 0.f, col = 0.f;
    for (int j = 0; j < i; ++j) row += s_dP[i * kLd + j] * s_QK[i * kLd + j];
    for (int j = i + 1; j < kC; ++j) col += s_dP[j * kLd + i] * s_QK[j * kLd + i];
    s_pair[i] = row - col;
  }
  __syncthreads();
  // dq += dPD Kn
  block_gemm<kC, D, kC>(
      [&](int i, int j) { return s_dP[i * kLd + j]; },
      [&](int j, int a) { return kn[j * lds + a]; },
      [&](int i, int a, float x) { dqg[i * D + a] += x; });
  // dk += dPD^T Qn
  block_gemm<kC, D, kC>(
      [&](int j, int i) { return s_dP[i * kLd + j]; },
      [&](int i, int a) { return qn[i * lds + a]; },
      [&](int j, int a, float x) { dkg[j * D + a] += x; });
  // dW = -dV_new S0^T
  block_gemm<kC, D, D>(
      [&](int i, int v) { return dvg[i * D + v]; },
      [&](int v, int a) { return hg[a * D + v]; },
      [&](int i, int a, float x) { dWg[i * D + a] = -x; });
  // <dS, S0>, fixed order: thread-strided partial sums, then the warps' sums in order
  float fr = 0.f;
  for (int e = tid; e < D * D; e += kThreads) fr += dhg[e] * hg[e];
  fr = warp_sum(fr);
  if (lane == 0) s_red[warp] = fr;
  __syncthreads();
  float* dcg = P.dc + r * kC;
  if (tid < kC) {
    const int i = tid;
    float x = s_qdot[i] - s_kdot[i] + s_pair[i];
    if (i == len - 1) {
      float frob = 0.f, kd = 0.f;
      for (int w = 0; w < kThreads / 32; ++w) frob += s_red[w];
      for (int jj = 0; jj < len - 1; ++jj) kd += s_kdot[jj];
      x = s_qdot[i] + s_pair[i] + expf(cL) * frob + kd;  // Kf_L = k_L: its two terms cancel
    }
    dcg[i] = i < len ? x : 0.f;
  }
}

template <int D, typename TQ>
void launch_typed(DimType<D, TQ>, const BwdParams& P, cudaStream_t s) {
  dqk_kernel<D, TQ><<<dim3(P.slots, P.Hv), kThreads, 0, s>>>(P);
  FGDN_CHECK_LAUNCH("bwd dqk");
}

}  // namespace

void launch_bwd_dqk(const BwdParams& P, cudaStream_t s) {
  dispatch_dim_type(P, [&](auto c) { launch_typed(c, P, s); });
}

}  // namespace flashgdn::cuda::bwd
