// Kernel parameters of the Hopper forward (host and device). Filled by fwd_launch.cu from the
// validated Problem; passed by value as a __grid_constant__ so the TMA descriptors stay in
// parameter space.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/chunk_index.cuh"
#include "sm90/tma.h"

namespace flashgdn::sm90 {

// A state tensor [rows, Hv, K, V] (or [rows, Hv, V, K] with v_first): element (row, h, k, v) at
// row * s0 + h * s1 + (v_first ? v * s2 + k * s3 : k * s2 + v * s3). data == nullptr: absent.
struct StateRef {
  void* data = nullptr;
  int32_t dtype = FGDN_FLOAT32;  // fp32 | bf16 | fp16
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
};

// Intra-card context parallelism (fwd_context_parallel.h): the tables the plan kernel writes on
// the device and the phase this launch runs. phase 0: no CP (one work item per (sequence, value
// head), N x Hv units).
struct CpRef {
  int32_t phase = 0;            // 0 off | 1 first pass | 2 second pass (exact segments)
  int32_t max_slots = 0;        // grid bound of the slot range (host, shapes only)
  const int32_t* plan = nullptr;   // [kPlanWords]: chosen chunks per segment, counts
  const int4* items = nullptr;     // per work item {n, seg, slot or -1, nseg}
  const int4* slots = nullptr;     // per slot (segment of a split sequence) {n, seg, nseg, bound0}
  const int32_t* warm = nullptr;   // [slot x Hv]: warm-up chunks (>= 0) or kExactSegment
  float* ends = nullptr;           // [slot][Hv][D][D] fp32: segment end states (E / N)
  float* trans = nullptr;          // [slot][Hv][D][D] fp32: transfer matrices M
  // The exact segments' corrected outputs (CpLayout::corrected; nullptr: walked again in phase
  // 2): q~_t = scale M_t^T q_t, the M walk's output, [B, T, Hv, K] in the dtype of q, element
  // strides cs0, cs1, cs2.
  void* corr = nullptr;
  int64_t cs0 = 0, cs1 = 0, cs2 = 0;
};

struct FwdParams {
  // q, k: [B, T, Hq, K] and v: [B, T, Hv, V] as 4-D TMA maps (dims innermost first: D, H, T, B),
  // box 64 x 1 x 64 x 1, 128-byte swizzle; out-of-range rows read as zero.
  CUtensorMap tma_q, tma_k, tma_v;
  TileMapOrder order_q, order_k, order_v;
  // o as a TMA map of the same box (the state warpgroups' 64 x 64 output tiles go out through
  // it), where TMA can address o as it is (o_tma); else 16-byte stores.
  CUtensorMap tma_o;
  TileMapOrder order_o;
  int32_t o_tma = 0;

  cuda::SeqLayout seq;  // N sequences: dense B x T, or varlen cu_seqlens
  int64_t Hv = 0, group = 1;  // value head h reads q/k head h / group
  int64_t state_dim = 0;      // K = V

  // g, beta: [B, T, Hv] (fp32 | bf16), element strides.
  const void* g = nullptr;
  const void* beta = nullptr;
  int32_t g_dtype = FGDN_FLOAT32, beta_dtype = FGDN_FLOAT32;
  int64_t gs0 = 0, gs1 = 0, gs2 = 0, bs0 = 0, bs1 = 0, bs2 = 0;
  // gate in kernel: g is the activation a; gate = -exp(A_log[h]) * softplus(a + dt_bias[h]).
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;  // nullptr: 0
  int32_t gate_in_kernel = 0;
  int32_t l2norm = 0;
  float scale = 1.f;
  // k as plain memory as well, [B, T, Hq, K] with element strides ks0..2 and K contiguous, 16-byte
  // aligned rows (the call's tensor where TMA addresses it, else its packed copy), in q's 16-bit
  // dtype: the certificate reads the key norms from it when the kernel does not normalise them.
  const void* k = nullptr;
  int32_t k_dtype = FGDN_BFLOAT16;  // bf16 | fp16
  int64_t ks0 = 0, ks1 = 0, ks2 = 0;

  // o: [B, T, Hv, V], dtype of q, element strides.
  void* o = nullptr;
  int64_t os0 = 0, os1 = 0, os2 = 0;

  int32_t v_first = 0;
  StateRef h0;                     // initial state, or the pool with state_idx
  const void* state_idx = nullptr; // [N] int32 | int64: pool row per sequence (< 0: none)
  int32_t state_idx_dtype = FGDN_INT64;
  int32_t write_final = 0;         // write S_T into ht (or, with state_idx, the pool row)
  StateRef ht;
  StateRef ckpt;                   // checkpoints (data nullptr: none)
  int64_t every = 0;               // checkpoint_every
  const int64_t* ckpt_offset = nullptr;  // varlen: first checkpoint row per sequence [N]

  CpRef cp;
  int32_t units = 0;  // unit indices of the launch (fwd_scheduler.cuh): N Hv (x col_blocks), or the
                      // CP grid bound
  int32_t col_blocks = 1;  // 2: a CTA owns one 64-column block of the value dimension (D = 128,
                           // no CP), the kernel built with FwdTraits::kSplitColumns
};

// Whether a launch writes output rows (o, or an exact segment's q~): not for the backward's
// chunk-start states (chunk_states, fwd_launch.cu), whose `high` kernels then skip O's products.
__host__ __device__ inline bool fwd_writes_output(const FwdParams& p) {
  return p.o != nullptr || p.cp.corr != nullptr;
}

}  // namespace flashgdn::sm90
