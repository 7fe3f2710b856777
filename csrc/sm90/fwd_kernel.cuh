// The Hopper forward kernel: wires the shared storage, the barriers and the warp roles.
//
//   WG 0 producer  --in_ready-->  WG 1 chunk-local  --local_full-->  WG 2.. state
//   (TMA --in_full--> norms)                |      ^                            |
//        ^                                  |      |                            |
//        +-------------in_empty-------------+------|----------------------------+
//                                                  +---------local_empty--------+
//
// in_full   : 1 arrival with the TMA byte count (waited for by the norm warps)
// in_ready  : 32 (gate warp) + 64 (norm warps) (waited for by the chunk-local role and the state)
// fk_full   : 32 (k-norm warp) (waited for by the gate warp)
// in_empty  : 128 (chunk-local) + 128 per state warpgroup
// local_full: 128 (chunk-local), local_empty: 128 per state warpgroup
#pragma once

#include "sm90/fwd_chunk_local.cuh"
#include "sm90/fwd_load.cuh"
#include "sm90/fwd_params.h"
#include "sm90/fwd_row_norms.cuh"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_smem.cuh"
#include "sm90/fwd_state.cuh"

namespace flashgdn::sm90 {

// A role's walk over the CTA's items (fwd_scheduler.cuh) for whole warps. With a split state
// (`high`), where the state role and the producer's warps use every register they have, the
// walk's counters live in shared memory (a pair per warp), not in registers across the body:
// there ptxas spilled them (and the lane index) to the stack, once per item (bench/NOTES.md,
// step 39).
template <class Tr, class F>
__device__ __forceinline__ void walk_items(const FwdParams& p, FwdSmem<Tr>& sm, F&& body) {
  if constexpr (Tr::kSplitState) for_each_work_item(p, sm.walk[threadIdx.x / 32], body);
  else for_each_work_item(p, body);
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) gdn_fwd_kernel(const __grid_constant__ FwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Aligned to 1024 by pointer arithmetic on the __shared__ array itself (not through an integer),
  // so that the compiler still knows every access below is to shared memory (LDS/STS, not
  // generic loads).
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<FwdSmem<Tr>*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int tid = threadIdx.x & 127;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Tr::kInStages; ++s) {
      sm.in_full[s].init(1);
      sm.in_ready[s].init(Tr::kInReadyArrivals);
      sm.fk_full[s].init(Tr::kFkFullArrivals);
      sm.in_empty[s].init(Tr::kInEmptyArrivals);
    }
    for (int s = 0; s < Tr::kLocalStages; ++s) {
      sm.local_full[s].init(Tr::kLocalFullArrivals);
      sm.local_empty[s].init(Tr::kLocalEmptyArrivals);
    }
    fence_barrier_init();
  }
  __syncthreads();
  // Launched after the CP pipeline's kernels, pack_rows or the caller's: nothing in global
  // memory is read before the grid ahead has completed (dependent_launch.h).
  grid_dependency_wait();
  launch_dependents();

  // Every role walks the CTA's work items itself (fwd_scheduler.cuh), after taking its register
  // budget (a value computed before the split would have to survive the producer's 24 registers).
  // c0: the chunks the CTA walked before the item, where its ring positions start.
  if (wg == 0) {
    setmaxnreg_dec<Tr::kProducerRegs>();
    // Warp w of every warpgroup issues from scheduler w % 4. The norm warps issue for thousands
    // of cycles a chunk, so they take warps 0-1, beside the chunk-local warpgroup's light warps
    // (rows 0-31); its warps 2-3 (rows 32-63: 3-4x the gating, every merge) share their
    // schedulers with the mostly idle TMA and gate warps (bench/NOTES.md).
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;
    if (warp < 2) {
      walk_items(p, sm, [&](const WorkItem& w, int32_t c0) { fwd_row_norms<Tr>(p, sm, w, c0, warp, lane); });
    } else if (warp == 2) {
      if (lane == 0) {
        prefetch_tensormap(&p.tma_q);
        prefetch_tensormap(&p.tma_k);
        prefetch_tensormap(&p.tma_v);
        for_each_work_item(p, [&](const WorkItem& w, int32_t c0) { fwd_load_tiles<Tr>(p, sm, w, c0); });
      }
    } else {
      walk_items(p, sm, [&](const WorkItem& w, int32_t c0) { fwd_load_gates<Tr>(p, sm, w, c0, lane); });
    }
  } else if (wg == 1) {
    if constexpr (Tr::kLocalRegs > 128) setmaxnreg_inc<Tr::kLocalRegs>();
    else setmaxnreg_dec<Tr::kLocalRegs>();
    zero_local_p(sm, tid);
    // Every warp's zeros are in before any warp writes its blocks of P (they overlap the tile).
    named_barrier_sync(static_cast<uint32_t>(FwdBarrier::kChunkLocal), Tr::kWarpgroupThreads);
    walk_items(p, sm, [&](const WorkItem& w, int32_t c0) { fwd_chunk_local<Tr>(p, sm, w, c0, tid); });
  } else {
    setmaxnreg_inc<Tr::kStateRegs>();
    // The value-column block: the warpgroup's own, or with the columns split the item's.
    auto walk = [&](const WorkItem& w, int32_t c0) {
      fwd_state<Tr>(p, sm, w, c0, Tr::kSplitColumns ? w.col : wg - 2, tid);
    };
    walk_items(p, sm, walk);
    if (tid == 0) bulk_wait_group<0>();  // o's TMA stores (store_output) written before the CTA ends
  }
#endif
}

}  // namespace flashgdn::sm90
