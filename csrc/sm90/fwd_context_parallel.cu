// Context parallelism of the Hopper forward, apart from the forward kernel itself: the layout
// from the shapes (host), the boundaries (one CTA), the gate certificate (a CTA per boundary and
// 32 heads), the plan (one CTA: cost model, work items, slots) and the scan across segments
// (fp32).
// fwd_context_parallel.h lists the launches; docs/context-parallel.md the math and the model.
#include "sm90/fwd_context_parallel.h"
#include "sm90/cp_cost_model.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "cuda/chunk_index.cuh"
#include "cuda/device_utils.cuh"
#include "sm90/dependent_launch.h"
#include "sm90/fwd_epilogue.cuh"
#include "sm90/fwd_load.cuh"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/cp_scan_step.cuh"
#include "sm90/ptx.cuh"

namespace flashgdn::sm90 {
namespace {

using cuda::ceil_div;

constexpr int kPlanThreads = 256;

__device__ inline int64_t seq_chunks(const cuda::SeqLayout& s, int64_t n) {
  return ceil_div(cuda::seq_info(s, n).len, 64);
}

// Boundaries of a sequence of c chunks that splits (c > L_min): k grain for k = 1, 2, .. while
// inside the sequence. Segments start only at k grain >= L_min; the boundaries before carry
// the chunk sums of the windows that reach back past them (cp_certify_kernel).
__device__ inline int seq_bounds(int64_t c, int32_t grain, int32_t min_chunks) {
  return c > min_chunks ? static_cast<int>(ceil_div(c, static_cast<int64_t>(grain)) - 1) : 0;
}

// The tile's sequence that owns entry j of a tile-wide exclusive prefix `first` (kPlanThreads + 1
// entries, the last the total): the last i with first[i] <= j, so first[i] <= j < first[i + 1]
// and sequence i has at least one entry.
__device__ inline int tile_owner(const int* first, int j) {
  int lo = 0, hi = kPlanThreads;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first[mid] <= j) lo = mid;
    else hi = mid;
  }
  return lo;
}

// ---- boundaries ----------------------------------------------------------------------------
// One CTA. Every sequence of more than L_min chunks gets a boundary every grain chunks (k >= 1),
// in sequence order (an exclusive scan); every candidate L (a multiple of the grain,
// cp_cost_model.h) starts its segments on a subset of them, so one certificate per boundary
// serves every candidate.
__global__ void __launch_bounds__(kPlanThreads) cp_bounds_kernel(cuda::SeqLayout seq, int32_t grain, int32_t min_chunks,
                                                                  int64_t max_bounds, CpTables t) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int base;
  __shared__ int first[kPlanThreads + 1];  // the tile's sequences' first boundary (+ the count)
  __shared__ int chunks[kPlanThreads];
  launch_dependents();  // the first of the pipeline: launched behind the caller's work as usual
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int64_t n0 = 0; n0 < seq.N; n0 += kPlanThreads) {
    const int64_t n = n0 + threadIdx.x;
    const int64_t c = n < seq.N ? seq_chunks(seq, n) : 0;
    const int nb = seq_bounds(c, grain, min_chunks);
    int b0, total;
    Scan(tmp).ExclusiveSum(nb, b0, total);
    first[threadIdx.x] = b0;
    chunks[threadIdx.x] = static_cast<int>(c);
    if (threadIdx.x == 0) first[kPlanThreads] = total;
    __syncthreads();
    // The tile's boundaries a thread each (one sequence's on its own thread were a chain of
    // stores: 127 of them at 2/8 1x32768 with boundaries every 4 chunks).
    for (int i = threadIdx.x; i < total; i += kPlanThreads) {
      const int s = tile_owner(first, i);
      if (base + i < max_bounds)
        t.bounds[base + i] = make_int4(static_cast<int>(n0) + s, i - first[s] + 1, chunks[s], 0);
    }
    __syncthreads();
    if (threadIdx.x == 0) base += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) t.plan[kPlanBounds] = static_cast<int32_t>(min(static_cast<int64_t>(base), max_bounds));
}

// ---- certificate -----------------------------------------------------------------------------
// A CTA per (boundary, one of the m = min(grain, window) chunks just before it, up to 32 value
// heads): the chunk's summed (floored) gate of each head, or +inf where a token's update is not
// a contraction, into t.chunk_gate. The update I - beta k k^T has eigenvalues 1 and
// 1 - beta ||k||^2, so it is one where 0 <= beta ||k||^2 <= 2: with the keys normalised in the
// kernel (||k|| <= 1) that is beta in [0, 2]; otherwise the CTA reads the keys and tests
// beta ||k||^2 itself (keys normalised before the call certify as well as in the kernel). Each chunk a window
// can reach is summed once: a window longer than the grain reads the sums of the boundaries
// before its own (cp_warm_up), so windows of up to 16 chunks every grain chunks do not read the
// same tokens several times. The plan walks them. One chunk a CTA spreads a window over up to
// 16 SMs: one CTA reading a whole window (128-256 KB of g and beta at 16/64) took ~10 us at
// ~13-30 GB/s (bench/NOTES.md, step 21).
// g and beta rows are [token][head]: a warp covers hw = min(32, pow2 >= Hv) heads and 32 / hw
// tokens at once (one coalesced row per load), 8 of the chunk's tokens a warp.
constexpr int kCertifyThreads = 256, kCertifyWarps = kCertifyThreads / 32, kCertifyWarpTokens = 64 / kCertifyWarps;

// Squared norms of the keys of the warp's tokens t0 + i, i < 8, for key heads hk0 .. hk0 + nk - 1
// (nk <= 32) into n2[i][j]: a lane a (token, head) row, its K 16-bit elements in 16-byte vectors
// issued together, summed in fp32 (the kernel's K K^T accumulates in fp32 from the same values).
template <typename TK>
__device__ __forceinline__ void key_norms(const FwdParams& p, int64_t b, int64_t t0, int64_t hk0, int nk,
                                          float (*n2)[32]) {
  constexpr int kMaxVecs = 128 * 2 / 16;  // K = 128
  const int vecs = static_cast<int>(p.state_dim) * 2 / 16;
  for (int r = threadIdx.x & 31; r < kCertifyWarpTokens * nk; r += 32) {
    const int i = r / nk, j = r % nk;
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const TK*>(p.k) + b * p.ks0 + (t0 + i) * p.ks1 +
                                                      (hk0 + j) * p.ks2);
    uint4 u[kMaxVecs];
#pragma unroll
    for (int c = 0; c < kMaxVecs; ++c) u[c] = c < vecs ? __ldg(row + c) : make_uint4(0, 0, 0, 0);
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < kMaxVecs; ++c) {
      const TK* e = reinterpret_cast<const TK*>(&u[c]);
#pragma unroll
      for (int m = 0; m < 8; ++m) acc = fmaf(cuda::to_float(e[m]), cuda::to_float(e[m]), acc);
    }
    n2[i][j] = acc;
  }
}

// Summed gate and the contraction test over the warp's tokens t0 + i, i = sub, sub + step, .. < 8,
// of head h (sub: the lane's token row, step: the tokens one load covers; with one or two heads a
// load covers more than the warp's 8 tokens and the lanes past them load nothing), with the
// storage dtypes as template parameters: a run-time dtype switch per load would keep only one
// load in flight. kn2: the squared key norms of this head's q/k head for the warp's 8 tokens
// (stride 32; nullptr: keys normalised in the kernel, norm <= 1).
template <typename TG, typename TB>
__device__ __forceinline__ void certify_tokens(const FwdParams& p, int64_t b, int64_t t0, int sub, int step,
                                               int32_t h, float dt_bias, float A_log, const float* kn2, float& g,
                                               bool& ok) {
  constexpr int kBatch = kCertifyWarpTokens;
  const TG* gp = static_cast<const TG*>(p.g) + b * p.gs0 + h * p.gs2;
  const TB* bp = static_cast<const TB*>(p.beta) + b * p.bs0 + h * p.bs2;
  float gv[kBatch], bv[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {  // loads first: the test must not make the next load wait
    const int i = sub + u * step;
    const int64_t t = t0 + i;
    const bool in = i < kBatch;
    gv[u] = in ? cuda::to_float(gp[t * p.gs1]) : 0.f;
    bv[u] = in ? cuda::to_float(bp[t * p.bs1]) : 0.f;
  }
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    if (sub + u * step >= kBatch) continue;
    g += gate_floor(p.gate_in_kernel ? gate_from_activation(gv[u] + dt_bias, A_log) : gv[u]);
    const float bk = kn2 != nullptr ? bv[u] * kn2[(sub + u * step) * 32] : bv[u];  // beta ||k||^2
    ok &= (bv[u] >= 0.f) & (bk <= 2.f);
  }
}

template <typename TG>
__device__ __forceinline__ void certify_tokens(const FwdParams& p, int64_t b, int64_t t0, int sub, int step,
                                               int32_t h, float dt_bias, float A_log, const float* kn2, float& g,
                                               bool& ok) {
  switch (p.beta_dtype) {
    case FGDN_BFLOAT16:
      return certify_tokens<TG, __nv_bfloat16>(p, b, t0, sub, step, h, dt_bias, A_log, kn2, g, ok);
    case FGDN_FLOAT16: return certify_tokens<TG, __half>(p, b, t0, sub, step, h, dt_bias, A_log, kn2, g, ok);
    default: return certify_tokens<TG, float>(p, b, t0, sub, step, h, dt_bias, A_log, kn2, g, ok);
  }
}

__global__ void __launch_bounds__(kCertifyThreads) cp_certify_kernel(const __grid_constant__ FwdParams p,
                                                                      CpTables t, int32_t grain,
                                                                      int32_t per_bound) {
  __shared__ float warp_gate[kCertifyWarps][32];  // +inf: an update that is not a contraction
  __shared__ float key_n2[kCertifyWarps][kCertifyWarpTokens][32];  // without the in-kernel norm
  grid_dependency_wait();  // the boundaries
  launch_dependents();
  const int64_t b = blockIdx.x / per_bound;
  const int j = static_cast<int>(blockIdx.x % per_bound);  // chunk k grain - per_bound + j
  if (b >= t.plan[kPlanBounds]) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t hv = static_cast<int32_t>(p.Hv);
  const int32_t heads = min(32, hv - 32 * static_cast<int32_t>(blockIdx.y));  // this CTA's heads
  int hw = 1;
  while (hw < heads) hw *= 2;
  const int lanes_t = 32 / hw;  // tokens per warp-wide load
  const int hl = lane % hw, tsub = lane / hw;
  const int32_t h = static_cast<int32_t>(blockIdx.y) * 32 + hl;
  const int4 r = t.bounds[b];
  const cuda::SeqInfo si = cuda::seq_info(p.seq, r.x);
  // The chunk's first token (k >= 1 and per_bound <= grain keep it inside the sequence).
  const int64_t t0 = si.t0 + (static_cast<int64_t>(r.y) * grain - per_bound + j) * 64 + warp * kCertifyWarpTokens;
  // The q/k heads of this CTA's value heads 32 y .. 32 y + heads - 1.
  const int64_t hk0 = 32 * static_cast<int64_t>(blockIdx.y) / p.group;
  const float* kn2 = nullptr;
  if (!p.l2norm) {
    const int nk = static_cast<int>((32 * static_cast<int64_t>(blockIdx.y) + heads - 1) / p.group - hk0 + 1);
    if (p.k_dtype == FGDN_FLOAT16) key_norms<__half>(p, si.b, t0, hk0, nk, key_n2[warp]);
    else key_norms<__nv_bfloat16>(p, si.b, t0, hk0, nk, key_n2[warp]);
    __syncwarp();
    if (hl < heads) kn2 = &key_n2[warp][0][h / p.group - hk0];
  }
  float g = 0.f;
  bool ok = true;
  if (hl < heads) {
    float dt_bias = 0.f, A_log = 0.f;
    if (p.gate_in_kernel) {
      dt_bias = p.dt_bias != nullptr ? p.dt_bias[h] : 0.f;
      A_log = p.A_log[h];
    }
    switch (p.g_dtype) {
      case FGDN_BFLOAT16:
        certify_tokens<__nv_bfloat16>(p, si.b, t0, tsub, lanes_t, h, dt_bias, A_log, kn2, g, ok);
        break;
      case FGDN_FLOAT16: certify_tokens<__half>(p, si.b, t0, tsub, lanes_t, h, dt_bias, A_log, kn2, g, ok); break;
      default: certify_tokens<float>(p, si.b, t0, tsub, lanes_t, h, dt_bias, A_log, kn2, g, ok); break;
    }
  }
  for (int m = hw; m < 32; m *= 2) {  // the token lanes of one head
    g += __shfl_xor_sync(0xffffffffu, g, m);
    ok &= __shfl_xor_sync(0xffffffffu, static_cast<int>(ok), m) != 0;
  }
  if (tsub == 0) warp_gate[warp][hl] = ok ? g : INFINITY;
  __syncthreads();
  if (warp != 0 || lane >= heads) return;
  float sum = 0.f;
  for (int v = 0; v < kCertifyWarps; ++v) sum += warp_gate[v][lane];  // in order: the same bits every run
  t.chunk_gate[(b * per_bound + j) * hv + 32 * static_cast<int32_t>(blockIdx.y) + lane] = sum;
}

// The warm-up of boundary b for head h from its window's chunk sums: W = the fewest chunks back
// whose summed gate reaches kCertifyLogDecay with no refused beta (+inf) among them; else the
// exact path. The chunk w + 1 back is at (b + 1) per_bound - 1 - w in the table: in b's own
// sums while w < per_bound, else in the boundaries' before it (per_bound = grain then), which
// belong to the same sequence where a segment can start (k grain >= L_min >= window). For the
// boundaries where none can (k grain < L_min), the walk may read another sequence's sums or
// none (+inf), and its result is never used. The sums are loaded together, before the walk.
__device__ inline int32_t cp_warm_up(const float* chunk_gate, int64_t b, int32_t window, int32_t per_bound,
                                     int32_t hv, int32_t h) {
  float g[kCertifyMaxChunks];
#pragma unroll
  for (int w = 0; w < kCertifyMaxChunks; ++w) {
    const int64_t at = (b + 1) * per_bound - 1 - w;
    g[w] = w < window && at >= 0 ? chunk_gate[at * hv + h] : INFINITY;
  }
  float decay = 0.f;
#pragma unroll
  for (int w = 0; w < kCertifyMaxChunks; ++w) {
    if (g[w] == INFINITY) return kExactSegment;
    decay += g[w];
    if (decay <= kCertifyLogDecay) return w + 1;
  }
  return kExactSegment;
}

// ---- plan statistics (the cost model is cp_cost_model.h) ------------------------------------
// Per candidate set (a template argument of the plan kernel, so that the coarse set's loops are
// those of 6 power-of-two lengths, as before the fine set existed: bench/NOTES.md, step 32c).
template <bool kFine>
struct PlanStats {
  static constexpr int kCandidates = cp_candidate_count(kFine);
  static constexpr int kFields = 2 + 7 * kCandidates;
  unsigned long long sum_c, max_c;
  CpCandidateStats cand[kCandidates];
};

// Block-wide reduction of every PlanStats field (sums; maxima for max_c and warm_max), integers
// so the order does not matter: each warp's values by shuffles, then thread f over the warps'
// partials of field f. (A block-wide atomic round per field, 38 of them, took ~12000 of the
// plan's ~40000 cycles: bench/NOTES.md, step 12.)
static_assert(sizeof(CpCandidateStats) == 7 * sizeof(unsigned long long) &&
                  offsetof(PlanStats<false>, cand) == 2 * sizeof(unsigned long long) &&
                  offsetof(PlanStats<true>, cand) == 2 * sizeof(unsigned long long) &&
                  sizeof(PlanStats<true>) == PlanStats<true>::kFields * sizeof(unsigned long long) &&
                  offsetof(CpCandidateStats, warm_max) == 4 * sizeof(unsigned long long),
              "stat_is_max assumes this layout");
__device__ __forceinline__ bool stat_is_max(int f) { return f == 1 || (f >= 2 && (f - 2) % 7 == 4); }

template <class Stats>
__device__ inline void block_reduce_stats(const Stats& own, Stats& all,
                                          unsigned long long (*partial)[Stats::kFields]) {
  constexpr int kStatFields = Stats::kFields;
  const auto* x = reinterpret_cast<const unsigned long long*>(&own);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int f = 0; f < kStatFields; ++f) {
    unsigned long long v = x[f];
#pragma unroll
    for (int m = 16; m > 0; m /= 2) {
      const unsigned long long y = __shfl_xor_sync(0xffffffffu, v, m);
      v = stat_is_max(f) ? max(v, y) : v + y;
    }
    if (lane == 0) partial[warp][f] = v;
  }
  __syncthreads();
  if (threadIdx.x < kStatFields) {
    const int f = static_cast<int>(threadIdx.x);
    unsigned long long v = partial[0][f];
    for (int w = 1; w < kPlanThreads / 32; ++w) v = stat_is_max(f) ? max(v, partial[w][f]) : v + partial[w][f];
    reinterpret_cast<unsigned long long*>(&all)[f] = v;
  }
  __syncthreads();
}

// Block-wide sum (or max) of one statistic into shared memory: the warp's value by shuffles,
// then one atomic per warp (integers: the result does not depend on the order).
__device__ inline void block_accumulate(unsigned long long* to, unsigned long long x, bool is_max) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) {
    const unsigned long long y = __shfl_xor_sync(0xffffffffu, x, m);
    x = is_max ? max(x, y) : x + y;
  }
  if ((threadIdx.x & 31) == 0) is_max ? atomicMax(to, x) : atomicAdd(to, x);
}

// Movable CTAs of item u over its hv heads (cp_movable for each h): the item-wide cases first,
// then the heads' flags 16 at a time, so that their loads fly together (one head at a time, a
// load round trip each, this took up to ~12000 cycles of the plan at Hv = 64).
__device__ inline int movable_heads(const int32_t* warm, int32_t hv, int4 u) {
  if (u.z < 0) return hv;
  if (u.y == 0 || u.y + 1 >= u.w) return 0;
  const int32_t* row = warm + static_cast<int64_t>(u.z) * hv;
  int count = 0;
  for (int32_t h0 = 0; h0 < hv; h0 += 16) {
    int32_t a[16], b[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      a[j] = h0 + j < hv ? row[h0 + j] : kExactSegment;
      b[j] = h0 + j < hv ? row[hv + h0 + j] : kExactSegment;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) count += a[j] != kExactSegment && b[j] != kExactSegment ? 1 : 0;
  }
  return count;
}

// ---- plan ------------------------------------------------------------------------------------
// Where the plan reads back the tables it writes (and the boundaries and their warm-ups): in
// shared memory when they fit (PlanStage), else in the workspace. The forward reads the
// workspace's copies. Reading back from global memory what the block had just written took
// ~3500-6000 of the plan's ~19000-27000 cycles (bench/NOTES.md, step 21).
struct PlanView {
  int4 *bounds, *items, *slots;
  int32_t *bound_warm, *warm;
};

// The staged tables' layout in the plan kernel's dynamic shared memory, or 0 bytes where they do
// not fit in kPlanStageBytes (one layout for the host's launch and the kernel).
constexpr size_t kPlanStageBytes = 64 * 1024;
struct PlanStage {
  int64_t bounds, items, slots;  // int4 entries
  int64_t bound_warm, warm;      // int32 entries
  FGDN_HOST_DEVICE size_t bytes() const {
    return static_cast<size_t>(bounds + items + slots) * sizeof(int4) +
           static_cast<size_t>(bound_warm + warm) * sizeof(int32_t);
  }
  FGDN_HOST_DEVICE bool fits() const { return bytes() <= kPlanStageBytes; }
};

// The (row, head) of the entries e = row Hv + h that thread threadIdx.x takes, e = threadIdx.x,
// + kPlanThreads, ..: stepped without divisions (a 64-bit division is ~70 instructions, and the
// plan's loops took one or two an entry).
struct EntryWalk {
  int64_t row;
  int32_t h, hv, drow, dh;
  __device__ explicit EntryWalk(int32_t heads)
      : row(threadIdx.x / heads), h(threadIdx.x % heads), hv(heads), drow(kPlanThreads / heads),
        dh(kPlanThreads % heads) {}
  __device__ int64_t entry() const { return row * hv + h; }
  __device__ void next() {
    row += drow;
    h += dh;
    if (h >= hv) {
      h -= hv;
      ++row;
    }
  }
};

__device__ inline PlanView plan_view(const CpTables& t, const PlanStage& st, int4* smem) {
  if (!st.fits()) return {t.bounds, t.items, t.slots, t.bound_warm, t.warm};
  PlanView v;
  v.bounds = smem;
  v.items = v.bounds + st.bounds;
  v.slots = v.items + st.items;
  v.bound_warm = reinterpret_cast<int32_t*>(v.slots + st.slots);
  v.warm = v.bound_warm + st.bound_warm;
  return v;
}

// One CTA. Pass 0: every (boundary, head)'s warm-up from the certificate's chunk sums
// (cp_warm_up). Pass 1 (unless L is fixed): per candidate L = q grains (CpCandidates) the cost
// model's inputs, from the sequence lengths and the warm-ups of the boundaries it starts
// segments on (k a multiple of q); then the cheapest L (cp_cost_model.h). Pass 2: the items
// (one per unsplit sequence or segment), longest first, and the slots (segments of split
// sequences), in sequence order by block-wide exclusive scans. Pass 3: each slot's warm-up from
// its boundary's, and where the exact segments are corrected, their list (t.exact). Pass 4:
// what phase 2 takes.
// One CTA on the GPU: `1` lets the fine set's unrolled statistics take 147 registers (ptxas
// capped them at 128 with a 40-byte stack otherwise).
template <bool kFine>
__global__ void __launch_bounds__(kPlanThreads, 1) cp_plan_kernel(cuda::SeqLayout seq, int32_t hv, int32_t sms,
                                                                int32_t corrected, CpCandidates cand,
                                                                int32_t window, int64_t max_items, int64_t max_slots,
                                                                int64_t max_splits, PlanStage stage, CpTables t) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  using Stats = PlanStats<kFine>;
  __shared__ union {
    typename Scan::TempStorage scan[4];  // pass 2's four scans, no barrier between them
    Stats stats;
  } tmp;
  __shared__ int chosen;
  __shared__ int base[4];
  __shared__ int exact_count;  // entries of t.exact
  extern __shared__ int4 plan_smem[];
  const PlanView v = plan_view(t, stage, plan_smem);
  const bool staged = stage.fits();
  grid_dependency_wait();  // the certificates
  launch_dependents();
  const int64_t N = seq.N;
  const int32_t min_chunks = cand.min_chunks, grain = cand.grain();
  const int32_t per_bound = min(grain, window);  // chunk sums a boundary holds (cp_certify_kernel)

  // Pass 0 (the boundaries' loads fly with the chunk sums').
  const int32_t n_bounds = t.plan[kPlanBounds];
  if (staged)
    for (int32_t i = threadIdx.x; i < n_bounds; i += kPlanThreads) v.bounds[i] = t.bounds[i];
  for (EntryWalk w(hv); w.row < n_bounds; w.next())
    v.bound_warm[w.entry()] = cp_warm_up(t.chunk_gate, w.row, window, per_bound, hv, w.h);
  __syncthreads();

  if (cand.count == 1) {
    if (threadIdx.x == 0) chosen = min_chunks;
  } else {
    Stats own = {};
    // Per sequence: chunks and items.
    for (int64_t n = threadIdx.x; n < N; n += kPlanThreads) {
      const unsigned long long c = static_cast<unsigned long long>(seq_chunks(seq, n));
      own.sum_c += c;
      own.max_c = c > own.max_c ? c : own.max_c;
      // 32-bit divisions (a 64-bit one is ~70 instructions): a sequence's chunk count fits 32
      // bits (the boundaries' table holds it as an int).
      const uint32_t c32 = static_cast<uint32_t>(c);
      const auto heads = static_cast<unsigned long long>(hv);
#pragma unroll
      for (int i = 0; i < Stats::kCandidates; ++i) {
        const uint32_t L = static_cast<uint32_t>(grain * cp_candidate_grains(i, kFine));
        const uint32_t whole = c32 / L, rest = c32 - whole * L;  // one division for both counts
        own.cand[i].items += c32 > L ? whole + (rest > 0 ? 1u : 0u) : 1u;
        own.cand[i].movable += c32 > L ? 0 : heads;  // unsplit: movable
        // cp_long_items(c32, L) from the same quotient.
        own.cand[i].long_ctas += heads * (c32 > L ? whole + (2 * rest > L ? 1u : 0u) : (2 * c32 > L ? 1u : 0u));
      }
    }
    // Per (boundary, head): the segments' certificates.
    for (EntryWalk w(hv); w.row < n_bounds; w.next()) {
      const int64_t e = w.entry();
      const int4 r = v.bounds[w.row];
      const int32_t warm = v.bound_warm[e];
#pragma unroll
      for (int i = 0; i < Stats::kCandidates; ++i) {
        // Candidate i's segments start at k = q, 2 q, .. (a constant per unrolled i).
        const int32_t q = cp_candidate_grains(i, kFine);
        if (r.y % q != 0) continue;
        CpCandidateStats& cs = own.cand[i];
        const long long L = static_cast<long long>(grain) * q;
        const long long rest = static_cast<long long>(r.z) - static_cast<long long>(r.y) * grain;
        if (warm == kExactSegment) {
          cs.exact += 1;
          cs.exact_chunks += static_cast<unsigned long long>(rest < L ? rest : L);
        } else {
          cs.warm_chunks += static_cast<unsigned long long>(warm);
          cs.warm_max = max(cs.warm_max, static_cast<unsigned long long>(warm));
          // A middle segment not followed by an exact one is movable (cp_movable).
          if (rest > L && v.bound_warm[e + static_cast<int64_t>(q) * hv] != kExactSegment) cs.movable += 1;
        }
      }
    }
    __shared__ unsigned long long partial[kPlanThreads / 32][Stats::kFields];
    __shared__ double cost[kCpMaxCandidates + 1];
    Stats& all = tmp.stats;
    block_reduce_stats(own, all, partial);
    // The candidates priced a thread each (the cost model's integer divisions and waves in
    // double precision cost ~900 cycles a candidate), the no-split bar by one more, then the pick.
    const double sum_c = static_cast<double>(all.sum_c), max_c = static_cast<double>(all.max_c);
    if (threadIdx.x < cand.count) {
      const int i = static_cast<int>(threadIdx.x);
      cost[i] = cp_candidate_steps(all.cand[i], i, cand, sum_c, max_c, hv, sms, corrected != 0);
    } else if (threadIdx.x == cand.count) {
      cost[kCpMaxCandidates] = cp_split_bar(sum_c, max_c, static_cast<double>(N), hv, sms);
    }
    __syncthreads();
    if (threadIdx.x == 0) chosen = cp_pick_from(cost, cand, cost[kCpMaxCandidates]);
  }
  if (threadIdx.x == 0) base[0] = base[1] = base[2] = base[3] = exact_count = 0;
  __syncthreads();
  const int64_t L = chosen;

  // Items go out longest first (the forward's CTAs take the units in index order,
  // fwd_scheduler.cuh, so a long chain placed last would run alone at the end): buckets of
  // floor(log2(chunks)), longest bucket first. Within a bucket the order is the atomics' and does
  // not matter: an item's results do not depend on the CTA that runs it.
  __shared__ int bucket_next[32];
  auto nseg_of = [&](int64_t c) { return c > L ? static_cast<int>(ceil_div(c, L)) : 1; };
  auto bucket_of = [&](int64_t c, int s) {  // segment s of a sequence of c chunks
    const int64_t len = c > L ? min(L, c - s * L) : c;
    return len > 0 ? 63 - __clzll(static_cast<unsigned long long>(len)) : 0;
  };
  if (threadIdx.x < 32) bucket_next[threadIdx.x] = 0;
  __syncthreads();
  // A split sequence's segments but the last are L chunks long, so one bucket takes them all:
  // two atomics a sequence, not one a segment (a serial chain on one thread for one sequence).
  for (int64_t n = threadIdx.x; n < N; n += kPlanThreads) {
    const int64_t c = seq_chunks(seq, n);
    const int nseg = nseg_of(c);
    if (nseg > 1) atomicAdd(&bucket_next[bucket_of(c, 0)], nseg - 1);
    atomicAdd(&bucket_next[bucket_of(c, nseg - 1)], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // bucket b starts after the buckets above it: lane 31 - b's exclusive prefix
    const int lane = threadIdx.x, b = 31 - lane, count = bucket_next[b];
    int through = count;
#pragma unroll
    for (int m = 1; m < 32; m *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, through, m);
      if (lane >= m) through += y;
    }
    bucket_next[b] = through - count;
  }
  __syncthreads();

  __shared__ int seg_first[kPlanThreads + 1];  // the tile's sequences' first segment (+ the count)
  __shared__ int4 seg_of[kPlanThreads];       // {first full position, last's, first slot or -1, bound0}
  for (int64_t n0 = 0; n0 < N; n0 += kPlanThreads) {
    const int64_t n = n0 + threadIdx.x;
    const int64_t c = n < N ? seq_chunks(seq, n) : 0;
    const bool split = c > L;
    const int nseg = n < N ? nseg_of(c) : 0;
    int item0, slot0, split0, bound0, items, slots, splits, bounds;
    Scan(tmp.scan[0]).ExclusiveSum(nseg, item0, items);  // the count (positions: the buckets)
    Scan(tmp.scan[1]).ExclusiveSum(split ? nseg : 0, slot0, slots);
    Scan(tmp.scan[2]).ExclusiveSum(split ? 1 : 0, split0, splits);
    Scan(tmp.scan[3]).ExclusiveSum(seq_bounds(c, grain, min_chunks), bound0, bounds);  // as cp_bounds_kernel
    slot0 += base[1];
    split0 += base[2];
    bound0 += base[3];
    // The bounds hold by construction (cp_layout); the checks keep a broken invariant from
    // writing past the tables.
    if (n < N) {
      // Positions: a bucket's run for the full segments, one more for the last.
      const int full = nseg > 1 ? atomicAdd(&bucket_next[bucket_of(c, 0)], nseg - 1) : 0;
      const int last = atomicAdd(&bucket_next[bucket_of(c, nseg - 1)], 1);
      seg_of[threadIdx.x] = make_int4(full, last, split ? slot0 : -1, bound0);
      if (split && split0 < max_splits) t.splits[split0] = make_int4(static_cast<int>(n), slot0, nseg, 0);
    }
    seg_first[threadIdx.x] = item0;
    if (threadIdx.x == 0) seg_first[kPlanThreads] = items;
    __syncthreads();
    // The tile's segments a thread each (one sequence's segments on its own thread were a chain
    // of ~250 cycles a segment: bench/NOTES.md, step 21): segment j belongs to the tile's
    // sequence i with seg_first[i] <= j < seg_first[i + 1] (every sequence has a segment).
    for (int j = threadIdx.x; j < items; j += kPlanThreads) {
      const int lo = tile_owner(seg_first, j);
      const int s = j - seg_first[lo], nsegs = seg_first[lo + 1] - seg_first[lo];
      const int4 where = seg_of[lo];
      const int seq_n = static_cast<int>(n0) + lo;
      const int at = s + 1 < nsegs ? where.x + s : where.y;
      if (at < max_items) {
        const int4 item = make_int4(seq_n, s, where.z >= 0 ? where.z + s : -1, nsegs);
        t.items[at] = item;
        if (staged) v.items[at] = item;
      }
      if (where.z >= 0 && where.z + s < max_slots) {
        const int4 slot = make_int4(seq_n, s, nsegs, where.w);
        t.slots[where.z + s] = slot;
        if (staged) v.slots[where.z + s] = slot;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      base[0] += items;
      base[1] += slots;
      base[2] += splits;
      base[3] += bounds;
    }
    __syncthreads();
  }
  const int32_t n_slots = static_cast<int32_t>(min(static_cast<int64_t>(base[1]), max_slots));
  // Pass 3: segment s of a split sequence starts at its boundary k = s L / grain, entry k - 1 of
  // the sequence's boundaries (the slots' writes above are visible to the block after the
  // barrier).
  const int32_t stride = static_cast<int32_t>(L / grain);
  for (EntryWalk w(hv); w.row < n_slots; w.next()) {
    const int64_t e = w.entry();
    const int4 u = v.slots[w.row];
    const int32_t h = w.h;
    const int32_t warm = u.y == 0 ? 0 : v.bound_warm[(static_cast<int64_t>(u.w) + u.y * stride - 1) * hv + h];
    t.warm[e] = warm;
    if (staged) v.warm[e] = warm;
    // The correction's work list (cp_correct.cu); its order changes no result.
    if (corrected && u.y > 0 && warm == kExactSegment)
      t.exact[atomicAdd(&exact_count, 1)] = make_int4(static_cast<int32_t>(e), u.x, u.y, 0);
  }
  // Pass 4: how many movable CTAs phase 2 takes (cp_deferred), and which: the last ones in item
  // order (items are longest first, so the shortest move), counted to the CTA, so that phase 1
  // ends on the wave boundary the cost model priced. The threshold is a CTA index unit Hv + h
  // (the item CTAs' order in the grid): a block-wide scan of the items' movable counts from the
  // last item finds the item where the count reaches `deferred`, then the head within it. Which
  // CTAs run where changes no result, only the time.
  __shared__ unsigned long long movable_exact[2];
  __shared__ unsigned long long deferred;
  __shared__ int32_t defer_from;
  if (threadIdx.x == 0) movable_exact[0] = movable_exact[1] = 0;
  __syncthreads();  // also: pass 3's flags are visible
  const int32_t n_items = static_cast<int32_t>(min(static_cast<int64_t>(base[0]), max_items));
  unsigned long long movable = 0, exact = 0;
  for (EntryWalk w(hv); w.row < n_items; w.next()) movable += cp_movable(v.warm, hv, v.items[w.row], w.h) ? 1 : 0;
  for (EntryWalk w(hv); w.row < n_slots; w.next())
    exact += v.slots[w.row].y > 0 && v.warm[w.entry()] == kExactSegment ? 1 : 0;
  block_accumulate(&movable_exact[0], movable, false);
  block_accumulate(&movable_exact[1], exact, false);
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long mv = movable_exact[0], ex = movable_exact[1];
    // Corrected exact segments are not walked again: no second pass to fill.
    deferred = cp_deferred(static_cast<unsigned long long>(n_items) * hv + ex, mv, corrected ? 0 : ex, sms);
    defer_from = INT32_MAX;  // nothing moves
  }
  __syncthreads();
  unsigned long long after = 0;  // movable CTAs in the items behind this tile
  for (int32_t last = n_items - 1; deferred > 0 && last >= 0; last -= kPlanThreads) {
    const int32_t i = last - static_cast<int32_t>(threadIdx.x);
    int count = 0;
    if (i >= 0) count = movable_heads(v.warm, hv, v.items[i]);
    int through, tile;  // movable CTAs in items [i, last], and in the whole tile
    Scan(tmp.scan[0]).InclusiveSum(count, through, tile);
    const unsigned long long behind = after + static_cast<unsigned long long>(through - count);
    if (count > 0 && behind < deferred && behind + static_cast<unsigned long long>(count) >= deferred) {
      // Item i's last `need` movable heads move: h is the first of them.
      int32_t h = hv;
      for (unsigned long long need = deferred - behind; need > 0;)
        if (cp_movable(v.warm, hv, v.items[i], --h)) --need;
      defer_from = i * hv + h;
    }
    __syncthreads();  // defer_from is seen by all; tmp.scan may be reused
    if (defer_from != INT32_MAX) break;
    after += static_cast<unsigned long long>(tile);
  }
  if (threadIdx.x == 0) {
    t.plan[kPlanDeferFrom] = defer_from;
    t.plan[kPlanChunks] = static_cast<int32_t>(L);
    t.plan[kPlanItems] = n_items;
    t.plan[kPlanSlots] = n_slots;
    t.plan[kPlanSplits] = static_cast<int32_t>(min(static_cast<int64_t>(base[2]), max_splits));
    t.plan[kPlanExact] = exact_count;
  }
}

// ---- scan ------------------------------------------------------------------------------------
// A chain per (split sequence, value head, 8 state columns), walked by one CTA at a time (a
// CTA walks several chains one after another when there are more than fit on the SMs). Along
// the sequence's segments s = 1, 2, ..:
//   S_end(s) = M_s S_end(s - 1) + N_s   (exact segment: N_s and M_s from phase 1)
//   S_end(s) = E_s                      (first or warm-up segment: its own end state)
// in fp32, each exact S_end(s) written back over N_s for phase 2 of segment s + 1; the last
// one is the sequence's final state (ht or the pool row, in its dtype and layout). The step (a
// copy warp streaming M, the product in 3xTF32 on the tensor cores) is cp_scan_step.cuh's, the
// backward's scan's too.
template <int kD>
using ScanTraits = CpScanTraits<kD>;
template <int kD>
using ScanStorage = CpScanStorage<kD>;

// A chain's coordinates: work unit `index` = (split sequence, value head, block of kCols columns).
template <int kD>
struct ScanChain {
  int4 u;  // {n, first slot, segments}
  int32_t h, hv;
  int col0;
  __device__ ScanChain(const FwdParams& p, const CpTables& t, int64_t index) {
    hv = static_cast<int32_t>(p.Hv);
    const int64_t unit = index / ScanTraits<kD>::kBlocksPerHead;
    col0 = static_cast<int>(index % ScanTraits<kD>::kBlocksPerHead) * ScanTraits<kD>::kCols;
    u = t.splits[unit / hv];
    h = static_cast<int32_t>(unit % hv);
  }
  // Segment s's K x K (or K x V) fp32 matrix in one of phase 1's per-slot arrays.
  __device__ float* at(float* base, int s, int row) const {
    return base + ((static_cast<int64_t>(u.y + s) * hv + h) * kD + row) * kD;
  }
  __device__ bool exact(const CpTables& t, int s) const {
    return s < u.z && t.warm[(static_cast<int64_t>(u.y) + s) * hv + h] == kExactSegment;
  }
};

// The copy warp: every exact segment's M, in order, into buffer fills % 2 once the compute
// warps have released it; each lane's copies arrive on m_full (its count is the 32 lanes).
template <int kD>
__device__ __forceinline__ void scan_copy_chain(const FwdParams& p, const CpTables& t, int64_t index,
                                                ScanStorage<kD>& sm, uint32_t& fills) {
  const ScanChain<kD> c(p, t, index);
  for (int s = 1; s < c.u.z; ++s)
    if (c.exact(t, s)) cp_scan_copy<kD>(sm, fills, c.at(p.cp.trans, s, 0));
}

// The chain's last S_end, the sequence's final state: into ht, or the pool row, in its dtype and
// layout (the thread's elements: rows r0 and r0 + 8, columns cc and cc + 1 of the chain's block).
template <int kD>
__device__ __forceinline__ void write_final_state(const FwdParams& p, const ScanChain<kD>& c, float2 lo, float2 hi,
                                                  int r0, int cc) {
  if (!p.write_final) return;
  StateRef dst = p.ht;
  int64_t row = c.u.x;
  if (p.state_idx != nullptr) {
    dst = p.h0;
    row = cuda::load_index(p.state_idx, p.state_idx_dtype, c.u.x);
  }
  if (row < 0 || dst.data == nullptr) return;
  const float v[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
  for (int e = 0; e < 4; ++e)
    cuda::store_from_float(dst.data, dst.dtype,
                           state_offset(dst, row, c.h, r0 + 8 * (e >> 1), c.col0 + cc + (e & 1), p.v_first), v[e]);
}

// The compute warps: S_end along the chain, M_s S_end(s - 1) on the tensor cores.
template <int kD>
__device__ __forceinline__ void scan_chain(const FwdParams& p, const CpTables& t, int64_t index,
                                           ScanStorage<kD>& sm, uint32_t& fills) {
  using Tr = ScanTraits<kD>;
  const ScanChain<kD> c(p, t, index);
  const int z = c.u.z;
  // The thread's elements, in the m16n8 accumulator layout: rows r0 and r0 + 8, columns cc, cc + 1.
  const CpScanLane l;
  const int lane = threadIdx.x & 31, r0 = l.r0, cc = l.cc;
  auto load2 = [&](int s, int row) { return *reinterpret_cast<const float2*>(c.at(p.cp.ends, s, row) + c.col0 + cc); };
  // A chain without an exact segment multiplies nothing: its final state is its last segment's
  // own end state. Walking its segments anyway (the St split and a barrier a step) took most of
  // the scan where a CTA walks many chains (16/64: 64 heads, one exact; bench/NOTES.md step 23).
  bool any_exact = false;
  for (int s = 1 + lane; s < z; s += 32) any_exact |= c.exact(t, s);
  if (!__any_sync(0xffffffffu, any_exact)) {
    write_final_state(p, c, load2(z - 1, r0), load2(z - 1, r0 + 8), r0, cc);
    return;
  }
  // Segment s's end state is read only where the chain needs it: a movable segment (phase 2
  // may run it, fwd_scheduler.cuh) writes none. Exactness is read three segments ahead (x[0]
  // is segment s's), so that no load of the flags waits on the chain.
  bool x[4] = {c.exact(t, 1), c.exact(t, 2), c.exact(t, 3), c.exact(t, 4)};
  float2 lo = load2(0, r0), hi = load2(0, r0 + 8), next_lo = {}, next_hi = {};
  if (z > 1 && (z <= 2 || x[0] || x[1])) {
    next_lo = load2(1, r0);
    next_hi = load2(1, r0 + 8);
  }
  named_barrier_sync(kCpScanComputeBarrier, Tr::kComputeThreads);  // the previous chain's reads of St are done
  for (int s = 1; s < z; ++s) {
    const bool run = x[0];
    cp_scan_put<kD>(sm, l, s & 1, lo, hi);  // S_end(s - 1), split, into this step's St
    lo = next_lo;
    hi = next_hi;
    if (s + 1 < z && (s + 2 >= z || x[1] || x[2])) {
      next_lo = load2(s + 1, r0);
      next_hi = load2(s + 1, r0 + 8);
    }
    x[0] = x[1];
    x[1] = x[2];
    x[2] = x[3];
    x[3] = c.exact(t, s + 4);
    named_barrier_sync(kCpScanComputeBarrier, Tr::kComputeThreads);  // St is written
    if (!run) continue;
    cp_scan_product<kD>(sm, l, s & 1, fills, lo, hi);  // N_s + M_s S_end(s - 1)
    *reinterpret_cast<float2*>(c.at(p.cp.ends, s, r0) + c.col0 + cc) = lo;
    *reinterpret_cast<float2*>(c.at(p.cp.ends, s, r0 + 8) + c.col0 + cc) = hi;
  }
  write_final_state(p, c, lo, hi, r0, cc);
}

// The grid is at most what fits on the SMs at once, and each CTA walks the units blockIdx.x,
// blockIdx.x + gridDim.x, .. below the plan's count: the host knows only a bound on the splits
// (max_splits, from the shapes), and a grid of one CTA per bounded unit was mostly CTAs that
// found no split and exited (at 2/8 1x32768: 3840 of 3968). Dropping them measured no faster
// (bench/NOTES.md, CP step 6); it is kept as the simpler launch for the same bits. The copy warp
// walks the same units, so its count of M fills matches the compute warps' count of uses.
template <int kD>
__global__ void __launch_bounds__(ScanTraits<kD>::kThreads) cp_scan_kernel(const __grid_constant__ FwdParams p,
                                                                           CpTables t) {
  using Tr = ScanTraits<kD>;
  extern __shared__ float4 scan_smem[];
  ScanStorage<kD>& sm = *reinterpret_cast<ScanStorage<kD>*>(scan_smem);
  if (threadIdx.x == 0) cp_scan_init<kD>(sm);
  __syncthreads();
  grid_dependency_wait();  // phase 1's segment states and transfer matrices
  launch_dependents();
  const int64_t units = static_cast<int64_t>(t.plan[kPlanSplits]) * p.Hv * Tr::kBlocksPerHead;
  const bool copier = threadIdx.x >= Tr::kComputeThreads;
  uint32_t fills = 0;  // M buffers filled (copy warp) or used (compute warps) so far
  for (int64_t index = blockIdx.x; index < units; index += gridDim.x) {
    if (copier)
      scan_copy_chain<kD>(p, t, index, sm, fills);
    else
      scan_chain<kD>(p, t, index, sm, fills);
  }
  if (copier) cp_async_wait<0>();  // no copy outlives its issuing thread
}

}  // namespace

CpLayout cp_layout(const Problem& p, int sms) {
  CpLayout c;
  c.sms = sms;
  if (p.context_parallel == FGDN_CONTEXT_PARALLEL_OFF || p.N == 0 || p.B * p.T == 0) return c;
  // Chunks: sum over sequences (a bound for varlen) and the longest chain the shapes allow.
  const int64_t sum_c = cuda::num_chunk_slots(p);
  const int64_t longest = ceil_div(p.T, 64);  // varlen: T is the packed total
  const int64_t balanced = ceil_div(p.Hv * sum_c, sms);
  if (p.cp_segment > 0) {
    c.cand = cp_fixed_length(static_cast<int32_t>(std::min<int64_t>(p.cp_segment / 64, kCpNoSplit)));
  } else {
    // Candidates from a quarter of the balanced load up (shorter segments cannot pay for their
    // joins).
    c.cand = cp_candidates(cp_min_chunks(balanced), true);  // the set: below, from the lengths
  }
  const bool worth = longest >= 2 * balanced && longest > c.cand.min_chunks;
  if (p.context_parallel == FGDN_CONTEXT_PARALLEL_AUTO && !worth) return c;
  const int64_t C = ceil_div(p.T, 64);
  const int64_t L = c.cand.min_chunks;
  // Items: ceil(c_n / L) <= c_n / L + 1 per sequence. Slots: split sequences have c_n > L, so
  // sum ceil(c_n / L) < 2 sum c_n / L (dense: exactly B ceil(C / L) when C > L). Every
  // candidate is at least L_min = L long, so these bounds hold for the plan's choice.
  const int64_t max_slots = p.varlen ? 2 * ceil_div(sum_c, L) : (C > L ? p.B * ceil_div(C, L) : 0);
  const size_t state_bytes = static_cast<size_t>(max_slots) * p.Hv * p.K * p.K * sizeof(float);
  const bool corrected = max_slots > 0 && cp_corrects(c.cand.min_chunks, p.K, p.varlen,
                                                      p.precision == FGDN_PRECISION_HIGH, p.checkpoint_every > 0);
  // With the sequences' lengths on the host (dense: from the shapes; varlen: in a call, not in a
  // workspace query, which sizes for the pipeline), the candidate set (the fine one only where
  // it pays for its boundaries, cp_fine_pays), and no pipeline where a split with one exact head
  // per split sequence would not pay for it (cp_pipeline_pays). Under CUDA graph capture this is
  // decided from the capture's lengths. Without them the set stays the fine one, whose tables
  // bound the coarse one's (boundaries every L_min / 4 chunks, each with up to L_min / 4 sums).
  const bool auto_cp = p.context_parallel == FGDN_CONTEXT_PARALLEL_AUTO;
  if ((!p.varlen || p.have_host_seqlens) && (auto_cp || c.cand.count > 1)) {
    std::vector<CpSeqGroup> groups;
    if (!p.varlen) {
      groups.push_back({C, p.B});
    } else {
      groups.reserve(static_cast<size_t>(p.N));
      for (int64_t n = 0; n < p.N; ++n) groups.push_back({ceil_div(p.seq(n).len, 64), 1});
    }
    // Each set priced once (a varlen call has a group per sequence).
    const int64_t n_groups = static_cast<int64_t>(groups.size());
    const auto hv = static_cast<double>(p.Hv);
    double split = cp_host_split_steps(groups.data(), n_groups, hv, c.cand, sms, corrected);
    if (c.cand.count > 1) {
      const CpCandidates coarse = cp_candidates(c.cand.min_chunks, false);
      const double coarse_split = cp_host_split_steps(groups.data(), n_groups, hv, coarse, sms, corrected);
      if (!cp_fine_pays(split, coarse_split)) {
        c.cand = coarse;
        split = coarse_split;
      }
    }
    if (auto_cp && !cp_split_pays(split, cp_host_bar(groups.data(), n_groups, hv, sms))) return c;
  }
  c.enabled = true;
  c.window = static_cast<int32_t>(std::min<int64_t>(L, kCertifyMaxChunks));
  c.max_items = p.N + ceil_div(sum_c, L);
  c.max_slots = max_slots;
  c.max_splits = sum_c / (L + 1) + 1;
  const int64_t grain = c.cand.grain();
  c.per_bound = static_cast<int32_t>(std::min<int64_t>(grain, c.window));
  // Boundaries: ceil(c_n / grain) - 1 <= floor(c_n / grain) per sequence longer than L.
  c.max_bounds = p.varlen ? sum_c / grain : (C > L ? p.B * (ceil_div(C, grain) - 1) : 0);
  c.state_bytes = state_bytes;
  c.corrected = corrected;
  c.corr_bytes = corrected ? static_cast<size_t>(p.B * p.T) * p.Hv * p.K * 2 : 0;  // q~ in q's 16-bit dtype
  return c;
}

void launch_cp_bounds(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  cp_bounds_kernel<<<1, kPlanThreads, 0, stream>>>(fp.seq, c.cand.grain(), c.cand.min_chunks, c.max_bounds, t);
  FGDN_CHECK_LAUNCH("cp_bounds_kernel");
}

void launch_cp_certify(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  if (c.max_bounds == 0) return;
  const dim3 grid(static_cast<unsigned>(c.max_bounds * c.per_bound), static_cast<unsigned>(ceil_div(fp.Hv, 32)));
  launch_dependent(cp_certify_kernel, grid, dim3(kCertifyThreads), 0, stream, "cp_certify_kernel", fp, t,
                   c.cand.grain(), c.per_bound);
}

void launch_cp_plan(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  PlanStage stage;
  stage.bounds = c.max_bounds;
  stage.items = c.max_items;
  stage.slots = c.max_slots;
  stage.bound_warm = c.max_bounds * fp.Hv;
  stage.warm = c.max_slots * fp.Hv;
  // The fixed length (one candidate) takes the coarse instantiation: its pass 1 does not run.
  const auto kernel = c.cand.fine ? cp_plan_kernel<true> : cp_plan_kernel<false>;
  FGDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kPlanStageBytes)));
  launch_dependent(kernel, dim3(1), dim3(kPlanThreads), stage.fits() ? stage.bytes() : 0, stream, "cp_plan_kernel",
                   fp.seq, static_cast<int32_t>(fp.Hv), c.sms, c.corrected ? 1 : 0, c.cand, c.window, c.max_items,
                   c.max_slots, c.max_splits, stage, t);
}

template <int kD>
void launch_scan(int64_t units, int sms, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  constexpr size_t bytes = sizeof(ScanStorage<kD>);
  const int per_sm = resident_ctas_per_sm<cp_scan_kernel<kD>>(ScanTraits<kD>::kThreads, bytes);
  const int64_t grid = std::min<int64_t>(units, static_cast<int64_t>(per_sm) * sms);
  launch_dependent(cp_scan_kernel<kD>, dim3(static_cast<unsigned>(grid)), dim3(ScanTraits<kD>::kThreads), bytes,
                   stream, "cp_scan_kernel", fp, t);
}

void launch_cp_scan(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  const int64_t units = c.max_splits * fp.Hv * (fp.state_dim / 8);  // a bound: the plan has the count
  if (units == 0) return;
  if (fp.state_dim == 128)
    launch_scan<128>(units, c.sms, fp, t, stream);
  else
    launch_scan<64>(units, c.sms, fp, t, stream);
}

}  // namespace flashgdn::sm90
