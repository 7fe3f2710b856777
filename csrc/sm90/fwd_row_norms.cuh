// Row-norm role of the Hopper forward (warps 0-1 of the producer warpgroup). Once a chunk's
// tiles have landed (in_full), warp 0 takes the chunk's q rows, warp 1 its k rows:
//   rows past the chunk's end: zeroed, so that a partial chunk never multiplies another
//                              sequence's tokens (0 x inf would be NaN); factor 0;
//   l2norm:                    f = 1 / sqrt(|x|^2 + 1e-6), applied later as diagonal factors,
//                              so q and k enter the tensor cores exactly as loaded;
//   otherwise:                 f = 1.
// |x|^2 by row_sumsq: lane l takes rows l and l + 32 of its half.
// Rare path: a row whose sum of squares reaches 2^100 (it may have overflowed, or would in
// K K^T) is scaled in place by a power of two first. Then 64 arrivals on in_ready. Running a
// chunk ahead of the chunk-local warpgroup, this keeps the row reads off its critical path.
#pragma once

#include "cuda/device_utils.cuh"
#include "sm90/fwd_params.h"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_smem.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90 {

// Squares at or above this take the rare path: 2^100.
constexpr float kSumsqLimit = 1.2676506e30f;

// Address of 16-byte chunk ch of row `row` of the stacked Q/K tile's column block blk (128-byte
// swizzled rows).
template <class Tr>
__device__ __forceinline__ uint32_t row_chunk_addr(typename Tr::Tin (*qk)[128][64], int blk, int row, int ch) {
  return smem_addr(&qk[blk][0][0]) + swizzle128(row, ch);
}

template <class Tr>
__device__ __forceinline__ void zero_row(typename Tr::Tin (*qk)[128][64], int row) {
#pragma unroll
  for (int blk = 0; blk < Tr::kBlocks; ++blk)
#pragma unroll
    for (int ch = 0; ch < 8; ++ch)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(row_chunk_addr<Tr>(qk, blk, row, ch)),
                   "r"(0u)
                   : "memory");
}

// The rare path: the row is scaled in place by 2^-e (exact for 16-bit values) so that its max
// lies in [0.5, 1), and the factor for the stored row is returned:
// x / sqrt(|x|^2 + eps) = x' / sqrt(|x'|^2 + eps 2^-2e). A zero or non-finite row stays as is.
template <class Tr>
__device__ __forceinline__ float rescale_row(typename Tr::Tin (*qk)[128][64], int row) {
  using Tin = typename Tr::Tin;
  auto at = [&](int blk, int col) -> Tin& { return qk[blk][row][(((col >> 3) ^ (row & 7)) << 3) | (col & 7)]; };
  float m = 0.f;
#pragma unroll 1
  for (int blk = 0; blk < Tr::kBlocks; ++blk)
#pragma unroll 1
    for (int col = 0; col < 64; ++col) m = fmaxf(m, fabsf(cuda::to_float(at(blk, col))));
  if (!(m > 0.f) || isinf(m)) return rsqrtf(m * m + 1e-6f);
  const int e = ilogbf(m) + 1;
  const float down = ldexpf(1.f, -e);
  float s = 0.f;
#pragma unroll 1
  for (int blk = 0; blk < Tr::kBlocks; ++blk)
#pragma unroll 1
    for (int col = 0; col < 64; ++col) {
      const float v = cuda::to_float(at(blk, col)) * down;
      at(blk, col) = cuda::from_float<Tin>(v);
      s = fmaf(v, v, s);
    }
  return rsqrtf(s + 1e-6f * down * down);
}

// Sum of squares of one row of the stacked tile, in fp32 on the CUDA cores (squares of 16-bit
// values are exact; two partial sums). A lane reads whole rows: the 128-byte swizzle puts the 8
// rows of a group at different 16-byte chunks, so a warp's reads of one chunk index meet no bank
// conflict. The CUDA cores leave the tensor pipe to the wgmmas (the earlier form, diag(X X^T)
// by mma.sync, queued its small mmas behind them); either way the two warps take thousands of
// cycles a chunk under the state's load and run a stage ahead (bench/NOTES.md).
template <class Tr>
__device__ __forceinline__ float row_sumsq(typename Tr::Tin (*qk)[128][64], int row) {
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int blk = 0; blk < Tr::kBlocks; ++blk)
#pragma unroll 4
    for (int ch = 0; ch < 8; ++ch) {
      const uint4 v = ld_shared_v4(row_chunk_addr<Tr>(qk, blk, row, ch));
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = unpack2<typename Tr::Tin>(w[e]);
        s0 = fmaf(x.x, x.x, s0);
        s1 = fmaf(x.y, x.y, s1);
      }
    }
  return s0 + s1;
}

template <class Tr>
__device__ __forceinline__ void fwd_row_norms(const FwdParams& p, FwdSmem<Tr>& sm, const WorkItem& w,
                                              int32_t c0, int is_k, int lane) {
  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pos(c0 + j);
    auto& st = sm.in[pos.stage];
    float* f = is_k ? st.fk : st.fq;
    sm.in_full[pos.stage].wait(pos.phase);
    const int len = w.chunk_len(j);
    if (len < 64) {
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (lane + 32 * u >= len) zero_row<Tr>(st.qk, 64 * is_k + lane + 32 * u);
      __syncwarp();
    }
    if (p.l2norm) {
#pragma unroll 1
      for (int h = 0; h < 2; ++h) {
        const int r = lane + 32 * h;
        float fr = 0.f;
        if (r < len) {
          const float x = row_sumsq<Tr>(st.qk, 64 * is_k + r);
          fr = (x < kSumsqLimit || isnan(x)) ? rsqrtf(x + 1e-6f) : rescale_row<Tr>(st.qk, 64 * is_k + r);
        }
        f[r] = fr;
      }
    } else {
      f[lane] = lane < len ? 1.f : 0.f;
      f[lane + 32] = lane + 32 < len ? 1.f : 0.f;
    }
    fence_proxy_async();  // the zeroed / rescaled rows, before the tensor cores read them
    // fk is in: the gate warp forms the column exponents from it (fwd_load.cuh); each lane's
    // arrival releases its own writes of f.
    if (is_k) sm.fk_full[pos.stage].arrive();
    sm.in_ready[pos.stage].arrive();
  }
}

}  // namespace flashgdn::sm90
