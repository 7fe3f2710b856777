// Backward, per-chunk preparation on wgmma: the `fast` level's version of chunk_prep
// (csrc/cuda/chunk_bwd_prep.cu; `high` keeps that kernel's split products). Same outputs but W,
// which only the images need here (dqk writes dW in its place):
//   c, A = strict_lower(diag(beta) Kn Kn^T (.) D), T = (I + A)^-1 (blocked, fwd_inverse.cuh),
//   W = T diag(beta exp(c)) Kn, V_new = T diag(beta) V - W h,
//   dvl = P^T dO with P = scale lower(Qn Kn^T (.) D) (diagonal included),
//   the reverse pass's images K~, QW = [Q~ | -W]^T, dO^T (chunk_bwd_images.cuh).
//
// One block per (chunk, value head), two warpgroups, operands staged once as 16-bit tiles
// (bwd_tiles.cuh; which type, see PrepSmem), single products with fp32 accumulation; Kn Kn^T and
// Kn Qn^T as k k^T and k q^T of the raw inputs, the norms applied after (see PrepSmem):
//   warpgroup 0: Kn Kn^T -> A -> T (fp32, TF32 split merges) -> Tm and the tiles T diag(beta exp(c)),
//                T diag(beta); W and U; the -W^T image; V_new = U + (-W) h
//   warpgroup 1: Kn Qn^T -> P^T -> dvl = P^T dO; the images K~, Q~^T, dO^T
// The images are built in shared memory (hi + lo of the fp32 values) and leave by bulk copies;
// K~ and Q~ come from the fp32 normalised keys and queries (qk_prep), as chunk_prep's do.
#include "cuda/chunk_bwd_images.cuh"
#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/bwd_tiles.cuh"
#include "sm90/fwd_inverse.cuh"

namespace flashgdn::cuda::bwd {

namespace {

namespace tl = sm90::tiles;

// Kn Kn^T and Kn Qn^T are formed from the raw inputs k and q (exact in their 16-bit type, fp32
// accumulation) with the norms 1 / ||k||, 1 / ||q|| applied to the accumulator in fp32, as the
// forward forms them: a product of tiles rounded after the norm loses q.k's small values
// (relative error ~2^-9 / |q.k|, which P^T dO passes to dv and dbeta).
// W = T diag(beta exp(c)) Kn scales every term of row i by exp(c_j), j <= i: under strong decay
// whole rows fall below fp16's range (6e-8) while the reverse pass weighs them against equally
// small exp(c_L) dS. So W's products are bf16 whatever the inputs' type T (Kn staged as bf16
// from the fp32 normalised keys); V, dO and T diag(beta) stay in T.
using bf16 = __nv_bfloat16;

// Rare path. k k^T and k q^T accumulate the raw rows' products in fp32: two rows of norm 2^64
// would overflow it, where the normalised product is at most 1. A row of norm at least 2^50
// (factor r = 1 / ||x|| <= 2^-50; products of two such rows reach 2^100 at most otherwise) is
// scaled in its tile by s = 2^ilogb(r), exact in bf16, and its factor becomes r / s:
// (s x_i) . y_j (r_i / s) = r_i x_i . y_j. A zero factor (a row of infinite norm) stays as is.
__device__ __forceinline__ bool is_huge_row(float r) { return r > 0.f && r <= 0x1p-50f; }

template <int D>
__device__ __noinline__ void rescale_huge_rows(bf16 (*k)[64][64], bf16 (*q)[64][64], float* rk, float* rq, int len,
                                               int tid) {
  __shared__ float down[2][kC];
  if (tid < kC) {
    const float a = tid < len && is_huge_row(rk[tid]) ? ldexpf(1.f, ilogbf(rk[tid])) : 1.f;
    const float b = tid < len && is_huge_row(rq[tid]) ? ldexpf(1.f, ilogbf(rq[tid])) : 1.f;
    down[0][tid] = a, down[1][tid] = b;
    rk[tid] /= a, rq[tid] /= b;
  }
  __syncthreads();
  constexpr int kPerTile = D / 64 * 64 * 64;
  for (int e = tid; e < 2 * kPerTile; e += tl::kThreads) {
    const int t = e / kPerTile, i = e % kPerTile, row = (i >> 6) & 63;  // a 128-byte row holds one token's 64 values
    bf16& x = (t == 0 ? &k[0][0][0] : &q[0][0][0])[i];
    x = __float2bfloat16(__bfloat162float(x) * down[t][row]);
  }
}

template <int D, typename T>
struct PrepSmem {
  static constexpr int kB = D / 64;
  T kr[kB][64][64];     // k [tokens][a] (raw): A and B of k k^T, A of k q^T
  T qr[kB][64][64];     // q [tokens][a] (raw): B of k q^T
  bf16 kn[kB][64][64];  // Kn [tokens][a]: B (MN-major) of W
  T v[kB][64][64];      // V [tokens][v]: B (MN-major) of U
  T o[kB][64][64];      // dO [tokens][v]: B (MN-major) of dvl
  bf16 h[kB][D][64];    // S0 [a][v]: B (MN-major, k = a) of (-W) h
  bf16 tw[64][64];      // T diag(beta exp(c)) [i][j]: A of W
  T tu[64][64];         // T diag(beta): A of U
  uint8_t stage1[kImageStage];  // warpgroup 1's image parts
  union {
    struct {
      float af[64][sm90::kLdF];
      float tf[64][sm90::kLdF];
    } at;                         // A and T (fp32) for the inverse (fwd_inverse.cuh)
    uint8_t stage0[kImageStage];  // then warpgroup 0's image part (-W^T)
  } u;
};

// Barriers beside __syncthreads (id 0), each within one warpgroup.
enum class PrepBarrier : uint32_t { kWg0 = 1, kWg1 = 2 };

// kH16: h arrives in bf16 (bwd::states_in_bf16: `fast` with bf16 inputs).
template <int D, typename TQ, bool kH16>
__global__ void __launch_bounds__(tl::kThreads, 1) prep_sm90_kernel(BwdParams P) {
  static_assert(!kH16 || std::is_same_v<TQ, bf16>, "bf16 states come with bf16 inputs");
  constexpr int kB = D / 64;
  using Im = Images<D>;
  constexpr uint32_t kHalf = kImageStage / 2;
  ChunkUnit u;
  if (!locate_unit(P, u)) return;
  const ChunkInfo& ci = u.ci;
  const int64_t ls = u.ls, h = u.h, hq = u.hq, r = u.r;
  const int len = u.len;
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const tl::AccCoord ac(tid);

  auto& S = dynamic_smem_1024<PrepSmem<D, TQ>>();
  __shared__ float s_c[kC], s_ec[kC], s_beta[kC], s_ke[kC], s_qe[kC], s_rk[kC], s_rq[kC];

  // The gate inputs first: their (strided) loads fly under the staging's.
  const TokenGate tg = tid < kC ? load_token_gate(P, ci, h, tid) : TokenGate{};

  // ---- staging: V, dO, k, q (16-bit), then Kn and S0 (fp32), the next piece's loads in flight --
  const int64_t lds = P.Hq * D;
  const float* kn = P.kn + qk_row(P, ls, 0, hq) * D;
  const float* qn = P.qn + qk_row(P, ls, 0, hq) * D;
  const TQ* vg = static_cast<const TQ*>(P.v.data) + tok_off(P.v, ci.b, ci.t0, h);
  const TQ* dog = static_cast<const TQ*>(P.d_o.data) + tok_off(P.d_o, ci.b, ci.t0, h);
  const TQ* kg = static_cast<const TQ*>(P.k.data) + tok_off(P.k, ci.b, ci.t0, hq);
  const TQ* qg = static_cast<const TQ*>(P.q.data) + tok_off(P.q, ci.b, ci.t0, hq);
  tl::Rows16<D> vr, orr, kr, qr;
  tl::load_rows16<D>(kg, P.k.s1, len, kr, tid);
  tl::load_rows16<D>(qg, P.q.s1, len, qr, tid);
  tl::load_rows16<D>(vg, P.v.s1, len, vr, tid);
  tl::load_rows16<D>(dog, P.d_o.s1, len, orr, tid);
  // S0 = h[chunk]: bf16 in the workspace at `fast` with bf16 inputs (kH16), copied as it is;
  // else fp32, rounded here. 64-row blocks of its D rows, D * 128 bytes between column tiles.
  uint8_t* hs = reinterpret_cast<uint8_t*>(S.h);
  if constexpr (kH16) {
    const bf16* hg = reinterpret_cast<const bf16*>(P.h) + u.state_row * D * D;
    tl::Rows16<D> hr[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) tl::load_rows16<D>(hg + 64 * b * D, D, 64, hr[b], tid);
    const tl::PieceSrc kp{kn, lds, reinterpret_cast<uint8_t*>(S.kn), tl::kTile64};
    tl::Piece<D> kv;
    tl::load_piece<D>(kp, kv, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.kr), kr, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.qr), qr, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.v), vr, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.o), orr, tid);
#pragma unroll
    for (int b = 0; b < kB; ++b) tl::store_rows16<D>(hs + 64 * b * 128, hr[b], tid, D * 128);
    tl::store_piece<D, bf16>(kp, kv, tid);
  } else {
    const float* hg = P.h + u.state_row * D * D;
    constexpr int kPieces = 1 + kB;
    const auto piece = [&](int i) -> tl::PieceSrc {
      if (i == 0) return {kn, lds, reinterpret_cast<uint8_t*>(S.kn), tl::kTile64};
      return {hg + 64 * (i - 1) * D, D, hs + 64 * (i - 1) * 128, D * 128};
    };
    tl::Piece<D> cur, nxt;
    tl::load_piece<D>(piece(0), cur, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.kr), kr, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.qr), qr, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.v), vr, tid);
    tl::store_rows16<D>(reinterpret_cast<uint8_t*>(S.o), orr, tid);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      if (i + 1 < kPieces) tl::load_piece<D>(piece(i + 1), nxt, tid);
      tl::store_piece<D, bf16>(piece(i), cur, tid);
      cur = nxt;
    }
  }
  scan_chunk_gates(tg, s_c, s_beta);
  if (tid < kC) {
    s_ec[tid] = expf(s_c[tid]);
    s_ke[tid] = tid < len ? expf(s_c[len - 1] - s_c[tid]) : 0.f;
    s_qe[tid] = tid < len ? P.scale * expf(s_c[tid]) : 0.f;
    const int64_t row = qk_row(P, ls, tid, hq);  // rq, rk: written by qk_prep for rows < len
    s_rk[tid] = tid < len ? (P.l2norm ? P.rk[row] : 1.f) : 0.f;
    s_rq[tid] = tid < len ? (P.l2norm ? P.rq[row] : 1.f) : 0.f;
    P.cg[r * kC + tid] = s_c[tid];
  }
  sm90::fence_proxy_async();  // the tiles, written by ordinary stores, are read by wgmma
  __syncthreads();
  if constexpr (std::is_same_v<TQ, bf16>) {  // an fp16 row's norm is below 2^24: never taken
    if (__syncthreads_or(tid < len && (is_huge_row(s_rk[tid]) || is_huge_row(s_rq[tid])))) {
      rescale_huge_rows<D>(S.kr, S.qr, s_rk, s_rq, len, tid);
      sm90::fence_proxy_async();
      __syncthreads();
    }
  }

  const auto ip = Im::at(P.precision_fast != 0);  // where this unit's images go (hi only at `fast`)
  uint8_t* img = P.img + r * ip.bytes;
  // The lo parts only where the reverse pass reads them: its split products (not at `fast`),
  // and of dO^T only for fp16 dO (a bf16 dO's lo part is zero: chunk_bwd_dh.cu skips it).
  const bool lo_parts = !P.precision_fast;
  constexpr bool kDoLo = !std::is_same_v<TQ, bf16>;
  // Ships the image part pair (hi, lo) built in `buf` by this warpgroup (hi alone unless lo);
  // `buf` is free on return.
  const auto ship = [&](uint8_t* buf, uint32_t dst_hi, uint32_t dst_lo, uint32_t bytes, PrepBarrier bar, bool lo) {
    sm90::fence_proxy_async();
    sm90::named_barrier_sync(static_cast<uint32_t>(bar), tl::kWarpgroup);
    if (wtid == 0) {
      sm90::bulk_store(img + dst_hi, buf, bytes);
      if (lo) sm90::bulk_store(img + dst_lo, buf + kHalf, bytes);
      sm90::bulk_commit_group();
      sm90::bulk_wait_group_read<0>();
    }
    sm90::named_barrier_sync(static_cast<uint32_t>(bar), tl::kWarpgroup);
  };
  // fp32 stores of a 64 x D accumulator into a [64][D] workspace block.
  const auto store_rows = [&](float* dst, const float (&acc)[kB][32]) {
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; e += 2)
        *reinterpret_cast<float2*>(dst + ac.row(e) * D + 64 * b + ac.col(e)) = make_float2(acc[b][e], acc[b][e + 1]);
  };

  if (wg == 0) {
    constexpr auto kBar = PrepBarrier::kWg0;
    // ---- A = strict_lower(diag(beta) Kn Kn^T (.) D), T = (I + A)^-1 ------------------------
    float kk[1][32];
    tl::zero(kk);
    tl::begin_products();
    tl::product_ss<TQ, 64, D, 0>(kk, S.kr, S.kr, false);
    tl::finish(kk);
    {  // every element computed, the strict lower triangle kept (AccCoord::rows_of: no branches)
      float ci[2], bi[2], rki[2], cj[16], rkj[16];
      ac.rows_of(s_c, ci), ac.rows_of(s_beta, bi), ac.rows_of(s_rk, rki);
      ac.cols_of(s_c, cj), ac.cols_of(s_rk, rkj);
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int a = tl::AccCoord::row_slot(e), b = tl::AccCoord::col_slot(e);
        const float x = bi[a] * expf(ci[a] - cj[b]) * (rki[a] * rkj[b] * kk[0][e]);
        S.u.at.af[ac.row(e)][ac.col(e)] = ac.row(e) > ac.col(e) ? x : 0.f;
      }
    }
    for (int e = wtid; e < 64 * sm90::kLdF; e += tl::kWarpgroup) (&S.u.at.tf[0][0])[e] = 0.f;
    const auto sync = [] { sm90::named_barrier_sync(static_cast<uint32_t>(kBar), tl::kWarpgroup); };
    sync();
    sm90::invert_chunk<true>(S.u.at, wtid >> 5, tid & 31, sync);
    TQ* Tg = reinterpret_cast<TQ*>(P.Tm) + r * kC * kC;  // in the inputs' type: wy's tiles
    {  // pairs (i, j), (i, j + 1): a thread keeps its column pair j (the factors read once)
      constexpr int kStep = tl::kWarpgroup / (kC / 2);  // rows between a thread's pairs
      const int j = 2 * (wtid % (kC / 2));
      const float b0 = s_beta[j], b1 = s_beta[j + 1], e0 = s_ec[j], e1 = s_ec[j + 1];
#pragma unroll
      for (int i = wtid / (kC / 2); i < kC; i += kStep) {
        const float2 t = *reinterpret_cast<const float2*>(&S.u.at.tf[i][j]);
        *reinterpret_cast<uint32_t*>(Tg + i * kC + j) = cuda::pack2<TQ>(t.x, t.y);
        tl::put2<bf16>(reinterpret_cast<uint8_t*>(S.tw), tl::kTile64, i, j, t.x * b0 * e0, t.y * b1 * e1);
        tl::put2<TQ>(reinterpret_cast<uint8_t*>(S.tu), tl::kTile64, i, j, t.x * b0, t.y * b1);
      }
    }
    sm90::fence_proxy_async();
    sm90::named_barrier_sync(static_cast<uint32_t>(kBar), tl::kWarpgroup);  // the T tiles; A and T are free

    // ---- W = T diag(beta exp(c)) Kn, U = T diag(beta) V; the -W^T image; V_new = U + (-W) S0
    float w[kB][32], u[kB][32];
    tl::zero(w);
    tl::zero(u);
    tl::begin_products();
    tl::product_ss<bf16, D, 64, 1>(w, S.tw, S.kn, false);
    tl::product_ss<TQ, D, 64, 1>(u, S.tu, S.v, false);
    tl::finish(w);
    tl::fence(u);
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        w[b][e] = -w[b][e];
        put_image_one(S.u.stage0, kHalf, 64 * b + ac.col(e), ac.row(e), w[b][e]);  // row a, column t
      }
    ship(S.u.stage0, ip.qw + Im::kQWTile, ip.qw + Im::kQWPart + Im::kQWTile, Im::kQWTile, kBar, lo_parts);
    tl::product_rs<bf16, D, 1>(u, w, S.h, D * 128);
    tl::finish(u);
    // V_new in the inputs' type: dqk (below high, as this kernel) stages it so anyway.
    tl::store_acc16<TQ>(ac, reinterpret_cast<TQ*>(P.vn) + r * kC * D, D, u);
  } else {
    constexpr auto kBar = PrepBarrier::kWg1;
    // ---- P^T = (scale lower(Qn Kn^T) (.) D)^T, dvl = P^T dO ---------------------------------
    float pt[1][32], dv[kB][32];
    tl::zero(pt);
    tl::zero(dv);
    tl::begin_products();
    tl::product_ss<TQ, 64, D, 0>(pt, S.kr, S.qr, false);
    tl::finish(pt);
    {  // (j, i) = (row, column): P_ij, every element computed, j <= i kept
      float cj[2], rkj[2], ci[16], rqi[16];
      ac.rows_of(s_c, cj), ac.rows_of(s_rk, rkj);
      ac.cols_of(s_c, ci), ac.cols_of(s_rq, rqi);
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int a = tl::AccCoord::row_slot(e), b = tl::AccCoord::col_slot(e);
        const float x = P.scale * expf(ci[b] - cj[a]) * (rqi[b] * rkj[a] * pt[0][e]);
        pt[0][e] = ac.row(e) <= ac.col(e) ? x : 0.f;
      }
    }
    tl::product_rs<TQ, D, 1>(dv, pt, S.o);
    tl::finish(dv);
    store_rows(P.dvn + r * kC * D, dv);

    // ---- images: K~ (rows t, pairs along a), Q~^T and dO^T (rows a / v, pairs along t) -------
    // Kn and Qn were read at the start but are out of L2 by now (a unit's traffic fills it
    // within a few units): each loop issues all of its thread's loads before it writes them
    // (64 values), one DRAM round trip a loop.
    {  // K~: consecutive threads take consecutive pairs of a row (conflict-free writes)
      constexpr int kItems = kC * D / 2 / tl::kWarpgroup;
      float2 x[kItems];
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int p = wtid + u * tl::kWarpgroup, t = p / (D / 2), a = 2 * (p % (D / 2));
        x[u] = __ldg(reinterpret_cast<const float2*>(kn + t * lds + a));
      }
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int p = wtid + u * tl::kWarpgroup, t = p / (D / 2), a = 2 * (p % (D / 2));
        put_image_pair(S.stage1 + (a / 64) * 64 * 128, kHalf, t, a % 64, s_ke[t] * x[u].x, s_ke[t] * x[u].y);
      }
    }
    ship(S.stage1, ip.k, ip.k + Im::kKPart, Im::kKPart, kBar, lo_parts);
    {  // Q~^T: lane l takes the token pair 2 l, 2 l + 1 and 8 consecutive a (one 32-byte sector
       // of each token's row); each write is then one whole 128-byte image row for the warp
      const int lane = wtid & 31, warp = wtid >> 5, t = 2 * lane;
      constexpr int kItems = D / 8 / 4;  // 8-wide groups of a per warp
      float4 x[kItems][4];
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int a = 8 * (warp + 4 * u);
        const float4* r0 = reinterpret_cast<const float4*>(qn + t * lds + a);
        const float4* r1 = reinterpret_cast<const float4*>(qn + (t + 1) * lds + a);
        x[u][0] = __ldg(r0);
        x[u][1] = __ldg(r0 + 1);
        x[u][2] = __ldg(r1);
        x[u][3] = __ldg(r1 + 1);
      }
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int a = 8 * (warp + 4 * u);
        const float e0 = s_qe[t], e1 = s_qe[t + 1];
        const float q0[8] = {x[u][0].x, x[u][0].y, x[u][0].z, x[u][0].w, x[u][1].x, x[u][1].y, x[u][1].z, x[u][1].w};
        const float q1[8] = {x[u][2].x, x[u][2].y, x[u][2].z, x[u][2].w, x[u][3].x, x[u][3].y, x[u][3].z, x[u][3].w};
#pragma unroll
        for (int k = 0; k < 8; ++k) put_image_pair(S.stage1, kHalf, a + k, t, e0 * q0[k], e1 * q1[k]);
      }
    }
    ship(S.stage1, ip.qw, ip.qw + Im::kQWPart, Im::kQWTile, kBar, lo_parts);
    // dO^T from dO's tile (rows past len are zero there): items are 2 x 2 blocks, rows v, v + 1.
    const uint8_t* ot = reinterpret_cast<const uint8_t*>(S.o);
    constexpr int kBatch = 8;
    // item p: row (lane & 7) + 8 ((p / 32) % (D / 16)), column pair (lane >> 3) + 4 ((p / 32) / (D / 16))
    const auto row_of = [](int p, int rows) { return (p & 7) + 8 * ((p >> 5) % (rows / 8)); };
    const auto pair_of = [](int p, int rows) { return ((p & 31) >> 3) + 4 * ((p >> 5) / (rows / 8)); };
    for (int p0 = wtid; p0 < D * kC / 4; p0 += kBatch * tl::kWarpgroup) {
      float2 x[kBatch][2];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int p = p0 + u * tl::kWarpgroup, v = 2 * row_of(p, D / 2), t = 2 * pair_of(p, D / 2);
        x[u][0] = tl::get2<TQ>(ot, t, v);
        x[u][1] = tl::get2<TQ>(ot, t + 1, v);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int p = p0 + u * tl::kWarpgroup, v = 2 * row_of(p, D / 2), t = 2 * pair_of(p, D / 2);
        put_image_pair(S.stage1, kHalf, v, t, x[u][0].x, x[u][1].x);
        put_image_pair(S.stage1, kHalf, v + 1, t, x[u][0].y, x[u][1].y);
      }
    }
    ship(S.stage1, ip.o, ip.o + Im::kOPart, Im::kOPart, kBar, lo_parts && kDoLo);
  }
}

}  // namespace

void launch_bwd_prep_sm90(const BwdParams& P, cudaStream_t s) {
  launch_bwd_qk_prep(P, s);
  dispatch_dim_type(P, [&](auto c) {
    using C = decltype(c);
    using TQ = typename C::TQ;
    using Smem = PrepSmem<C::D, TQ>;
    dispatch_states_type<TQ>(P, [&](auto h16) {
      launch_per_chunk(prep_sm90_kernel<C::D, TQ, decltype(h16)::value>, tl::kThreads,
                       dynamic_smem_1024_bytes<Smem>(), P, s, "bwd prep (sm90)");
    });
  });
}

}  // namespace flashgdn::cuda::bwd
