// Shared device utilities of the CUDA backend (forward and backward kernels).
//
//  - FGDN_CUDA_CHECK(expr) / check_launch(what): throw flashgdn::cuda::CudaError on failure
//    (CudaError is defined in cuda_backend.h; the C ABI maps it to FGDN_ERROR_CUDA);
//    DeviceScope: the tensors' device current for a host scope.
//  - Element conversions: to_float / from_float<T> for float, __nv_bfloat16, __half, and
//    load_as_float(ptr, dtype, i) for a run-time storage dtype (fp32 | bf16 | fp16).
//  - Warp reductions, the l2norm factor of a row spread over a warp, an inclusive warp scan.
//  - Tensor-core helpers (mma.sync m16n8k16, bf16 or fp16 operands, fp32 accumulate), with
//    ldmatrix fragment loaders from shared memory tiles of 2-byte elements:
//      load_a_rowmajor  : A 16x16 tile from smem stored [m][k]          (A itself)
//      load_a_colmajor  : A 16x16 tile from smem stored [k][m]          (A transposed in smem)
//      load_b_nk        : B 16x16 (two n-tiles of 8) from smem stored [n][k]
//      load_b_kn        : B 16x16 (two n-tiles of 8) from smem stored [k][n]
//    ld is the leading dimension in elements (pad rows by 8 elements to avoid bank conflicts);
//    every row address must be 16-byte aligned.
//    Accumulator layout (per 16x8 tile): lane = 4*g + t; c[0], c[1] at (row g, cols 2t, 2t+1),
//    c[2], c[3] at (row g + 8, cols 2t, 2t+1).
//  - split_hi_lo: x ~= hi + lo with both in the operand type, for near-fp32 products on the
//    tensor cores (two or three MMAs instead of one); store_hi_lo2 splits and stores a pair.
//  - zero_acc: clears an array of MMA accumulator tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/numerics.h"
#include "cuda/cuda_backend.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda {

// ---- host-side error checks ----------------------------------------------------------------
inline void cuda_check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw CudaError(std::string("flashgdn: CUDA error in ") + what + " (" + file + ":" +
                    std::to_string(line) + "): " + cudaGetErrorString(e));
}
#define FGDN_CUDA_CHECK(expr) ::flashgdn::cuda::cuda_check((expr), #expr, __FILE__, __LINE__)
// The device's multiprocessors (the forward's persistent grids and CP plan, the backward's).
inline int sm_count(int device_id) {
  int sms = 0;
  FGDN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_id));
  return sms;
}
// After a launch: reports configuration errors (does not synchronise).
#define FGDN_CHECK_LAUNCH(what) \
  ::flashgdn::cuda::cuda_check(cudaGetLastError(), (what), __FILE__, __LINE__)

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Makes the tensors' device current for the scope and restores the caller's device (host).
class DeviceScope {
 public:
  explicit DeviceScope(int device_id) {
    FGDN_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device_id) FGDN_CUDA_CHECK(cudaSetDevice(device_id));
  }
  ~DeviceScope() { cudaSetDevice(prev_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = 0;
};

// ---- element conversions -------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Storage dtype known only at run time (g, beta: fp32 | bf16; fp16 too for completeness).
__device__ __forceinline__ float load_as_float(const void* p, int32_t dtype, int64_t i) {
  switch (dtype) {
    case FGDN_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case FGDN_FLOAT16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store_from_float(void* p, int32_t dtype, int64_t i, float x) {
  switch (dtype) {
    case FGDN_BFLOAT16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    case FGDN_FLOAT16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}
// Index tensors (cu_seqlens, state_indices): int32 | int64.
__device__ __forceinline__ int64_t load_index(const void* p, int32_t dtype, int64_t i) {
  return dtype == FGDN_INT32 ? static_cast<int64_t>(static_cast<const int32_t*>(p)[i])
                             : static_cast<const int64_t*>(p)[i];
}

// Two 2-byte values packed into one 32-bit register (low half = first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// x ~= hi + lo, both representable in T (relative error of the pair ~ 2^-16 for bf16).
template <typename T>
__device__ __forceinline__ void split_hi_lo(float x, T& hi, T& lo) {
  hi = from_float<T>(x);
  lo = from_float<T>(x - to_float(hi));
}

// Splits a and b (adjacent columns) into hi + lo parts and stores each pair as one 32-bit word:
// (hi(a), hi(b)) at hi + off, (lo(a), lo(b)) at lo + off (off: element offset, even).
template <typename T>
__device__ __forceinline__ void store_hi_lo2(T* hi, T* lo, int off, float a, float b) {
  T ah, al, bh, bl;
  split_hi_lo(a, ah, al);
  split_hi_lo(b, bh, bl);
  *reinterpret_cast<uint32_t*>(hi + off) = pack2<T>(to_float(ah), to_float(bh));
  *reinterpret_cast<uint32_t*>(lo + off) = pack2<T>(to_float(al), to_float(bl));
}

// ---- warp reductions -------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// r = 1 / sqrt(sum x^2 + 1e-6) of a row spread over the warp (each lane's elements in x, zeros
// past the row's end), right for any finite row: rescaled where the sum overflows
// (common/numerics.h). Warp-uniform: the butterfly sums give every lane the same value.
template <int N>
__device__ __forceinline__ float warp_l2norm_rnorm(const float (&x)[N]) {
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < N; ++u) ss += x[u] * x[u];
  return l2norm_rnorm(
      warp_sum(ss),
      [&] {
        float m = 0.f;
#pragma unroll
        for (int u = 0; u < N; ++u) m = fmaxf(m, fabsf(x[u]));
        return warp_max(m);
      },
      [&](float sc) {
        float t = 0.f;
#pragma unroll
        for (int u = 0; u < N; ++u) t += (sc * x[u]) * (sc * x[u]);
        return warp_sum(t);
      });
}

// Inclusive prefix sum over the 32 lanes (lane i gets x_0 + .. + x_i).
__device__ __forceinline__ float warp_inclusive_scan(float x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// ---- tensor cores: mma.sync m16n8k16, fp32 accumulate --------------------------------------
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Zeroes N accumulator tiles (16 x 8 each, 4 floats a thread).
template <int N>
__device__ __forceinline__ void zero_acc(float (&acc)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// A fragment (16 x 16) of a matrix stored row-major [m][k] in smem: rows m0.., cols k0...
template <typename T>
__device__ __forceinline__ void load_a_rowmajor(uint32_t (&a)[4], const T* s, int ld, int m0,
                                                int k0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(a, s + (int64_t)(m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}
// A fragment (16 x 16) where smem holds A^T, i.e. element A[m][k] is at s[k * ld + m].
template <typename T>
__device__ __forceinline__ void load_a_colmajor(uint32_t (&a)[4], const T* s, int ld, int m0,
                                                int k0) {
  const int lane = threadIdx.x & 31;
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4_trans(a, s + (int64_t)(k0 + r + ((i >> 1) & 1) * 8) * ld + m0 + (i & 1) * 8);
}
// B fragments for two n-tiles (16 k x 16 n) where smem holds B^T: B[k][n] at s[n * ld + k].
// b[0], b[1]: n-tile n0..n0+7; b[2], b[3]: n-tile n0+8..n0+15.
template <typename T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4(b, s + (int64_t)(n0 + r + (i >> 1) * 8) * ld + k0 + (i & 1) * 8);
}
// B fragments for two n-tiles (16 k x 16 n) where smem holds B row-major: B[k][n] at s[k*ld+n].
template <typename T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4_trans(b, s + (int64_t)(k0 + r + (i & 1) * 8) * ld + n0 + (i >> 1) * 8);
}

}  // namespace flashgdn::cuda
