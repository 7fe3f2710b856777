// The Hopper forward, as the CUDA backend calls it (after validation).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/error.h"
#include "common/problem.h"
#include "flashgdn/flashgdn.h"
#include "sm90/fwd_traits.cuh"

namespace flashgdn::sm90 {

// Throws NotSupported unless the device is a Hopper GPU (compute capability 9.0).
void require_sm90(int device_id);

size_t forward_workspace_bytes(const Problem& p, const fgdn_fwd_args& a);
// workspace: forward_workspace_bytes(p, a) bytes of device memory (may be null when that is 0).
void forward(const Problem& p, const fgdn_fwd_args& a, Precision precision, void* workspace,
             cudaStream_t stream);

// The backward's chunk-start states: the forward of the same inputs without o or a final state,
// checkpointing the state after every chunk. Sequence n's state after its chunk j goes to row
// first_row[n] + j of states ([rows, Hv, K, V] in states_dtype, fp32 or bf16, K-major whatever
// p.state_v_first says; first_row: [N] on the device). workspace:
// chunk_states_workspace_bytes(p, in) bytes.
size_t chunk_states_workspace_bytes(const Problem& p, const fgdn_inputs& in);
void chunk_states(const Problem& p, const fgdn_inputs& in, Precision precision, void* states,
                  fgdn_dtype states_dtype, const int64_t* first_row, void* workspace, cudaStream_t stream);

// The forward of the call a (o, final state) that also writes those chunk-start states, bf16, as
// chunk_states does (the saved_states of fgdn_fwd_args; a.checkpoints unused). workspace:
// forward_with_states_workspace_bytes(p, a) bytes.
size_t forward_with_states_workspace_bytes(const Problem& p, const fgdn_fwd_args& a);
void forward_with_states(const Problem& p, const fgdn_fwd_args& a, Precision precision, void* states,
                         const int64_t* first_row, void* workspace, cudaStream_t stream);

}  // namespace flashgdn::sm90
