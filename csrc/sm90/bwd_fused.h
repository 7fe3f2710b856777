// The fused backward's host side (bwd_fused.cu): when it applies, its workspace and its launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/bwd_fused_params.h"

namespace flashgdn::cuda::bwd {

// The fused kernel takes the backward at `fast` and `default` with bf16 inputs and K = V = 128
// (at `default` not with the gate in the kernel: D7); every other call (`high`, fp16, K = V = 64)
// takes the staged chain (chunk_bwd.cu), as does every call while FLASHGDN_BWD_FUSED reads as 0
// (std::atoi; read on every call), for A/B runs.
bool fused_backward_applies(const Problem& p);

// Its per-chunk buffers, every chunk slot at once (the walk covers whole sequences), in order.
// vo_direct: the kernel reads v and dO from the user's tensors (where TMA can address them): no
// copies then, but for a packed call's tails (kVTail, kDoTail: a sequence's partial last chunk,
// whose rows past its length are the next sequence's, as 64 rows zero past the length; a dense
// call's partial chunk is at its row's end, where the map reads zeros). dv_direct: dv stored in
// place, a packed sequence's tail through kDvTail (the reduce step copies its rows out).
struct FusedLayout {
  enum { kQ16, kK16, kV16, kDo16, kVTail, kDoTail, kDvTail, kGates, kAr, kOut, kDg, kDbeta, kBound, kRowScale, kCp, kCount };
  size_t off[kCount];
  size_t bytes;
  bool vo_direct;
  bool tails;         // vo_direct on a packed call: the sequences' tails through kVTail, kDoTail (kDvTail)
  bool dv_direct;     // vo_direct and TMA can address dv: the kernel writes dv in place
  int32_t out_count;  // kOut's tiles a (chunk slot, value head): dk, dq (2) with dv_direct, else dk, dv, dq
  // The out tiles in the states' memory (kOut empty): with dv_direct a unit's dk, dq tiles (2 x 16
  // KB) fill its bf16 state (128 x 128 x 2 bytes), and the walk stores a unit's tiles only after
  // it has read that unit's state (the chunk's S0, loaded before the chunk's products; no other
  // reader of h follows the walk). Where h is the caller's saved_states, only with their consent
  // (fgdn_bwd_args::saved_states_scratch).
  bool out_in_states;
  // Reverse CP (bwd_dh_plan.h's segments; 1: none): kCp, per chain the seeds and transfers the
  // walks and the scan use (bwd_dh_plan.h's fused_cp_per_chain: 3 S - 5 fp32 128 x 128 matrices).
  cuda::bwd::FusedCut cut;
  int32_t segments;
};
FusedLayout fused_layout(const Problem& p, const fgdn_bwd_args& a);

struct FusedBuffers {
  __nv_bfloat16 *q16, *k16, *v16, *do16;  // [slot 64 + i][heads][128], zero past the length
                                          // (v16, do16 null: vo_direct)
  __nv_bfloat16 *v_tail, *do_tail;        // [n 64 + i][Hv][128]: sequence n's partial last chunk,
                                          // zero past the length (FusedLayout::tails; else null)
  uint8_t* dv_tail;                       // [n Hv + h]: its dv tile (tails and dv_direct; else null)
  float* gates;                           // [slot Hv + h][2][64]: c, beta
  uint8_t* ar;                            // [slot Hv + h]: Ar, a 64 x 64 bf16 tile
  uint8_t* out;                           // [slot Hv + h][out_count]: dk, dv, dq tiles (bf16; dv not
                                          // with dv_direct: the kernel stores it in place)
  int32_t dv_direct, out_count;
  float* dg;                              // [slot Hv + h][64] (P.dc: the gate step reads it)
  float* dbeta;                           // [slot Hv + h][64]
  float* bound;                           // [slot Hv + h]: reverse CP's certificate (fused_bwd::Params)
  float* row_scale;                       // [slot Hq + hq][2][64]: q's, k's 1 / ||x|| (l2norm, else null; the
                                          // prep's, for the reduce's norm backward)
  float* cp;                              // reverse CP's seeds and transfers (FusedLayout::kCp)
  cuda::bwd::FusedCut cut;
  int32_t segments;
};

// The steps' launches, a file each: 2 (bwd_fused_prep.cu), 3b (bwd_fused_scan.cu), 4
// (bwd_fused_reduce.cu); P.num_chunks chunk slots.
void launch_fused_prep(const BwdParams& P, const FusedBuffers& F, cudaStream_t s);
void launch_fused_cp_scan(const sm90::fused_bwd::Params& K, int64_t N, int64_t Hv, cudaStream_t s);
void launch_fused_reduce(const BwdParams& P, const FusedBuffers& F, cudaStream_t s);

// Steps 2-4 of bwd_fused.cu over every chunk slot (P.slot0 = 0, P.slots = P.num_chunks), after the
// states pass; the gate step and the head sums follow (chunk_bwd.cu).
void launch_bwd_fused(const BwdParams& P, const fgdn_bwd_args& a, const FusedBuffers& F, cudaStream_t s);

}  // namespace flashgdn::cuda::bwd
