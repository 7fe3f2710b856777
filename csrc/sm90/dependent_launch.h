// Programmatic dependent launch: a kernel launched with launch_dependent may be scheduled onto
// SMs before the kernel ahead of it in the stream has finished, once every CTA of that kernel
// has called launch_dependents() (ptx.cuh) or exited. It must call grid_dependency_wait()
// before it reads anything the kernel ahead wrote (the wait returns when that grid has completed
// and its writes are visible; it is a no-op in a kernel launched without the attribute). The CP
// pipeline's six launches use it so that each grid's launch and set-up overlap the tail of the
// one before (bench/NOTES.md step 18).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/device_utils.cuh"

namespace flashgdn::sm90 {

template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      const char* what, Args&&... args) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  FGDN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
  FGDN_CHECK_LAUNCH(what);
}

}  // namespace flashgdn::sm90
