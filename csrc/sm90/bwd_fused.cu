// Backward at `fast` and `default` by the fused reverse kernel (bwd_fused_kernel.cuh), K = V = 128,
// bf16:
//   1. states   chunk-start states h, bf16 (chunk_bwd_state.cu: the forward's `fast` kernel at
//               `fast`, its split-states kernel at `default`), or the ones the forward saved
//               under autograd
//   2. prep     per (chunk, q/k head): q, k normalised (with the in-kernel l2norm) and rounded to
//               bf16 in slot layout (zero past the length), K K^T once, then per value head c
//               and beta and Ar = (I + strict_lower(diag(beta) K K^T))^-1 from the bf16 keys, no
//               gates; v, dO too unless the kernel reads the user's in place (FusedLayout::vo_direct;
//               then a packed sequence's partial last chunk alone, its tail)
//   3. fused    per (sequence, value head): the reverse walk -> dk, dv, dq tiles, dg, dbeta, dh0;
//               under reverse CP (bwd_dh_plan.h's segments, when the chains are too few for the
//               SMs): 3a. the last segment walked from dht (its start carry the seed of the one
//               before) and each middle segment's transfer dS -> A_s dS + B_s (two walks that
//               write no gradient; A_s's not where the gates certify it negligible), 3b. the scan
//               X = A_s X + B_s from that seed, segment by segment, for the carry at each
//               segment's end (the forward scan's step, cp_scan_step.cuh), 3c. the other
//               segments walked from that carry
//   4. reduce   per (chunk, q/k head): dq, dk summed over the group's value heads in ascending
//               order, the l2norm's backward (1 / ||x|| recomputed), dv (where the kernel did
//               not store it in place: FusedLayout::dv_direct) and dbeta to the user's tensors;
//               then the gate step (chunk_bwd_reduce.cu) from dg.
// Steps 2, 3b and 4 are in bwd_fused_prep.cu, bwd_fused_scan.cu and bwd_fused_reduce.cu, the
// kernel of step 3 in bwd_fused_kernel.cuh; this file holds the layout and the launch sequence.
// Selected by chunk_bwd.cu (fused_backward_applies); its workspace: fused_layout().
#include "sm90/bwd_fused.h"

#include <algorithm>
#include <cstdlib>

#include "cuda/bwd_dh_plan.h"
#include "sm90/bwd_fused_kernel.cuh"
#include "sm90/tma.h"

namespace flashgdn::cuda::bwd {

namespace {

namespace fk = sm90::fused_bwd;
constexpr int kD = 128;

// A 4-D tile map over a slot-layout bf16 buffer [rows, heads, 128] (sm90/tma.h's box).
sm90::TileMap slot_map(const void* data, int64_t rows, int64_t heads) {
  fgdn_tensor t{};
  t.data = const_cast<void*>(data);
  t.dtype = FGDN_BFLOAT16;
  t.ndim = 4;
  const int64_t shape[4] = {1, rows, heads, kD};
  const int64_t strides[4] = {rows * heads * kD, heads * kD, kD, 1};
  for (int i = 0; i < 4; ++i) t.shape[i] = shape[i], t.strides[i] = strides[i];
  return sm90::make_tile_map(t);
}

}  // namespace

bool fused_backward_applies(const Problem& p) {
  const char* e = std::getenv("FLASHGDN_BWD_FUSED");  // "0": the staged kernels, for A/B runs
  // Not `default` with the gate in the kernel: dA_log and ddt_bias sum dg over tokens that cancel
  // (docs/reliability.md D1), and the fused kernel's dg (bf16 states, bf16 dS mirror) carries
  // `fast`'s tail into them there: 1.41e-2 and 1.22e-2 on 2 of 25 seeds of test_bwd_fused's varlen
  // case against the staged `default`'s 1.3e-3 and 3.1e-3 (H200, 2026-11-29; D7).
  if (p.gate_in_kernel && p.precision == FGDN_PRECISION_DEFAULT) return false;
  return (e == nullptr || std::atoi(e) != 0) && p.precision != FGDN_PRECISION_HIGH && p.qkv_dtype == FGDN_BFLOAT16 &&
         p.K == kD && p.V == kD && (num_chunk_slots(p) + 1) * p.Hv * kD < (int64_t{1} << 31);  // 32-bit unit rows
}

FusedLayout fused_layout(const Problem& p, const fgdn_bwd_args& a) {
  const size_t S = static_cast<size_t>(num_chunk_slots(p)), C = kC, D = kD;
  const size_t Hq = static_cast<size_t>(p.Hq), Hv = static_cast<size_t>(p.Hv);
  const bool direct = sm90::tile_map_direct(a.in.v) && sm90::tile_map_direct(a.d_o);
  const bool dv_direct = direct && sm90::tile_map_direct(a.dv);
  const bool tails = direct && p.varlen;
  const int32_t out_count = dv_direct ? 2 : 3;
  static_assert(2 * fk::kTile == fk::kState, "a unit's dk, dq tiles fill its state");
  const bool out_in_states = out_count == 2 && (!p.has_saved_states || a.saved_states_scratch == 1);
  const size_t vo = direct ? 0 : S * C * Hv * D * 2;
  // A tail a sequence (N of them <= the chunk slots; the shapes alone size it, no lengths needed).
  const size_t N = static_cast<size_t>(p.N), tail = tails ? N * C * Hv * D * 2 : 0;
  // The plan from the lengths where the call has them; the buffers for the most segments any
  // lengths take, so that a workspace sized by the query (no lengths) always suffices.
  const DhPlan plan = dh_plan_segments(p, sm_count(p.device_id), /*fused=*/true);
  const int32_t capacity = fused_segments_capacity(p, sm_count(p.device_id));
  const size_t cp = static_cast<size_t>(p.N) * Hv * fused_cp_per_chain(capacity) * D * D * 4;
  const size_t sizes[FusedLayout::kCount] = {
      S * C * Hq * D * 2, S * C * Hq * D * 2,  // q16, k16
      vo, vo,                                  // v16, do16
      tail, tail,                              // v_tail, do_tail
      tails && dv_direct ? N * Hv * fk::kTile : 0,  // dv_tail
      S * Hv * 2 * C * 4,                      // gates
      S * Hv * fk::kSmall,                     // ar
      out_in_states ? 0 : S * Hv * out_count * fk::kTile,  // out
      S * Hv * C * 4, S * Hv * C * 4,          // dg, dbeta
      S * Hv * 4,                              // bound
      p.l2norm ? S * Hq * 2 * C * 4 : 0,       // row_scale (the in-kernel l2norm's backward alone)
      cp,                                      // cp
  };
  FusedLayout L{};
  L.vo_direct = direct;
  L.tails = tails;
  L.dv_direct = dv_direct;
  L.out_count = out_count;
  L.out_in_states = out_in_states;
  L.segments = plan.segments;
  L.cut = plan.cut;
  size_t o = 0;
  for (int i = 0; i < FusedLayout::kCount; ++i) {
    L.off[i] = o;
    o += align256(sizes[i]);
  }
  L.bytes = o;
  return L;
}

void launch_bwd_fused(const BwdParams& P, const fgdn_bwd_args& a, const FusedBuffers& F, cudaStream_t s) {
  const int64_t slots = P.num_chunks;
  if (slots > 0) launch_fused_prep(P, F, s);
  fk::Params K{};
  const int64_t rows = slots * kC;
  K.tq = slot_map(F.q16, std::max<int64_t>(rows, 1), P.Hq);
  K.tk = slot_map(F.k16, std::max<int64_t>(rows, 1), P.Hq);
  K.vo_direct = F.v16 == nullptr;
  K.tv = K.vo_direct ? sm90::make_tile_map(a.in.v) : slot_map(F.v16, std::max<int64_t>(rows, 1), P.Hv);
  K.tdo = K.vo_direct ? sm90::make_tile_map(a.d_o) : slot_map(F.do16, std::max<int64_t>(rows, 1), P.Hv);
  K.tails = F.v_tail != nullptr;
  if (K.tails) {  // rows n 64 + i of sequence n's partial last chunk
    K.tv_tail = slot_map(F.v_tail, std::max<int64_t>(P.N * kC, 1), P.Hv);
    K.tdo_tail = slot_map(F.do_tail, std::max<int64_t>(P.N * kC, 1), P.Hv);
    K.dv_tail = F.dv_tail;
  }
  K.ts0 = slot_map(P.h, (slots + 1) * P.Hv * kD, 1);  // bf16 h (states_in_bf16)
  K.dv_direct = F.dv_direct;
  K.out_count = F.out_count;
  if (F.dv_direct) K.tdv = sm90::make_tile_map(a.dv);
  K.seq = P.seq;
  K.Hv = static_cast<int32_t>(P.Hv);
  K.group = static_cast<int32_t>(P.group);
  K.ar = F.ar;
  K.gates = F.gates;
  K.out_tiles = F.out;
  K.dg = F.dg;
  K.dbeta = F.dbeta;
  K.dht = P.d_final_state;
  K.dh0 = P.dh0;
  K.state_indices = P.state_indices;
  K.has_dht = P.has_d_final_state;
  K.want_dh0 = P.want_dh0;
  K.state_v_first = P.state_v_first;
  K.has_state_indices = P.has_state_indices;
  K.idx_dtype = P.idx_dtype;
  K.scale = P.scale;
  K.cut = F.cut;
  K.segments = F.segments;
  K.cp = F.cp;
  K.bound = F.bound;
  // `default` stages T diag(beta), dV_new and R in fp16, each tile scaled (fk::fused_bwd's
  // kF16Island); `fast` stages them in bf16, as every other intermediate.
  const auto kernel = P.precision_fast ? fk::fused_bwd<false> : fk::fused_bwd<true>;
  constexpr size_t kSmem = sizeof(fk::Smem) + 1024;  // + the alignment the kernel takes
  static_assert(kSmem <= 227 * 1024, "fused_bwd's shared memory exceeds sm_90's 227 KB a block");
  set_dynamic_smem(kernel, kSmem);
  if (P.N > 0 && P.Hv > 0) {  // a CTA a chain or segment (sequences of no chunks too: dh0 = dht)
    const unsigned N = static_cast<unsigned>(P.N), Hv = static_cast<unsigned>(P.Hv);
    if (F.segments > 1) {
      K.phase = 1;
      fk::clear_walk_timeline_ctas(s);
      kernel<<<dim3(N, Hv, 2 * F.segments), fk::kThreads, kSmem, s>>>(K);
      FGDN_CHECK_LAUNCH("bwd fused (CP transfers)");
      launch_fused_cp_scan(K, P.N, P.Hv, s);
    }
    K.phase = 0;
    fk::clear_walk_timeline_ctas(s);
    kernel<<<dim3(N, Hv, F.segments), fk::kThreads, kSmem, s>>>(K);
    FGDN_CHECK_LAUNCH("bwd fused");
    // A diagnostic build's table (bwd_fused_timeline.cuh): CTA (0, 0, 0) walks sequence 0's first
    // segment (dense: the chunks of a row, or the cut's first segment of them under reverse CP).
    const int64_t row_chunks = (P.seq.T + 63) / 64;
    const int64_t walked = std::min<int64_t>(F.cut.chunks(static_cast<int>(row_chunks)), row_chunks);
    fk::report_walk_timeline(s, P.seq.varlen ? 0 : walked);
  }
  if (slots > 0) launch_fused_reduce(P, F, s);
}

}  // namespace flashgdn::cuda::bwd
