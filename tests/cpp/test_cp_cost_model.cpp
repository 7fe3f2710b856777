// The context-parallel plan's cost model (csrc/sm90/cp_cost_model.h) on the host: the segment
// length it picks for shapes whose GPU timings are in bench/NOTES.md ("Context parallelism,
// step 4"), and the cases where it must not split. The statistics are built here the way the
// plan kernel sums them (fwd_context_parallel.cu), from sequence lengths and one certificate per
// head (a warm-up of W chunks at every boundary, or the exact path).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "sm90/cp_cost_model.h"

namespace {

using flashgdn::sm90::CpCandidateStats;
using namespace flashgdn::sm90;

constexpr int kH100Sms = 132;
constexpr int32_t kExact = -1;

struct Shape {
  std::vector<int64_t> tokens;  // per sequence
  std::vector<int32_t> warm;    // per value head: W chunks, or kExact
};

struct Choice {
  int32_t min_chunks, chunks;
  bool fine;
  double cost, unsplit;
};

// The sequences as the host groups them (cp_layout: one group a sequence).
std::vector<CpSeqGroup> groups_of(const std::vector<int64_t>& tokens) {
  std::vector<CpSeqGroup> groups;
  for (int64_t t : tokens) groups.push_back({(t + 63) / 64, 1});
  return groups;
}

Choice plan(const Shape& s, bool corrected = false, int sms = kH100Sms) {
  const int64_t hv = static_cast<int64_t>(s.warm.size());
  int64_t sum_c = 0, max_c = 0;
  std::vector<int64_t> c;
  for (int64_t t : s.tokens) {
    c.push_back((t + 63) / 64);
    sum_c += c.back();
    max_c = std::max(max_c, c.back());
  }
  Choice r{};
  r.min_chunks = cp_min_chunks((hv * sum_c + sms - 1) / sms);
  const std::vector<CpSeqGroup> groups = groups_of(s.tokens);
  r.fine = cp_fine_pays(groups.data(), static_cast<int64_t>(groups.size()), static_cast<double>(hv), r.min_chunks,
                        sms, corrected);
  const CpCandidates cand = cp_candidates(r.min_chunks, r.fine);
  CpCandidateStats st[kCpMaxCandidates] = {};
  for (int i = 0; i < cand.count; ++i) {
    const int64_t L = cand.chunks(i);
    for (int64_t cn : c) {
      st[i].items += cn > L ? (cn + L - 1) / L : 1;
      if (cn <= L) st[i].movable += static_cast<unsigned long long>(hv);  // unsplit
      // Segments of L chunks, and a last one or an unsplit sequence of more than L / 2.
      const int64_t whole = cn > L ? cn / L : 0, last = cn > L ? cn % L : cn;
      st[i].long_ctas += static_cast<unsigned long long>(hv * (whole + (2 * last > L ? 1 : 0)));
      for (int64_t start = L; start < cn; start += L)  // the segments after the first
        for (int32_t w : s.warm) {
          if (w == kExact) {
            st[i].exact += 1;
            st[i].exact_chunks += static_cast<unsigned long long>(std::min(L, cn - start));
          } else {
            st[i].warm_chunks += static_cast<unsigned long long>(w);
            st[i].warm_max = std::max<unsigned long long>(st[i].warm_max, w);
            if (start + L < cn) st[i].movable += 1;  // a middle segment (the same certificate follows)
          }
        }
    }
  }
  const double n = static_cast<double>(c.size());
  r.chunks = cp_choose_chunks(st, cand, double(sum_c), double(max_c), n, double(hv), sms, corrected);
  r.unsplit = cp_unsplit_steps(double(sum_c), double(max_c), n, double(hv), sms);
  int chosen = 0;
  while (chosen + 1 < cand.count && cand.chunks(chosen) != r.chunks) ++chosen;
  r.cost = r.chunks == kCpNoSplit ? r.unsplit
                                  : cp_steps(st[chosen], double(sum_c), double(max_c), double(r.chunks), double(hv), sms,
                                             corrected);
  return r;
}

// The benchmark's gates (bench/gdnbench/inputs.py, examples/run.cpp): head 0 never decays and
// takes the exact path; every other head certifies within one chunk.
std::vector<int32_t> bench_gates(int hv) {
  std::vector<int32_t> w(static_cast<size_t>(hv), 1);
  w[0] = kExact;
  return w;
}

TEST(CpCostModel, SplitsTheFewChainRowsAsMeasured) {
  // 16/64 1x32768: L_min = 64 (a quarter of 249 balanced steps is 62); 8 segments of 64; 255
  // middle warm-up CTAs move to phase 2, beside head 0's second pass: 273 of 514 steps (275
  // with the scan step priced at 0.75 chunk-steps, before step 16).
  // (Step 4, before the move: 2.56 ms unsplit -> 1.80 ms, 0.70; model then 0.66. Step 5b,
  // with the move counted to the CTA: 2.42 -> 1.40 ms, 0.58.)
  Choice r = plan({{32768}, bench_gates(64)});
  EXPECT_EQ(r.min_chunks, 64);
  EXPECT_EQ(r.chunks, 64);
  EXPECT_NEAR(r.cost / r.unsplit, 0.531, 0.005);
  // 2/8 1x32768: L_min = 16. With L = 16 (32 segments) phase 2 needed 1.4 waves, so 2 (the
  // model 0.142; step 4: 2.50 -> 0.531 ms, 0.21; step 5b: 2.37 -> 0.424 ms, 0.18); L = 20 (26
  // segments, a candidate since step 32) fills one wave in each phase: 0.115, to be measured
  // (bench/NOTES.md, "Candidate segment lengths").
  r = plan({{32768}, bench_gates(8)});
  EXPECT_EQ(r.min_chunks, 16);
  EXPECT_EQ(r.chunks, 20);
  EXPECT_NEAR(r.cost / r.unsplit, 0.115, 0.005);
  // 8/32 1x32768: L_min = 32; with L = 32, 542 CTAs needed 5 waves with or without the move
  // (model 0.357; step 4: 2.56 -> 1.01 ms, 0.40); L = 48 (step 32): 0.310, to be measured.
  r = plan({{32768}, bench_gates(32)});
  EXPECT_EQ(r.chunks, 48);
  EXPECT_NEAR(r.cost / r.unsplit, 0.310, 0.005);
}

// The host's test before any pipeline launch (cp_pipeline_pays), with L_min and the correction
// of exact segments (cp_corrects, K = V = 128, `fast`) as cp_layout takes them: from the
// balanced load over the chunk slots (varlen: a bound, ceil(T / 64) + N).
struct HostChoice {
  bool runs, corrected, fine;
};
HostChoice pipeline_pays(const std::vector<int64_t>& tokens, int64_t hv, bool varlen) {
  const std::vector<CpSeqGroup> groups = groups_of(tokens);
  int64_t total = 0, slots = 0, longest = 0;
  for (int64_t t : tokens) {
    total += t;
    slots += (t + 63) / 64;
    longest = std::max(longest, t);
  }
  if (varlen) slots = (total + 63) / 64 + static_cast<int64_t>(tokens.size());
  const int32_t min_chunks = cp_min_chunks((hv * slots + kH100Sms - 1) / kH100Sms);
  const int64_t C = (longest + 63) / 64;
  const bool splits = varlen || C > min_chunks;  // dense: max_slots > 0
  const bool corrected = splits && cp_corrects(min_chunks, 128, varlen, false, false);
  const auto n = static_cast<int64_t>(groups.size());
  const bool fine = cp_fine_pays(groups.data(), n, static_cast<double>(hv), min_chunks, kH100Sms, corrected);
  return {cp_pipeline_pays(groups.data(), n, static_cast<double>(hv), cp_candidates(min_chunks, fine), kH100Sms,
                           corrected),
          corrected, fine};
}

TEST(CpCostModel, TheHostSkipsThePipelineWhereNoSplitCanPay) {
  struct Case {
    const char* cell;  // Hq/Hv and layout, with its measured time (CP auto / off)
    std::vector<int64_t> tokens;
    int64_t hv;
    bool varlen, runs;
  };
  std::vector<int64_t> mix(32, 512);  // one long sequence among short ones: its chain is the call
  mix.push_back(16384);
  const std::vector<Case> cases = {
      // The pipeline ran and lost (bench/NOTES.md step 17, ms):
      {"16/64 1x2048 (0.163 / 0.122)", {2048}, 64, false, false},
      {"2/8 B8x2048 (0.155 / 0.122)", std::vector<int64_t>(8, 2048), 8, false, false},
      {"2/6 B8x2048 (0.156 / 0.120)", std::vector<int64_t>(8, 2048), 6, false, false},
      {"8/32 4x8192 varlen (0.528 / 0.450)", std::vector<int64_t>(4, 8192), 32, true, false},
      {"4/16 8x4096 varlen (0.296 / 0.239)", std::vector<int64_t>(8, 4096), 16, true, false},
      // ... and, priced with one exact head (step 24), where it ran and lost with head 0 not
      // decaying (graph replays, us, at 97f1599 or 0da658b; 2/8 8x4096 in ms at step 17):
      {"16/64 1x4096 (254 / 225)", {4096}, 64, false, false},
      {"8/24 8x4096 varlen (518 / 466)", std::vector<int64_t>(8, 4096), 24, true, false},
      {"16/48 4x8192 varlen (951 / 905)", std::vector<int64_t>(4, 8192), 48, true, false},
      // It won (step 17, ms):
      {"16/64 1x32768 (1.040 / 1.746)", {32768}, 64, false, true},
      {"16/64 1x8192 (0.379 / 0.442)", {8192}, 64, false, true},
      {"8/32 1x4096 (0.187 / 0.229)", {4096}, 32, false, true},
      {"2/8 1x2048 (0.079 / 0.115)", {2048}, 8, false, true},
      {"4/16 2x16384 varlen (0.464 / 0.877)", {16384, 16384}, 16, true, true},
      {"2/8 mix of 1x16384 and 32x512", mix, 8, true, true},
      // Where the exact segments are corrected (step 27), not walked again, it runs and wins
      // where it lost before (benchmark medians, us: auto at d2d6763 / CP off in the all-peer
      // run at 8166fd8; walked again, it was 125 / 117 and 115 / 117):
      {"16/32 1x2048, corrected (102 / 119)", {2048}, 32, false, true},
      {"8/32 1x2048, corrected (100 / 116)", {2048}, 32, false, true},
      // Lost at the power-of-two candidates (138 / 118 us and 0.273 / 0.230 ms, walked again);
      // with the lengths between them and the correction priced at one chunk-step, the model
      // ran 4/4 B8x2048, and it lost again (step 32, graph replays: 126.6 / 116.2 us): the scan
      // and the correction took ~24 and ~15 us. Priced as measured (kCpScanFixedSteps,
      // kCpCorrectUnitSteps), neither runs.
      {"4/4 B8x2048 (126.6 / 116.2 at step 32)", std::vector<int64_t>(8, 2048), 4, false, false},
      {"2/8 8x4096 varlen (0.273 / 0.230 at L = 16)", std::vector<int64_t>(8, 4096), 8, true, false},
  };
  for (const Case& c : cases) {
    const HostChoice h = pipeline_pays(c.tokens, c.hv, c.varlen);
    EXPECT_EQ(h.runs, c.runs) << c.cell << (h.corrected ? " (corrected)" : "");
  }
}

TEST(CpCostModel, LongCtasRunInWholeWaves) {
  // Two CTAs longer than half a wave never share an SM's wave: 135 of them on 132 SMs take two
  // waves however little work they hold together; the work still bounds it from below.
  EXPECT_EQ(cp_long_waves(915.0, 7.0, 135.0, 132), 14.0);
  EXPECT_EQ(cp_long_waves(915.0, 7.0, 132.0, 132), 7.0);
  EXPECT_EQ(cp_long_waves(2000.0, 7.0, 10.0, 132), 21.0);
  EXPECT_EQ(cp_long_waves(915.0, 7.0, 0.0, 132), 7.0);  // none long: the work's waves
  EXPECT_EQ(cp_long_items(32u, 4u), 8u);  // eight segments of 4
  EXPECT_EQ(cp_long_items(32u, 5u), 6u);  // six of 5; the last, of 2, is short
  EXPECT_EQ(cp_long_items(33u, 5u), 7u);  // the last, of 3, is long
  EXPECT_EQ(cp_long_items(3u, 4u), 1u);   // unsplit, more than half a segment
  EXPECT_EQ(cp_long_items(2u, 4u), 0u);
  // 8/16 1x2048 (corrected, the benchmark's gates): at L = 4, 8 segments x 16 heads + 7 M walks
  // = 135 CTAs ran phase 1 in two rounds; fixed lengths measured (us, H100, step 33): L 4 88.8,
  // L 5 69.6, L 6 71.2, L 8 72.5. The coarse set's best is L = 8 (the fine set's L = 5 does not
  // pay for its boundaries: cp_fine_pays).
  const Choice r = plan({{2048}, bench_gates(16)}, /*corrected=*/true);
  EXPECT_FALSE(r.fine);
  EXPECT_EQ(r.chunks, 8);
  // Where the exact segments are walked again the count does not apply (pass 4 decides which
  // CTAs run in which phase): the same shape uncorrected keeps the work's price.
  const Choice walked = plan({{2048}, bench_gates(16)}, /*corrected=*/false);
  EXPECT_EQ(walked.chunks, 4);
}

TEST(CpCostModel, AllExactHeadsDoNotPayForASplitTheyCannotUse) {
  // Every head exact (no in-kernel l2norm, or no decay): at 16/64 1x32768 each segment costs
  // an M walk and a second pass, and 64 chains already fill half the SMs.
  const Choice r = plan({{32768}, std::vector<int32_t>(64, kExact)});
  EXPECT_EQ(r.chunks, kCpNoSplit);
  EXPECT_EQ(r.cost, r.unsplit);
}

TEST(CpCostModel, ManyChainsStayWhole) {
  // 16/64 4x8192 fills the SMs twice over without splitting.
  const Choice r = plan({{8192, 8192, 8192, 8192}, bench_gates(64)});
  EXPECT_EQ(r.chunks, kCpNoSplit);
}

TEST(CpCostModel, OneLongSequenceAmongShortOnesSplits) {
  // A varlen pack of one 16384-token sequence and 40 of 400 tokens at 2/8: only the long one
  // can split, and it must, or its chain is the whole call.
  Shape s{{16384}, bench_gates(8)};
  s.tokens.insert(s.tokens.end(), 40, 400);
  const Choice r = plan(s);
  EXPECT_NE(r.chunks, kCpNoSplit);
  EXPECT_LT(r.cost, 0.5 * r.unsplit);
}

TEST(CpCostModel, PhaseTwoTakesMovableCtasOnlyBesideExactWork) {
  // Phase 1 keeps what it must and fills its last wave; the rest of the movable CTAs go.
  EXPECT_EQ(cp_deferred(519, 378, 7, 132), 255u);
  EXPECT_EQ(cp_deferred(519, 378, 0, 132), 0u);  // no second pass: nothing to run beside
  EXPECT_EQ(cp_deferred(300, 10, 7, 132), 0u);   // fewer movable CTAs than phase 1's last wave
}

TEST(CpCostModel, ExactSegmentsAreCorrectedForShortSegmentsOnly) {
  // From L_min, K and the layout alone (so that a sequence's bits do not depend on its pack).
  EXPECT_TRUE(cp_corrects(8, 128, false, false, false));    // dense: L_min <= K / 16
  EXPECT_FALSE(cp_corrects(16, 128, false, false, false));
  EXPECT_TRUE(cp_corrects(16, 128, true, false, false));    // varlen: L_min <= K / 8
  EXPECT_FALSE(cp_corrects(32, 128, true, false, false));
  EXPECT_TRUE(cp_corrects(4, 64, false, false, false));
  EXPECT_FALSE(cp_corrects(8, 64, false, false, false));
  EXPECT_FALSE(cp_corrects(4, 128, false, true, false));    // `high` walks again
  EXPECT_FALSE(cp_corrects(4, 128, false, false, true));    // so do checkpoints
}

TEST(CpCostModel, CorrectedQTildeNeverExceedsTheStateArrays) {
  // q~ (tokens Hv K 2 bytes) against the two state arrays (2 max_slots Hv K K 4 bytes, max_slots as
  // cp_layout bounds it) over dense batches and varlen packs, including many empty sequences.
  for (int64_t K : {64, 128})
    for (int32_t L : {4, 8, 16, 32, 64})
      for (bool varlen : {false, true})
        for (int64_t n : {1, 2, 7, 33, 300})
          for (int64_t len : {0, 1, 63, 64, 65, 1000, 4096, 20000}) {
            if (!varlen && len == 0) continue;
            const int64_t tokens = n * len, C = (len + 63) / 64;
            const int64_t sum_c = varlen ? (tokens + 63) / 64 + n : n * C;
            const int64_t max_slots = varlen ? 2 * ((sum_c + L - 1) / L) : (C > L ? n * ((C + L - 1) / L) : 0);
            if (max_slots == 0 || !cp_corrects(L, K, varlen, false, false)) continue;
            EXPECT_LE(tokens * K * 2, 2 * max_slots * K * K * 4)
                << "K " << K << " L " << L << (varlen ? " varlen " : " dense ") << n << " x " << len;
          }
}

TEST(CpCostModel, MinChunksIsAPowerOfTwoAboveAQuarterOfTheBalancedLoad) {
  EXPECT_EQ(cp_min_chunks(0), 4);
  EXPECT_EQ(cp_min_chunks(31), 8);
  EXPECT_EQ(cp_min_chunks(32), 16);
  EXPECT_EQ(cp_min_chunks(249), 64);
  EXPECT_EQ(cp_min_chunks(256), 128);
}

}  // namespace

TEST(CpCostModel, CandidatesAreWholeGrainsFromLMinUp) {
  // Fine: L = L_min q / 4 over boundaries every grain = L_min / 4 chunks; coarse: L = L_min 2^i
  // over boundaries every L_min. Segments start from L_min on, so every candidate's segment
  // starts (multiples of L) are boundaries.
  for (bool fine : {true, false})
    for (int32_t lmin : {4, 8, 16, 64, 1024}) {
      const CpCandidates cand = cp_candidates(lmin, fine);
      EXPECT_EQ(cand.count, fine ? 8 : 6);
      EXPECT_LE(cand.count, kCpMaxCandidates);
      EXPECT_EQ((fine ? 4 : 1) * cand.grain(), lmin);
      int64_t prev = 0;
      for (int i = 0; i < cand.count; ++i) {
        const int64_t L = cand.chunks(i);
        EXPECT_EQ(L, static_cast<int64_t>(cand.grain()) * cand.grains(i)) << lmin << " " << i;
        EXPECT_GT(L, prev) << lmin << " " << i;  // increasing: the first of equal costs is the shortest
        prev = L;
      }
      EXPECT_EQ(cand.chunks(0), lmin);
      EXPECT_EQ(cand.chunks(cand.count - 1), (fine ? 8 : 32) * static_cast<int64_t>(lmin));
    }
  // A fixed segment length: one candidate of any length, a boundary every L.
  const CpCandidates fixed = cp_fixed_length(3);
  EXPECT_EQ(fixed.count, 1);
  EXPECT_EQ(fixed.grain(), 3);
  EXPECT_EQ(fixed.chunks(0), 3);
}

TEST(CpCostModel, TheFineSetOnlyWhereItPaysForItsBoundaries) {
  // Step 32b (bench/NOTES.md; the all-flashgdn matrix against main, H100): the fine set gained
  // 13-20% where the model priced it >= 9% under the coarse one, and lost 4-10% (its larger
  // pre-phase) where the model's pick was a power of two anyway.
  struct Case {
    const char* cell;
    std::vector<int64_t> tokens;
    int64_t hv;
    bool varlen, fine;
  };
  const std::vector<Case> cases = {
      {"2/8 1x32768 (L 16 -> 20: 296 -> 257 us)", {32768}, 8, false, true},
      {"8/16 1x16384 (L 16 -> 20: 273 -> 232 us)", {16384}, 16, false, true},
      {"2/8 2x16384 varlen (L 16 -> 40: 303 -> 241 us)", {16384, 16384}, 8, true, true},
      {"8/32 1x32768 (L 32 -> 48: 8.7% faster)", {32768}, 32, false, true},
      {"8/16 1x2048 (L 4 both: 94 -> 101 us)", {2048}, 16, false, false},
      {"16/64 1x32768 (L 64 both)", {32768}, 64, false, false},
      {"16/32 1x4096 (L 16 both: 125 -> 133 us)", {4096}, 32, false, false},
      {"4/4 B2x8192 (priced 9.5% under: 0.9% slower)", {8192, 8192}, 4, false, false},
  };
  for (const Case& c : cases) EXPECT_EQ(pipeline_pays(c.tokens, c.hv, c.varlen).fine, c.fine) << c.cell;
}
