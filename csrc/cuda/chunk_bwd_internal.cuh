// Private to the backward (chunk_bwd*.cu): the parameter block every backward kernel gets, the
// workspace layout, typed scalar loads/stores and a block-level tensor-core GEMM.
//
// Layout of the per-chunk workspace: it holds one block of chunk slots at a time (the launcher
// walks the slots in blocks, last block first: chunk_bwd.cu), indexed by the slot's place in its
// block ls = gc - slot0 and the value head h as row r = ls * Hv + h, with C = 64 token rows per
// chunk; rows past the chunk's length are zero. The chunk-start states h and the per-chunk gate
// sums hold every slot (row gc * Hv + h). All offsets are int64.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/chunk_index.cuh"
#include "cuda/dim_type_dispatch.h"
#include "cuda/device_utils.cuh"
#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cuda::bwd {

constexpr int kC = 64;          // chunk length
constexpr int kThreads = 256;   // threads per block of the per-chunk kernels (8 warps)
constexpr int kLd = kC + 1;     // padded leading dimension of 64 x 64 fp32 tiles in smem

struct Tensor4 {  // a strided device tensor (element strides)
  void* data;
  int64_t s0, s1, s2;
  int32_t dtype;  // fgdn_dtype (read by the state tensors: fp32 | bf16 | fp16)
};
// A C ABI tensor as a Tensor4 (its first three strides; none below three dimensions).
inline Tensor4 tensor4(const fgdn_tensor& t) {
  Tensor4 r{};
  r.data = t.data;
  r.dtype = t.dtype;
  if (t.ndim >= 3) {
    r.s0 = t.strides[0];
    r.s1 = t.strides[1];
    r.s2 = t.strides[2];
  }
  return r;
}
// The backward's workspace regions start on 256-byte boundaries.
inline size_t align256(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

struct BwdParams {
  // problem
  int64_t B, T, Hq, Hv, D, N, group;
  int64_t num_chunks;  // chunk slots: num_chunk_slots(p) (chunk_index.cuh; some may be unused)
  // The block of chunk slots this launch works on (chunk_bwd.cu): slot0 .. slot0 + slots - 1, the
  // per-chunk grids' x extent; blocked: more than one block (the dh pass then walks each chain's
  // chunks of the block and carries dS between blocks in dh_carry_in / dh_carry_out).
  int64_t slot0, slots;
  int32_t blocked;
  float scale;
  int32_t qkv_dtype, g_dtype, beta_dtype;
  int32_t l2norm, gate_in_kernel, has_dt_bias, state_v_first;
  int32_t has_initial_state, has_state_indices, has_d_final_state, want_dh0;
  int32_t idx_dtype;  // state_indices dtype
  int32_t precision_high;  // precision "high": split products (else the `fast` wgmma kernels)
  // Reverse context parallelism of the dh pass (chunk_bwd_dh.cu): each (sequence, value head)
  // chain cut into segments of dh_segment_chunks chunks, one CTA each (dh_segments = the grid's
  // z extent; 1: no split).
  int32_t dh_segments;
  int64_t dh_segment_chunks;
  int32_t dh_phase;   // set by the dh launcher (chunk_bwd_dh.cu)
  int32_t dh_halves;  // 2: a chain's value rows over two CTAs of one warpgroup (bwd_dh_plan.h)
  int32_t precision_fast;  // precision "fast": the dh pass's products single hi*hi (chunk_bwd_dh.cu);
                          // h in bf16 with bf16 inputs (states_in_bf16)
  float* dh_cp;       // [N * Hv * dh_segments * 2] x D x D: the exact path's N_s / R_s slots
  // Blocked: dS ([Hv][D a][D v], as dh) of the one sequence that crosses the block's upper
  // boundary (written by the block above) and of the one that crosses its lower boundary.
  const float* dh_carry_in;
  float* dh_carry_out;
  int32_t* dh_exact;  // [N * Hv]: 1 where a chain takes the exact path

  SeqLayout seq;  // chunk enumeration on the device (chunk_index.cuh)

  // inputs
  Tensor4 q, k, v, g, beta, d_o;  // g/beta: s0 = batch stride, s1 = token, s2 = head
  const float* A_log;
  const float* dt_bias;
  const void* state_indices;
  Tensor4 h0;             // initial state / pool [P, Hv, ., .]
  Tensor4 d_final_state;  // [N, Hv, ., .]: s0, s1 (head), s2 (row); last dim unit
  // outputs
  Tensor4 dq, dk, dv, dg, dbeta;
  float* dA_log;
  float* ddt_bias;
  Tensor4 dh0;

  // workspace (fp32 unless noted)
  // (slots: a block's chunk slots, in block order; num_chunks: all of them)
  float* qn;    // [slots * 64, Hq, D]      normalised q (or q), slot layout
  float* kn;    // [slots * 64, Hq, D]
  float* rq;    // [slots * 64, Hq]         1 / ||q|| (applied with l2norm only)
  float* rk;    // [slots * 64, Hq]
  float* cg;    // [slots * Hv, 64]         in-chunk cumulative gate c
  float* h;     // [(num_chunks + 1) * Hv, D, D] chunk-start states (S_0 of each chunk; one
                //                           spare row: chunk_bwd_state.cu); bf16 where
                //                           states_in_bf16 (below)
  float* dh;    // [slots * Hv, D, D]       gradient of each chunk's end state
  float* Tm;    // [slots * Hv, 64, 64]     (I + A)^{-1}; in the inputs' type below `high`
  float* W;     // [slots * Hv, 64, D]      W, later overwritten by dW
  float* vn;    // [slots * Hv, 64, D]      corrected values V_new
  float* dvn;   // [slots * Hv, 64, D]      local dv (dvl); after the dh pass, dV_new
  float* dvn_out;  // the dh pass's dV_new (W's buffer, free by then); the launcher swaps it with
                   // dvn after the pass, so that no CTA's warm-up reads a dvl another overwrote
  float* dqh;   // [slots * Hv, 64, D]      dq per value head (w.r.t. normalised q)
  float* dkh;   // [slots * Hv, 64, D]
  float* dc;    // [slots * Hv, 64]         gradient w.r.t. c (dc_summed: w.r.t. g, its reverse
                //                           in-chunk sum; the fused kernel writes that)
  int32_t dc_summed;
  float* gpart; // [num_chunks * Hv, 2]     per-chunk sums for dA_log and ddt_bias
  uint8_t* img; // [slots * Hv] x Images<D>::kBytes: the reverse pass's operands (chunk_bwd_images.cuh)
};

// At `fast` with bf16 inputs the chunk-start states h are stored in bf16 (half h's bytes): the
// products of sm90/bwd_prep.cu and sm90/bwd_dqk_wy.cu read them as bf16 tile operands at every
// level below `high`, but dg's term <dS, S0> then sums bf16 values of S0. At `default` that term
// reads fp32 h: with bf16 h, dg's error on rows of zero keys rose to 1.66e-2 (tests/python/
// test_extreme.py::test_key_norms_with_l2norm, H100, 2026-11-28; fp32 h passes its 1.2e-2).
// fp16 inputs keep fp32 h (prep stages h in bf16, dqk in fp16); `high` reads it in fp32.
__host__ __device__ inline bool states_in_bf16(bool precision_fast, int32_t qkv_dtype) {
  return precision_fast && qkv_dtype == FGDN_BFLOAT16;
}

// Calls f(std::bool_constant<kH16>{}), kH16 = whether this call's h is bf16 (states_in_bf16), for
// the kernels templated on h's type; TQ is the call's q/k/v type (bf16 states need bf16 inputs).
template <typename TQ, class F>
void dispatch_states_type(const BwdParams& P, F&& f) {
  if constexpr (std::is_same_v<TQ, __nv_bfloat16>) {
    if (states_in_bf16(P.precision_fast != 0, P.qkv_dtype)) return f(std::true_type{});
  }
  f(std::false_type{});
}

__device__ __forceinline__ int64_t tok_off(const Tensor4& t, int64_t b, int64_t tok, int64_t h) {
  return b * t.s0 + tok * t.s1 + h * t.s2;
}

// Row of token i of the block's local slot ls, q/k head hq, in qn, kn, rq and rk.
__device__ __forceinline__ int64_t qk_row(const BwdParams& P, int64_t ls, int64_t i, int64_t hq) {
  return (ls * kC + i) * P.Hq + hq;
}

// ---- block GEMM on tensor cores -------------------------------------------------------------
// C[M x N] = sum_k A(i, k) B(k, j) over k < KK, with fa(i, k), fb(k, j) returning fp32. Each
// operand is split into a bf16 high part and a bf16 low part, and the product is formed as
// hi*hi + hi*lo + lo*hi with mma.sync m16n8k16 (fp32 accumulate): about fp32 accuracy on tensor
// cores. Warps take 16 x 32 tiles of C in turn; fe(i, j, value) receives every element once,
// from the thread that owns it. The summation order is fixed: results are bitwise reproducible.
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}


template <int M, int N, int KK, class FA, class FB, class FE>
__device__ __forceinline__ void block_gemm(const FA& fa, const FB& fb, const FE& fe) {
  static_assert(M % 16 == 0 && N % 32 == 0 && KK % 16 == 0, "tile shape");
  constexpr int kTilesN = N / 32;
  constexpr int kTiles = (M / 16) * kTilesN;
  const int lane = threadIdx.x & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int nw = blockDim.x >> 5;
  for (int tile = threadIdx.x >> 5; tile < kTiles; tile += nw) {
    const int m0 = (tile / kTilesN) * 16, n0 = (tile % kTilesN) * 32;
    float acc[4][4];
    zero_acc(acc);
#pragma unroll 1
    for (int k0 = 0; k0 < KK; k0 += 16) {
      uint32_t ahi[4], alo[4];  // NOLINT
      const int r0 = m0 + gq, r1 = m0 + gq + 8, c0 = k0 + 2 * tq, c1 = k0 + 2 * tq + 8;
      split2(fa(r0, c0), fa(r0, c0 + 1), ahi[0], alo[0]);
      split2(fa(r1, c0), fa(r1, c0 + 1), ahi[1], alo[1]);
      split2(fa(r0, c1), fa(r0, c1 + 1), ahi[2], alo[2]);
      split2(fa(r1, c1), fa(r1, c1 + 1), ahi[3], alo[3]);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = n0 + nt * 8 + gq;
        uint32_t bhi[2], blo[2];
        split2(fb(c0, col), fb(c0 + 1, col), bhi[0], blo[0]);
        split2(fb(c1, col), fb(c1 + 1, col), bhi[1], blo[1]);
        mma_16816<__nv_bfloat16>(acc[nt], alo, bhi[0], bhi[1]);
        mma_16816<__nv_bfloat16>(acc[nt], ahi, blo[0], blo[1]);
        mma_16816<__nv_bfloat16>(acc[nt], ahi, bhi[0], bhi[1]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = n0 + nt * 8 + 2 * tq;
      fe(m0 + gq, col, acc[nt][0]);
      fe(m0 + gq, col + 1, acc[nt][1]);
      fe(m0 + gq + 8, col, acc[nt][2]);
      fe(m0 + gq + 8, col + 1, acc[nt][3]);
    }
  }
}

// ---- the per-chunk kernels' gates ------------------------------------------------------------
// Token tid (< kC) of the chunk: its gate (the in-kernel gate applied) and beta, zero past the
// chunk. Loaded on their own so that a kernel can issue them before its other loads.
struct TokenGate {
  float g = 0.f, b = 0.f;
};
__device__ __forceinline__ TokenGate load_token_gate(const BwdParams& P, const ChunkInfo& ci, int64_t h, int tid) {
  TokenGate x;
  if (tid < ci.len) {
    const int64_t t = ci.t0 + tid;
    const int64_t og = ci.b * P.g.s0 + t * P.g.s1 + h * P.g.s2;
    const int64_t ob = ci.b * P.beta.s0 + t * P.beta.s1 + h * P.beta.s2;
    x.g = load_as_float(P.g.data, P.g_dtype, og);
    if (P.gate_in_kernel) x.g = gate_from_activation(x.g + (P.has_dt_bias ? P.dt_bias[h] : 0.f), P.A_log[h]);
    x.b = load_as_float(P.beta.data, P.beta_dtype, ob);
  }
  return x;
}

// s_c[i] = sum_{j <= i} floor(g_j) (the in-chunk cumulative gate; a reset, g = -inf, keeps the sums
// finite: common/numerics.h) and s_beta from the threads tid < kC's tokens: a warp scan of each
// 32 tokens, then the second half adds the first's total (a fixed order: the same bits every
// run). Every thread of the block calls it (two barriers).
__device__ __forceinline__ void scan_chunk_gates(const TokenGate& x, float* s_c, float* s_beta) {
  const int tid = threadIdx.x;
  if (tid < kC) {
    s_c[tid] = warp_inclusive_scan(gate_floor(x.g));
    s_beta[tid] = x.b;
  }
  __syncthreads();
  if (tid >= 32 && tid < kC) s_c[tid] += s_c[31];
  __syncthreads();
}

// Column m of T = (I + A)^-1 for a strictly lower 64 x 64 A (fp32, row stride kLd) into T (same
// layout), by forward substitution in fp32: x_i = delta_im - sum_{m <= j < i} A_ij x_j.
__device__ __forceinline__ void inverse_column(const float* A, float* T, int m) {
  for (int i = 0; i < m; ++i) T[i * kLd + m] = 0.f;
  T[m * kLd + m] = 1.f;
  for (int i = m + 1; i < kC; ++i) {
    float x = 0.f;
    for (int j = m; j < i; ++j) x -= A[i * kLd + j] * T[j * kLd + m];
    T[i * kLd + m] = x;
  }
}

// ---- a per-chunk kernel's unit and its shared memory -------------------------------------------
// The unit of launch_per_chunk's grid: the block's local slot ls = blockIdx.x (chunk slot
// gc = slot0 + ls) and value head h = blockIdx.y, located in its sequence (ci); r = ls Hv + h is
// its row of the per-chunk workspace, state_row = gc Hv + h its row of h, hq its q/k head. False
// for a surplus slot (nothing to do).
struct ChunkUnit {
  ChunkInfo ci;
  int64_t gc, ls, h, hq, r, state_row;
  int len;  // tokens in the chunk, 1..64
};
__device__ __forceinline__ bool locate_unit(const BwdParams& P, ChunkUnit& u) {
  u.ls = blockIdx.x;
  u.gc = P.slot0 + u.ls;
  u.h = blockIdx.y;
  if (!locate_chunk(P.seq, u.gc, u.ci)) return false;
  u.hq = u.h / P.group;
  u.r = u.ls * P.Hv + u.h;
  u.state_row = u.gc * P.Hv + u.h;
  u.len = u.ci.len;
  return true;
}

// The dynamic shared memory as a T, its start aligned to 1024 bytes (the 128-byte swizzle's
// atom repeats every 1024 bytes; the launches ask for 1024 bytes more than sizeof(T)).
template <class T>
__device__ __forceinline__ T& dynamic_smem_1024() {
  extern __shared__ uint8_t bwd_dynamic_smem[];
  return *reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(bwd_dynamic_smem) + 1023) & ~uintptr_t{1023});
}
// The dynamic shared memory a launch asks for to hold T there.
template <class T>
constexpr size_t dynamic_smem_1024_bytes() {
  return sizeof(T) + 1024;
}

// ---- host-side dispatch on the head dimension and the q/k/v storage type ----------------------
using cuda::DimType;
// Calls f(DimType<D, TQ>{}) with D = P.D and TQ the q/k/v type (cuda/dim_type_dispatch.h).
template <class F>
void dispatch_dim_type(const BwdParams& P, F&& f) {
  cuda::dispatch_dim_type(P.D, static_cast<fgdn_dtype>(P.qkv_dtype), std::forward<F>(f));
}

// Lets `kernel` launch with `bytes` of dynamic shared memory (above the default 48 KB).
template <class Kernel>
void set_dynamic_smem(Kernel kernel, size_t bytes) {
  FGDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Launches kernel(P) on the per-chunk grid (the block's chunk slots x value heads; surplus slots
// exit) with `smem` bytes of dynamic shared memory.
template <class Kernel>
void launch_per_chunk(Kernel kernel, int threads, size_t smem, const BwdParams& P, cudaStream_t s, const char* what) {
  set_dynamic_smem(kernel, smem);
  kernel<<<dim3(P.slots, P.Hv), threads, smem, s>>>(P);
  FGDN_CHECK_LAUNCH(what);
}

// ---- host-side launchers (one per file) -------------------------------------------------------
// chunk-start states h by the Hopper forward (first_row: [N] int64 scratch; fwd_workspace:
// states_workspace_bytes(p, in) bytes), stored in bf16 where h16 (the staged kernels:
// states_in_bf16; the fused kernel: always, it reads them as bf16 tiles)
size_t states_workspace_bytes(const Problem& p, const fgdn_inputs& in);
void launch_bwd_states(const Problem& p, const fgdn_inputs& in, const BwdParams& P, bool h16, int64_t* first_row,
                       void* fwd_workspace, cudaStream_t s);
// The forward with fgdn_fwd_args.saved_states: those states written as launch_bwd_states writes
// them (workspace: saving_forward_workspace_bytes(p, a) bytes).
size_t saving_forward_workspace_bytes(const Problem& p, const fgdn_fwd_args& a);
void forward_saving_states(const Problem& p, const fgdn_fwd_args& a, void* workspace, cudaStream_t s);
void launch_bwd_qk_prep(const BwdParams& P, cudaStream_t s);    // qn/kn, rq/rk
void launch_bwd_prep(const BwdParams& P, cudaStream_t s);       // qk_prep; c, T, W, V_new, local dv, images
void launch_bwd_prep_sm90(const BwdParams& P, cudaStream_t s);  // the same at `fast` (sm90/bwd_prep.cu)
void launch_bwd_dh(const BwdParams& P, cudaStream_t s);         // reverse pass: dh, dV_new, dh0
void launch_bwd_dqk(const BwdParams& P, cudaStream_t s);        // dq, dk (partial), dW, dc (`high`)
void launch_bwd_wy(const BwdParams& P, cudaStream_t s);         // dv, dbeta, dk, dc (WY part; `high`)
void launch_bwd_dqk_wy_sm90(const BwdParams& P, cudaStream_t s);  // both below `high` (sm90/bwd_dqk_wy.cu)
void launch_bwd_reduce(const BwdParams& P, cudaStream_t s);     // dq/dk GVA + l2norm, dg (a block)
void launch_bwd_gate(const BwdParams& P, cudaStream_t s);       // dg alone (its part of reduce)
void launch_bwd_head_sums(const BwdParams& P, cudaStream_t s);  // dA_log, ddt_bias (every block's sums)

}  // namespace flashgdn::cuda::bwd
