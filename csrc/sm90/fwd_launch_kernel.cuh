// Definition of launch_fwd (fwd_instantiate.h), included by the instantiation units only.
#pragma once

#include <stdexcept>
#include <type_traits>

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

// The kernel with a CTA's value columns split (fp.col_blocks = 2, D = 128) or whole.
template <int kD, typename Tin, Precision kPrecision>
void launch_columns(const FwdParams& fp, int64_t ctas, cudaStream_t stream) {
  if constexpr (kD == 128) {
    if (fp.col_blocks == 2) return launch_traits<FwdTraits<kD, Tin, kPrecision, true>>(fp, ctas, stream);
  }
  launch_traits<FwdTraits<kD, Tin, kPrecision>>(fp, ctas, stream);
}

template <int kD, typename Tin>
void launch_fwd(const FwdParams& fp, Precision precision, int64_t ctas, cudaStream_t stream) {
  switch (precision) {
    case Precision::kFast: launch_columns<kD, Tin, Precision::kFast>(fp, ctas, stream); break;
    case Precision::kHigh: launch_columns<kD, Tin, Precision::kHigh>(fp, ctas, stream); break;
    case Precision::kSplitStates:
      // Instantiated for the fused backward's shape alone (D = 128, bf16): two kernels, not eight.
      if constexpr (kD == 128 && std::is_same_v<Tin, __nv_bfloat16>) {
        launch_columns<kD, Tin, Precision::kSplitStates>(fp, ctas, stream);
      } else {
        throw std::logic_error("flashgdn: the split-states forward is instantiated for D = 128, bf16 only");
      }
      break;
  }
}

}  // namespace flashgdn::sm90
