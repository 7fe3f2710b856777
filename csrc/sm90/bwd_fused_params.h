// The fused backward kernel's parameters (bwd_fused_kernel.cuh), filled by bwd_fused.cu.
#pragma once

#include <cstdint>

#include "cuda/bwd_dh_plan.h"
#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/tma.h"

namespace flashgdn::sm90::fused_bwd {

constexpr uint32_t kTile = 64 * 128 * 2;   // a 64 x 128 bf16 tile: 16 KB
constexpr uint32_t kState = 128 * 128 * 2;  // 32 KB
constexpr uint32_t kSmall = 64 * 64 * 2;    // 8 KB

struct Params {
  // q, k ([rows, Hq, 128]) and v, dO ([rows, Hv, 128]): bf16 in slot layout (64 rows a chunk slot,
  // zero past the chunk's length; bwd_fused_prep.cu), as 4-D tile maps (sm90/tma.h: boxes of
  // 64 x 1 x 64 x 1, the 128-byte swizzle); v, dO the user's [B, T, Hv, 128] where vo_direct.
  TileMap tq, tk, tv, tdo;
  // S0: the states pass's bf16 h ([(slots + 1) Hv 128 rows][128], [K][V] a unit) as a one-head
  // tile map: four boxes of 64 rows x 64 columns a state.
  TileMap ts0;
  cuda::SeqLayout seq;
  int32_t Hv, group;
  const uint8_t* ar;    // [slot Hv + h] 64 x 64 bf16 tiles of Ar (the shared layout)
  const float* gates;   // [slot Hv + h][2][64]: c, beta (c held and beta zero past the length)
  uint8_t* out_tiles;   // [slot Hv + h][out_count] tiles: dk, dv, dq (bf16, the shared layout; no dv: dv_direct)
  float* dg;            // [slot Hv + h][64]: dL/dg before the floor and the activation
  float* dbeta;         // [slot Hv + h][64]
  // d_final_state and dh0 as the library's state tensors (bwd::BwdParams; element (n, h, a, v)
  // at n s0 + h s1 + a s2 + v, or v s2 + a where state_v_first), fp32 | bf16 | fp16.
  cuda::bwd::Tensor4 dht, dh0;
  const void* state_indices;
  int32_t has_dht, want_dh0, state_v_first, has_state_indices, idx_dtype;
  int32_t vo_direct;  // tv, tdo map the user's v, dO (FusedLayout::vo_direct)
  // tails (packed calls with vo_direct): a sequence's partial last chunk read from tv_tail,
  // tdo_tail ([N 64 rows, Hv, 128], zero past the length) and its dv stored to dv_tail
  // ([n Hv + h] tiles) where dv_direct: the rows past its length are the next sequence's.
  TileMap tv_tail, tdo_tail;
  uint8_t* dv_tail;
  int32_t tails;
  // dv_direct (vo_direct calls whose dv TMA can address): dv tiles stored through tdv into the
  // user's dv (rows past T not written), out_tiles then holds dk, dq only: out_count 2, else 3.
  TileMap tdv;
  int32_t dv_direct, out_count;
  float scale;
  // Reverse context parallelism (bwd_fused.cu; segments 1: each CTA walks a whole sequence): a
  // sequence's chunks in segments of cut.chunks(its chunks) (bwd_dh_plan.h's FusedCut), `segments`
  // of them at most; gridDim.z counts them (bwd_fused_scheduler.cuh's walk_kind).
  //   phase 1: z = 2 s + which. The last segment walked from dht, writing gradients, its start
  //            carry to the seed of s - 1; a segment 1 <= s < last walked for its transfer
  //            dS_in -> A_s dS_in + B_s only (no gradient written): which = 0 from dS = 0 with dO
  //            gives B_s, which = 1 from dS = I with dO = 0 gives A_s (the carry is affine in dS,
  //            linear in dO; K = V, so I is a carry; not run where transfer_negligible); the
  //            final dS to its transfer `which` (fp32 [128][128]).
  //   phase 0: z = s, segment s < last walked from its seed, the scan's dS at its end
  //            (the whole sequence from dht without a split).
  cuda::bwd::FusedCut cut;
  int32_t segments, phase;
  // The seeds and transfers, chain n Hv + h's at bwd_dh_plan.h's fused_cp_seed, fused_cp_map
  // (S = segments), a 128 x 128 fp32 matrix each.
  float* cp;
  const float* bound;  // [slot Hv + h]: the certificate's log bound of a chunk (transfer_negligible)
};

}  // namespace flashgdn::sm90::fused_bwd
