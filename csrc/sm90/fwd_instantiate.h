// The Hopper forward kernels: one per entry of FGDN_CUDA_DIM_TYPES (cuda/dim_type_dispatch.h:
// head dim {64, 128} x operand type {bf16, fp16}), each with both precision schemes
// (Precision::kFast, kHigh: fwd_traits.cuh) and, at D = 128, whole or column-split CTAs; D = 128
// bf16 also Precision::kSplitStates (the fused backward's states at `default`): 14 kernels, one
// translation unit per (head dim, type) under csrc/sm90/instantiations/ so that
// they compile in parallel. scripts/gen_sm90_instantiations.py writes those units from the list;
// its --check (a ctest) fails when they and the list disagree.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/dim_type_dispatch.h"
#include "sm90/fwd_params.h"
#include "sm90/fwd_traits.cuh"

namespace flashgdn::sm90 {

// Launches the kernel for (kD, Tin, precision) on `ctas` CTAs, which walk fp.units work items.
template <int kD, typename Tin>
void launch_fwd(const FwdParams& fp, Precision precision, int64_t ctas, cudaStream_t stream);

#define FGDN_SM90_FWD_DECLARE(D, T) \
  extern template void launch_fwd<D, T>(const FwdParams&, Precision, int64_t, cudaStream_t);
FGDN_CUDA_DIM_TYPES(FGDN_SM90_FWD_DECLARE)
#undef FGDN_SM90_FWD_DECLARE

}  // namespace flashgdn::sm90
