// The CUDA backend through the public C++ API on device tensors: a Case's buffers copied to the
// device (outputs poisoned with NaN, so that an element not written fails), one forward or one
// backward, the results copied back into the Case; and the comparisons against the float64
// oracle run on the same storage-rounded inputs. Everything skips without a device.
//
// Forward bounds (relative L2 error ||x - ref|| / ||ref||): o, final state and checkpoints
// <= 6e-3 over the whole tensor and <= 1.2e-2 per (sequence, value head) slice of >= 64 tokens.
// With precision = high: o within 1.5x the rounding floor of its dtype (bf16 2.5e-3, fp16
// 3.2e-4: rounding the exact result alone gives 1.66e-3 and 2.1e-4), states and checkpoints
// <= 1e-4 (slices twice these).
// Backward bounds: dq, dk, dv, dbeta, dh0 <= 8e-3; dg (and dA_log, ddt_bias) <= 1.2e-2; dq, dk,
// dv and dh0 also <= 1.6e-2 on every (sequence, head) slice of at least 64 tokens. Below `high`,
// dA_log and ddt_bias (sums of per-token terms that may cancel) are held to 1.2e-2 of the larger
// of their norm and their terms' magnitudes (expect_close_sum). Every output
// element must be finite. A state stored in bf16 / fp16 (final state, pool, dh0) adds the unit
// roundoff u of its dtype (2^-8, 2^-11) to its bounds: it is the float32 state rounded once.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "gdn_reference.h"
#include "test_util.h"

#if defined(FLASHGDN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace flashgdn::test {

// Relative L2 error of a state slice stored in dt: against the oracle rounded to dt, and relative
// to at least dt's smallest normal number per element. Below it a 16-bit store keeps only an
// absolute accuracy (half its subnormal spacing), and the slice of a long, decaying sequence can
// underflow there entirely in fp16 (2^-14): then both sides are zero or subnormal.
inline double stored_rel_l2(const std::vector<double>& x, const std::vector<double>& ref, fgdn_dtype dt) {
  const std::vector<double> r = round_vec(ref, dt);
  const double m = dt == FGDN_FLOAT16 ? std::ldexp(1.0, -14) : std::ldexp(1.0, -126);
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < std::min(x.size(), r.size()); ++i) {
    num += (x[i] - r[i]) * (x[i] - r[i]);
    den += r[i] * r[i];
  }
  if (x.size() != r.size()) return INFINITY;
  return std::sqrt(num / std::max(den, static_cast<double>(r.size()) * m * m));
}

inline bool have_cuda_device() {
#if defined(FLASHGDN_WITH_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0 && has_cuda();
#else
  return false;
#endif
}

#if defined(FLASHGDN_WITH_CUDA)

constexpr double kCudaFwdTol = 6e-3;
constexpr double kCudaFwdTolSlice = 1.2e-2;

// The whole-tensor forward bound of one output of a case (slices: twice it).
inline double cuda_fwd_tol(const Spec& s, bool is_o) {
  if (s.precision != FGDN_PRECISION_HIGH) return kCudaFwdTol;
  if (!is_o) return 1e-4;
  return s.dt == FGDN_FLOAT16 ? 3.2e-4 : 2.5e-3;
}
// What storing a state in dt adds to its relative L2 error (0 for float32).
inline double state_rounding(fgdn_dtype dt) { return dt == FGDN_FLOAT32 ? 0.0 : unit_roundoff(dt); }
constexpr double kCudaBwdTol = 8e-3;
constexpr double kCudaBwdTolDg = 1.2e-2;
constexpr double kCudaBwdTolSlice = 2 * kCudaBwdTol;

// Device copies of host buffers; freed at scope end.
struct DeviceArena {
  std::vector<void*> ptrs;
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* p : ptrs) cudaFree(p);
  }
  void* alloc(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes < 16 ? 16 : bytes) != cudaSuccess) return nullptr;
    ptrs.push_back(p);
    return p;
  }
  // Copies b to the device and points t at the copy (nothing when t is absent).
  bool upload(HostBuffer& b, fgdn_tensor& t) {
    if (t.data == nullptr) return true;
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
  // A device output for b, poisoned with NaN (all-ones bytes); nothing when t is absent.
  bool output(HostBuffer& b, fgdn_tensor& t) {
    if (t.data == nullptr) return true;
    const size_t n = b.bytes.size() < 16 ? 16 : b.bytes.size();
    void* d = alloc(n);
    if (d == nullptr || cudaMemset(d, 0xff, n) != cudaSuccess) return false;
    t.data = d;
    t.device_type = FGDN_CUDA;
    t.device_id = 0;
    return true;
  }
  static bool download(HostBuffer& b, const fgdn_tensor& t) {
    if (t.data == nullptr || b.bytes.empty()) return true;
    return cudaMemcpy(b.bytes.data(), t.data, b.bytes.size(), cudaMemcpyDeviceToHost) ==
           cudaSuccess;
  }
};

// Uploads the inputs in points at (from c's buffers); with pass_host_seqlens, in also gets the
// host copy of cu_seqlens.
inline void inputs_to_device(DeviceArena& dev, Case& c, fgdn_inputs& in, bool pass_host_seqlens) {
  if (in.cu_seqlens.data && pass_host_seqlens) in.cu_seqlens_host = c.cu_buf.tensor({c.s.N() + 1});
  const std::pair<HostBuffer*, fgdn_tensor*> all[] = {
      {&c.q, &in.q},           {&c.k, &in.k},         {&c.v, &in.v},
      {&c.g, &in.g},           {&c.beta, &in.beta},   {&c.A_log, &in.A_log},
      {&c.dt_bias, &in.dt_bias}, {&c.cu_buf, &in.cu_seqlens}, {&c.h0, &in.initial_state},
      {&c.idx_buf, &in.state_indices}};
  for (const auto& [b, t] : all) ASSERT_TRUE(dev.upload(*b, *t)) << "device copy failed";
}

// One forward of c on the device: fa's tensors moved to the device, the outputs (o, final state,
// checkpoints and, with a pool, the pool) copied back into c's buffers.
inline void run_forward_on_device(Case& c, FwdArgs& fa, bool pass_host_seqlens = true) {
  DeviceArena dev;
  ASSERT_NO_FATAL_FAILURE(inputs_to_device(dev, c, fa.in, pass_host_seqlens));
  ASSERT_TRUE(dev.output(c.o, fa.o) && dev.output(c.ht, fa.final_state) &&
              dev.output(c.ck, fa.checkpoints));
  try {
    flashgdn::forward(fa);
  } catch (const std::exception& e) {
    FAIL() << c.s.name << ": forward threw: " << e.what();
  }
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize()) << c.s.name;
  ASSERT_TRUE(DeviceArena::download(c.o, fa.o) && DeviceArena::download(c.ht, fa.final_state) &&
              DeviceArena::download(c.ck, fa.checkpoints) &&
              DeviceArena::download(c.h0, fa.in.initial_state));
}

// One backward of c on the device; the gradients copied back into c's buffers.
inline void run_backward_on_device(Case& c, bool pass_host_seqlens = true) {
  BwdArgs a = c.bwd_args();
  DeviceArena dev;
  ASSERT_NO_FATAL_FAILURE(inputs_to_device(dev, c, a.in, pass_host_seqlens));
  ASSERT_TRUE(dev.upload(c.d_o_buf, a.d_o) && dev.upload(c.d_ht_buf, a.d_final_state));
  const std::pair<HostBuffer*, fgdn_tensor*> outs[] = {
      {&c.dq, &a.dq},         {&c.dk, &a.dk},         {&c.dv, &a.dv},
      {&c.dg, &a.dg},         {&c.dbeta, &a.dbeta},   {&c.dA_log, &a.dA_log},
      {&c.ddt_bias, &a.ddt_bias}, {&c.dh0, &a.dh0}};
  for (const auto& [b, t] : outs) ASSERT_TRUE(dev.output(*b, *t)) << "device allocation failed";
  ASSERT_NO_THROW(flashgdn::backward(a)) << c.s.name;
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize()) << c.s.name;
  for (const auto& [b, t] : outs) ASSERT_TRUE(DeviceArena::download(*b, *t)) << c.s.name;
}

// Whole-tensor and per-slice checks of one forward output. Slices: `count` consecutive blocks
// of `slice_len` values, each checked when its reference is not ~0 and slice_ok(i).
template <class SliceOk>
void expect_close_fwd(ErrorSummary& errors, const std::string& name, const std::string& what,
                      fgdn_dtype dt, const std::vector<double>& got,
                      const std::vector<double>& want, int64_t count, int64_t slice_len,
                      SliceOk slice_ok, double tol = kCudaFwdTol) {
  ASSERT_EQ(got.size(), want.size()) << name << ": " << what;
  EXPECT_TRUE(all_finite(got)) << name << ": " << what << " has non-finite (unwritten) elements";
  const double err = rel_l2(got, want);
  errors.record(what, dt, err, name);
  if (std::getenv("FLASHGDN_TEST_VERBOSE"))
    std::printf("  %-34s %-12s %.3e\n", name.c_str(), what.c_str(), err);
  EXPECT_LE(err, tol) << name << ": " << what << " rel L2 error " << err;
  double worst = 0.0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < count; ++i) {
    if (!slice_ok(i)) continue;
    std::vector<double> a(got.begin() + i * slice_len, got.begin() + (i + 1) * slice_len);
    std::vector<double> b(want.begin() + i * slice_len, want.begin() + (i + 1) * slice_len);
    double nb = 0.0;
    for (double x : b) nb += x * x;
    if (nb < 1e-20) continue;
    const double e = rel_l2(a, b);
    if (e > worst) {
      worst = e;
      worst_i = i;
    }
  }
  errors.record(what + " per slice", dt, worst, name);
  EXPECT_LE(worst, 2 * tol) << name << ": " << what << " worst slice " << worst_i
                                     << " rel L2 error " << worst;
}

// o rearranged per (sequence, head): [N][Hv][len_n][V] concatenated (the same for got/want).
inline std::vector<double> o_by_seq_head(const Spec& s, const std::vector<double>& o) {
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

// One forward of c on the device against the oracle (bounds in the file comment).
inline void expect_cuda_forward_matches_oracle(Case& c, ErrorSummary& errors,
                                               bool pass_host_seqlens = true) {
  const Spec& s = c.s;
  const int64_t N = s.N(), KV = s.K * s.V;
  const std::vector<unsigned char> pool_before = c.h0.bytes;
  FwdArgs fa = c.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward_on_device(c, fa, pass_host_seqlens));
  const reference::Outputs ro = reference::forward(c.rp, c.ri);

  // o, whole and per (sequence, head) with >= 64 tokens
  {
    std::vector<int64_t> lens;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < s.Hv; ++h) lens.push_back(s.seq_len(n));
    const auto got = o_by_seq_head(s, c.o.to_double());
    const auto want = o_by_seq_head(s, ro.o);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_TRUE(all_finite(c.o.to_double())) << s.name << ": o has unwritten elements";
    const double err = rel_l2(got, want);
    errors.record("o", s.dt, err, s.name);
    if (std::getenv("FLASHGDN_TEST_VERBOSE"))
      std::printf("  %-34s %-12s %.3e\n", s.name.c_str(), "o", err);
    EXPECT_LE(err, cuda_fwd_tol(s, true)) << s.name << ": o rel L2 error " << err;
    double worst = 0.0;
    size_t off = 0;
    for (int64_t len : lens) {
      const size_t n = static_cast<size_t>(len * s.V);
      if (len >= 64) {
        std::vector<double> a(got.begin() + off, got.begin() + off + n);
        std::vector<double> b(want.begin() + off, want.begin() + off + n);
        worst = std::max(worst, rel_l2(a, b));
      }
      off += n;
    }
    errors.record("o per slice", s.dt, worst, s.name);
    EXPECT_LE(worst, 2 * cuda_fwd_tol(s, true)) << s.name << ": o worst (sequence, head) rel L2 " << worst;
  }

  const auto every = [](int64_t) { return true; };
  if (s.final_state) {
    if (s.state_indices) {
      const PoolFinalStates p = pool_final_states(c, ro.ht);
      const int64_t rows = static_cast<int64_t>(p.got.size()) / KV;
      expect_close_fwd(errors, s.name, "ht", s.dt, p.got, p.want, rows, KV, every,
                       cuda_fwd_tol(s, false) + state_rounding(s.h0_dt));
      expect_unwritten_rows_unchanged(c, p.written, pool_before);
    } else {
      expect_close_fwd(errors, s.name, "ht", s.dt,
                       state_dense(c.ht, N, s.Hv, s.K, s.V, s.v_first), ro.ht, N * s.Hv, KV,
                       every, cuda_fwd_tol(s, false) + state_rounding(s.ht_dt));
    }
  }
  if (s.checkpoint_every > 0) {
    const int64_t R = c.num_checkpoints();
    if (R > 0)
      expect_close_fwd(errors, s.name, "checkpoints", s.dt,
                       state_dense(c.ck, R, s.Hv, s.K, s.V, s.v_first), ro.checkpoints, R * s.Hv,
                       KV, every, cuda_fwd_tol(s, false));
  }
}

inline void expect_close_bwd(ErrorSummary& errors, const std::string& name,
                             const std::string& what, const std::vector<double>& got,
                             const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size()) << name << ": " << what;
  EXPECT_TRUE(all_finite(got)) << name << ": " << what << " has non-finite elements";
  const double err = rel_l2(got, want);
  EXPECT_LE(err, tol) << name << ": " << what << " relative L2 error " << err;
  if (std::getenv("FLASHGDN_TEST_VERBOSE"))
    std::printf("  %-28s %-8s %.3e\n", name.c_str(), what.c_str(), err);
  errors.record(what, err, name);
}

// Rows [t0, t0 + len) of batch row b, head h, of a [B, T, H, D] tensor.
inline std::vector<double> tok_slice(const std::vector<double>& x, int64_t T, int64_t H,
                                     int64_t D, int64_t b, int64_t t0, int64_t len, int64_t h) {
  std::vector<double> y;
  y.reserve(static_cast<size_t>(len * D));
  for (int64_t t = t0; t < t0 + len; ++t)
    for (int64_t d = 0; d < D; ++d)
      y.push_back(x[static_cast<size_t>(((b * T + t) * H + h) * D + d)]);
  return y;
}

// dA_log[h] = sum_t g_t dL/dg_t and ddt_bias[h] = sum_t dL/da_t are sums over tokens whose
// terms may cancel (random data gives dA_log 600x smaller than the sum of its terms' magnitudes
// in GateReset's cases). Per head, the magnitudes of the terms from the oracle's dg (= dL/da with
// the gate in the kernel; dL/dg = dg / (-exp(A_log) sigmoid(a + dt_bias))): {sum_t |g_t dL/dg_t|,
// sum_t |dg_t|} over the tokens whose gate is not floored.
inline std::pair<std::vector<double>, std::vector<double>> gate_sum_magnitudes(const Case& c,
                                                                            const reference::Grads& rg) {
  const Spec& s = c.s;
  std::vector<double> ma(static_cast<size_t>(s.Hv), 0.0), mb(static_cast<size_t>(s.Hv), 0.0);
  const int64_t tokens = s.B * s.T;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < s.Hv; ++h) {
      const size_t i = static_cast<size_t>(t * s.Hv + h);
      const double x = c.ri.g[i] + (c.ri.dt_bias.empty() ? 0.0 : c.ri.dt_bias[static_cast<size_t>(h)]);
      const double sp = x > 20.0 ? x : std::log1p(std::exp(x)), sg = x > 20.0 ? 1.0 : 1.0 / (1.0 + std::exp(-x));
      const double g = -std::exp(c.ri.A_log[static_cast<size_t>(h)]) * sp;
      if (!(g >= -128.0)) continue;  // floored: no gradient
      ma[static_cast<size_t>(h)] += std::fabs(sp / sg * rg.dg[i]);
      mb[static_cast<size_t>(h)] += std::fabs(rg.dg[i]);
    }
  return {ma, mb};
}

// A sum over tokens checked as accurate as the dg it sums: ||got - want|| <= tol max(||want||,
// ||magnitudes||) (the error bound of a sum of terms with relative error tol). Used below
// `high`, whose single 16-bit products leave dg with ~1e-3 relative error; `high` keeps the
// plain relative bound.
inline void expect_close_sum(ErrorSummary& errors, const std::string& name, const std::string& what,
                             const std::vector<double>& got, const std::vector<double>& want,
                             const std::vector<double>& magnitudes, double tol) {
  ASSERT_EQ(got.size(), want.size()) << name << ": " << what;
  EXPECT_TRUE(all_finite(got)) << name << ": " << what << " has non-finite elements";
  double e = 0, w = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    e += (got[i] - want[i]) * (got[i] - want[i]);
    w += want[i] * want[i];
    m += magnitudes[i] * magnitudes[i];
  }
  const double err = std::sqrt(e) / std::max(std::sqrt(std::max(w, m)), 1e-300);
  EXPECT_LE(err, tol) << name << ": " << what << " error " << err << " relative to max(|ref|, sum of |terms|)";
  errors.record(what + " (vs its terms)", err, name);
}

// One backward of c on the device against the oracle (bounds in the file comment).
inline void expect_cuda_backward_matches_oracle(Case& c, ErrorSummary& errors) {
  const Spec& s = c.s;
  ASSERT_NO_FATAL_FAILURE(run_backward_on_device(c));
  reference::Grads rg = reference::backward(c.rp, c.ri, c.d_o, c.d_ht);
  zero_dh0_of_unindexed(c, rg);
  const int64_t N = s.N();
  const auto dq = c.dq.to_double(), dk = c.dk.to_double(), dv = c.dv.to_double();
  expect_close_bwd(errors, s.name, "dq", dq, rg.dq, kCudaBwdTol);
  expect_close_bwd(errors, s.name, "dk", dk, rg.dk, kCudaBwdTol);
  expect_close_bwd(errors, s.name, "dv", dv, rg.dv, kCudaBwdTol);
  expect_close_bwd(errors, s.name, "dbeta", c.dbeta.to_double(), rg.dbeta, kCudaBwdTol);
  expect_close_bwd(errors, s.name, "dg", c.dg.to_double(), rg.dg, kCudaBwdTolDg);
  std::vector<double> dh0;
  if (s.h0) {
    dh0 = state_dense(c.dh0, N, s.Hv, s.K, s.V, s.v_first);
    expect_close_bwd(errors, s.name, "dh0", dh0, rg.dh0, kCudaBwdTol + state_rounding(s.dh0_dt));
  }
  if (s.gate_in_kernel && s.precision == FGDN_PRECISION_HIGH) {
    expect_close_bwd(errors, s.name, "dA_log", c.dA_log.to_double(), rg.dA_log, kCudaBwdTolDg);
    if (s.dt_bias)
      expect_close_bwd(errors, s.name, "ddt_bias", c.ddt_bias.to_double(), rg.ddt_bias,
                       kCudaBwdTolDg);
  } else if (s.gate_in_kernel) {
    const auto [ma, mb] = gate_sum_magnitudes(c, rg);
    expect_close_sum(errors, s.name, "dA_log", c.dA_log.to_double(), rg.dA_log, ma, kCudaBwdTolDg);
    if (s.dt_bias)
      expect_close_sum(errors, s.name, "ddt_bias", c.ddt_bias.to_double(), rg.ddt_bias, mb, kCudaBwdTolDg);
  }
  // per (sequence, head) slices of at least 64 tokens
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = s.seq_len(n);
    if (len < 64) continue;
    const int64_t b = s.cu.empty() ? n : 0, t0 = s.cu.empty() ? 0 : s.cu[n];
    for (int64_t h = 0; h < s.Hq; ++h) {
      const std::string w = " seq " + std::to_string(n) + " head " + std::to_string(h);
      EXPECT_LE(rel_l2(tok_slice(dq, s.T, s.Hq, s.K, b, t0, len, h),
                       tok_slice(rg.dq, s.T, s.Hq, s.K, b, t0, len, h)), kCudaBwdTolSlice)
          << s.name << ": dq" << w;
      EXPECT_LE(rel_l2(tok_slice(dk, s.T, s.Hq, s.K, b, t0, len, h),
                       tok_slice(rg.dk, s.T, s.Hq, s.K, b, t0, len, h)), kCudaBwdTolSlice)
          << s.name << ": dk" << w;
    }
    for (int64_t h = 0; h < s.Hv; ++h) {
      const std::string w = " seq " + std::to_string(n) + " head " + std::to_string(h);
      EXPECT_LE(rel_l2(tok_slice(dv, s.T, s.Hv, s.V, b, t0, len, h),
                       tok_slice(rg.dv, s.T, s.Hv, s.V, b, t0, len, h)), kCudaBwdTolSlice)
          << s.name << ": dv" << w;
      if (s.h0 && !(s.state_indices && c.idx[static_cast<size_t>(n)] < 0)) {
        const int64_t KV = s.K * s.V, o = (n * s.Hv + h) * KV;
        const std::vector<double> a(dh0.begin() + o, dh0.begin() + o + KV);
        const std::vector<double> r(rg.dh0.begin() + o, rg.dh0.begin() + o + KV);
        EXPECT_LE(stored_rel_l2(a, r, s.dh0_dt), kCudaBwdTolSlice + 2 * state_rounding(s.dh0_dt))
            << s.name << ": dh0" << w;
      }
    }
  }
}

#endif  // FLASHGDN_WITH_CUDA

}  // namespace flashgdn::test
