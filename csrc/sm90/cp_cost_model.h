// The cost model of the context-parallel plan (docs/context-parallel.md, "The cost model"),
// host and device: the plan kernel calls it on the GPU, tests/cpp/test_cp_cost_model.cpp on the
// host with the statistics of known shapes.
//
// Time is counted in chunk-steps (one chunk of one chain on one SM), for Hv value heads on `sms`
// SMs and segments of L chunks (sequences of more than L chunks split). From the certificates of
// the boundaries that start L's segments: a warm-up segment walks W more chunks in phase 1; an
// exact one walks its M in phase 1, takes a scan step and walks again in phase 2. Every CTA pays
// kCpFillSteps for its pipeline fill (its first chunk's chunk-local work runs before the state
// role can start).
//   ctas1   = Hv items + exact                        (items: unsplit sequences and segments)
//   len1    = min(max c, L) + max W + F
//   D       = len1 x the movable CTAs that phase 2 takes (cp_deferred)
//   phase 1 = waves(Hv sum c + m + warm + F ctas1 - D, len1)
//   phase 2 = waves(m + F exact + D, max(L + F, len1 if D > 0))   (m: chunks of exact segments)
//   scan    = kCpScanSteps (ceil(max c / L) - 1)
// With the exact segments' outputs corrected instead of walked again (`corrected`,
// cp_layout): no second pass, so nothing moves (D = 0) and phase 2 is the correction,
// kCpCorrectSteps + kCpCorrectUnitSteps ceil(m / sms) where there is an exact segment, and
// phase 1 takes at least ceil(n_long / sms) waves, n_long = the CTAs longer than half a wave
// (long_ctas + exact), since no two of them share an SM's wave.
//   waves(work, len) = ceil(work / (sms len)) len      (CTAs of len steps, sms at a time)
// plus kCpFixedSteps for the extra launches. Without CP: waves(Hv (sum c + F N), max c + F).
#pragma once

#include <math.h>

#include <cstdint>

#include "common/host_device.h"

namespace flashgdn::sm90 {

constexpr double kCpFixedSteps = 2.0;
constexpr double kCpFillSteps = 2.0;
// A scan step against a chunk-step, as measured (clock64 timelines, H100, 2/8 1x8192: ~2900
// cycles a scan step, ~6400 a chunk of a chain; bench/NOTES.md step 16. It was 0.75 before the
// scan's copy warp).
constexpr double kCpScanSteps = 0.45;
// The scan's own start (its launch behind phase 1, the first S_end and M): phase 1's end to the
// scan's is ~5 us + ~1.35 us a step over the CP rows' timelines (H100, 2026-11-26: 2/8 1x32768
// 31 steps 47.7 us, 25 steps 39.2; 8/16 1x2048 7 steps 13.5-14.0), ~1.5 chunk-steps. Paid by
// every split alike, so it is part of the pipeline's price on the host (cp_pipeline_pays), not
// of the plan's split-or-not test on the device: there, where a pack of short sequences makes
// the model's phase-1 work meaningless (cp_steps' deferred work counts every movable CTA as
// len1 long), 1.5 steps tipped 8/32 mix32768's second input set from a split (629 us) to none
// (1123 us): bench/NOTES.md, step 32f.
constexpr double kCpScanFixedSteps = 1.5;
// The correction of the exact segments' outputs (cp_correct_kernel: a 64 x K by K x V product a
// unit, each CTA a contiguous run of units, one CTA an SM): the scan's end to the correction's
// is ~2 us + ~5.7 us per unit a CTA takes over the same timelines (8/16 1x2048, 28 units: 7.7
// us; 2/8 1x16384 and B2x8192, ~2 a CTA: 13.4-15.0; 2/8 2x16384, ~4 a CTA: 24.7), in
// chunk-steps kCpCorrectSteps + kCpCorrectUnitSteps ceil(m / SMs).
constexpr double kCpCorrectSteps = 0.5;
constexpr double kCpCorrectUnitSteps = 1.6;
// A split must beat no split by this factor.
constexpr double kCpMinGain = 0.9;
// cp.plan[kPlanChunks] when nothing splits.
constexpr int32_t kCpNoSplit = INT32_MAX / 128;
constexpr int kCpMaxCandidates = 8;  // the larger of the two sets (CpCandidates)

// The candidate segment lengths, over one shortest length L_min (cp_min_chunks), in one of two
// sets. Coarse: L = L_min 2^i, i < 6, with a boundary every L_min chunks. Fine: L = L_min q / 4,
// q = 4, 5, 6, 8, 10, 12, 16, 32 (L_min x 1 .. 8), with a boundary every grain = L_min / 4 chunks.
// A split runs in whole waves of segment-long CTAs, and with the powers of two alone the few-head
// long rows had a wave of phase 2 barely used (2/8 1x32768 at L = 16: 1.4 waves of 19
// chunk-steps, so 2; at L = 20, 0.94 of a wave of 23: bench/NOTES.md, "Candidate segment
// lengths"; measured 296 -> 255 us, step 32). The fine set's 4x boundaries cost the pre-phase
// 5-8 us (certificate, plan), which rows where it picks a power of two anyway lost (+4-10%,
// step 32b), so the host takes it only where it pays (cp_fine_pays). With several candidates
// L_min is a power of two >= 4, so every L is a whole number of grains. A fixed length (the
// caller's cp_segment) is one coarse candidate of any length.
// Candidate i's length in grains: its segments start at every this-many-th boundary.
FGDN_HOST_DEVICE constexpr int32_t cp_candidate_grains(int i, bool fine) {
  return !fine ? 1 << i : i <= 2 ? 4 + i : i <= 5 ? 8 + 2 * (i - 3) : i == 6 ? 16 : 32;
}
constexpr int kCpCoarseCandidates = 6;
constexpr int kCpFineCandidates = 8;
FGDN_HOST_DEVICE constexpr int cp_candidate_count(bool fine) { return fine ? kCpFineCandidates : kCpCoarseCandidates; }

struct CpCandidates {
  int32_t min_chunks = 0;  // L_min, the first candidate
  int count = 0;           // 1: a fixed length
  bool fine = false;
  FGDN_HOST_DEVICE constexpr int32_t grain() const { return fine ? min_chunks / 4 : min_chunks; }
  FGDN_HOST_DEVICE constexpr int32_t grains(int i) const { return cp_candidate_grains(i, fine); }
  FGDN_HOST_DEVICE constexpr int64_t chunks(int i) const { return static_cast<int64_t>(grain()) * grains(i); }
};
FGDN_HOST_DEVICE constexpr CpCandidates cp_candidates(int32_t min_chunks, bool fine) {
  return {min_chunks, cp_candidate_count(fine), fine};
}
FGDN_HOST_DEVICE constexpr CpCandidates cp_fixed_length(int32_t chunks) { return {chunks, 1, false}; }

// The plan's statistics of one candidate L, summed over its segments and heads. `movable`:
// CTAs whose results neither the scan nor a later pass reads (unsplit sequences; middle
// warm-up segments not followed by an exact one), which may run in phase 2 beside the exact
// segments' second pass instead of in phase 1. `long_ctas`: the item CTAs longer than half a
// segment (every segment of L chunks; a last segment or an unsplit sequence of more than L / 2
// chunks), of which no two share an SM's wave (cp_long_waves); the M walks are in `exact`.
struct CpCandidateStats {
  unsigned long long items, exact, exact_chunks, warm_chunks, warm_max, movable, long_ctas;
};

// The long item CTAs of a sequence of c chunks at segment length L, per head (CpCandidateStats;
// the plan kernel forms the same from the quotient it takes for `items`).
template <class U>
FGDN_HOST_DEVICE constexpr U cp_long_items(U c, U L) {
  return c > L ? c / L + (2 * (c % L) > L ? 1 : 0) : (2 * c > L ? 1 : 0);
}

// Movable CTAs that phase 2 takes: phase 1 keeps the others and fills its last wave with
// movable ones; the rest run beside the exact segments' second pass. Nothing moves when there
// is no second pass (a launch boundary would only add a partial wave).
FGDN_HOST_DEVICE inline unsigned long long cp_deferred(unsigned long long ctas1, unsigned long long movable,
                                                       unsigned long long exact, int sms) {
  if (exact == 0 || movable == 0) return 0;
  const unsigned long long forced = ctas1 - movable, s = static_cast<unsigned long long>(sms);
  const unsigned long long fill = (forced + s - 1) / s * s - forced;
  return movable > fill ? movable - fill : 0;
}

FGDN_HOST_DEVICE inline double cp_waves(double work, double len, int sms) {
  return len <= 0 ? 0.0 : ceil(work / (sms * len)) * len;
}

// Waves of CTAs of up to len steps, `long_ctas` of them longer than len / 2: at least
// ceil(long / sms) waves, since two long ones never share an SM's wave. Work alone let the model
// cut CTAs: at 8/16 1x2048, L = 4, 135 segment and M-walk CTAs (0.99 of a wave of work) ran in
// two rounds on 132 SMs (phase 1 ~50 us; at L = 5, 102 of them: ~25; bench/NOTES.md, step 33).
FGDN_HOST_DEVICE inline double cp_long_waves(double work, double len, double long_ctas, int sms) {
  const double by_work = cp_waves(work, len, sms);
  if (len <= 0 || long_ctas <= 0) return by_work;
  const double by_count = ceil(long_ctas / sms) * len;
  return by_work > by_count ? by_work : by_count;
}

FGDN_HOST_DEVICE inline double cp_unsplit_steps(double sum_c, double max_c, double n, double hv, int sms) {
  return cp_waves(hv * (sum_c + kCpFillSteps * n), max_c + kCpFillSteps, sms);
}

FGDN_HOST_DEVICE inline double cp_steps(const CpCandidateStats& s, double sum_c, double max_c, double L,
                                        double hv, int sms, bool corrected) {
  const double exact = static_cast<double>(s.exact), m = static_cast<double>(s.exact_chunks);
  const double ctas1 = hv * static_cast<double>(s.items) + exact;
  const double len1 = (max_c < L ? max_c : L) + static_cast<double>(s.warm_max) + kCpFillSteps;
  const unsigned long long walked_again = corrected ? 0 : s.exact;
  const double deferred =
      static_cast<double>(cp_deferred(static_cast<unsigned long long>(ctas1), s.movable, walked_again, sms)) * len1;
  // Whole-CTA waves where nothing is walked again (corrected): there phase 1 holds every CTA.
  // Where phase 2 walks the exact segments again and takes movable CTAs beside them, which CTAs
  // run when is the plan's pass 4, which this count does not follow: with it the model picked
  // worse lengths there (8/32 1x32768 and 1x8192, 16/64 1x8192: +9..+12%, step 33).
  const double long1 = corrected ? static_cast<double>(s.long_ctas) + exact : 0.0;
  const double p1 = cp_long_waves(hv * sum_c + m + static_cast<double>(s.warm_chunks) + kCpFillSteps * ctas1 - deferred,
                                  len1, long1, sms);
  const double len2 = deferred > 0 && len1 > L + kCpFillSteps ? len1 : L + kCpFillSteps;
  const double p2 = exact <= 0 ? 0.0
                    : corrected ? kCpCorrectSteps + kCpCorrectUnitSteps * ceil(m / sms)
                                : cp_waves(m + kCpFillSteps * exact + deferred, len2, sms);
  const double scan = kCpScanSteps * (ceil(max_c / L) - 1.0);
  return p1 + p2 + scan + kCpFixedSteps;
}

// The cost of candidate i (L = cand.chunks(i)), or -1 where nothing splits (the plan kernel
// prices its candidates in parallel, a thread each).
FGDN_HOST_DEVICE inline double cp_candidate_steps(const CpCandidateStats& s, int i, const CpCandidates& cand,
                                                  double sum_c, double max_c, double hv, int sms, bool corrected) {
  const double L = static_cast<double>(cand.chunks(i));
  return max_c <= L ? -1.0 : cp_steps(s, sum_c, max_c, L, hv, sms, corrected);
}

// What a split must cost less than: kCpMinGain x no split.
FGDN_HOST_DEVICE inline double cp_split_bar(double sum_c, double max_c, double n, double hv, int sms) {
  return kCpMinGain * cp_unsplit_steps(sum_c, max_c, n, hv, sms);
}

// The plan's choice from the candidates' costs: the cheapest candidate L that splits
// something and costs under the bar (the first of equal costs); else kCpNoSplit.
FGDN_HOST_DEVICE inline int32_t cp_pick_from(const double* cost, const CpCandidates& cand, double bar) {
  double best = bar;
  int32_t chosen = kCpNoSplit;
  for (int i = 0; i < cand.count; ++i) {
    if (cost[i] >= 0.0 && cost[i] < best) {
      best = cost[i];
      chosen = static_cast<int32_t>(cand.chunks(i));
    }
  }
  return chosen;
}

FGDN_HOST_DEVICE inline int32_t cp_pick_chunks(const double* cost, const CpCandidates& cand, double sum_c,
                                               double max_c, double n, double hv, int sms) {
  return cp_pick_from(cost, cand, cp_split_bar(sum_c, max_c, n, hv, sms));
}

FGDN_HOST_DEVICE inline int32_t cp_choose_chunks(const CpCandidateStats* stats, const CpCandidates& cand,
                                                 double sum_c, double max_c, double n, double hv, int sms,
                                                 bool corrected) {
  double cost[kCpMaxCandidates];
  for (int i = 0; i < cand.count; ++i)
    cost[i] = cp_candidate_steps(stats[i], i, cand, sum_c, max_c, hv, sms, corrected);
  return cp_pick_chunks(cost, cand, sum_c, max_c, n, hv, sms);
}

// The CP pipeline's own cost beyond kCpFixedSteps, paid whether or not the plan then splits
// (bounds, certificate and plan kernels, the scan and second-pass launches): ~40 us measured at
// 16/64 1x2048, where the plan split nothing (0.163 ms against 0.122 with CP off; bench/NOTES.md
// step 17), ~12 chunk-steps of ~3.4 us.
constexpr double kCpPipelineSteps = 10.0;

// Sequences of equal length, for the host's test below (a dense batch is one group).
struct CpSeqGroup {
  int64_t chunks, count;
};

// The host's price of a split, from the lengths alone (the gates are on the device): the
// cheapest candidate in the case of one head per split sequence taking the exact path at every
// boundary (its transfer matrices, scan steps and second pass or correction) and every other head
// certified within one chunk, the benchmark's gates (bench/gdnbench/inputs.py: head 0 never
// decays); -1 where no candidate splits.
inline double cp_host_split_steps(const CpSeqGroup* groups, int64_t n_groups, double hv, const CpCandidates& cand,
                                  int sms, bool corrected) {
  double sum_c = 0.0, max_c = 0.0;
  for (int64_t i = 0; i < n_groups; ++i) {
    sum_c += static_cast<double>(groups[i].chunks) * static_cast<double>(groups[i].count);
    max_c = groups[i].chunks > max_c ? static_cast<double>(groups[i].chunks) : max_c;
  }
  const auto heads = static_cast<unsigned long long>(hv);
  const unsigned long long exact_heads = heads > 0 ? 1 : 0, warm_heads = heads - exact_heads;
  double best = -1.0;
  for (int c = 0; c < cand.count; ++c) {
    const int64_t L = cand.chunks(c);
    CpCandidateStats st = {};
    for (int64_t i = 0; i < n_groups; ++i) {
      const int64_t chunks = groups[i].chunks;
      const auto count = static_cast<unsigned long long>(groups[i].count);
      st.long_ctas += cp_long_items(static_cast<unsigned long long>(chunks), static_cast<unsigned long long>(L)) *
                      count * heads;
      if (chunks <= L) {  // unsplit: one item, movable
        st.items += count;
        st.movable += count * heads;
        continue;
      }
      const auto segs = static_cast<unsigned long long>((chunks + L - 1) / L);
      st.items += segs * count;
      st.exact += (segs - 1) * count * exact_heads;
      st.exact_chunks += static_cast<unsigned long long>(chunks - L) * count * exact_heads;  // all but the first
      st.warm_chunks += (segs - 1) * count * warm_heads;
      st.movable += (segs - 2) * count * warm_heads;  // middle warm-up segments, none followed by an exact one
    }
    st.warm_max = st.warm_chunks > 0 ? 1 : 0;
    const double cost = cp_candidate_steps(st, c, cand, sum_c, max_c, hv, sms, corrected);
    if (cost >= 0.0 && (best < 0.0 || cost < best)) best = cost;
  }
  return best;
}

// What a split must cost less than, from the lengths on the host (cp_split_bar).
inline double cp_host_bar(const CpSeqGroup* groups, int64_t n_groups, double hv, int sms) {
  double sum_c = 0.0, max_c = 0.0, n = 0.0;
  for (int64_t i = 0; i < n_groups; ++i) {
    sum_c += static_cast<double>(groups[i].chunks) * static_cast<double>(groups[i].count);
    max_c = groups[i].chunks > max_c ? static_cast<double>(groups[i].chunks) : max_c;
    n += static_cast<double>(groups[i].count);
  }
  return cp_split_bar(sum_c, max_c, n, hv, sms);
}

// Whether to launch the pipeline at all: the host's price of a split (cp_host_split_steps) must
// beat no split (the bar, kCpMinGain below it) after the pipeline's own cost. Where even that
// case loses, the plan would split and lose where a head does not decay, or decline after the
// pipeline had cost ~20-30 us. Pricing the best case (no exact head) instead launched the
// pipeline in 7 of the benchmark's cells where it lost 5-15% to CP off (16/64 1x4096, 8/32 and
// 16/32 1x2048, 4/4 B8x2048, the 8x4096 packs at 2/8 and 8/24, 16/48 4x8192: bench/NOTES.md
// step 24), where head 0 does not decay; with every head decaying, those cells give up a split
// the model prices within ~10-20 chunk-steps of the bar.
inline bool cp_split_pays(double split, double bar) {
  return split >= 0.0 && split + kCpPipelineSteps + kCpScanFixedSteps < bar;
}
inline bool cp_pipeline_pays(const CpSeqGroup* groups, int64_t n_groups, double hv, const CpCandidates& cand,
                             int sms, bool corrected) {
  return cp_split_pays(cp_host_split_steps(groups, n_groups, hv, cand, sms, corrected),
                       cp_host_bar(groups, n_groups, hv, sms));
}

// The fine candidate set's price: its 4x boundaries grew the pre-phase by 5-8 us (~2
// chunk-steps: the certificate's and plan's loops), and over the benchmark's CP cells the model's
// gain from it had a spread of several percent (rows it priced 1-6% cheaper measured up to 14%
// slower; those priced >= 9% cheaper gained 3-20%, step 32b). So the fine set (its host price
// `fine`) must beat the coarse one (`coarse`) by kCpFineMinGain with that cost added.
constexpr double kCpFineGrainSteps = 2.0;
constexpr double kCpFineMinGain = 0.93;
inline bool cp_fine_pays(double fine, double coarse) {
  if (fine < 0.0) return false;
  return coarse < 0.0 ||
         fine + kCpPipelineSteps + kCpFineGrainSteps < kCpFineMinGain * (coarse + kCpPipelineSteps);
}
inline bool cp_fine_pays(const CpSeqGroup* groups, int64_t n_groups, double hv, int32_t min_chunks, int sms,
                         bool corrected) {
  return cp_fine_pays(cp_host_split_steps(groups, n_groups, hv, cp_candidates(min_chunks, true), sms, corrected),
                      cp_host_split_steps(groups, n_groups, hv, cp_candidates(min_chunks, false), sms, corrected));
}

// Whether an exact segment's outputs are corrected from its start state (o = o_local +
// S_start^T q~, fwd_context_parallel.h) instead of walked again: at the `fast` precision (o_local
// takes one more rounding to q's dtype), without checkpoints (the second pass writes the exact
// segments'), and where q~ for every token and head in q's 16-bit dtype (the heads that need it
// are known only on the device) is no larger than the segments' two fp32 state arrays for any
// call of this shortest segment length L_min: the few-head shapes, whose second pass is on the
// critical path. A sequence of C chunks has at most 64 C tokens, and the slots are C / L_min
// (dense) or a bound of twice that (varlen), so q~ <= the states when 16 L_min <= K (dense) or
// 8 L_min <= K (varlen). It depends on nothing else of the call, so that with a fixed segment
// length a sequence's bits stay independent of the other sequences packed with it (a rule from
// the pack's own sizes flipped with, e.g., the number of empty sequences beside it).
FGDN_HOST_DEVICE inline bool cp_corrects(int32_t min_chunks, int64_t d, bool varlen, bool high, bool checkpoints) {
  return !high && !checkpoints && static_cast<int64_t>(min_chunks) * (varlen ? 8 : 16) <= d;
}

// The shortest candidate: the smallest power of two, at least 4, above a quarter of the
// balanced load (chunk-steps per SM if every chain were spread evenly).
FGDN_HOST_DEVICE inline int32_t cp_min_chunks(int64_t balanced) {
  int64_t L = 4;
  while (2 * L <= balanced / 2) L *= 2;
  return static_cast<int32_t>(L);
}

}  // namespace flashgdn::sm90
