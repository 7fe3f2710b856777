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
#include <cstdio>

namespace flashgdn::sm90::fused_bwd {

struct WalkTimeline {
  // The walk's roles (C, D, R) and stages: bwd_fused_kernel.cuh asserts they match its own.
  static constexpr int kRoles = 3, kStagesMax = 16, kChunks = 32;
  enum Point { kWaitBegin = 0, kWaitEnd = 1, kEnd = 2, kPoints = 3 };
  unsigned long long t[kRoles][kChunks][kStagesMax][kPoints];
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
#endif
}

}  // namespace flashgdn::sm90::fused_bwd
