// Epilogue pieces of the Hopper forward, run by the state warpgroups: the output tile (through a
// swizzled staging tile, so that global stores are whole 16-byte rows) and the state's reads and
// writes (initial state, checkpoints, final state) in the caller's layout and dtype.
#pragma once

#include <type_traits>

#include "cuda/device_utils.cuh"
#include "sm90/fwd_params.h"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_smem.cuh"
#include "sm90/ptx.cuh"

namespace flashgdn::sm90 {

// The slice of S^T a state thread holds: S[blk][4 jj + 2 i + e] is element (k, v) of S with
//   v = 64 sw + 16 warp + g + 8 i   (the warpgroup's 64 value columns: rows of S^T)
//   k = 64 blk + 8 jj + 2 q + e     (lane = 4 g + q)
template <int kBlocks, class F>
__device__ __forceinline__ void for_each_state(float (&S)[kBlocks][32], int sw, int tid, F&& f) {
  const int warp = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
#pragma unroll
  for (int blk = 0; blk < kBlocks; ++blk)
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int x = 0; x < 4; ++x)
        f(S[blk][4 * jj + x], 64 * blk + 8 * jj + 2 * q + (x & 1), 64 * sw + 16 * warp + g + 8 * (x >> 1));
}

// Element (k, v) of state `row` of head h.
__device__ __forceinline__ int64_t state_offset(const StateRef& s, int64_t row, int64_t h, int k,
                                                int v, int v_first) {
  return row * s.s0 + h * s.s1 + (v_first ? v * s.s2 + k * s.s3 : k * s.s2 + v * s.s3);
}

// The thread's slice of a state in memory, with element strides sk (along k) and sv (along v):
// block (blk, jj) of for_each_state's slice starts at row = base + (64 blk + 8 jj) sk, and its
// four elements x = 0..3 sit at row, row + sk, row + 8 sv and row + sk + 8 sv. f(blk, jj, row)
// for each block: the dtype is dispatched once per state and each address is a pointer step
// (the per-element dtype switch and 64-bit index products took ~100 instructions an element,
// ~16000 cycles a 64 KB state: bench/NOTES.md, step 10).
template <int kBlocks, typename T, class F>
__device__ __forceinline__ void for_each_state_row(T* base, int64_t sk, int64_t sv, int sw, int tid, F&& f) {
  const int warp = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
  T* row = base + 2 * q * sk + (64 * sw + 16 * warp + g) * sv;
#pragma unroll
  for (int blk = 0; blk < kBlocks; ++blk)
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      f(blk, jj, row);
      row += 8 * sk;
    }
}

// Calls f(typed pointer to element (0, 0) of state `row` of head h, sk, sv) with the element
// type of the state's dtype (fp32 | bf16 | fp16).
template <class F>
__device__ __forceinline__ void with_state_type(const StateRef& s, int64_t row, int64_t h, int v_first, F&& f) {
  const int64_t at = row * s.s0 + h * s.s1;
  const int64_t sk = v_first ? s.s3 : s.s2, sv = v_first ? s.s2 : s.s3;
  switch (s.dtype) {
    case FGDN_BFLOAT16: f(static_cast<__nv_bfloat16*>(s.data) + at, sk, sv); break;
    case FGDN_FLOAT16: f(static_cast<__half*>(s.data) + at, sk, sv); break;
    default: f(static_cast<float*>(s.data) + at, sk, sv); break;
  }
}

// A CP workspace of states, [slot][Hv][D][D] fp32 ([K][V]: rows k, columns v).
__device__ __forceinline__ StateRef cp_state_ref(const FwdParams& p, float* data) {
  StateRef s;
  const int64_t d = p.state_dim;
  s.data = data;
  s.dtype = FGDN_FLOAT32;
  s.s0 = p.Hv * d * d;
  s.s1 = d * d;
  s.s2 = d;
  s.s3 = 1;
  return s;
}

// Where a work item's walk starts from: the caller's initial state (h0, or the pool row of
// state_idx) or, for the second pass of a CP segment, the scanned state at its start. row < 0:
// from zero or the identity (the caller's initial state absent, a negative pool index, or a
// walk that starts from zero by construction).
struct StateSource {
  StateRef ref;
  int64_t row;
  int32_t v_first;
};

__device__ __forceinline__ StateSource initial_state_source(const FwdParams& p, const WorkItem& w) {
  StateSource s{p.h0, -1, p.v_first};
  if (w.init == kInitH0 && p.h0.data != nullptr) {
    s.row = p.state_idx != nullptr ? cuda::load_index(p.state_idx, p.state_idx_dtype, w.n) : w.n;
  } else if (w.init == kInitPrevEnd) {
    s = StateSource{cp_state_ref(p, p.cp.ends), w.slot - 1, 0};
  }
  return s;
}

// Asks L2 for a state's D rows of D elements (where the inner stride is 1), so that the state
// role's loads, scattered by the accumulator layout (each warp load: 4 rows x 32 bytes), hit L2
// instead of DRAM. Issued by the producer after an item's first chunk loads: for a CTA's later
// items (the persistent walk) that is chunks before the state role reads the state, and it took
// ~8% off an item's time in one timeline; for its first item it arrives with the state role's
// own loads and buys nothing (bench/NOTES.md, step 10).
__device__ __forceinline__ void prefetch_state_l2(const StateSource& s, int64_t h, int d) {
  if (s.row < 0 || s.ref.s3 != 1) return;
  const int64_t esize = s.ref.dtype == FGDN_FLOAT32 ? 4 : 2;
  const char* base = static_cast<const char*>(s.ref.data) + (s.row * s.ref.s0 + h * s.ref.s1) * esize;
  const bool packed = s.ref.s2 == d;  // the D rows are one range
  for (int r = 0; r < (packed ? 1 : d); ++r) {
    const char* at = base + r * s.ref.s2 * esize;
    if ((reinterpret_cast<uintptr_t>(at) & 15) == 0)
      prefetch_l2_bulk(at, static_cast<uint32_t>((packed ? d : 1) * d * esize));
  }
}

// S from state `row` of head h (row < 0: zero). The 64 loads of a thread are independent.
template <int kBlocks>
__device__ __forceinline__ void load_state(float (&S)[kBlocks][32], const StateRef& src, int64_t row,
                                           int64_t h, int v_first, int sw, int tid) {
  if (row < 0) {
    for_each_state(S, sw, tid, [](float& s, int, int) { s = 0.f; });
    return;
  }
  with_state_type(src, row, h, v_first, [&](auto* base, int64_t sk, int64_t sv) {
    for_each_state_row<kBlocks>(base, sk, sv, sw, tid, [&](int blk, int jj, const auto* r) {
      float* x = &S[blk][4 * jj];
      x[0] = cuda::to_float(r[0]);
      x[1] = cuda::to_float(r[sk]);
      x[2] = cuda::to_float(r[8 * sv]);
      x[3] = cuda::to_float(r[sk + 8 * sv]);
    });
  });
}

template <int kBlocks>
__device__ __forceinline__ void store_state(float (&S)[kBlocks][32], const StateRef& dst, int64_t row,
                                            int64_t h, int v_first, int sw, int tid) {
  with_state_type(dst, row, h, v_first, [&](auto* base, int64_t sk, int64_t sv) {
    using T = std::remove_pointer_t<decltype(base)>;
    for_each_state_row<kBlocks>(base, sk, sv, sw, tid, [&](int blk, int jj, T* r) {
      const float* x = &S[blk][4 * jj];
      r[0] = cuda::from_float<T>(x[0]);
      r[sk] = cuda::from_float<T>(x[1]);
      r[8 * sv] = cuda::from_float<T>(x[2]);
      r[sk + 8 * sv] = cuda::from_float<T>(x[3]);
    });
  });
}

// Rows of the 64 x 64 output tile of state warpgroup sw, from its accumulator O^T [64 v][64 t]:
// 8 x 8 blocks are transposed into the staging tile (the warpgroup's V tile of the chunk, no
// longer needed, in the 128-byte swizzle of the TMA maps) by stmatrix (rows = tokens). A whole
// chunk of o then goes out as one TMA store issued by thread 0, which returns true: it must wait
// for the store's reads of the stage (bulk_wait_group_read) before the caller releases it.
// Otherwise (a partial chunk, where the rows past `len` may be the next sequence's, q~, or o that
// TMA cannot address) each row's 128 bytes go out as 16-byte stores.
template <class Tr>
__device__ __forceinline__ bool store_output(const FwdParams& p, typename Tr::Tin (*stage)[64],
                                             const float (&o)[32], const WorkItem& w, int64_t t_chunk,
                                             int len, int sw, int tid) {
  using Tin = typename Tr::Tin;
  const uint32_t bar = static_cast<uint32_t>(FwdBarrier::kStateBase) + sw;
  const int warp = tid >> 5, lane = tid & 31;
  const uint32_t base = smem_addr(&stage[0][0]);
#pragma unroll
  for (int jp = 0; jp < 4; ++jp) {
    uint32_t r[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int i = m & 1, jj = 2 * jp + (m >> 1);
      r[m] = cuda::pack2<Tin>(o[4 * jj + 2 * i], o[4 * jj + 2 * i + 1]);
    }
    const int m = lane >> 3;
    const uint32_t t = 8 * (2 * jp + (m >> 1)) + (lane & 7);
    stmatrix_x4_trans(base + swizzle128(t, 2 * warp + (m & 1)), r);
  }
  const bool to_corr = Tr::kPrecision == Precision::kFast && w.out_corr;  // `fast` alone corrects
  if (p.o_tma && !to_corr && len == 64) {
    fence_proxy_async();  // the stmatrix writes, before the TMA engine reads them
    named_barrier_sync(bar, Tr::kWarpgroupThreads);
    if (tid == 0) {
      const TileMapOrder& ord = p.order_o;
      const int32_t t = static_cast<int32_t>(t_chunk);
      tma_store_4d(&p.tma_o, &stage[0][0], 64 * sw, ord.at(1, w.h, t, w.b), ord.at(2, w.h, t, w.b),
                   ord.at(3, w.h, t, w.b));
      bulk_commit_group();
    }
    return tid == 0;
  }
  named_barrier_sync(bar, Tr::kWarpgroupThreads);
  // o, or an exact segment's q~ (WorkItem::out_corr), of the same shape.
  Tin* dst = to_corr ? static_cast<Tin*>(p.cp.corr) + w.b * p.cp.cs0 + w.h * p.cp.cs2 + 64 * sw
                     : static_cast<Tin*>(p.o) + w.b * p.os0 + w.h * p.os2 + 64 * sw;
  const int64_t row_stride = to_corr ? p.cp.cs1 : p.os1;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int idx = tid + 128 * u, t = idx >> 3, ch = idx & 7;
    if (t < len) {
      st_global_v4(dst + (t_chunk + t) * row_stride + 8 * ch, ld_shared_v4(base + swizzle128(t, ch)));
    }
  }
  return false;
}

}  // namespace flashgdn::sm90
