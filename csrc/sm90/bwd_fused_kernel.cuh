// The fused reverse kernel of the backward at `fast` and `default` (issue 36; bench/fused-backward.md):
// one CTA of four warpgroups per (sequence, value head) walks the sequence's chunks last to first
// with the carry dS = dL/dS (K x V, fp32, in registers), for K = V = 128, bf16. Each chunk runs the
// stage table of tests/python/fused_schedule.py, op for op (SCHEDULE): 16 stages separated by
// mbarriers, products on wgmma with 16-bit operands (bf16; at `default` T diag(beta), dVn and R in
// fp16, each tile scaled by a power of two: kF16Island) and fp32 accumulation.
//   producer (warpgroup 3): warp 0 loads q, k, v, S0 (after stage 10) and dO, Ar (after 13) of the
//            chunk before through TMA; warp 2 brings c and beta; warp 1 stores dk, dv, dq tiles;
//   C (warpgroup 0): the carry: dS = e^{c_L} dS + K^T dVg + Q^T dOg, and <dS, S0> for dg;
//   D (warpgroup 1): dVn = e^{c_L - c} (.) K dS + P^T dO, dR = Tb^T dVn (dv), dK;
//   R (warpgroup 2): the recompute of P, Tb, K S0, R, Vn and dP, dQ, dAr, X, dA, dbeta, dg.
// Inputs are prepared by bwd_fused.cu (slot-layout bf16 q, k, v, dO; c, beta; the gate-free inverse
// Ar = (I + strict_lower(diag(beta) K K^T))^-1); outputs go to its workspace for the reduce step.
// Its parameters: bwd_fused_params.h; which chunks a CTA walks: bwd_fused_scheduler.cuh.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/bwd_fused_frag.cuh"
#include "sm90/bwd_fused_params.h"
#include "sm90/bwd_fused_scheduler.cuh"
#include "sm90/ptx.cuh"
#include "sm90/tma.h"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90::fused_bwd {

constexpr int kStages = 16;
// The CTA: warpgroups 0-2 compute (C, D, R), warpgroup 3 is the producer.
constexpr int kWarpgroupThreads = 128, kComputeWarpgroups = 3, kThreads = 4 * kWarpgroupThreads;
// The producer's store warp ships `out` three times a chunk, j = 0, 1, 2 (dK of the chunk after,
// dv, dq): after stage out_written(j) and before stage out_freed(j) + 1 writes it again, so it
// arrives on those stages' barriers too.
__host__ __device__ constexpr int out_written(int j) { return j == 0 ? 0 : (j == 1 ? 4 : 10); }
__host__ __device__ constexpr int out_freed(int j) { return j == 0 ? 3 : (j == 1 ? 9 : 15); }
__host__ __device__ constexpr bool frees_out(int s) {
  return s == out_freed(0) || s == out_freed(1) || s == out_freed(2);
}
// Who arrives where, by the roles: the compute warpgroups' threads and the producer's store warp
// (all lanes) on the stage barriers; one elected lane of the producer's load warp
// (arrive_expect_tx) and of its (c, beta) warp on the full barriers.
constexpr uint32_t kStoreWarpArrivals = 32, kElectedLaneArrivals = 1;
// Stage s's barrier: every compute thread, and the store warp where stage s frees `out`.
__host__ __device__ constexpr uint32_t stage_arrivals(int s) {
  return kComputeWarpgroups * kWarpgroupThreads + (frees_out(s) ? kStoreWarpArrivals : 0);
}
// full0: the load warp's arrive_expect_tx; full1: that and the (c, beta) warp's arrival.
constexpr uint32_t kFull0Arrivals = kElectedLaneArrivals;
constexpr uint32_t kFull1Arrivals = 2 * kElectedLaneArrivals;
// Named barriers of one role (bar.sync id, a warpgroup's 128 threads; 0 is __syncthreads').
constexpr int kBarR = 1, kBarD = 2;
constexpr uint32_t kLoad0 = 3 * kTile + kState;        // q, k, v, S0 (reloaded after stage 10)
constexpr uint32_t kLoad0Transfer = 2 * kTile;          // q, k: what a transfer walk reads of load 0
constexpr uint32_t kLoad1 = kSmall + kTile;             // Ar, dO (reloaded after stage 13)
// c and beta (512 bytes, after stage 14) come through registers (the producer's warp 2): loaded a
// chunk ahead, stored once stage 14 ends, so no load latency is left between chunks.

struct alignas(1024) Smem {
  bf16 q[64 * 128], k[64 * 128], v[64 * 128], dO[64 * 128];
  bf16 s0[128 * 128], dsm[128 * 128];  // [K][V]: K rows, V in two 64-column blocks
  bf16 ar[64 * 64];
  bf16 t11[64 * 64], t12[64 * 64], t13[64 * 64];
  bf16 t21[64 * 128], t22[64 * 128], t23[64 * 128];
  bf16 out[64 * 128];
  float c[64], beta[64];                 // c then beta (the producer's warp 2 stores them as one)
  float dc_R[64], dc_D[64], dbeta_R[64];
  float dcl_part[4], kt_part[4];
  float amax_tb[4], amax_dvn[4], amax_r[4];  // kF16Island: each warp's largest |x| of Tb, dVn, R
  Mbarrier bar[kStages], full0, full1;
};

// The carry's element (a, v) = (64 m + row, 64 hf + col) of element e as an offset into a state
// tensor of sequence n, head h (fp32 | bf16 | fp16; [K][V] or V-major). The thread index comes
// from a volatile instruction: recomputed where used, so ptxas does not keep 128 offsets across
// the chunk loop from dS's load to dh0's store (it did, and spilled them).
struct CarryAt {
  int a, v;
};
__device__ __forceinline__ CarryAt carry_at(int m, int hf, int e) {
  int tx;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
  return {64 * m + 16 * ((tx >> 5) & 3) + ((tx & 31) >> 2) + 8 * ((e >> 1) & 1),
          64 * hf + 8 * (e >> 2) + 2 * (tx & 3) + (e & 1)};
}
template <class ParamsT>
__device__ __forceinline__ int64_t state_off(const ParamsT& P, const cuda::bwd::Tensor4& t, int64_t n, int h, int m,
                                             int hf, int e) {
  const CarryAt c = carry_at(m, hf, e);
  const int64_t base = n * t.s0 + h * t.s1;
  return P.state_v_first ? base + int64_t{c.v} * t.s2 + c.a : base + int64_t{c.a} * t.s2 + c.v;
}
// The carry's element as an offset into a fp32 [128][128] matrix (the CP transfers and seeds).
__device__ __forceinline__ int carry_off(int m, int hf, int e) {
  const CarryAt c = carry_at(m, hf, e);
  return c.a * 128 + c.v;
}

// f(m, hf, e) for every element of the carry (row block m, column block hf, accumulator element e;
// e by kStep), unrolled.
template <int kStep = 1, class F>
__device__ __forceinline__ void each_carry(F&& f) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int e = 0; e < 32; e += kStep) f(m, hf, e);
}



// d, opaque to ptxas: what is derived from it is formed again where used, not kept across stages.
__device__ __forceinline__ Descs opaque(Descs d) {
  asm volatile("" : "+l"(d.k), "+l"(d.mn64), "+l"(d.mn128));
  return d;
}

// The walk of one CTA. kCarryOnly: a transfer walk of phase 1 (WalkKind::kTransfer), the carry
// alone: its chain needs P, Tb (R's stages 0-2, and Q copied for P18 at 9), dVn, dR, dVg, dOg (D's
// stages 1-6, 13) and the carry's products; the other stages only meet at their barriers, no
// gradient is written, and the producer loads no v, S0. An instantiation of its own, chosen once
// at the kernel's top: branches between products at run time left ptxas unable to follow them
// (serialised wgmma, spills), and values kept across the roles' register split were spilled.
template <bool kCarryOnly, bool kF16Island>
__device__ __forceinline__ void fused_walk(const Params& P, int64_t n_seq, int h, int seg, bool zero_do) {
  constexpr bool transfer = kCarryOnly;  // no gradient written
  extern __shared__ __align__(16) uint8_t raw[];
  const uint32_t at = smem_addr(raw);
  Smem& S = *reinterpret_cast<Smem*>(raw + ((1024u - (at & 1023u)) & 1023u));
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const bool phase1 = P.phase == 1;
  // The walk (bwd_fused_scheduler.cuh): N chunks from chunk `first`, unit rows from u0. Each role
  // takes them after its register allocation (chain()): values live across the roles' split were
  // spilled.
  int N, u0, first, row_b, row_t0;
  bool from_dht, tail;
  const auto chain = [&]() {
    const Walk w = walk_of(P, n_seq, h, seg);
    N = w.chunks;
    u0 = w.u0;
    first = w.first;
    row_b = w.b;
    row_t0 = w.t0;
    from_dht = w.from_dht;
    tail = w.tail;
  };
  if (tid < kStages) S.bar[tid].init(stage_arrivals(tid));
  if (tid == kStages) S.full0.init(kFull0Arrivals);
  if (tid == kStages + 1) S.full1.init(kFull1Arrivals);
  fence_barrier_init();
  if (zero_do) {  // dO stays zero: the producer loads none
    for (int j = tid; j < int(kTile / 16); j += kThreads) reinterpret_cast<uint4*>(S.dO)[j] = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
  }
  __syncthreads();
  // Chunks last to first: iteration i works on chunk n = N - 1 - i, slot f + n, unit row u(n).
  auto unit = [&](int n) { return u0 + n * P.Hv; };
  auto gv = [&](int i) { return P.gates + size_t(unit(N - 1 - i)) * 128; };
  auto out_tile = [&](int n, int j) {  // j: 0 dk, 1 dv, 2 dq (slot 1 without dv)
    return P.out_tiles + (size_t(unit(n)) * P.out_count + (j == 2 ? P.out_count - 1 : j)) * kTile;
  };

  if (wg == 3) {  // ---- producer: loads (warp 0), stores (warp 1) ----------------------------
    setmaxnreg_dec<32>();
    chain();
    const int hq = h / P.group;
    // A 64 x 128 tile of a slot-layout tensor: two 64-column boxes, each 64 rows x 128 bytes,
    // the tile's two column blocks (its layout is the box's, swizzle included).
    // Box (c0, head, row) through the map's dimension order (sm90/tma.h: a one-head map puts
    // the rows first).
    auto box = [&](bf16* dst, const TileMap& m, Mbarrier* bar, int c0, int head, int row, int b = 0) {
      const TileMapOrder& o = m.order;
      tma_load_4d(dst, &m.map, bar, c0, o.at(1, head, row, b), o.at(2, head, row, b), o.at(3, head, row, b));
    };
    // Chunk N - 1 - i's rows in slot layout (the slot's 64 rows).
    auto tile = [&](bf16* dst, const TileMap& map, int head, int i, Mbarrier* bar) {
      const int row = (unit(N - 1 - i) - h) / P.Hv * 64;
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) box(dst + blk * 64 * 64, map, bar, blk * 64, head, row);
    };
    // Its v or dO rows: with vo_direct the user's [B, T, H, D] tensor's (the sequence's batch row,
    // tokens from its first + 64 (first + N - 1 - i); rows past the tensor's end read as zeros),
    // a packed sequence's partial last chunk (`tail`, the walk's first) from the tail's rows
    // n 64 (its rows past the length are the next sequence's there); else the slot's.
    auto vo_tile = [&](bf16* dst, const TileMap& map, const TileMap& tail_map, int i, Mbarrier* bar) {
      if (!P.vo_direct) return tile(dst, map, h, i, bar);
      const bool t = tail && i == 0;
      const int row = t ? static_cast<int>(n_seq) * 64 : row_t0 + (first + N - 1 - i) * 64;
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) box(dst + blk * 64 * 64, t ? tail_map : map, bar, blk * 64, h, row, t ? 0 : row_b);
    };
    if (warp == 0 && lane == 0) {
      auto load0 = [&](int i) {
        S.full0.arrive_expect_tx(transfer ? kLoad0Transfer : kLoad0);
        tile(S.q, P.tq, hq, i, &S.full0);
        tile(S.k, P.tk, hq, i, &S.full0);
        if (transfer) return;  // a transfer walk reads no v, S0
        vo_tile(S.v, P.tv, P.tv_tail, i, &S.full0);
        // S0 (128 rows): four boxes of 64 rows, column block blk's rows at blk 128 128 bytes.
        const int row = unit(N - 1 - i) * 128;
#pragma unroll
        for (int blk = 0; blk < 2; ++blk)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            box(S.s0 + blk * 128 * 64 + half * 64 * 64, P.ts0, &S.full0, blk * 64, 0, row + 64 * half);
      };
      auto load1 = [&](int i) {
        S.full1.arrive_expect_tx(zero_do ? kSmall : kLoad1);
        if (!zero_do) vo_tile(S.dO, P.tdo, P.tdo_tail, i, &S.full1);
        bulk_load(S.ar, P.ar + size_t(unit(N - 1 - i)) * kSmall, kSmall, &S.full1);
      };
      if (N > 0) {
        load0(0);
        load1(0);
      }
      for (int i = 0; i + 1 < N; ++i) {
        S.bar[10].wait(i & 1);
        load0(i + 1);
        S.bar[13].wait(i & 1);
        load1(i + 1);
      }
    } else if (warp == 2) {  // c, beta: 128 floats, four a lane, c then beta as in Smem
      for (int i = 0; i < N; ++i) {
        const float4 v = reinterpret_cast<const float4*>(gv(i))[lane];
        if (i > 0) S.bar[14].wait((i - 1) & 1);
        reinterpret_cast<float4*>(S.c)[lane] = v;
        __syncwarp();
        if (lane == 0) S.full1.arrive();
      }
    } else if (warp == 1) {
      for (int i = 0; i < N; ++i) {
        const int n = N - 1 - i;
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          S.bar[out_written(j)].wait(i & 1);
          // j = 0: the dK of the chunk after (none on the walk's first chunk); 1: dv; 2: dq.
          if (lane == 0 && (j > 0 || i > 0) && !transfer) {
            if (j == 1 && P.dv_direct && tail && i == 0) {  // a packed sequence's tail: its dv tile
              bulk_store(P.dv_tail + (size_t(n_seq) * P.Hv + h) * kTile, S.out, kTile);
            } else if (j == 1 && P.dv_direct) {  // dv into the user's tensor: the sequence's rows of chunk first + n
              const TileMapOrder& o = P.tdv.order;
              const int row = row_t0 + (first + n) * 64, b = row_b;
#pragma unroll
              for (int blk = 0; blk < 2; ++blk)
                tma_store_4d(&P.tdv.map, S.out + blk * 64 * 64, blk * 64, o.at(1, h, row, b), o.at(2, h, row, b),
                             o.at(3, h, row, b));
            } else {
              bulk_store(out_tile(j == 0 ? n + 1 : n, j), S.out, kTile);
            }
            bulk_commit_group();
            bulk_wait_group_read<0>();
          }
          __syncwarp();
          S.bar[out_freed(j)].arrive();
        }
      }
      if (lane == 0) bulk_wait_group<0>();
    }
    return;
  }

  const float scale = P.scale;
  if (wg == 0) {  // ---- C: the carry dS (K x V fp32), rows 64 m + arow, columns 64 half + acol ---
    setmaxnreg_inc<176>();
    chain();
    const Descs dd = descs(S);
    const Frag fr = frag();
    float ds[2][2][32];
    // The carry at the walk's start: d_final_state (the sequence's end), the scan's seed (a
    // segment before it), or phase 1's 0 or I.
    const size_t chain_seg = (size_t(n_seq) * P.Hv + h) * P.segments + seg;
    each_carry([&](int m, int hf, int e) {
      if (transfer) {
        const CarryAt c = carry_at(m, hf, e);
        ds[m][hf][e] = zero_do && c.a == c.v ? 1.f : 0.f;
      } else if (!from_dht) {
        ds[m][hf][e] = P.cp_seeds[chain_seg * 16384 + carry_off(m, hf, e)];
      } else {
        ds[m][hf][e] = P.has_dht ? cuda::load_as_float(P.dht.data, P.dht.dtype, state_off(P, P.dht, n_seq, h, m, hf, e)) : 0.f;
      }
    });
    auto mirror = [&]() {  // dsm = bf16(dS)
      each_carry<2>([&](int m, int hf, int e) { fst2<128>(S.dsm, fr, e, ds[m][hf][e], ds[m][hf][e + 1], hf, m); });
    };
    mirror();  // dS at the sequence's end, before stage 1 of the first chunk reads it
    fence_proxy_async();
    for (int i = 0; i < N; ++i) {
      const uint32_t ph = i & 1;
      S.full0.wait(ph);
      S.full1.wait(ph);
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        if (s == 1) {  // decay: dS = e^{c_L} dS
          const float eL = fexp(S.c[63]);
          each_carry([&](int m, int hf, int e) { ds[m][hf][e] *= eL; });
        }
        if (s == 4 && !transfer) {  // <dS, S0> for dg (dS already decayed: e^{c_L} <dS_in, S0>)
          float part[4] = {0.f, 0.f, 0.f, 0.f};  // four chains, not one of 128 dependent FMAs
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 32; e += 2) {
                const float2 s0 = fld2<128>(S.s0, fr, e, hf, m);
                part[2 * m + hf] += ds[m][hf][e] * s0.x + ds[m][hf][e + 1] * s0.y;
              }
          float acc = (part[0] + part[1]) + (part[2] + part[3]);
          acc = octet_sum(quad_sum(acc));
          if (lane == 0) S.dcl_part[warp] = acc;
        }
        if (s == 11) {  // P13: dS += K^T dVg (K from t22, dVg from t23)
#pragma unroll
          for (int m = 0; m < 2; ++m)
            mm128<1, 1, 4>(ds[m], [&](int k) { return mnmaj(dd, S, S.t22, 64, k, m * 8192); },
                           [&](int k) { return mnmaj(dd, S, S.t23, 64, k); }, true);
        }
        if (s == 14) {  // P18: dS += Q^T dOg (Q copy in t21)
#pragma unroll
          for (int m = 0; m < 2; ++m)
            mm128<1, 1, 4>(ds[m], [&](int k) { return mnmaj(dd, S, S.t21, 64, k, m * 8192); },
                           [&](int k) { return mnmaj(dd, S, S.t23, 64, k); }, true);
        }
        if (s == 15) {
          mirror();
          fence_proxy_async();
        }
        S.bar[s].arrive();
        S.bar[s].wait(ph);
      }
    }
    const bool seeding = phase1 && !transfer;  // the last segment's: its start carry seeds seg - 1
    if (transfer || seeding) {  // A_s or B_s, or the seed of the segment before
      float* map = transfer ? P.cp_maps + (chain_seg * 2 + (zero_do ? 1 : 0)) * 16384 : P.cp_seeds + (chain_seg - 1) * 16384;
      each_carry([&](int m, int hf, int e) { map[carry_off(m, hf, e)] = ds[m][hf][e]; });
    } else if (P.want_dh0 && seg == 0) {  // dh0 = dS at the sequence's start (zero where its state index is < 0)
      const bool keep = !P.has_state_indices || cuda::load_index(P.state_indices, P.idx_dtype, n_seq) >= 0;
      each_carry([&](int m, int hf, int e) {
        cuda::store_from_float(P.dh0.data, P.dh0.dtype, state_off(P, P.dh0, n_seq, h, m, hf, e), keep ? ds[m][hf][e] : 0.f);
      });
    }
  } else if (wg == 1) {  // ---- D: dVn, dR (dv), dK -------------------------------------------
    setmaxnreg_dec<112>();  // from the launch's 128: a decrease
    chain();
    const Descs dd = descs(S);
    const Frag fr = frag();
    float acc[2][32];
    auto emit = [&](bf16* tile) {  // acc (64 x 128) to a tile, bf16
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int e = 0; e < 32; e += 2) fst2(tile, fr, e, acc[hf][e], acc[hf][e + 1], hf);
    };
    for (int i = 0; i < N; ++i) {
      const uint32_t ph = i & 1;
      S.full0.wait(ph);
      S.full1.wait(ph);
      const float* c = S.c;
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        if (s == 0 && i > 0 && !transfer) {  // the chunk after's dK to out
          emit(S.out);
          fence_proxy_async();
        }
        if (s == 1) {  // P2: dVn = e^{c_L - c} (.) (K dsm)
          mm128<0, 1, 8>(acc, [&](int k) { return kmaj(dd, S, S.k, 64, k); }, [&](int k) { return mnmaj(dd, S, S.dsm, 128, k); },
                         false);
          const float dec[2] = {fexp(c[63] - c[fr.r0]), fexp(c[63] - c[fr.r0 + 8])};
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 32; ++e) acc[hf][e] *= dec[(e >> 1) & 1];
        }
        if (s == 2)  // P3: dVn += P^T dO
          mm128<1, 1, 4>(acc, [&](int k) { return mnmaj(dd, S, S.t11, 64, k); }, [&](int k) { return mnmaj(dd, S, S.dO, 64, k); },
                         true);
        if (s == 3) {  // dVn staged in t21 (kF16Island: fp16, scaled by sd)
          if constexpr (kF16Island) {
            float m = 0.f;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 32; ++e) m = fmaxf(m, fabsf(acc[hf][e]));
            const Pow2Scale sd = role_scale(m, S.amax_dvn, kBarD);
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 32; e += 2) fst2_f16(S.t21, fr, e, sd.s * acc[hf][e], sd.s * acc[hf][e + 1], hf);
          } else {
            emit(S.t21);
          }
          fence_proxy_async();
        }
        if (s == 4) {  // P5: dR = Tb^T dVn (kF16Island: on fp16, then both tiles' scales undone); dv to out
          if constexpr (kF16Island) {
            mm128<1, 1, 4, __half>(acc, [&](int k) { return mnmaj(dd, S, S.t12, 64, k); },
                                   [&](int k) { return mnmaj(dd, S, S.t21, 64, k); }, false);
            // One scale at a time (exact): their product alone could leave the float range.
            const float it = pow2_scale_of(S.amax_tb).inv, id = pow2_scale_of(S.amax_dvn).inv;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 32; ++e) acc[hf][e] = acc[hf][e] * it * id;
          } else {
            mm128<1, 1, 4>(acc, [&](int k) { return mnmaj(dd, S, S.t12, 64, k); },
                           [&](int k) { return mnmaj(dd, S, S.t21, 64, k); }, false);
          }
          if (!transfer) {
            emit(S.out);
            fence_proxy_async();
          }
        }
        if (s == 5) {  // dg's R term: dR (.) (-e^c K S0), K S0 in t23; then dVg = -e^c dR to t23
          const float ex[2] = {fexp(c[fr.r0]), fexp(c[fr.r0 + 8])};
          if (!transfer) {
            float rs[2] = {0.f, 0.f};
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 32; e += 2) {
                const float2 ks = fld2(S.t23, fr, e, hf);
                rs[(e >> 1) & 1] -= ex[(e >> 1) & 1] * (acc[hf][e] * ks.x + acc[hf][e + 1] * ks.y);
              }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              rs[j] = quad_sum(rs[j]);
              if ((lane & 3) == 0) S.dc_D[fr.r0 + 8 * j] = rs[j];
            }
            __syncwarp();
          }
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
              const float f = -ex[(e >> 1) & 1];
              fst2(S.t23, fr, e, f * acc[hf][e], f * acc[hf][e + 1], hf);
            }
          fence_proxy_async();
        }
        if (s == 6) {  // K copied to t22 (the same layout: a 16 KB copy)
          const uint4* src = reinterpret_cast<const uint4*>(S.k);
          uint4* dst = reinterpret_cast<uint4*>(S.t22);
          for (int j = tid & 127; j < int(kTile / 16); j += 128) dst[j] = src[j];
          fence_proxy_async();
        }
        if (s == 7 && !transfer)  // P9: dK~ = Vn dsm^T
          mm128<0, 0, 8>(acc, [&](int k) { return kmaj(dd, S, S.t21, 64, k); }, [&](int k) { return kmaj(dd, S, S.dsm, 128, k); },
                         false);
        if (s == 8 && !transfer) {  // dK = e^{c_L - c} (.) dK~; dg's K~ term
          float rs[2] = {0.f, 0.f};
          const float dec[2] = {fexp(c[63] - c[fr.r0]), fexp(c[63] - c[fr.r0 + 8])};
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
              const float f = dec[(e >> 1) & 1];
              const float2 kk = fld2(S.t22, fr, e, hf);
              acc[hf][e] *= f;
              acc[hf][e + 1] *= f;
              rs[(e >> 1) & 1] += acc[hf][e] * kk.x + acc[hf][e + 1] * kk.y;
            }
          float tot = 0.f;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            rs[j] = quad_sum(rs[j]);
            if ((lane & 3) == 0) S.dc_D[fr.r0 + 8 * j] -= rs[j];
            tot += rs[j];
          }
          tot = octet_sum(tot);  // the warp's 16 rows (each row's sum counted once: lanes q = 0 .. 3 hold it)
          if (lane == 0) S.kt_part[warp] = tot;
          role_sync(kBarD);
          if ((tid & 127) == 0) S.dc_D[63] += S.kt_part[0] + S.kt_part[1] + S.kt_part[2] + S.kt_part[3];
        }
        if (s == 9 && !transfer)  // P11: dK += dVg S0^T
          mm128<0, 0, 8>(acc, [&](int k) { return kmaj(dd, S, S.t23, 64, k); }, [&](int k) { return kmaj(dd, S, S.s0, 128, k); },
                         true);
        if (s == 12 && !transfer)  // P14: dK += dP^T Q
          mm128<1, 1, 4>(acc, [&](int k) { return mnmaj(dd, S, S.t11, 64, k); }, [&](int k) { return mnmaj(dd, S, S.t21, 64, k); },
                         true);
        if (s == 13) {  // dOg = scale e^c (.) dO to t23, for the carry's P18
          const float f[2] = {scale * fexp(c[fr.r0]), scale * fexp(c[fr.r0 + 8])};
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
              const float fe = f[(e >> 1) & 1];
              const float2 d = fld2(S.dO, fr, e, hf);
              fst2(S.t23, fr, e, fe * d.x, fe * d.y, hf);
            }
          fence_proxy_async();
        }
        if (s == 15 && !transfer)  // P19: dK += dAs K
          mm128<0, 1, 4>(acc, [&](int k) { return kmaj(dd, S, S.t12, 64, k); }, [&](int k) { return mnmaj(dd, S, S.t22, 64, k); },
                         true);
        S.bar[s].arrive();
        S.bar[s].wait(ph);
      }
    }
    // The epilogue: the walk's last chunk (chunk 0) dK, once the store warp is done with out.
    emit(S.out);
    fence_proxy_async();
    role_sync(kBarD);
    if ((tid & 127) == 0 && N > 0 && !transfer) {
      bulk_store(out_tile(0, 0), S.out, kTile);
      bulk_commit_group();
      bulk_wait_group<0>();
    }
  } else {  // ---- R: P, Tb, K S0, R, Vn, dP, dQ, dAr, X, dA, dbeta, dg ---------------------------
    setmaxnreg_inc<192>();
    chain();
    const Descs dd_role = descs(S);
    const Frag fr = frag();
    float p[32], x[32], wide[2][32];
    for (int i = 0; i < N; ++i) {
      const uint32_t ph = i & 1;
      const int n = N - 1 - i;
      S.full0.wait(ph);
      S.full1.wait(ph);
      const float* c = S.c;
      const float* beta = S.beta;
      // The stages as straight-line code (the loop form stays a loop: ptxas then cannot follow a
      // product issued in one stage and waited for in a later one, and waits at every stage's end).
      auto stage = [&](auto stage_index) {
        constexpr int s = decltype(stage_index)::value;
        // The descriptors afresh each stage (opaque to ptxas): kept from one stage to a later one, a
        // 64-bit one was spilled once the split products came in.
        const Descs dd = opaque(dd_role);
        if (s == 0) {  // P1: P = Q K^T; P4 (K S0, stage 3's) issued behind it, to run under stages 1-2
          mm64_issue<0, 0, 8>(p, [&](int k) { return kmaj(dd, S, S.q, 64, k); }, [&](int k) { return kmaj(dd, S, S.k, 64, k); });
          if constexpr (transfer) {  // the carry needs P and Tb of R's work, nothing else
            mm_wait<0>(p);
          } else {
            mm128_issue<0, 1, 8>(wide, [&](int k) { return kmaj(dd, S, S.k, 64, k); },
                                 [&](int k) { return mnmaj(dd, S, S.s0, 128, k); });
            mm_wait<1>(p);
          }
          if ((tid & 127) < 64) S.dc_R[tid & 127] = 0.f;
        }
        if (s == 1) {  // P staged: t11 = scale lower(P) (.) Gam
          const FragVec cf = frag_vec(c, fr.r0, fr.cq);
#pragma unroll
          for (int e = 0; e < 32; e += 2) {
            const int r = frow(fr, e), col = fcol(fr, e);
            fst2(S.t11, fr, e, scale * p[e] * gam_at(cf, e, r, col), scale * p[e + 1] * gam_at(cf, e + 1, r, col + 1));
          }
          fence_proxy_async();
        }
        if (s == 2) {  // Tb staged: t12 = Gam (.) Ar diag(beta) (kF16Island: fp16, scaled), while P4 runs
          const FragVec cf = frag_vec(c, fr.r0, fr.cq), bf = frag_vec(beta, fr.r0, fr.cq);
          if constexpr (kF16Island) {  // Tb in x (free until P6 writes it at stage 5) until its scale is known
            float m = 0.f;
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
              const int r = frow(fr, e), col = fcol(fr, e);
              const float2 a = fld2(S.ar, fr, e);
              x[e] = gam_at(cf, e, r, col) * a.x * col_of(bf, e);
              x[e + 1] = gam_at(cf, e + 1, r, col + 1) * a.y * col_of(bf, e + 1);
              m = fmaxf(m, fmaxf(fabsf(x[e]), fabsf(x[e + 1])));
            }
            const Pow2Scale st = role_scale(m, S.amax_tb, kBarR);
#pragma unroll
            for (int e = 0; e < 32; e += 2) fst2_f16(S.t12, fr, e, st.s * x[e], st.s * x[e + 1]);
          } else {
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
              const int r = frow(fr, e), col = fcol(fr, e);
              const float2 a = fld2(S.ar, fr, e);
              fst2(S.t12, fr, e, gam_at(cf, e, r, col) * a.x * col_of(bf, e),
                   gam_at(cf, e + 1, r, col + 1) * a.y * col_of(bf, e + 1));
            }
          }
          fence_proxy_async();
        }
        if (s == 3 && !transfer) mm_wait<0>(wide);  // P4: K S0 (issued at stage 0)
        if (s == 4 && !transfer) {  // K S0 staged in t23, R = V - e^c (.) K S0 staged in t22 (kF16Island: fp16, scaled)
          const float ec[2] = {fexp(c[fr.r0]), fexp(c[fr.r0 + 8])};
          [[maybe_unused]] float m = 0.f;  // kF16Island: R's largest magnitude
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
              const __nv_bfloat162 kb = __floats2bfloat162_rn(wide[hf][e], wide[hf][e + 1]);  // K S0 staged
              *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<char*>(S.t23) + foff(fr, e, 64, hf, 0)) = kb;
              const float k0 = __low2float(kb), k1 = __high2float(kb);
              const float f = ec[(e >> 1) & 1];
              const float2 vv = fld2(S.v, fr, e, hf);
              if constexpr (kF16Island) {  // R kept in wide (K S0 is not read again) until its scale is known
                wide[hf][e] = vv.x - f * k0;
                wide[hf][e + 1] = vv.y - f * k1;
                m = fmaxf(m, fmaxf(fabsf(wide[hf][e]), fabsf(wide[hf][e + 1])));
              } else {
                fst2(S.t22, fr, e, vv.x - f * k0, vv.y - f * k1, hf);
              }
            }
          if constexpr (kF16Island) {
            const Pow2Scale sr = role_scale(m, S.amax_r, kBarR);
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 32; e += 2) fst2_f16(S.t22, fr, e, sr.s * wide[hf][e], sr.s * wide[hf][e + 1], hf);
          }
          fence_proxy_async();
        }
        if (s == 5 && !transfer) {  // P6: dT~ = dVn R^T; P7: Vn = Tb R, staged in t21
          if constexpr (kF16Island) {  // on the fp16 tiles, then their scales undone (one at a time: exact)
            mm64<0, 0, 8, __half>(x, [&](int k) { return kmaj(dd, S, S.t21, 64, k); },
                                  [&](int k) { return kmaj(dd, S, S.t22, 64, k); }, false);
            mm128<0, 1, 4, __half>(wide, [&](int k) { return kmaj(dd, S, S.t12, 64, k); },
                                   [&](int k) { return mnmaj(dd, S, S.t22, 64, k); }, false);
            const float id = pow2_scale_of(S.amax_dvn).inv, ir = pow2_scale_of(S.amax_r).inv,
                        it = pow2_scale_of(S.amax_tb).inv;
#pragma unroll
            for (int e = 0; e < 32; ++e) x[e] = x[e] * id * ir;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 32; ++e) wide[hf][e] = wide[hf][e] * it * ir;
          } else {
            mm64<0, 0, 8>(x, [&](int k) { return kmaj(dd, S, S.t21, 64, k); }, [&](int k) { return kmaj(dd, S, S.t22, 64, k); },
                          false);
            mm128<0, 1, 4>(wide, [&](int k) { return kmaj(dd, S, S.t12, 64, k); }, [&](int k) { return mnmaj(dd, S, S.t22, 64, k); },
                           false);
          }
          role_sync(kBarR);  // every R warp has read dVn from t21 before it becomes Vn
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 32; e += 2) fst2(S.t21, fr, e, wide[hf][e], wide[hf][e + 1], hf);
          fence_proxy_async();
        }
        if (s == 6 && !transfer) {  // P8: dP = dO Vn^T
          mm64_issue<0, 0, 8>(p, [&](int k) { return kmaj(dd, S, S.dO, 64, k); }, [&](int k) { return kmaj(dd, S, S.t21, 64, k); });
          mm_wait<0>(p);
        }
        if (s == 7 && !transfer) {  // dP staged; dg's Gam terms; dT, dAr; dbeta's T term
          // Per-warp column sums (dg's, then dbeta's), summed in warp order: fp32 scratch in t13
          // (free until stage 11).
          float(*colpart)[64] = reinterpret_cast<float(*)[64]>(S.t13);
          // Each thread reads and overwrites only its own elements of t11 (the staged P, then dP): dP
          // is written as each pair is done. Column sums a block of eight columns at a time.
          float rs[2] = {0.f, 0.f};
          const FragVec cf = frag_vec(c, fr.r0, fr.cq), bf = frag_vec(beta, fr.r0, fr.cq);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float cs[2], cb[2];  // columns 8 j + 2 q + b, b = 0, 1: over the thread's two rows
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
              const int e0 = 4 * j + 2 * hi;
              const float2 pst2 = fld2(S.t11, fr, e0);  // the staged P (scale, mask and Gam in it)
              const float2 ar2 = fld2(S.ar, fr, e0);
#pragma unroll
              for (int b = 0; b < 2; ++b) {
                const int e = e0 + b;
                const int r = frow(fr, e), col = fcol(fr, e);
                const float gm = gam_at(cf, e, r, col);
                const float pp = (r >= col ? p[e] : 0.f) * (b ? pst2.y : pst2.x);
                const float t = gm * (b ? ar2.y : ar2.x);
                const float dt = x[e] * col_of(bf, e);
                const float tt = r > col ? dt * t : 0.f;
                rs[hi] += pp + tt;
                // Column terms: -pp - tt for dg, dtb (.) t for dbeta.
                cs[b] = hi ? cs[b] - (pp + tt) : -(pp + tt);
                cb[b] = hi ? cb[b] + x[e] * t : x[e] * t;
                p[e] = scale * (r >= col ? p[e] : 0.f) * gm;  // dP
                x[e] = r > col ? dt * gm : 0.f;               // dAr (register)
              }
              fst2(S.t11, fr, e0, p[e0], p[e0 + 1]);
            }
            // The four sums over the warp's 16 rows (the eight lanes g of a column) by reduce-scatter:
            // v = (cs0, cs1, cb0, cb1); after three exchanges lane (g, q) holds v[2 g0 + g1] summed
            // over g (4 shuffles instead of 4 octet sums' 12).
            const int g0 = (lane >> 2) & 1, g1 = (lane >> 3) & 1;
            float a0 = g0 ? cb[0] : cs[0], a1 = g0 ? cb[1] : cs[1];
            const float s0 = g0 ? cs[0] : cb[0], s1 = g0 ? cs[1] : cb[1];
            a0 += __shfl_xor_sync(~0u, s0, 4);
            a1 += __shfl_xor_sync(~0u, s1, 4);
            float v = g1 ? a1 : a0;
            v += __shfl_xor_sync(~0u, g1 ? a0 : a1, 8);
            v += __shfl_xor_sync(~0u, v, 16);
            if (lane < 16) colpart[4 * g0 + warp][8 * j + 2 * (lane & 3) + g1] = v;
          }
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            rs[j] = quad_sum(rs[j]);
            if ((lane & 3) == 0) S.dc_R[fr.r0 + 8 * j] += rs[j];
          }
          role_sync(kBarR);  // column partials written
          if ((tid & 127) < 64) {
            const int col = tid & 127;
            S.dc_R[col] += colpart[0][col] + colpart[1][col] + colpart[2][col] + colpart[3][col];
            S.dbeta_R[col] = colpart[4][col] + colpart[5][col] + colpart[6][col] + colpart[7][col];
          }
          fence_proxy_async();
        }
        // P10: dQ~ = dO S0^T. Issued at stage 6 to run under stage 7 it was slower (16.2 against 15.2
        // us a chunk step, 132 heads x 64 chunks): its 64 accumulators spilled stage 7's work.
        if (s == 8 && !transfer)
          mm128<0, 0, 8>(wide, [&](int k) { return kmaj(dd, S, S.dO, 64, k); }, [&](int k) { return kmaj(dd, S, S.s0, 128, k); },
                         false);
        if (s == 9) {  // dQ = scale e^c (.) dQ~; dg's Q~ term; Q copied to t21 (for the carry's P18)
          if (!transfer) {
            float rs[2] = {0.f, 0.f};
            const float fq[2] = {scale * fexp(c[fr.r0]), scale * fexp(c[fr.r0 + 8])};
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 32; ++e) {
                const float f = fq[(e >> 1) & 1];
                const float qv = fld(S.q, fr, e, hf);
                wide[hf][e] *= f;
                rs[(e >> 1) & 1] += wide[hf][e] * qv;
              }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              rs[j] = quad_sum(rs[j]);
              if ((lane & 3) == 0) S.dc_R[fr.r0 + 8 * j] += rs[j];
            }
          }
          const uint4* src = reinterpret_cast<const uint4*>(S.q);
          uint4* dst = reinterpret_cast<uint4*>(S.t21);
          for (int j = tid & 127; j < int(kTile / 16); j += 128) dst[j] = src[j];
          fence_proxy_async();
        }
        if (s == 10 && !transfer) {  // P12: dQ += dP K; dq to out
          mm128<0, 1, 4>(wide, [&](int k) { return kmaj(dd, S, S.t11, 64, k); }, [&](int k) { return mnmaj(dd, S, S.t22, 64, k); },
                         true);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 32; e += 2) fst2(S.out, fr, e, wide[hf][e], wide[hf][e + 1], hf);
          fence_proxy_async();
        }
        if (s == 11 && !transfer) {  // dAr staged in t13
#pragma unroll
          for (int e = 0; e < 32; e += 2) fst2(S.t13, fr, e, x[e], x[e + 1]);
          fence_proxy_async();
        }
        if (s == 12 && !transfer) {  // P15: X = Ar^T dAr, staged in t12; P17 (K K^T, stage 13's) issued behind it
          mm64_issue<1, 1, 4>(x, [&](int k) { return mnmaj(dd, S, S.ar, 64, k); }, [&](int k) { return mnmaj(dd, S, S.t13, 64, k); });
          mm64_issue<0, 0, 8>(p, [&](int k) { return kmaj(dd, S, S.t22, 64, k); }, [&](int k) { return kmaj(dd, S, S.t22, 64, k); });
          mm_wait<1>(x);
#pragma unroll
          for (int e = 0; e < 32; e += 2) fst2(S.t12, fr, e, x[e], x[e + 1]);
          fence_proxy_async();
        }
        if (s == 13 && !transfer) {  // P16: dA0 = -lower(X Ar^T); P17 (issued at stage 12) waited for with it
          role_sync(kBarR);  // X complete in t12
          mm64_issue<0, 0, 4>(x, [&](int k) { return kmaj(dd, S, S.t12, 64, k); }, [&](int k) { return kmaj(dd, S, S.ar, 64, k); });
          mm_wait<0>(x);
          fence_regs(p);
#pragma unroll
          for (int e = 0; e < 32; ++e) x[e] = frow(fr, e) > fcol(fr, e) ? -x[e] : 0.f;
        }
        if (s == 14 && !transfer) {  // dbeta's A0 term; dAs = dkk + dkk^T staged in t12 (dkk = dA0 rows by beta)
          float rs[2] = {0.f, 0.f};
#pragma unroll
          for (int e = 0; e < 32; ++e) {
            rs[(e >> 1) & 1] += x[e] * p[e];
            x[e] *= beta[frow(fr, e)];
          }
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            rs[j] = quad_sum(rs[j]);
            if ((lane & 3) == 0) S.dbeta_R[fr.r0 + 8 * j] += rs[j];
          }
          // dkk's transpose through shared memory as hi + lo bf16 halves (t13 and t11, free now).
#pragma unroll
          for (int e = 0; e < 32; e += 2) {
            const float h0 = __bfloat162float(__float2bfloat16_rn(x[e]));
            const float h1 = __bfloat162float(__float2bfloat16_rn(x[e + 1]));
            fst2(S.t13, fr, e, h0, h1);
            fst2(S.t11, fr, e, x[e] - h0, x[e + 1] - h1);
          }
          role_sync(kBarR);
          uint32_t th[16], tl[16];
          fld_t_pairs(S.t13, fr, th);
          fld_t_pairs(S.t11, fr, tl);
#pragma unroll
          for (int e = 0; e < 32; e += 2) {
            const float2 h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&th[e / 2]));
            const float2 l = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&tl[e / 2]));
            fst2(S.t12, fr, e, x[e] + h.x + l.x, x[e + 1] + h.y + l.y);
          }
          fence_proxy_async();
        }
        if (s == 15 && !transfer) {  // dg by a reverse cumulative sum; dbeta out
          {  // dg_r = sum_{r' >= r} d_r': lane l holds rows 2 l, 2 l + 1; a suffix scan of pairs (every R
             // warp scans, warp 0 stores: the shuffles stay in converged code)
            float* dg = P.dg + size_t(unit(n)) * 64;
            const float lo = S.dc_R[2 * lane] + S.dc_D[2 * lane];
            float hi = S.dc_R[2 * lane + 1] + S.dc_D[2 * lane + 1];
            if (lane == 31) hi += S.dcl_part[0] + S.dcl_part[1] + S.dcl_part[2] + S.dcl_part[3];
            float x = lo + hi;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
              const float y = __shfl_down_sync(~0u, x, o);
              if (lane + o < 32) x += y;
            }
            float after = __shfl_down_sync(~0u, x, 1);  // the pairs after this lane's
            if (lane == 31) after = 0.f;
            if (warp == 0) {
              dg[2 * lane + 1] = after + hi;
              dg[2 * lane] = after + hi + lo;
            }
          }
          if ((tid & 127) < 64) P.dbeta[size_t(unit(n)) * 64 + (tid & 127)] = S.dbeta_R[tid & 127];
        }
        S.bar[s].arrive();
        S.bar[s].wait(ph);
      };
      each_stage(stage, std::make_integer_sequence<int, kStages>{});
    }
  }
}

// kF16Island (`default`): T diag(beta), dVn and R, the operands of P5 (dR = Tb^T dVn, the dv), P6
// (dT~ = dVn R^T: dbeta's T term, dA's) and P7 (Vn = Tb R), staged in fp16 instead of bf16 (11
// significant bits against 8), each tile scaled by a power of two into fp16's range (its largest
// magnitude to [2^14, 2^15): gradients far below 1 stay normal) and the products' scales undone
// after them. Every other staged value stays bf16. bench/fused-backward.md, "The fp16 island".
template <bool kF16Island>
__global__ void __launch_bounds__(kThreads, 1) fused_bwd(const __grid_constant__ Params P) {
  // This CTA's chain: value head h of sequence n, its chunks in slots f .. f + N - 1
  // (cuda/chunk_index.cuh), walked last to first; under reverse CP (P.seg_chunks > 0) segment
  // `seg` of it (Params, bwd_fused_scheduler.cuh's walk_kind).
  const int h = blockIdx.y;
  const int64_t n_seq = blockIdx.x;
  const bool phase1 = P.phase == 1;
  const int seg = phase1 ? blockIdx.z >> 1 : blockIdx.z;
  const bool zero_do = phase1 && (blockIdx.z & 1) != 0;  // the A_s walk: dS = I, dO = 0
  const WalkKind kind = walk_kind(P, n_seq, h, seg, phase1, zero_do);
  if (kind == WalkKind::kTransfer)
    fused_walk<true, kF16Island>(P, n_seq, h, seg, zero_do);
  else if (kind != WalkKind::kNone)
    fused_walk<false, kF16Island>(P, n_seq, h, seg, zero_do);
}
}  // namespace flashgdn::sm90::fused_bwd
