// The validated problem every backend receives: shapes, options and the sequence layout,
// resolved once by csrc/api/validate.cpp from the caller's fgdn_*_args.
#pragma once

#include <cstdint>
#include <vector>

#include "flashgdn/flashgdn.h"

namespace flashgdn {

// One sequence: tokens [t0, t0 + len) of batch row b.
struct SeqSpan {
  int64_t b;
  int64_t t0;
  int64_t len;
};

struct Problem {
  int64_t B = 0, T = 0, Hq = 0, Hv = 0, K = 0, V = 0;
  int64_t N = 0;               // number of sequences (B for dense, len(cu_seqlens) - 1 varlen)
  int64_t group = 1;           // Hv / Hq: value head h reads q/k head h / group
  bool varlen = false;
  bool on_cuda = false;
  int32_t device_id = 0;
  // Sequence boundaries on the host: seq(n) may be called when have_host_seqlens. Dense: from
  // the shapes (cu stays empty). Varlen: cu [N + 1], set in a call (not in a workspace size
  // query, which reads no values) from cu_seqlens_host or cu_seqlens.
  bool have_host_seqlens = false;
  std::vector<int64_t> cu;
  // The call's stream captures a CUDA graph (set in a varlen call). A replay may change
  // cu_seqlens' values (docs/api.md), so a plan that would follow the host lengths follows the
  // shapes.
  bool capturing = false;

  fgdn_dtype qkv_dtype = FGDN_BFLOAT16;
  fgdn_dtype g_dtype = FGDN_FLOAT32;
  fgdn_dtype beta_dtype = FGDN_FLOAT32;
  float scale = 0.f;
  bool l2norm = false;
  bool gate_in_kernel = false;
  bool has_dt_bias = false;
  bool state_v_first = false;
  bool has_initial_state = false;
  bool has_state_indices = false;
  int64_t pool_rows = 0;       // rows of initial_state (N without state_indices)

  // The CUDA arithmetic (fgdn_precision), forward and backward.
  fgdn_precision precision = FGDN_PRECISION_DEFAULT;

  // Forward only.
  bool output_final_state = false;
  int64_t checkpoint_every = 0;
  int32_t context_parallel = 0;  // fgdn_context_parallel (CUDA forward)
  int64_t cp_segment = 0;        // tokens per CP segment; 0: the cost model picks

  // saved_states given (forward: written; backward: read instead of the states pass).
  bool has_saved_states = false;

  // Backward only.
  bool has_d_final_state = false;
  bool want_dh0 = false;

  SeqSpan seq(int64_t n) const {
    if (!varlen) return SeqSpan{n, 0, T};
    return SeqSpan{0, cu[n], cu[n + 1] - cu[n]};
  }
  // Row of the checkpoint buffer where sequence n's checkpoints start (needs host seqlens).
  int64_t checkpoint_offset(int64_t n) const {
    int64_t off = 0;
    for (int64_t m = 0; m < n; ++m) off += seq(m).len / checkpoint_every;
    return off;
  }
};

}  // namespace flashgdn
