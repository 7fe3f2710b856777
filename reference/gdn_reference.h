// float64 oracle of the gated delta rule: the token-by-token recurrence (gdn-math section 1)
// and its reverse mode (section 2), with every option of the public API. Slow on purpose: it is
// what every faster path is measured against. Layouts are dense row-major:
//   q, k [B, T, Hq, K]; v, o [B, T, Hv, V]; g (or a with gate_in_kernel), beta [B, T, Hv];
//   A_log, dt_bias [Hv]; h0, ht, dh0, d_ht [N, Hv, K, V]; checkpoints [R, Hv, K, V].
#pragma once

#include <cstdint>
#include <vector>

namespace flashgdn::reference {

struct Problem {
  int64_t B = 1, T = 0, Hq = 1, Hv = 1, K = 0, V = 0;
  std::vector<int64_t> cu_seqlens;  // empty: B dense sequences of T tokens; else B == 1
  double scale = 0.0;               // 0: 1 / sqrt(K)
  bool use_qk_l2norm = false;       // q / sqrt(sum q^2 + 1e-6), same for k
  bool gate_in_kernel = false;      // g = -exp(A_log[h]) * softplus(a + dt_bias[h])
  bool has_initial_state = false;
  int64_t checkpoint_every = 0;     // 0: none

  int64_t num_seqs() const;
  int64_t seq_begin(int64_t n) const;  // first token (within its batch row)
  int64_t seq_len(int64_t n) const;
  int64_t seq_batch(int64_t n) const;
  double resolved_scale() const;
  int64_t num_checkpoints() const;  // sum_n floor(len_n / checkpoint_every)
};

struct Inputs {
  std::vector<double> q, k, v, g, beta;
  std::vector<double> A_log, dt_bias;  // gate_in_kernel only (dt_bias may be empty: zero)
  std::vector<double> h0;              // has_initial_state only
};

struct Outputs {
  std::vector<double> o, ht, checkpoints;
};

struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta;
  std::vector<double> dA_log, ddt_bias;  // gate_in_kernel only
  std::vector<double> dh0;               // has_initial_state only
};

Outputs forward(const Problem& p, const Inputs& in);
// d_ht may be empty (zero).
Grads backward(const Problem& p, const Inputs& in, const std::vector<double>& d_o,
               const std::vector<double>& d_ht);

}  // namespace flashgdn::reference
