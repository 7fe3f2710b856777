// The CPU backend against the float64 oracle (run on the SAME storage-rounded inputs): one
// forward and one backward of a Case through the public C++ API, every output compared.
//
// Bound, per output tensor, on the relative L2 error ||x - ref|| / ||ref||:
//   kTolF32 (float32 arithmetic)  +  u(storage dtype of that output)
// where u is the unit roundoff of the dtype the output is stored in (0 for float32 outputs,
// 2^-8 for bf16, 2^-11 for fp16): storing a tensor in a dtype with unit roundoff u changes it by
// at most u in relative L2, so this bound is what float32 arithmetic plus the final rounding can
// give. For rounded outputs we additionally require the error against the oracle's output
// rounded the same way to stay below u / 4 (that catches a systematic error of size ~u that the
// first bound would let through). The final state and dh0 are stored in their Spec dtypes
// (fp32, or bf16 / fp16: then the state is rounded once, on store, and the same two bounds
// apply with that dtype's u); checkpoints and dA_log / ddt_bias are always float32.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "gdn_reference.h"
#include "test_util.h"

namespace flashgdn::test {

constexpr double kTolF32 = 2e-5;
// dA_log, ddt_bias: sums over every token of a head whose terms cancel, which amplifies the
// per-token float32 error of dg by about the ratio sum|dg g| / |sum dg g|.
constexpr double kTolReduction = 5e-5;

// Checks one output tensor of case `name` stored in `storage` against the oracle's values.
inline void expect_close_cpu(ErrorSummary& errors, const std::string& name,
                             const std::string& what, fgdn_dtype in_dt,
                             const std::vector<double>& got, const std::vector<double>& want,
                             fgdn_dtype storage, double tol = kTolF32) {
  ASSERT_EQ(got.size(), want.size()) << name << ": " << what;
  const double u = storage == FGDN_FLOAT32 ? 0.0 : unit_roundoff(storage);
  const double err = rel_l2(got, want);
  if (std::getenv("FLASHGDN_TEST_VERBOSE"))
    std::printf("  %-28s %-12s %.3e\n", name.c_str(), what.c_str(), err);
  errors.record(what, in_dt, err, name);
  EXPECT_LE(err, tol + u) << name << ": " << what << " rel L2 error " << err;
  if (storage != FGDN_FLOAT32) {
    const double err_r = rel_l2(got, round_vec(want, storage));
    errors.record(what + " (" + dtype_name(in_dt) + ", vs rounded)", err_r, name);
    EXPECT_LE(err_r, u / 4) << name << ": " << what << " vs rounded oracle, rel L2 " << err_r;
  }
}

// Slice [n * len, (n + 1) * len) of x.
inline std::vector<double> slice(const std::vector<double>& x, int64_t n, int64_t len) {
  return std::vector<double>(x.begin() + n * len, x.begin() + (n + 1) * len);
}

// Forward and backward of c on the CPU backend, every output against the oracle; the errors are
// recorded in `errors`.
inline void expect_cpu_matches_oracle(Case& c, ErrorSummary& errors) {
  const Spec& s = c.s;
  const int64_t N = s.N(), HKV = s.Hv * s.K * s.V;
  const std::vector<unsigned char> h0_before = c.h0.bytes;
  auto close = [&](const std::string& what, const std::vector<double>& got,
                   const std::vector<double>& want, fgdn_dtype storage, double tol = kTolF32) {
    expect_close_cpu(errors, s.name, what, s.dt, got, want, storage, tol);
  };
  auto states = [&](const HostBuffer& b, int64_t rows) {
    return state_dense(b, rows, s.Hv, s.K, s.V, s.v_first);
  };
  // A state output's key names its storage dtype when it is not float32.
  auto state_key = [](const std::string& what, fgdn_dtype dt) {
    return dt == FGDN_FLOAT32 ? what : what + "[" + dtype_name(dt) + "]";
  };

  // ---- forward
  FwdArgs fa = c.fwd_args();
  ASSERT_NO_THROW(flashgdn::forward(fa)) << s.name;
  const reference::Outputs ro = reference::forward(c.rp, c.ri);
  close("o", c.o.to_double(), ro.o, s.dt);
  if (s.final_state) {
    if (s.state_indices) {
      // the final state of sequence n is in pool row idx[n]; rows no sequence writes (and the
      // rows of sequences with a negative index) are bitwise unchanged
      const PoolFinalStates p = pool_final_states(c, ro.ht);
      close(state_key("ht", s.h0_dt), p.got, p.want, s.h0_dt);  // the pool's dtype
      expect_unwritten_rows_unchanged(c, p.written, h0_before);
    } else {
      close(state_key("ht", s.ht_dt), states(c.ht, N), ro.ht, s.ht_dt);
    }
  }
  if (s.checkpoint_every > 0)
    close("checkpoints", states(c.ck, c.num_checkpoints()), ro.checkpoints, FGDN_FLOAT32);

  // ---- backward (from the original initial state)
  c.reset_initial_state();
  BwdArgs ba = c.bwd_args();
  ASSERT_NO_THROW(flashgdn::backward(ba)) << s.name;
  EXPECT_EQ(c.h0.bytes, h0_before) << s.name << ": backward modified the initial state";
  reference::Grads rg = reference::backward(c.rp, c.ri, c.d_o, c.d_ht);
  zero_dh0_of_unindexed(c, rg);
  close("dq", c.dq.to_double(), rg.dq, s.dt);
  close("dk", c.dk.to_double(), rg.dk, s.dt);
  close("dv", c.dv.to_double(), rg.dv, s.dt);
  close("dg", c.dg.to_double(), rg.dg, s.g_dt);
  close("dbeta", c.dbeta.to_double(), rg.dbeta, s.beta_dt);
  if (s.h0) {
    const std::vector<double> dh0 = states(c.dh0, N);
    close(state_key("dh0", s.dh0_dt), dh0, rg.dh0, s.dh0_dt);
    if (s.state_indices) {  // a sequence with a negative index has zero dh0
      for (int64_t n = 0; n < N; ++n) {
        if (c.idx[static_cast<size_t>(n)] >= 0) continue;
        EXPECT_EQ(rel_l2(slice(dh0, n, HKV), std::vector<double>(static_cast<size_t>(HKV))), 0.0)
            << s.name << ": dh0 of sequence " << n;
      }
    }
  }
  if (s.gate_in_kernel) {
    close("dA_log", c.dA_log.to_double(), rg.dA_log, FGDN_FLOAT32, kTolReduction);
    if (s.dt_bias)
      close("ddt_bias", c.ddt_bias.to_double(), rg.ddt_bias, FGDN_FLOAT32, kTolReduction);
  }
}

}  // namespace flashgdn::test
