// Backward at `fast` by the fused reverse kernel (bwd_fused_kernel.cuh), K = V = 128, bf16:
//   1. states   chunk-start states h, bf16 (chunk_bwd_state.cu, as the staged chain)
//   2. prep     per (chunk, q/k head): q, k normalised (with the in-kernel l2norm) and rounded to
//               bf16 in slot layout (zero past the length), K K^T once, then per value head c
//               and beta and Ar = (I + strict_lower(diag(beta) K K^T))^-1 from the bf16 keys, no
//               gates; v, dO too on varlen calls (dense calls read the user's v, dO in place:
//               FusedLayout::vo_direct)
//   3. fused    per (sequence, value head): the reverse walk -> dk, dv, dq tiles, dg, dbeta, dh0;
//               under reverse CP (bwd_dh_plan.h's segments, when the chains are too few for the
//               SMs) per segment: 3a. each segment's transfer dS -> A_s dS + B_s (two walks that
//               write no gradient; A_s's not where the gates certify it negligible), 3b. the scan
//               X = A_s X + B_s from dht, segment by segment, for the carry at each segment's
//               end, 3c. every segment's walk from that carry
//   4. reduce   per (chunk, q/k head): dq, dk summed over the group's value heads in ascending
//               order, the l2norm's backward (1 / ||x|| recomputed), dv (where the kernel did
//               not store it in place: FusedLayout::dv_direct) and dbeta to the user's tensors;
//               then the gate step (chunk_bwd_reduce.cu) from dg.
// Selected by chunk_bwd.cu (fused_backward_applies); its workspace: fused_layout().
#include "sm90/bwd_fused.h"

#include <algorithm>
#include <cstdlib>

#include "cuda/bwd_dh_plan.h"

#include "sm90/bwd_fused_kernel.cuh"
#include "sm90/bwd_tiles.cuh"
#include "sm90/fwd_inverse.cuh"
#include "sm90/tma.h"

namespace flashgdn::cuda::bwd {

namespace {

namespace fk = sm90::fused_bwd;
namespace tl = sm90::tiles;
using bf16 = __nv_bfloat16;
constexpr int kD = 128;

size_t align256(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

// 1 / ||x|| of a token row of q or k (128 bf16 values) by a warp, summed as qk_prep sums it
// (chunk_bwd_prep.cu: element lane + 32 u a lane), so the staged and the fused backward scale by
// the same bits: the prep's l2norm and the reduce's backward of it.
__device__ __forceinline__ float row_rnorm(const bf16* x, int lane) {
  float v[kD / 32];
#pragma unroll
  for (int u = 0; u < kD / 32; ++u) v[u] = __bfloat162float(x[lane + 32 * u]);
  return warp_l2norm_rnorm(v);
}

// ---- 2. prep --------------------------------------------------------------------------------
// One warpgroup per (chunk slot, q/k head): q and k normalised (l2norm) and rounded to bf16, the
// keys staged once as a bf16 tile (the values the fused kernel multiplies), K K^T on wgmma (fp32
// accumulation), then for each value head of the group: c and beta (scan_chunk_gates), A =
// strict_lower(diag(beta) K K^T) and its inverse by the forward's blocked inverse
// (fwd_inverse.cuh, TF32 split products), Ar to a swizzled tile, the certificate's bound; and the
// rows of q, k (once) and v, dO (each value head) in slot layout, zero past the length.
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

__global__ void __launch_bounds__(tl::kWarpgroup) fused_prep_kernel(BwdParams P, FusedBuffers F) {
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
    if (P.l2norm && i < len) sq = row_rnorm(q_row(i), tid & 31), sk = row_rnorm(k_row(i), tid & 31);
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
    // v, dO rows of this value head (their loads in flight under the scan and the inverse).
    for (int x = tid; F.v16 != nullptr && x < kGroups; x += tl::kWarpgroup) {
      const int row = x / (kD / 8), c8 = x % (kD / 8);
      const int64_t t = ci.t0 + row, dst = ((gc * kC + row) * P.Hv + h) * kD;
      reinterpret_cast<uint4*>(F.v16 + dst)[c8] =
          row8(static_cast<const bf16*>(P.v.data) + tok_off(P.v, ci.b, t, h), row, len, c8);
      reinterpret_cast<uint4*>(F.do16 + dst)[c8] =
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

// ---- 5. reduce ------------------------------------------------------------------------------
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
__global__ void __launch_bounds__(kThreads) fused_reduce_kernel(BwdParams P, FusedBuffers F) {
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
        const float rn = row_rnorm(x, lane);
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
      if (lane == 0)
        store_from_float(P.dbeta.data, P.beta_dtype, ci.b * P.dbeta.s0 + (ci.t0 + i) * P.dbeta.s1 + h * P.dbeta.s2,
                         F.dbeta[u * kC + i]);
    }
  }
}

// ---- 4b. the reverse CP scan ------------------------------------------------------------------
// Per (sequence, value head, 8 columns of the carry): X = dht (0 without), then for the segments
// s = last .. 1: X = A_s X + B_s (fp32), the carry at segment s - 1's end, to seeds[s - 1]. The
// carry's columns evolve independently (every product of the walk multiplies dS from the left),
// so 16 CTAs share a chain. A thread: one column, rows r0 + 32 j; A_s's rows padded to 132 floats
// so that a warp's four consecutive rows are four float4s in distinct banks.
constexpr int kScanCols = 8, kScanThreads = 256, kScanRows = kD * kScanCols / kScanThreads, kScanLd = kD + 4;
struct ScanSmem {
  float a[kD][kScanLd];
  float x[kD][kScanCols];
};

__global__ void __launch_bounds__(kScanThreads) fused_cp_scan_kernel(fk::Params K) {
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y, tid = threadIdx.x;
  const int total = static_cast<int>(ceil_div(seq_info(K.seq, n).len, int64_t{kC}));
  const int segs = (total + K.seg_chunks - 1) / K.seg_chunks;
  if (segs <= 1) return;
  auto& S = dynamic_smem_1024<ScanSmem>();
  const int col = tid % kScanCols, v = blockIdx.z * kScanCols + col, r0 = tid / kScanCols;
  const size_t chain = (size_t(n) * K.Hv + h) * K.segments;
  float x[kScanRows];
#pragma unroll
  for (int j = 0; j < kScanRows; ++j) {
    const int a = r0 + 32 * j;
    const int64_t o = n * K.dht.s0 + h * K.dht.s1 +
                      (K.state_v_first ? int64_t{v} * K.dht.s2 + a : int64_t{a} * K.dht.s2 + v);
    x[j] = K.has_dht ? load_as_float(K.dht.data, K.dht.dtype, o) : 0.f;
    S.x[a][col] = x[j];
  }
  const int u_first = static_cast<int>(chunk_slot(K.seq, n, 0, seq_info(K.seq, n).t0)) * K.Hv + h;
  for (int s = segs - 1; s >= 1; --s) {
    const float* Bm = K.cp_maps + (chain + s) * 2 * kD * kD;
#pragma unroll
    for (int j = 0; j < kScanRows; ++j) x[j] = __ldg(Bm + (r0 + 32 * j) * kD + v);
    const int first = s * K.seg_chunks;
    if (!fk::transfer_negligible(K.bound, u_first + first * K.Hv, min(total - first, K.seg_chunks), K.Hv)) {
      const float* A = K.cp_maps + ((chain + s) * 2 + 1) * kD * kD;
      for (int j = tid; j < kD * kD / 4; j += kScanThreads)
        *reinterpret_cast<float4*>(&S.a[j / (kD / 4)][4 * (j % (kD / 4))]) =
            __ldg(reinterpret_cast<const float4*>(A) + j);
      __syncthreads();  // A_s and X in shared memory
#pragma unroll 4
      for (int k = 0; k < kD; k += 4) {
        const float x0 = S.x[k][col], x1 = S.x[k + 1][col], x2 = S.x[k + 2][col], x3 = S.x[k + 3][col];
#pragma unroll
        for (int j = 0; j < kScanRows; ++j) {
          const float4 a = *reinterpret_cast<const float4*>(&S.a[r0 + 32 * j][k]);
          x[j] = fmaf(a.w, x3, fmaf(a.z, x2, fmaf(a.y, x1, fmaf(a.x, x0, x[j]))));
        }
      }
    }
    __syncthreads();  // every read of X and A_s done
    float* seed = const_cast<float*>(K.cp_seeds) + (chain + s - 1) * kD * kD;
#pragma unroll
    for (int j = 0; j < kScanRows; ++j) {
      S.x[r0 + 32 * j][col] = x[j];
      seed[(r0 + 32 * j) * kD + v] = x[j];
    }
  }
}

// A 4-D tile map over a slot-layout bf16 buffer [rows, heads, 128] (sm90/tma.h's box).
sm90::TileMap slot_map(const void* data, int64_t rows, int64_t heads) {
  fgdn_tensor t{};
  t.data = const_cast<void*>(data);
  t.dtype = FGDN_BFLOAT16;
  t.ndim = 4;
  const int64_t shape[4] = {1, rows, heads, kD};
  const int64_t strides[4] = {rows * heads * kD, heads * kD, kD, 1};
  for (int i = 0; i < 4; ++i) t.shape[i] = shape[i], t.strides[i] = strides[i];
  return sm90::make_tile_map(t);
}

}  // namespace

bool fused_backward_applies(const Problem& p) {
  const char* e = std::getenv("FLASHGDN_BWD_FUSED");
  return e != nullptr && std::atoi(e) == 1 && p.precision == FGDN_PRECISION_FAST && p.qkv_dtype == FGDN_BFLOAT16 &&
         p.K == kD && p.V == kD && (num_chunk_slots(p) + 1) * p.Hv * kD < (int64_t{1} << 31);  // 32-bit unit rows
}

FusedLayout fused_layout(const Problem& p, const fgdn_bwd_args& a) {
  const size_t S = static_cast<size_t>(num_chunk_slots(p)), C = kC, D = kD;
  const size_t Hq = static_cast<size_t>(p.Hq), Hv = static_cast<size_t>(p.Hv);
  const bool direct = !p.varlen && sm90::tile_map_direct(a.in.v) && sm90::tile_map_direct(a.d_o);
  const bool dv_direct = direct && sm90::tile_map_direct(a.dv);
  const size_t vo = direct ? 0 : S * C * Hv * D * 2;
  const DhPlan plan = dh_plan_segments(p, sm_count(p.device_id), /*fused=*/true);
  const size_t cp = plan.segments > 1 ? static_cast<size_t>(p.N) * Hv * plan.segments * D * D * 4 : 0;
  const size_t sizes[FusedLayout::kCount] = {
      S * C * Hq * D * 2, S * C * Hq * D * 2,  // q16, k16
      vo, vo,                                  // v16, do16
      S * Hv * 2 * C * 4,                      // gates
      S * Hv * fk::kSmall,                     // ar
      S * Hv * (dv_direct ? 2 : 3) * fk::kTile,  // out
      S * Hv * C * 4, S * Hv * C * 4,          // dg, dbeta
      S * Hv * 4,                              // bound
      2 * cp, cp,                              // maps, seeds
  };
  FusedLayout L{};
  L.vo_direct = direct;
  L.dv_direct = dv_direct;
  L.segments = plan.segments;
  L.seg_chunks = plan.segments > 1 ? static_cast<int32_t>(plan.chunks) : 0;
  size_t o = 0;
  for (int i = 0; i < FusedLayout::kCount; ++i) {
    L.off[i] = o;
    o += align256(sizes[i]);
  }
  L.bytes = o;
  return L;
}

void launch_bwd_fused(const BwdParams& P, const fgdn_bwd_args& a, const FusedBuffers& F, cudaStream_t s) {
  const int64_t slots = P.num_chunks;
  if (slots > 0) {
    constexpr size_t kPrepSmem = dynamic_smem_1024_bytes<PrepSmem>();
    set_dynamic_smem(fused_prep_kernel, kPrepSmem);
    fused_prep_kernel<<<dim3(slots, P.Hq), tl::kWarpgroup, kPrepSmem, s>>>(P, F);
    FGDN_CHECK_LAUNCH("bwd fused prep");
  }
  fk::Params K{};
  const int64_t rows = slots * kC;
  K.tq = slot_map(F.q16, std::max<int64_t>(rows, 1), P.Hq);
  K.tk = slot_map(F.k16, std::max<int64_t>(rows, 1), P.Hq);
  K.vo_direct = F.v16 == nullptr;
  K.tv = K.vo_direct ? sm90::make_tile_map(a.in.v) : slot_map(F.v16, std::max<int64_t>(rows, 1), P.Hv);
  K.tdo = K.vo_direct ? sm90::make_tile_map(a.d_o) : slot_map(F.do16, std::max<int64_t>(rows, 1), P.Hv);
  K.ts0 = slot_map(P.h, (slots + 1) * P.Hv * kD, 1);  // bf16 h (states_in_bf16)
  K.dv_direct = F.dv_direct;
  K.out_count = F.out_count;
  if (F.dv_direct) K.tdv = sm90::make_tile_map(a.dv);
  K.seq = P.seq;
  K.Hv = static_cast<int32_t>(P.Hv);
  K.group = static_cast<int32_t>(P.group);
  K.ar = F.ar;
  K.gates = F.gates;
  K.out_tiles = F.out;
  K.dg = F.dg;
  K.dbeta = F.dbeta;
  K.dht = P.d_final_state;
  K.dh0 = P.dh0;
  K.state_indices = P.state_indices;
  K.has_dht = P.has_d_final_state;
  K.want_dh0 = P.want_dh0;
  K.state_v_first = P.state_v_first;
  K.has_state_indices = P.has_state_indices;
  K.idx_dtype = P.idx_dtype;
  K.scale = P.scale;
  K.seg_chunks = F.seg_chunks;
  K.segments = F.segments;
  K.cp_maps = F.maps;
  K.cp_seeds = F.seeds;
  K.bound = F.bound;
  constexpr size_t kSmem = sizeof(fk::Smem) + 1024;
  set_dynamic_smem(fk::fused_bwd, kSmem);
  if (P.N > 0 && P.Hv > 0) {  // a CTA a chain or segment (sequences of no chunks too: dh0 = dht)
    const unsigned N = static_cast<unsigned>(P.N), Hv = static_cast<unsigned>(P.Hv);
    if (F.seg_chunks > 0) {
      K.phase = 1;
      fk::fused_bwd<<<dim3(N, Hv, 2 * F.segments), fk::kThreads, kSmem, s>>>(K);
      FGDN_CHECK_LAUNCH("bwd fused (CP transfers)");
      constexpr size_t kScanSmem = dynamic_smem_1024_bytes<ScanSmem>();
      set_dynamic_smem(fused_cp_scan_kernel, kScanSmem);
      fused_cp_scan_kernel<<<dim3(N, Hv, kD / kScanCols), kScanThreads, kScanSmem, s>>>(K);
      FGDN_CHECK_LAUNCH("bwd fused (CP scan)");
    }
    K.phase = 0;
    fk::fused_bwd<<<dim3(N, Hv, F.segments), fk::kThreads, kSmem, s>>>(K);
    FGDN_CHECK_LAUNCH("bwd fused");
  }
  if (slots > 0) {
    fused_reduce_kernel<<<dim3(slots, P.Hq), kThreads, 0, s>>>(P, F);
    FGDN_CHECK_LAUNCH("bwd fused reduce");
  }
}

}  // namespace flashgdn::cuda::bwd
