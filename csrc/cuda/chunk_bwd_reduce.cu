// Backward, step 6: deterministic reductions and the per-token input transforms.
//
//  qk_reduce: dq, dk of a q/k head = sum over the Hv / Hq value heads that read it, in
//             ascending head order, then (l2norm) x^ = x r  ->  dx = r (dx^ - x^ (x^ . dx^)).
//  gate:      dg_t = sum_{i >= t} dc_i within the chunk (reverse cumulative sum, fixed order;
//             dc_summed: dc holds that sum already, as the fused kernel writes it),
//             0 where the gate was floored (g < -128); gate_in_kernel: da = dg (-exp(A_log))
//             sigmoid(a + dt_bias) (1 past 20), and the per-chunk sums of dg g (for dA_log) and
//             of da (for ddt_bias) (common/numerics.h).
//  head_sum:  dA_log[h], ddt_bias[h] = sums of the per-chunk partials over the chunk slots in a
//             fixed order (thread-strided partial sums, then a fixed tree).
#include "cuda/chunk_bwd_internal.cuh"

namespace flashgdn::cuda::bwd {

namespace {

template <int D, typename TQ>
__global__ void __launch_bounds__(kThreads) qk_reduce_kernel(BwdParams P) {
  const int64_t ls = blockIdx.x;  // the block's local slot (chunk_bwd_internal.cuh)
  const int64_t hq = blockIdx.y;
  ChunkInfo ci;
  if (!locate_chunk(P.seq, P.slot0 + ls, ci)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < ci.len; i += kThreads / 32) {
    const int64_t row = qk_row(P, ls, i, hq);
    for (int which = 0; which < 2; ++which) {
      const float* src = which == 0 ? P.dqh : P.dkh;
      const float* xn = (which == 0 ? P.qn : P.kn) + row * D;
      float d[D / 32];
#pragma unroll
      for (int u = 0; u < D / 32; ++u) d[u] = 0.f;
      for (int64_t g = 0; g < P.group; ++g) {
        const float* s = src + ((ls * P.Hv + hq * P.group + g) * kC + i) * D;
#pragma unroll
        for (int u = 0; u < D / 32; ++u) d[u] += s[lane + 32 * u];
      }
      if (P.l2norm) {
        const float rn = (which == 0 ? P.rq : P.rk)[row];
        float dot = 0.f;
#pragma unroll
        for (int u = 0; u < D / 32; ++u) dot += xn[lane + 32 * u] * d[u];
        dot = warp_sum(dot);
#pragma unroll
        for (int u = 0; u < D / 32; ++u) d[u] = rn * (d[u] - xn[lane + 32 * u] * dot);
      }
      const Tensor4& out = which == 0 ? P.dq : P.dk;
      TQ* o = static_cast<TQ*>(out.data) + tok_off(out, ci.b, ci.t0 + i, hq);
#pragma unroll
      for (int u = 0; u < D / 32; ++u) o[lane + 32 * u] = from_float<TQ>(d[u]);
    }
  }
}

__global__ void __launch_bounds__(kC) gate_kernel(BwdParams P) {
  const int64_t ls = blockIdx.x, gc = P.slot0 + ls;  // local and global chunk slot
  const int64_t h = blockIdx.y;
  const int64_t r = ls * P.Hv + h, pr = gc * P.Hv + h;  // rows of dc (the block's) and of gpart (all)
  ChunkInfo ci;
  if (!locate_chunk(P.seq, gc, ci)) {
    if (threadIdx.x == 0) P.gpart[2 * pr] = 0.f, P.gpart[2 * pr + 1] = 0.f;
    return;
  }
  __shared__ float s_dg[kC], s_pa[kC], s_pb[kC];
  const int i = threadIdx.x;
  s_dg[i] = P.dc[r * kC + i];
  __syncthreads();
  if (i == 0 && !P.dc_summed) {  // reverse cumulative sum, fixed order
    float acc = 0.f;
    for (int t = ci.len - 1; t >= 0; --t) {
      acc += s_dg[t];
      s_dg[t] = acc;
    }
  }
  __syncthreads();
  float pa = 0.f, pb = 0.f;
  if (i < ci.len) {
    const int64_t o = ci.b * P.dg.s0 + (ci.t0 + i) * P.dg.s1 + h * P.dg.s2;
    // the gate as the forward formed it; dg = 0 where it was floored (the floor's derivative)
    const int64_t og = ci.b * P.g.s0 + (ci.t0 + i) * P.g.s1 + h * P.g.s2;
    const float raw = load_as_float(P.g.data, P.g_dtype, og);
    const float x = raw + (P.gate_in_kernel && P.has_dt_bias ? P.dt_bias[h] : 0.f);
    const float g = P.gate_in_kernel ? gate_from_activation(x, P.A_log[h]) : raw;
    // The sequence's first gate scales only its initial state: with none its gradient is exactly
    // zero, which the sum gives only up to float32 cancellation (docs/reliability.md, D1).
    bool zero_start_gate = false;
    if (ci.j == 0 && i == 0) {
      zero_start_gate = !P.has_initial_state ||
                        (P.has_state_indices && load_index(P.state_indices, P.idx_dtype, ci.n) < 0);
    }
    float dg = gate_floored(g) || zero_start_gate ? 0.f : s_dg[i];
    if (P.gate_in_kernel) {
      const GateGrad gg = gate_activation_backward(dg, x, P.A_log[h], g);
      pa = gg.dA_log;  // dg * g
      dg = gg.dx;
      pb = dg;
    }
    store_from_float(P.dg.data, P.g_dtype, o, dg);
  }
  s_pa[i] = pa;
  s_pb[i] = pb;
  __syncthreads();
  if (i == 0) {
    float a = 0.f, b = 0.f;
    for (int t = 0; t < kC; ++t) a += s_pa[t], b += s_pb[t];
    P.gpart[2 * pr] = a;
    P.gpart[2 * pr + 1] = b;
  }
}

__global__ void __launch_bounds__(kThreads) head_sum_kernel(BwdParams P) {
  const int64_t h = blockIdx.x;
  __shared__ float s_a[kThreads], s_b[kThreads];
  float a = 0.f, b = 0.f;
  for (int64_t gc = threadIdx.x; gc < P.num_chunks; gc += kThreads) {
    a += P.gpart[2 * (gc * P.Hv + h)];
    b += P.gpart[2 * (gc * P.Hv + h) + 1];
  }
  s_a[threadIdx.x] = a;
  s_b[threadIdx.x] = b;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) {
      s_a[threadIdx.x] += s_a[threadIdx.x + w];
      s_b[threadIdx.x] += s_b[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    P.dA_log[h] = s_a[0];
    if (P.has_dt_bias && P.ddt_bias) P.ddt_bias[h] = s_b[0];
  }
}

template <int D, typename TQ>
void launch_typed(DimType<D, TQ>, const BwdParams& P, cudaStream_t s) {
  qk_reduce_kernel<D, TQ><<<dim3(P.slots, P.Hq), kThreads, 0, s>>>(P);
  FGDN_CHECK_LAUNCH("bwd qk_reduce");
}

}  // namespace

void launch_bwd_gate(const BwdParams& P, cudaStream_t s) {
  if (P.slots > 0) {
    gate_kernel<<<dim3(P.slots, P.Hv), kC, 0, s>>>(P);
    FGDN_CHECK_LAUNCH("bwd gate");
  }
}

void launch_bwd_reduce(const BwdParams& P, cudaStream_t s) {
  if (P.slots > 0) dispatch_dim_type(P, [&](auto c) { launch_typed(c, P, s); });
  launch_bwd_gate(P, s);
}

void launch_bwd_head_sums(const BwdParams& P, cudaStream_t s) {
  head_sum_kernel<<<P.Hv, kThreads, 0, s>>>(P);
  FGDN_CHECK_LAUNCH("bwd head_sum");
}

}  // namespace flashgdn::cuda::bwd
