// Shared helpers for the C++ tests: random problems with realistic gates, conversion of double
// vectors to storage-dtype host buffers (and back), fgdn_*_args built with flashgdn::make_tensor,
// the relative L2 error ||x - ref|| / ||ref|| and a summary of the largest errors of a run.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "flashgdn/flashgdn.hpp"
#include "gdn_reference.h"

namespace flashgdn::test {

// ---- random numbers ---------------------------------------------------------------------

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen); }
  std::vector<double> normals(int64_t n, double sd = 1.0) {
    std::vector<double> x(static_cast<size_t>(n));
    for (auto& e : x) e = sd * normal();
    return x;
  }
  std::vector<double> uniforms(int64_t n, double lo, double hi) {
    std::vector<double> x(static_cast<size_t>(n));
    for (auto& e : x) e = uniform(lo, hi);
    return x;
  }
};

inline double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// ---- storage dtypes ---------------------------------------------------------------------

// x rounded to dtype dt (and back to double).
inline double round_to(double x, fgdn_dtype dt) {
  const float f = static_cast<float>(x);
  switch (dt) {
    case FGDN_BFLOAT16: return bf16_to_float(float_to_bf16(f));
    case FGDN_FLOAT16: return fp16_to_float(float_to_fp16(f));
    case FGDN_FLOAT32: return f;
    default: return x;
  }
}
inline std::vector<double> round_vec(std::vector<double> x, fgdn_dtype dt) {
  for (auto& e : x) e = round_to(e, dt);
  return x;
}

// Unit roundoff of a storage dtype: |round(x) - x| <= u |x| for normal x, so the relative L2 error
// that storing a tensor in dt adds is at most u.
inline double unit_roundoff(fgdn_dtype dt) {
  switch (dt) {
    case FGDN_BFLOAT16: return std::ldexp(1.0, -8);   // 8 significant bits
    case FGDN_FLOAT16: return std::ldexp(1.0, -11);   // 11
    default: return std::ldexp(1.0, -24);             // 24
  }
}

// An owning host buffer of n elements of one dtype (float/bf16/fp16 from doubles, or indices).
struct HostBuffer {
  fgdn_dtype dtype = FGDN_FLOAT32;
  int64_t n = 0;
  std::vector<unsigned char> bytes;

  HostBuffer() = default;
  HostBuffer(fgdn_dtype dt, int64_t count) : dtype(dt), n(count), bytes(static_cast<size_t>(count) * dtype_size(dt)) {}
  static HostBuffer from(const std::vector<double>& x, fgdn_dtype dt) {
    HostBuffer b(dt, static_cast<int64_t>(x.size()));
    for (int64_t i = 0; i < b.n; ++i) store_float(b.data(), dt, i, static_cast<float>(x[static_cast<size_t>(i)]));
    return b;
  }
  static HostBuffer from_index(const std::vector<int64_t>& x, fgdn_dtype dt) {
    HostBuffer b(dt, static_cast<int64_t>(x.size()));
    for (int64_t i = 0; i < b.n; ++i) {
      if (dt == FGDN_INT32) static_cast<int32_t*>(b.data())[i] = static_cast<int32_t>(x[static_cast<size_t>(i)]);
      else static_cast<int64_t*>(b.data())[i] = x[static_cast<size_t>(i)];
    }
    return b;
  }
  // Fill every byte (a sentinel pattern, to see what a call did not write).
  void fill_bytes(unsigned char c) {
    if (!bytes.empty()) std::memset(bytes.data(), c, bytes.size());
  }
  void* data() { return bytes.empty() ? nullptr : bytes.data(); }
  std::vector<double> to_double() const {
    std::vector<double> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = load_float(bytes.data(), dtype, i);
    return x;
  }
  // A tensor view; with no data (n == 0) an absent-looking tensor would be wrong for required
  // empty tensors, so a dummy non-null pointer is used then.
  fgdn_tensor tensor(std::initializer_list<int64_t> shape) {
    static unsigned char dummy[16];
    void* p = bytes.empty() ? static_cast<void*>(dummy) : bytes.data();
    return make_tensor(p, dtype, shape);
  }
};

// ---- a small host call whose outputs show what was written ---------------------------------

constexpr float kSentinel = 12345.f;

// A valid varlen fp32 call on the CPU over host vectors: one batch row of cu.back() tokens,
// an initial state, final states requested, `ck_rows` checkpoint rows allocated (not passed);
// every output filled with kSentinel, so that a test sees whatever a call wrote. With `gate`
// the backward computes the gate in the kernel (A_log, dt_bias in; dA_log, ddt_bias out).
struct HostCall {
  std::vector<float> q, k, v, g, beta, h0, A_log, dt_bias, d_o, dht;
  std::vector<float> o, ht, ck, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;
  std::vector<int64_t> cu;
  FwdArgs fa;
  BwdArgs ba;

  HostCall(std::vector<int64_t> cu_seqlens, int64_t Hq, int64_t Hv, int64_t K, int64_t V, bool gate,
           int64_t ck_rows)
      : cu(std::move(cu_seqlens)) {
    const int64_t T = cu.back(), N = static_cast<int64_t>(cu.size()) - 1;
    auto fill = [](std::vector<float>& x, int64_t n, float scale, float shift) {
      x.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i)
        x[static_cast<size_t>(i)] = shift + scale * std::sin(0.7f * static_cast<float>(i) + shift);
    };
    fill(q, T * Hq * K, 0.3f, 0.f);
    fill(k, T * Hq * K, 0.2f, 0.1f);
    fill(v, T * Hv * V, 0.5f, 0.2f);
    fill(g, T * Hv, 0.1f, -0.3f);
    fill(beta, T * Hv, 0.2f, 0.5f);
    fill(h0, N * Hv * K * V, 0.05f, 0.f);
    fill(A_log, Hv, 0.1f, -1.f);
    fill(dt_bias, Hv, 0.1f, 0.f);
    fill(d_o, T * Hv * V, 1.f, 0.f);
    fill(dht, N * Hv * K * V, 0.1f, 0.f);
    for (auto* x : {&o, &dv}) x->assign(static_cast<size_t>(T * Hv * V), kSentinel);
    for (auto* x : {&ht, &dh0}) x->assign(static_cast<size_t>(N * Hv * K * V), kSentinel);
    ck.assign(static_cast<size_t>(ck_rows * Hv * K * V), kSentinel);
    for (auto* x : {&dq, &dk}) x->assign(static_cast<size_t>(T * Hq * K), kSentinel);
    for (auto* x : {&dg, &dbeta}) x->assign(static_cast<size_t>(T * Hv), kSentinel);
    for (auto* x : {&dA_log, &ddt_bias}) x->assign(static_cast<size_t>(Hv), kSentinel);

    fgdn_inputs& in = fa.in;
    in.q = host_tensor(q.data(), FGDN_FLOAT32, {1, T, Hq, K});
    in.k = host_tensor(k.data(), FGDN_FLOAT32, {1, T, Hq, K});
    in.v = host_tensor(v.data(), FGDN_FLOAT32, {1, T, Hv, V});
    in.g = host_tensor(g.data(), FGDN_FLOAT32, {1, T, Hv});
    in.beta = host_tensor(beta.data(), FGDN_FLOAT32, {1, T, Hv});
    in.cu_seqlens = host_tensor(cu.data(), FGDN_INT64, {N + 1});
    in.initial_state = host_tensor(h0.data(), FGDN_FLOAT32, {N, Hv, K, V});
    fa.o = host_tensor(o.data(), FGDN_FLOAT32, {1, T, Hv, V});
    fa.final_state = host_tensor(ht.data(), FGDN_FLOAT32, {N, Hv, K, V});
    fa.output_final_state = 1;

    ba.in = in;
    ba.d_o = host_tensor(d_o.data(), FGDN_FLOAT32, {1, T, Hv, V});
    ba.d_final_state = host_tensor(dht.data(), FGDN_FLOAT32, {N, Hv, K, V});
    ba.dq = host_tensor(dq.data(), FGDN_FLOAT32, {1, T, Hq, K});
    ba.dk = host_tensor(dk.data(), FGDN_FLOAT32, {1, T, Hq, K});
    ba.dv = host_tensor(dv.data(), FGDN_FLOAT32, {1, T, Hv, V});
    ba.dg = host_tensor(dg.data(), FGDN_FLOAT32, {1, T, Hv});
    ba.dbeta = host_tensor(dbeta.data(), FGDN_FLOAT32, {1, T, Hv});
    ba.dh0 = host_tensor(dh0.data(), FGDN_FLOAT32, {N, Hv, K, V});
    if (gate) {
      ba.in.gate_in_kernel = 1;
      ba.in.A_log = host_tensor(A_log.data(), FGDN_FLOAT32, {Hv});
      ba.in.dt_bias = host_tensor(dt_bias.data(), FGDN_FLOAT32, {Hv});
      ba.dA_log = host_tensor(dA_log.data(), FGDN_FLOAT32, {Hv});
      ba.ddt_bias = host_tensor(ddt_bias.data(), FGDN_FLOAT32, {Hv});
    }
  }

  bool outputs_untouched() const {
    for (const auto* out : {&o, &ht, &ck, &dq, &dk, &dv, &dg, &dbeta, &dh0, &dA_log, &ddt_bias})
      for (float x : *out)
        if (x != kSentinel) return false;
    return true;
  }
};

// ---- errors -----------------------------------------------------------------------------

// ||x - ref|| / ||ref|| (||x|| when ref is zero).
inline double rel_l2(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  const size_t n = std::min(x.size(), ref.size());
  for (size_t i = 0; i < n; ++i) {
    const double d = x[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (x.size() != ref.size()) return INFINITY;
  if (den == 0.0) return std::sqrt(num);
  return std::sqrt(num / den);
}

inline bool all_finite(const std::vector<double>& x) {
  for (double e : x)
    if (!std::isfinite(e)) return false;
  return true;
}

// The largest error seen per key (an output tensor, often with its dtype) and the case that gave
// it, printed once when the test program ends. Each test file makes its own with
// add_error_summary.
class ErrorSummary : public ::testing::Environment {
 public:
  ErrorSummary(std::string title, int key_width)
      : title_(std::move(title)), key_width_(key_width) {}

  void record(const std::string& key, double err, const std::string& name) {
    auto& m = max_[key];
    if (err >= m.first) m = {err, name};
  }
  // Key "what (dtype)".
  void record(const std::string& what, fgdn_dtype dt, double err, const std::string& name) {
    record(what + " (" + dtype_name(dt) + ")", err, name);
  }

  void TearDown() override {
    if (max_.empty()) return;
    std::printf("[ %s max relative L2 error vs float64 oracle ]\n", title_.c_str());
    for (const auto& [k, v] : max_)
      std::printf("  %-*s %.3e  (%s)\n", key_width_, k.c_str(), v.first, v.second.c_str());
  }

 private:
  std::string title_;
  int key_width_;
  std::map<std::string, std::pair<double, std::string>> max_;
};

// A new ErrorSummary titled `title`, registered with gtest (which owns it).
inline ErrorSummary& add_error_summary(const std::string& title, int key_width = 30) {
  auto* e = new ErrorSummary(title, key_width);
  ::testing::AddGlobalTestEnvironment(e);
  return *e;
}

// ---- states: dense [R, Hv, K, V] doubles <-> buffers of a state dtype in either layout ------

inline HostBuffer state_buffer(const std::vector<double>& dense, int64_t R, int64_t Hv, int64_t K,
                               int64_t V, bool v_first, fgdn_dtype dt = FGDN_FLOAT32) {
  if (!v_first) return HostBuffer::from(dense, dt);
  std::vector<double> t(dense.size());
  for (int64_t r = 0; r < R * Hv; ++r)
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j)
        t[static_cast<size_t>((r * V + j) * K + i)] = dense[static_cast<size_t>((r * K + i) * V + j)];
  return HostBuffer::from(t, dt);
}
inline std::vector<double> state_dense(const HostBuffer& b, int64_t R, int64_t Hv, int64_t K,
                                       int64_t V, bool v_first) {
  std::vector<double> x = b.to_double();
  if (!v_first) return x;
  std::vector<double> d(x.size());
  for (int64_t r = 0; r < R * Hv; ++r)
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j)
        d[static_cast<size_t>((r * K + i) * V + j)] = x[static_cast<size_t>((r * V + j) * K + i)];
  return d;
}

// ---- a random problem ---------------------------------------------------------------------

enum class Gate {
  Realistic,  // per head A in [0, 16] (head 0: A = 0), g = -A softplus(x + 1), x ~ N(0, 1)
  Zero,       // g = 0 exactly
  Strong,     // g = -20
  Mixed,      // even heads g = 0, odd heads g = -20
  Constant    // g = Spec::gate_value everywhere
};

struct Spec {
  std::string name;
  int64_t B = 1, T = 0;
  std::vector<int64_t> cu;  // non-empty: varlen (B must be 1), cu.back() == T
  int64_t Hq = 1, Hv = 1, K = 64, V = 64;
  fgdn_dtype dt = FGDN_FLOAT32;       // q, k, v (and o, d_o, dq, dk, dv)
  fgdn_dtype g_dt = FGDN_FLOAT32;     // g (a) and dg
  fgdn_dtype beta_dt = FGDN_FLOAT32;  // beta and dbeta
  Gate gate = Gate::Realistic;
  double gate_value = 0.0;    // Gate::Constant
  bool h0 = false;            // initial state
  bool dht = false;           // d_final_state in backward
  bool final_state = true;    // output_final_state in forward
  bool l2norm = false;
  bool gate_in_kernel = false;
  bool dt_bias = true;        // with gate_in_kernel
  double scale = 0.0;         // 0: default
  bool state_indices = false; // pool of N + 2 rows, permuted, the last sequence index -1
  bool v_first = false;
  int64_t checkpoint_every = 0;
  fgdn_precision precision = FGDN_PRECISION_DEFAULT;  // forward and backward
  fgdn_context_parallel context_parallel = FGDN_CONTEXT_PARALLEL_AUTO;  // forward
  int64_t cp_segment = 0;                                              // forward
  bool strided = false;       // q, k, v, g, beta, d_o with padded (non-contiguous) strides
  fgdn_dtype cu_dt = FGDN_INT64;   // cu_seqlens
  fgdn_dtype idx_dt = FGDN_INT32;  // state_indices
  // State dtypes (fp32 | bf16 | fp16): initial state (or pool), final state, its gradient, dh0.
  fgdn_dtype h0_dt = FGDN_FLOAT32;
  fgdn_dtype ht_dt = FGDN_FLOAT32;
  fgdn_dtype dht_dt = FGDN_FLOAT32;
  fgdn_dtype dh0_dt = FGDN_FLOAT32;
  uint64_t seed = 1;

  int64_t N() const { return cu.empty() ? B : static_cast<int64_t>(cu.size()) - 1; }
  int64_t seq_len(int64_t n) const { return cu.empty() ? T : cu[n + 1] - cu[n]; }
};

// gtest prints a parameter by its name.
inline void PrintTo(const Spec& s, std::ostream* os) { *os << s.name; }

// B sequences of T tokens (everything else as Spec's defaults, float32 unless dt says).
inline Spec dense(const std::string& name, int64_t B, int64_t T, int64_t Hq, int64_t Hv, int64_t K,
                  int64_t V, fgdn_dtype dt = FGDN_FLOAT32) {
  Spec s;
  s.name = name;
  s.B = B;
  s.T = T;
  s.Hq = Hq;
  s.Hv = Hv;
  s.K = K;
  s.V = V;
  s.dt = dt;
  return s;
}

// Varlen: one row of cu.back() tokens, split into sequences at cu.
inline Spec varlen(const std::string& name, std::vector<int64_t> cu, int64_t Hq, int64_t Hv,
                   int64_t K, int64_t V, fgdn_dtype dt = FGDN_FLOAT32) {
  Spec s = dense(name, 1, cu.back(), Hq, Hv, K, V, dt);
  s.cu = std::move(cu);
  return s;
}

// The CUDA tests' shapes: K = V = D, bf16 q, k, v unless dt says.
inline Spec dense_d(const std::string& name, int64_t B, int64_t T, int64_t Hq, int64_t Hv,
                    int64_t D, fgdn_dtype dt = FGDN_BFLOAT16) {
  return dense(name, B, T, Hq, Hv, D, D, dt);
}
inline Spec varlen_d(const std::string& name, std::vector<int64_t> cu, int64_t Hq, int64_t Hv,
                     int64_t D, fgdn_dtype dt = FGDN_BFLOAT16) {
  return varlen(name, std::move(cu), Hq, Hv, D, D, dt);
}

// With an initial state.
inline Spec with_h0(Spec s) {
  s.h0 = true;
  return s;
}
// With an initial state and a final-state gradient.
inline Spec with_states(Spec s) {
  s.h0 = true;
  s.dht = true;
  return s;
}
// Every state tensor (initial, final, their gradients) stored in dt.
inline Spec with_state_dtype(Spec s, fgdn_dtype dt) {
  s.h0_dt = s.ht_dt = s.dht_dt = s.dh0_dt = dt;
  return s;
}

// Everything one test call needs: the oracle's problem and (rounded) inputs, and host buffers
// in the library's layouts.
struct Case {
  Spec s;
  reference::Problem rp;
  reference::Inputs ri;             // exactly the values the library sees (already rounded)
  std::vector<double> d_o, d_ht;    // rounded like the library sees them
  std::vector<int64_t> idx;         // state_indices (pool rows), when used
  int64_t P = 0;                    // pool rows
  std::vector<double> pool;         // dense pool [P, Hv, K, V] (state_indices)

  // storage
  int64_t pad = 0;  // extra elements per token row for strided inputs
  HostBuffer q, k, v, g, beta, A_log, dt_bias, cu_buf, h0, idx_buf;
  HostBuffer o, ht, ck, d_o_buf, d_ht_buf, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0;

  explicit Case(const Spec& spec) : s(spec) {
    const int64_t B = s.B, T = s.T, Hq = s.Hq, Hv = s.Hv, K = s.K, V = s.V, N = s.N();
    Rng rng(s.seed);
    rp.B = B; rp.T = T; rp.Hq = Hq; rp.Hv = Hv; rp.K = K; rp.V = V;
    rp.cu_seqlens = s.cu;
    rp.scale = s.scale;
    rp.use_qk_l2norm = s.l2norm;
    rp.gate_in_kernel = s.gate_in_kernel;
    rp.has_initial_state = s.h0;
    rp.checkpoint_every = s.checkpoint_every;
    const int64_t BT = B * T;

    // q, k: raw activations of varying norm with l2norm; otherwise unit-norm keys (so that
    // beta ||k||^2 <= 1 keeps the state bounded) and N(0, 1) queries.
    ri.q = rng.normals(BT * Hq * K);
    ri.k = rng.normals(BT * Hq * K);
    for (int64_t r = 0; r < BT * Hq; ++r) {
      double* kr = &ri.k[static_cast<size_t>(r * K)];
      double* qr = &ri.q[static_cast<size_t>(r * K)];
      if (s.l2norm) {
        const double sc = std::exp(rng.uniform(-1.0, 2.0));
        for (int64_t d = 0; d < K; ++d) { kr[d] *= sc; qr[d] *= sc; }
      } else {
        double nk = 0.0;
        for (int64_t d = 0; d < K; ++d) nk += kr[d] * kr[d];
        nk = std::sqrt(nk);
        for (int64_t d = 0; d < K; ++d) kr[d] /= nk;
      }
    }
    ri.q = round_vec(ri.q, s.dt);
    ri.k = round_vec(ri.k, s.dt);
    ri.v = round_vec(rng.normals(BT * Hv * V), s.dt);
    ri.beta = round_vec(rng.uniforms(BT * Hv, 0.0, 1.0), s.beta_dt);

    if (s.gate_in_kernel) {
      // raw a ~ N(0, 1) with a few entries above the softplus threshold; A in [0.5, 16] and one
      // head with A ~ 1e-13 (no decay); dt_bias in [-1, 1].
      ri.g = rng.normals(BT * Hv);
      for (size_t i = 0; i < ri.g.size(); i += 37) ri.g[i] = 25.0;
      ri.g = round_vec(ri.g, s.g_dt);
      ri.A_log = rng.uniforms(Hv, std::log(0.5), std::log(16.0));
      ri.A_log[0] = -30.0;
      for (auto& x : ri.A_log) x = round_to(x, FGDN_FLOAT32);
      if (s.dt_bias) ri.dt_bias = round_vec(rng.uniforms(Hv, -1.0, 1.0), FGDN_FLOAT32);
    } else {
      std::vector<double> A(static_cast<size_t>(Hv));
      for (int64_t h = 0; h < Hv; ++h) A[static_cast<size_t>(h)] = h == 0 ? 0.0 : rng.uniform(0.0, 16.0);
      ri.g.resize(static_cast<size_t>(BT * Hv));
      for (int64_t i = 0; i < BT * Hv; ++i) {
        const int64_t h = i % Hv;
        double gv = 0.0;
        switch (s.gate) {
          case Gate::Realistic: gv = -A[static_cast<size_t>(h)] * softplus(rng.normal() + 1.0); break;
          case Gate::Zero: gv = 0.0; break;
          case Gate::Strong: gv = -20.0; break;
          case Gate::Mixed: gv = (h % 2 == 0) ? 0.0 : -20.0; break;
          case Gate::Constant: gv = s.gate_value; break;
        }
        ri.g[static_cast<size_t>(i)] = gv;
      }
      ri.g = round_vec(ri.g, s.g_dt);
    }

    if (s.h0) {
      if (s.state_indices) {
        // pool of N + 2 rows; sequence n reads row idx[n] (a permutation), the last sequence -1
        P = N + 2;
        pool = round_vec(rng.normals(P * Hv * K * V, 0.5), s.h0_dt);
        std::vector<int64_t> rows(static_cast<size_t>(P));
        for (int64_t r = 0; r < P; ++r) rows[static_cast<size_t>(r)] = r;
        std::shuffle(rows.begin(), rows.end(), rng.gen);
        idx.assign(rows.begin(), rows.begin() + N);
        if (N >= 2) idx[static_cast<size_t>(N - 1)] = -1;
        ri.h0.assign(static_cast<size_t>(N * Hv * K * V), 0.0);
        for (int64_t n = 0; n < N; ++n) {
          const int64_t r = idx[static_cast<size_t>(n)];
          if (r < 0) continue;
          std::copy(pool.begin() + r * Hv * K * V, pool.begin() + (r + 1) * Hv * K * V,
                    ri.h0.begin() + n * Hv * K * V);
        }
        h0 = state_buffer(pool, P, Hv, K, V, s.v_first, s.h0_dt);
        idx_buf = HostBuffer::from_index(idx, s.idx_dt);
      } else {
        ri.h0 = round_vec(rng.normals(N * Hv * K * V, 0.5), s.h0_dt);
        h0 = state_buffer(ri.h0, N, Hv, K, V, s.v_first, s.h0_dt);
      }
    }
    d_o = round_vec(rng.normals(BT * Hv * V), s.dt);
    if (s.dht) {
      d_ht = round_vec(rng.normals(N * Hv * K * V, 0.1), s.dht_dt);
      d_ht_buf = state_buffer(d_ht, N, Hv, K, V, s.v_first, s.dht_dt);
    }

    // storage
    pad = s.strided ? 5 : 0;
    q = padded(ri.q, s.dt, Hq * K);
    k = padded(ri.k, s.dt, Hq * K);
    v = padded(ri.v, s.dt, Hv * V);
    g = padded(ri.g, s.g_dt, Hv);
    beta = padded(ri.beta, s.beta_dt, Hv);
    d_o_buf = padded(d_o, s.dt, Hv * V);
    if (s.gate_in_kernel) {
      A_log = HostBuffer::from(ri.A_log, FGDN_FLOAT32);
      if (s.dt_bias) dt_bias = HostBuffer::from(ri.dt_bias, FGDN_FLOAT32);
    }
    if (!s.cu.empty()) cu_buf = HostBuffer::from_index(s.cu, s.cu_dt);
  }

  // The initial state (or pool) buffer as first built: forward with state_indices writes final
  // states back into it, so a following backward needs it restored.
  void reset_initial_state() {
    if (!s.h0) return;
    h0 = s.state_indices ? state_buffer(pool, P, s.Hv, s.K, s.V, s.v_first, s.h0_dt)
                         : state_buffer(ri.h0, s.N(), s.Hv, s.K, s.V, s.v_first, s.h0_dt);
  }

  // A [B*T, row] tensor stored with `pad` extra elements after every token row.
  HostBuffer padded(const std::vector<double>& x, fgdn_dtype dt, int64_t row) const {
    const int64_t rows = s.B * s.T;
    std::vector<double> y(static_cast<size_t>(rows * (row + pad)), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < row; ++c)
        y[static_cast<size_t>(r * (row + pad) + c)] = x[static_cast<size_t>(r * row + c)];
    return HostBuffer::from(y, dt);
  }
  fgdn_tensor tok_tensor(HostBuffer& b, int64_t H, int64_t D) const {
    fgdn_tensor t = b.tensor({s.B, s.T, H, D});
    t.strides[2] = D;
    t.strides[1] = H * D + pad;
    t.strides[0] = s.T * t.strides[1];
    return t;
  }
  fgdn_tensor gate_tensor(HostBuffer& b, int64_t H) const {
    fgdn_tensor t = b.tensor({s.B, s.T, H});
    t.strides[1] = H + pad;
    t.strides[0] = s.T * t.strides[1];
    return t;
  }
  fgdn_tensor state_tensor(HostBuffer& b, int64_t R) const {
    return s.v_first ? b.tensor({R, s.Hv, s.V, s.K}) : b.tensor({R, s.Hv, s.K, s.V});
  }

  fgdn_inputs inputs() {
    fgdn_inputs in{};
    in.q = tok_tensor(q, s.Hq, s.K);
    in.k = tok_tensor(k, s.Hq, s.K);
    in.v = tok_tensor(v, s.Hv, s.V);
    in.g = gate_tensor(g, s.Hv);
    in.beta = gate_tensor(beta, s.Hv);
    if (s.gate_in_kernel) {
      in.A_log = A_log.tensor({s.Hv});
      if (s.dt_bias) in.dt_bias = dt_bias.tensor({s.Hv});
    }
    if (!s.cu.empty()) in.cu_seqlens = cu_buf.tensor({s.N() + 1});
    if (s.h0) {
      in.initial_state = state_tensor(h0, s.state_indices ? P : s.N());
      if (s.state_indices) in.state_indices = idx_buf.tensor({s.N()});
    }
    if (s.scale != 0.0) {
      in.scale = s.scale;
      in.has_scale = 1;
    }
    in.use_qk_l2norm_in_kernel = s.l2norm;
    in.gate_in_kernel = s.gate_in_kernel;
    in.state_v_first = s.v_first;
    return in;
  }

  int64_t num_checkpoints() const { return rp.num_checkpoints(); }

  // Forward args with fresh output buffers (filled with a sentinel byte pattern).
  FwdArgs fwd_args() {
    const int64_t BT = s.B * s.T, N = s.N();
    FwdArgs a;
    a.in = inputs();
    a.precision = s.precision;
    a.context_parallel = s.context_parallel;
    a.cp_segment = s.cp_segment;
    o = HostBuffer(s.dt, BT * s.Hv * s.V);
    o.fill_bytes(0x7f);
    a.o = o.tensor({s.B, s.T, s.Hv, s.V});
    if (s.final_state) {
      a.output_final_state = 1;
      if (!s.state_indices) {
        ht = HostBuffer(s.ht_dt, N * s.Hv * s.K * s.V);
        ht.fill_bytes(0x7f);
        a.final_state = state_tensor(ht, N);
      }
    }
    if (s.checkpoint_every > 0) {
      a.checkpoint_every = s.checkpoint_every;
      const int64_t R = num_checkpoints();
      ck = HostBuffer(FGDN_FLOAT32, R * s.Hv * s.K * s.V);
      ck.fill_bytes(0x7f);
      a.checkpoints = state_tensor(ck, R);
    }
    return a;
  }

  // Backward args with fresh gradient buffers.
  BwdArgs bwd_args() {
    const int64_t BT = s.B * s.T, N = s.N();
    BwdArgs a;
    a.in = inputs();
    a.precision = s.precision;
    a.d_o = tok_tensor(d_o_buf, s.Hv, s.V);
    if (s.dht) a.d_final_state = state_tensor(d_ht_buf, N);
    dq = HostBuffer(s.dt, BT * s.Hq * s.K);
    dk = HostBuffer(s.dt, BT * s.Hq * s.K);
    dv = HostBuffer(s.dt, BT * s.Hv * s.V);
    dg = HostBuffer(s.g_dt, BT * s.Hv);
    dbeta = HostBuffer(s.beta_dt, BT * s.Hv);
    for (HostBuffer* b : {&dq, &dk, &dv, &dg, &dbeta}) b->fill_bytes(0x7f);
    a.dq = dq.tensor({s.B, s.T, s.Hq, s.K});
    a.dk = dk.tensor({s.B, s.T, s.Hq, s.K});
    a.dv = dv.tensor({s.B, s.T, s.Hv, s.V});
    a.dg = dg.tensor({s.B, s.T, s.Hv});
    a.dbeta = dbeta.tensor({s.B, s.T, s.Hv});
    if (s.gate_in_kernel) {
      dA_log = HostBuffer(FGDN_FLOAT32, s.Hv);
      dA_log.fill_bytes(0x7f);
      a.dA_log = dA_log.tensor({s.Hv});
      if (s.dt_bias) {
        ddt_bias = HostBuffer(FGDN_FLOAT32, s.Hv);
        ddt_bias.fill_bytes(0x7f);
        a.ddt_bias = ddt_bias.tensor({s.Hv});
      }
    }
    if (s.h0) {
      dh0 = HostBuffer(s.dh0_dt, N * s.Hv * s.K * s.V);
      dh0.fill_bytes(0x7f);
      a.dh0 = state_tensor(dh0, N);
    }
    return a;
  }
};

// ---- state pools (state_indices) ----------------------------------------------------------

// After a forward with state_indices: the final states it wrote into the pool c.h0 (row idx[n]
// of every sequence n with idx[n] >= 0) as `got`, the oracle's final states `ht` of the same
// sequences as `want`, and which pool rows were written.
struct PoolFinalStates {
  std::vector<double> got, want;
  std::vector<char> written;  // per pool row
};
inline PoolFinalStates pool_final_states(const Case& c, const std::vector<double>& ht) {
  const Spec& s = c.s;
  const int64_t HKV = s.Hv * s.K * s.V;
  const std::vector<double> pool = state_dense(c.h0, c.P, s.Hv, s.K, s.V, s.v_first);
  PoolFinalStates p;
  p.written.assign(static_cast<size_t>(c.P), 0);
  for (int64_t n = 0; n < s.N(); ++n) {
    const int64_t r = c.idx[static_cast<size_t>(n)];
    if (r < 0) continue;
    p.written[static_cast<size_t>(r)] = 1;
    p.got.insert(p.got.end(), pool.begin() + r * HKV, pool.begin() + (r + 1) * HKV);
    p.want.insert(p.want.end(), ht.begin() + n * HKV, ht.begin() + (n + 1) * HKV);
  }
  return p;
}

// With state_indices, a sequence with a negative index has no initial state: its dh0 (in the
// oracle's gradients rg) is zero.
inline void zero_dh0_of_unindexed(const Case& c, reference::Grads& rg) {
  if (!(c.s.h0 && c.s.state_indices)) return;
  const int64_t HKV = c.s.Hv * c.s.K * c.s.V;
  for (int64_t n = 0; n < c.s.N(); ++n)
    if (c.idx[static_cast<size_t>(n)] < 0)
      std::fill(rg.dh0.begin() + n * HKV, rg.dh0.begin() + (n + 1) * HKV, 0.0);
}

// Every pool row of c.h0 not written is bitwise as it was `before` the call.
inline void expect_unwritten_rows_unchanged(const Case& c, const std::vector<char>& written,
                                            const std::vector<unsigned char>& before) {
  const size_t row_bytes = static_cast<size_t>(c.s.Hv * c.s.K * c.s.V) * dtype_size(c.h0.dtype);
  for (int64_t r = 0; r < c.P; ++r) {
    if (written[static_cast<size_t>(r)]) continue;
    EXPECT_EQ(0, std::memcmp(c.h0.bytes.data() + r * row_bytes, before.data() + r * row_bytes,
                             row_bytes))
        << c.s.name << ": pool row " << r << " was modified";
  }
}

}  // namespace flashgdn::test
