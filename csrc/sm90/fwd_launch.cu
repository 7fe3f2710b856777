// Host side of the Hopper forward: workspace, kernel parameters from the validated Problem, and
// the dispatch over (head dim, operand type, precision). One launch over the (sequence, value
// head) work items, or with context parallelism the five launches of fwd_context_parallel.h.
#include "sm90/fwd_launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "common/dtype.h"
#include "cuda/chunk_index.cuh"
#include "cuda/device_utils.cuh"
#include "sm90/fwd_context_parallel.h"
#include "sm90/fwd_instantiate.h"
#include "sm90/tma.h"

namespace flashgdn::sm90 {
namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Dense batches walked by persistent CTAs, several work items a CTA (checked against the oracle
// by CudaForward's dense_many_items cases, 480-512 units over the SMs).
constexpr bool kPersistentDenseBatches = true;

using cuda::sm_count;

// FLASHGDN_O_TMA=0: o's full chunks by 16-byte stores instead of TMA stores. For compute-sanitizer's
// initcheck, which does not count the TMA engine's writes as initialising memory and so reports
// every TMA-stored o tile read by a later copy (docs/reliability.md); read on every call.
bool o_tma_allowed() {
  const char* e = std::getenv("FLASHGDN_O_TMA");
  return e == nullptr || std::strcmp(e, "0") != 0;
}

// Workspace layout: [checkpoint row offsets (varlen with checkpoints)] [packed q] [packed k]
// [packed v] (the packed copies only for tensors TMA cannot address as they are), then with
// context parallelism the plan's tables, the segments' end states and transfer matrices, and
// where the exact segments' outputs are corrected, q~ ([B, T, Hv, K] in q's dtype).
struct Workspace {
  size_t ckpt = 0, q = 0, k = 0, v = 0;
  CpLayout cp;
  size_t cp_plan = 0, cp_items = 0, cp_slots = 0, cp_splits = 0, cp_warm = 0;
  size_t cp_bounds = 0, cp_chunk_gate = 0, cp_bound_warm = 0, cp_ends = 0, cp_trans = 0, cp_corr = 0;
  size_t cp_exact = 0;
  size_t total = 0;
};

Workspace plan(const Problem& p, const fgdn_fwd_args& a) {
  Workspace w;
  w.cp = cp_layout(p, sm_count(p.device_id));
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align_up(bytes);
    return at;
  };
  const bool tokens = p.B * p.T > 0;
  w.ckpt = take(p.varlen && p.checkpoint_every > 0 ? static_cast<size_t>(p.N) * sizeof(int64_t) : 0);
  w.q = take(tokens && !tile_map_direct(a.in.q) ? tile_map_packed_bytes(a.in.q) : 0);
  w.k = take(tokens && !tile_map_direct(a.in.k) ? tile_map_packed_bytes(a.in.k) : 0);
  w.v = take(tokens && !tile_map_direct(a.in.v) ? tile_map_packed_bytes(a.in.v) : 0);
  if (w.cp.enabled) {
    const CpLayout& c = w.cp;
    w.cp_plan = take(kPlanWords * sizeof(int32_t));
    w.cp_items = take(static_cast<size_t>(c.max_items) * sizeof(int4));
    w.cp_slots = take(static_cast<size_t>(c.max_slots) * sizeof(int4));
    w.cp_splits = take(static_cast<size_t>(c.max_splits) * sizeof(int4));
    w.cp_warm = take(static_cast<size_t>(c.max_slots) * p.Hv * sizeof(int32_t));
    w.cp_bounds = take(static_cast<size_t>(c.max_bounds) * sizeof(int4));
    w.cp_chunk_gate = take(static_cast<size_t>(c.max_bounds) * c.per_bound * p.Hv * sizeof(float));
    w.cp_bound_warm = take(static_cast<size_t>(c.max_bounds) * p.Hv * sizeof(int32_t));
    w.cp_ends = take(c.state_bytes);
    w.cp_trans = take(c.state_bytes);
    w.cp_corr = take(c.corr_bytes);
    w.cp_exact = take(c.corrected ? static_cast<size_t>(c.max_slots) * p.Hv * sizeof(int4) : 0);
  }
  w.total = off;
  return w;
}

// Contiguous [B, T, H, D] copy of a strided tensor (16-byte vectors along D).
__global__ void pack_rows_kernel(const uint16_t* src, int64_t s0, int64_t s1, int64_t s2, int64_t T,
                                 int64_t H, int64_t D, int64_t rows, uint16_t* dst) {
  const int64_t vec = D / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * vec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / vec, c = (i % vec) * 8;
    const int64_t b = r / (T * H), t = (r / H) % T, h = r % H;
    *reinterpret_cast<uint4*>(dst + r * D + c) =
        *reinterpret_cast<const uint4*>(src + b * s0 + t * s1 + h * s2 + c);
  }
}

TileMap tile_map(const fgdn_tensor& t, char* ws, size_t at, cudaStream_t stream) {
  if (tile_map_direct(t)) return make_tile_map(t);
  void* dst = ws + at;
  const int64_t rows = t.shape[0] * t.shape[1] * t.shape[2];
  const int64_t n = rows * (t.shape[3] / 8);
  const int blocks = static_cast<int>(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096);
  pack_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(t.data), t.strides[0],
                                               t.strides[1], t.strides[2], t.shape[1], t.shape[2],
                                               t.shape[3], rows, static_cast<uint16_t*>(dst));
  FGDN_CHECK_LAUNCH("pack_rows_kernel");
  return make_tile_map(t, dst);
}

StateRef state_ref(const fgdn_tensor& t) {
  StateRef s;
  s.data = t.data;
  s.dtype = t.dtype;
  s.s0 = t.strides[0];
  s.s1 = t.strides[1];
  s.s2 = t.strides[2];
  s.s3 = t.strides[3];
  return s;
}

// The kernel parameters of a call (all but the checkpoints and the CP tables); packs q, k, v
// into the workspace where TMA cannot address them as they are.
FwdParams make_params(const Problem& p, const fgdn_fwd_args& a, const Workspace& wl, char* ws,
                      cudaStream_t stream) {
  FwdParams fp{};
  fp.seq = cuda::make_seq_layout(p, a.in);
  fp.Hv = p.Hv;
  fp.state_dim = p.K;
  fp.group = p.group;
  if (p.B * p.T > 0) {
    const TileMap mq = tile_map(a.in.q, ws, wl.q, stream);
    const TileMap mk = tile_map(a.in.k, ws, wl.k, stream);
    const TileMap mv = tile_map(a.in.v, ws, wl.v, stream);
    fp.tma_q = mq.map;
    fp.tma_k = mk.map;
    fp.tma_v = mv.map;
    fp.order_q = mq.order;
    fp.order_k = mk.order;
    fp.order_v = mv.order;
    fp.k_dtype = a.in.k.dtype;
    if (tile_map_direct(a.in.k)) {
      fp.k = a.in.k.data;
      fp.ks0 = a.in.k.strides[0];
      fp.ks1 = a.in.k.strides[1];
      fp.ks2 = a.in.k.strides[2];
    } else {  // tile_map's packed copy: contiguous [B, T, Hq, K]
      fp.k = ws + wl.k;
      fp.ks2 = a.in.k.shape[3];
      fp.ks1 = a.in.k.shape[2] * fp.ks2;
      fp.ks0 = a.in.k.shape[1] * fp.ks1;
    }
    if (a.o.data != nullptr && tile_map_direct(a.o) && o_tma_allowed()) {
      const TileMap mo = make_tile_map(a.o);
      fp.tma_o = mo.map;
      fp.order_o = mo.order;
      fp.o_tma = 1;
    }
  }
  fp.g = a.in.g.data;
  fp.g_dtype = a.in.g.dtype;
  fp.gs0 = a.in.g.strides[0];
  fp.gs1 = a.in.g.strides[1];
  fp.gs2 = a.in.g.strides[2];
  fp.beta = a.in.beta.data;
  fp.beta_dtype = a.in.beta.dtype;
  fp.bs0 = a.in.beta.strides[0];
  fp.bs1 = a.in.beta.strides[1];
  fp.bs2 = a.in.beta.strides[2];
  fp.gate_in_kernel = p.gate_in_kernel ? 1 : 0;
  fp.A_log = p.gate_in_kernel ? static_cast<const float*>(a.in.A_log.data) : nullptr;
  fp.dt_bias = p.gate_in_kernel && p.has_dt_bias ? static_cast<const float*>(a.in.dt_bias.data) : nullptr;
  fp.l2norm = p.l2norm ? 1 : 0;
  fp.scale = p.scale;
  fp.o = a.o.data;
  fp.os0 = a.o.strides[0];
  fp.os1 = a.o.strides[1];
  fp.os2 = a.o.strides[2];
  fp.v_first = p.state_v_first ? 1 : 0;
  if (p.has_initial_state) fp.h0 = state_ref(a.in.initial_state);
  fp.state_idx = p.has_state_indices ? a.in.state_indices.data : nullptr;
  fp.state_idx_dtype = p.has_state_indices ? a.in.state_indices.dtype : FGDN_INT64;
  fp.write_final = p.output_final_state ? 1 : 0;
  if (p.output_final_state && !p.has_state_indices) fp.ht = state_ref(a.final_state);
  return fp;
}

// Launches the forward over the call's work items: one launch, or with context parallelism the
// five launches of fwd_context_parallel.h.
void run(const Problem& p, FwdParams fp, const Workspace& wl, char* ws, Precision prec,
         cudaStream_t stream) {
  // units: the launch's work-item indices (fwd_scheduler.cuh). persistent: at most one CTA per
  // SM (the kernel's occupancy), each walking every gridDim.x-th item, so that an item's loads
  // and chunk-local work overlap the state's last chunks of the one before instead of waiting
  // for a CTA to retire and the next to fill its pipeline. Otherwise one CTA per unit, for
  // items of unequal length in no particular order (varlen without CP), where the hardware's
  // greedy CTA dispatch balances better than a static stride, and for the CP launches, whose
  // grids hold many inactive units.
  auto launch = [&](FwdParams f, int64_t units, bool persistent) {
    if (units == 0) return;
    f.units = static_cast<int32_t>(units);
    const int64_t ctas = persistent ? std::min<int64_t>(units, sm_count(p.device_id)) : units;
    cuda::dispatch_dim_type(static_cast<int>(p.K), p.qkv_dtype, [&](auto c) {
      using C = decltype(c);
      launch_fwd<C::D, typename C::TQ>(f, prec, ctas, stream);
    });
  };
  if (!wl.cp.enabled) {
    // Where the items fill less than half the SMs, each one's value columns (D = 128) go to two
    // CTAs: the two halves' state chains run on two SMs instead of sharing one SM's tensor cores
    // (bench/NOTES.md, step 37). The bits are those of the unsplit kernel.
    const int64_t items = p.N * p.Hv;
    if (p.K == 128 && 2 * items <= sm_count(p.device_id)) fp.col_blocks = 2;
    launch(fp, items * fp.col_blocks, kPersistentDenseBatches && !p.varlen);
    return;
  }
  // Context parallelism (fwd_context_parallel.h): boundaries, certificate, plan, phase 1, scan,
  // then phase 2 or the exact segments' correction.
  const CpLayout& c = wl.cp;
  CpTables t;
  t.plan = reinterpret_cast<int32_t*>(ws + wl.cp_plan);
  t.items = reinterpret_cast<int4*>(ws + wl.cp_items);
  t.slots = reinterpret_cast<int4*>(ws + wl.cp_slots);
  t.splits = reinterpret_cast<int4*>(ws + wl.cp_splits);
  t.warm = reinterpret_cast<int32_t*>(ws + wl.cp_warm);
  t.bounds = reinterpret_cast<int4*>(ws + wl.cp_bounds);
  t.chunk_gate = reinterpret_cast<float*>(ws + wl.cp_chunk_gate);
  t.bound_warm = reinterpret_cast<int32_t*>(ws + wl.cp_bound_warm);
  t.exact = c.corrected ? reinterpret_cast<int4*>(ws + wl.cp_exact) : nullptr;
  fp.cp.max_slots = static_cast<int32_t>(c.max_slots);
  fp.cp.plan = t.plan;
  fp.cp.items = t.items;
  fp.cp.slots = t.slots;
  fp.cp.warm = t.warm;
  fp.cp.ends = reinterpret_cast<float*>(ws + wl.cp_ends);
  fp.cp.trans = reinterpret_cast<float*>(ws + wl.cp_trans);
  if (c.corrected) {
    fp.cp.corr = ws + wl.cp_corr;
    fp.cp.cs2 = p.K;
    fp.cp.cs1 = p.Hv * p.K;
    fp.cp.cs0 = p.T * p.Hv * p.K;
  }
  launch_cp_bounds(c, fp, t, stream);
  launch_cp_certify(c, fp, t, stream);
  launch_cp_plan(c, fp, t, stream);
  fp.cp.phase = 1;
  launch(fp, (c.max_slots + c.max_items) * p.Hv, false);
  launch_cp_scan(c, fp, t, stream);
  if (c.corrected) {
    // No second pass: the exact segments are corrected and the plan defers nothing.
    launch_cp_correct(c, fp, t, p.qkv_dtype, stream);
    return;
  }
  fp.cp.phase = 2;
  launch(fp, (c.max_slots + c.max_items) * p.Hv, false);
}

}  // namespace

void require_sm90(int device_id) {
  int major = 0, minor = 0;
  FGDN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id));
  FGDN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_id));
  if (major != 9 || minor != 0)
    throw NotSupported("flashgdn: the CUDA backend runs on Hopper GPUs (compute capability 9.0, "
                       "sm_90a); cuda:" + std::to_string(device_id) + " has compute capability " +
                       std::to_string(major) + "." + std::to_string(minor));
}

size_t forward_workspace_bytes(const Problem& p, const fgdn_fwd_args& a) { return plan(p, a).total; }

void forward(const Problem& p, const fgdn_fwd_args& a, Precision prec, void* workspace,
             cudaStream_t stream) {
  if (p.N == 0) return;
  const Workspace wl = plan(p, a);
  char* ws = static_cast<char*>(workspace);
  FwdParams fp = make_params(p, a, wl, ws, stream);
  if (p.checkpoint_every > 0) {
    fp.ckpt = state_ref(a.checkpoints);
    fp.every = p.checkpoint_every;
    if (p.varlen) {
      auto* offs = reinterpret_cast<int64_t*>(ws + wl.ckpt);
      cuda::launch_checkpoint_offsets(fp.seq, fp.every, offs, stream);
      fp.ckpt_offset = offs;
    }
  }
  run(p, fp, wl, ws, prec, stream);
}

namespace {

// The call whose checkpoints, one a chunk, are the chunk-start states: no o, no final state.
Problem chunk_states_problem(const Problem& p) {
  Problem q = p;
  q.output_final_state = false;
  q.checkpoint_every = cuda::kChunk;
  return q;
}

fgdn_fwd_args chunk_states_args(const fgdn_inputs& in) {
  fgdn_fwd_args a{};
  a.in = in;
  return a;  // o absent: the kernel computes no output
}

}  // namespace

size_t chunk_states_workspace_bytes(const Problem& p, const fgdn_inputs& in) {
  return plan(chunk_states_problem(p), chunk_states_args(in)).total;
}

namespace {

// The call q (checkpoint_every = one chunk) with its checkpoints rerouted to states in the
// backward's row layout (chunk_states, forward_with_states).
void run_with_states(const Problem& q, const fgdn_fwd_args& a, Precision prec, void* states,
                     fgdn_dtype states_dtype, const int64_t* first_row, void* workspace, cudaStream_t stream) {
  const Workspace wl = plan(q, a);
  char* ws = static_cast<char*>(workspace);
  FwdParams fp = make_params(q, a, wl, ws, stream);
  // states: [rows, Hv, K, V], row-major whatever the caller's state layout (StateRef's
  // element (k, v) is at v_first ? v s2 + k s3 : k s2 + v s3), rounded to nearest in bf16.
  const int64_t d = q.K;
  fp.ckpt.data = states;
  fp.ckpt.dtype = states_dtype;
  fp.ckpt.s0 = q.Hv * d * d;
  fp.ckpt.s1 = d * d;
  fp.ckpt.s2 = q.state_v_first ? 1 : d;
  fp.ckpt.s3 = q.state_v_first ? d : 1;
  fp.every = cuda::kChunk;
  fp.ckpt_offset = first_row;
  run(q, fp, wl, ws, prec, stream);
}

Problem with_states_problem(const Problem& p) {
  Problem q = p;
  q.checkpoint_every = cuda::kChunk;
  return q;
}

}  // namespace

void chunk_states(const Problem& p, const fgdn_inputs& in, Precision prec, void* states,
                  fgdn_dtype states_dtype, const int64_t* first_row, void* workspace, cudaStream_t stream) {
  if (p.N == 0) return;
  run_with_states(chunk_states_problem(p), chunk_states_args(in), prec, states, states_dtype, first_row, workspace,
                  stream);
}

size_t forward_with_states_workspace_bytes(const Problem& p, const fgdn_fwd_args& a) {
  return plan(with_states_problem(p), a).total;
}

void forward_with_states(const Problem& p, const fgdn_fwd_args& a, Precision prec, void* states,
                         const int64_t* first_row, void* workspace, cudaStream_t stream) {
  if (p.N == 0) return;
  run_with_states(with_states_problem(p), a, prec, states, FGDN_BFLOAT16, first_row, workspace, stream);
}

}  // namespace flashgdn::sm90
