// The fused backward's step 4 (bwd_fused.cu): per (chunk slot, q/k head), dq and dk summed over
// the group's value heads, the l2norm's backward, dv (unless stored in place: then a packed
// sequence's tail alone) and dbeta out.
#include "sm90/bwd_fused.h"
#include "sm90/ptx.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::cuda::bwd {

namespace {

namespace fk = sm90::fused_bwd;
using bf16 = __nv_bfloat16;

// Four adjacent values of a 64 x 128 tile in the kernel's shared layout (two 64-column blocks,
// 128-byte swizzle) at byte offset `off` (lane_col_off + swizzle of the row): one 8-byte load.
__device__ __forceinline__ float4 tile4(const uint8_t* t, uint32_t off) {
  const uint2 u = *reinterpret_cast<const uint2*>(t + off);
  const float2 a = sm90::unpack2<bf16>(u.x), c = sm90::unpack2<bf16>(u.y);
  return make_float4(a.x, a.y, c.x, c.y);
}
__device__ __forceinline__ void store4(bf16* o, float4 x) {
  *reinterpret_cast<uint2*>(o) = make_uint2(cuda::pack2<bf16>(x.x, x.y), cuda::pack2<bf16>(x.z, x.w));
}

// One block per (chunk slot, q/k head): a warp a token, four columns a lane. dq, dk = the sum over
// the group's value heads (ascending) of the tiles, then (l2norm) dx = r (dx^ - x^ (x^ . dx^)) with
// the prep's r = 1 / ||x|| (F.row_scale: recomputed here from x's row, the kernel took 648 us at
// 16/64 1x32768 with q/k normalised in the call, 468 before it; read, 574); dv and dbeta of the
// group's value heads copied out. The addresses are formed once a block (the
// group's tiles, each tensor's row of the chunk's first token, the lane's place in a tile row) and
// stepped by a token: formed per value and token, their 64-bit arithmetic took most of the issue
// slots (the kernel issued on 73% of its cycles at 47% of the memory's rate; results/
// h200-2026-11-29/ncu-fused.md).
__global__ void __launch_bounds__(kThreads) fused_reduce_kernel(BwdParams P, FusedBuffers F) {
  const int64_t gc = blockIdx.x, hq = blockIdx.y;
  ChunkInfo ci;
  if (!locate_chunk(P.seq, gc, ci)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = static_cast<int>(P.group);
  // The group's out tiles: unit gc Hv + hq group + g, F.out_count tiles a unit, dk first, dq last.
  const size_t unit_bytes = size_t(F.out_count) * fk::kTile;
  const uint8_t* const units = F.out + size_t(gc * P.Hv + hq * P.group) * unit_bytes;
  const uint8_t* const tiles[2] = {units + size_t(F.out_count - 1) * fk::kTile, units};  // 0: dq, 1: dk
  // q's rows, then k's (allocated with the in-kernel l2norm alone)
  const float* const row_scale = P.l2norm ? F.row_scale + (gc * P.Hq + hq) * 2 * kC : nullptr;
  // The lane's four columns 4 l .. 4 l + 3: their column block and their bytes in a swizzled row.
  const int col = 4 * lane;
  const uint32_t lane_block = uint32_t(col >> 6) * 64u * 128u, lane_chunk = uint32_t(col & 63) >> 3,
                 lane_byte = uint32_t(col & 7) * 2u;
  const Tensor4* const xs[2] = {&P.q, &P.k};
  const Tensor4* const ds[2] = {&P.dq, &P.dk};
  const bool dv_copy = !F.dv_direct || (F.dv_tail != nullptr && ci.len < kC);
  for (int i = warp; i < ci.len; i += kThreads / 32) {
    const int64_t t = ci.t0 + i;
    const uint32_t off = lane_block + sm90::swizzle128(uint32_t(i), lane_chunk) + lane_byte;
#pragma unroll
    for (int which = 0; which < 2; ++which) {  // 0: dq, 1: dk
      float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
      const uint8_t* tile = tiles[which];
      for (int g = 0; g < group; ++g, tile += unit_bytes) {
        const float4 x = tile4(tile, off);
        d.x += x.x, d.y += x.y, d.z += x.z, d.w += x.w;
      }
      if (P.l2norm) {  // x^ = x / ||x|| with the prep's 1 / ||x|| (F.row_scale), as it scaled x
        const bf16* x = static_cast<const bf16*>(xs[which]->data) + tok_off(*xs[which], ci.b, t, hq);
        const float rn = row_scale[which * kC + i];
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(x) + lane);
        const float2 x01 = sm90::unpack2<bf16>(raw.x), x23 = sm90::unpack2<bf16>(raw.y);
        const float4 xn = make_float4(x01.x * rn, x01.y * rn, x23.x * rn, x23.y * rn);
        const float dot = warp_sum(xn.x * d.x + xn.y * d.y + xn.z * d.z + xn.w * d.w);
        d = make_float4(rn * (d.x - xn.x * dot), rn * (d.y - xn.y * dot), rn * (d.z - xn.z * dot),
                        rn * (d.w - xn.w * dot));
      }
      store4(static_cast<bf16*>(ds[which]->data) + tok_off(*ds[which], ci.b, t, hq) + 4 * lane, d);
    }
    const int64_t h0 = hq * P.group;
    for (int g = 0; g < group; ++g) {
      const int64_t h = h0 + g, u = gc * P.Hv + h;
      if (dv_copy) {
        const uint8_t* src = F.dv_direct ? F.dv_tail + (ci.n * P.Hv + h) * fk::kTile : F.out + (u * 3 + 1) * fk::kTile;
        store4(static_cast<bf16*>(P.dv.data) + tok_off(P.dv, ci.b, t, h) + 4 * lane, tile4(src, off));
      }
      if (lane == 0)
        store_from_float(P.dbeta.data, P.beta_dtype, ci.b * P.dbeta.s0 + t * P.dbeta.s1 + h * P.dbeta.s2,
                         F.dbeta[u * kC + i]);
    }
  }
}

}  // namespace

void launch_fused_reduce(const BwdParams& P, const FusedBuffers& F, cudaStream_t s) {
  fused_reduce_kernel<<<dim3(P.num_chunks, P.Hq), kThreads, 0, s>>>(P, F);
  FGDN_CHECK_LAUNCH("bwd fused reduce");
}

}  // namespace flashgdn::cuda::bwd
