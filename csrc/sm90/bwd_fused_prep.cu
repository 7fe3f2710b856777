// The fused backward's step 2 (bwd_fused.cu): per (chunk slot, q/k head), q and k normalised and
// rounded to bf16, K K^T, and per value head c, beta, the gate-free inverse Ar and the reverse CP
// certificate's bound.
#include "sm90/bwd_fused.h"
#include "sm90/bwd_tiles.cuh"
#include "sm90/fwd_inverse.cuh"

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

// Four CTAs an SM (128 registers a thread at most; 134 took three). The kernel waits on memory
// latency, not bandwidth: its loads are batched (rows, groups, the next value head's gates) so
// that one wait covers many (16/64 1x32768: 1.06 -> 0.78 ms, bench/NOTES.md).
__global__ void __launch_bounds__(tl::kWarpgroup, 4) fused_prep_kernel(BwdParams P, FusedBuffers F) {
  const int64_t gc = blockIdx.x, hq = blockIdx.y;
  ChunkInfo ci;
  if (!locate_chunk(P.seq, gc, ci)) return;  // a surplus slot: the fused kernel reads none
  auto& S = dynamic_smem_1024<PrepSmem>();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, len = ci.len;
  const tl::AccCoord ac(tid);
  constexpr int kGroups = kC * kD / 8;  // 8-value groups of a 64 x 128 tile
  const bf16* q = static_cast<const bf16*>(P.q.data);
  const bf16* k = static_cast<const bf16*>(P.k.data);
  auto q_row = [&](int i) { return q + tok_off(P.q, ci.b, ci.t0 + i, hq); };
  auto k_row = [&](int i) { return k + tok_off(P.k, ci.b, ci.t0 + i, hq); };
  // The first value head's gates, in flight under the keys' loads.
  TokenGate tg = tid < kC ? load_token_gate(P, ci, hq * P.group, tid) : TokenGate{};

  // Each row's scale, a warp the rows warp + 4 j, element lane + 32 u in lane's u-th slot summed by
  // warp_l2norm_rnorm (qk_prep's order: the forward's bits), eight rows' loads in flight at a time:
  // a row at a time waited out each load's latency.
  constexpr int kBatch = 8;
  for (int j0 = 0; j0 < kC / 4; j0 += kBatch) {
    float vq[kBatch][kD / 32], vk[kBatch][kD / 32];
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      const int i = warp + 4 * (j0 + r);
      const bool live = P.l2norm && i < len;  // warp-uniform
#pragma unroll
      for (int u = 0; u < kD / 32; ++u) {
        vq[r][u] = live ? to_float(q_row(i)[lane + 32 * u]) : 0.f;
        vk[r][u] = live ? to_float(k_row(i)[lane + 32 * u]) : 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      const int i = warp + 4 * (j0 + r);
      const bool live = P.l2norm && i < len;
      const float sq = live ? warp_l2norm_rnorm(vq[r]) : 1.f, sk = live ? warp_l2norm_rnorm(vk[r]) : 1.f;
      if (lane == 0) {
        S.sq[i] = sq, S.sk[i] = sk;
        if (P.l2norm) {  // kept for the reduce's norm backward (the same scale, not recomputed from x there)
          float* const rs = F.row_scale + (gc * P.Hq + hq) * 2 * kC;
          rs[i] = sq, rs[kC + i] = sk;
        }
      }
    }
  }
  __syncthreads();
  // K (zero past the length) to the tile and to k16; Q to q16, four groups' loads of each in
  // flight before their stores.
  constexpr int kPerThread = kGroups / tl::kWarpgroup, kInFlight = 4;
  for (int it0 = 0; it0 < kPerThread; it0 += kInFlight) {
    uint4 kx[kInFlight], qx[kInFlight];
#pragma unroll
    for (int r = 0; r < kInFlight; ++r) {
      const int x = tid + (it0 + r) * tl::kWarpgroup, row = x / (kD / 8), c8 = x % (kD / 8);
      kx[r] = row8(k_row(row), row, len, c8);
      qx[r] = row8(q_row(row), row, len, c8);
    }
#pragma unroll
    for (int r = 0; r < kInFlight; ++r) {
      const int x = tid + (it0 + r) * tl::kWarpgroup, row = x / (kD / 8), c8 = x % (kD / 8);
      const int64_t qk = qk_row(P, gc, row, hq);
      const uint4 kv = scale8(kx[r], S.sk[row]);
      tl::put8(S.kr, tl::kTile64, row, c8, kv);
      reinterpret_cast<uint4*>(F.k16 + qk * kD)[c8] = kv;
      reinterpret_cast<uint4*>(F.q16 + qk * kD)[c8] = scale8(qx[r], S.sq[row]);
    }
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
    // The next value head's gates, in flight under this one's scan and inverse.
    const TokenGate next = tid < kC && g + 1 < P.group ? load_token_gate(P, ci, h + 1, tid) : TokenGate{};
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
    tg = next;
  }
}

}  // namespace

void launch_fused_prep(const BwdParams& P, const FusedBuffers& F, cudaStream_t s) {
  constexpr size_t kPrepSmem = dynamic_smem_1024_bytes<PrepSmem>();
  set_dynamic_smem(fused_prep_kernel, kPrepSmem);
  fused_prep_kernel<<<dim3(P.num_chunks, P.Hq), tl::kWarpgroup, kPrepSmem, s>>>(P, F);
  FGDN_CHECK_LAUNCH("bwd fused prep");
}

}  // namespace flashgdn::cuda::bwd
