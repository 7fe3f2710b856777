// Epilogue pieces of the Hopper forward, run by the state warpgroups: the output tile (through a
// swizzled staging tile, so that global stores are whole 16-byte rows) and the state's reads and
// writes (initial state, checkpoints, final state) in the caller's layout and dtype.
#pragma once

#include "cuda/device_utils.cuh"
#include "sm90/fwd_params.h"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_smem.cuh"

namespace flashgdn::sm90 {

// The slice of S^T a state thread holds: S[blk][4 jj + 2 i + e] is element (k, v) of S with
//   v = 64 sw + 16 warp + g + 8 i   (the warpgroup's 64 value columns: rows of S^T)
//   k = 64 blk + 8 jj + 2 q + e     (lane = 4 g + q)
template <int kBlocks, class F>
__device__ __forceinline__ void for_each_state(float (&S)[kBlocks][32], int sw, int tid, F&& f) {
  const int warp = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
#pragma unroll
  for (int blk = 0; blk < kBlocks; ++blk)
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int x = 0; x < 4; ++x)
        f(S[blk][4 * jj + x], 64 * blk + 8 * jj + 2 * q + (x & 1), 64 * sw + 16 * warp + g + 8 * (x >> 1));
}

__device__ __forceinline__ int64_t state_offset(const StateRef& s, int64_t row, int64_t h, int k,
                                                int v, int v_first) {
  return row * s.s0 + h * s.s1 + (v_first ? v * s.s2 + k * s.s3 : k * s.s2 + v * s.s3);
}

// A CP workspace of states, [slot][Hv][D][D] fp32 ([K][V]: rows k, columns v).
__device__ __forceinline__ StateRef cp_state_ref(const FwdParams& p, float* data) {
  StateRef s;
  const int64_t d = p.state_dim;
  s.data = data;
  s.dtype = FGDN_FLOAT32;
  s.s0 = p.Hv * d * d;
  s.s1 = d * d;
  s.s2 = d;
  s.s3 = 1;
  return s;
}

template <int kBlocks>
__device__ __forceinline__ void load_state(float (&S)[kBlocks][32], const StateRef& src, int64_t row,
                                           int64_t h, int v_first, int sw, int tid) {
  for_each_state(S, sw, tid, [&](float& s, int k, int v) {
    s = row >= 0 ? cuda::load_as_float(src.data, src.dtype, state_offset(src, row, h, k, v, v_first))
                 : 0.f;
  });
}

template <int kBlocks>
__device__ __forceinline__ void store_state(float (&S)[kBlocks][32], const StateRef& dst, int64_t row,
                                            int64_t h, int v_first, int sw, int tid) {
  for_each_state(S, sw, tid, [&](float& s, int k, int v) {
    cuda::store_from_float(dst.data, dst.dtype, state_offset(dst, row, h, k, v, v_first), s);
  });
}

// Rows of the 64 x 64 output tile of state warpgroup sw, from its accumulator O^T [64 v][64 t]:
// 8 x 8 blocks are transposed into the staging tile (the warpgroup's V tile of the chunk, no
// longer needed) by stmatrix (rows = tokens), then each row's 128 bytes go out as 16-byte
// stores; rows at or past `len` are not written. The caller releases the stage afterwards.
template <class Tr>
__device__ __forceinline__ void store_output(const FwdParams& p, typename Tr::Tin (*stage)[64],
                                             const float (&o)[32], const WorkItem& w, int64_t t_chunk,
                                             int len, int sw, int tid) {
  using Tin = typename Tr::Tin;
  const uint32_t bar = static_cast<uint32_t>(FwdBarrier::kStateBase) + sw;
  const int warp = tid >> 5, lane = tid & 31;
  const uint32_t base = smem_addr(&stage[0][0]);
#pragma unroll
  for (int jp = 0; jp < 4; ++jp) {
    uint32_t r[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int i = m & 1, jj = 2 * jp + (m >> 1);
      r[m] = cuda::pack2<Tin>(o[4 * jj + 2 * i], o[4 * jj + 2 * i + 1]);
    }
    const int m = lane >> 3;
    const uint32_t t = 8 * (2 * jp + (m >> 1)) + (lane & 7);
    stmatrix_x4_trans(base + swizzle128(t, 2 * warp + (m & 1)), r);
  }
  named_barrier_sync(bar, 128);
  Tin* dst = static_cast<Tin*>(p.o) + w.b * p.os0 + w.h * p.os2 + 64 * sw;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int idx = tid + 128 * u, t = idx >> 3, ch = idx & 7;
    if (t < len) {
      st_global_v4(dst + (t_chunk + t) * p.os1 + 8 * ch, ld_shared_v4(base + swizzle128(t, ch)));
    }
  }
}

}  // namespace flashgdn::sm90
