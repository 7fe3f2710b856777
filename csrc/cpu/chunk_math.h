// Small dense float32 matrix helpers for the per-chunk algebra of the CPU backend.
// Row-major with explicit leading dimensions (elements, int64). Every kernel has a fixed
// summation order, so results are bitwise reproducible for fixed shapes. The innermost loop is
// always a unit-stride axpy over a row (vectorisable without reassociating a reduction); a
// product with a transposed right operand is formed by transposing that operand first.
#pragma once

#include <cstdint>

namespace flashgdn::cpu {

// C[M x N] = (accumulate ? C : 0) + alpha * A[M x Kd] B[Kd x N]
void gemm_nn(int64_t M, int64_t N, int64_t Kd, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc);

// C[M x N] = (accumulate ? C : 0) + alpha * A^T B with A stored [Kd x M], B [Kd x N]
void gemm_tn(int64_t M, int64_t N, int64_t Kd, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc);

// At[N x M] = A[M x N]^T
void transpose(int64_t M, int64_t N, const float* A, int64_t lda, float* At, int64_t ldat);

// Tm = (I + Ab)^{-1} for Ab[m x m] strictly lower triangular (entries on/above the diagonal
// are ignored), by forward substitution row by row:  Tm_i = e_i^T - sum_{j<i} Ab_ij Tm_j.
// Tm is unit lower triangular; its upper part is written as zeros.
void unit_lower_inverse(int64_t m, const float* Ab, int64_t lda, float* Tm, int64_t ldt);

}  // namespace flashgdn::cpu
