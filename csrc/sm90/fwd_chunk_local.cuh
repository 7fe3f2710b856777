// Chunk-local role of the Hopper forward (warpgroup 1). Everything of a chunk that does not
// depend on the state, computed while the state warpgroups work on the previous chunk, from the
// input stage's tiles, cumulative gate c and row factors fq, fk (fwd_load.cuh, fwd_row_norms.cuh):
//
//   A     = strict_lower(diag(beta fk) K K^T diag(fk) (.) D),  D_ij = exp(c_i - c_j)
//   P     = scale lower(diag(fq) Q K^T diag(fk) (.) D)
//   T     = (I + A)^-1                                         (fwd_inverse.cuh)
//   per-token factors ykf, yb, of, vd and the chunk decay exp(c_C) (fwd_smem.cuh)
//
// The grams leave the wgmma accumulators raw (K K^T to sm.af, Q K^T to sm.tf), so that the
// elementwise gating, whose work is triangular, is spread evenly over the warpgroup instead of
// following the accumulator rows (warp 3 would own 4x the work of warp 0). Per chunk:
//
//   K K^T, Q K^T (wgmma) -> af, tf   -- barrier --  A in af, P to the local stage (balanced)
//   -- barrier --  every warp w: T_ww   -- barrier --  warps 1, 3: T_w,w-1 | warps 0, 2: factors,
//   warp 0: T rows 0-15 out   -- barrier --  warps 2, 3: X_2, X_3   -- barrier --  warps 2, 3:
//   T_2L, T_3L, T rows out | warp 1: T rows 16-31 out
//
// T and P go to the local ring in the operand type (hi, and lo when split) for the state
// warpgroups' wgmmas.
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

// Raw accumulators of a 64 x 64 gram (d = X K^T, this warp's rows) to an fp32 tile, row-major.
__device__ __forceinline__ void store_gram(float (*m)[68], const float (&d)[32], int warp, int lane) {
  const int g8 = lane >> 2, q4 = lane & 3;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj)
#pragma unroll
    for (int i = 0; i < 2; ++i)
      *reinterpret_cast<float2*>(&m[16 * warp + g8 + 8 * i][8 * jj + 2 * q4]) =
          make_float2(d[4 * jj + 2 * i], d[4 * jj + 2 * i + 1]);
}

// The gates and factors of A and P, from the raw K K^T (in sm.af) and Q K^T (in sm.tf), shared
// per element (j <= i; s_ij = 2^(c2_i - c2_j) fk_j):
//   A_ij = beta_i fk_i (K K^T)_ij s_ij  (j < i, in place in sm.af)
//   P_ij = scale fq_i (Q K^T)_ij s_ij   (to the local stage in the operand type)
// zero for rows past the chunk. Balanced over the warpgroup: thread t takes rows 63 - t/4 and t/4
// (65 elements together, 17 groups of 4 columns), groups t % 4, t % 4 + 4, ...; every thread
// runs 5 group slots (a 5th group exists only for t % 4 == 0).
template <class Tr, class Stage, class Local>
__device__ __forceinline__ void gate_products(const FwdParams& p, FwdSmem<Tr>& sm, const Stage& in,
                                              Local& loc, int len, int tid) {
  using Tin = typename Tr::Tin;
  const int pr = tid >> 2, q = tid & 3;
  const int ghi = (64 - pr + 3) >> 2;  // groups of row 63 - pr: columns 0 .. 63 - pr
  const int total = ghi + ((pr + 4) >> 2);
  auto group = [&](int u) {
    int k = q + 4 * u;
    const bool active = k < total;
    if (!active) k = q;  // recomputes a valid group, not stored
    const bool hi = k < ghi;
    const int i = hi ? 63 - pr : pr;
    const int j0 = 4 * (hi ? k : k - ghi);
    const float ci = in.c2[i];
    const bool vi = i < len;
    const float ra = in.beta[i] * in.fk[i], rp = p.scale * in.fq[i];
    const float4 cj = *reinterpret_cast<const float4*>(&in.c2[j0]);
    const float4 fj = *reinterpret_cast<const float4*>(&in.fk[j0]);
    const float4 ka = *reinterpret_cast<const float4*>(&sm.af[i][j0]);
    const float4 qa = *reinterpret_cast<const float4*>(&sm.tf[i][j0]);
    const float cjs[4] = {cj.x, cj.y, cj.z, cj.w}, fjs[4] = {fj.x, fj.y, fj.z, fj.w};
    const float kas[4] = {ka.x, ka.y, ka.z, ka.w}, qas[4] = {qa.x, qa.y, qa.z, qa.w};
    float a[4], pp[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int jc = j0 + e;
      const float sij = exp2_approx(ci - cjs[e]) * fjs[e];
      a[e] = (vi && jc < i) ? ra * kas[e] * sij : 0.f;
      pp[e] = (vi && jc <= i) ? rp * qas[e] * sij : 0.f;
    }
    if (active) {
      *reinterpret_cast<float4*>(&sm.af[i][j0]) = make_float4(a[0], a[1], a[2], a[3]);
      uint2 h, l;
      split_pair<Tin, Tr::kSplitLocal>(pp[0], pp[1], h.x, l.x);
      split_pair<Tin, Tr::kSplitLocal>(pp[2], pp[3], h.y, l.y);
      const uint32_t off = tile_offset(i, j0);
      *reinterpret_cast<uint2*>(reinterpret_cast<char*>(&loc.p[0][0][0]) + off) = h;
      if constexpr (Tr::kSplitLocal) *reinterpret_cast<uint2*>(reinterpret_cast<char*>(&loc.p[1][0][0]) + off) = l;
    }
  };
  // One group at a time (4 independent elements): hoisting the loads of several groups spills.
#pragma unroll 1
  for (int u = 0; u < 5; ++u) group(u);
}


// Rows 16 w .. 16 w + 15 of T (fp32, finished) to the local stage in the operand type: lane ->
// row 16 w + lane / 2, its 16-byte chunks of parity lane % 2; zeros right of the block diagonal
// (tf holds other data there).
template <class Tr, class Smem, class Local>
__device__ __forceinline__ void store_t_rows(const Smem& sm, Local& loc, int warp, int lane) {
  using Tin = typename Tr::Tin;
  const int row = 16 * warp + (lane >> 1);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int ch = 2 * k + (lane & 1);
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

template <class Tr>
__device__ __forceinline__ void fwd_chunk_local(const FwdParams& p, FwdSmem<Tr>& sm,
                                                const WorkItem& w, int tid_in) {
  using Tin = typename Tr::Tin;
  constexpr uint32_t kBar = static_cast<uint32_t>(FwdBarrier::kChunkLocal);

  // P's 4-column groups right of the diagonal are never written: zero once in every stage.
  for (int s = 0; s < Tr::kLocalStages; ++s)
    for (int i = tid_in; i < Tr::kLocalParts * 64 * 64 / 8; i += 128)
      reinterpret_cast<uint4*>(&sm.local[s].p[0][0][0])[i] = make_uint4(0, 0, 0, 0);

  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pin(j);
    const RingPos<Tr::kLocalStages> ploc(j);
    auto& in = sm.in[pin.stage];
    auto& loc = sm.local[ploc.stage];
    const int len = w.chunk_len(j);
    // The thread index anew each chunk (opaque to the compiler): addresses derived from it are
    // recomputed in the loop instead of held across it, which at 80 registers spilled them.
    int tid = tid_in;
    asm volatile("" : "+r"(tid));
    const int warp = tid >> 5, lane = tid & 31;
    sm.in_ready[pin.stage].wait(pin.phase);

    // ---- K K^T and Q K^T on the tensor cores, raw, to af and tf --------------------------------
    {
      float kk[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) kk[i] = 0.f;
      gram_issue<Tr>(kk, in.qk, 64);
      wgmma_wait<0>();
      fence_regs(kk);
      store_gram(sm.af, kk, warp, lane);
    }
    {
      float qk[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) qk[i] = 0.f;
      gram_issue<Tr>(qk, in.qk, 0);
      wgmma_wait<0>();
      fence_regs(qk);
      store_gram(sm.tf, qk, warp, lane);
    }
    sm.local_empty[ploc.stage].wait(ploc.phase ^ 1);
    named_barrier_sync(kBar, 128);  // both grams
    gate_products<Tr>(p, sm, in, loc, len, tid);
    named_barrier_sync(kBar, 128);  // A
    invert_diagonal_block(sm, warp, lane);
    named_barrier_sync(kBar, 128);  // every T_ww

    if (warp & 1) {
      merge_block_pair<Tr::kSplitLocal>(sm, warp, lane);
    } else {
      token_factors(p, in, loc, len, warp >> 1, lane);
      if (warp == 0) store_t_rows<Tr>(sm, loc, 0, lane);
    }
    named_barrier_sync(kBar, 128);  // T_LL and T_32

    if (warp >= 2) merge_halves_x<Tr::kSplitLocal>(sm, warp, lane);
    named_barrier_sync(kBar, 128);  // X_2, X_3
    if (warp >= 2) {
      merge_halves_t<Tr::kSplitLocal>(sm, warp, lane);
      __syncwarp();
      store_t_rows<Tr>(sm, loc, warp, lane);
    } else if (warp == 1) {
      store_t_rows<Tr>(sm, loc, 1, lane);
    }

    fence_proxy_async();
    sm.local_full[ploc.stage].arrive();
    sm.in_empty[pin.stage].arrive();
    // The next chunk rewrites af and tf.
    named_barrier_sync(kBar, 128);
  }
}

}  // namespace flashgdn::sm90
