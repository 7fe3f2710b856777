// The CUDA backward through the public C++ API on device tensors, against the float64 oracle
// (reference/) run on the SAME storage-rounded inputs, with the bounds of cuda_check.h (outputs
// are poisoned with NaN before the call). Skips when no CUDA device is present. Also: bitwise
// identical results over runs, and a sequence's gradients do not depend on what else is packed
// in the batch.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_check.h"
#include "flashgdn/flashgdn.hpp"
#include "test_util.h"

namespace ft = flashgdn::test;

namespace {

using ft::have_cuda_device;

#if defined(FLASHGDN_WITH_CUDA)

ft::ErrorSummary& errors = ft::add_error_summary("CudaBackward");

void run_and_check(const ft::Spec& s) {
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  ft::Case c(s);
  ft::expect_cuda_backward_matches_oracle(c, errors);
}

#endif  // FLASHGDN_WITH_CUDA

using ft::dense_d;
using ft::varlen_d;
using ft::with_states;

std::vector<ft::Spec> all_cases() {
  std::vector<ft::Spec> v;
  auto add = [&](ft::Spec s) {
    s.seed = 7000 + v.size();
    v.push_back(std::move(s));
  };
  const std::vector<int64_t> cu_edge = {0, 0, 1, 70, 70, 135, 200, 264};  // empty, one-token, ...

  add(with_states(dense_d("T1_B2_Hq1_Hv1_D64", 2, 1, 1, 1, 64)));
  add(dense_d("T63_Hq3_Hv3_D64_fp16", 1, 63, 3, 3, 64, FGDN_FLOAT16));
  add(with_states(dense_d("T64_Hq2_Hv8_D128", 1, 64, 2, 8, 128)));
  {
    ft::Spec s = dense_d("T65_Hq4_Hv4_D128_l2norm", 1, 65, 4, 4, 128);
    s.l2norm = true;
    add(s);
  }
  {
    ft::Spec s = with_states(dense_d("T1000_Hq1_Hv2_D128_l2norm", 1, 1000, 1, 2, 128));
    s.l2norm = true;
    add(s);
  }
  {
    ft::Spec s = dense_d("T4096_Hq1_Hv1_D128_l2norm_gk", 1, 4096, 1, 1, 128);
    s.l2norm = true;
    s.gate_in_kernel = true;
    add(s);
  }
  {
    ft::Spec s = with_states(dense_d("GVA16_64_T130_D128", 1, 130, 16, 64, 128));
    s.l2norm = true;
    add(s);
  }
  add(with_states(dense_d("GVA2_8_B2_T300_D64_fp16", 2, 300, 2, 8, 64, FGDN_FLOAT16)));
  add(dense_d("GVA32_32_T100_D128", 1, 100, 32, 32, 128));
  // Whole chunks in dense rows: the end of a row's last chunk lands on the next row's first
  // chunk-start state, which the initial state must overwrite (chunk_bwd_state.cu).
  add(with_states(dense_d("B3_T128_Hq2_Hv4_D128", 3, 128, 2, 4, 128)));
  add(with_states(dense_d("B2_T192_Hq1_Hv2_D64_fp16", 2, 192, 1, 2, 64, FGDN_FLOAT16)));
  // Hv = 6: g, beta, dg, dbeta rows of 24 bytes (read and written element by element).
  add(with_states(dense_d("GVA2_6_B2_T200_D128", 2, 200, 2, 6, 128)));
  {
    ft::Spec s = with_states(varlen_d("varlen_edge_D64_l2norm", cu_edge, 2, 4, 64));
    s.l2norm = true;
    add(s);
  }
  {
    ft::Spec s = with_states(varlen_d("varlen_gate_in_kernel_D128", cu_edge, 1, 2, 128));
    s.gate_in_kernel = true;
    s.g_dt = FGDN_BFLOAT16;
    s.beta_dt = FGDN_BFLOAT16;
    add(s);
  }
  {  // fp16 g and beta: dg and dbeta written in fp16
    ft::Spec s = with_states(varlen_d("varlen_fp16_gates_D64", cu_edge, 2, 4, 64));
    s.g_dt = FGDN_FLOAT16;
    s.beta_dt = FGDN_FLOAT16;
    add(s);
  }
  {
    ft::Spec s =
        with_states(varlen_d("varlen_pool_vfirst_D64_fp16", cu_edge, 1, 2, 64, FGDN_FLOAT16));
    s.state_indices = true;
    s.v_first = true;
    s.l2norm = true;
    add(s);
  }
  {
    ft::Spec s = with_states(dense_d("T200_Hq2_Hv4_D128_fp16_bf16gates", 1, 200, 2, 4, 128,
                                   FGDN_FLOAT16));
    s.g_dt = FGDN_BFLOAT16;
    s.beta_dt = FGDN_BFLOAT16;
    s.gate_in_kernel = true;
    s.dt_bias = false;
    add(s);
  }
  // States in bf16 / fp16: h0 (and dh0, in h0's dtype as autograd needs), d_final_state; a bf16
  // V-major pool read through state_indices
  {
    ft::Spec s = ft::with_state_dtype(with_states(dense_d("T300_Hq2_Hv4_D128_h0_bf16", 1, 300, 2, 4, 128)),
                                      FGDN_BFLOAT16);
    add(s);
    s = ft::with_state_dtype(with_states(varlen_d("varlen_edge_D64_h0_fp16", cu_edge, 2, 4, 64)),
                             FGDN_FLOAT16);
    s.l2norm = true;
    add(s);
    s = ft::with_state_dtype(with_states(varlen_d("varlen_pool_bf16_vfirst_D128", cu_edge, 1, 2, 128)),
                             FGDN_BFLOAT16);
    s.state_indices = true;
    s.v_first = true;
    add(s);
    s = with_states(dense_d("T200_D64_h0_bf16_dht_fp32_dh0_fp32", 2, 200, 1, 2, 64));
    s.h0_dt = FGDN_BFLOAT16;
    add(s);
  }
  // precision "fast": the reverse pass's products single (hi * hi), the same bounds.
  for (auto [nm, D, dt] : {std::tuple{"fast_T1000_Hq1_Hv2_D128_l2norm", 128, FGDN_BFLOAT16},
                           std::tuple{"fast_varlen_edge_D64_fp16", 64, FGDN_FLOAT16}}) {
    ft::Spec s = with_states(D == 128 ? dense_d(nm, 1, 1000, 1, 2, D, dt) : varlen_d(nm, cu_edge, 2, 4, D, dt));
    s.l2norm = true;
    s.precision = FGDN_PRECISION_FAST;
    add(s);
  }
  return v;
}

class CudaBackwardCase : public ::testing::TestWithParam<ft::Spec> {};

}  // namespace

TEST_P(CudaBackwardCase, MatchesFloat64Oracle) {
#if defined(FLASHGDN_WITH_CUDA)
  run_and_check(GetParam());
#else
  GTEST_SKIP() << "no CUDA device";
#endif
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaBackwardCase, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<ft::Spec>& i) { return i.param.name; });

#if defined(FLASHGDN_WITH_CUDA)
namespace {
std::vector<unsigned char> all_grad_bytes(ft::Case& c) {
  std::vector<unsigned char> b;
  for (ft::HostBuffer* x : {&c.dq, &c.dk, &c.dv, &c.dg, &c.dbeta, &c.dA_log, &c.ddt_bias, &c.dh0})
    b.insert(b.end(), x->bytes.begin(), x->bytes.end());
  return b;
}
}  // namespace
#endif

TEST(CudaBackward, BitwiseIdenticalOverRuns) {
#if defined(FLASHGDN_WITH_CUDA)
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = with_states(varlen_d("det", {0, 0, 1, 70, 200, 330}, 2, 4, 64));
  s.gate_in_kernel = true;
  s.l2norm = true;
  std::vector<unsigned char> first;
  for (int rep = 0; rep < 3; ++rep) {
    ft::Case c(s);
    ASSERT_NO_FATAL_FAILURE(ft::run_backward_on_device(c));
    const auto b = all_grad_bytes(c);
    if (rep == 0) first = b;
    else EXPECT_TRUE(b == first) << "run " << rep << " differs from run 0";
  }
#else
  GTEST_SKIP() << "no CUDA device";
#endif
}

// One sequence alone and packed between others: its gradients are bitwise the same.
TEST(CudaBackward, IndependentOfPacking) {
#if defined(FLASHGDN_WITH_CUDA)
  if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const int64_t L = 150, Hq = 1, Hv = 2, D = 64;
  ft::Spec alone = varlen_d("alone", {0, L}, Hq, Hv, D);
  alone.l2norm = true;
  ft::Case ca(alone);
  ASSERT_NO_FATAL_FAILURE(ft::run_backward_on_device(ca));
  // the packed problem: 37 tokens, the same sequence, 90 tokens
  ft::Spec packed = varlen_d("packed", {0, 37, 37 + L, 37 + L + 90}, Hq, Hv, D);
  packed.l2norm = true;
  ft::Case cp(packed);
  // copy the sequence's inputs into the middle slot of the packed case
  auto put = [&](ft::HostBuffer& dst, const ft::HostBuffer& src, int64_t row) {
    const size_t es = flashgdn::dtype_size(dst.dtype);
    std::memcpy(dst.bytes.data() + 37 * row * es, src.bytes.data(), static_cast<size_t>(L * row) * es);
  };
  put(cp.q, ca.q, Hq * D);
  put(cp.k, ca.k, Hq * D);
  put(cp.v, ca.v, Hv * D);
  put(cp.g, ca.g, Hv);
  put(cp.beta, ca.beta, Hv);
  put(cp.d_o_buf, ca.d_o_buf, Hv * D);
  ASSERT_NO_FATAL_FAILURE(ft::run_backward_on_device(cp));
  auto same = [&](const ft::HostBuffer& p, const ft::HostBuffer& a, int64_t row, const char* w) {
    const size_t es = flashgdn::dtype_size(p.dtype);
    EXPECT_EQ(0, std::memcmp(p.bytes.data() + 37 * row * es, a.bytes.data(),
                             static_cast<size_t>(L * row) * es))
        << w << " depends on the packing";
  };
  same(cp.dq, ca.dq, Hq * D, "dq");
  same(cp.dk, ca.dk, Hq * D, "dk");
  same(cp.dv, ca.dv, Hv * D, "dv");
  same(cp.dg, ca.dg, Hv, "dg");
  same(cp.dbeta, ca.dbeta, Hv, "dbeta");
#else
  GTEST_SKIP() << "no CUDA device";
#endif
}
