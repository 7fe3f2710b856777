// CUDA backend for Hopper (sm_90a). Host-side entry points, called after validation.
#pragma once

#include <cstddef>

#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda {

size_t forward_workspace_size(const Problem& p, const fgdn_fwd_args& a);
size_t backward_workspace_size(const Problem& p, const fgdn_bwd_args& a);
// workspace: at least *_workspace_size bytes of device memory (never NULL when that is > 0).
void forward(const Problem& p, const fgdn_fwd_args& a, void* workspace, void* stream);
void backward(const Problem& p, const fgdn_bwd_args& a, void* workspace, void* stream);

}  // namespace flashgdn::cuda
