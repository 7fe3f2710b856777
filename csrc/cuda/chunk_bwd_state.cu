// Backward, step 1: the chunk-start states h (fp32, [slot, Hv, K, V]) of every chunk.
//
// The Hopper forward computes them (sm90::chunk_states): run without o, it checkpoints the state
// after every chunk, and the state after chunk j of sequence n is the start state of chunk j + 1,
// so its checkpoint rows start at first_row[n] = slot(n, 0) + 1 and land on slot(n, j + 1). The
// end of a sequence's last chunk lands on a surplus slot (varlen), on the next sequence's first
// slot (dense) or on the extra row past the last slot: start_states_kernel, launched after the
// forward on the same stream, writes every sequence's first slot with its initial state.
#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/fwd_launch.h"

namespace flashgdn::cuda::bwd {

namespace {

__global__ void first_rows_kernel(SeqLayout seq, int64_t* first_row) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= seq.N) return;
  first_row[n] = chunk_slot(seq, n, 0, seq_info(seq, n).t0) + 1;
}

// h[slot(n, 0)] = the initial state of sequence n in [K, V] order (its pool row, read exactly in
// its dtype; zero without one or for a negative index), in h's dtype (states_in_bf16: rounded to
// nearest, as the states pass rounds its rows). A block per (sequence, value head, part of
// kStartThreads kStartPerThread elements), a thread's loads in flight together: one element at a
// time, a block a head took ~37 us of load latency (16/64 and 2/8 alike).
constexpr int kStartThreads = 256, kStartPerThread = 8;
template <typename TH>
__global__ void __launch_bounds__(kStartThreads) start_states_kernel(BwdParams P) {
  const int64_t n = blockIdx.x, h = blockIdx.y;
  const SeqInfo si = seq_info(P.seq, n);
  if (si.len == 0) return;
  int64_t row = -1;
  if (P.has_initial_state) row = P.has_state_indices ? load_index(P.state_indices, P.idx_dtype, n) : n;
  const int d = static_cast<int>(P.D), count = d * d;
  TH* out = reinterpret_cast<TH*>(P.h) + (chunk_slot(P.seq, n, 0, si.t0) * P.Hv + h) * count;
  const int first = blockIdx.z * kStartThreads * kStartPerThread + threadIdx.x;
  float x[kStartPerThread];
#pragma unroll
  for (int k = 0; k < kStartPerThread; ++k) {
    const int e = first + k * kStartThreads;
    x[k] = 0.f;
    if (row >= 0 && e < count) {
      const int a = e / d, v = e - a * d;
      const int64_t base = row * P.h0.s0 + h * P.h0.s1;
      x[k] = load_as_float(P.h0.data, P.h0.dtype, P.state_v_first ? base + v * P.h0.s2 + a : base + a * P.h0.s2 + v);
    }
  }
#pragma unroll
  for (int k = 0; k < kStartPerThread; ++k) {
    const int e = first + k * kStartThreads;
    if (e < count) out[e] = from_float<TH>(x[k]);
  }
}

template <typename TH>
void launch_start_states(const BwdParams& P, cudaStream_t s, const char* what) {
  const int64_t parts = ceil_div(P.D * P.D, int64_t{kStartThreads} * kStartPerThread);
  const dim3 grid(static_cast<unsigned>(P.N), static_cast<unsigned>(P.Hv), static_cast<unsigned>(parts));
  start_states_kernel<TH><<<grid, kStartThreads, 0, s>>>(P);
  FGDN_CHECK_LAUNCH(what);
}

}  // namespace

size_t states_workspace_bytes(const Problem& p, const fgdn_inputs& in) {
  return sm90::chunk_states_workspace_bytes(p, in);
}

void launch_bwd_states(const Problem& p, const fgdn_inputs& in, const BwdParams& P, bool h16, int64_t* first_row,
                       void* fwd_workspace, cudaStream_t s) {
  if (P.N == 0) return;
  first_rows_kernel<<<static_cast<unsigned>(ceil_div(P.N, 256)), 256, 0, s>>>(P.seq, first_row);
  FGDN_CHECK_LAUNCH("bwd first_rows_kernel");
  // `high` states (within ~5e-6 of the float64 ones) keep the staged backward's gradients at
  // their output's rounding floor at `default` and `high`; the `fast` level takes the `fast`
  // kernel's states (0.65 ms less at 16/64 1x32768; dq 3.1e-3 -> 4.0e-3, dk 4.9e-3 -> 5.3e-3, dg
  // 3.8e-3 -> 4.6e-3: bench/NOTES.md, step 14), and so does the fused backward (bf16 h) at both of
  // its levels (forward + backward 16/64 1x32768 -11%: results/h200-2026-11-29/
  // default-fast-states.md). Its 16-bit staging sets most of its errors' scale, but dg's largest
  // term is the states': `default`'s dg is 1.08x FlashQLA's error in the side-by-side run
  // (flashqla-side-by-side.md), 0.56x on `high` states.
  const bool fast = P.precision_fast != 0 || h16;
  const sm90::Precision level = fast ? sm90::Precision::kFast : sm90::Precision::kHigh;
  sm90::chunk_states(p, in, level, P.h, h16 ? FGDN_BFLOAT16 : FGDN_FLOAT32, first_row, fwd_workspace, s);
  if (h16) launch_start_states<__nv_bfloat16>(P, s, "bwd start_states_kernel");
  else launch_start_states<float>(P, s, "bwd start_states_kernel");
}

size_t saving_forward_workspace_bytes(const Problem& p, const fgdn_fwd_args& a) {
  return align256(static_cast<size_t>(p.N) * sizeof(int64_t)) + sm90::forward_with_states_workspace_bytes(p, a);
}

// The forward that also writes the backward's chunk-start states into a.saved_states: the rows
// as launch_bwd_states writes them, by the kernel the fused backward's states pass takes (`fast`
// at both of its levels: o is then the forward's own at `default` too), then every sequence's
// first slot from its initial state. No state_indices (validation): a pool written back by the
// forward would be read after it.
void forward_saving_states(const Problem& p, const fgdn_fwd_args& a, void* workspace, cudaStream_t s) {
  if (p.N == 0) return;
  BwdParams P{};
  P.N = p.N;
  P.Hv = p.Hv;
  P.D = p.K;
  P.seq = make_seq_layout(p, a.in);
  P.h = static_cast<float*>(a.saved_states.data);  // bf16 rows (start_states_kernel<bf16>)
  P.has_initial_state = p.has_initial_state;
  P.h0 = tensor4(a.in.initial_state);
  P.state_v_first = p.state_v_first;
  auto* first_row = static_cast<int64_t*>(workspace);
  char* fwd_ws = static_cast<char*>(workspace) + align256(static_cast<size_t>(p.N) * sizeof(int64_t));
  first_rows_kernel<<<static_cast<unsigned>(ceil_div(P.N, 256)), 256, 0, s>>>(P.seq, first_row);
  FGDN_CHECK_LAUNCH("forward first_rows_kernel");
  sm90::forward_with_states(p, a, sm90::Precision::kFast, a.saved_states.data, first_row, fwd_ws, s);
  launch_start_states<__nv_bfloat16>(P, s, "forward start_states_kernel");
}

}  // namespace flashgdn::cuda::bwd
