// flashgdn::cuda entry points (cuda_backend.h): workspace sizing and dispatch to the kernels.
// No host synchronisation; everything runs on the caller's stream.
#include <cuda_runtime.h>

#include <string>

#include "cuda/chunk_bwd.h"
#include "cuda/chunk_fwd.cuh"
#include "cuda/chunk_index.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/device_utils.cuh"

namespace flashgdn::cuda {

size_t forward_workspace_size(const Problem& p, const fgdn_fwd_args& /*a*/) {
  return chunk_fwd_workspace_bytes(p);
}

void forward(const Problem& p, const fgdn_fwd_args& a, void* workspace, void* stream) {
  DeviceScope scope(p.device_id);
  ChunkFwdOutputs out;
  out.o = a.o;
  out.write_final = a.output_final_state != 0;
  out.final_state = a.final_state;
  if (p.checkpoint_every > 0) out.checkpoints = a.checkpoints;
  launch_chunk_fwd_ws(p, a.in, workspace, out, static_cast<cudaStream_t>(stream));
}

size_t backward_workspace_size(const Problem& p, const fgdn_bwd_args& /*a*/) {
  return backward_workspace_bytes(p);
}

// The grids of the forward (chunk_fwd.cu: sequences x Hv x V/64; preprocess.cu: chunk slots x
// ceil(Hv/4), ceil(B*T*Hq/8) blocks) and of the backward (chunk_bwd*.cu: chunk slots or
// sequences x heads x slices): x up to 2^31 - 1 blocks, y up to 65535.
std::string launch_limits_error(const Problem& p) {
  constexpr int64_t kMaxX = 2147483647, kMaxY = 65535;
  const int64_t slots = num_chunk_slots(p);
  const int64_t norm_blocks = ceil_div(p.B * p.T * p.Hq, 8);  // no overflow: validated sizes
  if (p.N > kMaxX)
    return "the CUDA kernels take at most 2^31 - 1 sequences, got N=" + std::to_string(p.N);
  if (slots > kMaxX)
    return "the CUDA kernels take at most 2^31 - 1 chunks of 64 tokens, got " + std::to_string(slots);
  if (norm_blocks > kMaxX)
    return "the CUDA kernels take at most 2^34 tokens x q/k heads, got B*T*Hq=" +
           std::to_string(p.B * p.T * p.Hq);
  if (p.Hv > kMaxY || p.Hq > kMaxY)
    return "the CUDA kernels take at most 65535 heads, got Hv=" + std::to_string(p.Hv);
  return "";
}

void backward(const Problem& p, const fgdn_bwd_args& a, void* workspace, void* stream) {
  DeviceScope scope(p.device_id);
  launch_backward(p, a, workspace, static_cast<cudaStream_t>(stream));
  FGDN_CHECK_LAUNCH("the CUDA backward");
}

}  // namespace flashgdn::cuda
