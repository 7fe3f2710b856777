// Chunk-local role of the Hopper forward (warpgroup 1). Everything of a chunk that does not
// depend on the state, computed while the state warpgroups work on the previous chunk, from the
// input stage's tiles, cumulative gate c and row factors fq, fk (fwd_load.cuh, fwd_row_norms.cuh):
//
//   A     = strict_lower(diag(beta fk) K K^T diag(fk) (.) D),  D_ij = exp(c_i - c_j)
//   P     = scale lower(diag(fq) Q K^T diag(fk) (.) D)
//   T_LL, T_HH: the diagonal 32 x 32 blocks of T = (I + A)^-1    (fwd_inverse.cuh)
//   -A_HL: the lower left 32 x 32 block of A, in T_HL's place: the state forms Vn = T Y by
//          halves, Vn_H = T_HH (Y_H - A_HL Vn_L) (fwd_state.cuh), so T_HL is never needed
//   per-token factors ykf, yb, of, vd and the chunk decay exp(c_C) (fwd_smem.cuh)
//
// A and P are gated in the grams' accumulator registers (gate_products). Per chunk:
//
//   K K^T, Q K^T (wgmma); P and -A_HL to the local stage, A_10 and A_32 to af; every warp w:
//   T_ww from its diagonal block in registers
//   -- barrier --  warps 1, 3: T_w,w-1 | warps 0, 2: factors;  every warp: its T rows out
//
// The T tile and P go to the local ring in the operand type (hi, and lo when split) for the
// state warpgroups' wgmmas. (The 32 -> 64 merge T_HL = -T_HH A_HL T_LL here took two more
// products, two barriers and ~3000 cycles of this role's ~8900 a chunk: bench/NOTES.md.)
#pragma once

#include "cuda/device_utils.cuh"
#include "sm90/fwd_inverse.cuh"
#include "sm90/fwd_params.h"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_smem.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90 {

// d (64 x 64, fp32) = X K^T for the chunk's X = Q (rows 0..63 of the stacked tile: x_row = 0) or
// K (x_row = 64), over the head dimension, by SS wgmmas of the warpgroup; issued and committed,
// not waited for.
template <class Tr>
__device__ __forceinline__ void gram_issue(float (&d)[32], typename Tr::Tin (*qk)[128][64], int x_row) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Tr::kD / 16; ++ks) {
    const uint32_t off = (ks & 3) * 32;
    const uint64_t dx = desc_k_major(smem_addr(&qk[ks >> 2][x_row][0]) + off);
    const uint64_t dk = desc_k_major(smem_addr(&qk[ks >> 2][64][0]) + off);
    wgmma_ss_n64<typename Tr::Tin>(d, dx, dk, ks > 0);
  }
  wgmma_commit();
}

// Byte offset of (row, col) in a swizzled 64 x 64 16-bit tile (col even: a 4-byte pair).
__device__ __forceinline__ uint32_t tile_offset(int row, int col) {
  return swizzle128(row, col >> 3) + (col & 7) * 2;
}

// The gates and factors of A and P, straight from the grams' accumulators. Warp w holds rows
// i in {16 w + g, 16 w + g + 8} (lane = 4 g + q) and, per column block jj, columns
// j = 8 jj + 2 q + e; with s_ij = 2^(c2_i - u_j) = 2^(c2_i - c2_j) fk_j (u: fwd_smem.cuh), shared
// by both products:
//   A_ij = beta_i fk_i (K K^T)_ij s_ij   (j < i)  -> by block, as below
//   P_ij = scale fq_i (Q K^T)_ij s_ij    (j <= i) -> the local stage in the operand type
// zero for rows past the chunk (selected, not multiplied: s_ij may be inf above the diagonal).
// Only the blocks jj <= 2 w + 1 reach the diagonal of warp w's rows: nothing reads A right of
// its diagonal block, and P's blocks further right stay zero from the stage's first fill. Of A,
// the diagonal block stays in registers (step 1 of the inverse), A_HL (warps 2-3, jj < 4) goes
// negated to the local stage's T tile, and A_10, A_32 (left of the diagonal blocks of warps 1
// and 3) to sm.af for step 2. Warp 3 thus does 4x warp 0's elements (the timeline, bench/NOTES.md:
// warp 0 gates in ~1000-1700 cycles, warp 3 ends ~300-1300 later).
// with_p false (a `high` launch without output: fwd_state.cuh): P is neither formed nor stored.
template <class Tr, class Stage, class Local>
__device__ __forceinline__ void gate_products(const FwdParams& p, FwdSmem<Tr>& sm, const Stage& in,
                                              Local& loc, const float (&kk)[32], const float (&qk)[32],
                                              float (&diag)[2][2][2], int len, int warp, int lane,
                                              bool with_p) {
  using Tin = typename Tr::Tin;
  const int g8 = lane >> 2, q4 = lane & 3;
  // The column values two blocks ahead of their use: the loads of blocks jj + 2, jj + 3 (issued
  // at jj = 0, 2, 4 by every warp that gets there) overlap the gating of blocks jj, jj + 1, so a
  // warp waits for about one round trip through the loaded shared-memory pipe (~300-500 cycles)
  // instead of one per column block (c2 and fk, loaded block by block, cost warp 3 eight). All
  // eight up front did not fit in the role's registers.
  float2 uj[8];
  auto load_u = [&](int jj0) {
#pragma unroll
    for (int jj = jj0; jj < jj0 + 2; ++jj) uj[jj] = *reinterpret_cast<const float2*>(&in.u[8 * jj + 2 * q4]);
  };
  load_u(0);
  load_u(2);
  float ci[2], ra[2], rp[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = 16 * warp + g8 + 8 * h;
    const bool valid = i < len;
    ci[h] = in.c2[i];
    ra[h] = valid ? in.beta[i] * in.fk[i] : 0.f;
    rp[h] = valid ? p.scale * in.fq[i] : 0.f;
  }
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    if (jj > 2 * warp + 1) break;  // warp-uniform
    if (jj == 2 || jj == 4) load_u(jj + 2);
    const int j0 = 8 * jj + 2 * q4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 16 * warp + g8 + 8 * h, idx = 4 * jj + 2 * h;
      const float s0 = exp2_approx(ci[h] - uj[jj].x), s1 = exp2_approx(ci[h] - uj[jj].y);
      const float a0 = j0 < i ? ra[h] * kk[idx] * s0 : 0.f;
      const float a1 = j0 + 1 < i ? ra[h] * kk[idx + 1] * s1 : 0.f;
      const float p0 = j0 <= i ? rp[h] * qk[idx] * s0 : 0.f;
      const float p1 = j0 + 1 <= i ? rp[h] * qk[idx + 1] * s1 : 0.f;
      const uint32_t off = tile_offset(i, j0);
      if (warp >= 2 && jj < 4) {
        uint32_t hi, lo;
        split_pair<Tin, Tr::kSplitLocal>(-a0, -a1, hi, lo);
        *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(&loc.t[0][0][0]) + off) = hi;
        if constexpr (Tr::kSplitLocal) *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(&loc.t[1][0][0]) + off) = lo;
      } else if (jj < 2 * warp) {
        *reinterpret_cast<float2*>(&sm.af[i][j0]) = make_float2(a0, a1);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)  // (constant register indices: no local-memory array)
        if (jj == 2 * warp + nt) {
          diag[nt][h][0] = a0;
          diag[nt][h][1] = a1;
        }
      if (with_p) {
        uint32_t hi, lo;
        split_pair<Tin, Tr::kSplitLocal>(p0, p1, hi, lo);
        *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(&loc.p[0][0][0]) + off) = hi;
        if constexpr (Tr::kSplitLocal) *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(&loc.p[1][0][0]) + off) = lo;
      }
    }
  }
}

// Rows 16 w .. 16 w + 15 of the T tile to the local stage in the operand type, from tf (fp32):
// lane -> row 16 w + lane % 16, its 16-byte chunks 2 k + lane / 16; zeros right of the block
// diagonal (tf holds other data there). Rows 32-63 (w >= 2) only from column 32 on: left of it
// is -A_HL, written by gate_products. A 16-byte access is served 8 lanes at a time: 8
// consecutive rows at one chunk index meet no bank conflict, neither in tf (row stride 68
// floats) nor in the swizzled tile. (Lane pairs on one row, the earlier mapping, put rows r and
// r ^ 1 on the same banks: 2-way conflicts on both sides, measured by Nsight Compute.)
template <class Tr, class Smem, class Local>
__device__ __forceinline__ void store_t_rows(const Smem& sm, Local& loc, int warp, int lane) {
  using Tin = typename Tr::Tin;
  const int row = 16 * warp + (lane & 15);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (warp >= 2 && k < 2) continue;  // warp-uniform
    const int ch = 2 * k + (lane >> 4);
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 a = k <= warp ? *reinterpret_cast<const float4*>(&sm.tf[row][8 * ch]) : z;
    const float4 b = k <= warp ? *reinterpret_cast<const float4*>(&sm.tf[row][8 * ch + 4]) : z;
    uint4 hi, lo;
    split_pair<Tin, Tr::kSplitLocal>(a.x, a.y, hi.x, lo.x);
    split_pair<Tin, Tr::kSplitLocal>(a.z, a.w, hi.y, lo.y);
    split_pair<Tin, Tr::kSplitLocal>(b.x, b.y, hi.z, lo.z);
    split_pair<Tin, Tr::kSplitLocal>(b.z, b.w, hi.w, lo.w);
    const uint32_t off = swizzle128(row, ch);
    *reinterpret_cast<uint4*>(reinterpret_cast<char*>(&loc.t[0][0][0]) + off) = hi;
    if constexpr (Tr::kSplitLocal) *reinterpret_cast<uint4*>(reinterpret_cast<char*>(&loc.t[1][0][0]) + off) = lo;
  }
}

// Per-token factors of tokens 32 half .. 32 half + 31 (fwd_smem.cuh, LocalStage).
template <class Stage, class Local>
__device__ __forceinline__ void token_factors(const FwdParams& p, const Stage& in, Local& loc, int len,
                                              int half, int lane) {
  const int t = 32 * half + lane;
  const bool valid = t < len;
  const float ct = in.c2[t], cl = in.c2[len - 1];
  const float et = exp2_approx(ct);
  loc.ykf[t] = valid ? et * in.fk[t] : 0.f;
  loc.yb[t] = valid ? in.beta[t] : 0.f;
  loc.of[t] = valid ? p.scale * in.fq[t] * et : 0.f;
  loc.vd[t] = valid ? exp2_approx(cl - ct) * in.fk[t] : 0.f;
  if (t == 0) loc.decay = exp2_approx(cl);
}

// P's column blocks right of a warp's diagonal block are never written: zeroed once in every
// stage, before the CTA's first work item.
template <class Tr>
__device__ __forceinline__ void zero_local_p(FwdSmem<Tr>& sm, int tid) {
  for (int s = 0; s < Tr::kLocalStages; ++s)
    for (int i = tid; i < Tr::kLocalParts * 64 * 64 / 8; i += 128)
      reinterpret_cast<uint4*>(&sm.local[s].p[0][0][0])[i] = make_uint4(0, 0, 0, 0);
}

// One work item's chunks; c0: the chunks the CTA walked before it (ring positions c0 + j).
template <class Tr>
__device__ __forceinline__ void fwd_chunk_local(const FwdParams& p, FwdSmem<Tr>& sm,
                                                const WorkItem& w, int32_t c0, int tid_in) {
  using Tin = typename Tr::Tin;
  constexpr uint32_t kBar = static_cast<uint32_t>(FwdBarrier::kChunkLocal);
  // A `high` launch without output needs no P (fwd_state.cuh: states_only).
  const bool with_p = Tr::kPrecision != Precision::kHigh || fwd_writes_output(p);

  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pin(c0 + j);
    const RingPos<Tr::kLocalStages> ploc(c0 + j);
    auto& in = sm.in[pin.stage];
    auto& loc = sm.local[ploc.stage];
    const int len = w.chunk_len(j);
    // The thread index anew each chunk (opaque to the compiler): addresses derived from it are
    // recomputed in the loop instead of held across it, which at 80 registers spilled them.
    int tid = tid_in;
    asm volatile("" : "+r"(tid));
    const int warp = tid >> 5, lane = tid & 31;
    sm.in_ready[pin.stage].wait(pin.phase);

    // ---- K K^T and Q K^T on the tensor cores; A and P from the accumulators ------------------
    {
      float kk[32] = {}, qk[32] = {};
      gram_issue<Tr>(kk, in.qk, 64);
      if (with_p) gram_issue<Tr>(qk, in.qk, 0);
      // The local stage is waited for while the grams run: the wait's own latency (~300-500
      // cycles through the loaded shared-memory pipe, even when the stage was released long
      // ago) leaves the chain (bench/NOTES.md).
      sm.local_empty[ploc.stage].wait(ploc.phase ^ 1);
      wgmma_wait<0>();
      fence_regs(kk);
      fence_regs(qk);
      float diag[2][2][2];
      gate_products<Tr>(p, sm, in, loc, kk, qk, diag, len, warp, lane, with_p);
      invert_diagonal_block(sm, diag, warp, lane);
    }
    named_barrier_sync(kBar, Tr::kWarpgroupThreads);  // every T_ww; A's blocks left of the diagonal

    // Each warp's T rows need only its own results from here on: no further barrier.
    if (warp & 1) {
      merge_block_pair<Tr::kSplitLocal>(sm, warp, lane);
      __syncwarp();
    } else {
      token_factors(p, in, loc, len, warp >> 1, lane);
    }
    store_t_rows<Tr>(sm, loc, warp, lane);

    fence_proxy_async();
    sm.local_full[ploc.stage].arrive();
    sm.in_empty[pin.stage].arrive();
    // The next chunk rewrites af and tf.
    named_barrier_sync(kBar, Tr::kWarpgroupThreads);
  }
}

}  // namespace flashgdn::sm90
