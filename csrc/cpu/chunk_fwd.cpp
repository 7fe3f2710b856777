// CPU forward: the chunked gated delta rule (gdn-math section 3, C = 64) per (sequence, value
// head) pair, float32 arithmetic and state. Per chunk, with S the state at the chunk start:
//   Vn = U - W S
//   O  = scale * [ Qe S + M Vn ]
//   S' = exp(c_m) S + Kf^T Vn
// (U, W, M, Qe, Kf from chunk_intra, chunk_common.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "cpu/chunk_common.h"
#include "cpu/chunk_math.h"
#include "cpu/cpu_backend.h"
#include "cpu/thread_pool.h"

namespace flashgdn::cpu {

namespace {

constexpr int64_t C = kChunk;
inline size_t sz(int64_t n) { return static_cast<size_t>(n); }

struct FwdScratch {
  ChunkBuf buf;
  std::vector<float> S, Vn, O;
  FwdScratch(int64_t K, int64_t V) : buf(K, V), S(sz(K * V)), Vn(sz(C * V)), O(sz(C * V)) {}
};

}  // namespace

void forward(const Problem& p, const fgdn_fwd_args& a) {
  const fgdn_inputs& in = a.in;
  const int64_t K = p.K, V = p.V;
  const int64_t tasks = p.N * p.Hv;
  const int workers = workers_for(tasks);

  const StateView h0 = p.has_initial_state ? StateView(in.initial_state, p.state_v_first)
                                           : StateView();
  const StateView ht = (p.output_final_state && !p.has_state_indices)
                           ? StateView(a.final_state, p.state_v_first) : StateView();
  const int64_t ce = p.checkpoint_every;
  const StateView ck = ce > 0 ? StateView(a.checkpoints, p.state_v_first) : StateView();
  // offset_n = sum_{m < n} floor(len_m / checkpoint_every)
  std::vector<int64_t> ck_off(sz(p.N + 1), 0);
  if (ce > 0)
    for (int64_t n = 0; n < p.N; ++n) ck_off[sz(n + 1)] = ck_off[sz(n)] + p.seq(n).len / ce;

  std::vector<FwdScratch> scratch;
  scratch.reserve(sz(workers));
  for (int w = 0; w < workers; ++w) scratch.emplace_back(K, V);

  const fgdn_dtype odt = p.qkv_dtype;
  parallel_for(tasks, workers, [&](int64_t task, int w) {
    FwdScratch& s = scratch[sz(w)];
    ChunkBuf& buf = s.buf;
    float* S = s.S.data();
    const Pair pr = pair_of(p, task);
    const int64_t row = state_row(p, in, pr.n);
    if (row >= 0) h0.load(row, pr.h, K, V, S);
    else std::fill(s.S.begin(), s.S.end(), 0.f);

    for (int64_t tc = 0; tc < pr.len; tc += C) {
      const int64_t m = std::min(C, pr.len - tc);
      load_chunk(p, in, pr, tc, m, buf);
      chunk_intra(buf);
      // Vn = U - W S
      std::memcpy(s.Vn.data(), buf.U.data(), sizeof(float) * sz(m * V));
      gemm_nn(m, V, K, -1.f, buf.W.data(), K, S, V, true, s.Vn.data(), V);
      // O = scale * (Qe S + M Vn)
      gemm_nn(m, V, K, p.scale, buf.Qe.data(), K, S, V, false, s.O.data(), V);
      gemm_nn(m, V, m, p.scale, buf.M.data(), C, s.Vn.data(), V, true, s.O.data(), V);
      for (int64_t r = 0; r < m; ++r)
        store_row(a.o.data, odt, tok_off(a.o, pr.b, pr.t0 + tc + r, pr.h), V, &s.O[sz(r * V)]);
      // S' = exp(c_m) S + Kf^T Vn
      for (int64_t i = 0; i < K * V; ++i) S[i] *= buf.gamma;
      gemm_tn(K, V, m, 1.f, buf.Kf.data(), K, s.Vn.data(), V, true, S, V);
      // checkpoint j (0-based) is the state after (j + 1) * checkpoint_every tokens
      const int64_t done = tc + m;
      if (ce > 0 && m == C && done % ce == 0) ck.store(ck_off[sz(pr.n)] + done / ce - 1, pr.h, K, V, S);
    }

    if (p.output_final_state) {
      if (p.has_state_indices) {
        if (row >= 0) h0.store(row, pr.h, K, V, S);  // back into the pool row it came from
      } else {
        ht.store(pr.n, pr.h, K, V, S);
      }
    }
  });
}

}  // namespace flashgdn::cpu
