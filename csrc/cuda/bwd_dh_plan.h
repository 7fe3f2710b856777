// The plan of the backward's reverse context parallelism (chunk_bwd_dh.cu runs it): each
// (sequence, value head) chain of the dh pass cut into `segments` segments of `chunks` chunks,
// one CTA each (1: no split); and, at the end, its blocks of chunk slots (chunk_bwd.cu). Host
// arithmetic alone, so that the CPU tests check the decisions (tests/cpp/test_bwd_dh_plan.cpp)
// and the launcher keeps only the launches.
//
// A fixed cp_segment is taken as it is, but for the floor below (a sequence's bits then depend
// on nothing else in the call). Automatically, a split happens only when every chain can take
// kDhMinSegments segments within one wave of the SMs (4 N Hv <= SMs), into segments that fill
// them once: a chain on the exact path takes (waves of phase 1 + 1) segment walks, so fewer than
// four segments, or a second wave, gain nothing for it (the benchmark's inputs have a head
// without decay; at 16/64, one 32768-token sequence, four segments in two waves measured 4.28 ms
// against 3.87 unsplit on an H100). Segments are at least kDhMinSegmentChunks long: a certified
// segment's warm-up is up to 16 chunks.
//
// Unsplit at D = 128, where the chains fill at most half the SMs (2 N Hv <= SMs), each chain's
// 128 value rows go to two CTAs of one warpgroup instead of one CTA of two (halves = 2): the
// rows of dS^T evolve independently (dS^T's row v needs dvl^T's and dO^T's row v and the shared
// K~, Q~, W), so the bits are the same and the two halves' chains run on two SMs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda::bwd {

constexpr int64_t kDhChunk = 64;  // tokens a chunk (chunk_bwd_internal.cuh's kC)
constexpr int64_t kDhMinSegmentChunks = 16;
constexpr int64_t kDhMinSegments = 4;
// The fused walk's automatic segments: no warm-up to cover (its split is exact), so the floor only
// bounds the per-segment overheads (a transfer walk's start, the scan): 4 chunks. EXPERIMENT.
constexpr int64_t kFusedMinSegmentChunks = 4;
// r = num / den, the fused walk's transfer (a carry-only walk) against a whole walk, a chunk, as
// the plan takes it: 0.4, the best of 1, 0.7, 0.6, 0.5, 0.4 on 2/8, 4/16, 8/32, 16/64 one 32768-token
// sequence (H200, 2026-11-29; bench/NOTES.md), though a transfer walk alone costs 0.62 (Nsight).
constexpr int64_t kFusedTransferStepNum = 2, kFusedTransferStepDen = 5;

// How the fused walk cuts a sequence of `total` chunks, read alike by the host and the kernels
// (bwd_fused_scheduler.cuh, bwd_fused_scan.cu): `fixed` > 0, into segments of that many chunks
// (cp_segment); else `walks` = k > 0, each sequence by its own length into at most k + 1
// segments, L = max(kFusedMinSegmentChunks, ceil(total / (k + r))) (r = 0.4, below), none where
// that gives fewer than min_segments (automatically 3: two are walked one after the other, no
// gain; 2 where the caller forces CP) or the sequence is shorter than `floor`; else whole. Per
// sequence, so that a CUDA graph's replay with other lengths of the same total cuts each sequence
// as an eager call does (the captured grid holds the k + 1 segments any lengths take).
struct FusedCut {
  int32_t fixed = 0, walks = 0, floor = 0, min_segments = 3;
  constexpr int chunks(int total) const {
    if (fixed > 0) return fixed;
    const int whole = total > 0 ? total : 1;
    if (walks < 1 || total < floor) return whole;
    constexpr int64_t num = kFusedTransferStepNum, den = kFusedTransferStepDen;
    const int64_t l = (int64_t{total} * den + walks * den + num - 1) / (walks * den + num);  // ceil(total / (k + r))
    const int len = static_cast<int>(l > kFusedMinSegmentChunks ? l : kFusedMinSegmentChunks);
    return (total + len - 1) / len < min_segments ? whole : len;
  }
  constexpr int segments(int total) const {
    const int len = chunks(total);
    return (total + len - 1) / len;
  }
};

struct DhPlan {
  int64_t chunks = 0;    // chunks a segment (0 with no split; fused, automatic: the longest sequence's)
  int32_t segments = 1;  // segments of the longest possible sequence (T tokens; fused, automatic: k + 1)
  int32_t halves = 1;    // CTAs a chain's value rows are split over (segments == 1 only)
  FusedCut cut;          // the fused walk's cut (fused plans only)
};

// sms: the device's multiprocessors (read only by an automatic split). fused: the fused
// backward's walk (sm90/bwd_fused.cu). Its S segments take two launches of S - 1 walks a chain:
// phase 1 the last segment (from d_final_state, writing) and B_s, A_s of segments 1 .. S - 2
// (A_s only where the gates do not certify it away), phase 0 segments 0 .. S - 2. Automatically
// S - 1 = k walks a chain, k as many as fit 7/8 of a wave (the rest for the A_s walks: 15
// segments at 8 chains on 132 SMs, 112 walks and the 13 A_s walks of one head without decay);
// where that is 1, k = 2 if 2 N Hv <= SMs, for sequences of kFusedThreeSegmentMinChunks chunks
// or more (FusedCut::floor): 3 segments, 2/3 of the unsplit walk's chunk steps when the A_s walks
// fit the wave's rest, the unsplit walk's when they take a second wave.
//
// The three segments save a share of the unsplit walk's chunk steps (phase 1 ~0.62 L, a transfer
// step's cost, and phase 0 L, of 2.4 L) and cost a fixed part (phase 1's launch and prologue, the
// scan): split minus unsplit is linear in the chunks. Measured at 2/8, 64 chains (H200,
// 2026-11-30, q/k in the call, bwd; bench/results/h200-2026-11-30/bwd-2-8-cp.md): 8 sequences of
// 16 chunks 0.361 ms split against 0.323 unsplit, of 64 chunks 0.863 against 0.891: even at ~44
// chunks. The floor applies to this fallback alone, where it was measured (its A_s walks overflow
// the wave); k >= 3 keeps its gain on short sequences (4 x 32 chunks: 0.363 against 0.467 unsplit).
constexpr int64_t kFusedThreeSegmentMinChunks = 48;
// The fused plan's walks a chain and launch, S - 1 = k (0: no split), for any lengths.
inline int64_t fused_walks_per_chain(const Problem& p, int sms) {
  const int64_t c = std::max<int64_t>(p.N * p.Hv, 1);
  int64_t k = (sms - sms / 8) / c;
  if (k < 2 && 2 * c <= sms) k = 2;
  if (p.context_parallel != FGDN_CONTEXT_PARALLEL_AUTO) k = std::max<int64_t>(k, kDhMinSegments - 1);
  return k < 2 ? 0 : k;
}
// The shortest sequence the automatic plan splits: the three-segment fallback's floor, else any.
inline int32_t fused_split_floor(const Problem& p, int sms) {
  const int64_t c = std::max<int64_t>(p.N * p.Hv, 1);
  const bool fallback = p.context_parallel == FGDN_CONTEXT_PARALLEL_AUTO && (sms - sms / 8) / c < 2;
  return fallback ? static_cast<int32_t>(kFusedThreeSegmentMinChunks) : 0;
}

// The fused reverse CP's fp32 128 x 128 matrices, per chain of S segments (the plan's), only those
// a walk or the scan uses: the seeds of segments 0 .. S - 2 (the last segment starts from
// d_final_state) and the transfers B_s, A_s of segments 1 .. S - 2 (segment 0's carry is never
// transferred, the last one's is walked whole): 3 S - 5, against 3 S a chain for every segment's.
// Chain n Hv + h's first at (n Hv + h) fused_cp_per_chain(S); within it, in segment order, B_s,
// A_s, seed_s at 3 s - 2, 3 s - 1, 3 s (seed_0 at 0): an offset within a chain depends on s alone,
// in 32 bits (the scan, at 80 registers, spilled with 64-bit offsets).
constexpr int64_t fused_cp_per_chain(int64_t S) { return S > 1 ? 3 * S - 5 : 0; }
// The seed of segment s (0 <= s <= S - 2): the carry at its end.
constexpr int fused_cp_seed(int s) { return 3 * s; }
// The transfer of segment s (1 <= s <= S - 2): which 0 B_s, which 1 A_s.
constexpr int fused_cp_map(int s, int which) { return 3 * s - 2 + which; }

// The longest sequence in chunks: from the lengths where the call has them on the host (dense:
// the shapes; varlen: a call, not a workspace query, nor a call a CUDA graph captures: a replay
// may lengthen a sequence past the capture's longest), else the packed total, its upper bound.
// A fixed segment cuts by it (the grid's segments); the automatic fused plan asks it only whether
// any sequence splits, and cuts each by its own length (FusedCut).
inline bool lengths_on_host(const Problem& p) {
  return !p.varlen || (p.have_host_seqlens && !p.capturing && p.cu.size() == static_cast<size_t>(p.N) + 1);
}
inline int64_t longest_chunks(const Problem& p) {
  if (!p.varlen || !lengths_on_host(p)) return (p.T + kDhChunk - 1) / kDhChunk;
  int64_t longest = 0;
  for (int64_t n = 0; n < p.N; ++n) longest = std::max(longest, p.seq(n).len);
  return (longest + kDhChunk - 1) / kDhChunk;
}

// The fused plan (dh_plan_segments below) where it is automatic or forced without a fixed
// segment: each sequence cut by its own length, into at most k + 1 segments (ceil(total / L) with
// L >= total / (k + 0.4)). The grid takes the most any sequence of the call takes where the host
// has the lengths, else k + 1 (a replay's sequences of any lengths); none where the longest (or
// the packed total) does not split.
// Per sequence rather than by the longest: a CUDA graph's plan then cuts a replay's sequences as
// the eager call does (cut by the packed total, 2/8 4 x 2048 took one 32-chunk segment a sequence
// where the eager plan took four: 0.485 ms against 0.363).
// A captured call asks the packed total, not the capture's longest, whether to split: "no split"
// would hold for any replay too, but a capture of short sequences would then walk a replay's long
// ones unsplit (2/8 1x8192: 1.33 ms against 0.40), where asking the total costs a capture of
// short ones two empty launches (2/8 8x1024: 0.336 against 0.328).
inline DhPlan fused_plan_per_sequence(const Problem& p, int sms, int64_t longest) {
  DhPlan d;
  const int64_t k = fused_walks_per_chain(p, sms);
  if (k == 0) return d;
  FusedCut cut;
  cut.walks = static_cast<int32_t>(k);
  cut.floor = fused_split_floor(p, sms);
  cut.min_segments = p.context_parallel == FGDN_CONTEXT_PARALLEL_AUTO ? 3 : 2;
  const int longest_c = static_cast<int>(longest);
  if (cut.segments(longest_c) <= 1) return d;
  d.cut = cut;
  d.chunks = cut.chunks(longest_c);
  d.segments = static_cast<int32_t>(k + 1);
  if (lengths_on_host(p)) {
    d.segments = cut.segments(longest_c);
    for (int64_t n = 0; p.varlen && n < p.N; ++n)
      d.segments = std::max(d.segments, cut.segments(static_cast<int>((p.seq(n).len + kDhChunk - 1) / kDhChunk)));
  }
  return d;
}

inline DhPlan dh_plan_segments(const Problem& p, int sms, bool fused = false) {
  DhPlan d;
  if (p.context_parallel == FGDN_CONTEXT_PARALLEL_OFF || p.N <= 0) return d;
  const int64_t longest = fused ? longest_chunks(p) : (p.T + kDhChunk - 1) / kDhChunk;  // chunks
  const int64_t chains = p.N * p.Hv;
  const bool automatic = p.context_parallel == FGDN_CONTEXT_PARALLEL_AUTO;
  if (p.cp_segment > 0) {
    d.chunks = std::max(kDhMinSegmentChunks, p.cp_segment / kDhChunk);
    if (fused) d.cut.fixed = static_cast<int32_t>(d.chunks);
  } else if (fused) {
    // Phase 1 walks the last segment whole and the others' transfers, carry-only walks at r of a
    // whole walk's cost a chunk: S - 1 = k segments of L chunks and a last one of ~r L, so that
    // neither phase 1 part waits for the other. L = ceil(total / (k + r)) (FusedCut).
    return fused_plan_per_sequence(p, sms, longest);
  } else {
    if (automatic && chains * kDhMinSegments > sms) return d;
    const int64_t per_chain = std::max<int64_t>(kDhMinSegments, sms / std::max<int64_t>(chains, 1));
    d.chunks = std::max(kDhMinSegmentChunks, (longest + per_chain - 1) / per_chain);
  }
  if (longest > d.chunks) d.segments = static_cast<int32_t>((longest + d.chunks - 1) / d.chunks);
  if (d.segments == 1) d.cut = FusedCut{};
  return d;
}

// The most segments the fused plan takes for any lengths of p's shapes (the workspace query has
// no lengths): a fixed segment cuts the packed total into the most; automatically S <= k + 1.
inline int32_t fused_segments_capacity(const Problem& p, int sms) {
  Problem bound = p;
  bound.have_host_seqlens = false;
  const DhPlan b = dh_plan_segments(bound, sms, true);
  if (p.context_parallel == FGDN_CONTEXT_PARALLEL_OFF || p.N <= 0 || p.cp_segment > 0) return b.segments;
  const int64_t k = fused_walks_per_chain(p, sms);
  return k == 0 ? b.segments : std::max<int32_t>(b.segments, static_cast<int32_t>(k + 1));
}

inline DhPlan dh_plan(const Problem& p, int sms) {
  DhPlan d = dh_plan_segments(p, sms);
  if (d.segments == 1 && p.K == 128 && p.N > 0 && 2 * p.N * p.Hv <= sms) d.halves = 2;
  return d;
}

// The backward's per-chunk workspace (chunk_bwd.cu: ~270 KB a chunk slot and value head at
// D = 128, K = V) holds one block of chunk slots at a time; the launcher walks the blocks last
// first, and only the chunk-start states span every slot. A block is at least kBlockBytes of
// that workspace (rounded to the nearest whole number of waves of the per-chunk grids: slots Hv
// a multiple of the SMs) and four waves of them (4 SMs / Hv slots). The per-chunk kernels run one
// CTA an SM, so a block's last wave is paid whole (64 slots at 16/64 were 31.03 waves: +1.0 ms
// over 8 blocks, H200, 2026-11-28). Only with the reverse pass unsplit (DhPlan::segments == 1):
// its chains carry dS exactly from block to block, so the bits are those of one block; a split
// pass's warm-ups and scan would reach past a block (not done).
// forced_slots > 0 (the FLASHGDN_BWD_BLOCK_SLOTS test hook) sets the block's slots.
constexpr size_t kBlockBytes = size_t{1} << 30;

struct BlockPlan {
  int64_t slots = 0;  // chunk slots a block (the last block may hold fewer)
  int64_t count = 1;
};

inline BlockPlan block_plan(int64_t total_slots, size_t bytes_per_slot, int64_t Hv, int sms, bool reverse_split,
                            int64_t forced_slots) {
  BlockPlan b;
  b.slots = total_slots;
  if (reverse_split || total_slots <= 0) return b;
  int64_t slots = forced_slots;
  if (slots <= 0) {
    const int64_t hv = std::max<int64_t>(Hv, 1);
    const int64_t by_bytes = static_cast<int64_t>(kBlockBytes / std::max<size_t>(bytes_per_slot, 1));
    const int64_t by_waves = (4 * static_cast<int64_t>(sms) + hv - 1) / hv;
    slots = std::max<int64_t>({by_bytes, by_waves, 1});
    // slots whose Hv CTAs fill whole waves
    const int64_t wave = sms / std::gcd(hv, static_cast<int64_t>(sms));
    if (slots >= wave / 2) {  // the nearest whole number of waves, at least the four-wave floor
      const int64_t near = std::max<int64_t>((slots + wave / 2) / wave, 1) * wave;
      slots = near >= by_waves ? near : near + wave;
    }
  }
  if (slots >= total_slots) return b;
  b.slots = slots;
  b.count = (total_slots + slots - 1) / slots;
  return b;
}

}  // namespace flashgdn::cuda::bwd
