// Intra-card context parallelism of the Hopper forward: when too few (sequence, value head)
// chains would fill the GPU, long sequences are cut into segments of L chunks that run on
// different SMs, and their states are joined. docs/context-parallel.md has the math, the cost
// model and the measurements; this header is the contract between the host and the kernels.
//
// Launches, all on the caller's stream (no host synchronisation; capturable in a CUDA graph):
//   1. plan     (one CTA): reads the sequence lengths, picks L by the cost model (or takes the
//               caller's), and writes the work items and the slots (segments of split
//               sequences) into the workspace;
//   2. certify  (a warp per slot and head): the gate decides, per (sequence, head, segment),
//               between a warm-up start (W chunks early, from zero) and the exact path;
//   3. forward phase 1: whole sequences, first segments (from h0), warm-up segments (with o),
//               and for exact segments the local state N (from zero) and the transfer M;
//   4. scan     : S_end(s) = M_s S_end(s - 1) + N_s over each split sequence's segments, in
//               fp32; writes the final state;
//   5. forward phase 2: exact segments again from their true start state, writing o.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/problem.h"
#include "sm90/fwd_params.h"

namespace flashgdn::sm90 {

// The plan's scalars (cp.plan[]).
enum CpPlanWord : int {
  kPlanChunks = 0,  // L: chunks per segment (sequences of more than L chunks are split)
  kPlanItems = 1,   // work items of phase 1 (one per unsplit sequence or segment)
  kPlanSlots = 2,   // segments of split sequences
  kPlanSplits = 3,  // split sequences
  kPlanWords = 4,
};

// cp.warm[] value of a segment that takes the exact path.
constexpr int32_t kExactSegment = -1;

// The warm-up certificate (gdn-math section 5): with L2-normalised keys and 0 <= beta <= 2,
// starting W chunks early from zero changes the state at the segment start by at most
// exp(sum of g over those chunks) ||S||. W is the fewest whole chunks whose summed (floored)
// gate reaches this bound: e^-16 = 1.1e-7 of the state's norm, four orders below a bf16 ulp and
// below the error of the high precision level's final state (5e-6). The warm-up is at most
// one segment long (longer, and the exact path costs less).
constexpr float kCertifyLogDecay = -16.f;

// ---- host -----------------------------------------------------------------------------------
// Whether and how a call runs with CP, from the shapes alone (the workspace query reads no
// tensor memory): the candidate segment lengths the plan kernel chooses from, and the grid and
// table bounds for the shortest of them.
struct CpLayout {
  bool enabled = false;
  int32_t sms = 0;
  int32_t min_chunks = 0;  // candidates L = min_chunks << i, i < candidates (one when fixed)
  int32_t candidates = 0;
  int64_t max_items = 0, max_slots = 0, max_splits = 0;
  size_t state_bytes = 0;  // one of the two slot arrays (ends, trans)
};

// p.context_parallel: FGDN_CONTEXT_PARALLEL_OFF never, _ON always, _AUTO when the longest
// chain the shapes allow is at least twice the balanced load of an SM (docs/context-parallel.md).
CpLayout cp_layout(const Problem& p, int sms);

// The plan's tables in the workspace (device pointers).
struct CpTables {
  int32_t* plan;
  int4* items;
  int4* slots;
  int4* splits;  // per split sequence {n, first slot, segments, 0}
  int32_t* warm;
};

void launch_cp_plan(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream);
void launch_cp_certify(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream);
void launch_cp_scan(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream);

}  // namespace flashgdn::sm90
