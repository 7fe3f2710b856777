// The CPU backend (csrc/cpu/, float32 chunked algorithm) through the public C++ API on host
// tensors, against the float64 oracle (reference/) run on the SAME storage-rounded inputs.
//
// Bound, per output tensor, on the relative L2 error ||x - ref|| / ||ref||:
//   kTolF32 (float32 arithmetic)  +  u(storage dtype of that output)
// where u is the unit roundoff of the dtype the output is stored in (0 for float32 outputs,
// 2^-8 for bf16, 2^-11 for fp16): storing a tensor in a dtype with unit roundoff u changes it by
// at most u in relative L2, so this bound is what float32 arithmetic plus the final rounding can
// give. For rounded outputs we additionally require the error against the oracle's output
// rounded the same way to stay below u / 4 (that catches a systematic error of size ~u that the
// first bound would let through). States (final, checkpoints, dh0) and dA_log / ddt_bias are
// always float32.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "gdn_reference.h"
#include "test_util.h"

namespace ft = flashgdn::test;
namespace ref = flashgdn::reference;

namespace {

constexpr double kTolF32 = 2e-5;
// dA_log, ddt_bias: sums over every token of a head whose terms cancel, which amplifies the
// per-token float32 error of dg by about the ratio sum|dg g| / |sum dg g|.
constexpr double kTolReduction = 5e-5;

// Largest error seen per (tensor, input dtype), printed once at the end.
ft::ErrorSummary& errors = ft::add_error_summary("CpuBackend");

// Checks one output tensor stored in `storage` against the oracle's float64 values.
void expect_close(const std::string& name, const std::string& what, fgdn_dtype in_dt,
                  const std::vector<double>& got, const std::vector<double>& want,
                  fgdn_dtype storage, double tol = kTolF32) {
  ASSERT_EQ(got.size(), want.size()) << name << ": " << what;
  const double u = storage == FGDN_FLOAT32 ? 0.0 : ft::unit_roundoff(storage);
  const double err = ft::rel_l2(got, want);
  if (std::getenv("FLASHGDN_TEST_VERBOSE"))
    std::printf("  %-28s %-12s %.3e\n", name.c_str(), what.c_str(), err);
  errors.record(what, in_dt, err, name);
  EXPECT_LE(err, tol + u) << name << ": " << what << " rel L2 error " << err;
  if (storage != FGDN_FLOAT32) {
    const double err_r = ft::rel_l2(got, ft::round_vec(want, storage));
    errors.record(what + " (" + flashgdn::dtype_name(in_dt) + ", vs rounded)", err_r, name);
    EXPECT_LE(err_r, u / 4) << name << ": " << what << " vs rounded oracle, rel L2 " << err_r;
  }
}

// Slice [n * len, (n + 1) * len) of x.
std::vector<double> slice(const std::vector<double>& x, int64_t n, int64_t len) {
  return std::vector<double>(x.begin() + n * len, x.begin() + (n + 1) * len);
}

void run_and_check(const ft::Spec& s) {
  ft::Case c(s);
  const int64_t N = s.N(), HKV = s.Hv * s.K * s.V;
  const std::vector<unsigned char> h0_before = c.h0.bytes;

  // ---- forward
  flashgdn::FwdArgs fa = c.fwd_args();
  ASSERT_NO_THROW(flashgdn::forward(fa)) << s.name;
  const ref::Outputs ro = ref::forward(c.rp, c.ri);
  expect_close(s.name, "o", s.dt, c.o.to_double(), ro.o, s.dt);
  if (s.final_state) {
    if (s.state_indices) {
      // the final state of sequence n is in pool row idx[n]; rows no sequence writes (and the
      // rows of sequences with a negative index) are bitwise unchanged
      const ft::PoolFinalStates p = ft::pool_final_states(c, ro.ht);
      expect_close(s.name, "ht", s.dt, p.got, p.want, FGDN_FLOAT32);
      ft::expect_unwritten_rows_unchanged(c, p.written, h0_before);
    } else {
      expect_close(s.name, "ht", s.dt, ft::state_dense(c.ht, N, s.Hv, s.K, s.V, s.v_first),
                   ro.ht, FGDN_FLOAT32);
    }
  }
  if (s.checkpoint_every > 0) {
    const int64_t R = c.num_checkpoints();
    expect_close(s.name, "checkpoints", s.dt, ft::state_dense(c.ck, R, s.Hv, s.K, s.V, s.v_first),
                 ro.checkpoints, FGDN_FLOAT32);
  }

  // ---- backward (from the original initial state)
  c.reset_initial_state();
  flashgdn::BwdArgs ba = c.bwd_args();
  ASSERT_NO_THROW(flashgdn::backward(ba)) << s.name;
  EXPECT_EQ(c.h0.bytes, h0_before) << s.name << ": backward modified the initial state";
  ref::Grads rg = ref::backward(c.rp, c.ri, c.d_o, c.d_ht);
  ft::zero_dh0_of_unindexed(c, rg);
  expect_close(s.name, "dq", s.dt, c.dq.to_double(), rg.dq, s.dt);
  expect_close(s.name, "dk", s.dt, c.dk.to_double(), rg.dk, s.dt);
  expect_close(s.name, "dv", s.dt, c.dv.to_double(), rg.dv, s.dt);
  expect_close(s.name, "dg", s.dt, c.dg.to_double(), rg.dg, s.g_dt);
  expect_close(s.name, "dbeta", s.dt, c.dbeta.to_double(), rg.dbeta, s.beta_dt);
  if (s.h0) {
    expect_close(s.name, "dh0", s.dt, ft::state_dense(c.dh0, N, s.Hv, s.K, s.V, s.v_first),
                 rg.dh0, FGDN_FLOAT32);
    if (s.state_indices) {  // a sequence with a negative index has zero dh0
      const auto dh0 = ft::state_dense(c.dh0, N, s.Hv, s.K, s.V, s.v_first);
      for (int64_t n = 0; n < N; ++n) {
        if (c.idx[static_cast<size_t>(n)] >= 0) continue;
        EXPECT_EQ(ft::rel_l2(slice(dh0, n, HKV), std::vector<double>(static_cast<size_t>(HKV))), 0.0)
            << s.name << ": dh0 of sequence " << n;
      }
    }
  }
  if (s.gate_in_kernel) {
    expect_close(s.name, "dA_log", s.dt, c.dA_log.to_double(), rg.dA_log, FGDN_FLOAT32,
                 kTolReduction);
    if (s.dt_bias)
      expect_close(s.name, "ddt_bias", s.dt, c.ddt_bias.to_double(), rg.ddt_bias, FGDN_FLOAT32,
                   kTolReduction);
  }
}

// ---- the parametrized cases ---------------------------------------------------------------

using ft::dense;
using ft::varlen;
using ft::with_states;

std::vector<ft::Spec> all_cases() {
  std::vector<ft::Spec> v;
  auto add = [&](ft::Spec s) {
    s.seed = 1000 + v.size();
    v.push_back(std::move(s));
  };
  const std::vector<int64_t> cu_edge = {0, 0, 1, 70, 70, 135, 200};  // empty, one-token, partial

  // sequence lengths around the chunk size, head counts {1, 2, 3, 4, 8}, K, V in {64, 128}
  add(with_states(dense("T0_B2_Hq1_Hv2_K64_V64", 2, 0, 1, 2, 64, 64)));
  add(with_states(dense("T1_B2_Hq1_Hv1_K64_V64", 2, 1, 1, 1, 64, 64)));
  add(with_states(dense("T17_B2_Hq2_Hv4_K64_V64", 2, 17, 2, 4, 64, 64)));
  add(dense("T63_Hq3_Hv3_K64_V64_nostate", 1, 63, 3, 3, 64, 64));
  add(with_states(dense("T64_Hq2_Hv8_K64_V64", 1, 64, 2, 8, 64, 64)));
  add(with_states(dense("T65_Hq4_Hv4_K128_V128", 1, 65, 4, 4, 128, 128)));
  add(with_states(dense("T130_Hq1_Hv2_K64_V128", 1, 130, 1, 2, 64, 128)));
  add(with_states(dense("T200_B2_Hq2_Hv2_K128_V64", 2, 200, 2, 2, 128, 64)));
  add(with_states(dense("T129_Hq1_Hv1_K128_V128", 1, 129, 1, 1, 128, 128)));
  {
    ft::Spec s = with_states(dense("T70_h0_only", 1, 70, 1, 2, 64, 64));
    s.dht = false;
    add(s);
    s = with_states(dense("T70_dht_only_no_final", 1, 70, 1, 2, 64, 64));
    s.h0 = false;
    s.final_state = false;
    add(s);
  }

  // varlen with zero-length and one-token sequences
  add(with_states(varlen("varlen_edge_Hq2_Hv4", cu_edge, 2, 4, 64, 64)));
  add(varlen("varlen_edge_nostate", cu_edge, 1, 3, 64, 64));
  add(with_states(varlen("varlen_K128_V64", {0, 1, 129, 130, 131}, 1, 2, 128, 64)));

  // gates: exactly 0, strongly decaying, both kinds of head in one call
  for (auto [name, gate] : {std::pair{"gate_zero", ft::Gate::Zero},
                            std::pair{"gate_strong", ft::Gate::Strong},
                            std::pair{"gate_mixed", ft::Gate::Mixed}}) {
    ft::Spec s = with_states(dense(std::string(name) + "_T150", 1, 150, 2, 4, 64, 64));
    s.gate = gate;
    add(s);
  }

  {  // custom scale
    ft::Spec s = with_states(dense("scale_0p37", 1, 100, 1, 2, 64, 64));
    s.scale = 0.37;
    add(s);
  }
  {  // l2norm in kernel
    ft::Spec s = with_states(varlen("l2norm_varlen", cu_edge, 2, 4, 64, 64));
    s.l2norm = true;
    add(s);
    s = with_states(dense("l2norm_K128_V64", 1, 90, 1, 1, 128, 64));
    s.l2norm = true;
    add(s);
  }
  {  // gate in kernel, with and without dt_bias
    ft::Spec s = with_states(varlen("gate_in_kernel_varlen", cu_edge, 2, 4, 64, 64));
    s.gate_in_kernel = true;
    add(s);
    s = with_states(dense("gate_in_kernel_no_dt_bias", 2, 80, 1, 3, 64, 64));
    s.gate_in_kernel = true;
    s.dt_bias = false;
    add(s);
  }
  {  // state pool with permuted rows and one negative index
    ft::Spec s = with_states(varlen("state_indices", cu_edge, 1, 2, 64, 64));
    s.state_indices = true;
    add(s);
  }
  {  // [.., V, K] states with K != V
    ft::Spec s = with_states(dense("v_first_K64_V128", 1, 130, 1, 2, 64, 128));
    s.v_first = true;
    add(s);
  }
  {  // checkpoints every 64 and every 128 tokens
    ft::Spec s = with_states(dense("checkpoints_64", 2, 200, 1, 2, 64, 64));
    s.checkpoint_every = 64;
    add(s);
    s = with_states(varlen("checkpoints_128_varlen", {0, 1, 129, 300, 300, 428}, 1, 2, 64, 64));
    s.checkpoint_every = 128;
    add(s);
  }
  {  // non-contiguous strides on every input
    ft::Spec s = with_states(dense("strided_inputs", 2, 70, 2, 4, 64, 64));
    s.strided = true;
    add(s);
  }
  {  // everything at once
    ft::Spec s = with_states(varlen("all_options", {0, 0, 1, 65, 200, 330}, 2, 4, 64, 128));
    s.state_indices = true;
    s.v_first = true;
    s.checkpoint_every = 64;
    s.l2norm = true;
    s.gate_in_kernel = true;
    s.scale = 0.2;
    s.strided = true;
    s.cu_dt = FGDN_INT32;
    s.idx_dt = FGDN_INT64;
    add(s);
  }

  // bf16 / fp16 storage (the oracle sees the same rounded inputs)
  {
    ft::Spec s = with_states(dense("bf16_T130_Hq2_Hv4", 1, 130, 2, 4, 64, 64));
    s.dt = FGDN_BFLOAT16;
    add(s);
    s = with_states(varlen("bf16_gbeta_bf16_l2norm_gik", cu_edge, 2, 4, 64, 64));
    s.dt = s.g_dt = s.beta_dt = FGDN_BFLOAT16;
    s.l2norm = true;
    s.gate_in_kernel = true;
    add(s);
    s = with_states(varlen("bf16_K128_V64_pool_vfirst", cu_edge, 1, 2, 128, 64));
    s.dt = s.beta_dt = FGDN_BFLOAT16;
    s.state_indices = true;
    s.v_first = true;
    s.checkpoint_every = 64;
    s.l2norm = true;
    add(s);
    s = with_states(dense("fp16_T65_Hq1_Hv2", 1, 65, 1, 2, 64, 64));
    s.dt = FGDN_FLOAT16;
    s.l2norm = true;
    add(s);
  }
  return v;
}

class CpuBackendCase : public ::testing::TestWithParam<ft::Spec> {};

TEST_P(CpuBackendCase, MatchesFloat64Oracle) { run_and_check(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cpu, CpuBackendCase, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<ft::Spec>& i) { return i.param.name; });

// ---- thread-count invariance ----------------------------------------------------------------

struct EnvThreads {
  std::string old;
  bool had = false;
  EnvThreads() {
    if (const char* s = std::getenv("FLASHGDN_NUM_THREADS")) {
      had = true;
      old = s;
    }
  }
  void set(int n) { setenv("FLASHGDN_NUM_THREADS", std::to_string(n).c_str(), 1); }
  ~EnvThreads() {
    if (had) setenv("FLASHGDN_NUM_THREADS", old.c_str(), 1);
    else unsetenv("FLASHGDN_NUM_THREADS");
  }
};

// Every output of forward and backward, as raw bytes.
std::vector<std::vector<unsigned char>> run_all_bytes(const ft::Spec& s) {
  ft::Case c(s);
  flashgdn::FwdArgs fa = c.fwd_args();
  flashgdn::forward(fa);
  std::vector<std::vector<unsigned char>> out = {c.o.bytes, c.ht.bytes, c.ck.bytes, c.h0.bytes};
  c.reset_initial_state();
  flashgdn::BwdArgs ba = c.bwd_args();
  flashgdn::backward(ba);
  for (auto* b : {&c.dq, &c.dk, &c.dv, &c.dg, &c.dbeta, &c.dA_log, &c.ddt_bias, &c.dh0})
    out.push_back(b->bytes);
  return out;
}

TEST(CpuBackend, BitwiseIdenticalAcrossThreadCounts) {
  ft::Spec s = varlen("threads", {0, 0, 1, 65, 200, 330}, 2, 6, 64, 64);
  s.h0 = s.dht = true;
  s.gate_in_kernel = true;
  s.l2norm = true;
  s.checkpoint_every = 64;
  ft::Spec s_pool = s;
  s_pool.state_indices = true;
  for (const ft::Spec& spec : {s, s_pool}) {
    EnvThreads env;
    env.set(1);
    const auto base = run_all_bytes(spec);
    for (int n : {2, 3, 5, 16}) {
      env.set(n);
      const auto other = run_all_bytes(spec);
      ASSERT_EQ(base.size(), other.size());
      for (size_t i = 0; i < base.size(); ++i)
        EXPECT_TRUE(base[i] == other[i]) << "output " << i << " differs with " << n << " threads"
                                         << (spec.state_indices ? " (pool)" : "");
    }
  }
}

// ---- the comparisons can fail: a slightly different problem is detected -------------------------

TEST(CpuBackend, ComparisonDetectsSmallPerturbation) {
  ft::Spec s = dense("perturbed", 1, 100, 1, 2, 64, 64);
  s.h0 = s.dht = true;
  ft::Case c(s);
  flashgdn::FwdArgs fa = c.fwd_args();
  flashgdn::forward(fa);
  ref::Inputs pert = c.ri;
  for (auto& b : pert.beta) b *= 1.001;  // beta off by 0.1%
  ref::Problem rp = c.rp;
  const ref::Outputs ro = ref::forward(rp, pert);
  EXPECT_GT(ft::rel_l2(c.o.to_double(), ro.o), 4 * kTolF32);
  rp.scale = 1.001 / 8.0;  // scale off by 0.1%
  const ref::Outputs ro2 = ref::forward(rp, c.ri);
  EXPECT_GT(ft::rel_l2(c.o.to_double(), ro2.o), 4 * kTolF32);
}

}  // namespace
