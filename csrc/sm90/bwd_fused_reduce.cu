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
constexpr int kD = 128;

// Four adjacent values (i, 4 l .. 4 l + 3) of a 64 x 128 tile in the kernel's shared layout (two
// 64-column blocks, 128-byte swizzle): one 8-byte load.
__device__ __forceinline__ float4 tile4(const uint8_t* t, int i, int lane) {
  const int col = 4 * lane;
  const uint2 u = *reinterpret_cast<const uint2*>(t + (col >> 6) * 64 * 128 + sm90::swizzle128(i, (col & 63) >> 3) +
                                                  (col & 7) * 2);
  const float2 a = sm90::unpack2<bf16>(u.x), c = sm90::unpack2<bf16>(u.y);
  return make_float4(a.x, a.y, c.x, c.y);
}
__device__ __forceinline__ void store4(bf16* o, float4 x) {
  *reinterpret_cast<uint2*>(o) = make_uint2(cuda::pack2<bf16>(x.x, x.y), cuda::pack2<bf16>(x.z, x.w));
}

// One block per (chunk slot, q/k head): a warp a token, four columns a lane. dq, dk = the sum over
// the group's value heads (ascending) of the tiles, then (l2norm) dx = r (dx^ - x^ (x^ . dx^));
// dv and dbeta of the group's value heads copied out.
__global__ void __launch_bounds__(kThreads) fused_reduce_kernel(BwdParams P, FusedBuffers F) {
  const int64_t gc = blockIdx.x, hq = blockIdx.y;
  ChunkInfo ci;
  if (!locate_chunk(P.seq, gc, ci)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < ci.len; i += kThreads / 32) {
    for (int which = 0; which < 2; ++which) {  // 0: dq (tile 2), 1: dk (tile 0)
      float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int64_t g = 0; g < P.group; ++g) {
        const int64_t tile = (gc * P.Hv + hq * P.group + g) * F.out_count + (which == 0 ? F.out_count - 1 : 0);
        const float4 x = tile4(F.out + tile * fk::kTile, i, lane);
        d.x += x.x, d.y += x.y, d.z += x.z, d.w += x.w;
      }
      if (P.l2norm) {  // x^ = x / ||x||, as the prep scaled it
        const Tensor4& xt = which == 0 ? P.q : P.k;
        const bf16* x = static_cast<const bf16*>(xt.data) + tok_off(xt, ci.b, ci.t0 + i, hq);
        const float rn = warp_row_rnorm<kD>(x, lane);
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(x) + lane);
        const float2 x01 = sm90::unpack2<bf16>(raw.x), x23 = sm90::unpack2<bf16>(raw.y);
        const float4 xn = make_float4(x01.x * rn, x01.y * rn, x23.x * rn, x23.y * rn);
        const float dot = warp_sum(xn.x * d.x + xn.y * d.y + xn.z * d.z + xn.w * d.w);
        d = make_float4(rn * (d.x - xn.x * dot), rn * (d.y - xn.y * dot), rn * (d.z - xn.z * dot),
                        rn * (d.w - xn.w * dot));
      }
      const Tensor4& out = which == 0 ? P.dq : P.dk;
      store4(static_cast<bf16*>(out.data) + tok_off(out, ci.b, ci.t0 + i, hq) + 4 * lane, d);
    }
    for (int64_t g = 0; g < P.group; ++g) {
      const int64_t h = hq * P.group + g, u = gc * P.Hv + h;
      if (!F.dv_direct)
        store4(static_cast<bf16*>(P.dv.data) + tok_off(P.dv, ci.b, ci.t0 + i, h) + 4 * lane,
               tile4(F.out + (u * 3 + 1) * fk::kTile, i, lane));
      else if (F.dv_tail != nullptr && ci.len < kC)  // a packed sequence's tail (FusedLayout::tails)
        store4(static_cast<bf16*>(P.dv.data) + tok_off(P.dv, ci.b, ci.t0 + i, h) + 4 * lane,
               tile4(F.dv_tail + (ci.n * P.Hv + h) * fk::kTile, i, lane));
      if (lane == 0)
        store_from_float(P.dbeta.data, P.beta_dtype, ci.b * P.dbeta.s0 + (ci.t0 + i) * P.dbeta.s1 + h * P.dbeta.s2,
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
