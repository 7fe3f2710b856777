// The fused backward's step 3b (bwd_fused.cu): the reverse CP scan over each chain's segments.
#include "cuda/bwd_dh_plan.h"
#include "sm90/bwd_fused.h"
#include "sm90/bwd_fused_scheduler.cuh"
#include "sm90/cp_scan_step.cuh"

namespace flashgdn::cuda::bwd {

namespace {

namespace fk = sm90::fused_bwd;
constexpr int kD = 128;
using Tr = sm90::CpScanTraits<kD>;
using ScanSmem = sm90::CpScanStorage<kD>;

// A unit: (sequence, value head, 8 columns of the carry). X = the seed phase 1's walk of the last
// segment S - 1 left for S - 2, then for the segments s = S - 2 .. 1: X = A_s X + B_s (fp32), the
// carry at segment s - 1's end, to the seed of s - 1 (nothing to do for S <= 2). The carry's
// columns evolve independently (every product of the walk multiplies dS from the left), so 16
// units share a chain. Where the gates certify A_s negligible (phase 1 wrote no A_s), the seed of
// s - 1 is B_s, whatever came before: those steps are copies off the chain (pass 1, every warp,
// all in flight together); the chain is the steps from the last one that needs its A_s (pass 2:
// cp_scan_step.cuh's step, the forward scan's, with A_s streamed by the copy warp ahead of the
// product in 3xTF32 on the tensor cores). One CTA walked a unit's 13 steps one after another on
// the CUDA cores before, ~4 us a step (79 us at 2/8 1x8192, ncu clocks).
struct ScanUnit {
  size_t chain;  // the chain's first matrix (bwd_dh_plan.h's fused_cp_* offsets within it)
  int total, len, segs, u_first, col0;
  __device__ ScanUnit(const fk::Params& K, int64_t index) {
    const int64_t unit = index / Tr::kBlocksPerHead, n = unit / K.Hv;
    const int h = static_cast<int>(unit % K.Hv);
    col0 = static_cast<int>(index % Tr::kBlocksPerHead) * Tr::kCols;
    const SeqInfo si = seq_info(K.seq, n);
    total = static_cast<int>(ceil_div(si.len, int64_t{kC}));
    len = K.cut.chunks(total);
    segs = (total + len - 1) / len;
    chain = (size_t(n) * K.Hv + h) * fused_cp_per_chain(K.segments);
    u_first = static_cast<int>(chunk_slot(K.seq, n, 0, si.t0)) * K.Hv + h;
  }
  __device__ float* mat(const fk::Params& K, int m) const { return K.cp + (chain + m) * kD * kD; }
  // Whether step s needs A_s: phase 1's walk_kind's certificate, the same sum in the same order
  // (the same bits), split so that its first load is in flight under other work. Warp-collective.
  __device__ float bound_first(const fk::Params& K, int s) const {
    return fk::transfer_bound_first(K.bound, u_first + s * len * K.Hv, min(total - s * len, len), K.Hv);
  }
  __device__ bool needs(const fk::Params& K, int s, float first) const {
    return !fk::transfer_negligible_from(first, K.bound, u_first + s * len * K.Hv, min(total - s * len, len), K.Hv);
  }
  __device__ bool needs(const fk::Params& K, int s) const { return needs(K, s, bound_first(K, s)); }
};

struct ScanShared {
  ScanSmem step;
  int top;  // the last step s that needs A_s (0: none)
};

// Pass 1 of a unit, warp w of the CTA's kWarps: the seeds of the steps s = S - 2 - w, S - 2 - w -
// kWarps, .. whose A_s is negligible, B_s's block of 128 x 8 floats (a lane two float4s of four
// rows each); the highest step that needs A_s into top.
template <int kWarps>
__device__ __forceinline__ void scan_copies(const fk::Params& K, const ScanUnit& u, int warp, int& top) {
  const int lane = threadIdx.x & 31;
  for (int s = u.segs - 2 - warp; s >= 1; s -= kWarps) {
    // B_s (phase 1 writes every B_s) in flight with the certificate's loads, before it is known
    // whether it is needed.
    const float* b = u.mat(K, fused_cp_map(s, 0)) + u.col0;
    float4 x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = *reinterpret_cast<const float4*>(b + (lane + 32 * (i >> 1)) * kD + 4 * (i & 1));
    if (u.needs(K, s)) {
      if (lane == 0) atomicMax(&top, s);
      continue;
    }
    float* seed = u.mat(K, fused_cp_seed(s - 1)) + u.col0;
#pragma unroll
    for (int i = 0; i < 8; ++i) *reinterpret_cast<float4*>(seed + (lane + 32 * (i >> 1)) * kD + 4 * (i & 1)) = x[i];
  }
}

// Pass 2, the copy warp: A_s of every step from `top` down that needs it, in order.
__device__ __forceinline__ void scan_chain_copies(const fk::Params& K, const ScanUnit& u, int top, ScanSmem& sm,
                                                  uint32_t& fills) {
  float first = u.bound_first(K, top);
  for (int s = top; s >= 1; --s) {
    const bool need = u.needs(K, s, first);
    if (s > 1) first = u.bound_first(K, s - 1);  // in flight under the copies
    if (need) sm90::cp_scan_copy<kD>(sm, fills, u.mat(K, fused_cp_map(s, 1)));
  }
}

// Pass 2, the compute warps: X from the seed of `top` (phase 1's or pass 1's), then each step down
// to 1: A_s X + B_s where A_s counts (X split into St, the compute warps' barrier, the product),
// else B_s (pass 1 wrote that seed); each product's X to the seed of s - 1. St alternates by
// the count of products (`puts`), not by s: a fast warp's next St never overwrites the one a slow
// warp still reads (the barrier before each product orders the one before it).
__device__ __forceinline__ void scan_chain(const fk::Params& K, const ScanUnit& u, int top, ScanSmem& sm,
                                           uint32_t& fills) {
  uint32_t puts = 0;
  const sm90::CpScanLane l;
  auto at = [&](int m, int row) { return u.mat(K, m) + row * kD + u.col0 + l.cc; };
  auto load2 = [&](int m, int row) { return *reinterpret_cast<const float2*>(at(m, row)); };
  float2 lo = load2(fused_cp_seed(top), l.r0), hi = load2(fused_cp_seed(top), l.r0 + 8);
  float2 blo = load2(fused_cp_map(top, 0), l.r0), bhi = load2(fused_cp_map(top, 0), l.r0 + 8);
  bool need = u.needs(K, top);
  for (int s = top; s >= 1; --s) {
    float2 nlo = blo, nhi = bhi;  // B_s: N of the product, or X after it
    if (s > 1) {  // B_{s-1} and the certificate's first load of s - 1 in flight under this step
      blo = load2(fused_cp_map(s - 1, 0), l.r0);
      bhi = load2(fused_cp_map(s - 1, 0), l.r0 + 8);
    }
    const float first = s > 1 ? u.bound_first(K, s - 1) : 0.f;
    if (need) {
      sm90::cp_scan_put<kD>(sm, l, puts & 1, lo, hi);
      sm90::named_barrier_sync(sm90::kCpScanComputeBarrier, Tr::kComputeThreads);  // St is written
      sm90::cp_scan_product<kD>(sm, l, puts & 1, fills, nlo, nhi);
      ++puts;
      *reinterpret_cast<float2*>(at(fused_cp_seed(s - 1), l.r0)) = nlo;
      *reinterpret_cast<float2*>(at(fused_cp_seed(s - 1), l.r0 + 8)) = nhi;
    }
    lo = nlo;
    hi = nhi;
    if (s > 1) need = u.needs(K, s - 1, first);
  }
}

// A CTA a unit, grid (sequences, value heads, 16 column blocks), one CTA an SM (the M ring): the
// block scheduler hands each SM its next unit when its last ends, so the units whose chain
// multiplies (a head without decay, one per sequence) spread over the SMs however many there are.
// (A persistent grid walking units blockIdx.x, + gridDim.x, .. put up to four of them on one CTA
// at 2/8 4x2048.) Per unit: pass 1 (every warp), the CTA's barrier (pass 1's seeds visible to
// the whole CTA, `top` final), pass 2 where a step needs its A_s.
__global__ void __launch_bounds__(Tr::kThreads, 1) fused_cp_scan_kernel(const __grid_constant__ fk::Params K) {
  auto& S = dynamic_smem_1024<ScanShared>();
  const ScanUnit u(K, (int64_t{blockIdx.x} * K.Hv + blockIdx.y) * Tr::kBlocksPerHead + blockIdx.z);
  if (u.segs <= 2) return;
  if (threadIdx.x == 0) {
    sm90::cp_scan_init<kD>(S.step);
    S.top = 0;
  }
  __syncthreads();
  scan_copies<Tr::kThreads / 32>(K, u, static_cast<int>(threadIdx.x >> 5), S.top);
  __syncthreads();  // pass 1's seeds and top
  const int top = S.top;
  if (top == 0) return;
  uint32_t fills = 0;
  if (threadIdx.x >= Tr::kComputeThreads) {
    scan_chain_copies(K, u, top, S.step, fills);
    sm90::cp_async_wait<0>();  // no copy outlives its issuing thread
  } else {
    scan_chain(K, u, top, S.step, fills);
  }
}

}  // namespace

void launch_fused_cp_scan(const sm90::fused_bwd::Params& K, int64_t N, int64_t Hv, cudaStream_t s) {
  constexpr size_t kScanSmem = dynamic_smem_1024_bytes<ScanShared>();
  set_dynamic_smem(fused_cp_scan_kernel, kScanSmem);
  fused_cp_scan_kernel<<<dim3(N, Hv, Tr::kBlocksPerHead), Tr::kThreads, kScanSmem, s>>>(K);
  FGDN_CHECK_LAUNCH("bwd fused (CP scan)");
}

}  // namespace flashgdn::cuda::bwd
