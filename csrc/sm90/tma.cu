// TMA tensor maps for the Hopper kernels (see tma.h). The driver's encoder is reached through the
// runtime's entry-point query, so the library links no libcuda of its own.
#include "sm90/tma.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <string>

#include "common/dtype.h"
#include "cuda/cuda_backend.h"

namespace flashgdn::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  if (fn == nullptr)
    throw cuda::CudaError("flashgdn: the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12+)");
  return fn;
}

struct Dims {
  std::array<uint64_t, 4> extent;  // D, H, T, B
  std::array<uint64_t, 4> stride;  // bytes
};

Dims dims_of(const fgdn_tensor& t) {
  const uint64_t es = dtype_size(t.dtype);
  Dims d;
  d.extent = {static_cast<uint64_t>(t.shape[3]), static_cast<uint64_t>(t.shape[2]),
              static_cast<uint64_t>(t.shape[1]), static_cast<uint64_t>(t.shape[0])};
  d.stride = {es, static_cast<uint64_t>(t.strides[2]) * es, static_cast<uint64_t>(t.strides[1]) * es,
              static_cast<uint64_t>(t.strides[0]) * es};
  return d;
}

// The outer dimensions (1..3) in increasing stride order; extent-1 dimensions last.
std::array<int, 3> outer_order(const Dims& d) {
  std::array<int, 3> o = {1, 2, 3};
  std::stable_sort(o.begin(), o.end(), [&](int a, int b) {
    const bool ua = d.extent[a] == 1, ub = d.extent[b] == 1;
    if (ua != ub) return ub;
    return d.stride[a] < d.stride[b];
  });
  return o;
}

bool direct(const Dims& d, uintptr_t data) {
  if (data % 16 != 0) return false;
  for (int i = 0; i < 4; ++i)
    if (d.extent[i] == 0 || d.extent[i] > (1ull << 31)) return false;
  const auto o = outer_order(d);
  uint64_t span = d.extent[0] * d.stride[0];  // bytes covered by the inner dimensions
  for (int i : o) {
    if (d.extent[i] == 1) continue;
    const uint64_t s = d.stride[i];
    if (s == 0 || s % 16 != 0 || s >= (1ull << 40) || s < span) return false;
    span = s * d.extent[i];
  }
  return true;
}

}  // namespace

bool tile_map_direct(const fgdn_tensor& t) {
  return direct(dims_of(t), reinterpret_cast<uintptr_t>(t.data));
}

size_t tile_map_packed_bytes(const fgdn_tensor& t) {
  return static_cast<size_t>(t.shape[0]) * t.shape[1] * t.shape[2] * t.shape[3] * dtype_size(t.dtype);
}

TileMap make_tile_map(const fgdn_tensor& t, void* packed) {
  Dims d = dims_of(t);
  void* base = t.data;
  if (packed != nullptr) {
    base = packed;
    const uint64_t es = dtype_size(t.dtype);
    d.stride = {es, d.extent[0] * es, d.extent[0] * d.extent[1] * es,
                d.extent[0] * d.extent[1] * d.extent[2] * es};
  }
  const auto o = outer_order(d);
  cuuint64_t dim[4], stride[3];
  cuuint32_t box[4], elem[4] = {1, 1, 1, 1};
  dim[0] = d.extent[0];
  box[0] = 64;
  TileMap tm;
  uint64_t span = d.extent[0] * d.stride[0];
  for (int k = 0; k < 3; ++k) {
    const int i = o[k];
    dim[k + 1] = d.extent[i];
    // An extent-1 dimension's stride is never used; give it one TMA accepts.
    stride[k] = d.extent[i] == 1 ? std::max<uint64_t>(span, 16) : d.stride[i];
    span = std::max<uint64_t>(span, stride[k] * d.extent[i]);
    box[k + 1] = i == 2 ? 64 : 1;  // 64 tokens, one head, one batch row
    (i == 1 ? tm.order.h : i == 2 ? tm.order.t : tm.order.b) = static_cast<int8_t>(k + 1);
  }
  const CUtensorMapDataType type =
      t.dtype == FGDN_BFLOAT16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encoder()(&tm.map, type, 4, base, dim, stride, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw cuda::CudaError("flashgdn: cuTensorMapEncodeTiled failed (error " + std::to_string(static_cast<int>(r)) +
                          ") for a tensor of shape [" + std::to_string(t.shape[0]) + ", " +
                          std::to_string(t.shape[1]) + ", " + std::to_string(t.shape[2]) + ", " +
                          std::to_string(t.shape[3]) + "]");
  return tm;
}

}  // namespace flashgdn::sm90
