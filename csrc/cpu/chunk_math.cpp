// Dense float32 kernels of chunk_math.h. Products are computed in register tiles of 4 rows x 32
// (then 8, then 1) columns of C; every element is the ascending-p sum alpha * sum_p a_ip b_pj
// added to C once, independent of the tiling.
#include "cpu/chunk_math.h"

#include <cstring>

// On x86-64 with GCC or Clang, each kernel is also compiled for AVX2+FMA and AVX-512 and the
// best one for the running CPU is picked once at load time (ifunc). Results are reproducible on
// one machine (every thread runs the same clone); across machines they may differ by rounding
// (FMA contraction).
#if defined(__x86_64__) && defined(__GNUC__) && defined(__ELF__)
#define FGDN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FGDN_CPU_CLONES
#endif

namespace flashgdn::cpu {

namespace {

// a[r] = A[r*ars + p*aps], r < MR. With ars = 1 (A^T) and MR = 4, one 16-byte load: written as
// the plain loop, GCC 12 at -O3 built a 512-bit vector from this row of A and the next three and
// kept four lanes, reading up to three rows past A's end at the last p, a segfault where A ends
// a mapped region (tests/cpp/test_concurrency.cpp under load, 2026-11-28). Same values, same speed.
template <int MR>
__attribute__((always_inline)) inline void load_a(const float* A, int64_t ars, int64_t aps, int64_t p,
                                                  float (&a)[MR]) {
#if defined(__GNUC__)
  if constexpr (MR == 4) {
    if (ars == 1) {
      typedef float F4 __attribute__((vector_size(16)));
      F4 v;
      __builtin_memcpy(&v, A + p * aps, sizeof v);
      for (int r = 0; r < MR; ++r) a[r] = v[r];
      return;
    }
  }
#endif
  for (int r = 0; r < MR; ++r) a[r] = A[r * ars + p * aps];
}

// C[MR x NR] = (accumulate ? C : 0) + alpha * sum_p a(i, p) B[p, :], a(i, p) = A[i*ars + p*aps].
// The tile is accumulated in a local array (registers) in ascending p, then scaled and added.
template <int MR, int NR>
__attribute__((always_inline)) inline void tile(int64_t Kd, float alpha, const float* A,
                                                int64_t ars, int64_t aps, const float* B,
                                                int64_t ldb, bool accumulate, float* C,
                                                int64_t ldc) {
  float acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = 0.f;
  for (int64_t p = 0; p < Kd; ++p) {
    const float* __restrict b = B + p * ldb;
    float a[MR];
    load_a<MR>(A, ars, aps, p, a);
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] += a[r] * b[j];
  }
  for (int r = 0; r < MR; ++r) {
    float* __restrict c = C + r * ldc;
    if (accumulate)
      for (int j = 0; j < NR; ++j) c[j] += alpha * acc[r][j];
    else
      for (int j = 0; j < NR; ++j) c[j] = alpha * acc[r][j];
  }
}

template <int MR>
__attribute__((always_inline)) inline void row_block(int64_t N, int64_t Kd, float alpha,
                                                     const float* A, int64_t ars, int64_t aps,
                                                     const float* B, int64_t ldb,
                                                     bool accumulate, float* C, int64_t ldc) {
  int64_t j = 0;
  for (; j + 32 <= N; j += 32) tile<MR, 32>(Kd, alpha, A, ars, aps, B + j, ldb, accumulate, C + j, ldc);
  for (; j + 8 <= N; j += 8) tile<MR, 8>(Kd, alpha, A, ars, aps, B + j, ldb, accumulate, C + j, ldc);
  for (; j < N; ++j) tile<MR, 1>(Kd, alpha, A, ars, aps, B + j, ldb, accumulate, C + j, ldc);
}

// C = (accumulate ? C : 0) + alpha * Aop B with Aop(i, p) = A[i*ars + p*aps]
__attribute__((always_inline)) inline void gemm_any(int64_t M, int64_t N, int64_t Kd,
                                                    float alpha, const float* A, int64_t ars,
                                                    int64_t aps, const float* B, int64_t ldb,
                                                    bool accumulate, float* C, int64_t ldc) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4)
    row_block<4>(N, Kd, alpha, A + i * ars, ars, aps, B, ldb, accumulate, C + i * ldc, ldc);
  for (; i < M; ++i)
    row_block<1>(N, Kd, alpha, A + i * ars, ars, aps, B, ldb, accumulate, C + i * ldc, ldc);
}

}  // namespace

// C = alpha * A B (+ C):  A(i, p) = A[i*lda + p]
FGDN_CPU_CLONES
void gemm_nn(int64_t M, int64_t N, int64_t Kd, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  gemm_any(M, N, Kd, alpha, A, lda, 1, B, ldb, accumulate, C, ldc);
}

// C = alpha * A^T B (+ C):  A^T(i, p) = A[p*lda + i]
FGDN_CPU_CLONES
void gemm_tn(int64_t M, int64_t N, int64_t Kd, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  gemm_any(M, N, Kd, alpha, A, 1, lda, B, ldb, accumulate, C, ldc);
}

FGDN_CPU_CLONES
void transpose(int64_t M, int64_t N, const float* A, int64_t lda, float* At, int64_t ldat) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) At[j * ldat + i] = A[i * lda + j];
}

// (I + Ab) Tm = I  =>  Tm_i = e_i - sum_{j<i} Ab_ij Tm_j  (rows j < i are already final).
FGDN_CPU_CLONES
void unit_lower_inverse(int64_t m, const float* Ab, int64_t lda, float* Tm, int64_t ldt) {
  for (int64_t i = 0; i < m; ++i) {
    float* __restrict ti = Tm + i * ldt;
    std::memset(ti, 0, sizeof(float) * static_cast<size_t>(m));
    ti[i] = 1.f;
    for (int64_t j = 0; j < i; ++j) {
      const float a = Ab[i * lda + j];
      const float* __restrict tj = Tm + j * ldt;
      for (int64_t c = 0; c <= j; ++c) ti[c] -= a * tj[c];
    }
  }
}

}  // namespace flashgdn::cpu
