// Thin wrappers of the sm_90a PTX the Hopper kernels use: mbarriers, the TMA tile copy, cp.async,
// proxy fences, named barriers, register reallocation, ldmatrix/stmatrix. One instruction each, named
// as in the PTX ISA, so the kernels read like the protocol they implement. (Why not CuTe: see
// docs/design.md, "Why thin PTX wrappers".)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashgdn::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from a shared-memory address (a shared-state-space load, not a generic one).
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// 16 bytes to global memory in one instruction. (A plain uint4 store through a pointer derived
// from a 16-bit element pointer compiled to four 4-byte stores: four times the LSU requests,
// measured by Nsight Compute, bench/NOTES.md.) `dst` must be 16-byte aligned.
__device__ __forceinline__ void st_global_v4(void* dst, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// ---- mbarrier ------------------------------------------------------------------------------
// A 64-bit barrier in shared memory that completes a phase when `count` arrivals (and, with
// expect_tx, that many bytes of TMA traffic) have been seen. Waiters poll a phase parity.
struct alignas(8) Mbarrier {
  uint64_t word;

  __device__ __forceinline__ void init(uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(this)), "r"(count));
  }
  __device__ __forceinline__ void arrive() {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(this)) : "memory");
  }
  // One arrival that also announces `bytes` of TMA transactions for the current phase.
  __device__ __forceinline__ void arrive_expect_tx(uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(this)),
                 "r"(bytes)
                 : "memory");
  }
  // One arrival when all of this thread's earlier cp.async copies have landed; noinc: the
  // arrival is one of the count given to init, not an extra one.
  __device__ __forceinline__ void arrive_on_cp_async() {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(this)) : "memory");
  }
  // Blocks until the phase with the given parity has completed.
  __device__ __forceinline__ void wait(uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_addr(this)),
        "r"(parity)
        : "memory");
  }
};

// Makes mbarrier.init visible to the async proxy (TMA) before the first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads
// (wgmma operands, TMA stores) of the same memory.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- TMA -----------------------------------------------------------------------------------
__device__ __forceinline__ void prefetch_tensormap(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A 4-D tile from global memory into shared memory, completing on `bar`. Coordinates are in
// elements, innermost dimension first.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* map, Mbarrier* bar, int32_t c0,
                                            int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// `bytes` contiguous bytes from global to shared memory, completing on `bar` (a 1-D bulk copy:
// both addresses 16-byte aligned, bytes a multiple of 16; the caller announces them with
// arrive_expect_tx).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, Mbarrier* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// `bytes` contiguous bytes from shared to global memory, in the calling thread's bulk group (the
// same alignment rules; the writes to `src` made visible to the async proxy first).
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(reinterpret_cast<uint64_t>(dst)),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}

// A 4-D tile from shared memory into global memory, in the calling thread's bulk group; rows
// outside the map's extents are not written. The writes to `src` must be made visible to the
// async proxy first (fence_proxy_async by every writer, then a barrier).
__device__ __forceinline__ void tma_store_4d(const void* map, const void* src, int32_t c0, int32_t c1, int32_t c2,
                                             int32_t c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most N of the thread's bulk groups are still reading their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Waits until at most N of the thread's bulk groups are pending at all (their writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Asks L2 to fetch [src, src + bytes) from global memory (src 16-byte aligned, bytes a multiple
// of 16). Nothing lands in shared memory and nothing waits for it: a hint.
__device__ __forceinline__ void prefetch_l2_bulk(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(reinterpret_cast<uint64_t>(src)), "r"(bytes)
               : "memory");
}

// ---- cp.async (per-thread 16-byte copies into shared memory, in commit groups) -------------
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Blocks until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// ---- programmatic dependent launch (dependent_launch.h) --------------------------------------
// Blocks until the grid ahead in the stream has completed and its writes are visible (a no-op
// when this grid was launched without programmatic stream serialization).
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Lets the next grid in the stream be scheduled once every CTA of this one has called it.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// ---- named barriers and register reallocation ----------------------------------------------
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Counts this warp's threads toward barrier `id` without waiting (the producer side of a
// barrier whose consumers call named_barrier_sync with the same `threads`).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---- 8x8 matrix moves between shared memory and the mma fragment layout --------------------
// Lane l supplies the row address of row l % 8 of matrix l / 8. Transposed (.trans), a thread
// receives (stores) the fragment: element (row 2 (lane % 4) + e, column lane / 4) of the
// 8x8 matrix in memory.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// ---- the 128-byte swizzle ------------------------------------------------------------------
// TMA's SWIZZLE_128B and wgmma's 128B layout: in each 1024-byte block of eight 128-byte rows,
// the 16-byte chunk c of row r is stored at chunk c ^ (r % 8). Byte offset of (row, chunk).
__device__ __forceinline__ uint32_t swizzle128(uint32_t row, uint32_t chunk) {
  return row * 128u + ((chunk ^ (row & 7u)) << 4);
}

// ---- exponentials ---------------------------------------------------------------------------
constexpr float kLog2e = 1.4426950408889634f;

// 2^x (MUFU.EX2; the exponents here are differences of cumulative gates in log2 units, <= 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flashgdn::sm90
