// Definition of launch_fwd (fwd_instantiate.h), included by the instantiation units only.
#pragma once

#include "cuda/device_utils.cuh"
#include "sm90/dependent_launch.h"
#include "sm90/fwd_instantiate.h"
#include "sm90/fwd_kernel.cuh"

namespace flashgdn::sm90 {

template <class Tr>
void launch_traits(const FwdParams& fp, int64_t ctas, cudaStream_t stream) {
  constexpr size_t smem = fwd_smem_bytes<Tr>();
  static_assert(smem <= 227 * 1024, "shared memory plan exceeds the sm_90 limit");
  auto kern = gdn_fwd_kernel<Tr>;
  FGDN_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  launch_dependent(kern, dim3(static_cast<unsigned>(ctas)), dim3(Tr::kThreads), smem, stream, "gdn_fwd_kernel", fp);
}

template <int kD, typename Tin>
void launch_fwd(const FwdParams& fp, Precision precision, int64_t ctas, cudaStream_t stream) {
  switch (precision) {
    case Precision::kFast: launch_traits<FwdTraits<kD, Tin, Precision::kFast>>(fp, ctas, stream); break;
    case Precision::kHigh: launch_traits<FwdTraits<kD, Tin, Precision::kHigh>>(fp, ctas, stream); break;
  }
}

}  // namespace flashgdn::sm90
