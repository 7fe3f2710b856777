// Compile-time configuration of the Hopper forward: tile sizes, pipeline depths, warp roles and
// their register budgets, and the precision policy.
#pragma once

#include <cstdint>

namespace flashgdn::sm90 {

// Which operands are carried as two 16-bit halves (x = hi + lo, |lo| <= 2^-8 |x| for bf16) so
// that their products keep ~16 bits instead of 8. Each split doubles the wgmmas of its product.
//   kFast : every operand one 16-bit value (as the peers do): o within the peers' error.
//   kHigh : every computed operand split (S, Y, Vn, Vd on the A side, T and P on the B side):
//           the chunk math keeps ~fp32 accuracy and o lands at the bf16 rounding floor.
//   kSplitStates : the state recurrence's two operands split (S in X = K S and O1 = Q S; Vd =
//           e^{c_L - c} Vn in the update S' = e^{c_L} S + K^T Vd), the chunk-local ones (Y, T, P)
//           one 16-bit value: the states the fused backward reads at `default` (its states pass
//           and the forward that saves them): by the emulation (bench/fused_precision.py
//           --states, 6 seeds) dg 3.7e-3 against 4.4e-3 on kFast's states, 3.4e-3 on kHigh's, for
//           two more products a chunk.
//           D = 128, bf16 only (the fused backward's).
// (Splitting S alone was measured: o 3.4-3.5e-3 against 3.7-3.9e-3 for kFast, bench/NOTES.md.)
enum class Precision : int { kFast = 0, kHigh = 1, kSplitStates = 2 };

// kSplitColumns_: each CTA owns one 64-column block of the value dimension (D = 128 only), for
// launches whose work items fill less than half the GPU: two CTAs per item on two SMs, each
// with one state warpgroup, the chunk-local results computed by both (fwd_launch.cu).
template <int kD_, typename Tin_, Precision kPrecision_, bool kSplitColumns_ = false>
struct FwdTraits {
  using Tin = Tin_;                  // q, k, v and the tensor-core operand type (bf16 | fp16)
  static constexpr int kD = kD_;     // K = V head dimension
  static constexpr int kChunk = 64;  // tokens per chunk
  static constexpr int kBlocks = kD / 64;  // 64-element (128-byte) column blocks of a row
  static_assert(kD == 64 || kD == 128, "head dims K = V in {64, 128}");

  // Warp roles, one warpgroup (128 threads) each:
  //   WG 0      producer: warps 0-1 the rows' L2 norms (and zero rows past a partial chunk),
  //             warp 2 issues the TMA tile loads, warp 3 loads the gate inputs and forms the
  //             cumulative gate and, once the k norms are in, each key's column exponent
  //   WG 1      chunk-local: K K^T, Q K^T, A, P, T = (I + A)^-1; runs ahead of the state
  //   WG 2 ..   state: each owns 64 rows (value columns) of the transposed state S^T
  static constexpr bool kSplitColumns = kSplitColumns_;
  static_assert(!kSplitColumns || kD == 128, "the column split is for D = 128 (two blocks)");
  static constexpr int kStateWGs = kSplitColumns ? 1 : kD / 64;
  static constexpr int kWarpgroupThreads = 128;
  static constexpr int kThreads = kWarpgroupThreads * (2 + kStateWGs);

  // Barrier sizes and arrival counts, from the roles above (fwd_kernel.cuh initialises the
  // mbarriers; named barriers sync these many threads):
  //   in_full     1: the TMA warp's lane, with the chunk's transaction bytes (kTmaBytes)
  //   in_ready    the two norm warps and the gate warp: a chunk's rows and gates are in
  //   in_empty    the chunk-local warpgroup and every state warpgroup: the input stage is free
  //   local_full  the chunk-local warpgroup: T, P and the factors of a chunk are in
  //   local_empty every state warpgroup: the local stage is free
  //   fk_full     the k-norm warp: a chunk's key factors fk are in (the gate warp waits)
  static constexpr uint32_t kNormThreads = 64, kGateThreads = 32;
  static constexpr uint32_t kInReadyArrivals = kNormThreads + kGateThreads;
  static constexpr uint32_t kInEmptyArrivals = kWarpgroupThreads * (1 + kStateWGs);
  static constexpr uint32_t kLocalFullArrivals = kWarpgroupThreads;
  static constexpr uint32_t kLocalEmptyArrivals = kWarpgroupThreads * kStateWGs;
  static constexpr uint32_t kFkFullArrivals = 32;

  static constexpr Precision kPrecision = kPrecision_;
  static constexpr bool kSplitState = kPrecision != Precision::kFast;   // S: kHigh, kSplitStates
  static constexpr bool kSplitUpdate = kPrecision != Precision::kFast;  // Vd: kHigh, kSplitStates
  static constexpr bool kSplitLocal = kPrecision == Precision::kHigh;   // Y, Vn (o), T, P
  static constexpr int kLocalParts = kSplitLocal ? 2 : 1;  // T and P: hi (+ lo)

  // Ring depths: raw chunk inputs (TMA) and chunk-local results. Three input stages let the TMA
  // for chunk j + 2 fly while the chunk-local role works on j + 1 and the state on j; the split
  // T and P of kHigh leave room for two at D = 128.
  static constexpr int kInStages = (kD == 128 && kSplitLocal) ? 2 : 3;
  static constexpr int kLocalStages = 2;

  // Registers per thread by role (setmaxnreg). The CTA starts with 65536 / kThreads registers a
  // thread (128 at D = 128, 168 at D = 64) and the budgets must add up to no more than that, or
  // setmaxnreg.inc waits forever: 24 + 104 + 2 x 192 = 512 = 4 x 128; 32 + 232 + 240 = 504 = 3 x 168
  // (one state warpgroup: D = 64, or D = 128 with the columns split).
  // A state warpgroup holds S (D/2 floats), a 64 x 128 accumulator (64) and one product's A
  // fragments (D/4); the chunk-local one both grams' 64 x 64 accumulators while it gates them
  // (64) with the column values in flight, then small tiles of the inverse. (At 80 / 200 the
  // local role spilled 128 B at D = 128; at 96 with the column values two blocks ahead, 16 B.)
  // The producer's warps hold a 16-byte load or two and a sum: 24 is the hardware's minimum.
  static constexpr bool kFourWGs = kStateWGs == 2;
  static constexpr uint32_t kProducerRegs = kFourWGs ? 24 : 32;
  static constexpr uint32_t kLocalRegs = kFourWGs ? 104 : 232;
  static constexpr uint32_t kStateRegs = kFourWGs ? 192 : 240;
  static constexpr uint32_t kEntryRegs = (65536 / kThreads) / 8 * 8;
  static_assert(kProducerRegs + kLocalRegs + kStateWGs * kStateRegs <= kEntryRegs * (2 + kStateWGs),
                "register budgets exceed the CTA's registers");

  // Bytes one chunk's TMA loads bring: Q and K (64 x D each) and the CTA's value columns of V
  // (64 x 64 per state warpgroup).
  static constexpr uint32_t kTmaBytes = (2u * kD + 64u * kStateWGs) * 64u * 2u;
};

// Named barrier ids (0 is __syncthreads).
enum class FwdBarrier : uint32_t {
  kChunkLocal = 1,  // the chunk-local warpgroup's phases
  kStateBase = 3,   // + state warpgroup index: its output staging (2: free since fk_full)
};

}  // namespace flashgdn::sm90
