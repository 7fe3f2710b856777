// Per-token preprocessing of the CUDA forward (and backward), into workspace. fp32 math.
//
// Workspace layout (PrepBuffers, all fp32, head-major, flat token index f = b * T + t, NT = B*T):
//   gcum [Hv][NT] : in-chunk inclusive cumulative sum of the log gate g (c_i = g_1 + .. + g_i
//                   within each 64-token chunk of each sequence; chunks start at the sequence's
//                   first token). With gate_in_kernel, g = -exp(A_log[h]) * softplus(a + dt_bias[h]).
//                   Each g is floored at -128 first (common/numerics.h: g = -inf is a reset).
//   beta [Hv][NT] : beta as fp32.
//   rq, rk [Hq][NT]: only with use_qk_l2norm_in_kernel (else nullptr): r = 1 / sqrt(sum x^2 +
//                   1e-6) of the q / k row; the normalised row is x * r (applied in the kernels
//                   as a diagonal scaling, so normalised q/k are never rounded to bf16).
// Every array is 256-byte aligned inside the workspace. No host synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda {

struct PrepBuffers {
  float* gcum = nullptr;
  float* beta = nullptr;
  float* rq = nullptr;  // nullptr unless l2norm
  float* rk = nullptr;
};

// Bytes of workspace launch_preprocess needs (a multiple of 256).
size_t prep_workspace_bytes(const Problem& p);
// Splits ws (256-byte aligned, >= prep_workspace_bytes(p)) into the buffers above.
PrepBuffers prep_carve(const Problem& p, void* ws);
// Fills the buffers from the inputs, on stream.
void launch_preprocess(const Problem& p, const fgdn_inputs& in, const PrepBuffers& pb,
                       cudaStream_t stream);

}  // namespace flashgdn::cuda
