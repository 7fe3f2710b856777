// Context parallelism of the Hopper forward, apart from the forward kernel itself: the layout
// from the shapes (host), the plan (one CTA: cost model, work items, slots), the gate
// certificate (a warp per segment and head) and the scan across segments (fp32).
// fwd_context_parallel.h lists the launches; docs/context-parallel.md the math and the model.
#include "sm90/fwd_context_parallel.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "cuda/chunk_index.cuh"
#include "cuda/device_utils.cuh"
#include "sm90/fwd_epilogue.cuh"
#include "sm90/fwd_load.cuh"

namespace flashgdn::sm90 {
namespace {

using cuda::ceil_div;

constexpr int kPlanThreads = 512;
constexpr int kMaxCandidates = 6;

// ---- cost model (docs/context-parallel.md) -------------------------------------------------
// Time in chunk-steps (one chunk of one chain on one SM), for chains of c_n chunks per value
// head, Hv heads, `sms` SMs and segments of L chunks (sequences of more than L chunks split).
// Every non-first segment is priced as exact (the gate is not known to the plan): phase 1 walks
// every chunk once plus those segments' transfer matrices, phase 2 walks them again.
//   over(L) = sum over split sequences of (c_n - L)     (chunks after their first segment)
//   phase 1 = waves(Hv (sum c + over), longest item min(max c, L))
//   phase 2 = waves(Hv over, L)
//   waves(work, len) = ceil(work / (sms len)) len        (CTAs of len steps, sms at a time)
// plus kCpFixedSteps for the extra launches. Without CP: waves(Hv sum c, max c).
constexpr double kCpFixedSteps = 2.0;

__host__ __device__ inline double waves(double work, double len, int sms) {
  return len <= 0 ? 0.0 : ceil(work / (sms * len)) * len;
}

__host__ __device__ inline double cp_steps(double sum_c, double max_c, double over, double L,
                                           double hv, int sms) {
  const double p1 = waves(hv * (sum_c + over), max_c < L ? max_c : L, sms);
  const double p2 = over > 0 ? waves(hv * over, L, sms) : 0.0;
  return p1 + p2 + kCpFixedSteps;
}

__device__ inline int64_t seq_chunks(const cuda::SeqLayout& s, int64_t n) {
  return ceil_div(cuda::seq_info(s, n).len, 64);
}

// ---- plan ------------------------------------------------------------------------------------
// One CTA. Pass 1 (unless L is fixed): per candidate L the cost model's inputs (sum c, max c,
// over(L)) by block reductions, then the cheapest L, if it beats no split by 10%. Pass 2: the
// items (one per unsplit sequence or segment) and slots (segments of split sequences), in
// sequence order, by block-wide exclusive scans.
__global__ void __launch_bounds__(kPlanThreads) cp_plan_kernel(cuda::SeqLayout seq, int32_t hv, int32_t sms,
                                                                int32_t min_chunks, int32_t candidates,
                                                                int64_t max_items, int64_t max_slots,
                                                                int64_t max_splits, CpTables t) {
  using Reduce = cub::BlockReduce<long long, kPlanThreads>;
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ long long stat[2 + kMaxCandidates];
  __shared__ int chosen;
  __shared__ int base[3];
  const int64_t N = seq.N;

  if (candidates == 1) {
    if (threadIdx.x == 0) chosen = min_chunks;
  } else {
    long long sum_c = 0, max_c = 0, over[kMaxCandidates] = {};
    for (int64_t n = threadIdx.x; n < N; n += kPlanThreads) {
      const long long c = seq_chunks(seq, n);
      sum_c += c;
      max_c = c > max_c ? c : max_c;
      for (int i = 0; i < candidates; ++i) {
        const long long L = static_cast<long long>(min_chunks) << i;
        over[i] += c > L ? c - L : 0;
      }
    }
    long long r = Reduce(tmp.reduce).Sum(sum_c);
    if (threadIdx.x == 0) stat[0] = r;
    __syncthreads();
    r = Reduce(tmp.reduce).Reduce(max_c, [](long long x, long long y) { return x > y ? x : y; });
    if (threadIdx.x == 0) stat[1] = r;
    for (int i = 0; i < candidates; ++i) {
      __syncthreads();
      r = Reduce(tmp.reduce).Sum(over[i]);
      if (threadIdx.x == 0) stat[2 + i] = r;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const double sc = static_cast<double>(stat[0]), mc = static_cast<double>(stat[1]);
      double best = 0.9 * waves(hv * sc, mc, sms);
      int L = INT32_MAX / 128;  // no split
      for (int i = 0; i < candidates; ++i) {
        const double over_i = static_cast<double>(stat[2 + i]);
        if (over_i <= 0) continue;
        const double cost = cp_steps(sc, mc, over_i, static_cast<double>(min_chunks << i), hv, sms);
        if (cost < best) {
          best = cost;
          L = min_chunks << i;
        }
      }
      chosen = L;
    }
  }
  if (threadIdx.x == 0) base[0] = base[1] = base[2] = 0;
  __syncthreads();
  const int64_t L = chosen;

  for (int64_t n0 = 0; n0 < N; n0 += kPlanThreads) {
    const int64_t n = n0 + threadIdx.x;
    const int64_t c = n < N ? seq_chunks(seq, n) : 0;
    const bool split = c > L;
    const int nseg = n < N ? (split ? static_cast<int>(ceil_div(c, L)) : 1) : 0;
    int item0, slot0, split0, items, slots, splits;
    Scan(tmp.scan).ExclusiveSum(nseg, item0, items);
    __syncthreads();
    Scan(tmp.scan).ExclusiveSum(split ? nseg : 0, slot0, slots);
    __syncthreads();
    Scan(tmp.scan).ExclusiveSum(split ? 1 : 0, split0, splits);
    item0 += base[0];
    slot0 += base[1];
    split0 += base[2];
    if (n < N) {
      // The bounds hold by construction (cp_layout); the checks keep a broken invariant from
      // writing past the tables.
      for (int s = 0; s < nseg && item0 + s < max_items; ++s)
        t.items[item0 + s] = make_int4(static_cast<int>(n), s, split ? slot0 + s : -1, nseg);
      if (split) {
        for (int s = 0; s < nseg && slot0 + s < max_slots; ++s)
          t.slots[slot0 + s] = make_int4(static_cast<int>(n), s, nseg, slot0);
        if (split0 < max_splits) t.splits[split0] = make_int4(static_cast<int>(n), slot0, nseg, 0);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      base[0] += items;
      base[1] += slots;
      base[2] += splits;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    t.plan[kPlanChunks] = static_cast<int32_t>(L);
    t.plan[kPlanItems] = static_cast<int32_t>(min(static_cast<int64_t>(base[0]), max_items));
    t.plan[kPlanSlots] = static_cast<int32_t>(min(static_cast<int64_t>(base[1]), max_slots));
    t.plan[kPlanSplits] = static_cast<int32_t>(min(static_cast<int64_t>(base[2]), max_splits));
  }
}

// ---- certificate -----------------------------------------------------------------------------
// A warp per (slot, value head). First segments start from h0 (warm 0). Otherwise, over the
// whole chunks before the segment (chunk w = 1, 2, .. back from its first token; lane l sums
// chunk w0 + l + 1, so 32 chunks' gates load at once), the fewest chunks W whose summed gate
// reaches kCertifyLogDecay, provided every beta in them lies in [0, 2] and the keys are
// L2-normalised in the kernel; else (or when W would exceed a segment) the exact path.
__global__ void cp_certify_kernel(const __grid_constant__ FwdParams p, CpTables t) {
  const int lane = threadIdx.x & 31;
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int32_t hv = static_cast<int32_t>(p.Hv);
  const int64_t slot = gw / hv;
  const int32_t h = static_cast<int32_t>(gw % hv);
  if (slot >= t.plan[kPlanSlots]) return;
  const int4 u = t.slots[slot];
  int32_t warm = kExactSegment;
  if (u.y == 0) {
    warm = 0;
  } else if (p.l2norm) {
    const int32_t L = t.plan[kPlanChunks];
    const cuda::SeqInfo si = cuda::seq_info(p.seq, u.x);
    const int64_t first = si.t0 + static_cast<int64_t>(u.y) * L * 64;  // the segment's first token
    float carry = 0.f;
    for (int32_t w0 = 0; w0 < L; w0 += 32) {
      const int32_t w = w0 + lane + 1;
      float g = 0.f;
      bool ok = true;
      if (w <= L) {
        const int64_t t0 = first - 64 * static_cast<int64_t>(w);
        for (int i = 0; i < 64; ++i) {
          g += token_gate(p, si.b, t0 + i, h);
          const float b = token_beta(p, si.b, t0 + i, h);
          ok = ok && b >= 0.f && b <= 2.f;
        }
      }
      const float decay = carry + cuda::warp_inclusive_scan(g);
      const uint32_t bad = __ballot_sync(0xffffffffu, !ok);
      const uint32_t reached = __ballot_sync(0xffffffffu, w <= L && decay <= kCertifyLogDecay);
      // The first chunk that reaches the bound counts only if no chunk up to it is refused.
      const uint32_t first_reached = reached & (0u - reached);
      if (first_reached != 0 && (bad & ((first_reached << 1) - 1u)) == 0) {
        warm = w0 + __ffs(first_reached);
        break;
      }
      if (bad != 0) break;
      carry = __shfl_sync(0xffffffffu, decay, 31);
    }
  }
  if (lane == 0) t.warm[slot * hv + h] = warm;
}

// ---- scan ------------------------------------------------------------------------------------
// A CTA per (split sequence, value head, 16 state columns), 256 threads: thread (rows
// 8 (tid / 16) .. + 7, column tid % 16). Along the sequence's segments s = 1, 2, ..:
//   S_end(s) = M_s S_end(s - 1) + N_s   (exact segment: N_s and M_s from phase 1)
//   S_end(s) = E_s                      (first or warm-up segment: its own end state)
// in fp32, each exact S_end(s) written back over N_s for phase 2 of segment s + 1; the last
// one is the sequence's final state (ht or the pool row, in its dtype and layout). M_s passes
// through shared memory 64 columns at a time (coalesced loads; rows padded so that the float4
// reads along k do not conflict).
template <int kD>
__global__ void __launch_bounds__(256) cp_scan_kernel(const __grid_constant__ FwdParams p, CpTables t) {
  constexpr int kCols = 16, kBlocksPerHead = kD / kCols, kRows = kD / 16, kHalf = 64;
  __shared__ float S[kD][kCols];
  __shared__ __align__(16) float Ms[kD][kHalf + 4];
  const int32_t hv = static_cast<int32_t>(p.Hv);
  const int64_t unit = blockIdx.x / kBlocksPerHead;
  const int col0 = static_cast<int>(blockIdx.x % kBlocksPerHead) * kCols;
  const int64_t sid = unit / hv;
  const int32_t h = static_cast<int32_t>(unit % hv);
  if (sid >= t.plan[kPlanSplits]) return;
  const int4 u = t.splits[sid];  // {n, first slot, segments}
  const int c = threadIdx.x % kCols, r0 = (threadIdx.x / kCols) * kRows;
  auto at = [&](float* base, int64_t slot, int row) { return base + ((slot * hv + h) * kD + row) * kD; };

  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = at(p.cp.ends, u.y, r0 + r)[col0 + c];
  for (int s = 1; s < u.z; ++s) {
    const int64_t slot = u.y + s;
    __syncthreads();  // the previous step's reads of S are done
#pragma unroll
    for (int r = 0; r < kRows; ++r) S[r0 + r][c] = acc[r];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = at(p.cp.ends, slot, r0 + r)[col0 + c];
    if (t.warm[slot * hv + h] != kExactSegment) continue;
    for (int k0 = 0; k0 < kD; k0 += kHalf) {
      __syncthreads();  // S written; the previous half's reads of Ms done
      for (int i = threadIdx.x; i < kD * kHalf / 4; i += 256) {
        const int row = i / (kHalf / 4), q = i % (kHalf / 4);
        *reinterpret_cast<float4*>(&Ms[row][4 * q]) =
            *reinterpret_cast<const float4*>(at(p.cp.trans, slot, row) + k0 + 4 * q);
      }
      __syncthreads();
      for (int k = 0; k < kHalf; k += 4) {
        const float s0 = S[k0 + k][c], s1 = S[k0 + k + 1][c], s2 = S[k0 + k + 2][c], s3 = S[k0 + k + 3][c];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float4 m = *reinterpret_cast<const float4*>(&Ms[r0 + r][k]);
          acc[r] = fmaf(m.x, s0, fmaf(m.y, s1, fmaf(m.z, s2, fmaf(m.w, s3, acc[r]))));
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) at(p.cp.ends, slot, r0 + r)[col0 + c] = acc[r];
  }
  if (!p.write_final) return;
  StateRef dst = p.ht;
  int64_t row = u.x;
  if (p.state_idx != nullptr) {
    dst = p.h0;
    row = cuda::load_index(p.state_idx, p.state_idx_dtype, u.x);
  }
  if (row < 0 || dst.data == nullptr) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    cuda::store_from_float(dst.data, dst.dtype, state_offset(dst, row, h, r0 + r, col0 + c, p.v_first), acc[r]);
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
    c.min_chunks = static_cast<int32_t>(std::min<int64_t>(p.cp_segment / 64, INT32_MAX / 128));
    c.candidates = 1;
  } else {
    // Candidates from half the balanced load up (shorter segments cannot pay for their joins).
    int64_t L = 4;
    while (2 * L <= balanced / 2) L *= 2;
    c.min_chunks = static_cast<int32_t>(L);
    c.candidates = kMaxCandidates;
  }
  const bool worth = longest >= 2 * balanced && longest > c.min_chunks;
  if (p.context_parallel == FGDN_CONTEXT_PARALLEL_AUTO && !worth) return c;
  c.enabled = true;
  const int64_t L = c.min_chunks;
  // Items: ceil(c_n / L) <= c_n / L + 1 per sequence. Slots: split sequences have c_n > L, so
  // sum ceil(c_n / L) < 2 sum c_n / L (dense: exactly B ceil(C / L) when C > L).
  c.max_items = p.N + ceil_div(sum_c, L);
  c.max_slots = p.varlen ? 2 * ceil_div(sum_c, L) : (ceil_div(p.T, 64) > L ? p.B * ceil_div(ceil_div(p.T, 64), L) : 0);
  c.max_splits = sum_c / (L + 1) + 1;
  c.state_bytes = static_cast<size_t>(c.max_slots) * p.Hv * p.K * p.K * sizeof(float);
  return c;
}

void launch_cp_plan(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  cp_plan_kernel<<<1, kPlanThreads, 0, stream>>>(fp.seq, static_cast<int32_t>(fp.Hv), c.sms, c.min_chunks,
                                                  c.candidates, c.max_items, c.max_slots, c.max_splits, t);
  FGDN_CHECK_LAUNCH("cp_plan_kernel");
}

void launch_cp_certify(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  const int64_t warps = c.max_slots * fp.Hv;
  if (warps == 0) return;
  cp_certify_kernel<<<static_cast<unsigned>(ceil_div(warps, 4)), 128, 0, stream>>>(fp, t);
  FGDN_CHECK_LAUNCH("cp_certify_kernel");
}

void launch_cp_scan(const CpLayout& c, const FwdParams& fp, const CpTables& t, cudaStream_t stream) {
  const int64_t units = c.max_splits * fp.Hv * (fp.state_dim / 16);
  if (units == 0) return;
  if (fp.state_dim == 128)
    cp_scan_kernel<128><<<static_cast<unsigned>(units), 256, 0, stream>>>(fp, t);
  else
    cp_scan_kernel<64><<<static_cast<unsigned>(units), 256, 0, stream>>>(fp, t);
  FGDN_CHECK_LAUNCH("cp_scan_kernel");
}

}  // namespace flashgdn::sm90
