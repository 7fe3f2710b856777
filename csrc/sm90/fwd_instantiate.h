// The closed list of Hopper forward kernels: head dim {64, 128} x operand type {bf16, fp16}, each
// with both precision schemes (Precision::kFast, kHigh: fwd_traits.cuh) and, at D = 128, whole or
// column-split CTAs (12 kernels), one translation unit per (head dim, type) under
// csrc/sm90/instantiations/ so that they compile in parallel.
// scripts/gen_sm90_instantiations.py reads FGDN_SM90_FWD_INSTANTIATIONS below and writes those
// units; its --check (a ctest) fails when they and this list disagree.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sm90/fwd_params.h"
#include "sm90/fwd_traits.cuh"

namespace flashgdn::sm90 {

// Launches the kernel for (kD, Tin, precision) on `ctas` CTAs, which walk fp.units work items.
template <int kD, typename Tin>
void launch_fwd(const FwdParams& fp, Precision precision, int64_t ctas, cudaStream_t stream);

#define FGDN_SM90_FWD_INSTANTIATIONS(X) \
  X(64, __nv_bfloat16)                  \
  X(64, __half)                         \
  X(128, __nv_bfloat16)                 \
  X(128, __half)

#define FGDN_SM90_FWD_DECLARE(D, T) \
  extern template void launch_fwd<D, T>(const FwdParams&, Precision, int64_t, cudaStream_t);
FGDN_SM90_FWD_INSTANTIATIONS(FGDN_SM90_FWD_DECLARE)
#undef FGDN_SM90_FWD_DECLARE

}  // namespace flashgdn::sm90
