// A diagnostic build's per-role timeline of the fused walk (CMake -DFLASHGDN_WALK_TIMELINE=ON;
// off in every other build, where stamp() is empty): CTA (0, 0, 0) of the walk's last launch (the
// walk proper: sequence 0, value head 0, its first segment) stamps clock64 three times a stage and
// role, for its first kChunks chunks: when the role reaches the stage's waits, when they are
// through, and when it ends the stage. The library prints the table once a process, after the
// third backward that walks (bwd_fused.cu), to stderr: per stage and role, the mean cycles
// waited and worked over chunks 2 .. kChunks - 1 (the first two fill the pipeline), and the chunk
// period. What the waits table (stage_wait) makes each role wait for, and so which role's work
// sets the chunk's pace: bench/fused-backward.md. Included by bwd_fused.cu alone (the device
// variable is defined here).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <algorithm>
#include <cstddef>
#include <cstdio>

namespace flashgdn::sm90::fused_bwd {

struct WalkTimeline {
  // The walk's roles (C, D, R) and stages: bwd_fused_kernel.cuh asserts they match its own.
  static constexpr int kRoles = 3, kStagesMax = 16, kChunks = 32;
  enum Point { kWaitBegin = 0, kWaitEnd = 1, kEnd = 2, kPoints = 3 };
  unsigned long long t[kRoles][kChunks][kStagesMax][kPoints];
  // Every CTA of the launch (up to kCtas, by linear block index): %globaltimer (ns) at its entry
  // and when each of its four warpgroups (C, D, R, the producer) leaves the walk. Where a launch's
  // time goes beyond its chunk steps: the CTAs' start skew, the first chunks, the tail.
  static constexpr int kCtas = 1024;
  unsigned long long cta[kCtas][5];
  unsigned long long entry;  // clock64 at CTA (0, 0, 0)'s entry, against t's stamps
  // CTA (0, 0, 0)'s walk start, clock64 (pre_stamp): 0 barriers initialised, 1 the CTA's
  // __syncthreads, 2 role C's registers raised, 3 its walk read (chain), 4 its carry loaded,
  // 5 the roles' rendezvous, 6 and 7 chunk 0's loads landed (full0, full1); 8 and 9 the producer
  // before and after issuing chunk 0's loads; 10 and 11 the gates warp's start and first load.
  static constexpr int kPre = 12;
  unsigned long long pre[kPre];
};

#if FLASHGDN_WALK_TIMELINE
__device__ WalkTimeline g_walk_timeline;
#endif

// Point `point` of stage s, chunk i, for role `role`: one thread of the role, in CTA (0, 0, 0).
__device__ __forceinline__ void stamp([[maybe_unused]] int role, [[maybe_unused]] int i, [[maybe_unused]] int s,
                                      [[maybe_unused]] int point) {
#if FLASHGDN_WALK_TIMELINE
  if (i < WalkTimeline::kChunks && (threadIdx.x & 127) == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    g_walk_timeline.t[role][i][s][point] = clock64();
#endif
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// Point 0 (entry, by thread 0) or 1 + warpgroup (that warpgroup leaving the walk, its thread 0)
// of this CTA.
__device__ __forceinline__ void stamp_cta([[maybe_unused]] int point) {
#if FLASHGDN_WALK_TIMELINE
  if ((threadIdx.x & 127) != 0 || (point == 0 && threadIdx.x != 0)) return;
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta < WalkTimeline::kCtas) g_walk_timeline.cta[cta][point] = global_ns();
  if (point == 0 && cta == 0) g_walk_timeline.entry = clock64();
#endif
}

// Point k of the walk's start in CTA (0, 0, 0), by the calling thread (one thread a point).
__device__ __forceinline__ void pre_stamp([[maybe_unused]] int k) {
#if FLASHGDN_WALK_TIMELINE
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && k < WalkTimeline::kPre) g_walk_timeline.pre[k] = clock64();
#endif
}

// Host: forget the CTAs' stamps of the launches before (call before each launch of the walk).
inline void clear_walk_timeline_ctas([[maybe_unused]] cudaStream_t stream) {
#if FLASHGDN_WALK_TIMELINE
  void* at = nullptr;
  if (cudaGetSymbolAddress(&at, g_walk_timeline) == cudaSuccess)
    (void)cudaMemsetAsync(static_cast<char*>(at) + offsetof(WalkTimeline, cta), 0, sizeof(WalkTimeline::cta), stream);
#endif
}

// Host: the table, after the third call that walks (the earlier ones warm the caches); nothing in
// a build without the timeline.
inline void report_walk_timeline([[maybe_unused]] cudaStream_t stream, [[maybe_unused]] int64_t chunks) {
#if FLASHGDN_WALK_TIMELINE
  static int calls = 0;
  if (++calls != 3) return;
  static WalkTimeline h;
  if (cudaStreamSynchronize(stream) != cudaSuccess ||
      cudaMemcpyFromSymbol(&h, g_walk_timeline, sizeof(h)) != cudaSuccess) {
    std::fprintf(stderr, "walk timeline: could not read the stamps\n");
    return;
  }
  const int n = static_cast<int>(chunks < WalkTimeline::kChunks ? chunks : WalkTimeline::kChunks);
  if (n < 4) {
    std::fprintf(stderr, "walk timeline: %d chunks in CTA (0, 0, 0), 4 or more needed\n", n);
    return;
  }
  std::fprintf(stderr, "\nwalk timeline (clock64 cycles, mean over chunks 2 .. %d of CTA (0, 0, 0))\n\n", n - 1);
  std::fprintf(stderr, "| stage | C waits | C works | D waits | D works | R waits | R works |\n|---|---|---|---|---|---|---|\n");
  double total[WalkTimeline::kRoles][2] = {};
  for (int s = 0; s < WalkTimeline::kStagesMax; ++s) {
    std::fprintf(stderr, "| %d |", s);
    for (int r = 0; r < WalkTimeline::kRoles; ++r) {
      double wait = 0, work = 0;
      for (int i = 2; i < n; ++i) {
        const auto& p = h.t[r][i][s];
        wait += static_cast<double>(p[WalkTimeline::kWaitEnd] - p[WalkTimeline::kWaitBegin]);
        work += static_cast<double>(p[WalkTimeline::kEnd] - p[WalkTimeline::kWaitEnd]);
      }
      wait /= n - 2;
      work /= n - 2;
      total[r][0] += wait;
      total[r][1] += work;
      std::fprintf(stderr, " %.0f | %.0f |", wait, work);
    }
    std::fprintf(stderr, "\n");
  }
  std::fprintf(stderr, "| all |");
  for (int r = 0; r < WalkTimeline::kRoles; ++r) std::fprintf(stderr, " %.0f | %.0f |", total[r][0], total[r][1]);
  double period = 0;
  for (int i = 2; i + 1 < n; ++i)
    period += static_cast<double>(h.t[0][i + 1][0][WalkTimeline::kWaitBegin] - h.t[0][i][0][WalkTimeline::kWaitBegin]);
  std::fprintf(stderr, "\n\nchunk period %.0f cycles (role C's stage-0 arrivals); a role's waits and work add up to\n"
               "it less the time it spends between stages (the full barriers, the loop)\n",
               period / (n - 3));
  // The launch's CTAs (those that stamped an entry): entry skew, and each warpgroup's exit, from
  // the first entry, in us; then CTA (0, 0, 0)'s first chunks, role C's stage-0 arrivals.
  unsigned long long t0 = ~0ull;
  int ctas = 0;
  for (const auto& c : h.cta)
    if (c[0] != 0) t0 = c[0] < t0 ? c[0] : t0, ++ctas;
  double last_entry = 0, exit_max[4] = {}, exit_sum[4] = {};
  for (const auto& c : h.cta) {
    if (c[0] == 0) continue;
    last_entry = std::max(last_entry, (c[0] - t0) * 1e-3);
    for (int r = 0; r < 4; ++r) {
      const double e = c[1 + r] >= t0 ? (c[1 + r] - t0) * 1e-3 : 0;
      exit_max[r] = std::max(exit_max[r], e);
      exit_sum[r] += e;
    }
  }
  std::fprintf(stderr, "\nthe launch's %d CTAs: last entry %.1f us after the first; exits (mean / last, us): C %.1f / %.1f, "
               "D %.1f / %.1f, R %.1f / %.1f, producer %.1f / %.1f\n", ctas, last_entry, exit_sum[0] / ctas, exit_max[0],
               exit_sum[1] / ctas, exit_max[1], exit_sum[2] / ctas, exit_max[2], exit_sum[3] / ctas, exit_max[3]);
  std::fprintf(stderr, "CTA (0, 0, 0), cycles from its entry: role C's stage-0 arrival at chunk 0 .. %d:", n - 1);
  for (int i = 0; i < n; ++i) std::fprintf(stderr, " %lld", static_cast<long long>(h.t[0][i][0][WalkTimeline::kWaitBegin] - h.entry));
  std::fprintf(stderr, "\n");
  std::fprintf(stderr, "CTA (0, 0, 0)'s walk start, cycles from its entry, points 0 .. %d:", WalkTimeline::kPre - 1);
  for (unsigned long long p : h.pre) std::fprintf(stderr, " %lld", p ? static_cast<long long>(p - h.entry) : -1ll);
  std::fprintf(stderr, "\n");
#endif
}

}  // namespace flashgdn::sm90::fused_bwd
