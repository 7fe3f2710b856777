// Validation of the public entry points' arguments. Every check runs before any output is
// written; a failure throws InvalidArgument (or NotSupported) with a message that names the
// argument, what was expected and what was given.
#pragma once

#include <string>

#include "common/error.h"
#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn {

// The head dimensions each backend supports.
bool cpu_supports_head_dim(int64_t d);
bool cuda_supports_head_dims(int64_t K, int64_t V);

// What a validation may look at.
enum class Mode {
  // The workspace size queries: shapes, dtypes, devices, strides, memory ranges and overlaps,
  // everything that does not need a tensor's values. Nothing is read from tensor memory, so
  // nothing is read on a stream the caller did not give.
  kShapes,
  // The call itself: also the values the call needs on the host (cu_seqlens, host
  // state_indices), read once, a device cu_seqlens on `stream`; and, in check mode, the
  // inputs' values (one host synchronisation on `stream`).
  kCall,
};

// A tensor is present iff ndim != 0 (fgdn_tensor_none() and a zeroed struct are absent).
inline bool present(const fgdn_tensor& t) { return t.ndim != 0; }

// Check mode: in.check_inputs, or FLASHGDN_CHECK_INPUTS set to anything but "" or "0" (read on
// every call, so a C caller can switch it on without rebuilding).
bool check_mode(const fgdn_inputs& in);

// Rows of saved_states the call's CUDA backward takes (0: none; fgdn_saved_states_rows).
int64_t saved_states_rows(const Problem& p);

// workspace, workspace_bytes: the caller's device scratch of a call (NULL: none, or a query).
Problem validate_forward(const fgdn_fwd_args* a, Mode mode, void* stream,
                         const void* workspace = nullptr, size_t workspace_bytes = 0);
Problem validate_backward(const fgdn_bwd_args* a, Mode mode, void* stream,
                          const void* workspace = nullptr, size_t workspace_bytes = 0);

}  // namespace flashgdn
