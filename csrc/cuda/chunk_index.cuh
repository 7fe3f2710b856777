// Chunk enumeration on the device, without host synchronisation.
//
// Sequences are split into chunks of kChunk = 64 tokens, starting at each sequence's first
// token. Every chunk gets a global id ("slot"):
//   dense  (B sequences of T tokens): slot(n, j) = n * ceil(T / 64) + j
//   varlen (B == 1, cu_seqlens [N+1]): slot(n, j) = floor(cu[n] / 64) + n + j
// The varlen formula needs no prefix sum over the sequences: f(n) = floor(cu[n]/64) + n is
// strictly increasing and sequence n's chunks [f(n), f(n) + ceil(len_n / 64)) never reach
// f(n + 1), so slots are unique; some slots are unused (surplus). The slot count is an upper
// bound known on the host from the shapes alone: ceil(T/64) + N (varlen), B * ceil(T/64)
// (dense). A grid over the slots calls locate_chunk and lets surplus blocks exit.
//
// Flat token index (used by per-token workspaces): b * T + t.
#pragma once

#include <cstdint>

#include "common/problem.h"
#include "cuda/device_utils.cuh"

namespace flashgdn::cuda {

constexpr int kChunk = 64;

// The sequence layout as kernels see it (plain data, passed by value).
struct SeqLayout {
  const void* cu = nullptr;  // cu_seqlens on the device (varlen only)
  int32_t cu_dtype = FGDN_INT64;
  int32_t varlen = 0;
  int64_t N = 0;  // sequences
  int64_t B = 0;
  int64_t T = 0;
};

inline SeqLayout make_seq_layout(const Problem& p, const fgdn_inputs& in) {
  SeqLayout s;
  s.varlen = p.varlen ? 1 : 0;
  s.cu = p.varlen ? in.cu_seqlens.data : nullptr;
  s.cu_dtype = p.varlen ? in.cu_seqlens.dtype : FGDN_INT64;
  s.N = p.N;
  s.B = p.B;
  s.T = p.T;
  return s;
}

// Upper bound on the global chunk ids (host; shapes only).
inline int64_t num_chunk_slots(const SeqLayout& s) {
  return s.varlen ? ceil_div(s.T, kChunk) + s.N : s.B * ceil_div(s.T, kChunk);
}
inline int64_t num_chunk_slots(const Problem& p) {
  return p.varlen ? ceil_div(p.T, kChunk) + p.N : p.B * ceil_div(p.T, kChunk);
}

struct SeqInfo {
  int64_t b;    // batch row
  int64_t t0;   // first token within the batch row
  int64_t len;  // tokens
};

__device__ __forceinline__ SeqInfo seq_info(const SeqLayout& s, int64_t n) {
  if (!s.varlen) return SeqInfo{n, 0, s.T};
  const int64_t a = load_index(s.cu, s.cu_dtype, n);
  const int64_t e = load_index(s.cu, s.cu_dtype, n + 1);
  return SeqInfo{0, a, e - a};
}

// Global id of chunk j of sequence n (first token t0 + 64 j).
__device__ __forceinline__ int64_t chunk_slot(const SeqLayout& s, int64_t n, int64_t j,
                                              int64_t seq_t0) {
  if (!s.varlen) return n * ceil_div(s.T, kChunk) + j;
  return seq_t0 / kChunk + n + j;
}

// Varlen checkpoints: out[n] = sum_{m < n} floor(len_m / every), the first checkpoint row of
// sequence n ([N] int64 on the device), computed on `stream`.
void launch_checkpoint_offsets(const SeqLayout& seq, int64_t every, int64_t* out, cudaStream_t stream);

struct ChunkInfo {
  int64_t n;    // sequence
  int64_t b;    // batch row
  int64_t t0;   // first token of the chunk within its batch row
  int64_t j;    // chunk index within the sequence
  int32_t len;  // tokens in this chunk, 1..64
  int64_t seq_t0, seq_len;
};

// Maps a global chunk id to its chunk; false for a surplus slot (nothing to do).
// Varlen: a binary search over cu_seqlens (log2 N global reads, no host data).
__device__ inline bool locate_chunk(const SeqLayout& s, int64_t slot, ChunkInfo& c) {
  if (!s.varlen) {
    const int64_t nt = ceil_div(s.T, kChunk);
    c.n = slot / nt;
    c.j = slot % nt;
    if (c.n >= s.B) return false;
    c.b = c.n;
    c.seq_t0 = 0;
    c.seq_len = s.T;
  } else {
    // Largest n in [0, N) with f(n) = floor(cu[n] / 64) + n <= slot.
    int64_t lo = 0, hi = s.N - 1;
    if (s.N <= 0) return false;
    if (load_index(s.cu, s.cu_dtype, 0) / kChunk > slot) return false;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (load_index(s.cu, s.cu_dtype, mid) / kChunk + mid <= slot)
        lo = mid;
      else
        hi = mid - 1;
    }
    const SeqInfo q = seq_info(s, lo);
    c.n = lo;
    c.b = 0;
    c.seq_t0 = q.t0;
    c.seq_len = q.len;
    c.j = slot - (q.t0 / kChunk + lo);
  }
  const int64_t first = c.j * kChunk;
  if (first >= c.seq_len) return false;
  c.t0 = c.seq_t0 + first;
  const int64_t rest = c.seq_len - first;
  c.len = static_cast<int32_t>(rest < kChunk ? rest : kChunk);
  return true;
}

}  // namespace flashgdn::cuda
