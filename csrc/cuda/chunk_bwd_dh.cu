// Backward, step 3: the reverse state-gradient pass (sequential over the chunks, last first).
//
// One block per (sequence, value head), carrying dS^T (fp32, the wgmma accumulators of its own
// update; warpgroup w holds value rows 64 w .. 64 w + 63) from d_final_state (zero when absent).
// With P.dh_halves = 2 (D = 128, few chains: bwd_dh_plan.h) the two warpgroups are two blocks
// (blockIdx.y = 2 h + w), each loading the whole images: the same products, on two SMs.
// Per chunk, last to first:
//   dh[chunk]  = dS                                           (gradient of the chunk's end state)
//   dV_new^T   = dvl^T + dS^T K~^T,   K~ = diag(exp(c_L - c)) Kn    (dvl = P^T dO, chunk_prep)
//   dS^T      <- exp(c_L) dS^T + dO^T Q~ - dV_new^T W,   Q~ = scale diag(exp(c)) Qn
// and finally dh0 = dS (zero for a negative state index). dvl is read from dvn and dV_new
// written to dvn_out (the launcher swaps the two after the pass). The operands arrive as bf16 hi + lo
// images written by chunk_prep (chunk_bwd_images.cuh) by two bulk copies a chunk; dS^T and
// dV_new^T become the A operands of the next products in registers (split hi + lo), so nothing
// on the chain converts or touches shared memory but the copies. Every product is hi*hi + hi*lo
// + lo*hi (~fp32 accuracy, as the pass it replaced), but dO's lo half with bf16 dO (zero).
//
// Reverse context parallelism (docs/context-parallel.md, the backward): with P.dh_segments > 1
// a chain's chunks are cut into segments of P.dh_segment_chunks, one CTA each (blockIdx.z), each
// writing only its own chunks. dS at a segment's end comes from a warm-up: the CTA starts from
// zero W chunks later and walks them first. The pass over those W chunks is the adjoint of the
// forward's state update, a product of factors (I - beta_t k_t k_t^T) exp(g_t) of norm at most
// exp(sum g) when 0 <= beta_t ||k_t||^2 <= 2 (||k_t|| = 1 with the in-kernel norm; qk_prep's rk
// gives it without; gdn-math.md, the bound behind CP). So when a window's summed (floored) gate is at or below kWarmLog (-16),
// the dS it drops is below exp(-16) = 1.1e-7 of the true one: the window certifies the
// boundary. W is the fewest whole chunks that do, at most kWarmMaxChunks, or the chunks up to
// the sequence's end (then the warm-up is exact, from d_final_state).
//
// A chain with a boundary no window certifies takes the exact path, in three launches: the pass
// is affine in dS, dS_in = R_j^T dS_out + n_j per chunk, so per segment s
//   phase 1  the N walk from zero gives N_s (dS at the segment's start) and the R walk, from
//            dS^T = I with dvl and dO read as zero, gives its transfer R_s; the last segment
//            walks for real from d_final_state and keeps its dS_start;
//   scan     dS_start(s) = R_s^T dS_start(s + 1) + N_s, last segment first, in fp32;
//   phase 2  each segment but the last walks again from its true end state, writing.
// Certified chains do all their work in phase 1 (ReverseWalk says which walk a CTA does).
//
// Blocked (P.blocked: the launcher walks the chunk slots in blocks, last first, and the per-chunk
// workspace holds one block; only unsplit, phase 0): a CTA walks its chain's chunks of the block,
// from d_final_state where the sequence ends in the block, else from the dS the block above left
// in dh_carry_in; where the sequence starts before the block it leaves its dS in dh_carry_out
// instead of writing dh0. The carry is the fp32 dS itself: the bits are those of one walk. One
// sequence at most crosses a block boundary, so the carries hold one (value head) row each.
#include <algorithm>
#include <type_traits>

#include "cuda/chunk_bwd_images.cuh"
#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/wgmma.cuh"

namespace flashgdn::cuda::bwd {

namespace {

using sm90::Mbarrier;

// A fragments (hi, lo) of k-step s (columns 16 s .. 16 s + 15) of a 64 x 64 accumulator block
// (wgmma.cuh: the accumulator tiles 2 s and 2 s + 1).
__device__ __forceinline__ void a_frags(const float (&d)[32], int s, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int i = 0; i < 2; ++i)
      sm90::split_pair<__nv_bfloat16, true>(d[4 * (2 * s + c) + 2 * i], d[4 * (2 * s + c) + 2 * i + 1], hi[2 * c + i],
                                            lo[2 * c + i]);
}

// dS^T (64 x D) += A * B over one k-step, N = D: the n128 instruction on two blocks, or n64.
template <int kB>
__device__ __forceinline__ void acc_ss(float (&S)[kB][32], uint64_t a, uint64_t b) {
  if constexpr (kB == 2) sm90::wgmma_ss_n128<__nv_bfloat16>(S[0], S[1], a, b, 1);
  else sm90::wgmma_ss_n64<__nv_bfloat16>(S[0], a, b, 1);
}
template <int kB>
__device__ __forceinline__ void acc_rs(float (&S)[kB][32], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (kB == 2) sm90::wgmma_rs_n128<__nv_bfloat16, 0>(S[0], S[1], a, b, 1);
  else sm90::wgmma_rs_n64<__nv_bfloat16, 0>(S[0], a, b, 1);
}

constexpr int kWarmMaxChunks = 16;  // as the forward's certificate (kCertifyMaxChunks)
constexpr float kWarmLog = -16.f;

// Where a walk's dS starts.
enum class WalkInit { kZero, kFinalState, kIdentity, kSlot, kCarry };

// The chunks a CTA walks: hi - 1 down to lo; it writes dh and dV_new for chunks below write_hi
// and dh0 when dh0; zero_inputs: dvl and dO read as zero (the R walk); store_slot >= 0: dS at the
// end of the walk goes to that slot of P.dh_cp (init kSlot reads one); carry_out: to
// P.dh_carry_out (blocked; init kCarry reads P.dh_carry_in). Idle when !active.
struct ReverseWalk {
  int64_t hi, lo, write_hi;
  WalkInit init;
  bool active, dh0, zero_inputs;
  int64_t store_slot, load_slot;
  bool carry_out = false;
};

// Blocked: the first sequence whose chunks reach the block, the smallest n with
// f(n) + max(chunks(n), 1) > slot0, f(n) its first chunk slot (an empty sequence's f(n) is an
// unused slot of its own). That end grows strictly with n (chunk_index.cuh), so a CTA's sequence
// is this one plus blockIdx.x: at most P.slots sequences meet a block.
__device__ int64_t first_sequence_of_block(const BwdParams& P) {
  int64_t lo = 0, hi = P.N;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const SeqInfo si = seq_info(P.seq, mid);
    const int64_t nch = ceil_div(si.len, kC);
    const int64_t end = chunk_slot(P.seq, mid, 0, si.t0) + (nch > 0 ? nch : 1);
    if (end > P.slot0) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Row of the per-chunk workspace of chunk j of sequence n (first token t0), value head h.
__device__ __forceinline__ int64_t chain_row(const BwdParams& P, int64_t n, int64_t j, int64_t t0, int64_t h) {
  return (chunk_slot(P.seq, n, j, t0) - P.slot0) * P.Hv + h;
}

// P.dh_cp: per (chain, segment) two D x D slots ([a][v] as dh): 0 holds N_s, then (after the
// scan) dS_start(s); 1 holds R_s (row-major R^T).
__device__ __forceinline__ int64_t cp_slot(const BwdParams& P, int64_t chain, int64_t seg, int which) {
  return (chain * P.dh_segments + seg) * 2 + which;
}

// The warm-up window (chunks) that certifies the boundary before chunk j1 (0 < j1 < nch) of
// sequence n, head h, computed by one warp (the result is the same in every lane): the fewest
// chunks j1 .. j1 + w - 1 whose chunk gate sums reach kWarmLog with every beta ||k||^2 in [0, 2], at most
// kWarmMaxChunks; nch - j1 when the sequence ends first; 0 when neither.
__device__ int warm_window(const BwdParams& P, int64_t n, int64_t h, const SeqInfo& si, int64_t nch, int64_t j1,
                           int lane) {
  float sum = 0.f;
  for (int w = 1; w <= kWarmMaxChunks; ++w) {
    const int64_t j = j1 + w - 1;
    if (j >= nch) return w - 1;
    const int64_t rem = si.len - j * kC;
    const int len = static_cast<int>(rem < kC ? rem : kC);
    const int64_t ls = chunk_slot(P.seq, n, j, si.t0) - P.slot0, hq = h / P.group;
    bool ok = true;
    for (int i = lane; i < len; i += 32) {
      const int64_t t = si.t0 + j * kC + i;
      const float b = load_as_float(P.beta.data, P.beta_dtype, si.b * P.beta.s0 + t * P.beta.s1 + h * P.beta.s2);
      const float rk = P.rk[qk_row(P, ls, i, hq)];  // 1 / ||k_t||
      ok = ok && b >= 0.f && (P.l2norm ? b : b / (rk * rk)) <= 2.f;
    }
    if (!__all_sync(0xffffffffu, ok)) return 0;
    sum += P.cg[(ls * P.Hv + h) * kC + len - 1];
    if (sum <= kWarmLog) return w;
  }
  return j1 + kWarmMaxChunks >= nch ? static_cast<int>(nch - j1) : 0;
}

// This CTA's walk in phase P.dh_phase (0: unsplit; 1, 2: above). Every thread calls it (it
// synchronises the block in phase 1).
__device__ ReverseWalk reverse_walk(const BwdParams& P, int64_t n, int64_t h, const SeqInfo& si, int64_t nch) {
  const int phase = P.dh_phase;
  const int64_t seg = phase == 1 ? blockIdx.z / 2 : blockIdx.z;
  const int kind = phase == 1 ? static_cast<int>(blockIdx.z % 2) : 0;  // phase 1: 0 N (or final), 1 R
  const int64_t Lc = P.dh_segment_chunks, chain = n * P.Hv + h;
  const ReverseWalk idle{0, 0, 0, WalkInit::kZero, false, false, false, -1, -1};
  const ReverseWalk whole{nch, 0, nch, WalkInit::kFinalState, true, true, false, -1, -1};
  if (phase == 0 && (blockIdx.z != 0 || !P.blocked)) return blockIdx.z == 0 ? whole : idle;
  if (phase == 0) {  // blocked: the chain's chunks in the block, jlo .. jhi - 1
    const int64_t f = chunk_slot(P.seq, n, 0, si.t0), end = P.slot0 + P.slots;
    if (nch == 0) return f >= P.slot0 && f < end ? whole : idle;  // its dh0, in the block of its slot
    const int64_t jlo = P.slot0 > f ? P.slot0 - f : 0, jhi = end - f < nch ? end - f : nch;
    if (jlo >= jhi) return idle;
    ReverseWalk w{jhi, jlo, jhi, jhi == nch ? WalkInit::kFinalState : WalkInit::kCarry, true, jlo == 0, false, -1, -1};
    w.carry_out = jlo > 0;
    return w;
  }
  const int64_t nseg = ceil_div(nch, Lc);
  if (nseg <= 1) return phase == 1 && kind == 0 && seg == 0 ? whole : idle;
  if (seg >= nseg) return idle;
  const int64_t lo = seg * Lc, write_hi = lo + Lc < nch ? lo + Lc : nch;
  const bool last = seg == nseg - 1;
  if (phase == 2) {
    if (last || P.dh_exact[chain] == 0) return idle;
    return ReverseWalk{write_hi, lo, write_hi, WalkInit::kSlot, true, lo == 0, false, -1, cp_slot(P, chain, seg + 1, 0)};
  }
  __shared__ int s_warm;  // the window of this CTA's end boundary
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  bool fail = false;
  for (int64_t b = 1 + warp; b < nseg && !fail; b += warps) {
    const int w = warm_window(P, n, h, si, nch, b * Lc, lane);
    fail = w == 0;
    if (b == seg + 1 && lane == 0) s_warm = w;
  }
  const bool exact = __syncthreads_or(fail) != 0;
  if (seg == 0 && kind == 0 && threadIdx.x == 0) P.dh_exact[chain] = exact ? 1 : 0;  // for the scan, phase 2
  if (!exact) {  // certified: the segment's only walk, its warm-up first
    if (kind == 1) return idle;
    if (last) return ReverseWalk{nch, lo, nch, WalkInit::kFinalState, true, lo == 0, false, -1, -1};
    const int64_t hi = write_hi + s_warm < nch ? write_hi + s_warm : nch;
    return ReverseWalk{hi, lo, write_hi, hi == nch ? WalkInit::kFinalState : WalkInit::kZero, true, lo == 0, false,
                       -1, -1};
  }
  if (last)  // the real walk, from d_final_state; its dS_start seeds the scan
    return kind == 0 ? ReverseWalk{nch, lo, nch, WalkInit::kFinalState, true, false, false, cp_slot(P, chain, seg, 0), -1}
                     : idle;
  return kind == 0
             ? ReverseWalk{write_hi, lo, lo, WalkInit::kZero, true, false, false, cp_slot(P, chain, seg, 0), -1}  // N
             : ReverseWalk{write_hi, lo, lo, WalkInit::kIdentity, true, false, true, cp_slot(P, chain, seg, 1), -1};  // R
}

// The exact path's scan over a chain's segments, last first: slot (s, 0) <- R_s^T slot (s + 1, 0)
// + N_s, for s = nseg - 2 .. 1 (slot (nseg - 1, 0) holds the last segment's dS_start; segment s
// then starts its phase 2 walk from slot (s + 1, 0)). fp32 on the CUDA cores, in a fixed order.
template <int D>
__global__ void __launch_bounds__(256) dh_scan_kernel(BwdParams P) {
  const int64_t n = blockIdx.x, h = blockIdx.y, chain = n * P.Hv + h;
  const SeqInfo si = seq_info(P.seq, n);
  const int64_t nseg = ceil_div(ceil_div(si.len, kC), P.dh_segment_chunks);
  if (nseg <= 2 || P.dh_exact[chain] == 0) return;  // two segments: segment 0 reads slot (1, 0) as it is
  extern __shared__ float scan_smem[];
  float* X = scan_smem;           // [D][D]: dS_start of the segment after s
  float* R = scan_smem + D * D;   // [D][D]: R_s^T, row-major
  constexpr int kRows = D * D / 256;
  const int t = threadIdx.x, v = t % D, x0 = t / D;
  const float* last = P.dh_cp + cp_slot(P, chain, nseg - 1, 0) * D * D;
  for (int e = t; e < D * D; e += 256) X[e] = last[e];
  for (int64_t sg = nseg - 2; sg >= 1; --sg) {
    float* Ns = P.dh_cp + cp_slot(P, chain, sg, 0) * D * D;
    const float* Rs = P.dh_cp + cp_slot(P, chain, sg, 1) * D * D;
    for (int e = t; e < D * D; e += 256) R[e] = Rs[e];
    __syncthreads();
    float y[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int x = x0 + (256 / D) * i;
      float acc = Ns[x * D + v];
      for (int k = 0; k < D; ++k) acc = fmaf(R[x * D + k], X[k * D + v], acc);
      y[i] = acc;
    }
    __syncthreads();  // every thread is done reading X and R
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int x = x0 + (256 / D) * i;
      X[x * D + v] = y[i];
      Ns[x * D + v] = y[i];
    }
    __syncthreads();
  }
}

template <int D>
constexpr size_t dh_smem_bytes() {
  return Images<D>::kBytes + 1024;
}

// kSplit: every product hi*hi + hi*lo + lo*hi (`default` and `high`); else hi*hi alone and only
// the images' hi parts copied (`fast`: the forward's policy, one 16-bit product a term).
template <int D, typename TQ, bool kSplit>
__global__ void __launch_bounds__(D * 2) dh_kernel(BwdParams P) {
  using Im = Images<D>;
  constexpr int kB = D / 64;  // 64-column blocks of dS^T (and warpgroups)
  const int halves = D == 128 ? P.dh_halves : 1;  // 2: this CTA is one warpgroup, the rows' half blockIdx.y % 2
  const int64_t n = (P.blocked ? first_sequence_of_block(P) : 0) + blockIdx.x, h = blockIdx.y / halves;
  if (n >= P.N) return;
  const SeqInfo si = seq_info(P.seq, n);
  const int64_t nch = ceil_div(si.len, kC);
  const ReverseWalk walk = reverse_walk(P, n, h, si, nch);
  if (!walk.active) return;
  const int tid = threadIdx.x, lane = tid & 31, w = (tid >> 5) & 3;
  const int wg = halves == 2 ? static_cast<int>(blockIdx.y % 2) : tid >> 7;  // its value rows: 64 wg + [0, 64)
  const int g = lane >> 2, q = lane & 3;
  // Accumulator element e of a 64 x 64 block: (row 16 w + g + 8 ((e >> 1) & 1), column
  // 8 (e >> 2) + 2 q + (e & 1)); the row is the value index v, offset by 64 wg.
  const auto vrow = [&](int e) { return 64 * wg + 16 * w + g + 8 * ((e >> 1) & 1); };
  const auto col = [&](int e) { return 8 * (e >> 2) + 2 * q + (e & 1); };

  uint8_t* img = &dynamic_smem_1024<uint8_t>();
  __shared__ Mbarrier k_full, qwo_full;
  const uint32_t img_addr = sm90::smem_addr(img);

  const auto slot_row = [&](int64_t j) { return chain_row(P, n, j, si.t0, h); };
  // The workspace's placement (hi parts alone without kSplit: bwd_prep.cu writes no lo part at
  // `fast`); shared memory keeps the full layout.
  constexpr auto ip = Im::at(!kSplit);
  const auto load_k = [&](int64_t j) {  // one thread: K~ of chunk j (hi + lo, or hi)
    constexpr uint32_t bytes = kSplit ? Im::kKBytes : Im::kKPart;
    k_full.arrive_expect_tx(bytes);
    sm90::bulk_load(img + Im::kK, P.img + slot_row(j) * ip.bytes + ip.k, bytes, &k_full);
  };
  // One thread: QW and dOt of chunk j; the R walk takes QW only, its dOt zero from the start (so
  // that its dO^T Q~ adds exact zeros: no branch among the products). With bf16 dO its lo part
  // is zero and never read (the products skip it), so it is neither written (bwd_prep.cu) nor
  // copied: the copy ends at dOt's hi part. Without kSplit the hi parts alone, QW's and dOt's
  // (two copies: the lo parts lie between them).
  constexpr uint32_t kOLoBytes = std::is_same_v<TQ, __nv_bfloat16> ? Im::kOPart : 0u;
  const uint32_t qwo_bytes = walk.zero_inputs ? Im::kO - Im::kQW : Im::kQWOBytes - kOLoBytes;
  const auto load_qwo = [&](int64_t j) {
    const uint8_t* src = P.img + slot_row(j) * ip.bytes;
    if constexpr (kSplit) {
      qwo_full.arrive_expect_tx(qwo_bytes);
      sm90::bulk_load(img + Im::kQW, src + ip.qw, qwo_bytes, &qwo_full);
    } else {
      qwo_full.arrive_expect_tx(Im::kQWPart + (walk.zero_inputs ? 0u : Im::kOPart));
      sm90::bulk_load(img + Im::kQW, src + ip.qw, Im::kQWPart, &qwo_full);
      if (!walk.zero_inputs) sm90::bulk_load(img + Im::kO, src + ip.o, Im::kOPart, &qwo_full);
    }
  };
  if (tid == 0) {
    k_full.init(1);
    qwo_full.init(1);
    sm90::fence_barrier_init();
  }
  if (walk.zero_inputs) {
    for (uint32_t i = 16 * tid; i < 2 * Im::kOPart; i += 16 * blockDim.x)
      *reinterpret_cast<uint4*>(img + Im::kO + i) = make_uint4(0, 0, 0, 0);
    sm90::fence_proxy_async();  // ordinary stores, read by wgmma
  }
  __syncthreads();
  if (tid == 0 && walk.hi > walk.lo) {  // (a walk of no chunks: an empty sequence's dh0)
    load_k(walk.hi - 1);
    load_qwo(walk.hi - 1);
  }

  // dS^T from d_final_state (in its dtype: fp32 | bf16 | fp16), element (v, a).
  float S[kB][32];
  const Tensor4& dht = P.d_final_state;
  const auto state_off = [&](const Tensor4& t, int64_t row, int v, int a) {
    const int64_t base = row * t.s0 + h * t.s1;
    return P.state_v_first ? base + static_cast<int64_t>(v) * t.s2 + a : base + static_cast<int64_t>(a) * t.s2 + v;
  };
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int e = 0; e < 32; ++e)
      switch (walk.init) {
        case WalkInit::kFinalState:
          S[b][e] = P.has_d_final_state ? load_as_float(dht.data, dht.dtype, state_off(dht, n, vrow(e), 64 * b + col(e)))
                                        : 0.f;
          break;
        case WalkInit::kIdentity: S[b][e] = vrow(e) == 64 * b + col(e) ? 1.f : 0.f; break;
        case WalkInit::kSlot:
          S[b][e] = P.dh_cp[walk.load_slot * D * D + static_cast<int64_t>(64 * b + col(e)) * D + vrow(e)];
          break;
        case WalkInit::kCarry:
          S[b][e] = P.dh_carry_in[(h * D + 64 * b + col(e)) * D + vrow(e)];
          break;
        default: S[b][e] = 0.f;
      }

  for (int64_t j = walk.hi - 1, it = 0; j >= walk.lo; --j, ++it) {
    const bool own = j < walk.write_hi;  // a warm-up chunk writes nothing
    const uint32_t parity = static_cast<uint32_t>(it & 1);
    const int64_t r = slot_row(j);
    const int64_t rem = si.len - j * kC;
    const int L = static_cast<int>(rem < kC ? rem : kC);
    const float eL = expf(P.cg[r * kC + L - 1]);
    const float* dvg = P.dvn + r * kC * D;  // [64 tokens][D]: dvl
    float Vn[32];                            // dV_new^T (64 values x 64 tokens), from dvl^T
#pragma unroll
    for (int e = 0; e < 32; ++e) Vn[e] = walk.zero_inputs ? 0.f : dvg[col(e) * D + vrow(e)];
    if (own) {
      float* dhg = P.dh + r * D * D;  // [D a][D v]
#pragma unroll
      for (int b = 0; b < kB; ++b)
#pragma unroll
        for (int e = 0; e < 32; ++e) dhg[static_cast<int64_t>(64 * b + col(e)) * D + vrow(e)] = S[b][e];
    }

    // dV_new^T += dS^T K~^T: A = dS^T in registers (k = a), B = K~ ([tokens][a], K-major).
    uint32_t sh[D / 16][4], sl[D / 16][4];  // A fragments of dS^T, formed before the products
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) a_frags(S[ks / 4], ks % 4, sh[ks], sl[ks]);
    k_full.wait(parity);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t b = img_addr + Im::kK + (ks / 4) * 64 * 128 + (ks % 4) * 32;
      const uint64_t bh = sm90::desc_k_major(b), bl = sm90::desc_k_major(b + Im::kKPart);
      if constexpr (kSplit) {
        sm90::wgmma_rs_n64<__nv_bfloat16, 0>(Vn, sl[ks], bh, 1);
        sm90::wgmma_rs_n64<__nv_bfloat16, 0>(Vn, sh[ks], bl, 1);
      }
      sm90::wgmma_rs_n64<__nv_bfloat16, 0>(Vn, sh[ks], bh, 1);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_regs(Vn);
    __syncthreads();  // both warpgroups are done with K~: the next chunk's may land
    if (tid == 0 && j > walk.lo) load_k(j - 1);
    if (own && P.precision_high) {  // the split-product kernels read it in fp32
      float* dvo = P.dvn_out + r * kC * D;
#pragma unroll
      for (int e = 0; e < 32; ++e) dvo[col(e) * D + vrow(e)] = Vn[e];
    } else if (own) {  // the tile kernels stage it in the inputs' type: rounded here once
      TQ* dvo = reinterpret_cast<TQ*>(P.dvn_out) + r * kC * D;
#pragma unroll
      for (int e = 0; e < 32; ++e) dvo[col(e) * D + vrow(e)] = from_float<TQ>(Vn[e]);
    }

    // dS^T <- exp(c_L) dS^T + dO^T Q~ + dV_new^T (-W)
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; ++e) S[b][e] *= eL;
    uint32_t vh[4][4], vl[4][4];  // A fragments of dV_new^T
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) a_frags(Vn, ks, vh[ks], vl[ks]);
    qwo_full.wait(parity);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {  // dO^T Q~: A = dOt (rows v of this warpgroup), B = QW tile 0
      const uint32_t a = img_addr + Im::kO + wg * 64 * 128 + ks * 32;
      const uint32_t b = img_addr + Im::kQW + ks * 32;
      const uint64_t ah = sm90::desc_k_major(a), al = sm90::desc_k_major(a + Im::kOPart);
      const uint64_t bh = sm90::desc_k_major(b), bl = sm90::desc_k_major(b + Im::kQWPart);
      if constexpr (kSplit) {
        if constexpr (!std::is_same_v<TQ, __nv_bfloat16>) acc_ss<kB>(S, al, bh);  // bf16 dO: lo = 0
        acc_ss<kB>(S, ah, bl);
      }
      acc_ss<kB>(S, ah, bh);
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {  // dV_new^T (-W): A = dV_new^T in registers, B = QW tile 1
      const uint32_t b = img_addr + Im::kQW + Im::kQWTile + ks * 32;
      const uint64_t bh = sm90::desc_k_major(b), bl = sm90::desc_k_major(b + Im::kQWPart);
      if constexpr (kSplit) {
        acc_rs<kB>(S, vl[ks], bh);
        acc_rs<kB>(S, vh[ks], bl);
      }
      acc_rs<kB>(S, vh[ks], bh);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < kB; ++b) sm90::fence_regs(S[b]);
    __syncthreads();  // both warpgroups are done with QW and dOt
    if (tid == 0 && j > walk.lo) load_qwo(j - 1);
  }

  if (walk.store_slot >= 0) {
    float* dst = P.dh_cp + walk.store_slot * D * D;  // [D a][D v], as dh
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; ++e) dst[static_cast<int64_t>(64 * b + col(e)) * D + vrow(e)] = S[b][e];
  }
  if (walk.carry_out) {
    float* dst = P.dh_carry_out + h * D * D;  // [D a][D v], as dh
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; ++e) dst[static_cast<int64_t>(64 * b + col(e)) * D + vrow(e)] = S[b][e];
  }
  if (P.want_dh0 && walk.dh0) {  // rounded to dh0's dtype (nearest even)
    int64_t row = n;
    if (P.has_state_indices) row = load_index(P.state_indices, P.idx_dtype, n);
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 32; ++e)
        store_from_float(P.dh0.data, P.dh0.dtype, state_off(P.dh0, n, vrow(e), 64 * b + col(e)),
                         row >= 0 ? S[b][e] : 0.f);
  }
}

// Unsplit: one launch (phase 0). Split: phase 1 (two CTAs a segment: N or the certified walk,
// and R), the scan, phase 2 (a CTA a segment).
template <int D, typename TQ, bool kSplit>
void launch_split(const BwdParams& P0, cudaStream_t s) {
  set_dynamic_smem(dh_kernel<D, TQ, kSplit>, dh_smem_bytes<D>());
  BwdParams P = P0;
  if (P.dh_segments <= 1) {
    P.dh_phase = 0;
    const int halves = D == 128 ? P.dh_halves : 1;
    P.dh_halves = halves;
    const int64_t seqs = P.blocked ? std::min(P.N, P.slots) : P.N;  // blocked: the block's (at most slots)
    dh_kernel<D, TQ, kSplit><<<dim3(seqs, P.Hv * halves, 1), D * 2 / halves, dh_smem_bytes<D>(), s>>>(P);
    FGDN_CHECK_LAUNCH("bwd dh pass");
    return;
  }
  P.dh_phase = 1;
  P.dh_halves = 1;
  dh_kernel<D, TQ, kSplit><<<dim3(P.N, P.Hv, 2 * P.dh_segments), D * 2, dh_smem_bytes<D>(), s>>>(P);
  FGDN_CHECK_LAUNCH("bwd dh pass (segments)");
  constexpr size_t kScanSmem = 2 * D * D * sizeof(float);
  set_dynamic_smem(dh_scan_kernel<D>, kScanSmem);
  dh_scan_kernel<D><<<dim3(P.N, P.Hv), 256, kScanSmem, s>>>(P);
  FGDN_CHECK_LAUNCH("bwd dh scan");
  P.dh_phase = 2;
  dh_kernel<D, TQ, kSplit><<<dim3(P.N, P.Hv, P.dh_segments), D * 2, dh_smem_bytes<D>(), s>>>(P);
  FGDN_CHECK_LAUNCH("bwd dh pass (exact segments)");
}

// `fast` (P.precision_fast): single products; otherwise split.
template <int D, typename TQ>
void launch_typed(DimType<D, TQ>, const BwdParams& P, cudaStream_t s) {
  if (P.precision_fast) launch_split<D, TQ, false>(P, s);
  else launch_split<D, TQ, true>(P, s);
}

}  // namespace

void launch_bwd_dh(const BwdParams& P, cudaStream_t s) {
  dispatch_dim_type(P, [&](auto c) { launch_typed(c, P, s); });
}

}  // namespace flashgdn::cuda::bwd
