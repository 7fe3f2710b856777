// Backward launcher: workspace layout and the kernel chain (see chunk_bwd.h).
//   1. states  (per sequence)  chunk-start states h (Hopper forward)  chunk_bwd_state.cu
//   2. prep    (per chunk)     qn/kn, c, T, W, V_new = U - W h, dvl,  sm90/bwd_prep.cu (fast),
//                              the reverse pass's bf16 images         chunk_bwd_prep.cu (high)
//   3. dh      (per sequence)  reverse pass (wgmma): dh, dV_new, dh0  chunk_bwd_dh.cu
//   4. dqk     (per chunk)     dq, dk (output/state part), dW, dc     chunk_bwd_dqk.cu (high)
//   5. wy      (per chunk)     dv, dbeta, dk and dc (WY part)         chunk_bwd_wy.cu (high)
//   4+5 below `high`: one kernel, dW and dk's part kept on chip       sm90/bwd_dqk_wy.cu
//   6. reduce                  dq/dk over GVA + l2norm, dg, dA_log    chunk_bwd_reduce.cu
// Steps 2-6 run once per block of chunk slots, the last block first (bwd_dh_plan.h, block_plan):
// the per-chunk workspace holds one block, the states of step 1 every chunk; dA_log and ddt_bias
// are summed after the last block.
#include "cuda/chunk_bwd.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "cuda/bwd_dh_plan.h"
#include "cuda/chunk_bwd_images.cuh"
#include "cuda/chunk_bwd_internal.cuh"
#include "sm90/bwd_fused.h"

namespace flashgdn::cuda {

namespace {

struct Layout {
  bwd::BlockPlan blocks;
  size_t off[14];
  size_t gpart, first_row;  // per-chunk gate sums; chunk_bwd_state.cu's rows
  size_t dh_cp, dh_exact;   // the dh pass's exact-path slots and chain flags (split only)
  size_t carry[2];          // the dh pass's carries between blocks (blocked only)
  // One region, three tenants whose lives do not overlap (the launches run in order on one
  // stream): the states pass's forward scratch (step 1), the reverse pass's images (written by
  // step 2, read by step 3), then dqh and dkh (written by step 4, read by steps 5 and 6).
  size_t shared, fwd, img;
  size_t total;
  bool fused;  // the fused backward (sm90/bwd_fused.h): its buffers, `F`, from `shared` on
  bwd::FusedLayout F;
};

using bwd::align256;
using bwd::tensor4;

static_assert(bwd::kDhChunk == bwd::kC, "the dh plan counts the backward's chunks");

// Indices in Layout::off (BwdParams order) of h, T, W, V_new, dqh and dkh.
constexpr int kH = 5, kTm = 7, kW = 8, kVn = 9, kDqh = 11, kDkh = 12;

// FLASHGDN_BWD_BLOCK_SLOTS=n (n > 0): blocks of n chunk slots (tests; bwd_dh_plan.h).
int64_t forced_block_slots() {
  const char* e = std::getenv("FLASHGDN_BWD_BLOCK_SLOTS");
  return e ? std::max<int64_t>(0, std::atoll(e)) : 0;
}

// The per-chunk regions of a block of Sb slots, in BwdParams order: offsets from the block's
// start (h, index 5, excluded: it spans every slot), their end, and the shared region's size
// without the states pass's scratch.
struct BlockRegions {
  size_t off[14];
  size_t end, dqk_img;
};

BlockRegions block_regions(const Problem& p, size_t Sb) {
  const size_t D = static_cast<size_t>(p.K), C = bwd::kC;
  const size_t Hq = static_cast<size_t>(p.Hq), Hv = static_cast<size_t>(p.Hv);
  const size_t S = Sb;
  const size_t n[14] = {
      S * C * Hq * D, S * C * Hq * D,  // qn, kn
      S * C * Hq, S * C * Hq,          // rq, rk
      S * Hv * C,                      // cg
      0, S * Hv * D * D,               // h (its own region: make_layout), dh
      S * Hv * C * C,                  // Tm
      S * Hv * C * D, S * Hv * C * D, S * Hv * C * D,  // W, vn, dvn
      S * Hv * C * D, S * Hv * C * D,  // dqh, dkh (in the shared region)
      S * Hv * C,                      // dc
  };
  // Below `high`, T, W's buffer (the dh pass's dV_new, then dqk's dW) and V_new hold 16-bit
  // values (the inputs' type: the tile kernels that read them stage them so); so does h at `fast`
  // with bf16 inputs (bwd::states_in_bf16, make_layout).
  const bool wide = p.precision == FGDN_PRECISION_HIGH;
  BlockRegions R{};
  size_t o = 0;
  for (int i = 0; i < 14; ++i) {
    if (i == kDqh || i == kDkh || i == kH) continue;
    R.off[i] = o;
    const bool narrow = (i == kTm || i == kW || i == kVn) && !wide;
    o += align256(n[i] * (narrow ? 2 : sizeof(float)));
  }
  R.end = o;
  R.off[kDqh] = 0;
  R.off[kDkh] = align256(n[kDqh] * sizeof(float));
  const size_t dqk = R.off[kDkh] + align256(n[kDkh] * sizeof(float));
  const bool hi_only = p.precision == FGDN_PRECISION_FAST;  // the images' lo parts: none at `fast`
  const size_t per_unit = D == 128 ? bwd::Images<128>::at(hi_only).bytes : bwd::Images<64>::at(hi_only).bytes;
  const size_t img = align256(S * Hv * per_unit);
  R.dqk_img = std::max(dqk, img);
  return R;
}

// The workspace: the block's per-chunk regions, h, the gate sums and the dh pass's buffers, then
// the shared region.
Layout make_layout(const Problem& p, const fgdn_bwd_args& a) {
  const fgdn_inputs& in = a.in;
  const size_t S = static_cast<size_t>(num_chunk_slots(p));
  const size_t D = static_cast<size_t>(p.K), Hv = static_cast<size_t>(p.Hv);
  if (bwd::fused_backward_applies(p)) {  // h, the gate sums, the states pass's rows, then its buffers
    Layout L{};
    L.fused = true;
    const bool saved = p.has_saved_states;  // h is the caller's saved_states: no states pass
    size_t o = 0;
    L.off[kH] = o;
    if (!saved) o += align256((S + 1) * Hv * D * D * 2);  // bf16 (states_in_bf16); one spare row
    L.gpart = o;
    o += align256(S * Hv * 2 * sizeof(float));
    L.first_row = o;
    if (!saved) o += align256(static_cast<size_t>(p.N) * sizeof(int64_t));
    L.shared = L.fwd = o;  // the states pass's scratch, then the fused buffers
    L.F = bwd::fused_layout(p, a);
    L.total = o + std::max(saved ? 0 : align256(bwd::states_workspace_bytes(p, in)), L.F.bytes);
    return L;
  }
  const bwd::DhPlan dp = bwd::dh_plan(p, sm_count(p.device_id));
  const BlockRegions one = block_regions(p, 1);
  Layout L{};
  L.blocks = bwd::block_plan(static_cast<int64_t>(S), one.end + one.dqk_img, p.Hv, sm_count(p.device_id),
                             dp.segments > 1, forced_block_slots());
  const BlockRegions R = block_regions(p, static_cast<size_t>(L.blocks.slots));
  for (int i = 0; i < 14; ++i) L.off[i] = R.off[i];
  size_t o = R.end;
  const bool h16 = bwd::states_in_bf16(p.precision == FGDN_PRECISION_FAST, p.qkv_dtype);
  L.off[kH] = o;
  o += align256((S + 1) * Hv * D * D * (h16 ? 2 : sizeof(float)));  // one spare row: chunk_bwd_state.cu
  L.gpart = o;
  o += align256(S * Hv * 2 * sizeof(float));
  L.first_row = o;
  o += align256(static_cast<size_t>(p.N) * sizeof(int64_t));
  const size_t chains = static_cast<size_t>(p.N) * Hv;
  L.dh_cp = o;
  if (dp.segments > 1) o += align256(chains * static_cast<size_t>(dp.segments) * 2 * D * D * sizeof(float));
  L.dh_exact = o;
  if (dp.segments > 1) o += align256(chains * sizeof(int32_t));
  for (size_t& c : L.carry) {
    c = o;
    if (L.blocks.count > 1) o += align256(Hv * D * D * sizeof(float));
  }
  L.shared = L.fwd = L.img = o;
  L.off[kDqh] += o;
  L.off[kDkh] += o;
  const size_t fwd = align256(bwd::states_workspace_bytes(p, in));
  L.total = o + std::max(R.dqk_img, fwd);
  return L;
}

// The fused backward (sm90/bwd_fused.h): states, then its steps over every chunk slot at once, the
// gate step from its dg and the head sums.
void launch_fused(const Problem& p, const fgdn_bwd_args& a, bwd::BwdParams& P, const Layout& L, char* w,
                  cudaStream_t stream) {
  const fgdn_inputs& in = a.in;
  const bwd::FusedLayout& F = L.F;
  char* f = w + L.shared;
  P.gpart = reinterpret_cast<float*>(w + L.gpart);
  if (p.has_saved_states) {  // written by the forward (bwd::forward_saving_states)
    P.h = static_cast<float*>(a.saved_states.data);
  } else {
    P.h = reinterpret_cast<float*>(w + L.off[kH]);
    if (P.num_chunks > 0)
      bwd::launch_bwd_states(p, in, P, /*h16=*/true, reinterpret_cast<int64_t*>(w + L.first_row), w + L.fwd, stream);
  }
  P.slot0 = 0;
  P.slots = P.num_chunks;
  bwd::FusedBuffers B{};
  B.q16 = reinterpret_cast<__nv_bfloat16*>(f + F.off[F.kQ16]);
  B.k16 = reinterpret_cast<__nv_bfloat16*>(f + F.off[F.kK16]);
  B.v16 = F.vo_direct ? nullptr : reinterpret_cast<__nv_bfloat16*>(f + F.off[F.kV16]);
  B.do16 = F.vo_direct ? nullptr : reinterpret_cast<__nv_bfloat16*>(f + F.off[F.kDo16]);
  B.v_tail = F.tails ? reinterpret_cast<__nv_bfloat16*>(f + F.off[F.kVTail]) : nullptr;
  B.do_tail = F.tails ? reinterpret_cast<__nv_bfloat16*>(f + F.off[F.kDoTail]) : nullptr;
  B.dv_tail = F.tails && F.dv_direct ? reinterpret_cast<uint8_t*>(f + F.off[F.kDvTail]) : nullptr;
  B.gates = reinterpret_cast<float*>(f + F.off[F.kGates]);
  B.ar = reinterpret_cast<uint8_t*>(f + F.off[F.kAr]);
  // h's unit u (slot Hv + h) at u kState bytes, as the out tiles' unit u (bwd_fused.h).
  B.out = F.out_in_states ? reinterpret_cast<uint8_t*>(P.h) : reinterpret_cast<uint8_t*>(f + F.off[F.kOut]);
  B.dv_direct = F.dv_direct;
  B.out_count = F.out_count;
  B.dg = reinterpret_cast<float*>(f + F.off[F.kDg]);
  B.dbeta = reinterpret_cast<float*>(f + F.off[F.kDbeta]);
  B.bound = reinterpret_cast<float*>(f + F.off[F.kBound]);
  B.row_scale = p.l2norm ? reinterpret_cast<float*>(f + F.off[F.kRowScale]) : nullptr;
  B.cp = reinterpret_cast<float*>(f + F.off[F.kCp]);
  B.cut = F.cut;
  B.segments = F.segments;
  bwd::launch_bwd_fused(P, a, B, stream);
  P.dc = B.dg;
  P.dc_summed = 1;
  bwd::launch_bwd_gate(P, stream);
  if (P.gate_in_kernel) bwd::launch_bwd_head_sums(P, stream);
}

}  // namespace

size_t backward_workspace_bytes(const flashgdn::Problem& p, const fgdn_bwd_args& a) {
  return make_layout(p, a).total;
}

void launch_backward(const flashgdn::Problem& p, const fgdn_bwd_args& a, void* workspace,
                     cudaStream_t stream) {
  const fgdn_inputs& in = a.in;
  bwd::BwdParams P{};
  P.B = p.B;
  P.T = p.T;
  P.Hq = p.Hq;
  P.Hv = p.Hv;
  P.D = p.K;
  P.N = p.N;
  P.group = p.group;
  P.num_chunks = num_chunk_slots(p);
  P.scale = p.scale;
  P.qkv_dtype = p.qkv_dtype;
  P.g_dtype = p.g_dtype;
  P.beta_dtype = p.beta_dtype;
  P.l2norm = p.l2norm;
  P.gate_in_kernel = p.gate_in_kernel;
  P.has_dt_bias = p.has_dt_bias;
  P.state_v_first = p.state_v_first;
  P.has_initial_state = p.has_initial_state;
  P.has_state_indices = p.has_state_indices;
  P.has_d_final_state = p.has_d_final_state;
  P.want_dh0 = p.want_dh0;
  P.precision_high = p.precision == FGDN_PRECISION_HIGH;
  P.precision_fast = p.precision == FGDN_PRECISION_FAST;
  const bwd::DhPlan dp = bwd::dh_plan(p, sm_count(p.device_id));
  P.dh_segment_chunks = dp.chunks;
  P.dh_segments = dp.segments;
  P.dh_halves = dp.halves;
  P.idx_dtype = p.has_state_indices ? in.state_indices.dtype : FGDN_INT64;
  P.seq = make_seq_layout(p, in);

  P.q = tensor4(in.q);
  P.k = tensor4(in.k);
  P.v = tensor4(in.v);
  P.g = tensor4(in.g);
  P.beta = tensor4(in.beta);
  P.d_o = tensor4(a.d_o);
  P.A_log = static_cast<const float*>(in.A_log.data);
  P.dt_bias = static_cast<const float*>(in.dt_bias.data);
  P.state_indices = in.state_indices.data;
  P.h0 = tensor4(in.initial_state);
  P.d_final_state = tensor4(a.d_final_state);
  P.dq = tensor4(a.dq);
  P.dk = tensor4(a.dk);
  P.dv = tensor4(a.dv);
  P.dg = tensor4(a.dg);
  P.dbeta = tensor4(a.dbeta);
  P.dA_log = static_cast<float*>(a.dA_log.data);
  P.ddt_bias = static_cast<float*>(a.ddt_bias.data);
  P.dh0 = tensor4(a.dh0);

  const Layout L = make_layout(p, a);
  char* w = static_cast<char*>(workspace);
  if (L.fused) {
    launch_fused(p, a, P, L, w, stream);
    return;
  }
  float** dst[14] = {&P.qn, &P.kn, &P.rq, &P.rk, &P.cg, &P.h, &P.dh,
                     &P.Tm, &P.W,  &P.vn, &P.dvn, &P.dqh, &P.dkh, &P.dc};
  for (int i = 0; i < 14; ++i) *dst[i] = reinterpret_cast<float*>(w + L.off[i]);
  P.gpart = reinterpret_cast<float*>(w + L.gpart);
  P.dh_cp = reinterpret_cast<float*>(w + L.dh_cp);
  P.dh_exact = reinterpret_cast<int32_t*>(w + L.dh_exact);
  P.img = reinterpret_cast<uint8_t*>(w + L.img);

  const bool any_chunks = P.num_chunks > 0;
  if (any_chunks)
    bwd::launch_bwd_states(p, in, P, bwd::states_in_bf16(P.precision_fast != 0, P.qkv_dtype),
                           reinterpret_cast<int64_t*>(w + L.first_row), w + L.fwd, stream);
  P.blocked = L.blocks.count > 1;
  float* carry[2] = {reinterpret_cast<float*>(w + L.carry[0]), reinterpret_cast<float*>(w + L.carry[1])};
  for (int64_t blk = L.blocks.count - 1; blk >= 0; --blk) {  // the last block first: dS flows down
    bwd::BwdParams Pb = P;
    Pb.slot0 = blk * L.blocks.slots;
    Pb.slots = std::min(L.blocks.slots, P.num_chunks - Pb.slot0);
    Pb.dh_carry_in = carry[(blk + 1) & 1];  // written by the block above
    Pb.dh_carry_out = carry[blk & 1];
    const bool slots = Pb.slots > 0;
    if (slots) Pb.precision_high ? bwd::launch_bwd_prep(Pb, stream) : bwd::launch_bwd_prep_sm90(Pb, stream);
    if (Pb.N > 0) {
      Pb.dvn_out = Pb.W;  // W's buffer is free from here (the images carry -W); dW goes there later
      bwd::launch_bwd_dh(Pb, stream);
      std::swap(Pb.dvn, Pb.W);  // dvn: dV_new for dqk and wy; W: the dvl buffer, dW's home now
    }
    if (!slots) continue;
    if (Pb.precision_high) {
      bwd::launch_bwd_dqk(Pb, stream);
      bwd::launch_bwd_wy(Pb, stream);
    } else {
      bwd::launch_bwd_dqk_wy_sm90(Pb, stream);
    }
    bwd::launch_bwd_reduce(Pb, stream);
  }
  if (P.gate_in_kernel) bwd::launch_bwd_head_sums(P, stream);
}

}  // namespace flashgdn::cuda
