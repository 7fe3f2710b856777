// The CPU backend (csrc/cpu/, float32 chunked algorithm) through the public C++ API on host
// tensors, against the float64 oracle (reference/) run on the SAME storage-rounded inputs, with
// the bounds of cpu_check.h.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "gdn_reference.h"
#include "cpu_check.h"
#include "test_util.h"

namespace ft = flashgdn::test;
namespace ref = flashgdn::reference;

namespace {

using ft::kTolF32;

// Largest error seen per (tensor, input dtype), printed once at the end.
ft::ErrorSummary& errors = ft::add_error_summary("CpuBackend");

void run_and_check(const ft::Spec& s) {
  ft::Case c(s);
  ft::expect_cpu_matches_oracle(c, errors);
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
    // fp16 g and beta (FLA accepts them; dg and dbeta in the same dtypes)
    s = with_states(varlen("fp16_gbeta_bf16_qkv", cu_edge, 2, 4, 64, 32));
    s.dt = FGDN_BFLOAT16;
    s.g_dt = s.beta_dt = FGDN_FLOAT16;
    add(s);
    s = with_states(dense("fp16_gbeta_fp16_qkv_gik", 2, 100, 1, 2, 32, 64));
    s.dt = s.g_dt = s.beta_dt = FGDN_FLOAT16;
    s.gate_in_kernel = true;
    add(s);
  }

  // States in bf16 / fp16 (initial, final, d_final_state, dh0), each in its own dtype: read
  // exactly, rounded once on store (the oracle sees the same rounded inputs)
  for (fgdn_dtype sdt : {FGDN_BFLOAT16, FGDN_FLOAT16}) {
    const std::string d = sdt == FGDN_BFLOAT16 ? "bf16" : "fp16";
    add(ft::with_state_dtype(with_states(dense("state_" + d + "_T130_Hq2_Hv4", 1, 130, 2, 4, 64, 64)), sdt));
    add(ft::with_state_dtype(with_states(dense("state_" + d + "_T0", 2, 0, 1, 2, 64, 64)), sdt));
    ft::Spec s = ft::with_state_dtype(with_states(varlen("state_" + d + "_varlen_edge_qkv_bf16", cu_edge, 2, 4, 64, 128)), sdt);
    s.dt = FGDN_BFLOAT16;
    s.l2norm = true;
    s.gate_in_kernel = true;
    add(s);
    // a pool in the state dtype, V-major ([P, Hv, V, K], vLLM's layout), K != V, read and
    // written in place; checkpoints stay float32
    s = ft::with_state_dtype(with_states(varlen("pool_" + d + "_vfirst_K128_V64", cu_edge, 1, 2, 128, 64)), sdt);
    s.dt = FGDN_BFLOAT16;
    s.state_indices = true;
    s.v_first = true;
    s.checkpoint_every = 64;
    add(s);
  }
  {  // every state tensor in a different dtype
    ft::Spec s = with_states(dense("state_mixed_dtypes", 2, 100, 1, 2, 64, 64));
    s.h0_dt = FGDN_BFLOAT16;
    s.ht_dt = FGDN_FLOAT32;
    s.dht_dt = FGDN_FLOAT16;
    s.dh0_dt = FGDN_FLOAT32;
    add(s);
    s.name = "state_mixed_dtypes_2";
    s.h0_dt = FGDN_FLOAT32;
    s.ht_dt = FGDN_FLOAT16;
    s.dht_dt = FGDN_BFLOAT16;
    s.dh0_dt = FGDN_BFLOAT16;
    s.v_first = true;
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
