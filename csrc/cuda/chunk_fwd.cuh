// CUDA chunked forward of the gated delta rule (chunk 64, sm_90a).
//
// One fused kernel per (sequence, value head, V-slice of 64 columns) walks that sequence's
// chunks in order, holding its slice of the fp32 state S [K, 64] in registers. Per chunk
// (gdn-math section 3, gated form, exponents only as differences c_i - c_j <= 0):
//   A   = strict_lower(diag(beta) (Kn Kn^T) (.) D)        Kn = diag(rk) K (l2norm) or K
//   T   = (I + A)^-1                                       fp32 forward substitution
//   Y   = diag(beta) (V - diag(exp(c)) Kn S)
//   Vn  = T Y                                              (= U - W S)
//   O   = scale [ diag(exp(c)) Qn S + lower(Qn Kn^T (.) D) Vn ]
//   S  <- exp(c_last) S + Kn^T diag(exp(c_last - c)) Vn
// Nothing per chunk goes to memory in inference. The training launcher below additionally
// saves each chunk's START state (and optionally T) for the backward.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/problem.h"
#include "cuda/preprocess.cuh"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda {

// Outputs of one forward run. Every pointer may be null (that output is skipped).
struct ChunkFwdOutputs {
  // o [B, T, Hv, V] in q's dtype (strides in elements, from the fgdn_tensor).
  fgdn_tensor o{};
  // Final state S_T: [N, Hv, K, V] fp32 (or [N, Hv, V, K] with p.state_v_first) when
  // write_final; with p.has_state_indices it goes back into the pool (in.initial_state) at
  // row state_indices[n] (skipped for a negative index) and final_state is ignored.
  bool write_final = false;
  fgdn_tensor final_state{};
  // Interior checkpoints every p.checkpoint_every tokens (row offset_n + j, computed on the
  // device), layout as final_state. Skipped when data is null or p.checkpoint_every == 0.
  fgdn_tensor checkpoints{};
  // Training: the state at the START of every chunk, fp32, contiguous
  //   h_chunks[slot][Hv][K][V]   (always K-major, regardless of state_v_first)
  // slot = global chunk id (chunk_index.cuh; num_chunk_slots(p) rows; surplus slots untouched).
  float* h_chunks = nullptr;
  // Training, optional: the gated T = (I + A)^-1 of every chunk, fp32, contiguous
  //   T_chunks[slot][Hv][64][64] (row i, column j; zero above the diagonal, unit diagonal;
  //   rows/cols past the chunk's length are those of the identity).
  float* T_chunks = nullptr;
};

// The whole forward (preprocess + fused kernel) with its own workspace:
// chunk_fwd_workspace_bytes(p) bytes = the preprocess buffers at offset 0 (layout in
// preprocess.cuh) + int64 checkpoint row offsets [N] (varlen with checkpoints).
size_t chunk_fwd_workspace_bytes(const Problem& p);
void launch_chunk_fwd_ws(const Problem& p, const fgdn_inputs& in, void* workspace,
                         const ChunkFwdOutputs& out, cudaStream_t stream);

// The fused kernel alone: requires launch_preprocess to have filled pb on the same stream.
// (Varlen checkpoints need launch_chunk_fwd_ws.)
void launch_chunk_fwd(const Problem& p, const fgdn_inputs& in, const PrepBuffers& pb,
                      const ChunkFwdOutputs& out, cudaStream_t stream);

// ---- for the backward: recompute and save the chunk-start states ----------------------------
// Workspace for launch_recompute_h: the preprocess buffers (layout in preprocess.cuh) at
// offset 0, prep_workspace_bytes(p) bytes. After the call they stay valid (gcum, beta, rq,
// rk) and the backward may read them.
size_t recompute_h_workspace_bytes(const Problem& p);
// Runs preprocess + the forward with only h_chunks (and T_chunks if non-null) written
// (no o, no final state, no checkpoints). h_chunks: num_chunk_slots(p) * Hv * K * V floats.
void launch_recompute_h(const Problem& p, const fgdn_inputs& in, void* workspace,
                        float* h_chunks, float* T_chunks, cudaStream_t stream);

}  // namespace flashgdn::cuda
