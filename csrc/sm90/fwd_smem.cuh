// The shared-memory plan of the Hopper forward: one struct, every tile 1024-byte aligned (the
// 128-byte swizzle repeats every 8 rows of 128 bytes, and TMA and wgmma both assume the tile
// starts on a swizzle block).
#pragma once

#include <cstddef>

#include "sm90/fwd_traits.cuh"
#include "sm90/ptx.cuh"

namespace flashgdn::sm90 {

template <class Tr>
struct FwdSmem {
  using Tin = typename Tr::Tin;
  static constexpr int kBlocks = Tr::kBlocks;

  // One chunk's inputs, written by the producer warpgroup (TMA tiles, gates, row norms).
  struct alignas(1024) InStage {
    // Column block b of Q (rows 0..63) and K (rows 64..127): stacking them lets one wgmma of
    // width 128 compute S^T [Q; K]^T. Rows past the chunk are zeroed by the norm warps.
    Tin qk[kBlocks][128][64];
    // Column block b of V: state warpgroup b reads only its own, and once Y is formed it stages
    // its output tile there ([64 tokens][64 values]) before the stage is released.
    Tin v[kBlocks][64][64];
    // Per token (zero past the chunk, except c2, which stays at the chunk's last value):
    float c2[64];    // in-chunk cumulative gate in log2 units, log2(e) (g_1 + ... + g_t)
    float beta[64];
    float fq[64];    // factor of the stored q row: 1 / sqrt(|q|^2 + 1e-6) with l2norm, else 1
    float fk[64];    // same for k
    float u[64];     // column exponent of key t: c2_t - log2(fk_t) (+inf where fk_t = 0), so
                     // that the gate-and-factor of (K K^T)_it and (Q K^T)_it is 2^(c2_i - u_t)
  };

  // One chunk's local results, written by the chunk-local role for the state warpgroups.
  struct alignas(1024) LocalStage {
    Tin t[Tr::kLocalParts][64][64];  // T_LL, T_HH of T = (I + A)^-1 and -A_HL in T_HL's place,
                                     // [i][j] (hi, lo): fwd_chunk_local.cuh
    Tin p[Tr::kLocalParts][64][64];  // P = scale lower(Q K^T (.) D) with the norm factors, [i][j]
    // Per-token factors (zero for tokens past the chunk):
    float ykf[64];  // exp(c_t) fk_t          : Y = beta (V - ykf (.) K S)
    float yb[64];   // beta_t
    float of[64];   // scale fq_t exp(c_t)    : O = of (.) Q S + P Vn
    float vd[64];   // exp(c_C - c_t) fk_t    : S <- exp(c_C) S + K^T (vd (.) Vn)
    float decay;    // exp(c_C)
  };

  InStage in[Tr::kInStages];
  LocalStage local[Tr::kLocalStages];

  // Chunk-local role's private work space (fwd_inverse.cuh).
  alignas(16) float af[64][68];  // A_10, A_32 (left of the diagonal blocks of warps 1, 3); the
                                 // upper triangle holds the inverse's intermediate products
  alignas(16) float tf[64][68];  // T in fp32 while it is built

  // in_full: the TMA tiles landed; in_ready: gates and norms written too (rows zeroed/rescaled);
  // fk_full: the key factors fk written (the k-norm warp to the gate warp).
  Mbarrier in_full[Tr::kInStages], in_ready[Tr::kInStages], in_empty[Tr::kInStages];
  Mbarrier fk_full[Tr::kInStages];
  Mbarrier local_full[Tr::kLocalStages], local_empty[Tr::kLocalStages];

  // The walk's counters (unit index, chunks walked) of every warp, where the roles keep them out
  // of registers (split state: fwd_kernel.cuh, walk_items).
  int32_t walk[Tr::kThreads / 32][2];
};

// Dynamic shared memory the kernel asks for: the struct plus room to align its start to 1024.
template <class Tr>
constexpr size_t fwd_smem_bytes() {
  return sizeof(FwdSmem<Tr>) + 1024;
}

}  // namespace flashgdn::sm90
