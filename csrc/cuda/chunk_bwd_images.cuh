// The reverse pass's operands as the tensor cores read them ("images"), written once per chunk
// by chunk_prep and copied whole into shared memory by the reverse pass (chunk_bwd_dh.cu): bf16
// hi + lo parts (x = hi + lo, |lo| <= 2^-8 |x|: ~16 bits, the products keep fp32 accuracy), each
// a run of [rows][64] tiles of 128-byte rows in the 128-byte swizzle (16-byte chunk c of row r at
// chunk c ^ (r mod 8)), so that a byte copy lands them as wgmma's K-major operands.
//
// Per (chunk slot, value head), with c the in-chunk cumulative gate, L the chunk's tokens and
// every row past L zero:
//   K~   [64 tokens][D]            K~_t  = exp(c_L - c_t) Kn_t        (B of dV_new^T = dS^T K~^T)
//   QW   [D][64 tokens | 64 tokens] columns 0..63: scale exp(c_t) Qn_t, 64..127: -W_t
//                                                                   (B of dS^T += dO^T Q~ - dV_new^T W)
//   dOt  [D][64 tokens]            dO^T                              (A of dO^T Q~)
// Layout: K~ hi, K~ lo (D / 64 tiles of 64 rows each), QW hi, QW lo (two tiles of D rows), dOt hi,
// dOt lo (one tile of D rows). At `fast` nothing reads a lo part (the reverse pass takes hi*hi
// alone), and the workspace holds the hi parts alone, in the same order (Images::at): half the
// bytes. The reverse pass's shared memory keeps the full layout at every level.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>

#include "sm90/ptx.cuh"

namespace flashgdn::cuda::bwd {

template <int D>
struct Images {
  static constexpr uint32_t kKPart = (D / 64) * 64 * 128;  // one part (hi or lo) of K~
  static constexpr uint32_t kQWTile = D * 128;             // one 64-column tile of QW
  static constexpr uint32_t kQWPart = 2 * kQWTile;
  static constexpr uint32_t kOPart = D * 128;
  static constexpr uint32_t kK = 0;                          // offsets of the three images
  static constexpr uint32_t kQW = 2 * kKPart;
  static constexpr uint32_t kO = kQW + 2 * kQWPart;
  static constexpr uint32_t kBytes = kO + 2 * kOPart;         // 128 KB at D = 128
  static constexpr uint32_t kKBytes = 2 * kKPart;             // the copies: K~, then QW and dOt
  static constexpr uint32_t kQWOBytes = kBytes - kQW;
  static constexpr uint32_t kHiBytes = kKPart + kQWPart + kOPart;  // the hi parts alone (`fast`)

  // Where the images of one (chunk slot, value head) lie in the workspace: every part, or
  // (hi_only, at `fast`) the hi parts alone.
  struct Placement {
    uint32_t k, qw, o, bytes;
  };
  __host__ __device__ static constexpr Placement at(bool hi_only) {
    return hi_only ? Placement{0, kKPart, kKPart + kQWPart, kHiBytes} : Placement{kK, kQW, kO, kBytes};
  }
};

// chunk_prep builds one image part pair (hi, lo) at a time in this much dynamic shared memory,
// 1024-aligned (dynamic_smem_1024, chunk_bwd_internal.cuh), and ships it with bulk copies.
constexpr uint32_t kImageStage = 32 * 1024;

// Writes x0, x1 (columns col, col + 1 of row `row` of a [rows][64] tile) as hi and lo pairs:
// hi into the part at `hi`, lo `part_bytes` further.
__device__ __forceinline__ void put_image_pair(uint8_t* hi, uint32_t part_bytes, int row, int col, float x0,
                                               float x1) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  const uint32_t off = sm90::swizzle128(static_cast<uint32_t>(row), static_cast<uint32_t>(col >> 3)) + (col & 7) * 2;
  *reinterpret_cast<__nv_bfloat162*>(hi + off) = h;
  *reinterpret_cast<__nv_bfloat162*>(hi + part_bytes + off) = l;
}

// One value x at (row, col) as hi and lo.
__device__ __forceinline__ void put_image_one(uint8_t* hi, uint32_t part_bytes, int row, int col, float x) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  const uint32_t off = sm90::swizzle128(static_cast<uint32_t>(row), static_cast<uint32_t>(col >> 3)) + (col & 7) * 2;
  *reinterpret_cast<__nv_bfloat16*>(hi + off) = h;
  *reinterpret_cast<__nv_bfloat16*>(hi + part_bytes + off) = __float2bfloat16_rn(x - __bfloat162float(h));
}

}  // namespace flashgdn::cuda::bwd
