// The diagonal 32 x 32 blocks T_LL, T_HH of T = (I + A)^-1 for the chunk's strictly lower
// 64 x 64 fp32 A, into sm.tf, by the chunk-local warpgroup: warp w owns block row w (rows 16 w ..
// 16 w + 15) and writes only its own rows of T. In 16 x 16 blocks:
//
//   1. every warp:     T_ww = (I + A_ww)^-1                forward substitution in registers, fp32
//   2. warps 1 and 3:  T_w,w-1 = -T_ww (A_w,w-1 T_w-1,w-1)  16 x 16 products (A_10, A_32 in sm.af)
//
// (the block form of T = (I + A)^-1 for A block lower: T_10 = -T_11 A_10 T_00.) The lower left
// block T_HL is never formed: the state applies it as Vn_H = T_HH (Y_H - A_HL Vn_L)
// (fwd_state.cuh). Step 2 runs on the tensor cores (mma_tf32.cuh, 1 or 3 TF32 products by
// precision); the caller separates the steps with a barrier of the warpgroup. Its intermediate
// product goes to A's upper triangle (rows of block w - 1, columns of block w), never read as A.
#pragma once

#include "sm90/fwd_smem.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/mma_tf32.cuh"
#include "sm90/ptx.cuh"

namespace flashgdn::sm90 {

constexpr int kLdF = 68;  // row stride of the fp32 tiles af / tf (floats)

// Step 1 for block w, in registers: the warp's diagonal block of A, as gate_products leaves it in
// the accumulator layout (a[nt][h][e] = A_ww[g + 8 h][8 nt + 2 q + e], lane = 4 g + q), to
// T_ww = (I + A_ww)^-1 in sm.tf. With the 8 x 8 blocks B0 = A_ww[0:8, 0:8], B1 = A_ww[8:16, 8:16]
// and C = A_ww[8:16, 0:8]:
//
//   R_b = (I + B_b)^-1, row by row: R_b[k] = e_k - sum_{k' < k} B_b[k][k'] R_b[k']
//   T_ww = [ R0  0 ; -R1 (C R0)  R1 ]
//
// Lane (g, q) holds R_b[g][2 q .. 2 q + 1]; row k reaches the other rows by shuffles, and the
// coefficients B_b[g][k], C[g][k] are gathered before the chain. The chain is 8 shuffle + FMA
// steps (R0 and R1 together, X = C R0 accumulated along), then one round for R1 X: no shared
// memory until T_ww is stored. (The earlier form, column by column from A in shared memory, was
// 16 dependent steps of loads; the undisturbed timeline puts this one at ~1100-1450 cycles, its
// shuffles waiting behind the other roles' shared-memory traffic: bench/NOTES.md.)
template <class Smem>
__device__ __forceinline__ void invert_diagonal_block(Smem& sm, const float (&a)[2][2][2], int w, int lane) {
  const int g = lane >> 2, q = lane & 3;
  float b0[8], b1[8], c[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int src = 4 * g + (k >> 1);  // the lane holding column k of row g
    b0[k] = __shfl_sync(0xffffffffu, a[0][0][k & 1], src);
    b1[k] = __shfl_sync(0xffffffffu, a[1][1][k & 1], src);
    c[k] = __shfl_sync(0xffffffffu, a[0][1][k & 1], src);
  }
  float r0[2], r1[2], x[2] = {0.f, 0.f};
#pragma unroll
  for (int e = 0; e < 2; ++e) r0[e] = r1[e] = 2 * q + e == g ? 1.f : 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    // Row k is final here: steps 0 .. k - 1 applied its every term (B_b[g][k] = 0 for k >= g, so
    // rows at or above k are left as they are).
    float rk0[2], rk1[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      rk0[e] = __shfl_sync(0xffffffffu, r0[e], 4 * k + q);
      if (k < 7) rk1[e] = __shfl_sync(0xffffffffu, r1[e], 4 * k + q);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      x[e] = fmaf(c[k], rk0[e], x[e]);
      if (k < 7) {
        r0[e] = fmaf(-b0[k], rk0[e], r0[e]);
        r1[e] = fmaf(-b1[k], rk1[e], r1[e]);
      }
    }
  }
  float y[2] = {0.f, 0.f};  // R1 X
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float r1gk = __shfl_sync(0xffffffffu, r1[k & 1], 4 * g + (k >> 1));
#pragma unroll
    for (int e = 0; e < 2; ++e) y[e] = fmaf(r1gk, __shfl_sync(0xffffffffu, x[e], 4 * k + q), y[e]);
  }
  float* t0 = &sm.tf[16 * w + g][16 * w + 2 * q];
  float* t1 = &sm.tf[16 * w + g + 8][16 * w + 2 * q];
  *reinterpret_cast<float2*>(t0) = make_float2(r0[0], r0[1]);
  *reinterpret_cast<float2*>(t0 + 8) = make_float2(0.f, 0.f);
  *reinterpret_cast<float2*>(t1) = make_float2(-y[0], -y[1]);
  *reinterpret_cast<float2*>(t1 + 8) = make_float2(r1[0], r1[1]);
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

// The whole T = (I + A)^-1, for the backward's chunk preparation (every block of T feeds W and
// U there). sm.af holds A, strictly lower with zeros on and above the diagonal; sm.tf is zero.
// Steps 1 and 2 as above (the diagonal blocks read from sm.af), then the lower left block:
//
//   3. warps 2 and 3:  X_w = A_w,L T_LL                 into A's upper right block (rows 16 w - 32)
//                      T_w,L = -T_w,H X                 (T_w,H: the warp's rows of T_HH)
//
// the block form T_HL = -T_HH A_HL T_LL. Every step on the warpgroup's four warps; `sync`
// is the warpgroup's barrier and separates the steps (the last included: T is whole on return).
template <bool kSplit, class Smem, class Sync>
__device__ __forceinline__ void invert_chunk(Smem& sm, int w, int lane, const Sync& sync) {
  const int g = lane >> 2, q = lane & 3;
  float a[2][2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 x = *reinterpret_cast<const float2*>(&sm.af[16 * w + g + 8 * h][16 * w + 8 * nt + 2 * q]);
      a[nt][h][0] = x.x;
      a[nt][h][1] = x.y;
    }
  invert_diagonal_block(sm, a, w, lane);
  sync();
  if (w & 1) merge_block_pair<kSplit>(sm, w, lane);
  sync();
  if (w >= 2) {
    float x[4][4] = {};
    mma_tf32_tiles<kLdF, 4, 4, 0, kSplit>(x, &sm.af[16 * w][0], &sm.tf[0][0], lane);
    store_tf32_tiles<kLdF, 4>(&sm.af[16 * w - 32][32], x, 1.f, lane);
  }
  sync();
  if (w >= 2) {
    float y[4][4] = {};
    mma_tf32_tiles<kLdF, 4, 4, kNotLower, kSplit>(y, &sm.tf[16 * w][32], &sm.af[0][32], lane);
    store_tf32_tiles<kLdF, 4>(&sm.tf[16 * w][0], y, -1.f, lane);
  }
  sync();
}

}  // namespace flashgdn::sm90
