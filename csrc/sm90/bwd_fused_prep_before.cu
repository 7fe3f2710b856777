// EXPERIMENT (exp/prep-latency; out before landing): main's prep kernel, for an A/B in one build
// (FLASHGDN_EXP_OLD_PREP=1); main's reduce kernel below it.
// The fused backward's step 2 (bwd_fused.cu): per (chunk slot, q/k head), q and k normalised and
// rounded to bf16, K K^T, and per value head c, beta, the gate-free inverse Ar and the reverse CP
// certificate's bound.
#include "sm90/bwd_fused.h"
#include "sm90/bwd_tiles.cuh"
#include "sm90/fwd_inverse.cuh"
#include "sm90/ptx.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::cuda::bwd {

namespace {

namespace fk = sm90::fused_bwd;
namespace tl = sm90::tiles;
using bf16 = __nv_bfloat16;
constexpr int kD = 128;

// One warpgroup per (chunk slot, q/k head): q and k normalised (l2norm) and rounded to bf16, the
// keys staged once as a bf16 tile (the values the fused kernel multiplies), K K^T on wgmma (fp32
// accumulation), then for each value head of the group: c and beta (scan_chunk_gates), A =
// strict_lower(diag(beta) K K^T) and its inverse by the forward's blocked inverse
// (fwd_inverse.cuh, TF32 split products), Ar to a swizzled tile, the certificate's bound; and the
// rows of q, k (once) and v, dO (each value head) in slot layout, zero past the length (v, dO: of
// every chunk where the kernel cannot read them in place, else of a packed sequence's partial last
// chunk alone, to its tail).
struct PrepSmem {
  alignas(1024) uint8_t kr[2 * tl::kTile64];  // K [64 tokens][128]: two 64-column tiles
  float af[kC][sm90::kLdF];                    // A (its upper triangle: the inverse's scratch)
  float tf[kC][sm90::kLdF];                    // T = Ar
  float c[kC], beta[kC];
  float knorm[kC];     // |k_t|^2 of the bf16 keys (K K^T's diagonal), for the CP certificate
  float sq[kC], sk[kC];  // each row's scale: 1 / ||x|| with the in-kernel l2norm, else 1
};

// Row `row`'s 8 values at column 8 c8 as bf16 (zero past len) from a 16-bit token row.
__device__ __forceinline__ uint4 row8(const bf16* base, int row, int len, int c8) {
  return row < len ? __ldg(reinterpret_cast<const uint4*>(base) + c8) : make_uint4(0, 0, 0, 0);
}
// 8 bf16 values times s, rounded to bf16 (bf16(x s): qk_prep's fp32 x s, then the rounding).
__device__ __forceinline__ uint4 scale8(uint4 x, float s) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = sm90::unpack2<bf16>(w[i]);
    o[i] = cuda::pack2<bf16>(f.x * s, f.y * s);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

__global__ void __launch_bounds__(tl::kWarpgroup) fused_prep_kernel_before(BwdParams P, FusedBuffers F) {
  const int64_t gc = blockIdx.x, hq = blockIdx.y;
  ChunkInfo ci;
  if (!locate_chunk(P.seq, gc, ci)) return;  // a surplus slot: the fused kernel reads none
  auto& S = dynamic_smem_1024<PrepSmem>();
  const int tid = threadIdx.x, len = ci.len;
  const tl::AccCoord ac(tid);
  constexpr int kGroups = kC * kD / 8;  // 8-value groups of a 64 x 128 tile
  const bf16* q = static_cast<const bf16*>(P.q.data);
  const bf16* k = static_cast<const bf16*>(P.k.data);
  auto q_row = [&](int i) { return q + tok_off(P.q, ci.b, ci.t0 + i, hq); };
  auto k_row = [&](int i) { return k + tok_off(P.k, ci.b, ci.t0 + i, hq); };

  // Each row's scale, a warp 16 rows.
  for (int i = tid >> 5; i < kC; i += tl::kWarpgroup / 32) {
    float sq = 1.f, sk = 1.f;
    if (P.l2norm && i < len) sq = warp_row_rnorm<kD>(q_row(i), tid & 31), sk = warp_row_rnorm<kD>(k_row(i), tid & 31);
    if ((tid & 31) == 0) S.sq[i] = sq, S.sk[i] = sk;
  }
  __syncthreads();
  // K (zero past the length) to the tile and to k16; Q to q16.
  for (int x = tid; x < kGroups; x += tl::kWarpgroup) {
    const int row = x / (kD / 8), c8 = x % (kD / 8);
    const int64_t qk = qk_row(P, gc, row, hq);
    const uint4 kv = scale8(row8(k_row(row), row, len, c8), S.sk[row]);
    tl::put8(S.kr, tl::kTile64, row, c8, kv);
    reinterpret_cast<uint4*>(F.k16 + qk * kD)[c8] = kv;
    reinterpret_cast<uint4*>(F.q16 + qk * kD)[c8] = scale8(row8(q_row(row), row, len, c8), S.sq[row]);
  }
  sm90::fence_proxy_async();  // the tile, written by ordinary stores, is read by wgmma
  __syncthreads();
  float kk[1][32];
  tl::begin_products();
  tl::product_ss<bf16, 64, kD, 0>(kk, S.kr, S.kr, false);
  tl::finish(kk);
#pragma unroll
  for (int e = 0; e < 32; ++e)
    if (ac.row(e) == ac.col(e)) S.knorm[ac.row(e)] = kk[0][e];

  const auto sync = [] { __syncthreads(); };
  for (int64_t g = 0; g < P.group; ++g) {
    const int64_t h = hq * P.group + g, u = gc * P.Hv + h;
    const TokenGate tg = tid < kC ? load_token_gate(P, ci, h, tid) : TokenGate{};
    // v, dO rows of this value head (their loads in flight under the scan and the inverse): the
    // slot's, or sequence n's tail rows n 64 + i.
    const bool tail = F.v_tail != nullptr && len < kC;
    bf16* const vd = F.v16 != nullptr ? F.v16 : tail ? F.v_tail : nullptr;
    bf16* const dd = F.v16 != nullptr ? F.do16 : F.do_tail;
    const int64_t row0 = (F.v16 != nullptr ? gc : ci.n) * kC;
    for (int x = tid; vd != nullptr && x < kGroups; x += tl::kWarpgroup) {
      const int row = x / (kD / 8), c8 = x % (kD / 8);
      const int64_t t = ci.t0 + row, dst = ((row0 + row) * P.Hv + h) * kD;
      reinterpret_cast<uint4*>(vd + dst)[c8] =
          row8(static_cast<const bf16*>(P.v.data) + tok_off(P.v, ci.b, t, h), row, len, c8);
      reinterpret_cast<uint4*>(dd + dst)[c8] =
          row8(static_cast<const bf16*>(P.d_o.data) + tok_off(P.d_o, ci.b, t, h), row, len, c8);
    }
    scan_chunk_gates(tg, S.c, S.beta);  // (c held and beta zero past the length)
    if (tid < kC) {
      F.gates[u * 2 * kC + tid] = S.c[tid];
      F.gates[u * 2 * kC + kC + tid] = S.beta[tid];
    }
    float bi[2];
    ac.rows_of(S.beta, bi);
#pragma unroll
    for (int e = 0; e < 32; ++e)
      S.af[ac.row(e)][ac.col(e)] = ac.row(e) > ac.col(e) ? bi[tl::AccCoord::row_slot(e)] * kk[0][e] : 0.f;
    for (int e = tid; e < kC * sm90::kLdF; e += tl::kWarpgroup) (&S.tf[0][0])[e] = 0.f;
    sync();
    if (tid < 32) {  // the certificate's bound (fk::transfer_negligible): c_L + sum_t log max(1, |1 - beta_t |k_t|^2|)
      float l = 0.f;
      for (int t = tid; t < kC; t += 32) l += logf(fmaxf(1.f, fabsf(1.f - S.beta[t] * S.knorm[t])));
      l = warp_sum(l);
      if (tid == 0) F.bound[u] = S.c[kC - 1] + l;
    }
    sm90::invert_chunk<true>(S, tid >> 5, tid & 31, sync);
    uint8_t* tile = F.ar + u * fk::kSmall;
    for (int x = tid; x < kC * kC / 2; x += tl::kWarpgroup) {
      const int i = x / (kC / 2), j = 2 * (x % (kC / 2));
      const float2 t = *reinterpret_cast<const float2*>(&S.tf[i][j]);
      tl::put2<bf16>(tile, tl::kTile64, i, j, t.x, t.y);
    }
    sync();  // af, tf, c, beta free for the next value head
  }
}

}  // namespace

void launch_fused_prep_before(const BwdParams& P, const FusedBuffers& F, cudaStream_t s) {
  constexpr size_t kPrepSmem = dynamic_smem_1024_bytes<PrepSmem>();
  set_dynamic_smem(fused_prep_kernel_before, kPrepSmem);
  fused_prep_kernel_before<<<dim3(P.num_chunks, P.Hq), tl::kWarpgroup, kPrepSmem, s>>>(P, F);
  FGDN_CHECK_LAUNCH("bwd fused prep");
}

}  // namespace flashgdn::cuda::bwd

namespace flashgdn::cuda::bwd {

namespace {


// Four adjacent values (i, 4 l .. 4 l + 3) of a 64 x 128 tile in the kernel's shared layout (two
// 64-column blocks, 128-byte swizzle): one 8-byte load.
__device__ __forceinline__ float4 tile4(const uint8_t* t, int i, int lane) {
  const int col = 4 * lane;
  const uint2 u = *reinterpret_cast<const uint2*>(t + (col >> 6) * 64 * 128 + sm90::swizzle128(i, (col & 63) >> 3) +
                                                  (col & 7) * 2);
  const float2 a = sm90::unpack2<bf16>(u.x), c = sm90::unpack2<bf16>(u.y);
  return make_float4(a.x, a.y, c.x, c.y);
}
__device__ __forceinline__ void store4(bf16* o, float4 x) {
  *reinterpret_cast<uint2*>(o) = make_uint2(cuda::pack2<bf16>(x.x, x.y), cuda::pack2<bf16>(x.z, x.w));
}

// One block per (chunk slot, q/k head): a warp a token, four columns a lane. dq, dk = the sum over
// the group's value heads (ascending) of the tiles, then (l2norm) dx = r (dx^ - x^ (x^ . dx^));
// dv and dbeta of the group's value heads copied out.
__global__ void __launch_bounds__(kThreads) fused_reduce_kernel_before(BwdParams P, FusedBuffers F) {
  const int64_t gc = blockIdx.x, hq = blockIdx.y;
  ChunkInfo ci;
  if (!locate_chunk(P.seq, gc, ci)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < ci.len; i += kThreads / 32) {
    for (int which = 0; which < 2; ++which) {  // 0: dq (tile 2), 1: dk (tile 0)
      float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int64_t g = 0; g < P.group; ++g) {
        const int64_t tile = (gc * P.Hv + hq * P.group + g) * F.out_count + (which == 0 ? F.out_count - 1 : 0);
        const float4 x = tile4(F.out + tile * fk::kTile, i, lane);
        d.x += x.x, d.y += x.y, d.z += x.z, d.w += x.w;
      }
      if (P.l2norm) {  // x^ = x / ||x||, as the prep scaled it
        const Tensor4& xt = which == 0 ? P.q : P.k;
        const bf16* x = static_cast<const bf16*>(xt.data) + tok_off(xt, ci.b, ci.t0 + i, hq);
        const float rn = warp_row_rnorm<kD>(x, lane);
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(x) + lane);
        const float2 x01 = sm90::unpack2<bf16>(raw.x), x23 = sm90::unpack2<bf16>(raw.y);
        const float4 xn = make_float4(x01.x * rn, x01.y * rn, x23.x * rn, x23.y * rn);
        const float dot = warp_sum(xn.x * d.x + xn.y * d.y + xn.z * d.z + xn.w * d.w);
        d = make_float4(rn * (d.x - xn.x * dot), rn * (d.y - xn.y * dot), rn * (d.z - xn.z * dot),
                        rn * (d.w - xn.w * dot));
      }
      const Tensor4& out = which == 0 ? P.dq : P.dk;
      store4(static_cast<bf16*>(out.data) + tok_off(out, ci.b, ci.t0 + i, hq) + 4 * lane, d);
    }
    for (int64_t g = 0; g < P.group; ++g) {
      const int64_t h = hq * P.group + g, u = gc * P.Hv + h;
      if (!F.dv_direct)
        store4(static_cast<bf16*>(P.dv.data) + tok_off(P.dv, ci.b, ci.t0 + i, h) + 4 * lane,
               tile4(F.out + (u * 3 + 1) * fk::kTile, i, lane));
      else if (F.dv_tail != nullptr && ci.len < kC)  // a packed sequence's tail (FusedLayout::tails)
        store4(static_cast<bf16*>(P.dv.data) + tok_off(P.dv, ci.b, ci.t0 + i, h) + 4 * lane,
               tile4(F.dv_tail + (ci.n * P.Hv + h) * fk::kTile, i, lane));
      if (lane == 0)
        store_from_float(P.dbeta.data, P.beta_dtype, ci.b * P.dbeta.s0 + (ci.t0 + i) * P.dbeta.s1 + h * P.dbeta.s2,
                         F.dbeta[u * kC + i]);
    }
  }
}

}  // namespace

void launch_fused_reduce_before(const BwdParams& P, const FusedBuffers& F, cudaStream_t s) {
  fused_reduce_kernel_before<<<dim3(P.num_chunks, P.Hq), kThreads, 0, s>>>(P, F);
  FGDN_CHECK_LAUNCH("bwd fused reduce");
}

}  // namespace flashgdn::cuda::bwd
