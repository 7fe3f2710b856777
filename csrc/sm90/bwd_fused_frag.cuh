// The fused backward's vocabulary for one warpgroup's 64-row accumulator fragments in 128-byte
// swizzled bf16 tiles (bwd_fused_kernel.cuh): where a thread's elements lie (Frag, computed once a
// role), pair loads and stores, transposed loads by ldmatrix, 64-vectors at the fragment's rows
// and columns (FragVec), the products on wgmma (issued, waited for) with descriptors as a base
// plus a constant (Descs), and small reductions. Tiles are 64-column blocks of rows x 128 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <utility>

#include "sm90/ptx.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90::fused_bwd {

using bf16 = __nv_bfloat16;

// The accumulator fragment's place in a tile, computed once a role: element e lies at byte
//   j_off[e >> 2] + 1024 ((e >> 1) & 1) + 2 (e & 1)   (+ 64 m 128 for row block m, + blk rows 128
// for column block blk), j_off[j] = (16 w + g) 128 + ((j ^ g) << 4) + 4 q: the swizzle XORs the
// 16-byte column chunk j with the row's low three bits, which are g for both of the thread's rows.
// With the tile's place in Smem a constant, an access is one shared instruction: [j_off + imm].
struct Frag {
  uint32_t j_off[8];
  int r0;  // the thread's first row, 16 w + g (its second is r0 + 8)
  int cq;  // its first column in each block of eight, 2 q
};
// The thread index by a volatile read: each role's frag() stays after its register reallocation
// (ptxas hoisted the roles' common offsets above it and spilled them across).
__device__ __forceinline__ Frag frag() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  const int g = (t & 31) >> 2, q = t & 3;
  Frag f;
  f.r0 = 16 * ((t >> 5) & 3) + g;
  f.cq = 2 * q;
#pragma unroll
  for (int j = 0; j < 8; ++j) f.j_off[j] = f.r0 * 128 + ((j ^ g) << 4) + 4 * q;
  return f;
}
__device__ __forceinline__ int frow(const Frag& f, int e) { return f.r0 + 8 * ((e >> 1) & 1); }
__device__ __forceinline__ int fcol(const Frag& f, int e) { return 8 * (e >> 2) + f.cq + (e & 1); }
// Byte offset of element e in a tile with `rows` rows, row block m, column block blk.
__device__ __forceinline__ uint32_t foff(const Frag& f, int e, int rows, int blk, int m) {
  return f.j_off[e >> 2] + 1024 * ((e >> 1) & 1) + 2 * (e & 1) + blk * rows * 128 + m * 64 * 128;
}
// Elements e, e + 1 (e even: adjacent in a row) as one 32-bit load; element e alone through it, so
// that a pass over e and e + 1 shares one load.
template <int kRows = 64>
__device__ __forceinline__ float2 fld2(const bf16* tile, const Frag& f, int e, int blk = 0, int m = 0) {
  return __bfloat1622float2(
      *reinterpret_cast<const __nv_bfloat162*>(reinterpret_cast<const char*>(tile) + foff(f, e, kRows, blk, m)));
}
template <int kRows = 64>
__device__ __forceinline__ float fld(const bf16* tile, const Frag& f, int e, int blk = 0, int m = 0) {
  return (e & 1) ? fld2<kRows>(tile, f, e - 1, blk, m).y : fld2<kRows>(tile, f, e, blk, m).x;
}
// A 64 x 64 fp32 fragment through shared memory and back transposed, exactly: columns 0-31 in one
// 8 KB tile (`lo`, 64 rows of 32 floats), 32-63 in another (`hi`). Row rho's floats are permuted by
// t32_swz(rho) = 8 ((rho0 ^ rho1) + 2 (rho0 ^ rho2)) (its three low bits), which keeps a pair of
// columns adjacent and makes both passes free of bank conflicts: the pair stores (a half-warp: four
// rows, the pairs of four columns) and the transposed loads (a warp: eight rows, four columns).
__device__ __forceinline__ int t32_swz(int rho) { return 8 * (((rho ^ (rho >> 1)) & 1) | ((((rho >> 2) ^ rho) & 1) << 1)); }
// Stores: element pair e of row r = frow(e), columns 8 j + cq (+1): float offset r 32 + cq + (8 (j % 4)
// ^ t32_swz(r)) in lo (j < 4) or hi (cq's bits 1-2 and the swizzle's bits 3-4 are disjoint, so the
// XOR is on the block index alone). Loads: x[col][r] for col = 8 j + cq + b: col 32 + ((r % 32) ^
// t32_swz(cq + b)) (the swizzle of col depends on its three low bits only), in lo if r < 32; 256 j
// added as an immediate.
__device__ __forceinline__ void fst_f32(float* lo, float* hi, const Frag& f, const float (&x)[32]) {
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const int r = f.r0 + 8 * r2, sw = t32_swz(r);
    float* const row_lo = lo + r * 32 + f.cq;
    float* const row_hi = hi + r * 32 + f.cq;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int e = 4 * j + 2 * r2;
      float* const row = j < 4 ? row_lo : row_hi;
      *reinterpret_cast<float2*>(row + ((8 * (j & 3)) ^ sw)) = make_float2(x[e], x[e + 1]);
    }
  }
}
// The thread's fragment of the transpose, t[e] = x[fcol(e)][frow(e)].
__device__ __forceinline__ void fld_t_f32(const float* lo, const float* hi, const Frag& f, float (&t)[32]) {
  const float* const half = f.r0 < 32 ? lo : hi;  // rows r0 and r0 + 8 are in one half (r0 % 16 < 8)
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int sw = t32_swz(f.cq + b);
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const float* const base = half + (f.cq + b) * 32 + (((f.r0 + 8 * r2) & 31) ^ sw);
#pragma unroll
      for (int j = 0; j < 8; ++j) t[4 * j + 2 * r2 + b] = base[256 * j];
    }
  }
}
template <int kRows = 64>
__device__ __forceinline__ void fst2(bf16* tile, const Frag& f, int e, float x, float y, int blk = 0, int m = 0) {
  *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<char*>(tile) + foff(f, e, kRows, blk, m)) = __floats2bfloat162_rn(x, y);
}

// Elements e, e + 1 as one fp16 pair: a tile of the fp16 island (bwd_fused_kernel.cuh, kF16Island),
// already scaled into fp16's range (pow2_scale).
template <int kRows = 64>
__device__ __forceinline__ void fst2_f16(bf16* tile, const Frag& f, int e, float x, float y, int blk = 0, int m = 0) {
  *reinterpret_cast<__half2*>(reinterpret_cast<char*>(tile) + foff(f, e, kRows, blk, m)) = __floats2half2_rn(x, y);
}

// d (+)= A B, both from shared memory (wgmma.cuh; T: both operands' type, bf16 unless a product
// names fp16); tA / tB: the operand is MN-major.
template <int tA, int tB, typename T = bf16>
__device__ __forceinline__ void ss64(float (&d)[32], uint64_t a, uint64_t b, int acc) {
  wgmma_ss_n64<T, tB, tA>(d, a, b, acc);
}
template <int tA, int tB, typename T = bf16>
__device__ __forceinline__ void ss64_first(float (&d)[32], uint64_t a, uint64_t b) {
  wgmma_ss_n64_first<T, tB, tA>(d, a, b);
}
template <int tA, int tB, typename T = bf16>
__device__ __forceinline__ void ss128(float (&d0)[32], float (&d1)[32], uint64_t a, uint64_t b, int acc) {
  wgmma_ss_n128<T, tB, tA>(d0, d1, a, b, acc);
}
template <int tA, int tB, typename T = bf16>
__device__ __forceinline__ void ss128_first(float (&d0)[32], float (&d1)[32], uint64_t a, uint64_t b) {
  wgmma_ss_n128_first<T, tB, tA>(d0, d1, a, b);
}

// A product of `steps` k-steps, waited for: D (+)= A B. fa(s), fb(s): the descriptors of step s.
template <int tA, int tB, int kSteps, typename T = bf16, class FA, class FB>
__device__ __forceinline__ void mm64(float (&d)[32], FA fa, FB fb, bool accumulate) {
  __syncwarp();  // wgmma and its fence are .sync.aligned: the warp converged (as bwd_tiles.cuh)
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (s == 0 && !accumulate)
      ss64_first<tA, tB, T>(d, fa(s), fb(s));
    else
      ss64<tA, tB, T>(d, fa(s), fb(s), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(d);
}
template <int tA, int tB, int kSteps, typename T = bf16, class FA, class FB>
__device__ __forceinline__ void mm128(float (&d)[2][32], FA fa, FB fb, bool accumulate) {
  __syncwarp();
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (s == 0 && !accumulate)
      ss128_first<tA, tB, T>(d[0], d[1], fa(s), fb(s));
    else
      ss128<tA, tB, T>(d[0], d[1], fa(s), fb(s), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(d[0]);
  fence_regs(d[1]);
}

// A product issued, not waited for: D's registers belong to the tensor cores until mm_wait<n>
// (at most n groups still in flight) with D fenced again; nothing may touch them in between.
template <int tA, int tB, int kSteps, typename T = bf16, class FA, class FB>
__device__ __forceinline__ void mm64_issue(float (&d)[32], FA fa, FB fb) {
  __syncwarp();
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (s == 0)
      ss64_first<tA, tB, T>(d, fa(s), fb(s));
    else
      ss64<tA, tB, T>(d, fa(s), fb(s), 1);
  }
  wgmma_commit();
  fence_regs(d);
}
template <int tA, int tB, int kSteps, typename T = bf16, class FA, class FB>
__device__ __forceinline__ void mm128_issue(float (&d)[2][32], FA fa, FB fb) {
  __syncwarp();
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (s == 0)
      ss128_first<tA, tB, T>(d[0], d[1], fa(s), fb(s));
    else
      ss128<tA, tB, T>(d[0], d[1], fa(s), fb(s), 1);
  }
  wgmma_commit();
  fence_regs(d[0]);
  fence_regs(d[1]);
}
template <int kInFlight>
__device__ __forceinline__ void mm_wait(float (&d)[32]) {
  wgmma_wait<kInFlight>();
  fence_regs(d);
}
template <int kInFlight>
__device__ __forceinline__ void mm_wait(float (&d)[2][32]) {
  wgmma_wait<kInFlight>();
  fence_regs(d[0]);
  fence_regs(d[1]);
}

// f(integral_constant<int, s>) for s = 0 .. kStages - 1, in order: stages unrolled by construction.
template <class F, int... kS>
__device__ __forceinline__ void each_stage(F&& f, std::integer_sequence<int, kS...>) {
  (f(std::integral_constant<int, kS>{}), ...);
}

// Row sum over the four lanes of a row (q = 0 .. 3).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(~0u, x, 1);
  return x + __shfl_xor_sync(~0u, x, 2);
}
// Column sum over the warp's 16 rows (the eight lanes of a column, g = 0 .. 7).
__device__ __forceinline__ float octet_sum(float x) {
  x += __shfl_xor_sync(~0u, x, 4);
  x += __shfl_xor_sync(~0u, x, 8);
  return x + __shfl_xor_sync(~0u, x, 16);
}
__device__ __forceinline__ void role_sync(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

// A tile's scale into fp16 and back, both powers of two (exact): for a tile whose largest magnitude
// m lies in [2^e, 2^(e+1)), s = 2^(14 - e), so that m s lies in [2^14, 2^15), below fp16's largest
// value (65504), and every value within 2^-10 of m keeps fp16's 11 bits; s = 1 for a tile of zeros,
// or one with an inf or NaN (which then propagate as unscaled). The biased exponents are clamped to
// [1, 253], so that s and 1 / s are normal floats.
struct Pow2Scale {
  float s, inv;
};
__device__ __forceinline__ Pow2Scale pow2_scale(float m) {
  if (!(m > 0.f) || !(m <= FLT_MAX)) return {1.f, 1.f};
  const int e = int((__float_as_uint(m) >> 23) & 0xffu) - 127;
  const int b = min(max(127 + 14 - e, 1), 253);
  return {__uint_as_float(uint32_t(b) << 23), __uint_as_float(uint32_t(254 - b) << 23)};
}
// The scale of a tile whose four warps' largest magnitudes are in part[0..3] (role_scale's).
__device__ __forceinline__ Pow2Scale pow2_scale_of(const float* part) {
  return pow2_scale(fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])));
}
// A product of two scaled tiles (their parts as pow2_scale_of's) has its scales undone by
// a (.) i1 i2: by one multiply by f = i1 i2 (inv_scale_product) where f is a normal float
// (normal_scale: exact, the value one scale at a time gives whenever a i1 is exact), else one scale
// at a time (undo_scales_apart: f alone could leave the float range), the scales read again there
// so that only f stays live. The scales are the CTA's: the caller's branch is uniform.
__device__ __forceinline__ float inv_scale_product(const float* part1, const float* part2) {
  return pow2_scale_of(part1).inv * pow2_scale_of(part2).inv;
}
__device__ __forceinline__ bool normal_scale(float f) { return f >= FLT_MIN && f <= FLT_MAX; }
template <int N>
__device__ __forceinline__ void undo_scales_apart(float (&a)[N], const float* part1, const float* part2) {
  const float i1 = pow2_scale_of(part1).inv, i2 = pow2_scale_of(part2).inv;
#pragma unroll
  for (int e = 0; e < N; ++e) a[e] = a[e] * i1 * i2;
}
// The scale of a tile one role holds in its 128 threads' registers, each thread's largest magnitude
// m: the warp's by shuffles, the four warps' through part[4] and the role's named barrier `bar`;
// another role reads part after a stage barrier (pow2_scale_of).
__device__ __forceinline__ Pow2Scale role_scale(float m, float* part, int bar) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  if ((threadIdx.x & 31) == 0) part[(threadIdx.x >> 5) & 3] = m;
  role_sync(bar);
  return pow2_scale_of(part);
}

// e^x as one MUFU (ex2.approx.ftz; __expf adds range handling around the same instruction).
__device__ __forceinline__ float fexp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
// A 64-vector at this thread's fragment positions, read once a pass (not once an element): its
// two rows (vr[hi] = v[r0 + 8 hi]) and its 16 columns (vc[2 j + b] = v[8 j + 2 q + b], eight
// 8-byte loads). Element e's row value is vr[(e >> 1) & 1], its column value vc[2 (e >> 2) + (e & 1)].
struct FragVec {
  float vr[2], vc[16];
};
__device__ __forceinline__ FragVec frag_vec(const float* v, int r0, int cq) {
  FragVec f;
  f.vr[0] = v[r0];
  f.vr[1] = v[r0 + 8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 t = *reinterpret_cast<const float2*>(v + 8 * j + cq);
    f.vc[2 * j] = t.x;
    f.vc[2 * j + 1] = t.y;
  }
  return f;
}
__device__ __forceinline__ float row_of(const FragVec& f, int e) { return f.vr[(e >> 1) & 1]; }
__device__ __forceinline__ float col_of(const FragVec& f, int e) { return f.vc[2 * (e >> 2) + (e & 1)]; }
// Gam at element e (row r, column col of the fragment) from c's fragment values.
__device__ __forceinline__ float gam_at(const FragVec& cf, int e, int r, int col) {
  return r >= col ? fexp(fminf(row_of(cf, e) - col_of(cf, e), 0.f)) : 0.f;
}

// The kernel's descriptors as base + constant: the three layouts' descriptors of the Smem base are
// computed once (uniform registers); a tile's k-step adds (its offset in Smem + the step's) >> 4 to
// the start-address field, which cannot carry (shared addresses < 2^18, all offsets multiples of
// 16). ptxas then folds each k-step's descriptor to one add instead of recomputing the masks.
struct Descs {
  uint64_t k;             // K-major
  uint64_t mn64, mn128;   // MN-major, 64- and 128-row tiles
};
template <class SmemT>
__device__ __forceinline__ Descs descs(const SmemT& S) {
  const uint32_t a = smem_addr(&S);
  return Descs{desc_k_major(a), desc_mn_major(a, 64 * 128), desc_mn_major(a, 128 * 128)};
}
template <class SmemT>
__device__ __forceinline__ uint32_t in_smem(const SmemT& S, const void* t) {
  return uint32_t(static_cast<const char*>(t) - reinterpret_cast<const char*>(&S));
}
template <class SmemT>
__device__ __forceinline__ uint64_t kmaj(const Descs& d, const SmemT& S, const void* t, int rows, int s) {
  return d.k + ((in_smem(S, t) + (s >> 2) * rows * 128 + (s & 3) * 32) >> 4);
}
template <class SmemT>
__device__ __forceinline__ uint64_t mnmaj(const Descs& d, const SmemT& S, const void* t, int rows, int s,
                                          uint32_t extra = 0) {
  return (rows == 64 ? d.mn64 : d.mn128) + ((in_smem(S, t) + extra + s * 2048) >> 4);
}

}  // namespace flashgdn::sm90::fused_bwd
