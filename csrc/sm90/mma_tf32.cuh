// Warp-level TF32 tensor-core products on fp32 tiles in shared memory (mma.sync m16n8k8), for the
// small dense products of the chunk-local inverse. One warp computes D (16 x 8 n) += A (16 x 8 k)
// B (8 k x 8 n); the operands are read straight from fp32 row-major tiles whose rows are kLd
// floats apart, and rounded to TF32 (10-bit mantissa, fp32 range) on the way in.
//
// Fragment layouts (lane = 4 g + t), from the PTX ISA's m16n8k8 .tf32 figures:
//   A a[4]: (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)
//   B b[2]: (k = t, n = g), (k = t + 4, n = g)
//   D d[4]: (g, 2 t), (g, 2 t + 1), (g + 8, 2 t), (g + 8, 2 t + 1)
// With kLd = 68 (= 4 mod 32) both operand patterns touch 32 distinct banks.
//
// Split products (kSplit): x = big + small with both halves TF32, and a b ~ big_a big_b +
// big_a small_b + small_a big_b: three products keep ~21 bits, the fp32 inverse's accuracy
// for the `high` precision level; one product (10 bits) is below the bf16 rounding that T gets
// afterwards anyway (8 bits), so `fast` uses one.
#pragma once

#include <cstdint>

namespace flashgdn::sm90 {

__device__ __forceinline__ float round_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// x -> (big, small) as TF32 bit patterns with integer operations (cvt.rna.tf32 is several
// instructions on sm_90): big = x with its magnitude rounded half up to 10 mantissa bits, small
// = x - big (exact in fp32) truncated to TF32. x must be finite.
__device__ __forceinline__ uint32_t tf32_big(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ uint32_t tf32_small(float x, uint32_t big) {
  return __float_as_uint(x - __uint_as_float(big)) & 0xffffe000u;
}

// d += a b on TF32 bit patterns.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
  const uint32_t ab[4] = {__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]), __float_as_uint(a[3])};
  mma_m16n8k8_tf32(d, ab, __float_as_uint(b[0]), __float_as_uint(b[1]));
}

// d += a b for fp32 fragments a, b (rounded here); three products when kSplit.
template <bool kSplit>
__device__ __forceinline__ void mma_tf32(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
  float ab[4], bb[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) ab[i] = round_tf32(a[i]);
#pragma unroll
  for (int i = 0; i < 2; ++i) bb[i] = round_tf32(b[i]);
  if constexpr (kSplit) {
    float as[4], bs[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) as[i] = round_tf32(a[i] - ab[i]);
#pragma unroll
    for (int i = 0; i < 2; ++i) bs[i] = round_tf32(b[i] - bb[i]);
    mma_m16n8k8_tf32(d, as, bb);  // the small terms first
    mma_m16n8k8_tf32(d, ab, bs);
  }
  mma_m16n8k8_tf32(d, ab, bb);
}

// D (16 x 8 kNT) += A (16 x 8 kKT at a) B (8 kKT x 8 kNT at b), both row-major with leading
// dimension kLd. kLowerB >= 0: B is the block of a lower triangular matrix whose diagonal starts
// kLowerB tiles right of b's column 0 (B[k][n] = 0 for k < n + 8 kLowerB), so those k-tiles are
// skipped; kNotLower (-1): B is full.
constexpr int kNotLower = -1;
template <int kLd, int kKT, int kNT, int kLowerB, bool kSplit>
__device__ __forceinline__ void mma_tf32_tiles(float (&d)[kNT][4], const float* a, const float* b, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < kKT; ++kk) {
    const float* ak = a + 8 * kk;
    const float af[4] = {ak[g * kLd + t], ak[(g + 8) * kLd + t], ak[g * kLd + t + 4], ak[(g + 8) * kLd + t + 4]};
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      if (kLowerB >= 0 && kk < n + kLowerB) continue;
      const float* bk = b + 8 * kk * kLd + 8 * n;
      const float bf[2] = {bk[t * kLd + g], bk[(t + 4) * kLd + g]};
      mma_tf32<kSplit>(d[n], af, bf);
    }
  }
}

// Stores s D (16 x 8 kNT) row-major at m (leading dimension kLd, 8-byte aligned rows).
template <int kLd, int kNT>
__device__ __forceinline__ void store_tf32_tiles(float* m, const float (&d)[kNT][4], float s, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    *reinterpret_cast<float2*>(m + g * kLd + 8 * n + 2 * t) = make_float2(s * d[n][0], s * d[n][1]);
    *reinterpret_cast<float2*>(m + (g + 8) * kLd + 8 * n + 2 * t) = make_float2(s * d[n][2], s * d[n][3]);
  }
}

}  // namespace flashgdn::sm90
