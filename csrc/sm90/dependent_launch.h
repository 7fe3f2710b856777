// Programmatic dependent launch: a kernel launched with launch_dependent may be scheduled onto
// SMs before the kernel ahead of it in the stream has finished, once every CTA of that kernel
// has called launch_dependents() (ptx.cuh) or exited. It must call grid_dependency_wait()
// before it reads anything the kernel ahead wrote (the wait returns when that grid has completed
// and its writes are visible; it is a no-op in a kernel launched without the attribute). The CP
// pipeline's six launches use it so that each grid's launch and set-up overlap the tail of the
// one before (bench/NOTES.md step 18).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "cuda/device_utils.cuh"
#include "sm90/occupancy_cache.h"

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

// The one cache of resident-CTA counts that every launcher of this library shares.
inline OccupancyCache& occupancy_cache() {
  static OccupancyCache cache;
  return cache;
}

// The CTAs of kKernel resident at once on an SM of the current device with `threads` threads and
// `bytes` of dynamic shared memory (at least one). The opt-in to that many bytes is made on every
// call: it is a per-device attribute of the kernel that a call with other bytes or on another
// device may have changed since. The occupancy query runs once per (kernel, device, threads,
// bytes); later calls read its count from occupancy_cache().
template <auto kKernel>
int resident_ctas_per_sm(int threads, size_t bytes) {
  FGDN_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  int device = 0;
  FGDN_CUDA_CHECK(cudaGetDevice(&device));
  const OccupancyKey key{reinterpret_cast<const void*>(kKernel), device, threads, bytes};
  return occupancy_cache().get(key, [threads, bytes] {
    int n = 0;
    FGDN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, bytes));
    return std::max(n, 1);
  });
}

}  // namespace flashgdn::sm90
