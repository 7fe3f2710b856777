// Shared device code of the per-chunk backward kernels on wgmma (bwd_prep.cu, bwd_dqk_wy.cu): one
// block of two warpgroups per (chunk, value head) stages each operand once into shared memory
// as 16-bit tiles of the inputs' type T (bf16 | fp16, as the forward's operands) and multiplies
// them with single products (fp32 accumulation), the forward's `fast` policy.
//
// Tiles: [rows][64] T, 128-byte rows in the 128-byte swizzle (16-byte chunk c of row r at
// chunk c ^ (r mod 8)), 1024-byte aligned; a D-wide operand is D / 64 tiles side by side along
// its columns. A tile of a [tokens][x] operand is read K-major when the product reduces over x,
// and MN-major (N = x) when it reduces over the tokens: one copy serves both.
//
// Accumulators (wgmma.cuh): element e of a 64 x 64 block is (row 16 w + g + 8 ((e >> 1) & 1),
// column 8 (e >> 2) + 2 q + (e & 1)) for warp w of the warpgroup and lane 4 g + q.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/device_utils.cuh"
#include "sm90/ptx.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::sm90::tiles {

constexpr int kWarpgroup = 128;         // threads of a warpgroup
constexpr int kThreads = 2 * kWarpgroup;  // two warpgroups
constexpr uint32_t kTile64 = 64 * 128;  // bytes of a 64-row tile

// The place of a thread in a warpgroup's accumulator.
struct AccCoord {
  int w, g, q;
  __host__ __device__ __forceinline__ constexpr explicit AccCoord(int tid)
      : w((tid >> 5) & 3), g((tid & 31) >> 2), q(tid & 3) {}
  __host__ __device__ __forceinline__ constexpr int row(int e) const { return 16 * w + g + 8 * ((e >> 1) & 1); }
  __host__ __device__ __forceinline__ constexpr int col(int e) const { return 8 * (e >> 2) + 2 * q + (e & 1); }
  // A thread's 32 elements lie on two rows and sixteen columns: row(e) is row_at(row_slot(e)),
  // col(e) is col_at(col_slot(e)) (checked for every thread and element below).
  static __host__ __device__ __forceinline__ constexpr int row_slot(int e) { return (e >> 1) & 1; }
  static __host__ __device__ __forceinline__ constexpr int col_slot(int e) { return (e >> 2) * 2 + (e & 1); }
  __host__ __device__ __forceinline__ constexpr int row_at(int slot) const { return 16 * w + g + 8 * slot; }
  __host__ __device__ __forceinline__ constexpr int col_at(int slot) const {
    return 8 * (slot >> 1) + 2 * q + (slot & 1);
  }
  // s[row] of the two rows and s[col] of the sixteen columns, read once. An elementwise pass over
  // the accumulator then has no shared-memory load in each element's chain, and with a select in
  // place of a branch per element (`i > j ? x : 0` where x is computed for every element) the 32
  // chains overlap: one warp a scheduler has nothing else to hide their latency behind.
  __device__ __forceinline__ void rows_of(const float* s, float (&r)[2]) const {
    r[0] = s[row_at(0)], r[1] = s[row_at(1)];
  }
  __device__ __forceinline__ void cols_of(const float* s, float (&c)[16]) const {
#pragma unroll
    for (int k = 0; k < 16; ++k) c[k] = s[col_at(k)];
  }
};

// rows_of and cols_of read, for every element e of every thread, the values of row(e) and col(e).
constexpr bool acc_slots_consistent() {
  for (int tid = 0; tid < kWarpgroup; ++tid) {
    const AccCoord c(tid);
    for (int e = 0; e < 32; ++e)
      if (c.row_at(AccCoord::row_slot(e)) != c.row(e) || c.col_at(AccCoord::col_slot(e)) != c.col(e)) return false;
  }
  return true;
}
static_assert(acc_slots_consistent(), "AccCoord: row_slot / col_slot do not name row(e) / col(e)");

// ---- staging ----------------------------------------------------------------------------------
// Item it of a thread over 64 rows x D columns: row (tid + 256 it) / (D / 8), 8-column group
// (tid + 256 it) % (D / 8): consecutive threads read consecutive 16- or 32-byte runs of a row.
template <int D>
struct Items {
  static constexpr int kCount = 64 * D / 8 / kThreads;
  static __device__ __forceinline__ int row(int tid, int it) { return (tid + kThreads * it) / (D / 8); }
  static __device__ __forceinline__ int c8(int tid, int it) { return (tid + kThreads * it) % (D / 8); }
};

// 64 rows x D columns of fp32 in registers, 8 values an item.
template <int D>
struct Piece {
  float4 x[2 * Items<D>::kCount];
};
struct PieceSrc {
  const float* src;     // row 0, column 0
  int64_t ld;           // row stride (elements)
  uint8_t* dst;         // row 0 of the first tile
  uint32_t tile_bytes;  // distance between the 64-column tiles
};

template <int D>
__device__ __forceinline__ void load_piece(const PieceSrc& p, Piece<D>& r, int tid) {
#pragma unroll
  for (int it = 0; it < Items<D>::kCount; ++it) {
    const int row = Items<D>::row(tid, it), c8 = Items<D>::c8(tid, it);
    const float4* s = reinterpret_cast<const float4*>(p.src + row * p.ld + 8 * c8);
    r.x[2 * it] = __ldg(s);
    r.x[2 * it + 1] = __ldg(s + 1);
  }
}

// Eight 16-bit values at (row, columns 8 c8 .. 8 c8 + 7).
__device__ __forceinline__ void put8(uint8_t* tiles, uint32_t tile_bytes, int row, int c8, uint4 u) {
  *reinterpret_cast<uint4*>(tiles + (c8 >> 3) * tile_bytes + swizzle128(row, c8 & 7)) = u;
}
// Two values at (row, col), (row, col + 1), col even, rounded to T.
template <typename T>
__device__ __forceinline__ void put2(uint8_t* tiles, uint32_t tile_bytes, int row, int col, float a, float b) {
  *reinterpret_cast<uint32_t*>(tiles + (col >> 6) * tile_bytes + swizzle128(row, (col & 63) >> 3) + (col & 7) * 2) =
      cuda::pack2<T>(a, b);
}
// One value at (row, col), rounded to T.
template <typename T>
__device__ __forceinline__ void put1(uint8_t* tiles, uint32_t tile_bytes, int row, int col, float x) {
  *reinterpret_cast<T*>(tiles + (col >> 6) * tile_bytes + swizzle128(row, (col & 63) >> 3) + (col & 7) * 2) =
      cuda::from_float<T>(x);
}

template <int D, typename T>
__device__ __forceinline__ void store_piece(const PieceSrc& p, const Piece<D>& r, int tid) {
#pragma unroll
  for (int it = 0; it < Items<D>::kCount; ++it) {
    const float4 a = r.x[2 * it], b = r.x[2 * it + 1];
    put8(p.dst, p.tile_bytes, Items<D>::row(tid, it), Items<D>::c8(tid, it),
         make_uint4(cuda::pack2<T>(a.x, a.y), cuda::pack2<T>(a.z, a.w), cuda::pack2<T>(b.x, b.y),
                    cuda::pack2<T>(b.z, b.w)));
  }
}

// 64 token rows x D of a 16-bit input (row stride ld elements; rows >= len zero), loaded now and
// stored later (store_rows16), so that other loads can be in flight meanwhile.
template <int D>
struct Rows16 {
  uint4 x[Items<D>::kCount];
};
template <int D, typename TQ>
__device__ __forceinline__ void load_rows16(const TQ* src, int64_t ld, int len, Rows16<D>& r, int tid) {
#pragma unroll
  for (int it = 0; it < Items<D>::kCount; ++it) {
    const int row = Items<D>::row(tid, it);
    r.x[it] = row < len ? __ldg(reinterpret_cast<const uint4*>(src + row * ld + 8 * Items<D>::c8(tid, it)))
                        : make_uint4(0, 0, 0, 0);
  }
}
// tile_bytes: the distance between the 64-column tiles (kTile64 for a 64-row operand; a block of
// 64 rows of a D-row operand's tiles: D * 128).
template <int D>
__device__ __forceinline__ void store_rows16(uint8_t* dst, const Rows16<D>& r, int tid,
                                             uint32_t tile_bytes = kTile64) {
#pragma unroll
  for (int it = 0; it < Items<D>::kCount; ++it)
    put8(dst, tile_bytes, Items<D>::row(tid, it), Items<D>::c8(tid, it), r.x[it]);
}

// ---- products ---------------------------------------------------------------------------------
// Before the first product of a batch: the warp reconverged (the code before may branch by row:
// wgmma's .aligned instructions need every thread of the warp) and the accumulators' ordinary
// writes made visible to the tensor cores.
__device__ __forceinline__ void begin_products() {
  __syncwarp();
  wgmma_fence();
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][32]) {
#pragma unroll
  for (int b = 0; b < N; ++b)
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[b][e] = 0.f;
}
template <int N>
__device__ __forceinline__ void fence(float (&acc)[N][32]) {
#pragma unroll
  for (int b = 0; b < N; ++b) fence_regs(acc[b]);
}
// Commits the products issued and waits for all of them; acc may be read afterwards.
template <int N>
__device__ __forceinline__ void finish(float (&acc)[N][32]) {
  wgmma_commit();
  wgmma_wait<0>();
  fence(acc);
}

// acc (64 x N) (+)= A B: A (64 x K) K-major tiles [64][64]; B either K-major (N x K, tiles
// [N][64] along K: kTransB = 0) or MN-major (K x N with K <= 64 rows, tiles [K][64] along N,
// kTile64 apart: kTransB = 1). The first k-step overwrites unless `accumulate`.
template <typename T, int N, int K, int kTransB>
__device__ __forceinline__ void product_ss(float (&acc)[N / 64][32], const void* a, const void* b, bool accumulate) {
  const uint32_t a0 = smem_addr(a), b0 = smem_addr(b);
#pragma unroll
  for (int s = 0; s < K / 16; ++s) {
    const uint64_t da = desc_k_major(a0 + (s / 4) * kTile64 + (s % 4) * 32);
    const uint64_t db = kTransB ? desc_mn_major(b0 + s * 16 * 128, kTile64)
                                : desc_k_major(b0 + (s / 4) * N * 128 + (s % 4) * 32);
    const int acc_in = accumulate || s > 0;
    if constexpr (N == 128) wgmma_ss_n128<T, kTransB>(acc[0], acc[1], da, db, acc_in);
    else wgmma_ss_n64<T, kTransB>(acc[0], da, db, acc_in);
  }
}

// A fragment of k-step s of a 64 x 64 accumulator block (wgmma.cuh), rounded to T.
template <typename T>
__device__ __forceinline__ void a_frag(const float (&d)[32], int s, uint32_t (&a)[4]) {
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int i = 0; i < 2; ++i)
      a[2 * c + i] = cuda::pack2<T>(d[4 * (2 * s + c) + 2 * i], d[4 * (2 * s + c) + 2 * i + 1]);
}

// acc (64 x N) += X B with X a 64 x 64 KB accumulator (A from registers, k = its columns) and B
// (64 KB) x N, either K-major (tiles [N][64] along k: kTransB = 0) or MN-major (rows k, tiles of
// N-columns 64 wide, mn_tile_bytes apart: kTransB = 1). Calls begin_products itself (after
// forming the fragments).
template <typename T, int N, int kTransB, int KB>
__device__ __forceinline__ void product_rs(float (&acc)[N / 64][32], const float (&x)[KB][32], const void* b,
                                           uint32_t mn_tile_bytes = kTile64) {
  uint32_t a[4 * KB][4];
#pragma unroll
  for (int s = 0; s < 4 * KB; ++s) a_frag<T>(x[s / 4], s % 4, a[s]);
  const uint32_t b0 = smem_addr(b);
  begin_products();
#pragma unroll
  for (int s = 0; s < 4 * KB; ++s) {
    const uint64_t db = kTransB ? desc_mn_major(b0 + s * 16 * 128, mn_tile_bytes)
                                : desc_k_major(b0 + (s / 4) * N * 128 + (s % 4) * 32);
    if constexpr (N == 128) wgmma_rs_n128<T, kTransB>(acc[0], acc[1], a[s], db, 1);
    else wgmma_rs_n64<T, kTransB>(acc[0], a[s], db, 1);
  }
}

// Two adjacent values (row, col), (row, col + 1) of 64-row tiles of T (col even), as floats.
template <typename T>
__device__ __forceinline__ float2 get2(const uint8_t* tiles, int row, int col) {
  return unpack2<T>(*reinterpret_cast<const uint32_t*>(tiles + (col >> 6) * kTile64 +
                                                      swizzle128(row, (col & 63) >> 3) + (col & 7) * 2));
}

// A 64 x (64 kB) accumulator, times sign, into a [64][ld] row-major block of 16-bit T (pairs
// rounded as store_piece rounds: a consumer staging it gets the bits it would have converted).
template <typename T, int kB>
__device__ __forceinline__ void store_acc16(const AccCoord& c, T* dst, int ld, const float (&acc)[kB][32],
                                            float sign = 1.f) {
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int e = 0; e < 32; e += 2)
      *reinterpret_cast<uint32_t*>(dst + c.row(e) * ld + 64 * b + c.col(e)) =
          cuda::pack2<T>(sign * acc[b][e], sign * acc[b][e + 1]);
}

// ---- reductions over an accumulator (fixed shuffle trees: bitwise reproducible) -------------
// Per row i of a 64 x 64 block: sum over the quad of the thread's two rows; lane q = 0 gets it.
__device__ __forceinline__ void quad_sum(float (&s)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    s[i] += __shfl_xor_sync(0xffffffffu, s[i], 1);
    s[i] += __shfl_xor_sync(0xffffffffu, s[i], 2);
  }
}
// Row sums of row_value(e) and column sums of col_value(e) over a 64 x 64 block: rows to
// rowp[64] (written by lanes q = 0), columns over this warp's 16 rows to colp[w][64] (written
// by lanes g = 0; the caller sums the four warps in order).
template <class FR, class FC>
__device__ __forceinline__ void row_col_sums(const AccCoord& c, FR&& row_value, FC&& col_value, float* rowp,
                                             float (*colp)[64]) {
  float rs[2] = {0.f, 0.f}, cs[16];
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    rs[(e >> 1) & 1] += row_value(e);
    const float l = col_value(e);
    const int k = (e >> 2) * 2 + (e & 1);
    cs[k] = (e & 2) ? cs[k] + l : l;
  }
  quad_sum(rs);
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], 4);
    cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], 8);
    cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], 16);
  }
  if (c.q == 0) rowp[16 * c.w + c.g] = rs[0], rowp[16 * c.w + c.g + 8] = rs[1];
  if (c.g == 0) {
#pragma unroll
    for (int k = 0; k < 16; ++k) colp[c.w][8 * (k >> 1) + 2 * c.q + (k & 1)] = cs[k];
  }
}

// Two adjacent elements of a row as floats.
__device__ __forceinline__ float2 load2(const float* p) { return __ldg(reinterpret_cast<const float2*>(p)); }
template <typename T>
__device__ __forceinline__ float2 load2(const T* p) {
  return unpack2<T>(__ldg(reinterpret_cast<const unsigned int*>(p)));
}

// Per row of a 64 x D accumulator and 64-row tiles of T: sum_a acc(i, a) X(i, a); lane q = 0
// writes dst[i] (fixed order).
template <typename T, int kB>
__device__ __forceinline__ void row_dot_tile(const AccCoord& c, const float (&acc)[kB][32], const uint8_t* x,
                                             float* dst) {
  float s[2] = {0.f, 0.f};
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int e = 0; e < 32; e += 2) {
      const float2 v = get2<T>(x, c.row(e), 64 * b + c.col(e));
      s[(e >> 1) & 1] += acc[b][e] * v.x + acc[b][e + 1] * v.y;
    }
  quad_sum(s);
  if (c.q == 0) dst[16 * c.w + c.g] = s[0], dst[16 * c.w + c.g + 8] = s[1];
}

// Per row of a 64 x D accumulator: sum_a acc(i, a) X(i, a), X [rows][ldx] (fp32 or 16-bit; rows
// >= rows_valid not read); lane q = 0 writes dst[i] (fixed order).
template <int kB, typename TX>
__device__ __forceinline__ void row_dot(const AccCoord& c, const float (&acc)[kB][32], const TX* x, int64_t ldx,
                                        float* dst, int rows_valid = 64) {
  float s[2] = {0.f, 0.f};
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int e = 0; e < 32; e += 2) {
      if (c.row(e) >= rows_valid) continue;
      const float2 v = load2(x + c.row(e) * ldx + 64 * b + c.col(e));
      s[(e >> 1) & 1] += acc[b][e] * v.x + acc[b][e + 1] * v.y;
    }
  quad_sum(s);
  if (c.q == 0) dst[16 * c.w + c.g] = s[0], dst[16 * c.w + c.g + 8] = s[1];
}

}  // namespace flashgdn::sm90::tiles
