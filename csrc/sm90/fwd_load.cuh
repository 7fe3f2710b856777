// Producer role of the Hopper forward (warpgroup 0): fills the input ring, chunk by chunk.
//   warp 0 (one lane): TMA loads of the Q, K, V tiles, announced on in_full with their bytes;
//   warp 1: the per-token gate inputs g and beta of the chunk (strided, 4 or 2 bytes a token:
//           too narrow for TMA), 32 arrivals on in_full.
// Both wait for in_empty of the stage before overwriting it.
#pragma once

#include "cuda/device_utils.cuh"
#include "sm90/fwd_params.h"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_smem.cuh"

namespace flashgdn::sm90 {

// The tile at (column block, head h, token t, batch row b) of a map whose outer dimensions are in
// `o`'s order.
__device__ __forceinline__ void tma_load_tile(void* dst, const CUtensorMap* map, const TileMapOrder& o,
                                              Mbarrier* bar, int blk, int32_t h, int32_t t, int32_t b) {
  auto at = [&](int k) { return o.h == k ? h : (o.t == k ? t : b); };
  tma_load_4d(dst, map, bar, blk * 64, at(1), at(2), at(3));
}

template <class Tr>
__device__ __forceinline__ void fwd_load_tiles(const FwdParams& p, FwdSmem<Tr>& sm,
                                               const WorkItem& w) {
  prefetch_tensormap(&p.tma_q);
  prefetch_tensormap(&p.tma_k);
  prefetch_tensormap(&p.tma_v);
  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pos(j);
    auto& st = sm.in[pos.stage];
    sm.in_empty[pos.stage].wait(pos.phase ^ 1);
    Mbarrier* full = &sm.in_full[pos.stage];
    full->arrive_expect_tx(Tr::kTmaBytes);
    const int32_t t = static_cast<int32_t>(w.t0 + j * 64);
    const int32_t b = static_cast<int32_t>(w.b);
#pragma unroll
    for (int blk = 0; blk < Tr::kBlocks; ++blk) {
      const int32_t hq = static_cast<int32_t>(w.hq), h = static_cast<int32_t>(w.h);
      tma_load_tile(&st.qk[blk][0][0], &p.tma_q, p.order_q, full, blk, hq, t, b);
      tma_load_tile(&st.qk[blk][64][0], &p.tma_k, p.order_k, full, blk, hq, t, b);
      tma_load_tile(&st.v[blk][0][0], &p.tma_v, p.order_v, full, blk, h, t, b);
    }
  }
}

template <class Tr>
__device__ __forceinline__ void fwd_load_gates(const FwdParams& p, FwdSmem<Tr>& sm,
                                               const WorkItem& w, int lane) {
  // Tokens lane and lane + 32 of chunk j; the loads of chunk j + 1 are issued before waiting for
  // chunk j's stage, so their latency hides behind that wait.
  auto load = [&](int32_t j, float (&gv)[2], float (&bv)[2]) {
    const int len = w.chunk_len(j);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = lane + 32 * u;
      gv[u] = bv[u] = 0.f;
      if (i < len) {
        const int64_t t = static_cast<int64_t>(w.t0) + j * 64 + i;
        gv[u] = cuda::load_as_float(p.g, p.g_dtype, w.b * p.gs0 + t * p.gs1 + w.h * p.gs2);
        bv[u] = cuda::load_as_float(p.beta, p.beta_dtype, w.b * p.bs0 + t * p.bs1 + w.h * p.bs2);
      }
    }
  };
  float gn[2], bn[2];
  if (w.nchunks > 0) load(0, gn, bn);
  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pos(j);
    auto& st = sm.in[pos.stage];
    const float gv[2] = {gn[0], gn[1]}, bv[2] = {bn[0], bn[1]};
    if (j + 1 < w.nchunks) load(j + 1, gn, bn);
    sm.in_empty[pos.stage].wait(pos.phase ^ 1);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      st.g_raw[lane + 32 * u] = gv[u];
      st.beta_raw[lane + 32 * u] = bv[u];
    }
    sm.in_full[pos.stage].arrive();
  }
}

}  // namespace flashgdn::sm90
