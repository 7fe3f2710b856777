// Backward, step 1: per-chunk preparation (parallel over chunks and heads).
//
//  qk_prep:    qn = q / ||q|| (or q), kn likewise, fp32, in slot layout; rq, rk = 1 / ||x|| (always).
//  chunk_prep: c (in-chunk cumulative sum of the gates floored at -128, common/numerics.h),
//              A = strict_lower(diag(beta) Kn Kn^T (.) D), T = (I + A)^-1 (fp32 forward
//              substitution), W = T diag(beta exp(c)) Kn,
//              V_new = U - W h with U = T diag(beta) V and h the chunk-start state (step 1),
//              the local part of dV_new: dvl = P^T dO with P = scale lower(Qn Kn^T (.) D)
//              (into dvn), and the reverse pass's operand images K~, QW, dO^T
//              (chunk_bwd_images.cuh), built in shared memory and shipped by bulk copies.
#include "cuda/chunk_bwd_images.cuh"
#include "cuda/chunk_bwd_internal.cuh"

namespace flashgdn::cuda::bwd {

namespace {

template <int D, typename TQ>
__global__ void __launch_bounds__(kThreads) qk_prep_kernel(BwdParams P) {
  const int64_t ls = blockIdx.x;  // the block's local slot (chunk_bwd_internal.cuh)
  const int64_t hq = blockIdx.y;
  ChunkInfo ci;
  const bool valid = locate_chunk(P.seq, P.slot0 + ls, ci);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const TQ* q = static_cast<const TQ*>(P.q.data);
  const TQ* k = static_cast<const TQ*>(P.k.data);
  for (int i = warp; i < kC; i += kThreads / 32) {
    const int64_t row = qk_row(P, ls, i, hq);
    float* qo = P.qn + row * D;
    float* ko = P.kn + row * D;
    if (!valid || i >= ci.len) {
      for (int d = lane; d < D; d += 32) qo[d] = 0.f, ko[d] = 0.f;
      continue;
    }
    const TQ* qi = q + tok_off(P.q, ci.b, ci.t0 + i, hq);
    const TQ* ki = k + tok_off(P.k, ci.b, ci.t0 + i, hq);
    float xq[D / 32], xk[D / 32];
#pragma unroll
    for (int u = 0; u < D / 32; ++u) {
      xq[u] = to_float(qi[lane + 32 * u]);
      xk[u] = to_float(ki[lane + 32 * u]);
    }
    // 1 / ||x|| always (the dh pass's certificate reads ||k|| without the in-kernel norm too);
    // applied only with it.
    const float r_q = warp_l2norm_rnorm(xq), r_k = warp_l2norm_rnorm(xk);
    if (lane == 0) P.rq[row] = r_q, P.rk[row] = r_k;
    const float s_q = P.l2norm ? r_q : 1.f, s_k = P.l2norm ? r_k : 1.f;
#pragma unroll
    for (int u = 0; u < D / 32; ++u) {
      qo[lane + 32 * u] = xq[u] * s_q;
      ko[lane + 32 * u] = xk[u] * s_k;
    }
  }
}

template <int D, typename TQ>
__global__ void __launch_bounds__(kThreads, 2) chunk_prep_kernel(BwdParams P) {
  ChunkUnit u;
  if (!locate_unit(P, u)) return;
  const ChunkInfo ci = u.ci;  // copies: the lambdas below capture them
  const int64_t h = u.h, hq = u.hq, r = u.r, ls = u.ls, state_row = u.state_row;
  const int len = u.len;

  __shared__ float s_c[kC], s_ec[kC], s_beta[kC], s_ke[kC], s_qe[kC];
  __shared__ float s_A[kC * kLd];  // A, later P
  __shared__ float s_T[kC * kLd];

  const int tid = threadIdx.x;
  scan_chunk_gates(threadIdx.x < kC ? load_token_gate(P, ci, h, threadIdx.x) : TokenGate{}, s_c, s_beta);
  if (tid < kC) {
    s_ec[tid] = expf(s_c[tid]);
    P.cg[r * kC + tid] = s_c[tid];
  }
  __syncthreads();

  const float* kn = P.kn + qk_row(P, ls, 0, hq) * D;  // row i at kn[i * Hq * D]
  const float* qn = P.qn + qk_row(P, ls, 0, hq) * D;
  const int64_t lds = P.Hq * D;

  // A = strict_lower(diag(beta) Kn Kn^T (.) D)
  block_gemm<kC, kC, D>(
      [&](int i, int kk) { return kn[i * lds + kk]; },
      [&](int kk, int j) { return kn[j * lds + kk]; },
      [&](int i, int j, float v) {
        s_A[i * kLd + j] = (i > j) ? s_beta[i] * expf(s_c[i] - s_c[j]) * v : 0.f;
      });
  __syncthreads();
  // T = (I + A)^-1, one column per thread: x_i = delta_im - sum_{m <= j < i} A_ij x_j
  if (tid < kC) inverse_column(s_A, s_T, tid);
  __syncthreads();
  float* Tg = P.Tm + r * kC * kC;
  for (int e = tid; e < kC * kC; e += kThreads) Tg[e] = s_T[(e / kC) * kLd + (e % kC)];

  // W = T diag(beta exp(c)) Kn ;  U = T diag(beta) V
  float* Wg = P.W + r * kC * D;
  float* vng = P.vn + r * kC * D;
  block_gemm<kC, D, kC>(
      [&](int i, int j) { return s_T[i * kLd + j]; },
      [&](int j, int kk) { return s_beta[j] * s_ec[j] * kn[j * lds + kk]; },
      [&](int i, int kk, float v) { Wg[i * D + kk] = v; });
  const TQ* vg = static_cast<const TQ*>(P.v.data) + tok_off(P.v, ci.b, ci.t0, h);
  block_gemm<kC, D, kC>(
      [&](int i, int j) { return s_T[i * kLd + j]; },
      [&](int j, int vv) { return j < len ? s_beta[j] * to_float(vg[j * P.v.s1 + vv]) : 0.f; },
      [&](int i, int vv, float v) { vng[i * D + vv] = v; });
  // V_new = U - W h: block_gemm gives each thread the same (i, vv) elements of a 64 x D result
  // in both products, so each subtracts from what it wrote itself; the barrier makes W visible.
  __syncthreads();
  const float* hg = P.h + state_row * D * D;
  block_gemm<kC, D, D>(
      [&](int i, int a) { return Wg[i * D + a]; },
      [&](int a, int vv) { return hg[a * D + vv]; },
      [&](int i, int vv, float v) { vng[i * D + vv] -= v; });

  // P = scale lower(Qn Kn^T (.) D) (diagonal included), then dvl = P^T dO
  block_gemm<kC, kC, D>(
      [&](int i, int kk) { return qn[i * lds + kk]; },
      [&](int kk, int j) { return kn[j * lds + kk]; },
      [&](int i, int j, float v) {
        s_A[i * kLd + j] = (j <= i) ? P.scale * expf(s_c[i] - s_c[j]) * v : 0.f;
      });
  __syncthreads();
  const TQ* dog = static_cast<const TQ*>(P.d_o.data) + tok_off(P.d_o, ci.b, ci.t0, h);
  float* dvg = P.dvn + r * kC * D;
  block_gemm<kC, D, kC>(
      [&](int j, int i) { return s_A[i * kLd + j]; },
      [&](int i, int vv) { return i < len ? to_float(dog[i * P.d_o.s1 + vv]) : 0.f; },
      [&](int j, int vv, float v) { dvg[j * D + vv] = v; });

  // The reverse pass's operand images (chunk_bwd_images.cuh): K~, QW = [Q~ | -W]^T, dO^T.
  __syncthreads();  // W, written above by other threads
  if (tid < kC) {
    s_ke[tid] = tid < len ? expf(s_c[len - 1] - s_c[tid]) : 0.f;
    s_qe[tid] = tid < len ? P.scale * s_ec[tid] : 0.f;
  }
  __syncthreads();
  // Each image is built in a 32 KB shared buffer (two 16 KB parts, hi and lo) and leaves by a bulk
  // copy, so that the global writes are whole lines whatever order the values are read in.
  using Im = Images<D>;
  uint8_t* img = P.img + r * Im::kBytes;
  uint8_t* buf = &dynamic_smem_1024<uint8_t>();
  constexpr uint32_t kHalf = kImageStage / 2;
  const auto ship = [&](uint32_t dst_hi, uint32_t dst_lo, uint32_t bytes) {  // buf -> img, then reusable
    sm90::fence_proxy_async();
    __syncthreads();
    if (tid == 0) {
      sm90::bulk_store(img + dst_hi, buf, bytes);
      sm90::bulk_store(img + dst_lo, buf + kHalf, bytes);
      sm90::bulk_commit_group();
      sm90::bulk_wait_group_read<0>();
    }
    __syncthreads();
  };
  for (int p = tid; p < kC * D / 2; p += kThreads) {  // K~: rows t, pairs along a
    const int t = p / (D / 2), a = 2 * (p % (D / 2));
    put_image_pair(buf + (a / 64) * 64 * 128, kHalf, t, a % 64, s_ke[t] * kn[t * lds + a], s_ke[t] * kn[t * lds + a + 1]);
  }
  ship(Im::kK, Im::kK + Im::kKPart, Im::kKPart);
  for (int tile = 0; tile < 2; ++tile) {  // QW: rows a (consecutive threads), pairs along t
    for (int p = tid; p < D * kC / 2; p += kThreads) {
      const int a = p % D, t = 2 * (p / D);
      const float x0 = tile == 0 ? s_qe[t] * qn[t * lds + a] : -Wg[t * D + a];
      const float x1 = tile == 0 ? s_qe[t + 1] * qn[(t + 1) * lds + a] : -Wg[(t + 1) * D + a];
      put_image_pair(buf, kHalf, a, t, x0, x1);
    }
    ship(Im::kQW + tile * Im::kQWTile, Im::kQW + Im::kQWPart + tile * Im::kQWTile, Im::kQWTile);
  }
  for (int p = tid; p < D * kC / 2; p += kThreads) {  // dOt: rows v, pairs along t
    const int v = p % D, t = 2 * (p / D);
    const float x0 = t < len ? to_float(dog[t * P.d_o.s1 + v]) : 0.f;
    const float x1 = t + 1 < len ? to_float(dog[(t + 1) * P.d_o.s1 + v]) : 0.f;
    put_image_pair(buf, kHalf, v, t, x0, x1);
  }
  ship(Im::kO, Im::kO + Im::kOPart, Im::kOPart);
}

}  // namespace

void launch_bwd_qk_prep(const BwdParams& P, cudaStream_t s) {
  dispatch_dim_type(P, [&](auto c) {
    using C = decltype(c);
    qk_prep_kernel<C::D, typename C::TQ><<<dim3(P.slots, P.Hq), kThreads, 0, s>>>(P);
    FGDN_CHECK_LAUNCH("bwd qk_prep");
  });
}

void launch_bwd_prep(const BwdParams& P, cudaStream_t s) {
  launch_bwd_qk_prep(P, s);
  dispatch_dim_type(P, [&](auto c) {
    using C = decltype(c);
    launch_per_chunk(chunk_prep_kernel<C::D, typename C::TQ>, kThreads, kImageStage + 1024, P, s, "bwd chunk_prep");
  });
}

}  // namespace flashgdn::cuda::bwd
