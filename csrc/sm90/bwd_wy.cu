// Backward, through the WY representation on wgmma: the `fast` level's version of
// csrc/cuda/chunk_bwd_wy.cu (same outputs, same formulas; `high` keeps that kernel's split
// products until this one has a split variant).
//
// U = T diag(beta) V and W = T diag(beta exp(c)) Kn with T = (I + A)^-1,
// A = strict_lower(diag(beta) Kn Kn^T (.) D). Given dU = dV_new and dW (bwd_dqk.cu):
//   X = T^T dU:  dv = diag(beta) X,                 dbeta += rowsum(V (.) X)           (warpgroup 0)
//   dT = (dU V^T + dW Kn^T diag(exp(c))) diag(beta);  M = dT T^T                         (warpgroup 0)
//   Y = T^T dW:  dk += diag(beta exp(c)) Y,         dbeta += rowsum(exp(c) Kn (.) Y),
//                dc += rowsum(beta exp(c) Kn (.) Y)                                      (warpgroup 1)
//   G = (-T^T M) (.) D (strictly lower),  E = diag(beta) G,  KK = Kn Kn^T:
//                dbeta += rowsum(G (.) KK),  dk += E Kn + E^T Kn,
//                dc += rowsum(E (.) KK) - colsum(E (.) KK)                               (warpgroup 1)
// dv and dbeta are final here and go to the outputs; dk and dc are added to the workspace.
//
// One block per (chunk, value head), two warpgroups, operands staged once as 16-bit tiles of
// the inputs' type (bwd_tiles.cuh); M passes from warpgroup 0 to 1 through shared memory, E^T is stored
// transposed for the A operand of E^T Kn.
#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/bwd_tiles.cuh"

namespace flashgdn::cuda::bwd {

namespace {

namespace tl = sm90::tiles;

template <int D, typename T>
struct WySmem {
  static constexpr int kB = D / 64;
  T tt[64][64];       // T^T [i][j]: A of X, Y, G
  T tn[64][64];       // T [j][k]: B of dT T^T
  T du[kB][64][64];   // dU [tokens][v]: B (MN-major) of X; A of dU V^T
  T dw[kB][64][64];   // dW [tokens][a]: B (MN-major) of Y; A of dW Kn^T
  T kn[kB][64][64];   // Kn [tokens][a]: B of dW Kn^T; A and B of Kn Kn^T; B (MN-major) of E Kn, E^T Kn
  T v[kB][64][64];    // V [tokens][v]: B of dU V^T
  T m[64][64];        // M [k][j]: B (MN-major) of T^T M
  T et[64][64];       // E^T [i][j]: A of E^T Kn
  float dk[64][D];     // dk from dqk (fp32), copied in at the start: added to at the end
};

// Barriers beside __syncthreads (id 0): M written (both warpgroups), E^T written (warpgroup 1).
enum class WyBarrier : uint32_t { kM = 1, kE = 2 };

template <int D, typename TQ>
__global__ void __launch_bounds__(tl::kThreads, 1) wy_sm90_kernel(BwdParams P) {
  constexpr int kB = D / 64;
  ChunkUnit u;
  if (!locate_unit(P, u)) return;
  const ChunkInfo& ci = u.ci;
  const int64_t gc = u.gc, h = u.h, hq = u.hq, r = u.r;
  const int len = u.len;
  const int tid = threadIdx.x, wg = tid >> 7;
  const tl::AccCoord ac(tid);

  auto& S = dynamic_smem_1024<WySmem<D, TQ>>();
  __shared__ float s_c[kC], s_ec[kC], s_beta[kC];
  __shared__ float s_vx[kC], s_ky[kC], s_gk[kC], s_cole[4][kC];

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

  // dk's partial from dqk, copied into shared memory by warpgroup 1 while everything else runs
  // (it is read only at the very end of warpgroup 1's chain).
  float* dkg = P.dkh + r * kC * D;
  if (wg == 1) {
    for (int i = tid - tl::kWarpgroup; i < kC * D / 4; i += tl::kWarpgroup)
      sm90::cp_async_16(&S.dk[0][0] + 4 * i, dkg + 4 * i);
    sm90::cp_async_commit();
  }

  // ---- staging: V (16-bit), T (natural and transposed), dU, dW, Kn --------------------------
  const int64_t lds = P.Hq * D;
  const float* kn = P.kn + (gc * kC * P.Hq + hq) * D;
  const TQ* vg = static_cast<const TQ*>(P.v.data) + tok_off(P.v, ci.b, ci.t0, h);
  // dU (dV_new, the dh pass) and dW (dqk) arrive in the inputs' type below `high`.
  const TQ* dwg = reinterpret_cast<const TQ*>(P.W) + r * kC * D;
  const TQ* dug = reinterpret_cast<const TQ*>(P.dvn) + r * kC * D;
  tl::Rows16<D> vr, dur, dwr;
  tl::load_rows16<D>(vg, P.v.s1, len, vr, tid);
  tl::load_rows16<D>(dug, D, len, dur, tid);
  tl::load_rows16<D>(dwg, D, len, dwr, tid);
  // T arrives in the inputs' type (prep rounds it once, below `high`): copied as it is, and
  // transposed value by value.
  tl::Rows16<64> tr;
  tl::load_rows16<64>(reinterpret_cast<const TQ*>(P.Tm) + r * kC * kC, kC, kC, tr, tid);
  const tl::PieceSrc kp{kn, lds, reinterpret_cast<uint8_t*>(S.kn), tl::kTile64};
  tl::Piece<D> a;
  tl::load_piece<D>(kp, a, tid);
  tl::store_rows16<64>(reinterpret_cast<uint8_t*>(S.tn), tr, tid);
#pragma unroll
  for (int it = 0; it < tl::Items<64>::kCount; ++it) {  // T^T: T[j][k] at row k, column j
    const int j = tl::Items<64>::row(tid, it), k0 = 8 * tl::Items<64>::c8(tid, it);
    const uint32_t w[4] = {tr.x[it].x, tr.x[it].y, tr.x[it].z, tr.x[it].w};
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      const float2 x = sm90::unpack2<TQ>(w[k / 2]);  // exact: the put1 below rounds nothing
      tl::put1<TQ>(reinterpret_cast<uint8_t*>(S.tt), tl::kTile64, k0 + k, j, x.x);
      tl::put1<TQ>(reinterpret_cast<uint8_t*>(S.tt), tl::kTile64, k0 + k + 1, j, x.y);
    }
  }
  tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.du), dur, tid);
  tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.dw), dwr, tid);
  tl::store_piece<D, TQ>(kp, a, tid);
  tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.v), vr, tid);
  sm90::fence_proxy_async();  // the tiles, written by ordinary stores, are read by wgmma
  __syncthreads();

  if (wg == 0) {
    // ---- X = T^T dU: dv, dbeta (V . X);  dT;  M = dT T^T -> shared memory -----------------
    float x[kB][32], puv[1][32], pwk[1][32];
    tl::zero(x);
    tl::zero(puv);
    tl::zero(pwk);
    tl::begin_products();
    tl::product_ss<TQ, D, 64, 1>(x, S.tt, S.du, false);
    tl::product_ss<TQ, 64, D, 0>(puv, S.du, S.v, false);
    tl::product_ss<TQ, 64, D, 0>(pwk, S.dw, S.kn, false);
    tl::finish(x);
    tl::fence(puv);
    tl::fence(pwk);
    tl::row_dot_tile<TQ>(ac, x, reinterpret_cast<const uint8_t*>(S.v), s_vx);  // V exact in its tile
    TQ* dvo = static_cast<TQ*>(P.dv.data) + tok_off(P.dv, ci.b, ci.t0, h);
#pragma unroll
    for (int bb = 0; bb < kB; ++bb)
#pragma unroll
      for (int e = 0; e < 32; e += 2) {
        const int i = ac.row(e);
        if (i < len)
          *reinterpret_cast<uint32_t*>(dvo + i * P.dv.s1 + 64 * bb + ac.col(e)) =
              pack2<TQ>(s_beta[i] * x[bb][e], s_beta[i] * x[bb][e + 1]);
      }
    // dT_ij = beta_j (dU V^T + exp(c_j) dW Kn^T)_ij (into puv), then M = dT T^T
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      const int j = ac.col(e);
      puv[0][e] = s_beta[j] * (puv[0][e] + s_ec[j] * pwk[0][e]);
    }
    tl::zero(pwk);
    tl::product_rs<TQ, 64, 0>(pwk, puv, S.tn);
    tl::finish(pwk);
#pragma unroll
    for (int e = 0; e < 32; e += 2)
      tl::put2<TQ>(reinterpret_cast<uint8_t*>(S.m), tl::kTile64, ac.row(e), ac.col(e), pwk[0][e], pwk[0][e + 1]);
    sm90::fence_proxy_async();
    sm90::named_barrier_sync(static_cast<uint32_t>(WyBarrier::kM), tl::kThreads);
  } else {
    // ---- Y = T^T dW: dk, dbeta, dc;  G = -(T^T M) (.) D;  dk += E Kn + E^T Kn --------------
    float y[kB][32], kk[1][32], gm[1][32];
    tl::zero(y);
    tl::zero(kk);
    tl::zero(gm);
    tl::begin_products();
    tl::product_ss<TQ, D, 64, 1>(y, S.tt, S.dw, false);
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
    tl::product_ss<TQ, 64, 64, 1>(gm, S.tt, S.m, false);
    tl::finish(gm);
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      const int i = ac.row(e), j = ac.col(e);
      gm[0][e] = (i > j && i < len) ? -gm[0][e] * expf(s_c[i] - s_c[j]) : 0.f;
    }
    // dbeta_i += sum_j G_ij KK_ij; dc_i += sum_j E_ij KK_ij - sum_j E_ji KK_ji (E = diag(beta) G)
    tl::row_col_sums(
        ac, [&](int e) { return gm[0][e] * kk[0][e]; },
        [&](int e) { return s_beta[ac.row(e)] * gm[0][e] * kk[0][e]; }, s_gk, s_cole);
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      gm[0][e] *= s_beta[ac.row(e)];  // E
      tl::put1<TQ>(reinterpret_cast<uint8_t*>(S.et), tl::kTile64, ac.col(e), ac.row(e), gm[0][e]);
    }
    sm90::fence_proxy_async();
    sm90::named_barrier_sync(static_cast<uint32_t>(WyBarrier::kE), tl::kWarpgroup);
    tl::product_rs<TQ, D, 1>(y, gm, S.kn);
    tl::product_ss<TQ, D, 64, 1>(y, S.et, S.kn, true);
    tl::finish(y);
    sm90::cp_async_wait<0>();
    sm90::named_barrier_sync(static_cast<uint32_t>(WyBarrier::kE), tl::kWarpgroup);  // every thread's copies
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
      P.dc[r * kC + i] += s_beta[i] * s_ec[i] * s_ky[i] + rowE - colE;
    }
  }
}

}  // namespace

void launch_bwd_wy_sm90(const BwdParams& P, cudaStream_t s) {
  dispatch_dim_type(P, [&](auto c) {
    using C = decltype(c);
    using Smem = WySmem<C::D, typename C::TQ>;
    launch_per_chunk(wy_sm90_kernel<C::D, typename C::TQ>, tl::kThreads, dynamic_smem_1024_bytes<Smem>(), P, s,
                     "bwd wy (sm90)");
  });
}

}  // namespace flashgdn::cuda::bwd
