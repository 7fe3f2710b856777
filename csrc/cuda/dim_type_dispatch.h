// The closed list of (head dim, q/k/v type) pairs the CUDA kernels are built for, and the one
// host-side dispatch from a call's (D, q/k/v dtype) to it. The forward (sm90/fwd_launch.cu, its
// translation units written from this list by scripts/gen_sm90_instantiations.py) and every
// backward launcher (chunk_bwd_*.cu, sm90/bwd_*.cu) dispatch through it; each takes the
// precision level as a run-time argument of the launch it reaches.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "common/error.h"
#include "flashgdn/flashgdn.h"

// X(head dim, q/k/v type) for every pair with CUDA kernels.
#define FGDN_CUDA_DIM_TYPES(X) \
  X(64, __nv_bfloat16)         \
  X(64, __half)                \
  X(128, __nv_bfloat16)        \
  X(128, __half)

namespace flashgdn::cuda {

template <int D_, typename TQ_>
struct DimType {
  static constexpr int D = D_;
  using TQ = TQ_;
};

template <typename T>
constexpr fgdn_dtype dtype_of();
template <>
constexpr fgdn_dtype dtype_of<__nv_bfloat16>() {
  return FGDN_BFLOAT16;
}
template <>
constexpr fgdn_dtype dtype_of<__half>() {
  return FGDN_FLOAT16;
}

// Calls f(DimType<D, TQ>{}) for the listed pair (d, qkv); a launcher taking DimType<D, TQ> as
// its first argument deduces both. The call's checks admit only listed pairs, so the throw is
// a missing entry of the list, not a user's error.
template <class F>
void dispatch_dim_type(int d, fgdn_dtype qkv, F&& f) {
#define FGDN_DISPATCH_DIM_TYPE(D, T) \
  if (d == (D) && qkv == dtype_of<T>()) return static_cast<void>(f(DimType<D, T>{}));
  FGDN_CUDA_DIM_TYPES(FGDN_DISPATCH_DIM_TYPE)
#undef FGDN_DISPATCH_DIM_TYPE
  throw NotSupported("flashgdn: no CUDA kernel for head dim " + std::to_string(d) + " and q/k/v dtype " +
                     std::to_string(static_cast<int>(qkv)) + " (FGDN_CUDA_DIM_TYPES)");
}

}  // namespace flashgdn::cuda
