// Intra-card context parallelism of the Hopper forward: when too few (sequence, value head)
// chains would fill the GPU, long sequences are cut into segments of L chunks that run on
// different SMs, and their states are joined. docs/context-parallel.md has the math, the cost
// model and the measurements; this header is the contract between the host and the kernels.
//
// Launches, all on the caller's stream (no host synchronisation; capturable in a CUDA graph):
//   1. bounds   (one CTA): every possible segment start of the sequences long enough to split,
//               at multiples of the grain (L_min / 4 for the fine candidate set, else the
//               shortest candidate segment length L_min; segments start from L_min on);
//   2. certify  (a CTA per boundary, chunk of its window and 32 value heads): each chunk's
//               summed gate per head (or a refusal), from which the plan decides, per (sequence,
//               head, boundary), between a warm-up start (W chunks early, from zero) and the
//               exact path;
//   3. plan     (one CTA): reads the sequence lengths and the chunk sums, takes each
//               boundary's warm-up, picks L by the cost model (or takes the caller's), and
//               writes the work items, the slots (segments of split sequences) and each slot's
//               warm-up into the workspace;
//   4. forward phase 1: whole sequences, first segments (from h0), warm-up segments (with o),
//               and for exact segments the local state N (from zero) and the transfer M;
//   5. scan     : S_end(s) = M_s S_end(s - 1) + N_s over each split sequence's segments, in
//               fp32; writes the final state;
//   6. forward phase 2: exact segments again from their true start state, writing o, and beside
//               them the movable ones of the last items (cp_movable: results nobody reads
//               before the call ends), so that the second pass does not run on idle SMs.
// Where CpLayout::corrected, phase 1's two walks of an exact segment also write their outputs
// (the N walk o_local into o, the M walk q~ = scale M_t^T q_t into cp.corr), and instead of
// walking the segment again,
//   5b. correct (a unit per exact segment, head and chunk): o_t = o_local_t + S_start^T q~_t,
//               with S_start the scanned state at the segment's start; all chunks at once;
// phase 2 then runs nothing of the exact segments, and the plan defers nothing to it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/problem.h"
#include "sm90/cp_cost_model.h"
#include "sm90/fwd_params.h"

namespace flashgdn::sm90 {

// The plan's scalars (cp.plan[]).
enum CpPlanWord : int {
  kPlanChunks = 0,  // L: chunks per segment (sequences of more than L chunks are split)
  kPlanItems = 1,   // work items of phase 1 (one per unsplit sequence or segment)
  kPlanSlots = 2,   // segments of split sequences
  kPlanSplits = 3,  // split sequences
  kPlanBounds = 4,  // segment starts certified (multiples of L_min chunks)
  kPlanDeferFrom = 5,  // item CTAs (unit Hv + h) from here on run in phase 2 if movable (cp_movable)
  kPlanExact = 6,      // exact segments (slot > first, head) listed in CpTables::exact (corrected)
  kPlanWords = 7,
};

// cp.warm[] value of a segment that takes the exact path.
constexpr int32_t kExactSegment = -1;

// The warm-up certificate (gdn-math section 5): with L2-normalised keys and 0 <= beta <= 2,
// starting W chunks early from zero changes the state at the segment start by at most
// exp(sum of g over those chunks) ||S||. W is the fewest whole chunks whose summed (floored)
// gate reaches this bound: e^-16 = 1.1e-7 of the state's norm, four orders below a bf16 ulp and
// below the error of the high precision level's final state (5e-6). The warm-up is at most
// the shortest candidate segment long (longer, and the exact path costs less), and at most
// kCertifyMaxChunks chunks: the certificate reads every token of its window for every head
// (92 us at 16/64 1x32768 with 64 chunks), and a gate that has not decayed by e^-16 in 1024
// tokens is rare enough to take the exact path.
constexpr float kCertifyLogDecay = -16.f;
constexpr int32_t kCertifyMaxChunks = 16;

// ---- host -----------------------------------------------------------------------------------
// Whether and how a call runs with CP, from the shapes alone (the workspace query reads no
// tensor memory): the candidate segment lengths the plan kernel chooses from, and the grid and
// table bounds for the shortest of them.
struct CpLayout {
  bool enabled = false;
  int32_t sms = 0;
  CpCandidates cand;       // the segment lengths the plan chooses from (one when fixed); a
                           // boundary every cand.grain() chunks, segments from L_min on
  int32_t per_bound = 0;    // chunk sums a boundary holds: min(cand.grain(), window)
  int32_t window = 0;       // chunks the certificate may look back: min(min_chunks, 16)
  int64_t max_items = 0, max_slots = 0, max_splits = 0, max_bounds = 0;
  size_t state_bytes = 0;  // one of the two slot arrays (ends, trans)
  // The exact segments' outputs corrected (5b above) instead of walked again (cp_corrects:
  // `fast`, no checkpoints, segments short enough that q~ never exceeds the two slot arrays).
  bool corrected = false;
  size_t corr_bytes = 0;
};

// p.context_parallel: FGDN_CONTEXT_PARALLEL_OFF never, _ON always, _AUTO when the longest
// chain the shapes allow is at least twice the balanced load of an SM (docs/context-parallel.md).
CpLayout cp_layout(const Problem& p, int sms);

// The plan's tables in the workspace (device pointers).
struct CpTables {
  int32_t* plan;
  int4* items;       // per work item {n, seg, slot or -1, nseg}
  int4* slots;       // per slot {n, seg, nseg, the sequence's first boundary}
  int4* splits;      // per split sequence {n, first slot, segments, 0}
  int32_t* warm;     // [slot x Hv]: the slot's warm-up chunks or kExactSegment
  int4* bounds;      // per boundary {n, k (start chunk / grain), chunks of n, 0}
  float* chunk_gate;    // [boundary x per_bound chunk x Hv]: the chunk's summed gate, +inf: refused
  int32_t* bound_warm;  // [boundary x Hv]: the warm-up chunks or kExactSegment (where the plan
                        // does not keep them in shared memory)
  int4* exact;          // where corrected: the exact segments {slot Hv + h, n, seg, 0}, in no
                        // particular order (plan[kPlanExact] of them); else nullptr
};

void launch_cp_bounds(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream);
void launch_cp_certify(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream);
void launch_cp_plan(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream);
void launch_cp_scan(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream);
// q, k, v (and o, cp.corr) of type qkv. Launched after the scan where c.corrected.
void launch_cp_correct(const CpLayout& c, const FwdParams& fp, const CpTables& t, fgdn_dtype qkv,
                       cudaStream_t stream);

}  // namespace flashgdn::sm90
