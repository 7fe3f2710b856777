// Chunk-local role of the Hopper forward (warpgroup 1). Everything of a chunk that does not
// depend on the state, computed while the state warpgroups work on the previous chunk:
//
//   c_t   = g_1 + ... + g_t (in-chunk cumulative gate; the gate floored, see common/numerics.h)
//   f_t   = 1 / sqrt(|x_t|^2 + 1e-6) for q and k rows (l2norm), else 1: applied as diagonal
//           factors, so q and k enter the tensor cores exactly as loaded
//   A     = strict_lower(diag(beta fk) K K^T diag(fk) (.) D),  D_ij = exp(c_i - c_j)
//   P     = scale lower(diag(fq) Q K^T diag(fk) (.) D)
//   T     = (I + A)^-1  (fp32, blocked: 16 x 16 diagonal inverses, then 16 -> 32 -> 64 merges)
//   per-token factors ykf, yb, of, vd and the chunk decay exp(c_C) (fwd_smem.cuh)
//
// T and P go to the local ring in the operand type (hi, and lo when split) for the state
// warpgroups' wgmmas. Rows of Q and K past the chunk's end are zeroed in the input stage, so
// that a partial chunk never multiplies another sequence's tokens (0 x inf would be NaN).
#pragma once

#include "common/numerics.h"
#include "cuda/device_utils.cuh"
#include "sm90/fwd_params.h"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_smem.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90 {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// exp(x) for x <= 0 (every exponent here is a difference c_i - c_j with j <= i, or c_t).
__device__ __forceinline__ float exp_neg(float x) { return exp2_approx(x * kLog2e); }

// 16-bit operand x = hi + lo; lo only when the operand is split.
template <typename T, bool kSplit>
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  hi = cuda::pack2<T>(a, b);
  lo = 0u;
  if constexpr (kSplit) {
    const float ah = cuda::to_float(cuda::from_float<T>(a));
    const float bh = cuda::to_float(cuda::from_float<T>(b));
    lo = cuda::pack2<T>(a - ah, b - bh);
  }
}

// Rows of the input stage's stacked Q/K tile (column blocks of 64, swizzled 128-byte rows).
template <class Tr>
__device__ __forceinline__ uint32_t row_chunk_addr(typename Tr::Tin (*qk)[128][64], int blk, int row, int ch) {
  return smem_addr(&qk[blk][0][0]) + swizzle128(row, ch);
}

// A row past the chunk's end: zeroed, so that a partial chunk never multiplies another
// sequence's tokens (0 x inf would be NaN).
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

// Sum of squares of half a row (16-byte chunks 4 half .. 4 half + 3 of each column block).
template <class Tr>
__device__ __forceinline__ float half_row_sumsq(typename Tr::Tin (*qk)[128][64], int row, int half) {
  using Tin = typename Tr::Tin;
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int blk = 0; blk < Tr::kBlocks; ++blk)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(row_chunk_addr<Tr>(qk, blk, row, 4 * half + c)));
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float2 f;
        if constexpr (WgmmaType<Tin>::kBf16) f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[u]));
        else f = __half22float2(*reinterpret_cast<const __half2*>(&w[u]));
        s0 = fmaf(f.x, f.x, s0);
        s1 = fmaf(f.y, f.y, s1);
      }
    }
  return s0 + s1;
}

// Rare path of the L2 norm, for a row whose squares overflow fp32 (|x| around 1e19 and up):
// the row is scaled in place by 2^-e (exact for 16-bit values) so that its max lies in [0.5, 1),
// and the factor for the stored row is returned: x / sqrt(|x|^2 + eps) = x' / sqrt(|x'|^2 + eps 2^-2e).
template <class Tr>
__device__ __forceinline__ float rescale_row(typename Tr::Tin (*qk)[128][64], int row) {
  using Tin = typename Tr::Tin;
  auto at = [&](int blk, int col) -> Tin& { return qk[blk][row][(((col >> 3) ^ (row & 7)) << 3) | (col & 7)]; };
  float m = 0.f;
#pragma unroll 1
  for (int blk = 0; blk < Tr::kBlocks; ++blk)
#pragma unroll 1
    for (int col = 0; col < 64; ++col) m = fmaxf(m, fabsf(cuda::to_float(at(blk, col))));
  if (!(m > 0.f) || isinf(m)) return rsqrtf(m * m + 1e-6f);  // zero or non-finite: as is
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

// A barrier of `threads` threads that also returns whether any of them passed pred != 0.
__device__ __forceinline__ int named_barrier_or(uint32_t id, uint32_t threads, int pred) {
  int out;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.s32 p, %3, 0;\nbar.red.or.pred q, %1, %2, p;\nselp.s32 %0, 1, 0, q;\n}\n"
      : "=r"(out)
      : "r"(id), "r"(threads), "r"(pred)
      : "memory");
  return out;
}

// Squares at or above this make the rare path (they may have overflowed a sum, or will in
// K K^T): 2^100.
constexpr float kSumsqLimit = 1.2676506e30f;

// acc[u] += a * b[u] for kN consecutive floats of a 16-byte aligned shared-memory row.
template <int kN>
__device__ __forceinline__ void fma_row(float (&acc)[kN], float a, const float* b) {
#pragma unroll
  for (int u = 0; u < kN; u += 4) {
    const float4 v = *reinterpret_cast<const float4*>(b + u);
    acc[u] = fmaf(a, v.x, acc[u]);
    acc[u + 1] = fmaf(a, v.y, acc[u + 1]);
    acc[u + 2] = fmaf(a, v.z, acc[u + 2]);
    acc[u + 3] = fmaf(a, v.w, acc[u + 3]);
  }
}

// T = (I + A)^-1 for the strictly lower fp32 A in sm.af, into sm.tf (whose blocks above the
// block diagonal are zero). 128 threads; `tid` in [0, 128). Block notation: 16 x 16 blocks.
//   phase 1: T_bb = (I + A_bb)^-1 by forward substitution, one column per thread (64 threads)
//   phase 2: T_10 = -T_11 (A_10 T_00) for the block pairs (1, 0) and (3, 2)
//   phase 3: T_HL = -T_HH (A_HL T_LL) for the 32 x 32 halves
// Intermediate products X = A_10 T_00 are parked in A's (zero, unused) upper triangle.
template <class Tr, class Smem>
__device__ __forceinline__ void invert_unit_lower(Smem& sm, int tid) {
  constexpr uint32_t kBar = static_cast<uint32_t>(FwdBarrier::kChunkLocal);
  if (tid < 64) {
    const int b = tid >> 4, c = tid & 15;
    const float(*A)[68] = reinterpret_cast<const float(*)[68]>(&sm.af[16 * b][16 * b]);
    // Column c of T_bb: x_i = -sum_{k < i} A_ik x_k (x_c = 1, x_i = 0 above); two partial sums
    // halve the dependent chain, rows read as float4 (the block starts 16-byte aligned).
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
#pragma unroll
    for (int i = 0; i < 16; ++i) sm.tf[16 * b + i][16 * b + c] = x[i];
  }
  named_barrier_sync(kBar, 128);
  {  // phase 2: pair m: (b1, b0) = (2m + 1, 2m); thread -> row r of the block, 4 columns
    const int m = tid >> 6, r = (tid & 63) >> 2, c0 = (tid & 3) * 4;
    const int b1 = 2 * m + 1, b0 = 2 * m;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 16; ++k) fma_row(x, sm.af[16 * b1 + r][16 * b0 + k], &sm.tf[16 * b0 + k][16 * b0 + c0]);
    *reinterpret_cast<float4*>(&sm.af[16 * b0 + r][16 * b1 + c0]) = make_float4(x[0], x[1], x[2], x[3]);
    named_barrier_sync(kBar, 128);
    float y[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 16; ++k) fma_row(y, sm.tf[16 * b1 + r][16 * b1 + k], &sm.af[16 * b0 + k][16 * b1 + c0]);
    *reinterpret_cast<float4*>(&sm.tf[16 * b1 + r][16 * b0 + c0]) = make_float4(-y[0], -y[1], -y[2], -y[3]);
  }
  named_barrier_sync(kBar, 128);
  {  // phase 3: thread -> row r of the 32 x 32 block, 8 columns
    const int r = tid >> 2, c0 = (tid & 3) * 8;
    float x[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) x[u] = 0.f;
    // T_LL[k][c] = 0 for k < c: start at the thread's first column.
#pragma unroll 4
    for (int k = c0; k < 32; ++k) fma_row(x, sm.af[32 + r][k], &sm.tf[k][c0]);
    *reinterpret_cast<float4*>(&sm.af[r][32 + c0]) = make_float4(x[0], x[1], x[2], x[3]);
    *reinterpret_cast<float4*>(&sm.af[r][36 + c0]) = make_float4(x[4], x[5], x[6], x[7]);
    named_barrier_sync(kBar, 128);
    float y[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) y[u] = 0.f;
    // T_HH[r][k] = 0 for k > r.
#pragma unroll 4
    for (int k = 0; k <= r; ++k) fma_row(y, sm.tf[32 + r][32 + k], &sm.af[k][32 + c0]);
    *reinterpret_cast<float4*>(&sm.tf[32 + r][c0]) = make_float4(-y[0], -y[1], -y[2], -y[3]);
    *reinterpret_cast<float4*>(&sm.tf[32 + r][c0 + 4]) = make_float4(-y[4], -y[5], -y[6], -y[7]);
  }
  named_barrier_sync(kBar, 128);
}

// d (64 x 64, fp32) = X K^T for the chunk's X = Q (rows 0..63 of the stacked tile: x_row = 0) or
// K (x_row = 64), over the head dimension, by SS wgmmas of the warpgroup.
template <class Tr>
__device__ __forceinline__ void gram(float (&d)[32], typename Tr::Tin (*qk)[128][64], int x_row) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Tr::kD / 16; ++ks) {
    const uint32_t off = (ks & 3) * 32;
    const uint64_t dx = desc_k_major(smem_addr(&qk[ks >> 2][x_row][0]) + off);
    const uint64_t dk = desc_k_major(smem_addr(&qk[ks >> 2][64][0]) + off);
    wgmma_ss_n64<typename Tr::Tin>(d, dx, dk, 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(d);
}

template <class Tr>
__device__ __forceinline__ void fwd_chunk_local(const FwdParams& p, FwdSmem<Tr>& sm,
                                                const WorkItem& w, int tid) {
  using Tin = typename Tr::Tin;
  constexpr uint32_t kBar = static_cast<uint32_t>(FwdBarrier::kChunkLocal);
  const int warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, q4 = lane & 3;
  const float a_log = p.gate_in_kernel ? p.A_log[w.h] : 0.f;
  const float dt_bias = (p.gate_in_kernel && p.dt_bias != nullptr) ? p.dt_bias[w.h] : 0.f;

  // T's blocks above the block diagonal are never written: zero them once.
  for (int i = tid; i < 64 * 68; i += 128) (&sm.tf[0][0])[i] = 0.f;

  for (int32_t j = 0; j < w.nchunks; ++j) {
    const RingPos<Tr::kInStages> pin(j);
    const RingPos<Tr::kLocalStages> ploc(j);
    auto& in = sm.in[pin.stage];
    auto& loc = sm.local[ploc.stage];
    const int len = w.chunk_len(j);
    sm.in_full[pin.stage].wait(pin.phase);

    // ---- gates: c = inclusive cumulative sum of the (floored) gate, two tokens a lane ----------
    if (warp == 0) {
      float gg[2], bb[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = 2 * lane + u;
        float g = in.g_raw[i];
        if (p.gate_in_kernel) g = gate_from_activation(g + dt_bias, a_log);
        g = gate_floor(g);
        gg[u] = i < len ? g : 0.f;
        bb[u] = i < len ? in.beta_raw[i] : 0.f;
      }
      const float pair = gg[0] + gg[1];
      const float incl = cuda::warp_inclusive_scan(pair);
      const float c0 = (incl - pair) + gg[0];
      sm.c[2 * lane] = c0;
      sm.c[2 * lane + 1] = c0 + gg[1];
      sm.beta[2 * lane] = bb[0];
      sm.beta[2 * lane + 1] = bb[1];
    }
    // ---- rows past the chunk zeroed; q norms from the rows (two threads a row) --------------
    // (Rows at or past len are zeroed by one thread and never read by the others.)
    if (len < 64 && (tid & 63) >= len) zero_row<Tr>(in.qk, tid);  // Q rows 0..63, K rows 64..127
    int big = 0;
    if (p.l2norm) {
      const int row = tid >> 1;
      float sq = row < len ? half_row_sumsq<Tr>(in.qk, row, tid & 1) : 0.f;
      sq += __shfl_xor_sync(0xffffffffu, sq, 1);
      big = row < len && !(sq < kSumsqLimit) && !isnan(sq);
      if ((tid & 1) == 0) {
        sm.fq[row] = row < len ? rsqrtf(sq + 1e-6f) : 0.f;
        sm.rare[row] = big;
      }
    } else if (tid < 64) {
      sm.fq[tid] = tid < len ? 1.f : 0.f;
    }
    fence_proxy_async();
    named_barrier_sync(kBar, 128);

    // ---- A = strict_lower(diag(beta fk) K K^T diag(fk) (.) D), fp32, for the inverse; the k
    // norms are the diagonal of K K^T --------------------------------------------------------
    {
      // One pass, or two when a row's squares overflow fp32 (rare): its rows are rescaled in
      // place and K K^T is formed again.
      float kk[32];
      for (int pass = 0;; ++pass) {
#pragma unroll
        for (int i = 0; i < 32; ++i) kk[i] = 0.f;
        gram<Tr>(kk, in.qk, 64);
        int b = 0;
        if (p.l2norm && pass == 0) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int row = 16 * warp + g8 + 8 * i;
            float d = 0.f;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
              if (jj == 2 * warp + i) d = (g8 & 1) ? kk[4 * jj + 2 * i + 1] : kk[4 * jj + 2 * i];
            if (q4 == (g8 >> 1)) {  // this lane holds the diagonal element of `row`
              const int rb = row < len && !(d < kSumsqLimit) && !isnan(d);
              sm.fk[row] = row < len ? rsqrtf(d + 1e-6f) : 0.f;
              sm.rare[64 + row] = rb;
              b |= rb;
            }
          }
        } else if (!p.l2norm && tid < 64) {
          sm.fk[tid] = tid < len ? 1.f : 0.f;
        }
        if (!named_barrier_or(kBar, 128, pass == 0 && (big | b))) break;
        // Only the rows that need it (the others keep their bits); an infinite element gives
        // its row the factor 0 as before.
        const int r = tid & 63;
        if (r < len && sm.rare[tid]) (tid < 64 ? sm.fq : sm.fk)[r] = rescale_row<Tr>(in.qk, tid);
        fence_proxy_async();
        named_barrier_sync(kBar, 128);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = 16 * warp + g8 + 8 * i;
        const float cr = sm.c[row], ar = sm.beta[row] * sm.fk[row];
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int col0 = 8 * jj + 2 * q4;
          const float2 cc = *reinterpret_cast<const float2*>(&sm.c[col0]);
          const float2 fc = *reinterpret_cast<const float2*>(&sm.fk[col0]);
          const bool valid = row < len;
          const float a0 = (valid && col0 < row) ? ar * kk[4 * jj + 2 * i] * exp_neg(cr - cc.x) * fc.x : 0.f;
          const float a1 = (valid && col0 + 1 < row) ? ar * kk[4 * jj + 2 * i + 1] * exp_neg(cr - cc.y) * fc.y : 0.f;
          *reinterpret_cast<float2*>(&sm.af[row][col0]) = make_float2(a0, a1);
        }
      }
    }
    // ---- P = scale lower(diag(fq) Q K^T diag(fk) (.) D), to the local stage ----------------
    sm.local_empty[ploc.stage].wait(ploc.phase ^ 1);
    {
      float qk[32] = {};
      gram<Tr>(qk, in.qk, 0);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = 16 * warp + g8 + 8 * i;
        const float cr = sm.c[row], pr = p.scale * sm.fq[row];
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int col0 = 8 * jj + 2 * q4;
          const float2 cc = *reinterpret_cast<const float2*>(&sm.c[col0]);
          const float2 fc = *reinterpret_cast<const float2*>(&sm.fk[col0]);
          const bool valid = row < len;
          const float p0 = (valid && col0 <= row) ? pr * qk[4 * jj + 2 * i] * exp_neg(cr - cc.x) * fc.x : 0.f;
          const float p1 = (valid && col0 + 1 <= row) ? pr * qk[4 * jj + 2 * i + 1] * exp_neg(cr - cc.y) * fc.y : 0.f;
          uint32_t hi, lo;
          split_pair<Tin, Tr::kSplitLocal>(p0, p1, hi, lo);
          const uint32_t off = swizzle128(row, col0 >> 3) + (col0 & 7) * 2;
          *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(&loc.p[0][0][0]) + off) = hi;
          if constexpr (Tr::kSplitLocal)
            *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(&loc.p[1][0][0]) + off) = lo;
        }
      }
    }
    // ---- per-token factors (threads 64..127, while 0..63 start the inverse) -----------------
    named_barrier_sync(kBar, 128);
    if (tid >= 64) {
      const int t = tid - 64;
      const bool valid = t < len;
      const float ct = sm.c[t], cl = sm.c[len - 1];
      const float et = exp_neg(ct);
      loc.ykf[t] = valid ? et * sm.fk[t] : 0.f;
      loc.yb[t] = valid ? sm.beta[t] : 0.f;
      loc.of[t] = valid ? p.scale * sm.fq[t] * et : 0.f;
      loc.vd[t] = valid ? exp_neg(cl - ct) * sm.fk[t] : 0.f;
      if (t == 0) loc.decay = exp_neg(cl);
    }
    invert_unit_lower<Tr>(sm, tid);

    // ---- T to the local stage: row tid / 2, 32 columns --------------------------------------
    {
      const int row = tid >> 1, ch0 = (tid & 1) * 4;
#pragma unroll
      for (int ch = ch0; ch < ch0 + 4; ++ch) {
        const float4 a = *reinterpret_cast<const float4*>(&sm.tf[row][8 * ch]);
        const float4 b = *reinterpret_cast<const float4*>(&sm.tf[row][8 * ch + 4]);
        uint4 hi, lo;
        split_pair<Tin, Tr::kSplitLocal>(a.x, a.y, hi.x, lo.x);
        split_pair<Tin, Tr::kSplitLocal>(a.z, a.w, hi.y, lo.y);
        split_pair<Tin, Tr::kSplitLocal>(b.x, b.y, hi.z, lo.z);
        split_pair<Tin, Tr::kSplitLocal>(b.z, b.w, hi.w, lo.w);
        const uint32_t off = swizzle128(row, ch);
        *reinterpret_cast<uint4*>(reinterpret_cast<char*>(&loc.t[0][0][0]) + off) = hi;
        if constexpr (Tr::kSplitLocal)
          *reinterpret_cast<uint4*>(reinterpret_cast<char*>(&loc.t[1][0][0]) + off) = lo;
      }
    }
    fence_proxy_async();
    sm.local_full[ploc.stage].arrive();
    sm.in_empty[pin.stage].arrive();
    // The next chunk rewrites c, beta, fq, fk, af and tf.
    named_barrier_sync(kBar, 128);
  }
}

}  // namespace flashgdn::sm90
