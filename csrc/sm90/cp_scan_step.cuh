// The step of a context-parallel scan across segments, shared by the forward's
// (fwd_context_parallel.cu: S_end(s) = M_s S_end(s - 1) + N_s along a sequence) and the
// backward's (bwd_fused_scan.cu: X_{s-1} = A_s X_s + B_s against it): a block of kCols = 8
// columns of a kD x kD fp32 state, X' = M X + N with M a segment's kD x kD fp32 transfer.
//
// Roles: kD / 16 compute warps, a warp per 16 state rows, and one copy warp that streams each
// step's M (64 KB at D = 128) into a two-buffer ring (`m_full` / `m_empty`), running ahead of the
// compute warps. Issuing 64 KB of 16-byte copies takes ~1500 cycles a step (bench/NOTES.md, CP
// step 16): on the compute warps it was on the chain, on the copy warp it overlaps the product.
//
// The product is a warp's 16 x 8 tile on the tensor cores, 3xTF32 (~21 bits, as an fp32 FMA
// chain: 128-term sums in fp32 carry ~2^-20 anyway): x = big + small, a b ~ big_a big_b + big_a
// small_b + small_a big_b. X is split once, by the thread that holds it, into two transposed
// tiles (St: big and small); each M element is split by the one warp that reads it, with integer
// operations: big rounds the magnitude half up to TF32's 10 mantissa bits, small = x - big is
// exact in fp32 and the tensor core reads its leading 10 bits. The products accumulate in three
// chains of kD / 8, not one of 3 kD / 8. Rows of M and St are padded to kD + 16 floats (16-byte
// units: 4 mod 8), so a quarter warp's 16-byte fragment reads (rows g, g + 1; q = 0..3) touch 8
// distinct 16-byte bank groups.
//
// A thread's elements of the 8-column block, in the m16n8 accumulator layout (CpScanLane): rows
// r0 and r0 + 8, columns cc and cc + 1, held as two float2 (lo: row r0, hi: row r0 + 8).
#pragma once

#include <cstdint>

#include "sm90/mma_tf32.cuh"
#include "sm90/ptx.cuh"

namespace flashgdn::sm90 {

template <int kD>
struct CpScanTraits {
  static constexpr int kComputeWarps = kD / 16, kComputeThreads = 32 * kComputeWarps;
  static constexpr int kThreads = kComputeThreads + 32;  // + the copy warp
  static constexpr int kCols = 8, kBlocksPerHead = kD / kCols, kPitch = kD + 16;
};

template <int kD>
struct CpScanStorage {
  float m[2][kD][CpScanTraits<kD>::kPitch];                         // M of a step, 2 buffers
  float st[2][2][CpScanTraits<kD>::kCols][CpScanTraits<kD>::kPitch];  // [step parity][big, small]: X^T
  Mbarrier m_full[2], m_empty[2];
};

constexpr uint32_t kCpScanComputeBarrier = 1;  // named barrier of the compute warps (0: __syncthreads)

// The ring's barriers, by one thread before the CTA's first __syncthreads.
template <int kD>
__device__ __forceinline__ void cp_scan_init(CpScanStorage<kD>& sm) {
  for (int b = 0; b < 2; ++b) {
    sm.m_full[b].init(32);                               // the copy warp's lanes
    sm.m_empty[b].init(CpScanTraits<kD>::kComputeThreads);  // every compute thread
  }
}

// The copy warp: M (row-major, kD x kD fp32 at src) into buffer fills % 2 once the compute warps
// have released its use two fills before; each lane's copies arrive on m_full (its count is the
// 32 lanes). The compute warps count the same fills in cp_scan_product.
template <int kD>
__device__ __forceinline__ void cp_scan_copy(CpScanStorage<kD>& sm, uint32_t& fills, const float* src) {
  const int lane = threadIdx.x & 31;
  const uint32_t b = fills & 1;
  if (fills >= 2) sm.m_empty[b].wait(((fills >> 1) + 1) & 1);  // the compute warps' use of fill - 2
#pragma unroll 8
  for (int i = lane; i < kD * kD / 4; i += 32) {
    const int row = i / (kD / 4), c4 = i % (kD / 4);
    cp_async_16(&sm.m[b][row][4 * c4], src + row * kD + 4 * c4);
  }
  sm.m_full[b].arrive_on_cp_async();
  ++fills;
}

// A compute thread's place in the block: rows r0, r0 + 8, columns cc, cc + 1.
struct CpScanLane {
  int warp, g, q, r0, cc;
  __device__ __forceinline__ CpScanLane() {
    warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    g = lane >> 2;
    q = lane & 3;
    r0 = 16 * warp + g;
    cc = 2 * q;
  }
};

// The thread's elements of X, split, into St of this step's parity (read by every compute warp
// after the named barrier that follows).
template <int kD>
__device__ __forceinline__ void cp_scan_put(CpScanStorage<kD>& sm, const CpScanLane& l, uint32_t parity, float2 lo,
                                            float2 hi) {
  using Tr = CpScanTraits<kD>;
  float(&sb)[Tr::kCols][Tr::kPitch] = sm.st[parity][0];
  float(&ss)[Tr::kCols][Tr::kPitch] = sm.st[parity][1];
  const float v[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int row = l.r0 + 8 * (e >> 1), col = l.cc + (e & 1);
    const uint32_t big = tf32_big(v[e]);
    sb[col][row] = __uint_as_float(big);
    ss[col][row] = __uint_as_float(tf32_small(v[e], big));
  }
}

// N + M X for the thread's elements (lo, hi hold N's on the way in, the result on the way out):
// M from buffer fills % 2 once the copy warp's fill has landed, X^T from St of this parity.
template <int kD>
__device__ __forceinline__ void cp_scan_product(CpScanStorage<kD>& sm, const CpScanLane& l, uint32_t parity,
                                                uint32_t& fills, float2& lo, float2& hi) {
  using Tr = CpScanTraits<kD>;
  const uint32_t b = fills & 1;
  sm.m_full[b].wait((fills >> 1) & 1);
  // The k index is permuted inside each 16-wide block (the same way for M's columns and St's
  // rows, so the sum is unchanged): lane q's A and B values of k steps 2i and 2i + 1 are the
  // four consecutive k = 16 i + 4 q .. + 3, one 16-byte load each (32 LDS.128 a warp instead of
  // 128 LDS; the compiler interleaves them with the products). Three accumulators: big big,
  // small big, big small.
  const float(&m)[kD][Tr::kPitch] = sm.m[b];
  const float(&sb)[Tr::kCols][Tr::kPitch] = sm.st[parity][0];
  const float(&ss)[Tr::kCols][Tr::kPitch] = sm.st[parity][1];
  const int warp = l.warp, g = l.g, q = l.q;
  float4 ag[kD / 16], ag8[kD / 16], bb[kD / 16], bs[kD / 16];
#pragma unroll
  for (int i = 0; i < kD / 16; ++i) {
    ag[i] = *reinterpret_cast<const float4*>(&m[16 * warp + g][16 * i + 4 * q]);
    ag8[i] = *reinterpret_cast<const float4*>(&m[16 * warp + g + 8][16 * i + 4 * q]);
    bb[i] = *reinterpret_cast<const float4*>(&sb[g][16 * i + 4 * q]);
    bs[i] = *reinterpret_cast<const float4*>(&ss[g][16 * i + 4 * q]);
  }
  float d[4] = {lo.x, lo.y, hi.x, hi.y}, e1[4] = {}, e2[4] = {};
#pragma unroll
  for (int i = 0; i < kD / 16; ++i) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      // A fragment (g, k), (g + 8, k), (g, k + 4), (g + 8, k + 4) -> physical k 16 i + 4 q + 2 jj + {0, 1}.
      const float a[4] = {jj ? ag[i].z : ag[i].x, jj ? ag8[i].z : ag8[i].x, jj ? ag[i].w : ag[i].y,
                          jj ? ag8[i].w : ag8[i].y};
      uint32_t abig[4], asmall[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        abig[r] = tf32_big(a[r]);
        asmall[r] = tf32_small(a[r], abig[r]);
      }
      const uint32_t b0 = __float_as_uint(jj ? bb[i].z : bb[i].x), b1 = __float_as_uint(jj ? bb[i].w : bb[i].y);
      const uint32_t c0 = __float_as_uint(jj ? bs[i].z : bs[i].x), c1 = __float_as_uint(jj ? bs[i].w : bs[i].y);
      mma_m16n8k8_tf32(e1, asmall, b0, b1);
      mma_m16n8k8_tf32(e2, abig, c0, c1);
      mma_m16n8k8_tf32(d, abig, b0, b1);
    }
  }
  sm.m_empty[b].arrive();  // this thread's reads of buffer b are done (each its own release: racecheck)
  ++fills;
  lo = make_float2(d[0] + (e1[0] + e2[0]), d[1] + (e1[1] + e2[1]));
  hi = make_float2(d[2] + (e1[2] + e2[2]), d[3] + (e1[3] + e2[3]));
}

}  // namespace flashgdn::sm90
