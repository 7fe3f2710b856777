// The exact segments' outputs from their true start state, without walking them again
// (CpLayout::corrected, fwd_context_parallel.h). The state after token t of a segment is linear
// in the segment's start state: S_t = M_t S_start + N_t, so
//   o_t = scale S_t^T q_t = o_local_t + S_start^T q~_t,   q~_t = scale M_t^T q_t,
// where phase 1's N walk (from zero) wrote o_local into o and its M walk (from the identity, V
// read as zero) wrote q~ into cp.corr, and the scan wrote S_start = S_end(s - 1) into
// cp.ends[slot - 1]. Every chunk of every exact segment is independent: a CTA per (slot, value
// head, chunk), its 64 x V tile one 64 x K by K x V product on the tensor cores, added to
// o_local in fp32 and rounded once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/chunk_index.cuh"
#include "cuda/device_utils.cuh"
#include "sm90/dependent_launch.h"
#include "sm90/fwd_context_parallel.h"
#include "sm90/ptx.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90 {
namespace {

constexpr int kCorrectThreads = 128;  // four warps, 16 tokens of the chunk each

// S_start^T in shared memory as two 16-bit halves, hi = S rounded to q's dtype and lo = S - hi
// rounded (S to ~16 bits: the start state of an exact head is the largest term of its o). Rows
// are padded to kD + 8 elements: the B fragments' 32-bit reads of a warp (rows g, columns 2 q)
// fall on banks 4 g + q, 32 distinct ones.
template <int kD>
constexpr int kCorrectPitch = kD + 8;
template <int kD, typename Tin>
constexpr size_t correct_smem_bytes() {
  return 2u * kD * kCorrectPitch<kD> * sizeof(Tin);
}

// S_start [k][v] (fp32, global) into hi and lo [v][k]: a thread takes rows k, k + 1 of four
// columns at a time (two 16-byte loads, four 32-bit stores of each half), eight such at once so
// that their loads are in flight together; the lanes of a warp take consecutive k, so that each
// store of the warp is one row's consecutive words (with consecutive columns it was 16-way
// bank-conflicted).
template <int kD, typename Tin>
__device__ __forceinline__ void stage_start_state(const float* S, Tin (*hi)[kCorrectPitch<kD>],
                                                  Tin (*lo)[kCorrectPitch<kD>]) {
  constexpr int kItems = (kD / 2) * (kD / 4), kBatch = 8;
  for (int base = 0; base < kItems; base += kCorrectThreads * kBatch) {
    float4 x0[kBatch], x1[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kCorrectThreads + static_cast<int>(threadIdx.x);
      if (i < kItems) {
        const int k = 2 * (i % (kD / 2)), v = 4 * (i / (kD / 2));
        x0[u] = *reinterpret_cast<const float4*>(S + k * kD + v);
        x1[u] = *reinterpret_cast<const float4*>(S + (k + 1) * kD + v);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kCorrectThreads + static_cast<int>(threadIdx.x);
      if (i >= kItems) continue;
      const int k = 2 * (i % (kD / 2)), v = 4 * (i / (kD / 2));
      const float a[4] = {x0[u].x, x0[u].y, x0[u].z, x0[u].w}, b[4] = {x1[u].x, x1[u].y, x1[u].z, x1[u].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t h = cuda::pack2<Tin>(a[e], b[e]);
        const float2 hf = unpack2<Tin>(h);
        *reinterpret_cast<uint32_t*>(&hi[v + e][k]) = h;
        *reinterpret_cast<uint32_t*>(&lo[v + e][k]) = cuda::pack2<Tin>(a[e] - hf.x, b[e] - hf.y);
      }
    }
  }
}

// mma.sync m16n8k16 (fp32 accumulation): A = q~ (16 tokens x K, row-major, straight from global
// memory, as phase 1 rounded it), B = S_start (K x V) as hi + lo.
template <int kD, typename Tin>
__global__ void __launch_bounds__(kCorrectThreads) cp_correct_kernel(const __grid_constant__ FwdParams p, CpTables t) {
  extern __shared__ __align__(16) unsigned char correct_smem[];
  auto* hi = reinterpret_cast<Tin(*)[kCorrectPitch<kD>]>(correct_smem);
  auto* lo = hi + kD;
  grid_dependency_wait();  // the scan's start states (and, before it, phase 1's o_local and q~)
  launch_dependents();
  const int32_t hv = static_cast<int32_t>(p.Hv);
  const int32_t L = t.plan[kPlanChunks];
  const int64_t units = static_cast<int64_t>(t.plan[kPlanExact]) * L;  // (exact segment, chunk)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int r0 = 16 * warp + g, r1 = r0 + 8;  // the thread's rows of the chunk
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const int32_t j = static_cast<int32_t>(unit % L);
    const int32_t e = t.exact[unit / L];
    const int32_t h = e % hv, slot = e / hv;
    const int4 u = t.slots[slot];  // {n, seg, nseg, first boundary}
    const cuda::SeqInfo si = cuda::seq_info(p.seq, u.x);
    const int64_t begin = (static_cast<int64_t>(u.y) * L + j) * 64;
    const int64_t seg_end = (static_cast<int64_t>(u.y) + 1) * L * 64;
    const int64_t end = si.len < seg_end ? si.len : seg_end;
    if (begin >= end) continue;
    const int len = end - begin < 64 ? static_cast<int>(end - begin) : 64;

    __syncthreads();  // the previous unit's reads of hi and lo are done
    stage_start_state<kD, Tin>(p.cp.ends + (static_cast<int64_t>(slot - 1) * hv + h) * kD * kD, hi, lo);
    __syncthreads();

    const int64_t t_chunk = si.t0 + begin;  // the chunk's first token within batch row si.b
    const Tin* qt = static_cast<const Tin*>(p.cp.corr) + si.b * p.cp.cs0 + h * p.cp.cs2;
    const Tin* q0 = qt + (t_chunk + r0) * p.cp.cs1;
    const Tin* q1 = qt + (t_chunk + r1) * p.cp.cs1;
    // Every global load of the unit is issued before anything waits on one: the A fragments of
    // all k steps and the rows' o_local (loaded one after another, each a round trip, they
    // took most of the unit's time).
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
        const float2 x = unpack2<Tin>(ol[half][nt]);
        *reinterpret_cast<uint32_t*>(orow[half] + 8 * nt) =
            cuda::pack2<Tin>(x.x + d[nt][2 * half], x.y + d[nt][2 * half + 1]);
      }
    }
  }
}

template <int kD, typename Tin>
void launch_correct(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  // A bound on the units (the plan has the count: the exact segments' chunks, at most every
  // chunk of every split sequence and head), at most two CTAs per SM: each walks the units
  // blockIdx.x, + gridDim.x, ..
  const int64_t units = c.max_slots * fp.Hv * (static_cast<int64_t>(c.min_chunks) << (c.candidates - 1));
  const int64_t grid = std::min<int64_t>(units, 2 * static_cast<int64_t>(c.sms));
  if (grid <= 0) return;
  constexpr size_t bytes = correct_smem_bytes<kD, Tin>();
  // Every call, as the scan and the plan do: the opt-in holds for the current device only (a
  // once-per-process call left a second GPU of the process without it).
  FGDN_CUDA_CHECK(cudaFuncSetAttribute(cp_correct_kernel<kD, Tin>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
  launch_dependent(cp_correct_kernel<kD, Tin>, dim3(static_cast<unsigned>(grid)), dim3(kCorrectThreads), bytes,
                   stream, "cp_correct_kernel", fp, t);
}

}  // namespace

void launch_cp_correct(const CpLayout& c, const FwdParams& fp, const CpTables& t, bool bf16, cudaStream_t stream) {
  if (!c.corrected) return;
  if (fp.state_dim == 128) {
    if (bf16) launch_correct<128, __nv_bfloat16>(c, fp, t, stream);
    else launch_correct<128, __half>(c, fp, t, stream);
  } else {
    if (bf16) launch_correct<64, __nv_bfloat16>(c, fp, t, stream);
    else launch_correct<64, __half>(c, fp, t, stream);
  }
}

}  // namespace flashgdn::sm90
