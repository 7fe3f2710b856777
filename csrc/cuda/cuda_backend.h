// CUDA backend for Hopper (sm_90a). Host-side entry points, called after validation.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/problem.h"
#include "common/value_checks.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda {

size_t forward_workspace_size(const Problem& p, const fgdn_fwd_args& a);
size_t backward_workspace_size(const Problem& p, const fgdn_bwd_args& a);
// Rows of the saved_states the forward of p may write for its backward (0: the backward would not
// take them; fgdn_saved_states_rows).
int64_t saved_states_rows(const Problem& p);
// workspace: at least *_workspace_size bytes of device memory (never NULL when that is > 0).
void forward(const Problem& p, const fgdn_fwd_args& a, void* workspace, void* stream);
void backward(const Problem& p, const fgdn_bwd_args& a, void* workspace, void* stream);

// Why the kernels' launch grids cannot cover a validated problem ("" when they can): grid
// extents past the hardware's limits. Called by validation (FGDN_ERROR_NOT_SUPPORTED).
std::string launch_limits_error(const Problem& p);

// Check mode on the device: runs every check on stream, gathers the results and the requested
// index tensors (cu_seqlens, state_indices; nullptr: not needed) as int64 into one scratch
// buffer, copies it back with one cudaMemcpyAsync and waits for the stream (the call's one
// host synchronisation of check mode).
ValueCheckOutcome run_value_checks(const std::vector<ValueCheck>& checks, const fgdn_tensor* cu_seqlens,
                                   const fgdn_tensor* state_indices, int device_id, void* stream);

}  // namespace flashgdn::cuda

namespace flashgdn::cuda {
// A failed CUDA call (status FGDN_ERROR_CUDA at the C ABI).
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Copies bytes from device memory to the host, ordered after the work already on stream, and
// waits for it (a host synchronisation: used only when the caller gave no host copy).
void copy_to_host(void* dst, const void* src, size_t bytes, int device_id, void* stream);
// Whether stream (on device_id) is capturing a CUDA graph: what a call may not do then (read a
// device tensor back, wait for the stream) is refused before anything is enqueued.
bool stream_capturing(void* stream, int device_id);
// Throws CudaError if the calling thread has a CUDA error pending from work done before this call
// (and clears it), so that it is reported as what it is, not as the failure of a flashgdn kernel.
void raise_pending_error();
// Stream-ordered scratch for callers that pass no workspace (graph capturable).
void* workspace_alloc(size_t bytes, int device_id, void* stream);
void workspace_free(void* ptr, void* stream);
}  // namespace flashgdn::cuda
