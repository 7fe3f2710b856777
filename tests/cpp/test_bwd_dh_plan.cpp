// The backward's reverse context-parallel plan (csrc/cuda/bwd_dh_plan.h) on the host: when the
// dh pass splits its chains, into how many segments, and the properties the launches rely on
// (every chunk of the longest sequence covered; an automatic split fits one wave of the SMs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/bwd_dh_plan.h"

namespace {

using flashgdn::Problem;
using flashgdn::cuda::bwd::dh_plan;
using flashgdn::cuda::bwd::DhPlan;
using flashgdn::cuda::bwd::block_plan;
using flashgdn::cuda::bwd::BlockPlan;
using flashgdn::cuda::bwd::kBlockBytes;
using flashgdn::cuda::bwd::kFusedThreeSegmentMinChunks;

constexpr int kH100Sms = 132;

Problem shape(int64_t N, int64_t T, int64_t Hv, int32_t mode = FGDN_CONTEXT_PARALLEL_AUTO, int64_t cp_segment = 0,
              int64_t K = 128) {
  Problem p;
  p.K = p.V = K;
  p.N = N;
  p.T = T;
  p.Hv = Hv;
  p.context_parallel = mode;
  p.cp_segment = cp_segment;
  return p;
}

TEST(BwdDhPlan, OffOrNoSequencesNeverSplits) {
  EXPECT_EQ(dh_plan(shape(1, 32768, 8, FGDN_CONTEXT_PARALLEL_OFF), kH100Sms).segments, 1);
  EXPECT_EQ(dh_plan(shape(1, 32768, 8, FGDN_CONTEXT_PARALLEL_OFF, 1024), kH100Sms).segments, 1);
  EXPECT_EQ(dh_plan(shape(0, 0, 8), kH100Sms).segments, 1);
}

TEST(BwdDhPlan, AutomaticRowsOfTheBenchmark) {
  // 16/64, one 32768-token sequence: 64 chains cannot take four segments each in one wave.
  EXPECT_EQ(dh_plan(shape(1, 32768, 64), kH100Sms).segments, 1);
  // 2/8: 8 chains, 16 segments each (132 / 8) of 32 chunks: one wave of 128 CTAs.
  const DhPlan d = dh_plan(shape(1, 32768, 8), kH100Sms);
  EXPECT_EQ(d.chunks, 32);
  EXPECT_EQ(d.segments, 16);
  // 33 chains on 132 SMs: exactly four segments each.
  EXPECT_EQ(dh_plan(shape(1, 32768, 33), kH100Sms).segments, 4);
  EXPECT_EQ(dh_plan(shape(1, 32768, 34), kH100Sms).segments, 1);
}

TEST(BwdDhPlan, ShortSequencesKeepTheSegmentFloor) {
  // 2048 tokens = 32 chunks: segments of at least 16 chunks, so two.
  const DhPlan d = dh_plan(shape(1, 2048, 8), kH100Sms);
  EXPECT_EQ(d.chunks, 16);
  EXPECT_EQ(d.segments, 2);
  // Up to 16 chunks: nothing to split.
  EXPECT_EQ(dh_plan(shape(1, 1024, 8), kH100Sms).segments, 1);
}

TEST(BwdDhPlan, FixedSegmentIgnoresTheDevice) {
  // cp_segment in tokens; the same plan on any GPU and beside any number of chains.
  for (int sms : {1, 78, 132, 1000}) {
    const DhPlan d = dh_plan(shape(4, 3000, 64, FGDN_CONTEXT_PARALLEL_AUTO, 1024), sms);
    EXPECT_EQ(d.chunks, 16);
    EXPECT_EQ(d.segments, 3);  // 47 chunks
  }
  EXPECT_EQ(dh_plan(shape(1, 32768, 8, FGDN_CONTEXT_PARALLEL_ON, 64 * 100), kH100Sms).chunks, 100);
  EXPECT_EQ(dh_plan(shape(1, 32768, 8, FGDN_CONTEXT_PARALLEL_ON, 256), kH100Sms).chunks, 16);  // floor
}

TEST(BwdDhPlan, ForcedSplitsBeyondOneWave) {
  // context_parallel=True without a length: split even where the chains fill the SMs.
  const DhPlan d = dh_plan(shape(1, 32768, 64, FGDN_CONTEXT_PARALLEL_ON), kH100Sms);
  EXPECT_EQ(d.chunks, 128);  // 512 chunks / max(4, 132 / 64)
  EXPECT_EQ(d.segments, 4);
}

TEST(BwdDhPlan, HalvesWhereTheChainsFillHalfTheSms) {
  // 16/64, one sequence: no segments, but 64 chains x 2 halves = 128 CTAs on 132 SMs.
  DhPlan d = dh_plan(shape(1, 32768, 64), kH100Sms);
  EXPECT_EQ(d.segments, 1);
  EXPECT_EQ(d.halves, 2);
  EXPECT_EQ(dh_plan(shape(1, 32768, 64, FGDN_CONTEXT_PARALLEL_AUTO, 0, 64), kH100Sms).halves, 1);  // D = 64
  EXPECT_EQ(dh_plan(shape(1, 32768, 67), kH100Sms).halves, 1);                                    // 134 CTAs
  EXPECT_EQ(dh_plan(shape(1, 32768, 8), kH100Sms).halves, 1);  // segments instead
  d = dh_plan(shape(1, 32768, 8, FGDN_CONTEXT_PARALLEL_OFF), kH100Sms);  // the same bits: CP off too
  EXPECT_EQ(d.segments, 1);
  EXPECT_EQ(d.halves, 2);
}

TEST(BwdDhPlan, RandomShapesCoverEveryChunkInOneWave) {
  std::mt19937_64 rng(20261128);
  for (int i = 0; i < 20000; ++i) {
    const int64_t N = 1 + static_cast<int64_t>(rng() % 16), Hv = 1 + static_cast<int64_t>(rng() % 64);
    const int64_t T = 1 + static_cast<int64_t>(rng() % (1 << 20));
    const int sms = 1 + static_cast<int>(rng() % 200);
    const DhPlan d = dh_plan(shape(N, T, Hv), sms);
    const int64_t chunks = (T + 63) / 64;
    if (d.halves != 1) {
      ASSERT_EQ(d.halves, 2);
      ASSERT_EQ(d.segments, 1);
      ASSERT_LE(2 * N * Hv, sms);
    }
    if (d.segments == 1) {
      ASSERT_TRUE(d.chunks == 0 || d.chunks >= chunks) << "N " << N << " T " << T << " Hv " << Hv << " sms " << sms;
      continue;
    }
    ASSERT_GE(d.chunks, 16);
    ASSERT_GE(d.chunks * d.segments, chunks);                 // every chunk in a segment
    ASSERT_LT(d.chunks * (d.segments - 1), chunks);          // no empty segment
    ASSERT_LE(N * Hv * d.segments, sms);                      // one wave
    ASSERT_GE(d.segments, std::min<int64_t>(4, (chunks + 15) / 16));  // four, unless too short
  }
}

// The fused backward's plan (sm90/bwd_fused.cu): each of its two launches walks S - 1 segments a
// chain (phase 1 the last segment and the B_s of segments 1 .. S - 2, with the A_s walks not
// certified away; phase 0 segments 0 .. S - 2), so S - 1 walks a chain fill 7/8 of one wave, or,
// where that leaves one, two fill at most the wave (three segments); the last segment shorter.
TEST(BwdDhPlan, FusedWalksFillOneWave) {
  using flashgdn::cuda::bwd::dh_plan_segments;
  EXPECT_EQ(dh_plan_segments(shape(1, 32768, 8), kH100Sms, true).segments, 15);   // 2/8: 112 walks a launch
  EXPECT_EQ(dh_plan_segments(shape(1, 32768, 32), kH100Sms, true).segments, 4);   // 8/32: 96
  EXPECT_EQ(dh_plan_segments(shape(1, 32768, 64), kH100Sms, true).segments, 3);   // 16/64: 128
  // Segments of L chunks and a last one of ~0.4 L (the transfers' carry-only walks, r = 2/5):
  // 512 = 2 L + 84 at 16/64, 14 x 36 + 8 at 2/8.
  EXPECT_EQ(dh_plan_segments(shape(1, 32768, 64), kH100Sms, true).chunks, 214);
  EXPECT_EQ(dh_plan_segments(shape(1, 32768, 8), kH100Sms, true).chunks, 36);
  EXPECT_EQ(dh_plan_segments(shape(1, 32768, 67), kH100Sms, true).segments, 1);   // 134 > 132: unsplit
  // 2/4, four 2048-token sequences (16 chains, 32 chunks each): seven segments of 5 chunks
  EXPECT_EQ(dh_plan_segments(shape(4, 2048, 4), kH100Sms, true).chunks, 5);
  EXPECT_EQ(dh_plan_segments(shape(4, 2048, 4), kH100Sms, true).segments, 7);
  EXPECT_EQ(dh_plan_segments(shape(4, 8192, 64), kH100Sms, true).segments, 1);    // 256 chains
  // 2/8, 64 chains: three segments only from kFusedThreeSegmentMinChunks chunks (8 x 1024 tokens:
  // 16 chunks, unsplit; 8 x 4096: 64, three segments; 8 x 3008: 47, unsplit).
  EXPECT_EQ(dh_plan_segments(shape(8, 1024, 8), kH100Sms, true).segments, 1);
  EXPECT_EQ(dh_plan_segments(shape(8, 4096, 8), kH100Sms, true).segments, 3);
  EXPECT_EQ(dh_plan_segments(shape(8, 3008, 8), kH100Sms, true).segments, 1);
  EXPECT_EQ(dh_plan_segments(shape(8, 3072, 8), kH100Sms, true).segments, 3);
  // Forced on, the floor does not apply.
  EXPECT_EQ(dh_plan_segments(shape(8, 1024, 8, FGDN_CONTEXT_PARALLEL_ON), kH100Sms, true).segments, 4);
  std::mt19937_64 rng(20261129);
  for (int i = 0; i < 20000; ++i) {
    const int64_t N = 1 + static_cast<int64_t>(rng() % 16), Hv = 1 + static_cast<int64_t>(rng() % 64);
    const int64_t T = 1 + static_cast<int64_t>(rng() % (1 << 20));
    const int sms = 1 + static_cast<int>(rng() % 200);
    const DhPlan d = dh_plan_segments(shape(N, T, Hv), sms, true);
    const int64_t chunks = (T + 63) / 64;
    if (d.segments == 1) {  // unsplit: too many chains, or too few chunks for three segments of 4,
                            // or for the three-segment split's floor
      const bool three = (sms - sms / 8) / (N * Hv) < 2;
      ASSERT_TRUE(2 * N * Hv > sms || chunks <= 8 || (three && chunks < kFusedThreeSegmentMinChunks))
          << "N " << N << " T " << T << " Hv " << Hv << " sms " << sms;
      continue;
    }
    if ((sms - sms / 8) / (N * Hv) < 2) {
      ASSERT_GE(chunks, kFusedThreeSegmentMinChunks);
    }
    ASSERT_GE(d.chunks, 4);
    ASSERT_GE(d.chunks * d.segments, chunks);
    ASSERT_LT(d.chunks * (d.segments - 1), chunks);
    const int64_t walks = N * Hv * (d.segments - 1);
    ASSERT_LE(walks, d.segments > 3 ? sms - sms / 8 : sms) << "N " << N << " T " << T << " Hv " << Hv << " sms " << sms;
  }
}

// Packed sequences are cut each by its own length (bwd_dh_plan.h's FusedCut, which the kernels
// read): the grid takes the most segments any sequence takes where the call has the lengths, k + 1
// where it has not (a workspace query; a call a CUDA graph captures, whose replay may bring other
// lengths of the same total), and the workspace's capacity covers every plan of the shapes.
TEST(BwdDhPlan, FusedPackedSequencesCutEachByItsLength) {
  using flashgdn::cuda::bwd::dh_plan_segments;
  using flashgdn::cuda::bwd::fused_segments_capacity;
  auto packed = [](std::vector<int64_t> lens, int64_t Hv, bool have) {
    Problem p = shape(static_cast<int64_t>(lens.size()), 0, Hv);
    p.varlen = true;
    p.B = 1;
    p.cu = {0};
    for (int64_t n : lens) p.cu.push_back(p.cu.back() + n);
    p.T = p.cu.back();
    p.have_host_seqlens = have;
    return p;
  };
  // 2/4, four 8192-token sequences: 16 chains, seven walks a chain; each sequence (128 chunks)
  // into eight segments of 18, with the lengths or without.
  const Problem with = packed({8192, 8192, 8192, 8192}, 4, true), without = packed({8192, 8192, 8192, 8192}, 4, false);
  EXPECT_EQ(dh_plan_segments(with, kH100Sms, true).chunks, 18);
  EXPECT_EQ(dh_plan_segments(with, kH100Sms, true).segments, 8);
  EXPECT_EQ(dh_plan_segments(without, kH100Sms, true).cut.chunks(128), 18);
  EXPECT_EQ(dh_plan_segments(without, kH100Sms, true).segments, 8);
  EXPECT_EQ(fused_segments_capacity(with, kH100Sms), 8);
  // 2/8, four 2048-token sequences captured: each sequence into four segments of 10 chunks, as
  // eagerly (cut by the packed total, 128 chunks, each took one segment of 38).
  Problem eager = packed({2048, 2048, 2048, 2048}, 8, true), captured = eager;
  captured.capturing = true;
  EXPECT_EQ(dh_plan_segments(eager, kH100Sms, true).cut.chunks(32), 10);
  EXPECT_EQ(dh_plan_segments(captured, kH100Sms, true).cut.chunks(32), 10);
  EXPECT_EQ(dh_plan_segments(eager, kH100Sms, true).segments, 4);
  EXPECT_EQ(dh_plan_segments(captured, kH100Sms, true).segments, 4);  // k + 1 = 4
  std::mt19937_64 rng(20261130);
  for (int i = 0; i < 20000; ++i) {
    const int64_t N = 1 + static_cast<int64_t>(rng() % 12), Hv = 1 + static_cast<int64_t>(rng() % 64);
    const int sms = 1 + static_cast<int>(rng() % 200);
    std::vector<int64_t> lens;
    for (int64_t n = 0; n < N; ++n) lens.push_back(static_cast<int64_t>(rng() % (1 << 17)));
    Problem p = packed(lens, Hv, true);
    const int mode = static_cast<int>(rng() % 3);
    p.context_parallel = mode == 0 ? FGDN_CONTEXT_PARALLEL_AUTO : mode == 1 ? FGDN_CONTEXT_PARALLEL_ON : FGDN_CONTEXT_PARALLEL_OFF;
    p.cp_segment = rng() % 4 == 0 ? 64 * static_cast<int64_t>(1 + rng() % 64) : 0;
    const DhPlan d = dh_plan_segments(p, sms, true);
    ASSERT_LE(d.segments, fused_segments_capacity(p, sms)) << "N " << N << " Hv " << Hv << " sms " << sms;
    Problem q = p;
    q.have_host_seqlens = false;
    ASSERT_EQ(fused_segments_capacity(q, sms), fused_segments_capacity(p, sms));  // the query's size
    // Every sequence's segments inside the grid, each at least one chunk but the last, which ends it.
    for (int64_t n = 0; d.segments > 1 && n < N; ++n) {
      const int total = static_cast<int>((lens[n] + 63) / 64), len = d.cut.chunks(total);
      ASSERT_GE(len, 1);
      ASSERT_LE(d.cut.segments(total), d.segments) << "N " << N << " Hv " << Hv << " sms " << sms << " total " << total;
      ASSERT_GE(len * d.cut.segments(total), total);
    }
    // Captured: any sequence a replay may bring (up to the packed total) fits the plan's segments,
    // the workspace holds them, and where both split, the replay cuts each sequence as eagerly.
    Problem cap = p;
    cap.capturing = true;
    const DhPlan dc = dh_plan_segments(cap, sms, true);
    const int total = static_cast<int>((p.T + 63) / 64);
    for (int t = 0; dc.segments > 1 && t <= total; t += 1 + total / 97) {
      ASSERT_LE(dc.cut.segments(t), dc.segments) << "N " << N << " Hv " << Hv << " sms " << sms << " t " << t;
    }
    ASSERT_LE(dc.segments, fused_segments_capacity(p, sms));
    if (d.segments > 1 && dc.segments > 1 && p.cp_segment == 0) {
      ASSERT_EQ(d.cut.walks, dc.cut.walks);
      ASSERT_EQ(d.cut.floor, dc.cut.floor);
      ASSERT_EQ(d.cut.min_segments, dc.cut.min_segments);
    }
  }
}

// The fused reverse CP's matrices (bwd_fused_kernel.cuh, bwd_fused_scan.cu): every seed and
// transfer a chain's walks and scan use at a distinct index inside the chain's 3 S - 5 (chain
// c's from c fused_cp_per_chain(S)), none unused, for any segments S the plan takes.
TEST(BwdDhPlan, FusedCpMatricesDistinctAndInside) {
  using flashgdn::cuda::bwd::fused_cp_map;
  using flashgdn::cuda::bwd::fused_cp_per_chain;
  using flashgdn::cuda::bwd::fused_cp_seed;
  EXPECT_EQ(fused_cp_per_chain(1), 0);
  EXPECT_EQ(fused_cp_per_chain(2), 1);  // segment 0's seed alone
  for (int64_t S = 2; S <= 40; ++S) {
    const int64_t per = fused_cp_per_chain(S);
    for (int64_t chain = 0; chain < 3; ++chain) {
      std::vector<int> used(static_cast<size_t>(per), 0);
      const auto take = [&](int64_t i) {
        ASSERT_GE(i, chain * per) << "S " << S;
        ASSERT_LT(i, (chain + 1) * per) << "S " << S;
        ++used[static_cast<size_t>(i - chain * per)];
      };
      for (int s = 0; s <= S - 2; ++s) take(chain * per + fused_cp_seed(s));
      for (int s = 1; s <= S - 2; ++s)
        for (int which = 0; which < 2; ++which) take(chain * per + fused_cp_map(s, which));
      EXPECT_TRUE(std::all_of(used.begin(), used.end(), [](int u) { return u == 1; })) << "S " << S;
    }
  }
}

// The blocks of chunk slots (block_plan): one block below kBlockBytes of per-chunk workspace or
// four waves of the per-chunk grids, or where the reverse pass splits; else blocks of whole waves
// (the last one shorter) that cover every slot.
TEST(BwdBlockPlan, OneBlockWhenSmallOrSplit) {
  const size_t per_slot = 290 * 1024 * 64;  // D = 128, Hv = 64
  const BlockPlan small = block_plan(20, per_slot, 64, 132, false, 0);
  EXPECT_EQ(small.count, 1);
  EXPECT_EQ(small.slots, 20);
  const BlockPlan split = block_plan(512, per_slot, 64, 132, true, 0);
  EXPECT_EQ(split.count, 1);
  EXPECT_EQ(split.slots, 512);
  EXPECT_EQ(block_plan(512, per_slot, 64, 132, true, 3).count, 1);  // the hook too
  EXPECT_EQ(block_plan(0, per_slot, 64, 132, false, 3).count, 1);
}

TEST(BwdBlockPlan, SixteenBySixtyFourOneLongSequence) {
  // 17.7 MB a slot: 1 GiB is 60 slots; waves of 132 SMs are 33 slots of 64 heads, so 66: 512
  // slots in 8 blocks (the last of 50). On 128 SMs a wave is 2 slots: 60.
  const BlockPlan b = block_plan(512, 270 * 1024 * 64, 64, 132, false, 0);
  EXPECT_EQ(b.count, 8);
  EXPECT_EQ(b.slots, 66);
  EXPECT_EQ(block_plan(512, 270 * 1024 * 64, 64, 128, false, 0).slots, 60);
  const size_t per_slot = 290 * 1024 * 64;
  const BlockPlan f = block_plan(512, per_slot, 64, 132, false, 5);
  EXPECT_EQ(f.slots, 5);
  EXPECT_EQ(f.count, 103);
}

TEST(BwdBlockPlan, RandomSizesCoverEverySlot) {
  std::mt19937_64 rng(20261128);
  for (int i = 0; i < 20000; ++i) {
    const int64_t total = static_cast<int64_t>(rng() % 100000), Hv = 1 + static_cast<int64_t>(rng() % 64);
    const size_t per_slot = 1 + rng() % (size_t{64} << 20);
    const int sms = 1 + static_cast<int>(rng() % 200);
    const int64_t forced = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 50) : 0;
    const BlockPlan b = block_plan(total, per_slot, Hv, sms, false, forced);
    ASSERT_GE(b.count, 1);
    if (b.count == 1) {
      ASSERT_EQ(b.slots, total);
      continue;
    }
    ASSERT_GE(b.slots * b.count, total);        // every slot in a block
    ASSERT_LT(b.slots * (b.count - 1), total);  // no empty block
    if (forced > 0) {
      ASSERT_LE(b.slots, forced);
    } else {
      ASSERT_GE(b.slots * Hv, 4 * sms);
      const int64_t wave = sms / std::gcd(Hv, static_cast<int64_t>(sms));
      ASSERT_TRUE(b.slots % wave == 0 || b.slots < wave / 2) << b.slots << " slots, waves of " << wave;
      const int64_t by_bytes = static_cast<int64_t>(kBlockBytes / per_slot);
      ASSERT_LE(b.slots, std::max<int64_t>({by_bytes + wave, (4 * sms + Hv - 1) / Hv + wave, 1}));
    }
  }
}

}  // namespace
