// The exceptions every layer may throw and the C ABI (api/capi.cpp) turns into statuses. They
// live here, below the API layer, so that a backend can throw them without including api/
// headers. CudaError (FGDN_ERROR_CUDA) belongs to the CUDA backend: cuda/cuda_backend.h.
#pragma once

#include <stdexcept>

namespace flashgdn {

// An argument the call refuses (FGDN_ERROR_INVALID_ARGUMENT); nothing was written.
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Valid input that this build or backend cannot run (FGDN_ERROR_NOT_SUPPORTED).
struct NotSupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace flashgdn
