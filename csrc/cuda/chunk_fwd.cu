// Fused chunked forward (see chunk_fwd.cuh for the math).
//
// Kernel: grid (N sequences, Hv value heads, V / 64 slices), 256 threads (8 warps), one CTA
// per (sequence, value head, 64-column slice of V), walking that sequence's chunks in order.
// The fp32 state slice S [K, 64] lives in the MMA accumulators of the 8 warps.
//
// Tensor cores (mma.sync m16n8k16, bf16/fp16 operands, fp32 accumulate) do every product.
// Precision: inputs q, k, v enter exactly (raw storage dtype; the l2norm factors and gates are
// fp32 diagonal scalings applied to the fp32 accumulators). Every computed operand (S, T, Y,
// P, Vn) is split into hi + lo parts in the operand dtype, and products use hi*hi + lo*hi +
// hi*lo (or hi + lo against an exact input), so the chunk math is close to fp32; the only
// rounding to 16 bits left is o itself.
//
// Per chunk (steps; __syncthreads between them):
//   A  load Q, K, V tiles (zero past the chunk end), gates, beta, norms; publish S as hi/lo
//   B  G = K K^T -> A (fp32, gated, strict lower); P = lower(Q K^T (.) D) * scale;
//      X = K S -> Y = beta (V - e^c X)
//   C  T = (I + A)^-1: diagonal 16x16 inverses (4 warps), then block forward substitution
//      (4 lanes per column, all 256 threads), fp32
//   D  Vn = T Y; Vd = e^(c_last - c) Vn
//   E  O = scale e^c (Q S) + P Vn -> o;   F  S = e^c_last S + K^T Vd; checkpoints
#include "cuda/chunk_fwd.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/chunk_index.cuh"
#include "cuda/device_utils.cuh"

namespace flashgdn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBV = 64;  // V columns per CTA

struct StateView {
  float* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
};

struct FwdParams {
  SeqLayout seq;
  const void* q;
  const void* k;
  const void* v;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2;
  int64_t Hv, group, NT;
  const float* gcum;
  const float* beta;
  const float* rq;  // nullptr: 1
  const float* rk;
  float scale;
  // o (nullptr: not written)
  void* o;
  int64_t os0, os1, os2;
  // states: element (k index kk, v index vv) of row r, head h at
  //   r*s0 + h*s1 + (v_first ? vv*s2 + kk*s3 : kk*s2 + vv*s3)
  int32_t v_first;
  StateView h0;             // initial state or pool (data nullptr: zero start)
  const void* state_idx;    // nullptr: row n
  int32_t state_idx_dtype;
  int32_t write_final;
  StateView ht;             // final state (ignored with state_idx: written into h0's pool)
  StateView ckpt;           // checkpoints (data nullptr: none)
  int64_t every;
  const int64_t* ckpt_offset;  // [N] (varlen), nullptr for dense
  float* h_chunks;
  float* T_chunks;
};

template <int KD>
struct Smem {
  static constexpr int LDK = KD + 8;   // Q, K rows
  static constexpr int LDC = 64 + 8;   // 64-wide tiles
  static constexpr int LDA = 64 + 4;   // fp32 A
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + 64 * LDK * 2;
  static constexpr size_t kV = kK + 64 * LDK * 2;
  static constexpr size_t kShi = kV + 64 * LDC * 2;
  static constexpr size_t kSlo = kShi + KD * LDC * 2;
  static constexpr size_t kA = kSlo + KD * LDC * 2;
  static constexpr size_t kTile = 64 * LDC * 2;
  static constexpr size_t kThi = kA + 64 * LDA * 4;
  static constexpr size_t kTlo = kThi + kTile;
  static constexpr size_t kPhi = kTlo + kTile;
  static constexpr size_t kPlo = kPhi + kTile;
  static constexpr size_t kYhi = kPlo + kTile;
  static constexpr size_t kYlo = kYhi + kTile;
  static constexpr size_t kVnhi = kYlo + kTile;
  static constexpr size_t kVnlo = kVnhi + kTile;
  static constexpr size_t kVdhi = kVnlo + kTile;
  static constexpr size_t kVdlo = kVdhi + kTile;
  static constexpr size_t kVec = kVdlo + kTile;  // 6 x 64 floats
  static constexpr int LDD = 16 + 4;              // fp32 diagonal 16x16 inverses, row-major
  static constexpr size_t kTd = kVec + 6 * 64 * 4;
  static constexpr size_t kX = kTd + 64 * LDD * 4;   // fp32 T, [64][LDA], for the solve
  static constexpr size_t kBytes = kX + 64 * LDA * 4;
  static_assert(kBytes <= 227 * 1024, "shared memory plan exceeds the sm_90 limit");
  static_assert((LDK * 2) % 16 == 0 && (LDC * 2) % 16 == 0 && (LDA * 4) % 16 == 0 &&
                    (LDD * 4) % 16 == 0 && kTd % 16 == 0,
                "rows must stay 16-byte aligned for ldmatrix / vector access");
};

__device__ __forceinline__ int64_t state_off(const StateView& s, int64_t row, int64_t h,
                                             int kk, int vv, int v_first) {
  return row * s.s0 + h * s.s1 + (v_first ? vv * s.s2 + kk * s.s3 : kk * s.s2 + vv * s.s3);
}

// ---- warp-tile products: acc (16 rows from r0 x 32 columns from c0, four 16x8 tiles) += A B ---
// A exact, stored [m][k]; B exact, stored transposed [n][k]; k < KK.
template <typename T, int KK>
__device__ __forceinline__ void warp_mma_nk(float (&acc)[4][4], const T* A, int lda, int r0,
                                            const T* Bt, int ldb, int c0) {
#pragma unroll 2
  for (int kk = 0; kk < KK; kk += 16) {
    uint32_t a[4];
    load_a_rowmajor(a, A, lda, r0, kk);
#pragma unroll
    for (int pj = 0; pj < 2; ++pj) {
      uint32_t b[4];
      load_b_nk(b, Bt, ldb, c0 + pj * 16, kk);
      mma_16816<T>(acc[2 * pj], a, b[0], b[1]);
      mma_16816<T>(acc[2 * pj + 1], a, b[2], b[3]);
    }
  }
}

// A exact, stored [m][k]; B = Bhi + Blo, stored [k][n]; k < KK (A Bhi, then A Blo).
template <typename T, int KK>
__device__ __forceinline__ void warp_mma_kn_hilo(float (&acc)[4][4], const T* A, int lda, int r0,
                                                 const T* Bhi, const T* Blo, int ldb, int c0) {
#pragma unroll 2
  for (int kk = 0; kk < KK; kk += 16) {
    uint32_t a[4];
    load_a_rowmajor(a, A, lda, r0, kk);
#pragma unroll
    for (int pj = 0; pj < 2; ++pj) {
      uint32_t b[4];
      load_b_kn(b, Bhi, ldb, c0 + pj * 16, kk);
      mma_16816<T>(acc[2 * pj], a, b[0], b[1]);
      mma_16816<T>(acc[2 * pj + 1], a, b[2], b[3]);
      load_b_kn(b, Blo, ldb, c0 + pj * 16, kk);
      mma_16816<T>(acc[2 * pj], a, b[0], b[1]);
      mma_16816<T>(acc[2 * pj + 1], a, b[2], b[3]);
    }
  }
}

// A = Ahi + Alo, stored [m][k]; B = Bhi + Blo, stored [k][n]; k < 64, but A's columns from kend
// on (a multiple of 16) are zero and skipped. Products hi*hi, lo*hi, hi*lo in that order.
template <typename T>
__device__ __forceinline__ void warp_mma_hilo_hilo(float (&acc)[4][4], const T* Ahi, const T* Alo,
                                                   int lda, int r0, const T* Bhi, const T* Blo,
                                                   int ldb, int c0, int kend) {
#pragma unroll
  for (int kk = 0; kk < 64; kk += 16) {
    if (kk >= kend) break;
    uint32_t ah[4], al[4];
    load_a_rowmajor(ah, Ahi, lda, r0, kk);
    load_a_rowmajor(al, Alo, lda, r0, kk);
#pragma unroll
    for (int pj = 0; pj < 2; ++pj) {
      uint32_t bh[4], bl[4];
      load_b_kn(bh, Bhi, ldb, c0 + pj * 16, kk);
      load_b_kn(bl, Blo, ldb, c0 + pj * 16, kk);
      mma_16816<T>(acc[2 * pj], ah, bh[0], bh[1]);
      mma_16816<T>(acc[2 * pj + 1], ah, bh[2], bh[3]);
      mma_16816<T>(acc[2 * pj], al, bh[0], bh[1]);
      mma_16816<T>(acc[2 * pj + 1], al, bh[2], bh[3]);
      mma_16816<T>(acc[2 * pj], ah, bl[0], bl[1]);
      mma_16816<T>(acc[2 * pj + 1], ah, bl[2], bl[3]);
    }
  }
}

template <typename Tin, int KD>
__global__ void __launch_bounds__(kThreads, 1) chunk_fwd_kernel(const FwdParams p) {
  using L = Smem<KD>;
  constexpr int LDK = L::LDK, LDC = L::LDC, LDA = L::LDA, LDD = L::LDD;
  // State tiling: warp -> rows srow0 .. +15 of K, columns scol0 .. + SCOLS - 1 of the slice.
  constexpr int SMT = KD / 16;            // 16-row tiles of S
  constexpr int SWC = kWarps / SMT;       // warps per row tile
  constexpr int SCOLS = kBV / SWC;
  constexpr int SNT = SCOLS / 8;          // 8-column MMA tiles per warp
  static_assert(SMT * SWC == kWarps && SNT % 2 == 0, "state tiling");

  extern __shared__ __align__(128) unsigned char smem[];
  Tin* Qs = reinterpret_cast<Tin*>(smem + L::kQ);
  Tin* Ks = reinterpret_cast<Tin*>(smem + L::kK);
  Tin* Vs = reinterpret_cast<Tin*>(smem + L::kV);
  Tin* Shi = reinterpret_cast<Tin*>(smem + L::kShi);
  Tin* Slo = reinterpret_cast<Tin*>(smem + L::kSlo);
  float* Af = reinterpret_cast<float*>(smem + L::kA);
  Tin* Thi = reinterpret_cast<Tin*>(smem + L::kThi);
  Tin* Tlo = reinterpret_cast<Tin*>(smem + L::kTlo);
  Tin* Phi = reinterpret_cast<Tin*>(smem + L::kPhi);
  Tin* Plo = reinterpret_cast<Tin*>(smem + L::kPlo);
  Tin* Yhi = reinterpret_cast<Tin*>(smem + L::kYhi);
  Tin* Ylo = reinterpret_cast<Tin*>(smem + L::kYlo);
  Tin* Vnhi = reinterpret_cast<Tin*>(smem + L::kVnhi);
  Tin* Vnlo = reinterpret_cast<Tin*>(smem + L::kVnlo);
  Tin* Vdhi = reinterpret_cast<Tin*>(smem + L::kVdhi);
  Tin* Vdlo = reinterpret_cast<Tin*>(smem + L::kVdlo);
  float* gc = reinterpret_cast<float*>(smem + L::kVec);  // c_i
  float* bt = gc + 64;                                   // beta_i (0 past the end)
  float* rqs = bt + 64;                                  // q norm factor
  float* rks = rqs + 64;                                 // k norm factor (0 past the end)
  float* eg = rks + 64;                                  // exp(c_i)
  float* egl = eg + 64;                                  // exp(c_last - c_i)
  float* Td = reinterpret_cast<float*>(smem + L::kTd);   // T_bb, b = 0..3, [64][LDD]
  float* Xf = reinterpret_cast<float*>(smem + L::kX);    // fp32 T, [64][LDA]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int64_t n = blockIdx.x, h = blockIdx.y;
  const int v0 = blockIdx.z * kBV;
  const int64_t hq = h / p.group;
  const SeqInfo si = seq_info(p.seq, n);
  const int64_t nchunks = ceil_div(si.len, kChunk);

  // 64 x 64 output tiling for the token-by-column products.
  const int r0 = (warp % 4) * 16, c0 = (warp / 4) * 32;
  const int srow0 = (warp % SMT) * 16, scol0 = (warp / SMT) * SCOLS;

  // ---- initial state into registers -------------------------------------------------------
  float sacc[SNT][4];
  // f(s, kk, vv) for each state element s = sacc[j][e] of this thread, at row kk of K and
  // column vv of V.
  auto for_each_state = [&](auto&& f) {
#pragma unroll
    for (int j = 0; j < SNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        f(sacc[j][e], srow0 + g8 + (e >> 1) * 8, v0 + scol0 + j * 8 + 2 * t4 + (e & 1));
  };
  int64_t h0_row = -1;
  if (p.h0.data != nullptr) {
    h0_row = p.state_idx ? load_index(p.state_idx, p.state_idx_dtype, n) : n;
  }
  for_each_state([&](float& s, int kk, int vv) {
    s = h0_row >= 0 ? p.h0.data[state_off(p.h0, h0_row, h, kk, vv, p.v_first)] : 0.f;
  });

  int64_t ck_base = 0;
  if (p.ckpt.data != nullptr) {
    ck_base = p.ckpt_offset ? p.ckpt_offset[n] : n * (p.seq.T / p.every);
  }

  for (int64_t jc = 0; jc < nchunks; ++jc) {
    const int64_t t0 = si.t0 + jc * kChunk;
    const int64_t rest = si.len - jc * kChunk;
    const int len = static_cast<int>(rest < kChunk ? rest : kChunk);
    const int64_t f0 = si.b * p.seq.T + t0;  // flat token index of row 0

    // ---- A: loads ------------------------------------------------------------------------
    {
      // Every global load of the step is issued before any shared store: one round trip.
      constexpr int VPR = KD / 8;  // 16-byte vectors per row
      constexpr int QIT = 64 * VPR / kThreads;
      constexpr int VIT = 64 * (kBV / 8) / kThreads;
      static_assert(QIT * kThreads == 64 * VPR && VIT * kThreads == 64 * (kBV / 8), "loads");
      const Tin* qb = static_cast<const Tin*>(p.q) + si.b * p.qs0 + hq * p.qs2;
      const Tin* kb = static_cast<const Tin*>(p.k) + si.b * p.ks0 + hq * p.ks2;
      const Tin* vb = static_cast<const Tin*>(p.v) + si.b * p.vs0 + h * p.vs2 + v0;
      uint4 qv[QIT], kv[QIT], vv[VIT];
#pragma unroll
      for (int u = 0; u < QIT; ++u) {
        const int idx = tid + u * kThreads;
        const int row = idx / VPR, c8 = (idx % VPR) * 8;
        qv[u] = make_uint4(0, 0, 0, 0);
        kv[u] = make_uint4(0, 0, 0, 0);
        if (row < len) {
          qv[u] = *reinterpret_cast<const uint4*>(qb + (t0 + row) * p.qs1 + c8);
          kv[u] = *reinterpret_cast<const uint4*>(kb + (t0 + row) * p.ks1 + c8);
        }
      }
#pragma unroll
      for (int u = 0; u < VIT; ++u) {
        const int idx = tid + u * kThreads;
        const int row = idx / (kBV / 8), c8 = (idx % (kBV / 8)) * 8;
        vv[u] = make_uint4(0, 0, 0, 0);
        if (row < len) vv[u] = *reinterpret_cast<const uint4*>(vb + (t0 + row) * p.vs1 + c8);
      }
      float ci = 0.f, cl = 0.f, bti = 0.f, rqi = 1.f, rki = 1.f;
      if (tid < 64) {
        const int i = tid;
        const int ii = i < len ? i : len - 1;
        ci = p.gcum[h * p.NT + f0 + ii];
        cl = p.gcum[h * p.NT + f0 + len - 1];
        bti = i < len ? p.beta[h * p.NT + f0 + i] : 0.f;
        if (p.rq) rqi = i < len ? p.rq[hq * p.NT + f0 + i] : 0.f;
        if (p.rk) rki = i < len ? p.rk[hq * p.NT + f0 + i] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < QIT; ++u) {
        const int idx = tid + u * kThreads;
        const int row = idx / VPR, c8 = (idx % VPR) * 8;
        *reinterpret_cast<uint4*>(Qs + row * LDK + c8) = qv[u];
        *reinterpret_cast<uint4*>(Ks + row * LDK + c8) = kv[u];
      }
#pragma unroll
      for (int u = 0; u < VIT; ++u) {
        const int idx = tid + u * kThreads;
        const int row = idx / (kBV / 8), c8 = (idx % (kBV / 8)) * 8;
        *reinterpret_cast<uint4*>(Vs + row * LDC + c8) = vv[u];
      }
      if (tid < 64) {
        const int i = tid;
        gc[i] = ci;
        bt[i] = bti;
        rqs[i] = rqi;
        rks[i] = rki;
        eg[i] = __expf(ci);
        egl[i] = __expf(cl - ci);
      }
      // Publish S (chunk start) as hi/lo operands; training: save it.
#pragma unroll
      for (int j = 0; j < SNT; ++j)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int kk = srow0 + g8 + e2 * 8, cc = scol0 + j * 8 + 2 * t4;
          store_hi_lo2(Shi, Slo, kk * LDC + cc, sacc[j][2 * e2], sacc[j][2 * e2 + 1]);
        }
      if (p.h_chunks != nullptr) {
        const int64_t slot = chunk_slot(p.seq, n, jc, si.t0);
        float* hc = p.h_chunks + ((slot * p.Hv + h) * KD) * KD;
#pragma unroll
        for (int j = 0; j < SNT; ++j)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int kk = srow0 + g8 + e2 * 8, vv = v0 + scol0 + j * 8 + 2 * t4;
            *reinterpret_cast<float2*>(hc + kk * KD + vv) =
                make_float2(sacc[j][2 * e2], sacc[j][2 * e2 + 1]);
          }
      }
    }
    __syncthreads();

    // ---- B: K K^T -> A, Q K^T -> P, K S -> Y -----------------------------------------------
    {
      float acc[4][4];
      // G = K K^T
      zero_acc(acc);
      warp_mma_nk<Tin, KD>(acc, Ks, LDK, r0, Ks, LDK, c0);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = r0 + g8 + (e >> 1) * 8, c = c0 + j * 8 + 2 * t4 + (e & 1);
          Af[i * LDA + c] =
              i > c ? bt[i] * rks[i] * rks[c] * acc[j][e] * __expf(gc[i] - gc[c]) : 0.f;
        }
      // P = scale * lower(Q K^T (.) D)
      zero_acc(acc);
      if (p.o != nullptr) {
        warp_mma_nk<Tin, KD>(acc, Qs, LDK, r0, Ks, LDK, c0);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int i = r0 + g8 + e2 * 8, c = c0 + j * 8 + 2 * t4;
            float x[2];
#pragma unroll
            for (int u = 0; u < 2; ++u)
              x[u] = c + u <= i ? p.scale * rqs[i] * rks[c + u] * acc[j][2 * e2 + u] *
                                      __expf(gc[i] - gc[c + u])
                                : 0.f;
            store_hi_lo2(Phi, Plo, i * LDC + c, x[0], x[1]);
          }
      }
      // X = K S; Y = beta (V - e^c rk X)
      zero_acc(acc);
      warp_mma_kn_hilo<Tin, KD>(acc, Ks, LDK, r0, Shi, Slo, LDC, c0);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int i = r0 + g8 + e2 * 8, c = c0 + j * 8 + 2 * t4;
          const float f = eg[i] * rks[i];
          const float y0 = bt[i] * (to_float(Vs[i * LDC + c]) - f * acc[j][2 * e2]);
          const float y1 = bt[i] * (to_float(Vs[i * LDC + c + 1]) - f * acc[j][2 * e2 + 1]);
          store_hi_lo2(Yhi, Ylo, i * LDC + c, y0, y1);
        }
    }
    __syncthreads();

    // ---- C: T = (I + A)^-1, blocked (16 x 16 blocks), fp32 ---------------------------------
    // C1: the four diagonal inverses T_dd = (I + A_dd)^-1, warp d (d < 4), lane = column (16
    // lanes), forward substitution without barriers; T_dd row-major into Td.
    if (warp < 4 && lane < 16) {
      const int d = warp, c = lane;
      const float* Ad = Af + (16 * d) * LDA + 16 * d;
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = i == c ? 1.f : 0.f;
#pragma unroll
      for (int i = 1; i < 16; ++i) {
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
        for (int jj = 0; jj < i; jj += 4) {  // A_dd[i][j >= i] is zero
          const float4 a = *reinterpret_cast<const float4*>(Ad + i * LDA + jj);
          s0 = fmaf(a.x, x[jj], s0);
          s1 = fmaf(a.y, x[jj + 1], s1);
          s2 = fmaf(a.z, x[jj + 2], s2);
          s3 = fmaf(a.w, x[jj + 3], s3);
        }
        const float xi = -((s0 + s1) + (s2 + s3));
        x[i] = i > c ? xi : x[i];
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) Td[(16 * d + i) * LDD + c] = x[i];
    }
    __syncthreads();
    // C2: column m of T by a quad of lanes (warp w: columns 8w .. 8w + 7, so the column's block
    // bm = w / 2 is warp-uniform); lane q of the quad owns rows 16 b + q + 4 r (r < 4):
    //   x_b = 0 (b < bm), T_bb e_(m - 16 bm) (b = bm), -T_bb sum_{k<b} A_bk x_k (b > bm).
    // The full 16-vectors of a block are exchanged through Xf (quad lanes, __syncwarp).
    {
      const int m = tid >> 2, q = tid & 3;
      const int bm = warp >> 1, cl = m & 15;
      const int qbase = lane & ~3;
      float* tc = nullptr;
      if (p.T_chunks != nullptr && blockIdx.z == 0) {
        const int64_t slot = chunk_slot(p.seq, n, jc, si.t0);
        tc = p.T_chunks + (slot * p.Hv + h) * 64 * 64;
      }
      float xo[4][4];   // own rows
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        if (b < bm) {
#pragma unroll
          for (int r = 0; r < 4; ++r) xo[b][r] = 0.f;
        } else if (b == bm) {
#pragma unroll
          for (int r = 0; r < 4; ++r) xo[b][r] = Td[(16 * b + q + 4 * r) * LDD + cl];
        } else {
          float s0[4], s1[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) s0[r] = s1[r] = 0.f;
#pragma unroll
          for (int k = 0; k < b; ++k) {
            if (k < bm) continue;  // x_k = 0 (warp-uniform)
            float xk[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) xk[j] = Xf[(16 * k + j) * LDA + m];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const float* Ar = Af + (16 * b + q + 4 * r) * LDA + 16 * k;
#pragma unroll
              for (int j = 0; j < 16; j += 4) {
                const float4 a = *reinterpret_cast<const float4*>(Ar + j);
                s0[r] = fmaf(a.x, xk[j], s0[r]);
                s1[r] = fmaf(a.y, xk[j + 1], s1[r]);
                s0[r] = fmaf(a.z, xk[j + 2], s0[r]);
                s1[r] = fmaf(a.w, xk[j + 3], s1[r]);
              }
            }
          }
          float y[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) y[r] = s0[r] + s1[r];
          float yf[16];
#pragma unroll
          for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int qq = 0; qq < 4; ++qq)
              yf[qq + 4 * r] = __shfl_sync(0xffffffffu, y[r], qbase + qq);
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float* Tr = Td + (16 * b + q + 4 * r) * LDD;
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int j = 0; j < 16; j += 4) {
              const float4 t = *reinterpret_cast<const float4*>(Tr + j);
              s0 = fmaf(t.x, yf[j], s0);
              s1 = fmaf(t.y, yf[j + 1], s1);
              s0 = fmaf(t.z, yf[j + 2], s0);
              s1 = fmaf(t.w, yf[j + 3], s1);
            }
            xo[b][r] = -(s0 + s1);
          }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 16 * b + q + 4 * r;
          Tin hi, lo;
          split_hi_lo(xo[b][r], hi, lo);
          Thi[i * LDC + m] = hi;
          Tlo[i * LDC + m] = lo;
          if (tc != nullptr) tc[i * 64 + m] = xo[b][r];
        }
        if (b < 3) {
#pragma unroll
          for (int r = 0; r < 4; ++r) Xf[(16 * b + q + 4 * r) * LDA + m] = xo[b][r];
          __syncwarp();
        }
      }
    }
    __syncthreads();

    // ---- D: Vn = T Y; Vd = e^(c_last - c) rk Vn ---------------------------------------------
    {
      float acc[4][4];
      zero_acc(acc);
      warp_mma_hilo_hilo(acc, Thi, Tlo, LDC, r0, Yhi, Ylo, LDC, c0, 64);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int i = r0 + g8 + e2 * 8, c = c0 + j * 8 + 2 * t4;
          const float a = acc[j][2 * e2], b = acc[j][2 * e2 + 1];
          store_hi_lo2(Vnhi, Vnlo, i * LDC + c, a, b);
          const float f = egl[i] * rks[i];
          store_hi_lo2(Vdhi, Vdlo, i * LDC + c, f * a, f * b);
        }
    }
    __syncthreads();

    // ---- E: O = scale e^c Q S + P Vn -> o ---------------------------------------------------
    if (p.o != nullptr) {
      // O = scale e^c rq (Q S)   (S hi/lo and Q are still in smem)
      float oacc[4][4];
      zero_acc(oacc);
      {
        warp_mma_kn_hilo<Tin, KD>(oacc, Qs, LDK, r0, Shi, Slo, LDC, c0);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = r0 + g8 + (e >> 1) * 8;
            oacc[j][e] *= p.scale * rqs[i] * eg[i];
          }
      }
      // P is lower triangular: its columns past the row tile (from r0 + 16 on) are zero.
      warp_mma_hilo_hilo(oacc, Phi, Plo, LDC, r0, Vnhi, Vnlo, LDC, c0, r0 + 16);
      Tin* ob = static_cast<Tin*>(p.o) + si.b * p.os0 + h * p.os2 + v0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int i = r0 + g8 + e2 * 8, c = c0 + j * 8 + 2 * t4;
          if (i < len)
            *reinterpret_cast<uint32_t*>(ob + (t0 + i) * p.os1 + c) =
                pack2<Tin>(oacc[j][2 * e2], oacc[j][2 * e2 + 1]);
        }
    }

    // ---- F: S = e^c_last S + K^T Vd --------------------------------------------------------
    {
      const float dl = eg[63];
#pragma unroll
      for (int j = 0; j < SNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[j][e] *= dl;
#pragma unroll
      for (int kk = 0; kk < 64; kk += 16) {
        uint32_t a[4];
        load_a_colmajor(a, Ks, LDK, srow0, kk);
#pragma unroll
        for (int pj = 0; pj < SNT / 2; ++pj) {
          uint32_t bh[4], bl[4];
          load_b_kn(bh, Vdhi, LDC, scol0 + pj * 16, kk);
          load_b_kn(bl, Vdlo, LDC, scol0 + pj * 16, kk);
          mma_16816<Tin>(sacc[2 * pj], a, bh[0], bh[1]);
          mma_16816<Tin>(sacc[2 * pj + 1], a, bh[2], bh[3]);
          mma_16816<Tin>(sacc[2 * pj], a, bl[0], bl[1]);
          mma_16816<Tin>(sacc[2 * pj + 1], a, bl[2], bl[3]);
        }
      }
      // Interior checkpoint after (jc + 1) * 64 tokens.
      if (p.ckpt.data != nullptr) {
        const int64_t done = (jc + 1) * kChunk;
        if (done <= si.len && done % p.every == 0) {
          const int64_t row = ck_base + done / p.every - 1;
          for_each_state([&](float& s, int kk, int vv) {
            p.ckpt.data[state_off(p.ckpt, row, h, kk, vv, p.v_first)] = s;
          });
        }
      }
    }
    __syncthreads();
  }

  // ---- final state -------------------------------------------------------------------------
  if (p.write_final) {
    const StateView* dst = nullptr;
    int64_t row = -1;
    if (p.state_idx != nullptr) {
      dst = &p.h0;
      row = h0_row;
    } else {
      dst = &p.ht;
      row = n;
    }
    if (row >= 0 && dst->data != nullptr) {
      for_each_state([&](float& s, int kk, int vv) {
        dst->data[state_off(*dst, row, h, kk, vv, p.v_first)] = s;
      });
    }
  }
}

// offset_n = sum_{m < n} floor(len_m / every), one block, sequential chunks + block scan.
__global__ void __launch_bounds__(1024) checkpoint_offsets_kernel(SeqLayout seq, int64_t every,
                                                                  int64_t* out) {
  __shared__ int64_t part[1024];
  const int64_t per = ceil_div(seq.N, 1024);
  const int64_t a = threadIdx.x * per;
  const int64_t e = seq.N < a + per ? seq.N : a + per;
  int64_t s = 0;
  for (int64_t m = a; m < e; ++m) s += seq_info(seq, m).len / every;
  part[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int i = 0; i < 1024; ++i) {
      const int64_t x = part[i];
      part[i] = run;
      run += x;
    }
  }
  __syncthreads();
  s = part[threadIdx.x];
  for (int64_t m = a; m < e; ++m) {
    out[m] = s;
    s += seq_info(seq, m).len / every;
  }
}

StateView view_of(const fgdn_tensor& t) {
  StateView s;
  s.data = static_cast<float*>(t.data);
  s.s0 = t.strides[0];
  s.s1 = t.strides[1];
  s.s2 = t.strides[2];
  s.s3 = t.strides[3];
  return s;
}

template <typename Tin, int KD>
void launch_typed(const FwdParams& fp, dim3 grid, cudaStream_t stream) {
  constexpr size_t smem = Smem<KD>::kBytes;
  auto kern = chunk_fwd_kernel<Tin, KD>;
  FGDN_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  kern<<<grid, kThreads, smem, stream>>>(fp);
  FGDN_CHECK_LAUNCH("chunk_fwd_kernel");
}

size_t ckpt_offsets_bytes(const Problem& p) {
  return (p.varlen ? (static_cast<size_t>(p.N) * 8 + 255) / 256 * 256 : 0);
}

void launch_impl(const Problem& p, const fgdn_inputs& in, const PrepBuffers& pb,
                 const ChunkFwdOutputs& out, int64_t* ckpt_offsets, cudaStream_t stream) {
  if (p.N == 0 || p.Hv == 0) return;
  FwdParams fp{};
  fp.seq = make_seq_layout(p, in);
  fp.q = in.q.data;
  fp.k = in.k.data;
  fp.v = in.v.data;
  fp.qs0 = in.q.strides[0];
  fp.qs1 = in.q.strides[1];
  fp.qs2 = in.q.strides[2];
  fp.ks0 = in.k.strides[0];
  fp.ks1 = in.k.strides[1];
  fp.ks2 = in.k.strides[2];
  fp.vs0 = in.v.strides[0];
  fp.vs1 = in.v.strides[1];
  fp.vs2 = in.v.strides[2];
  fp.Hv = p.Hv;
  fp.group = p.group;
  fp.NT = p.B * p.T;
  fp.gcum = pb.gcum;
  fp.beta = pb.beta;
  fp.rq = pb.rq;
  fp.rk = pb.rk;
  fp.scale = p.scale;
  fp.o = out.o.data;
  if (fp.o != nullptr) {
    fp.os0 = out.o.strides[0];
    fp.os1 = out.o.strides[1];
    fp.os2 = out.o.strides[2];
  }
  fp.v_first = p.state_v_first ? 1 : 0;
  if (p.has_initial_state && in.initial_state.data != nullptr) fp.h0 = view_of(in.initial_state);
  fp.state_idx = p.has_state_indices ? in.state_indices.data : nullptr;
  fp.state_idx_dtype = p.has_state_indices ? in.state_indices.dtype : FGDN_INT64;
  fp.write_final = out.write_final ? 1 : 0;
  if (out.write_final && !p.has_state_indices && out.final_state.data != nullptr)
    fp.ht = view_of(out.final_state);
  if (out.write_final && p.has_state_indices && fp.h0.data == nullptr) fp.write_final = 0;
  if (out.checkpoints.data != nullptr && p.checkpoint_every > 0) {
    fp.ckpt = view_of(out.checkpoints);
    fp.every = p.checkpoint_every;
    if (p.varlen) {
      checkpoint_offsets_kernel<<<1, 1024, 0, stream>>>(fp.seq, fp.every, ckpt_offsets);
      FGDN_CHECK_LAUNCH("checkpoint_offsets_kernel");
      fp.ckpt_offset = ckpt_offsets;
    }
  }
  fp.h_chunks = out.h_chunks;
  fp.T_chunks = out.T_chunks;

  dim3 grid(static_cast<unsigned>(p.N), static_cast<unsigned>(p.Hv),
            static_cast<unsigned>(p.V / kBV));
  const bool bf16 = p.qkv_dtype == FGDN_BFLOAT16;
  if (p.K == 128) {
    if (bf16) launch_typed<__nv_bfloat16, 128>(fp, grid, stream);
    else launch_typed<__half, 128>(fp, grid, stream);
  } else {
    if (bf16) launch_typed<__nv_bfloat16, 64>(fp, grid, stream);
    else launch_typed<__half, 64>(fp, grid, stream);
  }
}

}  // namespace

size_t chunk_fwd_workspace_bytes(const Problem& p) {
  return prep_workspace_bytes(p) + ckpt_offsets_bytes(p);
}

void launch_chunk_fwd_ws(const Problem& p, const fgdn_inputs& in, void* workspace,
                         const ChunkFwdOutputs& out, cudaStream_t stream) {
  const PrepBuffers pb = prep_carve(p, workspace);
  int64_t* offs = reinterpret_cast<int64_t*>(static_cast<char*>(workspace) + prep_workspace_bytes(p));
  launch_preprocess(p, in, pb, stream);
  launch_impl(p, in, pb, out, offs, stream);
}

void launch_chunk_fwd(const Problem& p, const fgdn_inputs& in, const PrepBuffers& pb,
                      const ChunkFwdOutputs& out, cudaStream_t stream) {
  if (out.checkpoints.data != nullptr && p.checkpoint_every > 0 && p.varlen)
    throw std::runtime_error(
        "flashgdn: launch_chunk_fwd: varlen checkpoints need launch_chunk_fwd_ws");
  launch_impl(p, in, pb, out, nullptr, stream);
}

size_t recompute_h_workspace_bytes(const Problem& p) { return prep_workspace_bytes(p); }

void launch_recompute_h(const Problem& p, const fgdn_inputs& in, void* workspace,
                        float* h_chunks, float* T_chunks, cudaStream_t stream) {
  const PrepBuffers pb = prep_carve(p, workspace);
  launch_preprocess(p, in, pb, stream);
  ChunkFwdOutputs out;
  out.h_chunks = h_chunks;
  out.T_chunks = T_chunks;
  launch_impl(p, in, pb, out, nullptr, stream);
}

}  // namespace flashgdn::cuda
