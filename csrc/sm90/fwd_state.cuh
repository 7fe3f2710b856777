// State role of the Hopper forward (warpgroups 2..): the recurrence across chunks. Warpgroup sw
// owns value columns [64 sw, 64 sw + 64) of S, held transposed (S^T: 64 rows x D, fp32, in
// wgmma accumulator layout). The value columns of S evolve independently, so the state
// warpgroups never wait for each other. Per chunk, with the chunk-local results T, P and the
// per-token factors of fwd_smem.cuh (every product a wgmma whose A operand is an accumulator
// converted in registers, B the chunk's tiles in shared memory):
//
//   [O1 | X]^T = S^T [Q; K]^T                       (one 64 x 128 product: Q S and K S)
//   Y^T  = yb (.) (V^T - ykf (.) X^T)               (per-token factors along the columns)
//   Vn = T Y, by halves of the chunk (L = tokens 0-31, H = 32-63; fwd_chunk_local.cuh):
//     Vn_L^T = Y_L^T T_LL^T,  Y_H^T += Vn_L^T (-A_HL)^T,  Vn_H^T = Y_H^T T_HH^T
//   S^T <- decay S^T + (vd (.) Vn^T) K              (B = the K tile read MN-major)
//   O^T  = of (.) O1^T + Vn^T P^T                   -> o
//
// A `high` call without o (the backward's chunk-start states, chunk_states in fwd_launch.cu:
// states_only) needs none of O's products: X^T = S^T K^T alone (64 x 64), no Vn^T P^T. `fast`
// kernels never take that branch (it is compiled out of them).
#pragma once

#include "sm90/fwd_epilogue.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90 {

// A fragments of k-step s (16 columns) of a 64 x 64 accumulator block `x` (32 floats): its
// accumulator tiles 2 s and 2 s + 1, each column t scaled by colf[t] (colf: per-token factors in
// shared memory; nullptr: 1).
template <typename T, bool kSplit>
__device__ __forceinline__ void to_fragments(const float* x, int s, const float* colf,
                                             uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int jj = 2 * s + c;
    float2 f = make_float2(1.f, 1.f);
    if (colf != nullptr) f = *reinterpret_cast<const float2*>(&colf[8 * jj + 2 * q]);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int idx = 4 * jj + 2 * i;
      split_pair<T, kSplit>(x[idx] * f.x, x[idx + 1] * f.y, hi[2 * c + i], lo[2 * c + i]);
    }
  }
}

// A fragments of k-step s of the state block S[blk] (64 x 64): part 0 its hi half, part 1 its
// lo half (split state only).
template <typename T, bool kSplit>
__device__ __forceinline__ void state_fragments(const float (&x)[32], int s, int part, uint32_t (&a)[4]) {
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int idx = 4 * (2 * s + c) + 2 * i;
      uint32_t hi, lo;
      split_pair<T, kSplit>(x[idx], x[idx + 1], hi, lo);
      a[2 * c + i] = part == 0 ? hi : lo;
    }
}

template <class Tr>
__device__ __forceinline__ void fwd_state(const FwdParams& p, FwdSmem<Tr>& sm, const WorkItem& item,
                                          int32_t c0, int sw, int tid) {
  // With a split state (`high`), the item's fields broadcast from lane 0: the compiler then keeps
  // them in uniform registers, not in the state role's vector registers, which split operands
  // fill (bench/NOTES.md step 20). `fast` has registers to spare and keeps its own allocation.
  WorkItem w = item;
  if constexpr (Tr::kSplitState) {
    for (int32_t* f : {&w.n, &w.h, &w.hq, &w.b, &w.t0, &w.len, &w.nchunks, &w.out_chunk0, &w.seq_chunk0,
                       &w.init, &w.end, &w.slot})
      *f = __shfl_sync(0xffffffffu, *f, 0);
    c0 = __shfl_sync(0xffffffffu, c0, 0);
  }
  using Tin = typename Tr::Tin;
  constexpr int kB = Tr::kBlocks, kKSteps = Tr::kD / 16;
  constexpr bool kSS = Tr::kSplitState, kSU = Tr::kSplitUpdate, kSL = Tr::kSplitLocal;
  const bool states_only = Tr::kPrecision == Precision::kHigh && !fwd_writes_output(p);

  // ---- initial state ---------------------------------------------------------------------
  // Per-item values used after the chunk loop (the pool row, the checkpoints' first row) are
  // computed where they are used, not held across the loop: at `high`'s 192 registers they were
  // the state role's only spills (bench/results/sass/README.md).
  const StateSource src = initial_state_source(p, w);
  float S[kB][32];
  if (w.init == kInitH0 || w.init == kInitPrevEnd) {
    load_state(S, src.ref, src.row, w.h, src.v_first, sw, tid);
  } else {
    const bool identity = w.init == kInitIdentity;
    for_each_state(S, sw, tid, [&](float& s, int k, int v) { s = identity && k == v ? 1.f : 0.f; });
  }
  // The transfer matrix's walk reads V as zero: S_C = M S_0 + N is linear in (S_0, V), and
  // from S_0 = I with V = 0 the walk ends at M.
  const float vscale = w.init == kInitIdentity ? 0.f : 1.f;
  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pin(c0 + j);
    const RingPos<Tr::kLocalStages> ploc(c0 + j);
    auto& in = sm.in[pin.stage];
    auto& loc = sm.local[ploc.stage];
    const int len = w.chunk_len(j);
    // The thread index anew each chunk (opaque to the compiler), as in the chunk-local role:
    // the lane-derived addresses are recomputed in the loop, not held across it (at 192
    // registers four of them were spilled, and their reloads missed L1: bench/NOTES.md).
    int tid_j = tid;
    asm volatile("" : "+r"(tid_j));
    const int warp = tid_j >> 5, lane = tid_j & 31, q4 = lane & 3;
    // [O1 | X] needs only the tiles as the norm warps leave them (rows past a partial chunk
    // zeroed, huge rows rescaled: in_ready, not in_full) and S: it is issued before the wait for
    // the chunk-local results, so that its ~1400 cycles overlap that wait instead of following it.
    sm.in_ready[pin.stage].wait(pin.phase);

    // ---- [O1 | X]^T = S^T [Q; K]^T (a split state: the hi part's products, then the lo part's,
    // so that only one set of A fragments is live) ------------------------------------------
    float o1[32] = {}, xk[32] = {};
#pragma unroll
    for (int part = 0; part < (kSS ? 2 : 1); ++part) {
      // The lo fragments only after the hi part's products are done: one set live at a time.
      if (part > 0) {
#pragma unroll
        for (int blk = 0; blk < kB; ++blk) fence_regs(S[blk]);
      }
      uint32_t sa[kKSteps][4];
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) state_fragments<Tin, kSS>(S[ks >> 2], ks & 3, part, sa[ks]);
      // Descriptors formed anew for each part (not kept live across the other part's products).
      uint32_t qk_base = smem_addr(&in.qk[0][0][0]);
      asm volatile("" : "+r"(qk_base));
      wgmma_fence();
      if (states_only) {  // X^T = S^T K^T: the K rows (64..127) of the stacked tile
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          const uint64_t d = desc_k_major(qk_base + (ks >> 2) * sizeof(in.qk[0]) + 64 * 128 + (ks & 3) * 32);
          wgmma_rs_n64<Tin, 0>(xk, sa[ks], d, part > 0 || ks > 0);
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          const uint64_t d = desc_k_major(qk_base + (ks >> 2) * sizeof(in.qk[0]) + (ks & 3) * 32);
          wgmma_rs_n128<Tin, 0>(o1, xk, sa[ks], d, part > 0 || ks > 0);
        }
      }
      wgmma_commit();
      if (part == (kSS ? 1 : 0)) sm.local_full[ploc.stage].wait(ploc.phase);
      wgmma_wait<0>();
      fence_regs(o1);
      fence_regs(xk);
    }

    // ---- Y^T = yb (.) (V^T - ykf (.) X^T), zero past the chunk (select: V there is another
    // sequence's data); O1^T *= of --------------------------------------------------------
    {
      const uint32_t vbase = smem_addr(&in.v[sw][0][0]);
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t r[4];
        const int m = lane >> 3;
        const uint32_t t = 8 * (2 * jp + (m >> 1)) + (lane & 7);
        ldmatrix_x4_trans(r, vbase + swizzle128(t, 2 * warp + (m & 1)));
#pragma unroll
        for (int mm = 0; mm < 4; ++mm) {
          const int i = mm & 1, jj = 2 * jp + (mm >> 1);
          const float2 vv = unpack2<Tin>(r[mm]);
          const int idx = 4 * jj + 2 * i, t0 = 8 * jj + 2 * q4;
          const float2 f = *reinterpret_cast<const float2*>(&loc.ykf[t0]);
          const float2 b = *reinterpret_cast<const float2*>(&loc.yb[t0]);
          xk[idx] = t0 < len ? b.x * (vscale * vv.x - f.x * xk[idx]) : 0.f;
          xk[idx + 1] = t0 + 1 < len ? b.y * (vscale * vv.y - f.y * xk[idx + 1]) : 0.f;
        }
      }
      if (!states_only) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float2 f = *reinterpret_cast<const float2*>(&loc.of[8 * jj + 2 * q4]);
#pragma unroll
          for (int x = 0; x < 4; ++x) o1[4 * jj + x] *= (x & 1) ? f.y : f.x;
        }
      }
    }

    // ---- Vn = T Y by halves: T = [T_LL 0; T_HL T_HH] with T_HL = -T_HH A_HL T_LL, so
    //   Vn_L = T_LL Y_L,  Vn_H = T_HH (Y_H - A_HL Vn_L)
    // The local stage's T tile holds T_LL, T_HH and, in T_HL's place, -A_HL. Each step is a
    // 64 x 32 x 32 product per warpgroup (K-steps of 16 tokens; rows 32-63 of the tile start
    // 4096 bytes in); Y_H is updated in Y's own accumulator registers (xk[16..31]). ---------
    float vn[32] = {};
    {
      float(&vn_l)[16] = *reinterpret_cast<float(*)[16]>(&vn[0]);
      float(&vn_h)[16] = *reinterpret_cast<float(*)[16]>(&vn[16]);
      float(&y_h)[16] = *reinterpret_cast<float(*)[16]>(&xk[16]);
      const uint32_t t_hi = smem_addr(&loc.t[0][0][0]), t_lo = smem_addr(&loc.t[kSL ? 1 : 0][0][0]);
      // d (+)= frag(x, k-steps s0, s0 + 1) * tile rows [row0, row0 + 32), k-steps s0, s0 + 1
      auto half_product = [&](float(&d)[16], const float* x, int s0, uint32_t row0_bytes, bool acc) {
        wgmma_fence();
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int s = s0 + u;
          uint32_t a[4], al[4];
          to_fragments<Tin, kSL>(x, s, nullptr, a, al);
          const uint32_t off = row0_bytes + s * 32;
          wgmma_rs_n32<Tin>(d, a, desc_k_major(t_hi + off), acc || u > 0);
          if constexpr (kSL) {
            wgmma_rs_n32<Tin>(d, al, desc_k_major(t_hi + off), 1);
            wgmma_rs_n32<Tin>(d, a, desc_k_major(t_lo + off), 1);
          }
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(d);
      };
      half_product(vn_l, xk, 0, 0, false);      // Vn_L^T = Y_L^T T_LL^T
      half_product(y_h, vn, 0, 4096, true);     // Y_H^T += Vn_L^T (-A_HL)^T
      half_product(vn_h, xk, 2, 4096, false);   // Vn_H^T = Y_H^T T_HH^T
    }

    // ---- S^T <- decay S^T + (vd (.) Vn^T) K;  O^T = O1^T + Vn^T P^T -----------------------
    {
      uint32_t na[4][4], nl[4][4], da[4][4], dl[4][4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        // Formed even where states_only skips their products: skipping them too spilled 112 B
        // in the `high` kernel at D = 128 (nvcc 13.0).
        to_fragments<Tin, kSL>(vn, s, nullptr, na[s], nl[s]);
        to_fragments<Tin, kSU>(vn, s, loc.vd, da[s], dl[s]);
      }
      const float decay = loc.decay;
#pragma unroll
      for (int blk = 0; blk < kB; ++blk)
#pragma unroll
        for (int x = 0; x < 32; ++x) S[blk][x] *= decay;
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        // K rows 16 s .. 16 s + 15 of the chunk, read MN-major: N = the key index (D).
        const uint64_t dk = desc_mn_major(smem_addr(&in.qk[0][64 + 16 * s][0]), sizeof(in.qk[0]));
        if constexpr (kB == 2) {
          wgmma_rs_n128<Tin, 1>(S[0], S[kB - 1], da[s], dk, 1);
          if constexpr (kSU) wgmma_rs_n128<Tin, 1>(S[0], S[kB - 1], dl[s], dk, 1);
        } else {
          wgmma_rs_n64<Tin, 1>(S[0], da[s], dk, 1);
          if constexpr (kSU) wgmma_rs_n64<Tin, 1>(S[0], dl[s], dk, 1);
        }
        if (!states_only) {
          const uint64_t dp = desc_k_major(smem_addr(&loc.p[0][0][0]) + s * 32);
          wgmma_rs_n64<Tin, 0>(o1, na[s], dp, 1);
          if constexpr (kSL) {
            wgmma_rs_n64<Tin, 0>(o1, nl[s], dp, 1);
            wgmma_rs_n64<Tin, 0>(o1, na[s], desc_k_major(smem_addr(&loc.p[kSL ? 1 : 0][0][0]) + s * 32), 1);
          }
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int blk = 0; blk < kB; ++blk) fence_regs(S[blk]);
      fence_regs(o1);
    }
    // T, P and the factors are consumed; the input stage after the output has left through it
    // (the stmatrix writes are ordered before the producer's next TMA into the stage). A
    // warm-up chunk (before out_chunk0) writes neither o nor checkpoints.
    sm.local_empty[ploc.stage].arrive();
    const bool owned = j >= w.out_chunk0;
    if (p.o != nullptr && owned && store_output<Tr>(p, in.v[sw], o1, w, w.t0 + 64 * j, len, sw, tid_j))
      bulk_wait_group_read<0>();  // the TMA store has read the stage
    fence_proxy_async();
    sm.in_empty[pin.stage].arrive();
    if (p.ckpt.data != nullptr && owned && len == 64) {
      const int64_t done = 64 * static_cast<int64_t>(w.seq_chunk0 + j + 1);
      if (done % p.every == 0) {
        const int64_t ck_base = p.ckpt_offset != nullptr ? p.ckpt_offset[w.n] : w.n * (p.seq.T / p.every);
        store_state(S, p.ckpt, ck_base + done / p.every - 1, w.h, p.v_first, sw, tid_j);
      }
    }
  }

  // ---- final state ------------------------------------------------------------------------
  if (w.end == kEndSlot) {
    store_state(S, cp_state_ref(p, p.cp.ends), w.slot, w.h, 0, sw, tid);
  } else if (w.end == kEndTrans) {
    store_state(S, cp_state_ref(p, p.cp.trans), w.slot, w.h, 0, sw, tid);
  } else if (w.end == kEndFinal && p.write_final) {
    if (p.state_idx != nullptr) {
      const int64_t row = w.init == kInitH0 ? initial_state_source(p, w).row : -1;  // the pool row read
      if (row >= 0) store_state(S, p.h0, row, w.h, p.v_first, sw, tid);
    } else if (p.ht.data != nullptr) {
      store_state(S, p.ht, w.n, w.h, p.v_first, sw, tid);
    }
  }
}

}  // namespace flashgdn::sm90
