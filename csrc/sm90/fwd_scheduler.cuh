// Work items of the Hopper forward: one (sequence, value head) state chain per CTA, its chunks
// walked in order by every role. Every role derives the same chunk sequence from the item, so
// the pipelines need no metadata beyond their barriers.
#pragma once

#include <cstdint>

#include "cuda/chunk_index.cuh"
#include "sm90/fwd_params.h"

namespace flashgdn::sm90 {

// 32-bit fields: the CUDA backend takes T < 2^31 tokens per batch row (TMA coordinates are
// 32-bit), so every token index and count fits.
struct WorkItem {
  int32_t n;        // sequence
  int32_t h;        // value head
  int32_t hq;       // its q/k head
  int32_t b;        // batch row
  int32_t t0;       // first token (within the batch row)
  int32_t len;      // tokens
  int32_t nchunks;  // ceil(len / 64)

  // Tokens of chunk j (1..64).
  __device__ __forceinline__ int chunk_len(int32_t j) const {
    const int32_t rest = len - j * 64;
    return rest < 64 ? rest : 64;
  }
};

// Item of this CTA: value heads of one sequence are adjacent, so CTAs that share q/k (GVA)
// run together and share those loads through L2.
__device__ __forceinline__ WorkItem fwd_work_item(const FwdParams& p) {
  WorkItem w;
  const int32_t hv = static_cast<int32_t>(p.Hv);
  w.n = static_cast<int32_t>(blockIdx.x / hv);
  w.h = static_cast<int32_t>(blockIdx.x % hv);
  w.hq = w.h / static_cast<int32_t>(p.group);
  const cuda::SeqInfo si = cuda::seq_info(p.seq, w.n);
  w.b = static_cast<int32_t>(si.b);
  w.t0 = static_cast<int32_t>(si.t0);
  w.len = static_cast<int32_t>(si.len);
  w.nchunks = (w.len + 63) / 64;
  return w;
}

// Stage and phase parity of the i-th use of a ring of kStages buffers.
template <int kStages>
struct RingPos {
  int stage;
  uint32_t phase;
  __device__ __forceinline__ explicit RingPos(int32_t i)
      : stage(static_cast<int>(i % kStages)), phase(static_cast<uint32_t>((i / kStages) & 1)) {}
};

}  // namespace flashgdn::sm90
