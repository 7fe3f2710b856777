// CUDA backward of the chunked gated delta rule (chunk 64), sm_90a.
//
// launch_backward recomputes the chunk-start states with the Hopper forward (chunk_bwd_state.cu:
// sm90::chunk_states at `high`, no o), prepares every chunk (chunk_bwd_prep.cu: T, W, V_new and
// the local dv), runs a reverse sequential pass over the chunks of every
// (sequence, value head) carrying dS in fp32, computes the per-chunk gradients in parallel and
// reduces dq/dk over the value heads of a GVA group (and dA_log / ddt_bias) deterministically,
// in a fixed order.
// No floating-point atomics, no host synchronisation (graph capturable), int64 offsets.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda {

// Device scratch launch_backward needs, in bytes (a multiple of 256).
size_t backward_workspace_bytes(const flashgdn::Problem& p, const fgdn_bwd_args& a);

// Writes every output tensor of a (dq, dk, dv, dg, dbeta, dA_log / ddt_bias when
// gate_in_kernel, dh0 when given). workspace: at least backward_workspace_bytes(p, a) bytes of
// device memory, 256-byte aligned. Asynchronous on stream; errors of launches are reported
// through the usual CUDA error state (the caller checks cudaGetLastError()).
void launch_backward(const flashgdn::Problem& p, const fgdn_bwd_args& a, void* workspace,
                     cudaStream_t stream);

}  // namespace flashgdn::cuda
