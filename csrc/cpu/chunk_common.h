// What the CPU forward and backward share: strided element addressing of the caller's tensors,
// the per-chunk load (storage dtype -> float, l2norm, gate) and the intra-chunk quantities of
// gdn-math section 3 for one chunk of one (sequence, value head) pair:
//   c_i = g_1 + ... + g_i (each g floored at -128, common/numerics.h)
//   e_i = exp(c_i),  f_i = exp(c_m - c_i),  D_ij = exp(c_i - c_j) (j <= i)
//   Ab  = strict_lower(diag(beta) (K K^T) (.) D),  Tm = (I + Ab)^{-1}
//   X   = diag(beta) (K (.) e),  Y = diag(beta) V,  W = Tm X,  U = Tm Y
//   M   = lower((Q K^T) (.) D) (diagonal included),  Qe = Q (.) e,  Kf = K (.) f
// Every exponent is c_i - c_j <= 0 (j <= i), c_i <= 0 or c_m - c_i <= 0: nothing overflows.
#pragma once

#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "common/problem.h"
#include "cpu/cpu_backend.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cpu {

// Element offset of (b, t, h) in a [B, T, H, D] tensor (add the unit-stride d), or of (b, t, h)
// in a [B, T, H] tensor (h has unit stride there).
inline int64_t tok_off(const fgdn_tensor& x, int64_t b, int64_t t, int64_t h) {
  return b * x.strides[0] + t * x.strides[1] + h * x.strides[2];
}
inline int64_t gate_off(const fgdn_tensor& x, int64_t b, int64_t t, int64_t h) {
  return b * x.strides[0] + t * x.strides[1] + h;
}

// A state tensor [rows, Hv, K, V] (or [rows, Hv, V, K] with v_first) of dtype fp32, bf16 or
// fp16: element (i = k index, j = v index) of (row, head) at off(row, h) + ij(i, j). Loads
// convert to float (exact), stores round to the tensor's dtype (to nearest, ties to even).
struct StateView {
  void* data = nullptr;
  fgdn_dtype dtype = FGDN_FLOAT32;
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  bool v_first = false;

  StateView() = default;
  StateView(const fgdn_tensor& t, bool vf)
      : data(t.data), dtype(static_cast<fgdn_dtype>(t.dtype)), s0(t.strides[0]),
        s1(t.strides[1]), s2(t.strides[2]), s3(t.strides[3]), v_first(vf) {}
  bool present() const { return data != nullptr; }
  int64_t off(int64_t row, int64_t h) const { return row * s0 + h * s1; }
  int64_t ij(int64_t i, int64_t j) const { return v_first ? j * s2 + i * s3 : i * s2 + j * s3; }

  // S[K x V] (row-major, ld V) <- stored (row, h)
  void load(int64_t row, int64_t h, int64_t K, int64_t V, float* S) const {
    const int64_t o = off(row, h);
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) S[i * V + j] = load_float(data, dtype, o + ij(i, j));
  }
  // stored (row, h) <- S[K x V]
  void store(int64_t row, int64_t h, int64_t K, int64_t V, const float* S) const {
    const int64_t o = off(row, h);
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) store_float(data, dtype, o + ij(i, j), S[i * V + j]);
  }
};

// out[0, n) <- elements [off, off + n) of a float tensor of dtype dt (one dtype switch per row).
inline void load_row(const void* base, fgdn_dtype dt, int64_t off, int64_t n, float* out) {
  switch (dt) {
    case FGDN_FLOAT32: {
      const float* s = static_cast<const float*>(base) + off;
      for (int64_t i = 0; i < n; ++i) out[i] = s[i];
      break;
    }
    case FGDN_BFLOAT16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(s[i]);
      break;
    }
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = load_float(base, dt, off + i);
  }
}

// Elements [off, off + n) of a tensor of dtype dt <- x[0, n) rounded to dt.
inline void store_row(void* base, fgdn_dtype dt, int64_t off, int64_t n, const float* x) {
  switch (dt) {
    case FGDN_FLOAT32: {
      float* d = static_cast<float*>(base) + off;
      for (int64_t i = 0; i < n; ++i) d[i] = x[i];
      break;
    }
    case FGDN_BFLOAT16: {
      uint16_t* d = static_cast<uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(x[i]);
      break;
    }
    default:
      for (int64_t i = 0; i < n; ++i) store_float(base, dt, off + i, x[i]);
  }
}

// One (sequence, value head) pair.
struct Pair {
  int64_t n = 0;   // sequence
  int64_t h = 0;   // value head
  int64_t hq = 0;  // its q/k head
  int64_t b = 0;   // batch row
  int64_t t0 = 0;  // first token within batch row b
  int64_t len = 0;
};

inline Pair pair_of(const Problem& p, int64_t task) {
  Pair r;
  r.n = task / p.Hv;
  r.h = task % p.Hv;
  r.hq = r.h / p.group;
  const SeqSpan s = p.seq(r.n);
  r.b = s.b;
  r.t0 = s.t0;
  r.len = s.len;
  return r;
}

// Row of initial_state sequence n starts from: n, or state_indices[n] (negative: start from zero
// and write nothing back); -1 when there is no initial state.
inline int64_t state_row(const Problem& p, const fgdn_inputs& in, int64_t n) {
  if (!p.has_initial_state) return -1;
  if (!p.has_state_indices) return n;
  const int64_t r = load_index(in.state_indices.data,
                               static_cast<fgdn_dtype>(in.state_indices.dtype), n);
  return r < 0 ? -1 : r;
}

// Per-worker scratch for one chunk (C = kChunk rows), sized for K and V.
struct ChunkBuf {
  int64_t K = 0, V = 0;
  int64_t m = 0;  // rows of this chunk (<= kChunk)
  // loaded inputs
  std::vector<float> q, k, v;        // [C x K] (after l2norm), [C x K], [C x V]
  std::vector<float> rq, rk;         // [C]: l2norm factors r (1 without l2norm)
  std::vector<float> a, g, beta;     // [C]: raw gate activation (gate_in_kernel), g (before
                                     // the floor), beta
  // cumulative gates: c in double so that c_i - c_j keeps float32 relative accuracy even when
  // |c| is large (a strongly decaying token early in the chunk); e, f, D in float32
  std::vector<double> c;             // [C]
  std::vector<float> e, f;           // [C]
  float gamma = 1.f;                 // exp(c_m)
  // intra-chunk matrices
  std::vector<float> D, KKt, Ab, Tm, M;  // [C x C]
  std::vector<float> X, W, Qe, Kf;       // [C x K]
  std::vector<float> Y, U;               // [C x V]
  std::vector<float> KT;                 // [K x C] scratch: K^T

  ChunkBuf(int64_t K_, int64_t V_);
};

// Loads rows [tc, tc + m) of pair pr (tc relative to the sequence start) into buf: q and k
// (l2-normalised when p.l2norm), v, beta, and g (computed from the raw a when gate_in_kernel);
// then c (of the floored gates), e, f, gamma.
void load_chunk(const Problem& p, const fgdn_inputs& in, const Pair& pr, int64_t tc, int64_t m,
                ChunkBuf& buf);

// D, KKt, Ab, Tm, X, Y, W, U, M, Qe, Kf of the loaded chunk (formulas in the file comment).
void chunk_intra(ChunkBuf& buf);

// Loads raw row x (K elements of dtype dt at ptr), returns r and writes xhat = x * r (r = 1 when
// !l2norm) into xhat.
float load_qk_row(const void* base, fgdn_dtype dt, int64_t off, int64_t K, bool l2norm,
                  float* xhat);

}  // namespace flashgdn::cpu
