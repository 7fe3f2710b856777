// The CUDA backward through the public C++ API on device tensors, against the float64 oracle
// (reference/) run on the SAME storage-rounded inputs. Skips when no CUDA device is present.
//
// Bounds (relative L2 error ||x - ref|| / ||ref|| over the whole tensor): dq, dk, dv, dbeta,
// dh0 <= 8e-3; dg (and dA_log, ddt_bias) <= 1.2e-2; dq, dk, dv and dh0 also <= 1.6e-2 on every
// (sequence, head) slice of at least 64 tokens. Every element must be finite (outputs are
// poisoned with NaN before the call). Also: bitwise identical results over runs, and a
// sequence's gradients do not depend on what else is packed in the batch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "gdn_reference.h"
#include "test_util.h"

#if defined(FLASHGDN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace ft = flashgdn::test;
namespace ref = flashgdn::reference;

namespace {

constexpr double kTol = 8e-3;
constexpr double kTolDg = 1.2e-2;
constexpr double kTolSlice = 2 * kTol;

[[maybe_unused]] bool have_device() {
#if defined(FLASHGDN_WITH_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return false;
  return n > 0;
#else
  return false;
#endif
}

[[maybe_unused]] ft::ErrorSummary& errors = ft::add_error_summary("CudaBackward");

#if defined(FLASHGDN_WITH_CUDA)

#define CUDA_OK(x) ASSERT_EQ(cudaSuccess, (x)) << #x

// Device copies of every tensor of a BwdArgs built on the host; outputs poisoned with NaN.
struct DeviceArgs {
  std::vector<void*> ptrs;
  flashgdn::BwdArgs a;
  std::vector<int64_t> cu_host;

  ~DeviceArgs() {
    for (void* p : ptrs) cudaFree(p);
  }
  static size_t bytes_of(const fgdn_tensor& t) {
    // extent of a strided tensor: 1 + sum (shape - 1) * stride elements
    int64_t n = 1;
    for (int d = 0; d < t.ndim; ++d) {
      if (t.shape[d] == 0) return 0;
      n += (t.shape[d] - 1) * t.strides[d];
    }
    return static_cast<size_t>(n) * flashgdn::dtype_size(t.dtype);
  }
  bool to_device(fgdn_tensor& t, bool poison) {
    if (t.data == nullptr) return true;
    const size_t nb = bytes_of(t);
    void* d = nullptr;
    if (cudaMalloc(&d, nb > 0 ? nb : 16) != cudaSuccess) return false;
    ptrs.push_back(d);
    if (poison) {
      if (cudaMemset(d, 0xff, nb) != cudaSuccess) return false;  // NaN in fp32 / bf16 / fp16
    } else if (nb > 0 && cudaMemcpy(d, t.data, nb, cudaMemcpyHostToDevice) != cudaSuccess) {
      return false;
    }
    t.data = d;
    t.device_type = FGDN_CUDA;
    t.device_id = 0;
    return true;
  }
  bool build(const flashgdn::BwdArgs& host, const std::vector<int64_t>& cu) {
    a = host;
    fgdn_inputs& in = a.in;
    for (fgdn_tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.beta, &in.A_log, &in.dt_bias,
                           &in.cu_seqlens, &in.initial_state, &in.state_indices, &a.d_o,
                           &a.d_final_state})
      if (!to_device(*t, false)) return false;
    for (fgdn_tensor* t : {&a.dq, &a.dk, &a.dv, &a.dg, &a.dbeta, &a.dA_log, &a.ddt_bias, &a.dh0})
      if (!to_device(*t, true)) return false;
    if (!cu.empty()) {
      cu_host = cu;
      in.cu_seqlens_host = flashgdn::host_tensor(cu_host.data(), FGDN_INT64,
                                                 {static_cast<int64_t>(cu_host.size())});
    }
    return true;
  }
  static bool back(const fgdn_tensor& t, ft::HostBuffer& b) {
    if (t.data == nullptr) return true;
    return cudaMemcpy(b.data(), t.data, b.bytes.size(), cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  // Copies every gradient back into the Case's host buffers.
  bool copy_back(ft::Case& c) {
    return back(a.dq, c.dq) && back(a.dk, c.dk) && back(a.dv, c.dv) && back(a.dg, c.dg) &&
           back(a.dbeta, c.dbeta) && back(a.dA_log, c.dA_log) && back(a.ddt_bias, c.ddt_bias) &&
           back(a.dh0, c.dh0);
  }
};

void expect_close(const std::string& name, const std::string& what, const std::vector<double>& got,
                  const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size()) << name << ": " << what;
  EXPECT_TRUE(ft::all_finite(got)) << name << ": " << what << " has non-finite elements";
  const double err = ft::rel_l2(got, want);
  EXPECT_LE(err, tol) << name << ": " << what << " relative L2 error " << err;
  if (std::getenv("FLASHGDN_TEST_VERBOSE"))
    std::printf("  %-28s %-8s %.3e\n", name.c_str(), what.c_str(), err);
  errors.record(what, err, name);
}

// Rows [t0, t0 + len) of batch row b, head h, of a [B, T, H, D] tensor.
std::vector<double> tok_slice(const std::vector<double>& x, int64_t T, int64_t H, int64_t D,
                              int64_t b, int64_t t0, int64_t len, int64_t h) {
  std::vector<double> y;
  y.reserve(static_cast<size_t>(len * D));
  for (int64_t t = t0; t < t0 + len; ++t)
    for (int64_t d = 0; d < D; ++d) y.push_back(x[static_cast<size_t>(((b * T + t) * H + h) * D + d)]);
  return y;
}

// Runs the backward on the device for one case; returns false (after a failed assertion) when
// something could not run.
void run_backward(ft::Case& c, DeviceArgs& dev) {
  flashgdn::BwdArgs host = c.bwd_args();
  ASSERT_TRUE(dev.build(host, c.s.cu)) << c.s.name << ": device allocation / copy failed";
  ASSERT_NO_THROW(flashgdn::backward(dev.a)) << c.s.name;
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(dev.copy_back(c)) << c.s.name;
}

void run_and_check(const ft::Spec& s) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  ft::Case c(s);
  DeviceArgs dev;
  run_backward(c, dev);
  if (::testing::Test::HasFatalFailure()) return;
  ref::Grads rg = ref::backward(c.rp, c.ri, c.d_o, c.d_ht);
  ft::zero_dh0_of_unindexed(c, rg);
  const int64_t N = s.N();
  const auto dq = c.dq.to_double(), dk = c.dk.to_double(), dv = c.dv.to_double();
  expect_close(s.name, "dq", dq, rg.dq, kTol);
  expect_close(s.name, "dk", dk, rg.dk, kTol);
  expect_close(s.name, "dv", dv, rg.dv, kTol);
  expect_close(s.name, "dbeta", c.dbeta.to_double(), rg.dbeta, kTol);
  expect_close(s.name, "dg", c.dg.to_double(), rg.dg, kTolDg);
  std::vector<double> dh0;
  if (s.h0) {
    dh0 = ft::state_dense(c.dh0, N, s.Hv, s.K, s.V, s.v_first);
    expect_close(s.name, "dh0", dh0, rg.dh0, kTol);
  }
  if (s.gate_in_kernel) {
    expect_close(s.name, "dA_log", c.dA_log.to_double(), rg.dA_log, kTolDg);
    if (s.dt_bias) expect_close(s.name, "ddt_bias", c.ddt_bias.to_double(), rg.ddt_bias, kTolDg);
  }
  // per (sequence, head) slices of at least 64 tokens
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = s.seq_len(n);
    if (len < 64) continue;
    const int64_t b = s.cu.empty() ? n : 0, t0 = s.cu.empty() ? 0 : s.cu[n];
    for (int64_t h = 0; h < s.Hq; ++h) {
      const std::string w = " seq " + std::to_string(n) + " head " + std::to_string(h);
      EXPECT_LE(ft::rel_l2(tok_slice(dq, s.T, s.Hq, s.K, b, t0, len, h),
                           tok_slice(rg.dq, s.T, s.Hq, s.K, b, t0, len, h)), kTolSlice)
          << s.name << ": dq" << w;
      EXPECT_LE(ft::rel_l2(tok_slice(dk, s.T, s.Hq, s.K, b, t0, len, h),
                           tok_slice(rg.dk, s.T, s.Hq, s.K, b, t0, len, h)), kTolSlice)
          << s.name << ": dk" << w;
    }
    for (int64_t h = 0; h < s.Hv; ++h) {
      const std::string w = " seq " + std::to_string(n) + " head " + std::to_string(h);
      EXPECT_LE(ft::rel_l2(tok_slice(dv, s.T, s.Hv, s.V, b, t0, len, h),
                           tok_slice(rg.dv, s.T, s.Hv, s.V, b, t0, len, h)), kTolSlice)
          << s.name << ": dv" << w;
      if (s.h0 && !(s.state_indices && c.idx[static_cast<size_t>(n)] < 0)) {
        const int64_t KV = s.K * s.V, o = (n * s.Hv + h) * KV;
        const std::vector<double> a(dh0.begin() + o, dh0.begin() + o + KV);
        const std::vector<double> r(rg.dh0.begin() + o, rg.dh0.begin() + o + KV);
        EXPECT_LE(ft::rel_l2(a, r), kTolSlice) << s.name << ": dh0" << w;
      }
    }
  }
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
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = with_states(varlen_d("det", {0, 0, 1, 70, 200, 330}, 2, 4, 64));
  s.gate_in_kernel = true;
  s.l2norm = true;
  std::vector<unsigned char> first;
  for (int rep = 0; rep < 3; ++rep) {
    ft::Case c(s);
    DeviceArgs dev;
    run_backward(c, dev);
    if (HasFatalFailure()) return;
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
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const int64_t L = 150, Hq = 1, Hv = 2, D = 64;
  ft::Spec alone = varlen_d("alone", {0, L}, Hq, Hv, D);
  alone.l2norm = true;
  ft::Case ca(alone);
  DeviceArgs da;
  run_backward(ca, da);
  if (HasFatalFailure()) return;
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
  DeviceArgs dp;
  run_backward(cp, dp);
  if (HasFatalFailure()) return;
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
