// The exact segments' outputs from their true start state, without walking them again
// (CpLayout::corrected, fwd_context_parallel.h). The state after token t of a segment is linear
// in the segment's start state: S_t = M_t S_start + N_t, so
//   o_t = scale S_t^T q_t = o_local_t + S_start^T q~_t,   q~_t = scale M_t^T q_t,
// where phase 1's N walk (from zero) wrote o_local into o and its M walk (from the identity, V
// read as zero) wrote q~ into cp.corr, and the scan wrote S_start = S_end(s - 1) into
// cp.ends[slot - 1]. Every chunk of every exact segment is independent: a unit per (exact
// segment, value head, chunk), its 64 x V tile one 64 x K by K x V product on the tensor cores,
// added to o_local in fp32 and rounded once; the resident CTAs take contiguous runs of units.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/chunk_index.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/dim_type_dispatch.h"
#include "sm90/dependent_launch.h"
#include "sm90/fwd_context_parallel.h"
#include "sm90/ptx.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90 {
namespace {

constexpr int kCorrectThreads = 128;  // four warps, 16 tokens of the chunk each

// Shared memory: S_start [k][v] in fp32 as it arrives (cp.async; rows padded to kD + 4 floats,
// 16-byte aligned), then S_start^T as two 16-bit halves [v][k], hi = S rounded to q's dtype and
// lo = S - hi rounded (S to ~16 bits: the start state of an exact head is the largest term of
// its o), rows padded to kD + 8 elements: the B fragments' 32-bit reads of a warp (rows g,
// columns 2 q) fall on banks 4 g + q, 32 distinct ones.
template <int kD>
constexpr int kRawPitch = kD + 4;
template <int kD>
constexpr int kCorrectPitch = kD + 8;
template <int kD, typename Tin>
constexpr size_t correct_smem_bytes() {
  return static_cast<size_t>(kD) * kRawPitch<kD> * sizeof(float) + 2u * kD * kCorrectPitch<kD> * sizeof(Tin);
}

// S_start's copies into `raw`, 16 bytes each, all in flight at once (one commit group).
template <int kD>
__device__ __forceinline__ void copy_start_state(const float* S, float (*raw)[kRawPitch<kD>]) {
  for (int i = static_cast<int>(threadIdx.x); i < kD * kD / 4; i += kCorrectThreads) {
    const int k = i / (kD / 4), v = 4 * (i % (kD / 4));
    cp_async_16(&raw[k][v], S + k * kD + v);
  }
  cp_async_commit();
}

// raw [k][v] (fp32) into hi and lo [v][k]: a thread takes rows k, k + 1 of four columns (two
// 16-byte shared loads, four 32-bit stores of each half); the lanes of a warp take consecutive
// k, so that each store of the warp is one row's consecutive words.
template <int kD, typename Tin>
__device__ __forceinline__ void split_start_state(float (*raw)[kRawPitch<kD>], Tin (*hi)[kCorrectPitch<kD>],
                                                  Tin (*lo)[kCorrectPitch<kD>]) {
  constexpr int kItems = (kD / 2) * (kD / 4);
#pragma unroll 4
  for (int i = static_cast<int>(threadIdx.x); i < kItems; i += kCorrectThreads) {
    const int k = 2 * (i % (kD / 2)), v = 4 * (i / (kD / 2));
    const float4 x0 = *reinterpret_cast<const float4*>(&raw[k][v]);
    const float4 x1 = *reinterpret_cast<const float4*>(&raw[k + 1][v]);
    const float a[4] = {x0.x, x0.y, x0.z, x0.w}, b[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t h = cuda::pack2<Tin>(a[e], b[e]);
      const float2 hf = unpack2<Tin>(h);
      *reinterpret_cast<uint32_t*>(&hi[v + e][k]) = h;
      *reinterpret_cast<uint32_t*>(&lo[v + e][k]) = cuda::pack2<Tin>(a[e] - hf.x, b[e] - hf.y);
    }
  }
}

// mma.sync m16n8k16 (fp32 accumulation): A = q~ (16 tokens x K, row-major, straight from global
// memory, as phase 1 rounded it), B = S_start (K x V) as hi + lo. A unit's memory is one chain of
// three waits: its list entry {slot Hv + h, n, seg} (the plan writes what the unit needs), then
// S_start's copies, the sequence's offsets and, once those are in, q~ and o_local together.
template <int kD, typename Tin>
__global__ void __launch_bounds__(kCorrectThreads) cp_correct_kernel(const __grid_constant__ FwdParams p, CpTables t) {
  extern __shared__ __align__(16) unsigned char correct_smem[];
  auto* raw = reinterpret_cast<float(*)[kRawPitch<kD>]>(correct_smem);
  auto* hi = reinterpret_cast<Tin(*)[kCorrectPitch<kD>]>(correct_smem + kD * kRawPitch<kD> * sizeof(float));
  auto* lo = hi + kD;
  grid_dependency_wait();  // the scan's start states (and, before it, phase 1's o_local and q~)
  launch_dependents();
  const int32_t hv = static_cast<int32_t>(p.Hv);
  const int32_t L = t.plan[kPlanChunks];
  const int64_t units = static_cast<int64_t>(t.plan[kPlanExact]) * L;  // (exact segment, chunk)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int r0 = 16 * warp + g, r1 = r0 + 8;  // the thread's rows of the chunk
  // A contiguous run of units a CTA (blockIdx.x's share of them), so that consecutive units are
  // mostly chunks of one segment: S_start is copied and split once a segment, not once a chunk.
  const int64_t first = units * blockIdx.x / gridDim.x, last = units * (blockIdx.x + 1) / gridDim.x;
  int64_t staged = -1;  // the exact segment whose S_start hi and lo hold
  for (int64_t unit = first; unit < last; ++unit) {
    const int32_t j = static_cast<int32_t>(unit % L);
    const int64_t e = unit / L;
    const int4 x = t.exact[e];  // {slot Hv + h, n, seg, 0}
    const int32_t h = x.x % hv, slot = x.x / hv;
    const bool restage = e != staged;
    if (restage) {
      __syncthreads();  // the previous unit's reads of hi and lo are done
      copy_start_state<kD>(p.cp.ends + (static_cast<int64_t>(slot - 1) * hv + h) * kD * kD, raw);
    }
    const cuda::SeqInfo si = cuda::seq_info(p.seq, x.y);
    const int64_t begin = (static_cast<int64_t>(x.z) * L + j) * 64;
    const int64_t seg_end = (static_cast<int64_t>(x.z) + 1) * L * 64;
    const int64_t end = si.len < seg_end ? si.len : seg_end;
    const int len = begin >= end ? 0 : (end - begin < 64 ? static_cast<int>(end - begin) : 64);

    // q~ and o_local while S_start's copies fly (a chunk past the sequence's end: len 0, no
    // loads or stores, but the unit still takes part in the block's barriers).
    const int64_t t_chunk = si.t0 + begin;  // the chunk's first token within batch row si.b
    const Tin* qt = static_cast<const Tin*>(p.cp.corr) + si.b * p.cp.cs0 + h * p.cp.cs2;
    const Tin* q0 = qt + (t_chunk + r0) * p.cp.cs1;
    const Tin* q1 = qt + (t_chunk + r1) * p.cp.cs1;
    uint32_t a_all[kD / 16][4], ol[2][kD / 8];
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int k = 16 * kk + 2 * q;
      a_all[kk][0] = r0 < len ? *reinterpret_cast<const uint32_t*>(q0 + k) : 0u;
      a_all[kk][1] = r1 < len ? *reinterpret_cast<const uint32_t*>(q1 + k) : 0u;
      a_all[kk][2] = r0 < len ? *reinterpret_cast<const uint32_t*>(q0 + k + 8) : 0u;
      a_all[kk][3] = r1 < len ? *reinterpret_cast<const uint32_t*>(q1 + k + 8) : 0u;
    }
    Tin* o = static_cast<Tin*>(p.o) + si.b * p.os0 + h * p.os2;
    Tin* orow[2] = {o + (t_chunk + r0) * p.os1 + 2 * q, o + (t_chunk + r1) * p.os1 + 2 * q};
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int nt = 0; nt < kD / 8; ++nt)
        ol[half][nt] = (half ? r1 : r0) < len ? *reinterpret_cast<const uint32_t*>(orow[half] + 8 * nt) : 0u;
    if (restage) {
      cp_async_wait<0>();
      __syncthreads();  // every thread's copies of S_start have landed
      split_start_state<kD, Tin>(raw, hi, lo);
      __syncthreads();
      staged = e;
    }

    float d[kD / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int k = 16 * kk + 2 * q;
      const uint32_t(&a)[4] = a_all[kk];
#pragma unroll
      for (int nt = 0; nt < kD / 8; ++nt) {
        const Tin* bh = &hi[8 * nt + g][k];
        const Tin* bl = &lo[8 * nt + g][k];
        cuda::mma_16816<Tin>(d[nt], a, *reinterpret_cast<const uint32_t*>(bh),
                             *reinterpret_cast<const uint32_t*>(bh + 8));
        cuda::mma_16816<Tin>(d[nt], a, *reinterpret_cast<const uint32_t*>(bl),
                             *reinterpret_cast<const uint32_t*>(bl + 8));
      }
    }
    // o_t = o_local_t + the product, in fp32, rounded once: columns 8 nt + 2 q, + 1 of rows r0, r1.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if ((half ? r1 : r0) >= len) continue;
#pragma unroll
      for (int nt = 0; nt < kD / 8; ++nt) {
        const float2 x2 = unpack2<Tin>(ol[half][nt]);
        *reinterpret_cast<uint32_t*>(orow[half] + 8 * nt) =
            cuda::pack2<Tin>(x2.x + d[nt][2 * half], x2.y + d[nt][2 * half + 1]);
      }
    }
  }
}

template <int kD, typename Tin>
void launch_correct(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  constexpr size_t bytes = correct_smem_bytes<kD, Tin>();
  const int per_sm = resident_ctas_per_sm<cp_correct_kernel<kD, Tin>>(kCorrectThreads, bytes);
  // A bound on the units (the plan has the count: the exact segments' chunks, at most every
  // chunk of every split sequence and head), at most what is resident at once: each CTA takes
  // a contiguous share of the plan's count.
  const int64_t units = c.max_slots * fp.Hv * c.cand.chunks(c.cand.count - 1);
  const int64_t grid = std::min<int64_t>(units, static_cast<int64_t>(per_sm) * c.sms);
  if (grid <= 0) return;
  launch_dependent(cp_correct_kernel<kD, Tin>, dim3(static_cast<unsigned>(grid)), dim3(kCorrectThreads), bytes,
                   stream, "cp_correct_kernel", fp, t);
}

}  // namespace

void launch_cp_correct(const CpLayout& c, const FwdParams& fp, const CpTables& t, fgdn_dtype qkv,
                       cudaStream_t stream) {
  if (!c.corrected) return;
  cuda::dispatch_dim_type(static_cast<int>(fp.state_dim), qkv, [&](auto d) {
    using C = decltype(d);
    launch_correct<C::D, typename C::TQ>(c, fp, t, stream);
  });
}

}  // namespace flashgdn::sm90
