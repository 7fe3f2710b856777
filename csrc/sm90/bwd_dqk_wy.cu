// Backward, per chunk and value head on wgmma, below `high`: the output and state terms (phase
// A, once `bwd_dqk`) and the WY terms (phase B, once `bwd_wy`) in one block, so that what phase
// A hands to phase B (dW, dk's state part, dc's part) stays in shared memory and the operands
// both read (dV_new = dU, Kn) are staged once. `high` keeps the split-product kernels
// chunk_bwd_dqk.cu and chunk_bwd_wy.cu.
//
// Phase A, with dPD = scale lower(dO V_new^T) (.) D (diagonal included), S0 = h[chunk], dS = dh[chunk]:
//   dq  = scale diag(exp(c)) dO S0^T + dPD Kn                      (warpgroup 0) -> dqh
//   dk  = diag(exp(c_L - c)) V_new dS^T + dPD^T Qn                 (warpgroup 1) -> shared
//   dW  = -dV_new S0^T                                             (warpgroup 1) -> shared tile
//   dc_i = Qn_i . dq_inter_i - Kn_i . dk_inter_i + sum_{j<i} L_ij - sum_{j>i} L_ji
//          + [i = L - 1] (exp(c_L) <dS, S0> + sum_j Kn_j . dk_inter_j),  L = dPD (.) Qn Kn^T
// Phase B, with U = T diag(beta) V, W = T diag(beta exp(c)) Kn, T = (I + A)^-1,
// A = strict_lower(diag(beta) Kn Kn^T (.) D), dU = dV_new:
//   X = T^T dU:  dv = diag(beta) X,                 dbeta += rowsum(V (.) X)           (warpgroup 0)
//   dT = (dU V^T + dW Kn^T diag(exp(c))) diag(beta);  M = dT T^T                         (warpgroup 0)
//   Y = T^T dW:  dk += diag(beta exp(c)) Y,         dbeta += rowsum(exp(c) Kn (.) Y),
//                dc += rowsum(beta exp(c) Kn (.) Y)                                      (warpgroup 1)
//   G = (-T^T M) (.) D (strictly lower),  E = diag(beta) G,  KK = Kn Kn^T:
//                dbeta += rowsum(G (.) KK),  dk += E Kn + E^T Kn,
//                dc += rowsum(E (.) KK) - colsum(E (.) KK)                               (warpgroup 1)
// dq (per value head, fp32), dk (the same), dc, dv and dbeta leave at the end of their phase.
//
// Two warpgroups; every operand staged once as a 16-bit tile of the inputs' type (bwd_tiles.cuh)
// and each product a single 16-bit product with fp32 accumulation (the forward's `fast`). The
// results are the bits the two kernels gave: dW and dk's state part are rounded / kept as they
// were stored, and every sum runs in the same order (fixed shuffle trees).
#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/bwd_tiles.cuh"

namespace flashgdn::cuda::bwd {

namespace {

namespace tl = sm90::tiles;
using bf16 = __nv_bfloat16;

// The staged operands (bwd_tiles.cuh: [rows][64] tiles of T, D / 64 of them along a D-wide row).
// Phase A's own tiles and phase B's share one region (phase B starts after a block barrier).
template <int D, typename T>
struct DqkWySmem {
  static constexpr int kB = D / 64;
  T dvn[kB][64][64];  // dV_new = dU [tokens][v]: A of dW (A); B (MN-major) of X, A of dU V^T (B)
  T kn[kB][64][64];   // Kn [tokens][a]: B of Qn Kn^T, B (MN-major) of dPD Kn (A); B of dW Kn^T,
                      // A and B of Kn Kn^T, B (MN-major) of E Kn, E^T Kn (B)
  T dw[kB][64][64];   // dW [tokens][a], written by phase A: B (MN-major) of Y, A of dW Kn^T
  float dk[64][D];    // dk's phase-A part (fp32), added to at the end of phase B
  union {
    struct {
      T d_o[kB][64][64];  // dO [tokens i][v]: A of dPD, dq_inter; B of dPD^T
      T vn[kB][64][64];   // V_new [tokens j][v]: B of dPD; A of dPD^T, dk_inter
      T qn[kB][64][64];   // Qn [tokens][a]: A of Qn Kn^T; B (MN-major) of dPD^T Qn
      T h[kB][D][64];     // S0 [a][v]: B of dq_inter, dW
      T dh[kB][D][64];    // dS [a][v]: B of dk_inter
    } a;
    struct {
      T tt[64][64];       // T^T [i][j]: A of X, Y, G
      T tn[64][64];       // T [j][k]: B of dT T^T
      T v[kB][64][64];    // V [tokens][v]: B of dU V^T
      T m[64][64];        // M [k][j]: B (MN-major) of T^T M
      T et[64][64];       // E^T [i][j]: A of E^T Kn
    } b;
  } u;
};

// Barriers beside __syncthreads (id 0): M written (warpgroup 0 arrives, warpgroup 1 waits), E^T
// written (warpgroup 1).
enum class WyBarrier : uint32_t { kM = 1, kE = 2 };

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

// kH16: h arrives in bf16 (bwd::states_in_bf16: `fast` with bf16 inputs).
template <int D, typename TQ, bool kH16>
__global__ void __launch_bounds__(tl::kThreads, 1) dqk_wy_sm90_kernel(BwdParams P) {
  static_assert(!kH16 || std::is_same_v<TQ, bf16>, "bf16 states come with bf16 inputs");
  constexpr int kB = D / 64;
  ChunkUnit u;
  if (!locate_unit(P, u)) return;
  const ChunkInfo& ci = u.ci;
  const int64_t ls = u.ls, h = u.h, hq = u.hq, r = u.r;
  const int len = u.len;
  const int tid = threadIdx.x, wg = tid >> 7;
  const tl::AccCoord ac(tid);

  auto& S = dynamic_smem_1024<DqkWySmem<D, TQ>>();
  auto& A = S.u.a;
  auto& B = S.u.b;
  __shared__ float s_c[kC], s_ec[kC], s_beta[kC], s_q[kC], s_e[kC], s_dc[kC];
  __shared__ float s_qdot[kC], s_kdot[kC], s_rowp[kC], s_colp[4][kC];
  __shared__ float s_vx[kC], s_ky[kC], s_gk[kC], s_cole[4][kC];
  __shared__ float s_red[tl::kThreads / 32];

  if (tid < kC) {
    const float c = P.cg[r * kC + tid];
    s_c[tid] = c;
    s_ec[tid] = expf(c);
    float b = 0.f;
    if (tid < len) {
      const int64_t ob = ci.b * P.beta.s0 + (ci.t0 + tid) * P.beta.s1 + h * P.beta.s2;
      b = load_as_float(P.beta.data, P.beta_dtype, ob);
    }
    s_beta[tid] = b;
  }

  // ==== phase A: staging, dO and the 16-bit rows, then the fp32 pieces, the next one's loads in flight
  const int64_t lds = P.Hq * D;
  const float* qn = P.qn + qk_row(P, ls, 0, hq) * D;
  const float* kn = P.kn + qk_row(P, ls, 0, hq) * D;
  tl::Rows16<D> o, vr, dvr;
  tl::load_rows16<D>(static_cast<const TQ*>(P.d_o.data) + tok_off(P.d_o, ci.b, ci.t0, h), P.d_o.s1, len, o, tid);
  // V_new (prep) and dV_new (the dh pass) arrive in the inputs' type below `high`.
  tl::load_rows16<D>(reinterpret_cast<const TQ*>(P.vn) + r * kC * D, D, len, vr, tid);
  tl::load_rows16<D>(reinterpret_cast<const TQ*>(P.dvn) + r * kC * D, D, len, dvr, tid);
  constexpr uint32_t kTD = D * 128;  // bytes of a D-row tile
  uint8_t* hs = reinterpret_cast<uint8_t*>(A.h);
  uint8_t* dhs = reinterpret_cast<uint8_t*>(A.dh);
  const float* dhg = P.dh + r * D * D;
  float frob = 0.f;
  if constexpr (kH16) {
    // S0 arrives in bf16 (states_in_bf16) and is copied as it is; the fp32 pieces are Kn, Qn and
    // dS's blocks, each S0 block's rows in registers while dS's block of the same rows is
    // staged, for <dS, S0> (the bf16 values of S0: what the products use).
    const bf16* hg = reinterpret_cast<const bf16*>(P.h) + u.state_row * D * D;
    tl::Rows16<D> hr[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) tl::load_rows16<D>(hg + 64 * b * D, D, 64, hr[b], tid);
    constexpr int kPieces = 2 + kB;
    const auto piece = [&](int i) -> tl::PieceSrc {
      if (i == 0) return {kn, lds, reinterpret_cast<uint8_t*>(S.kn), tl::kTile64};
      if (i == 1) return {qn, lds, reinterpret_cast<uint8_t*>(A.qn), tl::kTile64};
      return {dhg + 64 * (i - 2) * D, D, dhs + 64 * (i - 2) * 128, kTD};
    };
    tl::Piece<D> cur, nxt;
    tl::load_piece<D>(piece(0), cur, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(A.d_o), o, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(A.vn), vr, tid);
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
    const float* hg = P.h + u.state_row * D * D;
    // Pieces of 64 rows; the states' 64-row blocks alternate S0, dS, so that a block of each is
    // in registers at once for <dS, S0>.
    constexpr int kPieces = 2 + 2 * kB;
    const auto piece = [&](int i) -> tl::PieceSrc {
      switch (i) {
        case 0: return {kn, lds, reinterpret_cast<uint8_t*>(S.kn), tl::kTile64};
        case 1: return {qn, lds, reinterpret_cast<uint8_t*>(A.qn), tl::kTile64};
        default: {
          const int b = (i - 2) / 2;
          return (i - 2) % 2 == 0 ? tl::PieceSrc{hg + 64 * b * D, D, hs + 64 * b * 128, kTD}
                                  : tl::PieceSrc{dhg + 64 * b * D, D, dhs + 64 * b * 128, kTD};
        }
      }
    };
    tl::Piece<D> cur, nxt;
    tl::load_piece<D>(piece(0), cur, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(A.d_o), o, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(A.vn), vr, tid);
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

  // dPD_ij from the raw products in acc: masked to j <= i < L, gated and scaled; i is the
  // accumulator's row (transposed = false) or column (true). Every element computed, then the
  // mask selected (AccCoord::rows_of: no branch a element).
  const auto gate_pd = [&](float (&acc)[1][32], bool transposed) {
    float cr[2], cc[16];
    ac.rows_of(s_c, cr), ac.cols_of(s_c, cc);
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      const int a = tl::AccCoord::row_slot(e), b = tl::AccCoord::col_slot(e);
      const int i = transposed ? ac.col(e) : ac.row(e), j = transposed ? ac.row(e) : ac.col(e);
      const float ci = transposed ? cc[b] : cr[a], cj = transposed ? cr[a] : cc[b];
      const float x = P.scale * expf(ci - cj) * acc[0][e];
      acc[0][e] = (j <= i && i < len) ? x : 0.f;
    }
  };
  // fp32 stores of a 64 x D accumulator into a [64][D] workspace block.
  const auto store_rows = [&](float* dst, const float (&acc)[kB][32]) {
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; e += 2)
        *reinterpret_cast<float2*>(dst + ac.row(e) * D + 64 * b + ac.col(e)) = make_float2(acc[b][e], acc[b][e + 1]);
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
    tl::product_ss<TQ, 64, D, 0>(dp, A.d_o, A.vn, false);
    tl::product_ss<TQ, 64, D, 0>(qk, A.qn, S.kn, false);
    tl::product_ss<TQ, D, D, 0>(dq, A.d_o, A.h, false);
    tl::finish(dq);
    tl::fence(dp);
    tl::fence(qk);
    scale_rows(dq, s_q);
    tl::row_dot(ac, dq, qn, lds, s_qdot);
    // L_ij = dPD_ij QK_ij for j < i: +L to dc_i (row sums), -L to dc_j (column sums).
    gate_pd(dp, false);
    const auto pair = [&](int e) { return ac.col(e) < ac.row(e) ? dp[0][e] * qk[0][e] : 0.f; };
    tl::row_col_sums(ac, pair, pair, s_rowp, s_colp);
    tl::product_rs<TQ, D, 1>(dq, dp, S.kn);
    tl::finish(dq);
    store_rows(P.dqh + r * kC * D, dq);
  } else {
    // ---- dk = diag(exp(c_L - c)) V_new dS^T + dPD^T Qn; then dW = -dV_new S0^T ------------
    float dpt[1][32], dk[kB][32];
    tl::zero(dpt);
    tl::zero(dk);
    tl::begin_products();
    tl::product_ss<TQ, 64, D, 0>(dpt, A.vn, A.d_o, false);
    tl::product_ss<TQ, D, D, 0>(dk, A.vn, A.dh, false);
    tl::finish(dk);
    tl::fence(dpt);
    scale_rows(dk, s_e);
    tl::row_dot(ac, dk, kn, lds, s_kdot);
    gate_pd(dpt, true);  // (j, i): dPD_ij
    tl::product_rs<TQ, D, 1>(dk, dpt, A.qn);
    tl::finish(dk);
    // dk's state part to shared memory (fp32, the values dkh held), for phase B's sum
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; e += 2)
        *reinterpret_cast<float2*>(&S.dk[ac.row(e)][64 * b + ac.col(e)]) = make_float2(dk[b][e], dk[b][e + 1]);
    tl::begin_products();
    tl::product_ss<TQ, D, D, 0>(dk, S.dvn, A.h, false);
    tl::finish(dk);
    // dW into its tile, rounded as the 16-bit workspace copy was
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; e += 2)
        tl::put2<TQ>(reinterpret_cast<uint8_t*>(S.dw), tl::kTile64, ac.row(e), 64 * b + ac.col(e), -dk[b][e],
                     -dk[b][e + 1]);
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
    s_dc[i] = x;  // phase B adds its terms and stores it
  }


  // ==== phase B: staging V and T into phase A's region (free after the barrier above); dU =
  // dV_new, Kn and dW are in their tiles already ======================================
  {
    tl::Rows16<D> vr;
    tl::load_rows16<D>(static_cast<const TQ*>(P.v.data) + tok_off(P.v, ci.b, ci.t0, h), P.v.s1, len, vr, tid);
    // T arrives in the inputs' type (prep rounds it once, below `high`): copied as it is, and
    // transposed value by value.
    tl::Rows16<64> tr;
    tl::load_rows16<64>(reinterpret_cast<const TQ*>(P.Tm) + r * kC * kC, kC, kC, tr, tid);
    tl::store_rows16<64>(reinterpret_cast<uint8_t*>(B.tn), tr, tid);
#pragma unroll
    for (int it = 0; it < tl::Items<64>::kCount; ++it) {  // T^T: T[j][k] at row k, column j
      const int j = tl::Items<64>::row(tid, it), k0 = 8 * tl::Items<64>::c8(tid, it);
      const uint32_t w[4] = {tr.x[it].x, tr.x[it].y, tr.x[it].z, tr.x[it].w};
#pragma unroll
      for (int k = 0; k < 8; k += 2) {
        const float2 x = sm90::unpack2<TQ>(w[k / 2]);  // exact: the put1 below rounds nothing
        tl::put1<TQ>(reinterpret_cast<uint8_t*>(B.tt), tl::kTile64, k0 + k, j, x.x);
        tl::put1<TQ>(reinterpret_cast<uint8_t*>(B.tt), tl::kTile64, k0 + k + 1, j, x.y);
      }
    }
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(B.v), vr, tid);
  }
  sm90::fence_proxy_async();  // the tiles (dW's included), written by ordinary stores, are read by wgmma
  __syncthreads();
  float* dkg = P.dkh + r * kC * D;

  if (wg == 0) {
    // ---- dT, M = dT T^T -> shared memory (warpgroup 1 waits for M: first);  X = T^T dU: dv,
    // dbeta (V . X) --------------------------------------------------------------------------
    float puv[1][32], pwk[1][32];
    tl::zero(puv);
    tl::zero(pwk);
    tl::begin_products();
    tl::product_ss<TQ, 64, D, 0>(puv, S.dvn, B.v, false);
    tl::product_ss<TQ, 64, D, 0>(pwk, S.dw, S.kn, false);
    tl::finish(puv);
    tl::fence(pwk);
    // dT_ij = beta_j (dU V^T + exp(c_j) dW Kn^T)_ij (into puv), then M = dT T^T
    {
      float bj[16], ecj[16];
      ac.cols_of(s_beta, bj), ac.cols_of(s_ec, ecj);
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int b = tl::AccCoord::col_slot(e);
        puv[0][e] = bj[b] * (puv[0][e] + ecj[b] * pwk[0][e]);
      }
    }
    tl::zero(pwk);
    tl::product_rs<TQ, 64, 0>(pwk, puv, B.tn);
    tl::finish(pwk);
#pragma unroll
    for (int e = 0; e < 32; e += 2)
      tl::put2<TQ>(reinterpret_cast<uint8_t*>(B.m), tl::kTile64, ac.row(e), ac.col(e), pwk[0][e], pwk[0][e + 1]);
    sm90::fence_proxy_async();
    sm90::named_barrier_arrive(static_cast<uint32_t>(WyBarrier::kM), tl::kThreads);  // warpgroup 1 syncs

    float x[kB][32];
    tl::zero(x);
    tl::begin_products();
    tl::product_ss<TQ, D, 64, 1>(x, B.tt, S.dvn, false);
    tl::finish(x);
    tl::row_dot_tile<TQ>(ac, x, reinterpret_cast<const uint8_t*>(B.v), s_vx);  // V exact in its tile
    TQ* dvo = static_cast<TQ*>(P.dv.data) + tok_off(P.dv, ci.b, ci.t0, h);
    float br[2];
    ac.rows_of(s_beta, br);
#pragma unroll
    for (int bb = 0; bb < kB; ++bb)
#pragma unroll
      for (int e = 0; e < 32; e += 2) {
        const int i = ac.row(e);
        const float b = br[tl::AccCoord::row_slot(e)];
        if (i < len)
          *reinterpret_cast<uint32_t*>(dvo + i * P.dv.s1 + 64 * bb + ac.col(e)) = pack2<TQ>(b * x[bb][e], b * x[bb][e + 1]);
      }
  } else {
    // ---- Y = T^T dW: dk, dbeta, dc;  G = -(T^T M) (.) D;  dk += E Kn + E^T Kn --------------
    float y[kB][32], kk[1][32], gm[1][32];
    tl::zero(y);
    tl::zero(kk);
    tl::zero(gm);
    tl::begin_products();
    tl::product_ss<TQ, D, 64, 1>(y, B.tt, S.dw, false);
    tl::product_ss<TQ, 64, D, 0>(kk, S.kn, S.kn, false);
    tl::finish(y);
    tl::fence(kk);
    tl::row_dot(ac, y, kn, lds, s_ky);
#pragma unroll
    for (int bb = 0; bb < kB; ++bb)
#pragma unroll
      for (int e = 0; e < 32; ++e) y[bb][e] *= s_beta[ac.row(e)] * s_ec[ac.row(e)];  // dk = diag(beta exp(c)) Y
    sm90::named_barrier_sync(static_cast<uint32_t>(WyBarrier::kM), tl::kThreads);
    tl::begin_products();
    tl::product_ss<TQ, 64, 64, 1>(gm, B.tt, B.m, false);
    tl::finish(gm);
    float br[2];
    ac.rows_of(s_beta, br);
    {  // every element computed, i > j (and i < L) kept: no branch a element
      float ci[2], cj[16];
      ac.rows_of(s_c, ci), ac.cols_of(s_c, cj);
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int i = ac.row(e), j = ac.col(e);
        const float x = -gm[0][e] * expf(ci[tl::AccCoord::row_slot(e)] - cj[tl::AccCoord::col_slot(e)]);
        gm[0][e] = (i > j && i < len) ? x : 0.f;
      }
    }
    // dbeta_i += sum_j G_ij KK_ij; dc_i += sum_j E_ij KK_ij - sum_j E_ji KK_ji (E = diag(beta) G)
    tl::row_col_sums(
        ac, [&](int e) { return gm[0][e] * kk[0][e]; },
        [&](int e) { return br[tl::AccCoord::row_slot(e)] * gm[0][e] * kk[0][e]; }, s_gk, s_cole);
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      gm[0][e] *= br[tl::AccCoord::row_slot(e)];  // E
      tl::put1<TQ>(reinterpret_cast<uint8_t*>(B.et), tl::kTile64, ac.col(e), ac.row(e), gm[0][e]);
    }
    sm90::fence_proxy_async();
    sm90::named_barrier_sync(static_cast<uint32_t>(WyBarrier::kE), tl::kWarpgroup);
    tl::product_rs<TQ, D, 1>(y, gm, S.kn);
    tl::product_ss<TQ, D, 64, 1>(y, B.et, S.kn, true);
    tl::finish(y);
    // S.dk: this thread's own phase-A values (the same accumulator positions)
#pragma unroll
    for (int bb = 0; bb < kB; ++bb)
#pragma unroll
      for (int e = 0; e < 32; e += 2) {
        const int i = ac.row(e), a = 64 * bb + ac.col(e);
        *reinterpret_cast<float2*>(dkg + i * D + a) = make_float2(S.dk[i][a] + y[bb][e], S.dk[i][a + 1] + y[bb][e + 1]);
      }
  }
  __syncthreads();

  if (tid < kC) {
    const int i = tid;
    if (i < len) {
      // s_gk: this warpgroup's row sums of G (.) KK; the E row sums are beta_i times them.
      const float rowE = s_beta[i] * s_gk[i];
      const float colE = s_cole[0][i] + s_cole[1][i] + s_cole[2][i] + s_cole[3][i];
      const float db = s_vx[i] + s_ec[i] * s_ky[i] + s_gk[i];
      const int64_t ob = ci.b * P.dbeta.s0 + (ci.t0 + i) * P.dbeta.s1 + h * P.dbeta.s2;
      store_from_float(P.dbeta.data, P.beta_dtype, ob, db);
      P.dc[r * kC + i] = s_dc[i] + (s_beta[i] * s_ec[i] * s_ky[i] + rowE - colE);
    } else {
      P.dc[r * kC + i] = 0.f;
    }
  }
}

}  // namespace

void launch_bwd_dqk_wy_sm90(const BwdParams& P, cudaStream_t s) {
  dispatch_dim_type(P, [&](auto c) {
    using C = decltype(c);
    using TQ = typename C::TQ;
    using Smem = DqkWySmem<C::D, TQ>;
    dispatch_states_type<TQ>(P, [&](auto h16) {
      launch_per_chunk(dqk_wy_sm90_kernel<C::D, TQ, decltype(h16)::value>, tl::kThreads,
                       dynamic_smem_1024_bytes<Smem>(), P, s, "bwd dqk + wy (sm90)");
    });
  });
}

}  // namespace flashgdn::cuda::bwd
