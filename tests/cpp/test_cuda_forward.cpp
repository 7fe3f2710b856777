// The CUDA forward (csrc/sm90/) through the public C++ API on device tensors, against the
// float64 oracle (reference/) run on the same storage-rounded inputs, with the bounds of
// cuda_check.h. Skips without a device.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda_check.h"
#include "flashgdn/flashgdn.hpp"
#include "test_util.h"

namespace ft = flashgdn::test;

namespace {

using ft::have_cuda_device;

#ifdef FLASHGDN_WITH_CUDA

ft::ErrorSummary& errors = ft::add_error_summary("CudaForward", 34);

void run_and_check(const ft::Spec& s, bool pass_host_seqlens = true) {
  ft::Case c(s);
  ft::expect_cuda_forward_matches_oracle(c, errors, pass_host_seqlens);
}

// ---- cases -----------------------------------------------------------------------------------

using ft::dense_d;
using ft::varlen_d;
using ft::with_h0;

std::vector<ft::Spec> all_cases() {
  std::vector<ft::Spec> v;
  auto add = [&](ft::Spec s) {
    s.seed = 5000 + v.size();
    v.push_back(std::move(s));
  };
  const std::vector<int64_t> cu_edge = {0, 0, 1, 70, 70, 135, 200, 263};

  // sequence lengths around the chunk size
  for (int64_t T : {1, 63, 64, 65, 1000}) {
    add(with_h0(dense_d("bf16_T" + std::to_string(T) + "_Hq2_Hv8_D128", 1, T, 2, 8, 128)));
    add(with_h0(dense_d("fp16_T" + std::to_string(T) + "_Hq2_Hv4_D64", 2, T, 2, 4, 64,
                      FGDN_FLOAT16)));
  }
  add(dense_d("bf16_T4096_Hq2_Hv8_D128_nostate", 1, 4096, 2, 8, 128));
  add(with_h0(dense_d("fp16_T4096_Hq1_Hv2_D64", 1, 4096, 1, 2, 64, FGDN_FLOAT16)));
  // GVA configurations
  add(with_h0(dense_d("bf16_gva_16_64_T300_D128", 1, 300, 16, 64, 128)));
  add(with_h0(dense_d("bf16_gva_32_32_T200_D64", 1, 200, 32, 32, 64)));
  add(with_h0(dense_d("fp16_gva_3_3_T130_D128", 1, 130, 3, 3, 128, FGDN_FLOAT16)));
  // Hv = 6 (Qwen3.5 at TP 8): g and beta rows are 24 bytes, not a multiple of 16.
  add(with_h0(dense_d("bf16_gva_2_6_B2_T300_D128", 2, 300, 2, 6, 128)));
  // varlen with zero-length and one-token sequences
  add(with_h0(varlen_d("bf16_varlen_edge_D64", cu_edge, 2, 4, 64)));
  add(with_h0(varlen_d("fp16_varlen_edge_D128", cu_edge, 1, 3, 128, FGDN_FLOAT16)));
  add(varlen_d("bf16_varlen_long_D128", {0, 1, 1000, 1000, 2100, 2164}, 2, 8, 128));
  // gates and options
  for (auto [nm, gate] : {std::pair{"zero", ft::Gate::Zero}, std::pair{"strong", ft::Gate::Strong},
                          std::pair{"mixed", ft::Gate::Mixed}}) {
    ft::Spec s = with_h0(dense_d(std::string("bf16_gate_") + nm + "_T300", 1, 300, 2, 4, 64));
    s.gate = gate;
    add(s);
  }
  {
    ft::Spec s = with_h0(varlen_d("bf16_l2norm_varlen_D128", cu_edge, 2, 4, 128));
    s.l2norm = true;
    add(s);
    s = with_h0(dense_d("fp16_l2norm_D64_T500", 2, 500, 1, 4, 64, FGDN_FLOAT16));
    s.l2norm = true;
    add(s);
  }
  {
    ft::Spec s = with_h0(varlen_d("bf16_gate_in_kernel_varlen", cu_edge, 2, 4, 64));
    s.gate_in_kernel = true;
    s.g_dt = s.beta_dt = FGDN_BFLOAT16;
    add(s);
    s = with_h0(dense_d("fp16_gate_in_kernel_no_dt_bias", 2, 200, 1, 3, 128, FGDN_FLOAT16));
    s.gate_in_kernel = true;
    s.dt_bias = false;
    add(s);
    s = with_h0(varlen_d("bf16_fp16_gates_varlen", cu_edge, 2, 4, 64));
    s.g_dt = s.beta_dt = FGDN_FLOAT16;
    add(s);
  }
  {
    ft::Spec s = with_h0(varlen_d("bf16_state_indices_D128", cu_edge, 1, 2, 128));
    s.state_indices = true;
    add(s);
    s = with_h0(varlen_d("fp16_state_indices_vfirst_D64", cu_edge, 2, 2, 64, FGDN_FLOAT16));
    s.state_indices = true;
    s.v_first = true;
    add(s);
  }
  {
    ft::Spec s = with_h0(dense_d("bf16_v_first_D128", 2, 150, 1, 2, 128));
    s.v_first = true;
    add(s);
  }
  // Dense batches of more (sequence, value head) units than a GPU has SMs (512 and 480, over 3x
  // 148), so that a persistent grid walks several items a CTA (fwd_launch.cu,
  // kPersistentDenseBatches): states read and written between items, partial last chunks,
  // checkpoints, a bf16 state as vLLM's pools keep it.
  add(with_h0(dense_d("bf16_dense_many_items_D128", 16, 130, 8, 32, 128)));
  {
    ft::Spec s = with_h0(dense_d("fp16_dense_many_items_D64", 15, 200, 4, 32, 64, FGDN_FLOAT16));
    s.h0_dt = s.ht_dt = FGDN_BFLOAT16;
    s.checkpoint_every = 64;
    add(s);
  }
  {
    ft::Spec s = with_h0(dense_d("bf16_checkpoints_64_D64", 2, 200, 1, 2, 64));
    s.checkpoint_every = 64;
    add(s);
    s = with_h0(
        varlen_d("bf16_checkpoints_128_varlen_D128", {0, 1, 129, 300, 300, 428}, 1, 2, 128));
    s.checkpoint_every = 128;
    add(s);
  }
  {
    ft::Spec s = with_h0(varlen_d("bf16_all_options_D128", {0, 0, 1, 65, 200, 330}, 2, 4, 128));
    s.state_indices = true;
    s.v_first = true;
    s.checkpoint_every = 64;
    s.l2norm = true;
    s.gate_in_kernel = true;
    s.scale = 0.2;
    add(s);
    s.name = "fp16_all_options_D64";
    s.dt = FGDN_FLOAT16;
    s.K = s.V = 64;
    add(s);
  }
  // precision = high: the same kernels with split operands, at the rounding floor
  {
    ft::Spec s = with_h0(varlen_d("bf16_high_all_options_D128", {0, 0, 1, 65, 200, 330}, 2, 4, 128));
    s.precision = FGDN_PRECISION_HIGH;
    s.state_indices = true;
    s.checkpoint_every = 64;
    s.l2norm = true;
    s.gate_in_kernel = true;
    add(s);
    s = with_h0(dense_d("fp16_high_T1000_Hq2_Hv4_D64", 2, 1000, 2, 4, 64, FGDN_FLOAT16));
    s.precision = FGDN_PRECISION_HIGH;
    add(s);
    s = with_h0(dense_d("bf16_high_gva_16_64_T300_D128", 1, 300, 16, 64, 128));
    s.precision = FGDN_PRECISION_HIGH;
    add(s);
    s = with_h0(dense_d("bf16_fast_T1000_Hq2_Hv8_D128", 1, 1000, 2, 8, 128));
    s.precision = FGDN_PRECISION_FAST;
    add(s);
  }
  // States in bf16 / fp16: initial and final state, a pool (V-major, vLLM's layout) read and
  // written in place, each in its own dtype; checkpoints float32 beside them
  for (fgdn_dtype sdt : {FGDN_BFLOAT16, FGDN_FLOAT16}) {
    const std::string d = sdt == FGDN_BFLOAT16 ? "bf16" : "fp16";
    ft::Spec s = ft::with_state_dtype(with_h0(dense_d("bf16_state_" + d + "_T1000_Hq2_Hv8_D128", 1, 1000, 2, 8, 128)), sdt);
    add(s);
    s = ft::with_state_dtype(with_h0(varlen_d("bf16_pool_" + d + "_vfirst_D128", cu_edge, 2, 4, 128)), sdt);
    s.state_indices = true;
    s.v_first = true;
    s.checkpoint_every = 64;
    add(s);
    s = ft::with_state_dtype(with_h0(varlen_d("fp16_pool_" + d + "_vfirst_D64_high", cu_edge, 1, 2, 64, FGDN_FLOAT16)), sdt);
    s.state_indices = true;
    s.v_first = true;
    s.precision = FGDN_PRECISION_HIGH;
    add(s);
  }
  {
    ft::Spec s = with_h0(dense_d("bf16_h0_bf16_ht_fp32_D64", 2, 300, 2, 4, 64));
    s.h0_dt = FGDN_BFLOAT16;
    add(s);
    s = with_h0(dense_d("bf16_h0_fp32_ht_fp16_high_D128", 1, 300, 1, 2, 128));
    s.ht_dt = FGDN_FLOAT16;
    s.precision = FGDN_PRECISION_HIGH;
    add(s);
  }
  return v;
}

// Context parallelism (csrc/sm90/fwd_context_parallel.h) forced on, with segments short enough
// that these shapes split: exact segments (g = 0 heads), warm-up segments (decaying heads, keys
// normalised in the kernel or before the call: unit keys), gates just either side of the certificate, pools, checkpoints, varlen
// packs where some sequences split and others do not, and the cost model's own choice.
std::vector<ft::Spec> cp_cases() {
  std::vector<ft::Spec> v;
  auto add = [&](ft::Spec s, int64_t segment) {
    s.context_parallel = FGDN_CONTEXT_PARALLEL_ON;
    s.cp_segment = segment;
    s.seed = 7000 + v.size();
    v.push_back(std::move(s));
  };
  for (fgdn_precision prec : {FGDN_PRECISION_DEFAULT, FGDN_PRECISION_HIGH}) {
    const std::string tag = prec == FGDN_PRECISION_HIGH ? "_high" : "";
    ft::Spec s = with_h0(dense_d("cp_bf16_T1000_Hv8_D128_l2" + tag, 1, 1000, 2, 8, 128));
    s.l2norm = true;  // realistic gates: head 0 exact, the others warm-up
    s.precision = prec;
    add(s, 128);
    s = with_h0(dense_d("cp_bf16_T1000_Hv8_D128_prenormalized" + tag, 1, 1000, 2, 8, 128));
    s.precision = prec;  // unit keys, no l2norm: certified from the keys' norms (head 0 exact)
    add(s, 192);
  }
  {
    ft::Spec s = with_h0(dense_d("cp_fp16_B2_T700_Hv4_D64_ckpt", 2, 700, 2, 4, 64, FGDN_FLOAT16));
    s.l2norm = true;
    s.checkpoint_every = 128;
    add(s, 64);
  }
  for (auto [nm, gate] : {std::pair{"zero", ft::Gate::Zero}, std::pair{"mixed", ft::Gate::Mixed}}) {
    ft::Spec s = with_h0(dense_d(std::string("cp_gate_") + nm + "_D128", 1, 640, 2, 4, 128));
    s.gate = gate;
    s.l2norm = true;
    add(s, 128);
  }
  // One chunk's summed gate is 64 g: the certificate needs <= -16, so g = -0.2501 certifies a
  // one-chunk warm-up and g = -0.2499 does not (segments of one chunk: the exact path).
  for (auto [nm, g] : {std::pair{"below", -0.2501}, std::pair{"above", -0.2499}}) {
    ft::Spec s = with_h0(dense_d(std::string("cp_bound_") + nm + "_D128", 1, 640, 2, 4, 128));
    s.gate = ft::Gate::Constant;
    s.gate_value = g;
    s.l2norm = true;
    add(s, 64);
  }
  {
    ft::Spec s = with_h0(varlen_d("cp_varlen_pool_vfirst_D128", {0, 1, 300, 300, 1100, 1164, 1500}, 2, 4, 128));
    s.l2norm = true;
    s.state_indices = true;
    s.v_first = true;
    s.h0_dt = FGDN_BFLOAT16;
    add(s, 128);
    s = with_h0(varlen_d("cp_varlen_gate_in_kernel_D64", {0, 70, 70, 900, 1000}, 2, 4, 64));
    s.l2norm = true;
    s.gate_in_kernel = true;
    s.checkpoint_every = 64;
    add(s, 128);
  }
  // The plan kernel's cost model picks the segment length (few chains: it splits), from the
  // coarse set here (the host's lengths: cp_fine_pays; the fine set runs in
  // ContextParallelFineSetWithoutHostSeqlens below).
  ft::Spec s = with_h0(dense_d("cp_auto_bf16_T4096_Hv2_D128", 1, 4096, 1, 2, 128));
  s.l2norm = true;
  add(s, 0);
  // The same in a varlen pack: a one-token and a short sequence unsplit beside long ones.
  s = with_h0(varlen_d("cp_auto_varlen_bf16_Hv2_D128", {0, 1, 3001, 3101, 3801}, 1, 2, 128));
  s.l2norm = true;
  add(s, 0);
  // The correction of exact segments (cp_correct.cu) at fp16 and at D = 64, and with the gate in
  // the kernel: `fast` without checkpoints (the cases above with checkpoints walk again).
  s = with_h0(dense_d("cp_fp16_B2_T700_Hv4_D64_corrected", 2, 700, 2, 4, 64, FGDN_FLOAT16));
  s.l2norm = true;
  add(s, 64);
  s = with_h0(varlen_d("cp_varlen_gate_in_kernel_D64_corrected", {0, 70, 70, 900, 1000}, 2, 4, 64));
  s.l2norm = true;
  s.gate_in_kernel = true;
  add(s, 128);
  return v;
}

class CudaForwardCase : public ::testing::TestWithParam<ft::Spec> {};

TEST_P(CudaForwardCase, MatchesFloat64Oracle) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  run_and_check(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaForwardCase, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<ft::Spec>& i) { return i.param.name; });
INSTANTIATE_TEST_SUITE_P(CudaCP, CudaForwardCase, ::testing::ValuesIn(cp_cases()),
                         [](const ::testing::TestParamInfo<ft::Spec>& i) { return i.param.name; });

// CP forced on and off on the same inputs: o and the final state agree within the forward's
// bound (both are also checked against the oracle above).
TEST(CudaForward, ContextParallelOnMatchesOff) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = with_h0(varlen_d("cp_on_off", {0, 100, 2000, 2064, 3000}, 2, 8, 128));
  s.l2norm = true;
  s.seed = 7100;
  std::vector<double> o[2], ht[2];
  for (int on = 0; on < 2; ++on) {
    s.context_parallel = on ? FGDN_CONTEXT_PARALLEL_ON : FGDN_CONTEXT_PARALLEL_OFF;
    s.cp_segment = on ? 256 : 0;
    ft::Case c(s);
    flashgdn::FwdArgs fa = c.fwd_args();
    ASSERT_NO_FATAL_FAILURE(ft::run_forward_on_device(c, fa));
    o[on] = c.o.to_double();
    ht[on] = c.ht.to_double();
  }
  EXPECT_LE(ft::rel_l2(o[1], o[0]), ft::kCudaFwdTol);
  EXPECT_LE(ft::rel_l2(ht[1], ht[0]), ft::kCudaFwdTol);
  EXPECT_NE(o[0], o[1]) << "CP on gave the same bits as off: it did not split";
}

// The fine candidate set (boundaries every L_min / 4 chunks, a window reading the sums of the
// boundaries before its own): what a varlen call runs when the host has no lengths to choose the
// set from (cp_layout). Each sequence's boundaries start at its own first grain.
TEST(CudaForward, ContextParallelFineSetWithoutHostSeqlens) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = with_h0(varlen_d("cp_fine_varlen_device_only", {0, 1, 3001, 3101, 3801, 6001}, 1, 2, 128));
  s.l2norm = true;
  s.context_parallel = FGDN_CONTEXT_PARALLEL_ON;
  s.seed = 7200;
  run_and_check(s, /*pass_host_seqlens=*/false);
}

// cu_seqlens read back from the device (no host copy given).
TEST(CudaForward, VarlenWithoutHostSeqlens) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = with_h0(varlen_d("varlen_device_only", {0, 0, 1, 70, 70, 135}, 2, 4, 64));
  s.checkpoint_every = 64;
  run_and_check(s, /*pass_host_seqlens=*/false);
}

// Same inputs 100 times: bitwise identical outputs (no races): `fast` without CP, and through
// CP's launches at both precision levels (`fast` corrects the exact segments' outputs, `high`
// walks them again).
TEST(CudaForward, Deterministic) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  for (int config = 0; config < 3; ++config) {
    const fgdn_precision prec = config == 2 ? FGDN_PRECISION_HIGH : FGDN_PRECISION_DEFAULT;
    ft::Spec s = with_h0(varlen_d("det", {0, 5, 200, 300, 1000}, 2, 4, 128));
    s.precision = prec;
    if (config > 0) {
      s.l2norm = true;
      s.context_parallel = FGDN_CONTEXT_PARALLEL_ON;
      s.cp_segment = 128;
    }
    ft::Case c(s);
    std::vector<unsigned char> first;
    for (int rep = 0; rep < 100; ++rep) {
      // the inputs, o and the final state; no host copy of cu_seqlens
      flashgdn::FwdArgs fa = c.fwd_args();
      ASSERT_NO_FATAL_FAILURE(ft::run_forward_on_device(c, fa, /*pass_host_seqlens=*/false));
      std::vector<unsigned char> all = c.o.bytes;
      all.insert(all.end(), c.ht.bytes.begin(), c.ht.bytes.end());
      if (rep == 0) first = all;
      else ASSERT_EQ(first, all) << "run " << rep << " differs from run 0 (configuration " << config << ")";
    }
  }
}

#else  // !FLASHGDN_WITH_CUDA

TEST(CudaForward, Skipped) { GTEST_SKIP() << "no CUDA device (built without CUDA)"; }

#endif

}  // namespace
