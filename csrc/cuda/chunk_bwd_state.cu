// Backward, step 2: the forward state pass (sequential over the chunks of a sequence).
//
// One block per (sequence, value head, 32 state columns): the columns of S are independent
// (V_new[:, v] depends only on S[:, v]). Per chunk, in order:
//   h[chunk] = S ;  V_new = U - W S ;  S <- exp(c_L) S + (Kn (.) exp(c_L - c))^T V_new
// starting from the initial state (pool row state_indices[n]; zero for a negative index or
// none). Matrix products on tensor cores with split-bf16 operands (about fp32 accuracy).
#include "cuda/chunk_bwd_internal.cuh"

namespace flashgdn::cuda::bwd {

namespace {

constexpr int kVs = 32;  // state columns per block

template <int D>
__global__ void __launch_bounds__(kThreads) state_kernel(BwdParams P) {
  const int64_t n = blockIdx.x, h = blockIdx.y;
  const int v0 = blockIdx.z * kVs;
  const int64_t hq = h / P.group;
  const SeqInfo si = seq_info(P.seq, n);
  __shared__ float s_S[D * kVs];
  __shared__ float s_c[kC], s_e[kC];
  const int tid = threadIdx.x;

  int64_t row = -1;
  if (P.has_initial_state) row = P.has_state_indices ? load_index(P.state_indices, P.idx_dtype, n) : n;
  for (int e = tid; e < D * kVs; e += kThreads) {
    const int a = e / kVs, v = e % kVs;
    float x = 0.f;
    if (row >= 0) {  // the initial state in its dtype (fp32 | bf16 | fp16), exactly to float
      const int64_t base = row * P.h0.s0 + h * P.h0.s1;
      x = load_as_float(P.h0.data, P.h0.dtype,
                        P.state_v_first ? base + (v0 + v) * P.h0.s2 + a : base + a * P.h0.s2 + v0 + v);
    }
    s_S[e] = x;
  }
  const int64_t nch = ceil_div(si.len, kC);
  const int64_t lds = P.Hq * D;
  for (int64_t j = 0; j < nch; ++j) {
    const SeqChunk ch = begin_seq_chunk(P, n, h, si, j, s_c);
    const int64_t gc = ch.gc, r = ch.r;
    const int L = ch.L;
    const float cL = s_c[L - 1];
    if (tid < kC) s_e[tid] = tid < L ? expf(cL - s_c[tid]) : 0.f;
    float* hg = P.h + r * D * D;
    for (int e = tid; e < D * kVs; e += kThreads) hg[(e / kVs) * D + v0 + (e % kVs)] = s_S[e];
    const float* Wg = P.W + r * kC * D;
    float* vng = P.vn + r * kC * D + v0;
    block_gemm<kC, kVs, D>(
        [&](int i, int a) { return Wg[i * D + a]; },
        [&](int a, int v) { return s_S[a * kVs + v]; },
        [&](int i, int v, float x) { vng[i * D + v] -= x; });
    __syncthreads();
    const float* kn = P.kn + (gc * kC * P.Hq + hq) * D;
    const float eL = expf(cL);
    block_gemm<D, kVs, kC>(
        [&](int a, int i) { return s_e[i] * kn[i * lds + a]; },
        [&](int i, int v) { return vng[i * D + v]; },
        [&](int a, int v, float x) { s_S[a * kVs + v] = eL * s_S[a * kVs + v] + x; });
  }
}

}  // namespace

void launch_bwd_state(const BwdParams& P, cudaStream_t s) {
  if (P.D == 64)
    state_kernel<64><<<dim3(P.N, P.Hv, 64 / kVs), kThreads, 0, s>>>(P);
  else
    state_kernel<128><<<dim3(P.N, P.Hv, 128 / kVs), kThreads, 0, s>>>(P);
  FGDN_CHECK_LAUNCH("bwd state pass");
}

}  // namespace flashgdn::cuda::bwd
