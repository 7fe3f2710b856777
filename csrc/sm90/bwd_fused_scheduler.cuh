// What a CTA of the fused backward walks (bwd_fused_kernel.cuh), apart from how it walks it: the
// (sequence, value head, segment) of its grid coordinates, the chunks and unit rows of that walk,
// whether it has any work, and the reverse CP certificate that drops a transfer (the scan,
// bwd_fused.cu, applies the same one).
#pragma once

#include <cstdint>

#include "cuda/chunk_index.cuh"
#include "sm90/bwd_fused_params.h"

namespace flashgdn::sm90::fused_bwd {

// Segment `seg` of sequence n, value head h (P.cut's, by the sequence's length): `chunks`
// chunks from chunk `first` (0 or fewer: a segment past the sequence's end), `total` the
// sequence's; unit rows (slot Hv + h) as 32-bit integers from u0 (the launcher checks the range);
// from_dht: it ends the sequence, so its carry starts from d_final_state. b, t0: the sequence's
// batch row and first token in the caller's [B, T, H, D] tensors (dense n, 0; packed 0, cu[n]).
// tail: the walk's first chunk (the sequence's last) is a packed sequence's partial one, read from
// and stored to the tails (Params::tails).
struct Walk {
  int chunks, first, total, u0;
  int b, t0;
  bool from_dht, tail;
};
__device__ __forceinline__ Walk walk_of(const Params& P, int64_t n, int h, int seg) {
  const cuda::SeqInfo si = cuda::seq_info(P.seq, n);
  Walk w;
  w.total = static_cast<int>(cuda::ceil_div(si.len, int64_t{64}));
  const int len = P.cut.chunks(w.total);
  w.first = len * seg;
  w.chunks = min(w.total - w.first, len);
  w.from_dht = w.first + w.chunks == w.total;
  w.u0 = static_cast<int>(cuda::chunk_slot(P.seq, n, w.first, si.t0)) * P.Hv + h;
  w.b = static_cast<int>(si.b);
  w.t0 = static_cast<int>(si.t0);
  w.tail = P.tails && w.from_dht && w.chunks > 0 && (si.len & 63) != 0;
  return w;
}

// The reverse CP certificate. A segment's transfer A_s is the adjoint of the states' transfer
// over its tokens, prod_t e^{g_t} (I - beta_t k_t k_t^T), of norm at most e^{sum_t g_t} prod_t
// max(1, |1 - beta_t |k_t|^2|); bound[u] holds that bound's log for one chunk (the prep's:
// c_L + sum_t log max(1, |1 - beta_t |k_t|^2|), from the keys the walk multiplies). Below e^-16
// (the forward's kCertifyLogDecay: 1.1e-7 of the carry, four orders below a bf16 ulp) A_s X is
// dropped: its walk is not run and the scan takes X = B_s. The kernel and the scan decide alike
// (the same sum in the same order). Every lane of a warp asks together: lane l sums the chunks
// l, l + 32, .., then the warp's butterfly (every lane the same value): a segment's bounds loaded
// at once, where one thread summing them in turn waited out a load each (the scan asks once a
// segment, one after another).
// In two parts for the scan, which issues a lane's first bound before its product and sums after
// it: transfer_bound_first (chunk l's bound, 0 past the segment) and transfer_negligible_from (the
// rest in the same order: 0 + x is x, so the same bits as one sum).
constexpr float kTransferLogBound = -16.f;
__device__ __forceinline__ float transfer_bound_first(const float* bound, int u0, int chunks, int hv) {
  const int j = static_cast<int>(threadIdx.x & 31);
  return j < chunks ? bound[u0 + j * hv] : 0.f;
}
__device__ __forceinline__ bool transfer_negligible_from(float first, const float* bound, int u0, int chunks, int hv) {
  float s = first;
  for (int j = static_cast<int>(threadIdx.x & 31) + 32; j < chunks; j += 32) s += bound[u0 + j * hv];
  return cuda::warp_sum(s) < kTransferLogBound;
}
__device__ __forceinline__ bool transfer_negligible(const float* bound, int u0, int chunks, int hv) {
  return transfer_negligible_from(transfer_bound_first(bound, u0, chunks, hv), bound, u0, chunks, hv);
}

// What a CTA's walk does. Phase 0 walks segments 0 .. S - 2 of a sequence of S segments (all of
// it without a split; segment 0 always: dh0 of a sequence of no chunks is d_final_state), each
// from its seed, writing gradients. Phase 1 (grid z = 2 s + which) walks the last segment S - 1
// from d_final_state, writing gradients and its start carry (the seed of S - 2: no transfer is
// needed for it), and the transfers of segments 1 .. S - 2: B_s (which 0) and A_s (which 1,
// zero_do) where not certified away.
enum class WalkKind { kNone, kGradients, kGradientsSeeding, kTransfer };
__device__ __forceinline__ WalkKind walk_kind(const Params& P, int64_t n, int h, int seg, bool phase1, bool zero_do) {
  const cuda::SeqInfo si = cuda::seq_info(P.seq, n);
  const int total = static_cast<int>(cuda::ceil_div(si.len, int64_t{64}));
  const int len = P.cut.chunks(total), segs = (total + len - 1) / len;
  const int last = max(segs - 1, 0);
  if (!phase1) return seg == 0 || seg < last ? WalkKind::kGradients : WalkKind::kNone;
  if (seg < 1 || seg > last) return WalkKind::kNone;
  if (seg == last) return zero_do ? WalkKind::kNone : WalkKind::kGradientsSeeding;
  if (zero_do) {
    const int first = len * seg;  // walk_of's, without its other fields
    const int u = static_cast<int>(cuda::chunk_slot(P.seq, n, first, si.t0)) * P.Hv + h;
    if (transfer_negligible(P.bound, u, min(total - first, len), P.Hv)) return WalkKind::kNone;
  }
  return WalkKind::kTransfer;
}

}  // namespace flashgdn::sm90::fused_bwd
