// Per-token preprocessing: in-chunk cumulative gate, beta to fp32, q/k inverse L2 norms.
#include "cuda/preprocess.cuh"

#include "cuda/chunk_index.cuh"
#include "cuda/device_utils.cuh"

namespace flashgdn::cuda {
namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct GateParams {
  SeqLayout seq;
  const void* g;  // g, or the raw activation a with gate_in_kernel
  int32_t g_dtype;
  int64_t gs0, gs1, gs2;
  const void* beta;
  int32_t beta_dtype;
  int64_t bs0, bs1, bs2;
  const float* A_log;    // gate_in_kernel only
  const float* dt_bias;  // optional
  int32_t gate_in_kernel;
  int64_t Hv;
  float* gcum;
  float* beta_out;
};

// grid (chunk slots, ceil(Hv / 4)), 128 threads: one warp per (chunk, value head).
__global__ void __launch_bounds__(128) gate_cumsum_kernel(const GateParams p) {
  ChunkInfo c;
  if (!locate_chunk(p.seq, blockIdx.x, c)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * 4 + warp;
  if (h >= p.Hv) return;
  const int64_t NT = p.seq.B * p.seq.T;
  float gv[2], bv[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = lane + 32 * u;
    gv[u] = 0.f;
    bv[u] = 0.f;
    if (i < c.len) {
      const int64_t t = c.t0 + i;
      float g = load_as_float(p.g, p.g_dtype, c.b * p.gs0 + t * p.gs1 + h * p.gs2);
      if (p.gate_in_kernel)
        g = gate_from_activation(g + (p.dt_bias ? p.dt_bias[h] : 0.f), p.A_log[h]);
      gv[u] = gate_floor(g);  // a reset (g = -inf) keeps the sums finite (common/numerics.h)
      bv[u] = load_as_float(p.beta, p.beta_dtype, c.b * p.bs0 + t * p.bs1 + h * p.bs2);
    }
  }
  const float s0 = warp_inclusive_scan(gv[0]);
  const float s1 = warp_inclusive_scan(gv[1]) + __shfl_sync(0xffffffffu, s0, 31);
  const float cs[2] = {s0, s1};
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = lane + 32 * u;
    if (i < c.len) {
      const int64_t f = c.b * p.seq.T + c.t0 + i;
      p.gcum[h * NT + f] = cs[u];
      p.beta_out[h * NT + f] = bv[u];
    }
  }
}

struct NormParams {
  const void* x;
  int32_t dtype;
  int64_t s0, s1, s2;
  int64_t T, H, D, rows;  // rows = B * T * H
  float* r;               // [H][B*T]
};

// Elements of a row per lane: the CUDA head dims are at most 128 = 32 * 4.
constexpr int kMaxPerLane = 4;

// One warp per (token, head) row: r = 1 / sqrt(sum x^2 + 1e-6).
__global__ void __launch_bounds__(256) l2norm_factor_kernel(const NormParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= p.rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t f = row / p.H, h = row % p.H;
  const int64_t b = f / p.T, t = f % p.T;
  const int64_t base = b * p.s0 + t * p.s1 + h * p.s2;
  float x[kMaxPerLane];
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u) {
    const int64_t d = lane + 32 * u;
    x[u] = d < p.D ? load_as_float(p.x, p.dtype, base + d) : 0.f;
  }
  const float r = warp_l2norm_rnorm(x);
  if (lane == 0) p.r[h * (p.rows / p.H) + f] = r;
}

}  // namespace

size_t prep_workspace_bytes(const Problem& p) {
  const size_t nt = static_cast<size_t>(p.B * p.T);
  size_t b = 2 * align_up(nt * p.Hv * sizeof(float));
  if (p.l2norm) b += 2 * align_up(nt * p.Hq * sizeof(float));
  return b;
}

PrepBuffers prep_carve(const Problem& p, void* ws) {
  const size_t nt = static_cast<size_t>(p.B * p.T);
  char* c = static_cast<char*>(ws);
  PrepBuffers pb;
  pb.gcum = reinterpret_cast<float*>(c);
  c += align_up(nt * p.Hv * sizeof(float));
  pb.beta = reinterpret_cast<float*>(c);
  c += align_up(nt * p.Hv * sizeof(float));
  if (p.l2norm) {
    pb.rq = reinterpret_cast<float*>(c);
    c += align_up(nt * p.Hq * sizeof(float));
    pb.rk = reinterpret_cast<float*>(c);
  }
  return pb;
}

void launch_preprocess(const Problem& p, const fgdn_inputs& in, const PrepBuffers& pb,
                       cudaStream_t stream) {
  if (p.B * p.T == 0) return;
  GateParams gp{};
  gp.seq = make_seq_layout(p, in);
  gp.g = in.g.data;
  gp.g_dtype = in.g.dtype;
  gp.gs0 = in.g.strides[0];
  gp.gs1 = in.g.strides[1];
  gp.gs2 = in.g.strides[2];
  gp.beta = in.beta.data;
  gp.beta_dtype = in.beta.dtype;
  gp.bs0 = in.beta.strides[0];
  gp.bs1 = in.beta.strides[1];
  gp.bs2 = in.beta.strides[2];
  gp.gate_in_kernel = p.gate_in_kernel ? 1 : 0;
  gp.A_log = p.gate_in_kernel ? static_cast<const float*>(in.A_log.data) : nullptr;
  gp.dt_bias = (p.gate_in_kernel && p.has_dt_bias) ? static_cast<const float*>(in.dt_bias.data)
                                                   : nullptr;
  gp.Hv = p.Hv;
  gp.gcum = pb.gcum;
  gp.beta_out = pb.beta;
  const int64_t slots = num_chunk_slots(gp.seq);
  if (slots > 0) {
    dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(ceil_div(p.Hv, 4)));
    gate_cumsum_kernel<<<grid, 128, 0, stream>>>(gp);
    FGDN_CHECK_LAUNCH("gate_cumsum_kernel");
  }
  if (p.l2norm) {
    for (int which = 0; which < 2; ++which) {
      const fgdn_tensor& x = which == 0 ? in.q : in.k;
      NormParams np{};
      np.x = x.data;
      np.dtype = x.dtype;
      np.s0 = x.strides[0];
      np.s1 = x.strides[1];
      np.s2 = x.strides[2];
      np.T = p.T;
      np.H = p.Hq;
      np.D = p.K;
      np.rows = p.B * p.T * p.Hq;
      np.r = which == 0 ? pb.rq : pb.rk;
      l2norm_factor_kernel<<<static_cast<unsigned>(ceil_div(np.rows, 8)), 256, 0, stream>>>(np);
      FGDN_CHECK_LAUNCH("l2norm_factor_kernel");
    }
  }
}

}  // namespace flashgdn::cuda
