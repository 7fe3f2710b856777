// Backward, step 3: the reverse state-gradient pass (sequential over the chunks, last first).
//
// One block per (sequence, value head, 32 state columns), carrying dS (fp32, [D, 32] in shared
// memory), starting from d_final_state (zero when absent). Per chunk, last to first:
//   dh[chunk] = dS                                     (gradient of the chunk's end state)
//   dV_new    = dvl + (Kn (.) exp(c_L - c)) dS         (dvl = P^T dO from chunk_prep)
//   dS       <- exp(c_L) dS + scale (Qn (.) exp(c))^T dO - W^T dV_new
// and finally dh0 = dS (zero for a negative state index). The two products of the last line
// run as one GEMM over the concatenated reduction axis [tokens of Qn/dO ; tokens of W/dV_new].
#include "cuda/chunk_bwd_internal.cuh"

namespace flashgdn::cuda::bwd {

namespace {

constexpr int kVs = 32;

template <int D, typename TQ>
__global__ void __launch_bounds__(kThreads, 1) dh_kernel(BwdParams P) {
  const int64_t n = blockIdx.x, h = blockIdx.y;
  const int v0 = blockIdx.z * kVs;
  const int64_t hq = h / P.group;
  const SeqInfo si = seq_info(P.seq, n);
  __shared__ float s_S[D * kVs];
  __shared__ float s_c[kC], s_e[kC], s_q[kC];
  const int tid = threadIdx.x;

  for (int e = tid; e < D * kVs; e += kThreads) {
    const int a = e / kVs, v = e % kVs;
    float x = 0.f;
    if (P.has_d_final_state) {  // in its dtype (fp32 | bf16 | fp16)
      const Tensor4& dht = P.d_final_state;
      const int64_t base = n * dht.s0 + h * dht.s1;
      x = load_as_float(dht.data, dht.dtype,
                        P.state_v_first ? base + (v0 + v) * dht.s2 + a : base + a * dht.s2 + v0 + v);
    }
    s_S[e] = x;
  }
  const int64_t nch = ceil_div(si.len, kC);
  const int64_t lds = P.Hq * D;
  for (int64_t j = nch - 1; j >= 0; --j) {
    const SeqChunk ch = begin_seq_chunk(P, n, h, si, j, s_c);
    const int64_t gc = ch.gc, r = ch.r;
    const int L = ch.L;
    const float cL = s_c[L - 1];
    if (tid < kC) {
      s_e[tid] = tid < L ? expf(cL - s_c[tid]) : 0.f;
      s_q[tid] = tid < L ? P.scale * expf(s_c[tid]) : 0.f;
    }
    float* dhg = P.dh + r * D * D;
    for (int e = tid; e < D * kVs; e += kThreads) dhg[(e / kVs) * D + v0 + (e % kVs)] = s_S[e];
    __syncthreads();
    const float* kn = P.kn + (gc * kC * P.Hq + hq) * D;
    const float* qn = P.qn + (gc * kC * P.Hq + hq) * D;
    float* dvg = P.dvn + r * kC * D + v0;
    block_gemm<kC, kVs, D>(
        [&](int i, int a) { return kn[i * lds + a]; },
        [&](int a, int v) { return s_S[a * kVs + v]; },
        [&](int i, int v, float x) {
          if (i < L) dvg[i * D + v] += s_e[i] * x;
        });
    __syncthreads();
    const float* Wg = P.W + r * kC * D;
    const TQ* dog = static_cast<const TQ*>(P.d_o.data) + tok_off(P.d_o, si.b, si.t0 + j * kC, h) + v0;
    const float eL = expf(cL);
    block_gemm<D, kVs, 2 * kC>(
        [&](int a, int i) { return i < kC ? s_q[i] * qn[i * lds + a] : -Wg[(i - kC) * D + a]; },
        [&](int i, int v) {
          if (i < kC) return i < L ? to_float(dog[i * P.d_o.s1 + v]) : 0.f;
          return dvg[(i - kC) * D + v];
        },
        [&](int a, int v, float x) { s_S[a * kVs + v] = eL * s_S[a * kVs + v] + x; });
  }
  __syncthreads();
  if (P.want_dh0) {
    int64_t row = n;
    if (P.has_state_indices) row = load_index(P.state_indices, P.idx_dtype, n);
    for (int e = tid; e < D * kVs; e += kThreads) {  // rounded to dh0's dtype (nearest even)
      const int a = e / kVs, v = e % kVs;
      const int64_t base = n * P.dh0.s0 + h * P.dh0.s1;
      const int64_t o = P.state_v_first ? base + (v0 + v) * P.dh0.s2 + a : base + a * P.dh0.s2 + v0 + v;
      store_from_float(P.dh0.data, P.dh0.dtype, o, row >= 0 ? s_S[e] : 0.f);
    }
  }
}

template <int D, typename TQ>
void launch_typed(DimType<D, TQ>, const BwdParams& P, cudaStream_t s) {
  dh_kernel<D, TQ><<<dim3(P.N, P.Hv, D / kVs), kThreads, 0, s>>>(P);
  FGDN_CHECK_LAUNCH("bwd dh pass");
}

}  // namespace

void launch_bwd_dh(const BwdParams& P, cudaStream_t s) {
  dispatch_dim_type(P, [&](auto c) { launch_typed(c, P, s); });
}

}  // namespace flashgdn::cuda::bwd
