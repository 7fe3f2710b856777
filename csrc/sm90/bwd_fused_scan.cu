// The fused backward's step 3b (bwd_fused.cu): the reverse CP scan over each chain's segments.
#include "cuda/bwd_dh_plan.h"
#include "sm90/bwd_fused.h"
#include "sm90/bwd_fused_scheduler.cuh"

namespace flashgdn::cuda::bwd {

namespace {

namespace fk = sm90::fused_bwd;
constexpr int kD = 128;

// Per (sequence, value head, 8 columns of the carry): X = the seed phase 1's walk of the last
// segment S - 1 left for S - 2, then for the segments s = S - 2 .. 1: X = A_s X + B_s (fp32), the
// carry at segment s - 1's end, to the seed of s - 1 (nothing to do for S <= 2). The carry's columns
// evolve independently (every product of the walk multiplies dS from the left), so 16 CTAs share
// a chain. A thread: one column, rows r0 + 32 j; A_s's rows padded to 132 floats so that a warp's
// four consecutive rows are four float4s in distinct banks.
constexpr int kScanCols = 8, kScanThreads = 256, kScanRows = kD * kScanCols / kScanThreads, kScanLd = kD + 4;
struct ScanSmem {
  float a[kD][kScanLd];
  float x[kD][kScanCols];
};

__global__ void __launch_bounds__(kScanThreads, 3) fused_cp_scan_kernel(fk::Params K) {
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y, tid = threadIdx.x;
  const int total = static_cast<int>(ceil_div(seq_info(K.seq, n).len, int64_t{kC}));
  const int len = K.cut.chunks(total), segs = (total + len - 1) / len;
  if (segs <= 2) return;
  auto& S = dynamic_smem_1024<ScanSmem>();
  const int col = tid % kScanCols, v = blockIdx.z * kScanCols + col, r0 = tid / kScanCols;
  // The chain's first matrix; a matrix at its offset within the chain (bwd_dh_plan.h).
  const size_t chain = (size_t(n) * K.Hv + h) * fused_cp_per_chain(K.segments);
  float x[kScanRows];
  // The seed of segments - 2, written so (fused_cp_seed is linear) because ptxas spilled 4 bytes
  // at 80 registers for fused_cp_seed(segs - 2).
  const float* last_seed = K.cp + (chain + fused_cp_seed(segs) - fused_cp_seed(2)) * kD * kD;
#pragma unroll
  for (int j = 0; j < kScanRows; ++j) {
    x[j] = last_seed[(r0 + 32 * j) * kD + v];
    S.x[r0 + 32 * j][col] = x[j];
  }
  const int u_first = static_cast<int>(chunk_slot(K.seq, n, 0, seq_info(K.seq, n).t0)) * K.Hv + h;
  // Segment s's B_s rows of this thread's column and whether A_s counts (the certificate), fetched
  // a segment ahead, in flight under the product before: the B_s rows and the lane's first bound
  // issued before the product, the certificate's sum formed after it (formed before, it waited out
  // its loads there: 22% of the scan's stall samples, walk-start.md). A_s to the shared tile a half
  // at a time, each half's loads in flight together (a load at a time, a segment waited out ~20
  // latencies). Three CTAs an SM (the shared tiles allow three): 80 registers, the product
  // unrolled twice.
  constexpr int kALoads = kD * kD / 4 / kScanThreads, kAPart = kALoads / 2;
  float nb[kScanRows];
  const auto fetch = [&](int s) {
    const float* Bm = K.cp + (chain + fused_cp_map(s, 0)) * kD * kD;
#pragma unroll
    for (int j = 0; j < kScanRows; ++j) nb[j] = __ldg(Bm + (r0 + 32 * j) * kD + v);
    return fk::transfer_bound_first(K.bound, u_first + s * len * K.Hv, min(total - s * len, len), K.Hv);
  };
  const auto needed = [&](int s, float first) {
    return !fk::transfer_negligible_from(first, K.bound, u_first + s * len * K.Hv, min(total - s * len, len), K.Hv);
  };
  bool need_next = needed(segs - 2, fetch(segs - 2));
  for (int s = segs - 2; s >= 1; --s) {
    const bool need = need_next;
#pragma unroll
    for (int j = 0; j < kScanRows; ++j) x[j] = nb[j];
    if (need) {
      const float4* A = reinterpret_cast<const float4*>(K.cp + (chain + fused_cp_map(s, 1)) * kD * kD);
#pragma unroll
      for (int part = 0; part < kALoads / kAPart; ++part) {
        float4 a[kAPart];
#pragma unroll
        for (int j = 0; j < kAPart; ++j) a[j] = __ldg(A + tid + (part * kAPart + j) * kScanThreads);
#pragma unroll
        for (int j = 0; j < kAPart; ++j) {
          const int e = tid + (part * kAPart + j) * kScanThreads;
          *reinterpret_cast<float4*>(&S.a[e / (kD / 4)][4 * (e % (kD / 4))]) = a[j];
        }
      }
    }
    __syncthreads();  // A_s and X in shared memory
    const float first = s > 1 ? fetch(s - 1) : 0.f;
    if (need) {
#pragma unroll 2
      for (int k = 0; k < kD; k += 4) {
        const float x0 = S.x[k][col], x1 = S.x[k + 1][col], x2 = S.x[k + 2][col], x3 = S.x[k + 3][col];
#pragma unroll
        for (int j = 0; j < kScanRows; ++j) {
          const float4 a = *reinterpret_cast<const float4*>(&S.a[r0 + 32 * j][k]);
          x[j] = fmaf(a.w, x3, fmaf(a.z, x2, fmaf(a.y, x1, fmaf(a.x, x0, x[j]))));
        }
      }
    }
    if (s > 1) need_next = needed(s - 1, first);
    __syncthreads();  // every read of X and A_s done
    float* seed = K.cp + (chain + fused_cp_seed(s - 1)) * kD * kD;
#pragma unroll
    for (int j = 0; j < kScanRows; ++j) {
      S.x[r0 + 32 * j][col] = x[j];
      seed[(r0 + 32 * j) * kD + v] = x[j];
    }
  }
}

}  // namespace

void launch_fused_cp_scan(const sm90::fused_bwd::Params& K, int64_t N, int64_t Hv, cudaStream_t s) {
  constexpr size_t kScanSmem = dynamic_smem_1024_bytes<ScanSmem>();
  set_dynamic_smem(fused_cp_scan_kernel, kScanSmem);
  fused_cp_scan_kernel<<<dim3(N, Hv, kD / kScanCols), kScanThreads, kScanSmem, s>>>(K);
  FGDN_CHECK_LAUNCH("bwd fused (CP scan)");
}

}  // namespace flashgdn::cuda::bwd
