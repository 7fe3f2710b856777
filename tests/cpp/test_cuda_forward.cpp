// The CUDA forward (csrc/cuda/) through the public C++ API on device tensors, against the
// float64 oracle (reference/) run on the same storage-rounded inputs. Skips without a device.
//
// Bounds (relative L2 error ||x - ref|| / ||ref||): o, final state and checkpoints <= 6e-3 over
// the whole tensor and <= 1.2e-2 per (sequence, value head) slice of >= 64 tokens; every output
// element finite (outputs are poisoned with NaN before the call, so unwritten elements fail).
#include <gtest/gtest.h>

#ifdef FLASHGDN_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cmath>
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

constexpr double kTolTensor = 6e-3;
constexpr double kTolSlice = 1.2e-2;

[[maybe_unused]] bool have_device() {
#ifdef FLASHGDN_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0 && flashgdn::has_cuda();
#else
  return false;
#endif
}

#ifdef FLASHGDN_WITH_CUDA

#define CU(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

ft::ErrorSummary& errors = ft::add_error_summary("CudaForward", 34);

// Device copies of host buffers; freed at scope end.
struct DeviceArena {
  std::vector<void*> ptrs;
  ~DeviceArena() {
    for (void* p : ptrs) cudaFree(p);
  }
  void* alloc(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes < 16 ? 16 : bytes) != cudaSuccess) return nullptr;
    ptrs.push_back(p);
    return p;
  }
  // Copies b to the device and points t at the copy.
  bool upload(ft::HostBuffer& b, fgdn_tensor& t) {
    void* d = alloc(b.bytes.size());
    if (d == nullptr) return false;
    if (!b.bytes.empty() &&
        cudaMemcpy(d, b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess)
      return false;
    t.data = d;
    t.device_type = FGDN_CUDA;
    t.device_id = 0;
    return true;
  }
  // A device output for b, poisoned with NaN (all-ones bytes).
  bool output(ft::HostBuffer& b, fgdn_tensor& t) {
    void* d = alloc(b.bytes.size());
    if (d == nullptr || cudaMemset(d, 0xff, b.bytes.size() < 16 ? 16 : b.bytes.size()) != cudaSuccess)
      return false;
    t.data = d;
    t.device_type = FGDN_CUDA;
    t.device_id = 0;
    return true;
  }
  static bool download(ft::HostBuffer& b, const fgdn_tensor& t) {
    if (b.bytes.empty()) return true;
    return cudaMemcpy(b.bytes.data(), t.data, b.bytes.size(), cudaMemcpyDeviceToHost) ==
           cudaSuccess;
  }
};

// Uploads the inputs fa points at and makes NaN-poisoned device outputs; with
// pass_host_seqlens, fa also gets the host copy of cu_seqlens.
void to_device(DeviceArena& dev, ft::Case& c, flashgdn::FwdArgs& fa, bool pass_host_seqlens) {
  fgdn_inputs& in = fa.in;
  ASSERT_TRUE(dev.upload(c.q, in.q));
  ASSERT_TRUE(dev.upload(c.k, in.k));
  ASSERT_TRUE(dev.upload(c.v, in.v));
  ASSERT_TRUE(dev.upload(c.g, in.g));
  ASSERT_TRUE(dev.upload(c.beta, in.beta));
  if (in.A_log.data) {
    ASSERT_TRUE(dev.upload(c.A_log, in.A_log));
  }
  if (in.dt_bias.data) {
    ASSERT_TRUE(dev.upload(c.dt_bias, in.dt_bias));
  }
  if (in.cu_seqlens.data) {
    if (pass_host_seqlens) in.cu_seqlens_host = c.cu_buf.tensor({c.s.N() + 1});
    ASSERT_TRUE(dev.upload(c.cu_buf, in.cu_seqlens));
  }
  if (in.initial_state.data) {
    ASSERT_TRUE(dev.upload(c.h0, in.initial_state));
  }
  if (in.state_indices.data) {
    ASSERT_TRUE(dev.upload(c.idx_buf, in.state_indices));
  }
  ASSERT_TRUE(dev.output(c.o, fa.o));
  if (fa.final_state.data) {
    ASSERT_TRUE(dev.output(c.ht, fa.final_state));
  }
  if (fa.checkpoints.data) {
    ASSERT_TRUE(dev.output(c.ck, fa.checkpoints));
  }
}

// Copies o, the final state and the checkpoints back into c.
void outputs_to_host(ft::Case& c, const flashgdn::FwdArgs& fa) {
  ASSERT_TRUE(DeviceArena::download(c.o, fa.o));
  if (fa.final_state.data) {
    ASSERT_TRUE(DeviceArena::download(c.ht, fa.final_state));
  }
  if (fa.checkpoints.data) {
    ASSERT_TRUE(DeviceArena::download(c.ck, fa.checkpoints));
  }
}

// Whole-tensor and per-slice checks. Slices: `count` consecutive blocks of `slice_len` values,
// each checked only when `slice_ok(i)`.
template <class SliceOk>
void expect_close(const std::string& name, const std::string& what, fgdn_dtype dt,
                  const std::vector<double>& got, const std::vector<double>& want,
                  int64_t count, int64_t slice_len, SliceOk slice_ok) {
  ASSERT_EQ(got.size(), want.size()) << name << ": " << what;
  EXPECT_TRUE(ft::all_finite(got))
      << name << ": " << what << " has non-finite (unwritten) elements";
  const double err = ft::rel_l2(got, want);
  errors.record(what, dt, err, name);
  if (std::getenv("FLASHGDN_TEST_VERBOSE"))
    std::printf("  %-34s %-12s %.3e\n", name.c_str(), what.c_str(), err);
  EXPECT_LE(err, kTolTensor) << name << ": " << what << " rel L2 error " << err;
  double worst = 0.0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < count; ++i) {
    if (!slice_ok(i)) continue;
    std::vector<double> a(got.begin() + i * slice_len, got.begin() + (i + 1) * slice_len);
    std::vector<double> b(want.begin() + i * slice_len, want.begin() + (i + 1) * slice_len);
    double nb = 0.0;
    for (double x : b) nb += x * x;
    if (nb < 1e-20) continue;
    const double e = ft::rel_l2(a, b);
    if (e > worst) {
      worst = e;
      worst_i = i;
    }
  }
  errors.record(what + " per slice", dt, worst, name);
  EXPECT_LE(worst, kTolSlice) << name << ": " << what << " worst slice " << worst_i
                              << " rel L2 error " << worst;
}

// o rearranged per (sequence, head): [N][Hv][len_n][V] concatenated (the same for got/want).
std::vector<double> o_by_seq_head(const ft::Spec& s, const std::vector<double>& o) {
  std::vector<double> r;
  r.reserve(o.size());
  for (int64_t n = 0; n < s.N(); ++n) {
    const int64_t b = s.cu.empty() ? n : 0;
    const int64_t t0 = s.cu.empty() ? 0 : s.cu[n];
    for (int64_t h = 0; h < s.Hv; ++h)
      for (int64_t t = 0; t < s.seq_len(n); ++t)
        for (int64_t d = 0; d < s.V; ++d)
          r.push_back(o[static_cast<size_t>(((b * s.T + t0 + t) * s.Hv + h) * s.V + d)]);
  }
  return r;
}

void run_and_check(const ft::Spec& s, bool pass_host_seqlens = true) {
  ft::Case c(s);
  const int64_t N = s.N(), KV = s.K * s.V;
  flashgdn::FwdArgs fa = c.fwd_args();
  DeviceArena dev;
  ASSERT_NO_FATAL_FAILURE(to_device(dev, c, fa, pass_host_seqlens));
  const std::vector<unsigned char> pool_before = c.h0.bytes;

  try {
    flashgdn::forward(fa);
  } catch (const std::exception& e) {
    FAIL() << s.name << ": forward threw: " << e.what();
  }
  CU(cudaDeviceSynchronize());
  ASSERT_NO_FATAL_FAILURE(outputs_to_host(c, fa));
  if (fa.in.initial_state.data) {
    ASSERT_TRUE(DeviceArena::download(c.h0, fa.in.initial_state));
  }

  const ref::Outputs ro = ref::forward(c.rp, c.ri);

  // o, whole and per (sequence, head) with >= 64 tokens
  {
    std::vector<int64_t> lens;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < s.Hv; ++h) lens.push_back(s.seq_len(n));
    const auto got = o_by_seq_head(s, c.o.to_double());
    const auto want = o_by_seq_head(s, ro.o);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_TRUE(ft::all_finite(c.o.to_double())) << s.name << ": o has unwritten elements";
    const double err = ft::rel_l2(got, want);
    errors.record("o", s.dt, err, s.name);
    if (std::getenv("FLASHGDN_TEST_VERBOSE"))
      std::printf("  %-34s %-12s %.3e\n", s.name.c_str(), "o", err);
    EXPECT_LE(err, kTolTensor) << s.name << ": o rel L2 error " << err;
    double worst = 0.0;
    size_t off = 0;
    for (int64_t len : lens) {
      const size_t n = static_cast<size_t>(len * s.V);
      if (len >= 64) {
        std::vector<double> a(got.begin() + off, got.begin() + off + n);
        std::vector<double> b(want.begin() + off, want.begin() + off + n);
        worst = std::max(worst, ft::rel_l2(a, b));
      }
      off += n;
    }
    errors.record("o per slice", s.dt, worst, s.name);
    EXPECT_LE(worst, kTolSlice) << s.name << ": o worst (sequence, head) rel L2 " << worst;
  }

  if (s.final_state) {
    if (s.state_indices) {
      const ft::PoolFinalStates p = ft::pool_final_states(c, ro.ht);
      const int64_t rows = static_cast<int64_t>(p.got.size()) / KV;
      expect_close(s.name, "ht", s.dt, p.got, p.want, rows, KV, [](int64_t) { return true; });
      ft::expect_unwritten_rows_unchanged(c, p.written, pool_before);
    } else {
      expect_close(s.name, "ht", s.dt, ft::state_dense(c.ht, N, s.Hv, s.K, s.V, s.v_first),
                   ro.ht, N * s.Hv, KV, [](int64_t) { return true; });
    }
  }
  if (s.checkpoint_every > 0) {
    const int64_t R = c.num_checkpoints();
    if (R > 0)
      expect_close(s.name, "checkpoints", s.dt,
                   ft::state_dense(c.ck, R, s.Hv, s.K, s.V, s.v_first), ro.checkpoints,
                   R * s.Hv, KV, [](int64_t) { return true; });
  }
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
  return v;
}

class CudaForwardCase : public ::testing::TestWithParam<ft::Spec> {};

TEST_P(CudaForwardCase, MatchesFloat64Oracle) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  run_and_check(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaForwardCase, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<ft::Spec>& i) { return i.param.name; });

// cu_seqlens read back from the device (no host copy given).
TEST(CudaForward, VarlenWithoutHostSeqlens) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = with_h0(varlen_d("varlen_device_only", {0, 0, 1, 70, 70, 135}, 2, 4, 64));
  s.checkpoint_every = 64;
  run_and_check(s, /*pass_host_seqlens=*/false);
}

// Same inputs twice: bitwise identical outputs (no races, deterministic).
TEST(CudaForward, Deterministic) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = with_h0(varlen_d("det", {0, 5, 200, 300}, 2, 4, 128));
  ft::Case c(s);
  std::vector<unsigned char> first;
  for (int rep = 0; rep < 2; ++rep) {
    flashgdn::FwdArgs fa = c.fwd_args();
    DeviceArena dev;
    // the inputs, o and the final state; no host copy of cu_seqlens
    ASSERT_NO_FATAL_FAILURE(to_device(dev, c, fa, /*pass_host_seqlens=*/false));
    ASSERT_NO_THROW(flashgdn::forward(fa));
    CU(cudaDeviceSynchronize());
    ASSERT_NO_FATAL_FAILURE(outputs_to_host(c, fa));
    std::vector<unsigned char> all = c.o.bytes;
    all.insert(all.end(), c.ht.bytes.begin(), c.ht.bytes.end());
    if (rep == 0) first = all;
    else EXPECT_EQ(first, all) << "two runs on the same inputs differ";
  }
}

#else  // !FLASHGDN_WITH_CUDA

TEST(CudaForward, Skipped) { GTEST_SKIP() << "no CUDA device (built without CUDA)"; }

#endif

}  // namespace
