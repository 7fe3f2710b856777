// Warpgroup matrix multiply-accumulate (wgmma, sm_90a): shared-memory matrix descriptors and the
// few instruction shapes the GDN kernels use. D (64 x N, fp32, registers) += A (64 x 16) * B
// (16 x N), A from registers (RS) or shared memory (SS), B from shared memory; 16-bit operands
// (bf16 or fp16, one type for A and B).
//
// Register layouts (per warpgroup; warp w of the 4 owns rows 16 w .. 16 w + 15; lane = 4 g + q):
//   accumulator d[N / 2]: d[4 j + 2 i + e] is (row 16 w + g + 8 i, column 8 j + 2 q + e)
//   A fragment a[4] of a k-step (columns 16 s .. 16 s + 15): a[2 c + i] packs the two elements
//   (row 16 w + g + 8 i, columns 16 s + 8 c + 2 q + {0, 1}), i.e. the accumulator tiles 2 s and
//   2 s + 1 of a 64 x 64 result: an accumulator converts to the next product's A operand in place.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/device_utils.cuh"

namespace flashgdn::sm90 {

// ---- shared-memory matrix descriptors (128-byte swizzle) -----------------------------------
// Bits: start address >> 4 [0, 14), leading byte offset >> 4 [16, 30), stride byte offset >> 4
// [32, 46), layout type [62, 64) (1 = 128-byte swizzle). Tiles are 1024-byte aligned.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3ffffu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3ffffu) >> 4) << 32) | (1ull << 62);
}

// K-major operand: the reduction dimension is contiguous, 64 16-bit elements (128 bytes) per row,
// consecutive rows 128 bytes apart (groups of 8 rows: 1024 bytes). A k-step of 16 elements inside
// the 64 is a start address 32 bytes further (the hardware applies the swizzle to the address).
__device__ __forceinline__ uint64_t desc_k_major(uint32_t addr) { return make_desc(addr, 16, 1024); }

// MN-major operand: the M (or N) dimension is contiguous in 64-element rows of 128 bytes, one row
// per k; the next 64 M/N elements start `mn_block_bytes` further; groups of 8 k-rows are 1024
// bytes apart. A k-step of 16 is a start address 2048 bytes further.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t addr, uint32_t mn_block_bytes) {
  return make_desc(addr, mn_block_bytes, 1024);
}

// ---- ordering --------------------------------------------------------------------------------
// Before the first wgmma that reads registers written by ordinary instructions (accumulators,
// A fragments): makes those writes visible to the tensor cores.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most N committed groups are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator across a wgmma boundary.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---- instructions ----------------------------------------------------------------------------
#define FGDN_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FGDN_D32                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FGDN_D64                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define FGDN_OUT8(d, i)                                                                      \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FGDN_OUT32(d) \
  FGDN_OUT8(d, 0), FGDN_OUT8(d, 8), FGDN_OUT8(d, 16), FGDN_OUT8(d, 24)

template <typename T>
struct WgmmaType;
template <>
struct WgmmaType<__nv_bfloat16> {
  static constexpr bool kBf16 = true;
};
template <>
struct WgmmaType<__half> {
  static constexpr bool kBf16 = false;
};

// RS: d[64 x 64] (+)= a (registers) * B (descriptor); kTransB: B is MN-major.
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                             int accumulate) {
#define FGDN_RS64(TY)                                                                        \
  asm volatile(                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FGDN_D32                    \
      ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                      \
      : FGDN_OUT32(d)                                                                        \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB))
  if constexpr (WgmmaType<T>::kBf16) FGDN_RS64("bf16");
  else FGDN_RS64("f16");
#undef FGDN_RS64
}

// RS: d[64 x 32] (+)= a (registers) * B (descriptor, K-major).
template <typename T>
__device__ __forceinline__ void wgmma_rs_n32(float (&d)[16], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#define FGDN_RS32(TY)                                                                        \
  asm volatile(                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " FGDN_D16                    \
      ", {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"                                        \
      : FGDN_OUT8(d, 0), FGDN_OUT8(d, 8)                                                     \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate))
  if constexpr (WgmmaType<T>::kBf16) FGDN_RS32("bf16");
  else FGDN_RS32("f16");
#undef FGDN_RS32
}

// RS: [d0 | d1] (64 x 128: columns 0..63 in d0, 64..127 in d1) (+)= a (registers) * B.
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_rs_n128(float (&d0)[32], float (&d1)[32], const uint32_t (&a)[4],
                                              uint64_t b, int accumulate) {
#define FGDN_RS128(TY)                                                                       \
  asm volatile(                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " FGDN_D64                   \
      ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                      \
      : FGDN_OUT32(d0), FGDN_OUT32(d1)                                                       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB))
  if constexpr (WgmmaType<T>::kBf16) FGDN_RS128("bf16");
  else FGDN_RS128("f16");
#undef FGDN_RS128
}

// SS: d[64 x 64] (+)= A (descriptor; kTransA: MN-major, else K-major) * B (descriptor; kTransB:
// MN-major).
template <typename T, int kTransB = 0, int kTransA = 0>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
#define FGDN_SS64(TY)                                                                        \
  asm volatile(                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FGDN_D32                    \
      ", %32, %33, p, 1, 1, %35, %36;\n}\n"                                                  \
      : FGDN_OUT32(d)                                                                        \
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
  if constexpr (WgmmaType<T>::kBf16) FGDN_SS64("bf16");
  else FGDN_SS64("f16");
#undef FGDN_SS64
}

// SS: [d0 | d1] (64 x 128) (+)= A (descriptor; kTransA: MN-major) * B (descriptor; kTransB: MN-major).
template <typename T, int kTransB = 0, int kTransA = 0>
__device__ __forceinline__ void wgmma_ss_n128(float (&d0)[32], float (&d1)[32], uint64_t a, uint64_t b,
                                              int accumulate) {
#define FGDN_SS128(TY)                                                                       \
  asm volatile(                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " FGDN_D64                   \
      ", %64, %65, p, 1, 1, %67, %68;\n}\n"                                                  \
      : FGDN_OUT32(d0), FGDN_OUT32(d1)                                                       \
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
  if constexpr (WgmmaType<T>::kBf16) FGDN_SS128("bf16");
  else FGDN_SS128("f16");
#undef FGDN_SS128
}

// The first k-step of a product that does not accumulate: D = A B with D written only ("=f"),
// so that D's earlier values are dead before it (with "+f" they stay live from their last use to
// here: registers a role that holds many accumulators cannot spare).
#define FGDN_W8(d, i)                                                                        \
  "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), \
      "=f"(d[i + 6]), "=f"(d[i + 7])
#define FGDN_W32(d) FGDN_W8(d, 0), FGDN_W8(d, 8), FGDN_W8(d, 16), FGDN_W8(d, 24)
template <typename T, int kTransB = 0, int kTransA = 0>
__device__ __forceinline__ void wgmma_ss_n64_first(float (&d)[32], uint64_t a, uint64_t b) {
#define FGDN_SS64_FIRST(TY)                                                                                 \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FGDN_D32 ", %32, %33, 0, 1, 1, %34, %35;\n" \
               : FGDN_W32(d)                                                                                \
               : "l"(a), "l"(b), "n"(kTransA), "n"(kTransB))
  if constexpr (WgmmaType<T>::kBf16) FGDN_SS64_FIRST("bf16");
  else FGDN_SS64_FIRST("f16");
#undef FGDN_SS64_FIRST
}
template <typename T, int kTransB = 0, int kTransA = 0>
__device__ __forceinline__ void wgmma_ss_n128_first(float (&d0)[32], float (&d1)[32], uint64_t a, uint64_t b) {
#define FGDN_SS128_FIRST(TY)                                                                                \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " FGDN_D64 ", %64, %65, 0, 1, 1, %66, %67;\n" \
               : FGDN_W32(d0), FGDN_W32(d1)                                                                 \
               : "l"(a), "l"(b), "n"(kTransA), "n"(kTransB))
  if constexpr (WgmmaType<T>::kBf16) FGDN_SS128_FIRST("bf16");
  else FGDN_SS128_FIRST("f16");
#undef FGDN_SS128_FIRST
}
#undef FGDN_W8
#undef FGDN_W32

#undef FGDN_D16
#undef FGDN_D32
#undef FGDN_D64
#undef FGDN_OUT8
#undef FGDN_OUT32

// 16-bit operand x = hi + lo (|lo| <= 2^-8 |x| for bf16); lo only when the operand is split
// (the precision policy, fwd_traits.cuh). Two floats a, b packed into one 32-bit register.
template <typename T, bool kSplit>
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  hi = cuda::pack2<T>(a, b);
  lo = 0u;
  if constexpr (kSplit) {
    const float ah = cuda::to_float(cuda::from_float<T>(a));
    const float bh = cuda::to_float(cuda::from_float<T>(b));
    lo = cuda::pack2<T>(a - ah, b - bh);
  }
}

// The two 16-bit values of a 32-bit register as floats (exact).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t r) {
  if constexpr (WgmmaType<T>::kBf16) return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r));
  else return __half22float2(*reinterpret_cast<const __half2*>(&r));
}

}  // namespace flashgdn::sm90
