// Backward, per-chunk output and state terms on wgmma: the `fast` level's version of
// csrc/cuda/chunk_bwd_dqk.cu (same outputs, same formulas; `high` keeps that kernel's split
// products until this one has a split variant).
//
// With dPD = scale lower(dO V_new^T) (.) D (diagonal included), S0 = h[chunk], dS = dh[chunk]:
//   dq  = scale diag(exp(c)) dO S0^T + dPD Kn                      (warpgroup 0)
//   dk  = diag(exp(c_L - c)) V_new dS^T + dPD^T Qn                 (warpgroup 1)
//   dW  = -dV_new S0^T                                             (warpgroup 1, overwrites W)
//   dc_i = Qn_i . dq_inter_i - Kn_i . dk_inter_i + sum_{j<i} L_ij - sum_{j>i} L_ji
//          + [i = L - 1] (exp(c_L) <dS, S0> + sum_j Kn_j . dk_inter_j),  L = dPD (.) Qn Kn^T
//
// One block per (chunk, value head), two warpgroups. Every operand is staged once into shared
// memory as a 16-bit tile of the inputs' type (bwd_tiles.cuh), read from the workspace with
// 16-byte loads (the next piece's loads in flight while the current one is converted), and each
// product is a single 16-bit product with fp32 accumulation: the forward's `fast` policy. dPD
// and its transpose are two accumulators (an accumulator becomes an A operand in place only
// untransposed); dq += dPD Kn and dk += dPD^T Qn read Kn and Qn MN-major from the same tiles
// that Qn Kn^T reads K-major. <dS, S0> is summed in fp32 from the loaded values, in a fixed
// order; the row dots and the pair terms use fixed shuffle trees: bitwise reproducible.
#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/bwd_tiles.cuh"

namespace flashgdn::cuda::bwd {

namespace {

namespace tl = sm90::tiles;
using bf16 = __nv_bfloat16;

// The staged operands (bwd_tiles.cuh: [rows][64] tiles of T, D / 64 of them along a D-wide row).
template <int D, typename T>
struct DqkSmem {
  static constexpr int kB = D / 64;
  T d_o[kB][64][64];  // dO   [tokens i][v]: A of dPD, dq_inter; B of dPD^T
  T vn[kB][64][64];   // V_new [tokens j][v]: B of dPD; A of dPD^T, dk_inter
  T dvn[kB][64][64];  // dV_new [tokens][v]: A of dW
  T qn[kB][64][64];   // Qn   [tokens][a]: A of Qn Kn^T; B (MN-major) of dPD^T Qn
  T kn[kB][64][64];   // Kn   [tokens][a]: B of Qn Kn^T; B (MN-major) of dPD Kn
  T h[kB][D][64];     // S0   [a][v]: B of dq_inter, dW
  T dh[kB][D][64];    // dS   [a][v]: B of dk_inter
};

// sum over the thread's items of x (.) y: its part of <dS, S0> (fixed order)
template <int D>
__device__ __forceinline__ float dot_pieces(const tl::Piece<D>& x, const tl::Piece<D>& y) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 2 * tl::Items<D>::kCount; ++i)
    s += x.x[i].x * y.x[i].x + x.x[i].y * y.x[i].y + x.x[i].z * y.x[i].z + x.x[i].w * y.x[i].w;
  return s;
}

// The same over bf16 values x (Rows16: 8 an item) and fp32 values y, item by item in
// dot_pieces' order.
template <int D>
__device__ __forceinline__ float dot_rows_piece(const tl::Rows16<D>& x, const tl::Piece<D>& y) {
  float s = 0.f;
#pragma unroll
  for (int it = 0; it < tl::Items<D>::kCount; ++it) {
    const uint32_t w[4] = {x.x[it].x, x.x[it].y, x.x[it].z, x.x[it].w};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2 a = sm90::unpack2<bf16>(w[2 * half]), b = sm90::unpack2<bf16>(w[2 * half + 1]);
      const float4 v = y.x[2 * it + half];
      s += a.x * v.x + a.y * v.y + b.x * v.z + b.y * v.w;
    }
  }
  return s;
}

template <int D, typename TQ>
__global__ void __launch_bounds__(tl::kThreads, 1) dqk_sm90_kernel(BwdParams P) {
  constexpr int kB = D / 64;
  ChunkUnit u;
  if (!locate_unit(P, u)) return;
  const ChunkInfo& ci = u.ci;
  const int64_t gc = u.gc, h = u.h, hq = u.hq, r = u.r;
  const int len = u.len;
  const int tid = threadIdx.x, wg = tid >> 7;
  const tl::AccCoord ac(tid);

  auto& S = dynamic_smem_1024<DqkSmem<D, TQ>>();
  __shared__ float s_c[kC], s_q[kC], s_e[kC], s_qdot[kC], s_kdot[kC], s_rowp[kC], s_colp[4][kC];
  __shared__ float s_red[tl::kThreads / 32];

  if (tid < kC) s_c[tid] = P.cg[r * kC + tid];

  // ---- staging: dO, then the fp32 pieces, the next one's loads in flight ------------------
  const int64_t lds = P.Hq * D;
  const float* qn = P.qn + (gc * kC * P.Hq + hq) * D;
  const float* kn = P.kn + (gc * kC * P.Hq + hq) * D;
  tl::Rows16<D> o, vr, dvr;
  tl::load_rows16<D>(static_cast<const TQ*>(P.d_o.data) + tok_off(P.d_o, ci.b, ci.t0, h), P.d_o.s1, len, o, tid);
  // V_new (prep) and dV_new (the dh pass) arrive in the inputs' type below `high`.
  tl::load_rows16<D>(reinterpret_cast<const TQ*>(P.vn) + r * kC * D, D, len, vr, tid);
  tl::load_rows16<D>(reinterpret_cast<const TQ*>(P.dvn) + r * kC * D, D, len, dvr, tid);
  constexpr uint32_t kTD = D * 128;  // bytes of a D-row tile
  uint8_t* hs = reinterpret_cast<uint8_t*>(S.h);
  uint8_t* dhs = reinterpret_cast<uint8_t*>(S.dh);
  const float* dhg = P.dh + r * D * D;
  float frob = 0.f;
  if constexpr (std::is_same_v<TQ, bf16>) {
    // S0 arrives in bf16 (states_in_bf16) and is copied as it is; the fp32 pieces are Kn, Qn and
    // dS's blocks, each S0 block's rows in registers while dS's block of the same rows is
    // staged, for <dS, S0> (the bf16 values of S0: what the products use).
    const bf16* hg = reinterpret_cast<const bf16*>(P.h) + r * D * D;
    tl::Rows16<D> hr[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) tl::load_rows16<D>(hg + 64 * b * D, D, 64, hr[b], tid);
    constexpr int kPieces = 2 + kB;
    const auto piece = [&](int i) -> tl::PieceSrc {
      if (i == 0) return {kn, lds, reinterpret_cast<uint8_t*>(S.kn), tl::kTile64};
      if (i == 1) return {qn, lds, reinterpret_cast<uint8_t*>(S.qn), tl::kTile64};
      return {dhg + 64 * (i - 2) * D, D, dhs + 64 * (i - 2) * 128, kTD};
    };
    tl::Piece<D> cur, nxt;
    tl::load_piece<D>(piece(0), cur, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.d_o), o, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.vn), vr, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.dvn), dvr, tid);
#pragma unroll
    for (int b = 0; b < kB; ++b) tl::store_rows16<D>(hs + 64 * b * 128, hr[b], tid, kTD);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      if (i + 1 < kPieces) tl::load_piece<D>(piece(i + 1), nxt, tid);
      if (i >= 2) frob += dot_rows_piece<D>(hr[i - 2], cur);  // S0 block . dS block
      tl::store_piece<D, TQ>(piece(i), cur, tid);
      cur = nxt;
    }
  } else {
    const float* hg = P.h + r * D * D;
    // Pieces of 64 rows; the states' 64-row blocks alternate S0, dS, so that a block of each is
    // in registers at once for <dS, S0>.
    constexpr int kPieces = 2 + 2 * kB;
    const auto piece = [&](int i) -> tl::PieceSrc {
      switch (i) {
        case 0: return {kn, lds, reinterpret_cast<uint8_t*>(S.kn), tl::kTile64};
        case 1: return {qn, lds, reinterpret_cast<uint8_t*>(S.qn), tl::kTile64};
        default: {
          const int b = (i - 2) / 2;
          return (i - 2) % 2 == 0 ? tl::PieceSrc{hg + 64 * b * D, D, hs + 64 * b * 128, kTD}
                                  : tl::PieceSrc{dhg + 64 * b * D, D, dhs + 64 * b * 128, kTD};
        }
      }
    };
    tl::Piece<D> cur, nxt;
    tl::load_piece<D>(piece(0), cur, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.d_o), o, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.vn), vr, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.dvn), dvr, tid);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      if (i + 1 < kPieces) tl::load_piece<D>(piece(i + 1), nxt, tid);
      if (i >= 2 && i % 2 == 0) frob += dot_pieces<D>(cur, nxt);  // S0 block . dS block
      tl::store_piece<D, TQ>(piece(i), cur, tid);
      cur = nxt;
    }
  }
  frob = warp_sum(frob);
  if ((tid & 31) == 0) s_red[tid >> 5] = frob;
  __syncthreads();  // s_c
  const float cL = s_c[len - 1];
  if (tid < kC) {
    s_q[tid] = tid < len ? P.scale * expf(s_c[tid]) : 0.f;
    s_e[tid] = tid < len ? expf(cL - s_c[tid]) : 0.f;
  }
  sm90::fence_proxy_async();  // the tiles, written by ordinary stores, are read by wgmma
  __syncthreads();

  // dPD_ij from the raw product x: masked to j <= i < L, gated and scaled.
  const auto gate_pd = [&](int i, int j, float x) {
    return (j <= i && i < len) ? P.scale * expf(s_c[i] - s_c[j]) * x : 0.f;
  };
  // fp32 stores of a 64 x D accumulator into a [64][D] workspace block.
  const auto store_rows = [&](float* dst, const float (&acc)[kB][32], float sign) {
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; e += 2)
        *reinterpret_cast<float2*>(dst + ac.row(e) * D + 64 * b + ac.col(e)) =
            make_float2(sign * acc[b][e], sign * acc[b][e + 1]);
  };
  const auto scale_rows = [&](float (&acc)[kB][32], const float* f) {
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; ++e) acc[b][e] *= f[ac.row(e)];
  };

  if (wg == 0) {
    // ---- dq = diag(scale exp(c)) dO S0^T + dPD Kn; the pair terms of dc -------------------
    float dp[1][32], qk[1][32], dq[kB][32];
    tl::zero(dp);
    tl::zero(qk);
    tl::zero(dq);
    tl::begin_products();
    tl::product_ss<TQ, 64, D, 0>(dp, S.d_o, S.vn, false);
    tl::product_ss<TQ, 64, D, 0>(qk, S.qn, S.kn, false);
    tl::product_ss<TQ, D, D, 0>(dq, S.d_o, S.h, false);
    tl::finish(dq);
    tl::fence(dp);
    tl::fence(qk);
    scale_rows(dq, s_q);
    tl::row_dot(ac, dq, qn, lds, s_qdot);
    // L_ij = dPD_ij QK_ij for j < i: +L to dc_i (row sums), -L to dc_j (column sums).
#pragma unroll
    for (int e = 0; e < 32; ++e) dp[0][e] = gate_pd(ac.row(e), ac.col(e), dp[0][e]);
    const auto pair = [&](int e) { return ac.col(e) < ac.row(e) ? dp[0][e] * qk[0][e] : 0.f; };
    tl::row_col_sums(ac, pair, pair, s_rowp, s_colp);
    tl::product_rs<TQ, D, 1>(dq, dp, S.kn);
    tl::finish(dq);
    store_rows(P.dqh + r * kC * D, dq, 1.f);
  } else {
    // ---- dk = diag(exp(c_L - c)) V_new dS^T + dPD^T Qn; then dW = -dV_new S0^T ------------
    float dpt[1][32], dk[kB][32];
    tl::zero(dpt);
    tl::zero(dk);
    tl::begin_products();
    tl::product_ss<TQ, 64, D, 0>(dpt, S.vn, S.d_o, false);
    tl::product_ss<TQ, D, D, 0>(dk, S.vn, S.dh, false);
    tl::finish(dk);
    tl::fence(dpt);
    scale_rows(dk, s_e);
    tl::row_dot(ac, dk, kn, lds, s_kdot);
#pragma unroll
    for (int e = 0; e < 32; ++e) dpt[0][e] = gate_pd(ac.col(e), ac.row(e), dpt[0][e]);  // (j, i): dPD_ij
    tl::product_rs<TQ, D, 1>(dk, dpt, S.qn);
    tl::finish(dk);
    store_rows(P.dkh + r * kC * D, dk, 1.f);
    tl::begin_products();
    tl::product_ss<TQ, D, D, 0>(dk, S.dvn, S.h, false);
    tl::finish(dk);
    tl::store_acc16<TQ>(ac, reinterpret_cast<TQ*>(P.W) + r * kC * D, D, dk, -1.f);  // dW, 16-bit for wy
  }
  __syncthreads();

  if (tid < kC) {
    const int i = tid;
    const float pair = s_rowp[i] - (s_colp[0][i] + s_colp[1][i] + s_colp[2][i] + s_colp[3][i]);
    float x = s_qdot[i] - s_kdot[i] + pair;
    if (i == len - 1) {
      float fr = 0.f, kd = 0.f;
      for (int k = 0; k < tl::kThreads / 32; ++k) fr += s_red[k];
      for (int jj = 0; jj < len - 1; ++jj) kd += s_kdot[jj];
      x = s_qdot[i] + pair + expf(cL) * fr + kd;  // Kf_L = k_L: its two terms cancel
    }
    P.dc[r * kC + i] = i < len ? x : 0.f;
  }
}

}  // namespace

void launch_bwd_dqk_sm90(const BwdParams& P, cudaStream_t s) {
  dispatch_dim_type(P, [&](auto c) {
    using C = decltype(c);
    using Smem = DqkSmem<C::D, typename C::TQ>;
    launch_per_chunk(dqk_sm90_kernel<C::D, typename C::TQ>, tl::kThreads, dynamic_smem_1024_bytes<Smem>(), P, s,
                     "bwd dqk (sm90)");
  });
}

}  // namespace flashgdn::cuda::bwd
