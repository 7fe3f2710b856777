// Validation of the public entry points' arguments. Every check runs before any output is
// written; a failure throws InvalidArgument (or NotSupported) with a message that names the
// argument, what was expected and what was given.
#pragma once

#include <stdexcept>
#include <string>

#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn {

struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Valid input that this build or backend cannot run.
struct NotSupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The head dimensions each backend supports.
bool cpu_supports_head_dim(int64_t d);
bool cuda_supports_head_dims(int64_t K, int64_t V);

// stream: the call's stream, used only to read cu_seqlens back from the device when no host
// copy (cu_seqlens_host) was given.
Problem validate_forward(const fgdn_fwd_args* a, void* stream);
Problem validate_backward(const fgdn_bwd_args* a, void* stream);

}  // namespace flashgdn
