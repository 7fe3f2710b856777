// Producer role of the Hopper forward (warpgroup 0): fills the input ring, chunk by chunk.
//   warp 2 (one lane): TMA loads of the Q, K, V tiles, announced on in_full with their bytes;
//   warp 3: the per-token gate inputs g and beta of the chunk (strided, 4 or 2 bytes a token:
//           too narrow for TMA), the in-kernel gate, the floor and the in-chunk cumulative sum;
//           then, once the k-norm warp has written fk (fk_full), the column exponents
//           u_t = c2_t - log2(fk_t); 32 arrivals on in_ready;
//   warps 0-1: the rows' norms (fwd_row_norms.cuh), 64 arrivals on in_ready.
// Warps 2 and 3 wait for in_empty of the stage before overwriting it.
#pragma once

#include "common/numerics.h"
#include "cuda/device_utils.cuh"
#include "sm90/fwd_epilogue.cuh"
#include "sm90/fwd_params.h"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_smem.cuh"

namespace flashgdn::sm90 {

// The tile at (column block, head h, token t, batch row b) of a map whose outer dimensions are in
// `o`'s order.
__device__ __forceinline__ void tma_load_tile(void* dst, const CUtensorMap* map, const TileMapOrder& o,
                                              Mbarrier* bar, int blk, int32_t h, int32_t t, int32_t b) {
  tma_load_4d(dst, map, bar, blk * 64, o.at(1, h, t, b), o.at(2, h, t, b), o.at(3, h, t, b));
}

template <class Tr>
__device__ __forceinline__ void fwd_load_tiles(const FwdParams& p, FwdSmem<Tr>& sm,
                                               const WorkItem& w, int32_t c0) {
  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pos(c0 + j);
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
      if (!Tr::kSplitColumns || blk == w.col) tma_load_tile(&st.v[blk][0][0], &p.tma_v, p.order_v, full, blk, h, t, b);
    }
    // The item's start state into L2 once its first chunk's loads are out, chunks before the
    // state role reads it.
    if (j == 0) prefetch_state_l2(initial_state_source(p, w), w.h, Tr::kD);
  }
}

// The gate of token t (within batch row b) of value head h as the kernels use it: the in-kernel
// gate from the activation when asked for, then the floor (common/numerics.h).
__device__ __forceinline__ float token_gate(const FwdParams& p, int64_t b, int64_t t, int32_t h) {
  float x = cuda::load_as_float(p.g, p.g_dtype, b * p.gs0 + t * p.gs1 + h * p.gs2);
  if (p.gate_in_kernel) {
    const float dt_bias = p.dt_bias != nullptr ? p.dt_bias[h] : 0.f;
    x = gate_from_activation(x + dt_bias, p.A_log[h]);
  }
  return gate_floor(x);
}

__device__ __forceinline__ float token_beta(const FwdParams& p, int64_t b, int64_t t, int32_t h) {
  return cuda::load_as_float(p.beta, p.beta_dtype, b * p.bs0 + t * p.bs1 + h * p.bs2);
}

template <class Tr>
__device__ __forceinline__ void fwd_load_gates(const FwdParams& p, FwdSmem<Tr>& sm,
                                               const WorkItem& w, int32_t c0, int lane) {
  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pos(c0 + j);
    const int len = w.chunk_len(j);
    // Tokens 2 lane and 2 lane + 1, loaded and summed before waiting for the stage (the loads'
    // latency hides behind that wait): c_t = g_1 + ... + g_t of the floored gate
    // (common/numerics.h), zero gates past the chunk.
    float g[2], b[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = 2 * lane + u;
      g[u] = b[u] = 0.f;
      if (i < len) {
        const int64_t t = static_cast<int64_t>(w.t0) + j * 64 + i;
        g[u] = token_gate(p, w.b, t, w.h);
        b[u] = token_beta(p, w.b, t, w.h);
      }
    }
    const float pair = g[0] + g[1];
    const float cum = (cuda::warp_inclusive_scan(pair) - pair) + g[0];
    sm.in_empty[pos.stage].wait(pos.phase ^ 1);
    auto& st = sm.in[pos.stage];
    *reinterpret_cast<float2*>(&st.c2[2 * lane]) = make_float2(cum * kLog2e, (cum + g[1]) * kLog2e);
    *reinterpret_cast<float2*>(&st.beta[2 * lane]) = make_float2(b[0], b[1]);
    // u_t = c2_t - log2(fk_t): one value a column for the chunk-local role's gating, which
    // loads its columns' values two blocks ahead instead of c2 and fk block by block (each load
    // a round trip through the loaded shared-memory pipe: bench/NOTES.md). (log2f: exact to an
    // ulp; fk = 0 past the chunk gives u = +inf and a factor 2^-inf = 0.) fk arrives by an
    // mbarrier of the stage, not a named barrier the two warps meet: the k-norm warp need not
    // wait (the stage is rewritten only after in_empty, which this warp's in_ready precedes),
    // and compute-sanitizer's synccheck reported the named barrier reached divergent
    // (docs/reliability.md).
    sm.fk_full[pos.stage].wait(pos.phase);
    const float2 fk = *reinterpret_cast<const float2*>(&st.fk[2 * lane]);
    *reinterpret_cast<float2*>(&st.u[2 * lane]) =
        make_float2(cum * kLog2e - log2f(fk.x), (cum + g[1]) * kLog2e - log2f(fk.y));
    sm.in_ready[pos.stage].arrive();
  }
}

}  // namespace flashgdn::sm90
