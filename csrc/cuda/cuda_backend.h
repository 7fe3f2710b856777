// CUDA backend for Hopper (sm_90a). Host-side entry points, called after validation.
#pragma once

#include <cstddef>
#include <stdexcept>

#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda {

size_t forward_workspace_size(const Problem& p, const fgdn_fwd_args& a);
size_t backward_workspace_size(const Problem& p, const fgdn_bwd_args& a);
// workspace: at least *_workspace_size bytes of device memory (never NULL when that is > 0).
void forward(const Problem& p, const fgdn_fwd_args& a, void* workspace, void* stream);
void backward(const Problem& p, const fgdn_bwd_args& a, void* workspace, void* stream);

}  // namespace flashgdn::cuda

namespace flashgdn::cuda {
// A failed CUDA call (status FGDN_ERROR_CUDA at the C ABI).
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Copies bytes from device memory to the host, ordered after the work already on stream, and
// waits for it (a host synchronisation: used only when the caller gave no host copy).
void copy_to_host(void* dst, const void* src, size_t bytes, int device_id, void* stream);
// Stream-ordered scratch for callers that pass no workspace (graph capturable).
void* workspace_alloc(size_t bytes, int device_id, void* stream);
void workspace_free(void* ptr, void* stream);
}  // namespace flashgdn::cuda
