// T = (I + A)^-1 for the chunk's strictly lower 64 x 64 fp32 A (sm.af), into sm.tf, by the
// chunk-local warpgroup: warp w owns block row w (rows 16 w .. 16 w + 15) and writes only its
// own rows of T. In 16 x 16 blocks (L = blocks 0-1, H = blocks 2-3 of the 32 x 32 halves):
//
//   1. every warp:     T_ww = (I + A_ww)^-1                forward substitution, fp32
//   2. warps 1 and 3:  T_w,w-1 = -T_ww (A_w,w-1 T_w-1,w-1)  16 x 16 products
//   3. warps 2 and 3:  T_wL = -T_wH (A_HL T_LL)             X_w = A_wL T_LL (16 x 32), then
//                      T_2L = -T_22 X_2, T_3L = -(T_32 X_2 + T_33 X_3)
//
// (the block forms of T = (I + A)^-1 for A block lower: T_10 = -T_11 A_10 T_00.) Steps 2 and 3 run
// on the tensor cores (mma_tf32.cuh, 1 or 3 TF32 products by precision); the caller separates the
// steps with barriers of the warpgroup. Intermediate products X go to A's upper triangle, which
// is never read as A: step 2 at rows of block w - 1, columns of block w; step 3 at rows 0..31,
// columns 32..63 (X_2 above X_3).
#pragma once

#include "sm90/fwd_smem.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/mma_tf32.cuh"
#include "sm90/ptx.cuh"

namespace flashgdn::sm90 {

constexpr int kLdF = 68;  // row stride of the fp32 tiles af / tf (floats)

// Step 1 for block w: column c = lane & 15 of T_ww, x_i = -sum_{k<i} A_ik x_k (x_c = 1, zero
// above); two partial sums halve the dependent chain, A's rows read as float4 broadcasts. Lanes
// 16..31 repeat lanes 0..15 (one warp; no divergence) and do not store.
template <class Smem>
__device__ __forceinline__ void invert_diagonal_block(Smem& sm, int w, int lane) {
  const int c = lane & 15;
  const float(*A)[kLdF] = reinterpret_cast<const float(*)[kLdF]>(&sm.af[16 * w][16 * w]);
  float x[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int k4 = 0; k4 < i; k4 += 4) {
      const float4 a = *reinterpret_cast<const float4*>(&A[i][k4]);
      s0 = fmaf(a.x, x[k4], s0);
      if (k4 + 1 < i) s1 = fmaf(a.y, x[k4 + 1], s1);
      if (k4 + 2 < i) s0 = fmaf(a.z, x[k4 + 2], s0);
      if (k4 + 3 < i) s1 = fmaf(a.w, x[k4 + 3], s1);
    }
    x[i] = i == c ? 1.f : (i > c ? -(s0 + s1) : 0.f);
  }
  if (lane < 16) {
#pragma unroll
    for (int i = 0; i < 16; ++i) sm.tf[16 * w + i][16 * w + c] = x[i];
  }
}

// Step 2 for w in {1, 3}.
template <bool kSplit, class Smem>
__device__ __forceinline__ void merge_block_pair(Smem& sm, int w, int lane) {
  const int r1 = 16 * w, r0 = r1 - 16;
  float x[2][4] = {};
  mma_tf32_tiles<kLdF, 2, 2, 0, kSplit>(x, &sm.af[r1][r0], &sm.tf[r0][r0], lane);
  store_tf32_tiles<kLdF>(&sm.af[r0][r1], x, 1.f, lane);
  __syncwarp();
  float y[2][4] = {};
  mma_tf32_tiles<kLdF, 2, 2, kNotLower, kSplit>(y, &sm.tf[r1][r1], &sm.af[r0][r1], lane);
  store_tf32_tiles<kLdF>(&sm.tf[r1][r0], y, -1.f, lane);
}

// Step 3 for w in {2, 3}, in two parts with a barrier of the warpgroup between them (part t reads
// both X_2 and X_3). (Splitting it over all four warps in column halves measured 13% slower:
// bench/NOTES.md.)
template <bool kSplit, class Smem>
__device__ __forceinline__ void merge_halves_x(Smem& sm, int w, int lane) {
  float x[4][4] = {};
  mma_tf32_tiles<kLdF, 4, 4, 0, kSplit>(x, &sm.af[16 * w][0], &sm.tf[0][0], lane);
  store_tf32_tiles<kLdF>(&sm.af[16 * w - 32][32], x, 1.f, lane);
}
template <bool kSplit, class Smem>
__device__ __forceinline__ void merge_halves_t(Smem& sm, int w, int lane) {
  float y[4][4] = {};
  if (w == 2) mma_tf32_tiles<kLdF, 2, 4, kNotLower, kSplit>(y, &sm.tf[32][32], &sm.af[0][32], lane);
  else mma_tf32_tiles<kLdF, 4, 4, kNotLower, kSplit>(y, &sm.tf[48][32], &sm.af[0][32], lane);
  store_tf32_tiles<kLdF>(&sm.tf[16 * w][0], y, -1.f, lane);
}

}  // namespace flashgdn::sm90
