// flashgdn::cuda entry points (cuda_backend.h): workspace sizing and dispatch to the kernels.
// No host synchronisation; everything runs on the caller's stream.
#include <cuda_runtime.h>

#include <string>

#include "cuda/chunk_bwd.h"
#include "cuda/chunk_index.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/device_utils.cuh"
#include "sm90/bwd_fused.h"
#include "sm90/fwd_launch.h"

namespace flashgdn::cuda {

// The scheme behind each public precision level (sm90/fwd_traits.cuh).
// The default is the fastest scheme whose errors stay at or below the best peer's on the
// benchmark's check shape (bench/NOTES.md): kFast.
sm90::Precision forward_precision(fgdn_precision p) {
  return p == FGDN_PRECISION_HIGH ? sm90::Precision::kHigh : sm90::Precision::kFast;
}

size_t forward_workspace_size(const Problem& p, const fgdn_fwd_args& a) {
  return p.has_saved_states ? bwd::saving_forward_workspace_bytes(p, a) : sm90::forward_workspace_bytes(p, a);
}

int64_t saved_states_rows(const Problem& p) {
  return p.on_cuda && bwd::fused_backward_applies(p) ? num_chunk_slots(p) + 1 : 0;
}

void forward(const Problem& p, const fgdn_fwd_args& a, void* workspace, void* stream) {
  DeviceScope scope(p.device_id);
  sm90::require_sm90(p.device_id);
  if (p.has_saved_states)
    bwd::forward_saving_states(p, a, workspace, static_cast<cudaStream_t>(stream));
  else
    sm90::forward(p, a, forward_precision(p.precision), workspace, static_cast<cudaStream_t>(stream));
}

size_t backward_workspace_size(const Problem& p, const fgdn_bwd_args& a) {
  return backward_workspace_bytes(p, a);
}

// The grids of the forward (sm90: one CTA per sequence x value head; TMA coordinates of tokens
// and batch rows are 32-bit) and of the backward (chunk_bwd*.cu: chunk slots or sequences x
// heads x slices): x up to 2^31 - 1 blocks, y up to 65535.
std::string launch_limits_error(const Problem& p) {
  constexpr int64_t kMaxX = 2147483647, kMaxY = 65535;
  const int64_t slots = num_chunk_slots(p);
  if (p.N > kMaxX / p.Hv)
    return "the CUDA kernels take at most 2^31 - 1 (sequence, value head) pairs, got N*Hv=" +
           std::to_string(p.N) + "*" + std::to_string(p.Hv);
  if (p.T > kMaxX || p.B > kMaxX)
    return "the CUDA kernels take at most 2^31 - 1 tokens per batch row and batch rows, got B=" +
           std::to_string(p.B) + ", T=" + std::to_string(p.T);
  if (slots > kMaxX)
    return "the CUDA kernels take at most 2^31 - 1 chunks of 64 tokens, got " + std::to_string(slots);
  if (p.Hv > kMaxY || p.Hq > kMaxY)
    return "the CUDA kernels take at most 65535 heads, got Hv=" + std::to_string(p.Hv);
  return "";
}

void backward(const Problem& p, const fgdn_bwd_args& a, void* workspace, void* stream) {
  DeviceScope scope(p.device_id);
  sm90::require_sm90(p.device_id);
  launch_backward(p, a, workspace, static_cast<cudaStream_t>(stream));
  FGDN_CHECK_LAUNCH("the CUDA backward");
}

}  // namespace flashgdn::cuda
