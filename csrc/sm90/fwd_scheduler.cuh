// Work items of the Hopper forward and the persistent walk over them. A work item is one state
// chain (a sequence's, or with context parallelism one segment's, for one value head), its
// chunks walked in order by every role. A CTA walks several items back to back (for_each_work_item)
// and every role derives the same items and chunks, so the pipelines need no metadata beyond
// their barriers, and the next item's loads and chunk-local work overlap the state's last chunks
// of the one before.
#pragma once

#include <cstdint>

#include "cuda/chunk_index.cuh"
#include "sm90/fwd_context_parallel.h"
#include "sm90/fwd_params.h"

namespace flashgdn::sm90 {

// How the state role starts and ends a walk (context parallelism, fwd_context_parallel.h).
enum StateInit : int32_t {
  kInitH0 = 0,        // the caller's initial state (h0 or the pool row; zero when absent)
  kInitZero = 1,      // zero (a segment's local state N, or a warm-up start)
  kInitIdentity = 2,  // I, with V read as zero: the walk computes the transfer matrix M
  kInitPrevEnd = 3,   // the true state at the segment's start, from the scan (slot - 1)
};
enum StateEnd : int32_t {
  kEndFinal = 0,  // ht / the pool row, as the parameters ask
  kEndNone = 1,
  kEndSlot = 2,   // the segment's end state (fp32) into cp.ends[slot]
  kEndTrans = 3,  // the transfer matrix M into cp.trans[slot]
};

// 32-bit fields: the CUDA backend takes T < 2^31 tokens per batch row (TMA coordinates are
// 32-bit), so every token index and count fits.
struct WorkItem {
  int32_t n;        // sequence
  int32_t h;        // value head
  int32_t hq;       // its q/k head
  int32_t b;        // batch row
  int32_t t0;       // first token of the walk (within the batch row)
  int32_t len;      // tokens walked
  int32_t nchunks;  // ceil(len / 64)
  int32_t out_chunk0;  // first chunk of the walk whose o and checkpoints are written (a
                       // warm-up walks chunks before it; nchunks: none)
  int32_t seq_chunk0;  // the walk's first chunk, counted within its sequence
  int32_t init;        // StateInit
  int32_t end;         // StateEnd
  int32_t slot;        // CP slot (segment of a split sequence), -1 otherwise
  int32_t out_corr;    // 1: the walk's output goes to cp.corr, not o (an exact segment's M walk
                       // where its outputs are corrected: q~ = scale M_t^T q_t)
  int32_t col;         // the value-column block the item's state walk owns where a CTA owns one
                       // (p.col_blocks = 2), 0 otherwise
  bool active;         // false: a surplus unit of a CP grid (nothing to do)

  // Tokens of chunk j (1..64).
  __device__ __forceinline__ int chunk_len(int32_t j) const {
    const int32_t rest = len - j * 64;
    return rest < 64 ? rest : 64;
  }
};

// Whether the work item u = {n, seg, slot or -1, nseg} for value head h may run in phase 2:
// an unsplit sequence (it reads h0 and writes its final state itself), or a middle warm-up
// segment whose end state the scan does not read (the next segment is not exact for h). First
// segments (they read h0, maybe a pool row that the scan rewrites), last segments (the scan
// writes the final state from their end state), exact segments and chain starts stay in phase 1.
__device__ __forceinline__ bool cp_movable(const int32_t* warm, int32_t hv, int4 u, int32_t h) {
  if (u.z < 0) return true;
  if (u.y == 0 || u.y + 1 >= u.w) return false;
  const int64_t at = static_cast<int64_t>(u.z) * hv + h;
  return warm[at] != kExactSegment && warm[at + hv] != kExactSegment;
}

// The item of unit index `index` (p.units of them). Without CP: (sequence, value head[, column
// block]), the value heads of one sequence adjacent, so that CTAs sharing q/k (GVA) run together
// and share those loads through L2. With CP, the plan's tables name the unit (fwd_context_parallel.h):
//   phase 1: indices [0, max_slots Hv) compute the transfer matrix M of an exact segment; the
//            rest run the plan's items: whole sequences, first segments (from h0), warm-up
//            segments (from zero, W chunks early) and the local states N of exact segments;
//   phase 2: indices [0, max_slots Hv): exact segments again, from the scanned true start
//            state, writing o; the rest: the movable items whose index unit Hv + h is at least
//            plan[kPlanDeferFrom], which phase 1 skipped.
// With cp.corr (the exact segments' outputs corrected, fwd_context_parallel.h), phase 1's M walk
// writes q~ into cp.corr and its N walk o_local into o, and phase 2 does not walk them again.
__device__ __forceinline__ WorkItem fwd_work_item(const FwdParams& p, int32_t index) {
  WorkItem w;
  // With the value columns split (no CP), the two blocks of an item are adjacent indices: they
  // run at once and share the Q and K loads through L2.
  w.col = index % p.col_blocks;
  index /= p.col_blocks;
  const int32_t hv = static_cast<int32_t>(p.Hv);
  int32_t unit = index / hv;
  w.h = index % hv;
  w.hq = w.h / static_cast<int32_t>(p.group);
  w.out_chunk0 = 0;
  w.seq_chunk0 = 0;
  w.init = kInitH0;
  w.end = kEndFinal;
  w.slot = -1;
  w.out_corr = 0;
  w.active = true;
  int32_t seg = 0;
  bool trans = false, deferred_item = false;
  if (p.cp.phase != 0) {
    int4 u;
    if (unit >= p.cp.max_slots) {  // an item: phase 1 runs it unless phase 2 takes it
      unit -= p.cp.max_slots;
      w.active = unit < p.cp.plan[kPlanItems];
      u = w.active ? p.cp.items[unit] : make_int4(0, 0, -1, 1);
      if (w.active) {
        const bool deferred =
            unit * hv + w.h >= p.cp.plan[kPlanDeferFrom] && cp_movable(p.cp.warm, hv, u, w.h);
        w.active = deferred == (p.cp.phase == 2);
      }
      w.slot = u.z;
      deferred_item = p.cp.phase == 2;
    } else {
      w.active = unit < p.cp.plan[kPlanSlots];
      u = w.active ? p.cp.slots[unit] : make_int4(0, 0, 1, 0);
      w.slot = unit;
      trans = p.cp.phase == 1;
    }
    unit = u.x;
    seg = u.y;
  }
  w.n = unit;
  const cuda::SeqInfo si = cuda::seq_info(p.seq, w.n);
  w.b = static_cast<int32_t>(si.b);
  int32_t begin = 0, finish = static_cast<int32_t>(si.len);
  if (w.slot >= 0 && w.active) {
    const int32_t seg_tokens = 64 * p.cp.plan[kPlanChunks];
    begin = seg * seg_tokens;
    finish = min(finish, begin + seg_tokens);
    const int32_t warm = seg == 0 ? 0 : p.cp.warm[w.slot * hv + w.h];
    const bool exact = seg > 0 && warm == kExactSegment;
    const bool corrected = p.cp.corr != nullptr;
    if (trans || (p.cp.phase == 2 && !deferred_item)) {
      // M, and the second pass, only for exact segments; no second pass where corrected.
      w.active = exact && (trans || !corrected);
      w.init = trans ? kInitIdentity : kInitPrevEnd;
      w.end = trans ? kEndTrans : kEndNone;
      if (trans) {
        w.out_chunk0 = corrected ? 0 : INT32_MAX;
        w.out_corr = corrected ? 1 : 0;
      }
    } else {
      w.end = deferred_item ? kEndNone : kEndSlot;  // nobody reads a movable CTA's end state
      if (seg > 0) {
        w.init = kInitZero;
        if (exact) {
          // N; o_local where corrected (cp_correct_kernel adds the start state's part), else
          // no o: it comes from the second pass.
          w.out_chunk0 = corrected ? 0 : INT32_MAX;
        } else {
          begin -= 64 * warm;
          w.out_chunk0 = warm;
        }
      }
    }
  }
  w.t0 = static_cast<int32_t>(si.t0) + begin;
  w.len = w.active ? finish - begin : 0;
  w.seq_chunk0 = begin / 64;
  w.nchunks = (w.len + 63) / 64;
  w.out_chunk0 = min(w.out_chunk0, w.nchunks);
  return w;
}

// The persistent walk: CTA b takes the unit indices b, b + gridDim.x, b + 2 gridDim.x, .. below
// p.units (the grid: at most one CTA per SM, fwd_launch.cu) and calls walk(item, c0) for each
// active item, c0 being the chunks it walked before: the ring positions of the item's chunks are
// c0 + j in every role. The static stride keeps a unit's bits independent of the grid (nothing
// but the ring positions depends on the CTA) and balances items of equal length; items of
// unequal length arrive longest first from the CP plan, or (varlen without CP) get a CTA each.
template <class F>
__device__ __forceinline__ void for_each_work_item(const FwdParams& p, F&& walk) {
  int32_t c0 = 0;
  for (int32_t index = static_cast<int32_t>(blockIdx.x); index < p.units;
       index += static_cast<int32_t>(gridDim.x)) {
    const WorkItem w = fwd_work_item(p, index);
    if (!w.active) continue;
    walk(w, c0);
    c0 += w.nchunks;
  }
}

// The same walk with its two counters in shared memory (`slot`, the calling warp's own) instead
// of registers live across walk(): for roles whose bodies need every register they have (the
// whole-warp roles of the split-state kernels, walk_items in fwd_kernel.cuh, where ptxas otherwise
// kept the counters on the stack once per item, bench/NOTES.md step 39). Lane 0 writes the slot; each
// item's next values are written before its body runs, so nothing of the walk stays live across it.
template <class F>
__device__ __forceinline__ void for_each_work_item(const FwdParams& p, int32_t (&slot)[2], F&& walk) {
  volatile int32_t* counters = slot;
  // The lane read anew at each use (%laneid, volatile): held across walk(), it was spilled.
  auto lane0 = [] {
    uint32_t lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane == 0;
  };
  if (lane0()) {
    counters[0] = static_cast<int32_t>(blockIdx.x);
    counters[1] = 0;
  }
  __syncwarp();
  for (;;) {
    // (broadcast from lane 0: the compiler then keeps them, and the item's fields, in uniform
    // registers)
    const int32_t index = __shfl_sync(0xffffffffu, counters[0], 0);
    const int32_t c0 = __shfl_sync(0xffffffffu, counters[1], 0);
    if (index >= p.units) break;
    const WorkItem w = fwd_work_item(p, index);
    __syncwarp();
    if (lane0()) {
      counters[0] = index + static_cast<int32_t>(gridDim.x);
      counters[1] = c0 + (w.active ? w.nchunks : 0);
    }
    __syncwarp();
    if (w.active) walk(w, c0);
  }
}

// Stage and phase parity of the i-th use of a ring of kStages buffers.
template <int kStages>
struct RingPos {
  int stage;
  uint32_t phase;
  __device__ __forceinline__ explicit RingPos(int32_t i)
      : stage(static_cast<int>(i % kStages)), phase(static_cast<uint32_t>((i / kStages) & 1)) {}
};

}  // namespace flashgdn::sm90
