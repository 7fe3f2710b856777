// Tests of the float64 oracle (reference/gdn_reference.h): its gradients against central finite
// differences of its own forward, and its forward against directly written-out formulas.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gdn_reference.h"

namespace ref = flashgdn::reference;

namespace {

std::vector<double> uniform(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> x(n);
  for (auto& e : x) e = dist(rng);
  return x;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

double norm(const std::vector<double>& a) { return std::sqrt(dot(a, a)); }

enum class GateMode { Random, Zero, StrongDecay };

// Random inputs for a problem. Without l2norm, keys are kept small so that beta ||k||^2 < 2
// and the state stays bounded with g = 0.
ref::Inputs make_inputs(const ref::Problem& p, uint64_t seed, GateMode gate = GateMode::Random,
                        bool with_dt_bias = true) {
  std::mt19937_64 rng(seed);
  const int64_t BT = p.B * p.T;
  ref::Inputs in;
  const double kq = p.use_qk_l2norm ? 1.0 : 0.5;
  in.q = uniform(rng, BT * p.Hq * p.K, -kq, kq);
  in.k = uniform(rng, BT * p.Hq * p.K, -kq, kq);
  in.v = uniform(rng, BT * p.Hv * p.V, -1.0, 1.0);
  in.beta = uniform(rng, BT * p.Hv, 0.1, 0.9);
  if (p.gate_in_kernel) {
    in.g = uniform(rng, BT * p.Hv, -3.0, 3.0);  // raw activation a (far from softplus threshold)
    in.A_log = uniform(rng, p.Hv, -1.5, 0.5);
    if (with_dt_bias) in.dt_bias = uniform(rng, p.Hv, -1.0, 1.0);
  } else if (gate == GateMode::Zero) {
    in.g.assign(BT * p.Hv, 0.0);
  } else if (gate == GateMode::StrongDecay) {
    in.g.assign(BT * p.Hv, -20.0);
  } else {
    in.g = uniform(rng, BT * p.Hv, -1.0, 0.0);
  }
  if (p.has_initial_state) in.h0 = uniform(rng, p.num_seqs() * p.Hv * p.K * p.V, -1.0, 1.0);
  return in;
}

// Loss L = sum(o * W_o) + sum(ht * W_h).
double loss(const ref::Problem& p, const ref::Inputs& in, const std::vector<double>& W_o,
            const std::vector<double>& W_h) {
  const ref::Outputs out = ref::forward(p, in);
  return dot(out.o, W_o) + dot(out.ht, W_h);
}

// Central differences of the loss w.r.t. every element of in.*member.
std::vector<double> finite_diff(const ref::Problem& p, ref::Inputs in,
                                std::vector<double> ref::Inputs::*member,
                                const std::vector<double>& W_o, const std::vector<double>& W_h) {
  constexpr double kStep = 1e-6;
  std::vector<double>& x = in.*member;
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + kStep;
    const double lp = loss(p, in, W_o, W_h);
    x[i] = x0 - kStep;
    const double lm = loss(p, in, W_o, W_h);
    x[i] = x0;
    grad[i] = (lp - lm) / (2.0 * kStep);
  }
  return grad;
}

// ||analytic - fd|| / max(||fd||, floor). The floor only matters for gradients whose true size
// is below what central differences can resolve (e.g. dg at g = -20, of size ~exp(-20)); there
// the comparison is absolute, and a wrong analytic value (missing factor alpha, wrong sign) is
// still far above the tolerance.
double rel_err(const std::vector<double>& analytic, const std::vector<double>& fd) {
  EXPECT_EQ(analytic.size(), fd.size());
  std::vector<double> diff(fd.size());
  for (size_t i = 0; i < fd.size(); ++i) diff[i] = analytic[i] - fd[i];
  return norm(diff) / std::max(norm(fd), 1e-3);
}

struct FdCase {
  ref::Problem p;
  GateMode gate = GateMode::Random;
  bool with_dt_bias = true;
  bool large_activation = false;  // gate_in_kernel: every other a in (21, 30), softplus(x) = x
  uint64_t seed = 1;
};

constexpr double kFdTol = 1e-6;

void check_gradients(const FdCase& c) {
  const ref::Problem& p = c.p;
  ref::Inputs in = make_inputs(p, c.seed, c.gate, c.with_dt_bias);
  std::mt19937_64 rng(c.seed + 1000);
  if (c.large_activation) {
    // a in (22, 30) on every other token; exp(A_log) = 0.03 keeps g = -0.03 * x moderate.
    for (size_t i = 0; i < in.g.size(); i += 2) in.g[i] = 22.0 + 8.0 * (in.g[i] + 3.0) / 6.0;
    in.A_log.assign(p.Hv, std::log(0.03));
  }
  const std::vector<double> W_o = uniform(rng, p.B * p.T * p.Hv * p.V, -1.0, 1.0);
  const std::vector<double> W_h = uniform(rng, p.num_seqs() * p.Hv * p.K * p.V, -1.0, 1.0);

  const ref::Grads gr = ref::backward(p, in, W_o, W_h);

  struct Item {
    const char* name;
    std::vector<double> ref::Inputs::*input;
    const std::vector<double>* grad;
  };
  std::vector<Item> items = {{"q", &ref::Inputs::q, &gr.dq},
                             {"k", &ref::Inputs::k, &gr.dk},
                             {"v", &ref::Inputs::v, &gr.dv},
                             {"g", &ref::Inputs::g, &gr.dg},
                             {"beta", &ref::Inputs::beta, &gr.dbeta}};
  if (p.has_initial_state) items.push_back({"h0", &ref::Inputs::h0, &gr.dh0});
  if (p.gate_in_kernel) {
    items.push_back({"A_log", &ref::Inputs::A_log, &gr.dA_log});
    if (c.with_dt_bias) {
      items.push_back({"dt_bias", &ref::Inputs::dt_bias, &gr.ddt_bias});
    } else {
      EXPECT_EQ(gr.ddt_bias.size(), static_cast<size_t>(p.Hv));
    }
  } else {
    EXPECT_TRUE(gr.dA_log.empty());
  }
  if (!p.has_initial_state) {
    EXPECT_TRUE(gr.dh0.empty());
  }

  for (const Item& it : items) {
    ASSERT_EQ(it.grad->size(), (in.*(it.input)).size()) << it.name;
    const std::vector<double> fd = finite_diff(p, in, it.input, W_o, W_h);
    const double err = rel_err(*it.grad, fd);
    // Guard against vacuous comparisons: the gradient must be non-trivial.
    EXPECT_GT(norm(fd), 0.0) << it.name;
    EXPECT_LT(err, kFdTol) << "d" << it.name << " |fd| = " << norm(fd);
    ::testing::Test::RecordProperty(std::string("rel_err_d") + it.name, std::to_string(err));
    std::printf("    d%-8s n=%-4zu |grad|=%-10.3e rel_err=%.2e\n", it.name, fd.size(), norm(fd),
                err);
  }
}

ref::Problem small(int64_t B, int64_t T, int64_t Hq, int64_t Hv, int64_t K, int64_t V) {
  ref::Problem p;
  p.B = B;
  p.T = T;
  p.Hq = Hq;
  p.Hv = Hv;
  p.K = K;
  p.V = V;
  return p;
}

// Varlen problem (B = 1) from sequence lengths.
ref::Problem varlen(const std::vector<int64_t>& lens, int64_t Hq, int64_t Hv, int64_t K,
                    int64_t V) {
  ref::Problem p = small(1, 0, Hq, Hv, K, V);
  p.cu_seqlens = {0};
  for (int64_t l : lens) p.cu_seqlens.push_back(p.cu_seqlens.back() + l);
  p.T = p.cu_seqlens.back();
  return p;
}

}  // namespace

// ---- 1. finite differences ------------------------------------------------------------------

TEST(ReferenceGrad, DenseB2WithInitialState) {
  FdCase c{small(2, 7, 1, 2, 4, 4)};
  c.p.has_initial_state = true;
  check_gradients(c);
}

TEST(ReferenceGrad, DenseNoInitialStateKNotV) {
  FdCase c{small(2, 6, 2, 4, 8, 4)};
  c.seed = 2;
  check_gradients(c);
}

TEST(ReferenceGrad, VarlenEmptyAndSingleTokenSequences) {
  FdCase c{varlen({0, 1, 5, 0, 4}, 2, 4, 4, 8)};
  c.p.has_initial_state = true;
  c.seed = 3;
  check_gradients(c);
}

TEST(ReferenceGrad, GvaGroup2) {
  FdCase c{small(1, 9, 2, 4, 4, 4)};
  c.p.has_initial_state = true;
  c.seed = 4;
  check_gradients(c);
}

TEST(ReferenceGrad, GvaGroup3NoInitialState) {
  FdCase c{varlen({3, 6}, 1, 3, 8, 4)};
  c.seed = 5;
  check_gradients(c);
}

TEST(ReferenceGrad, QkL2Norm) {
  FdCase c{small(2, 6, 2, 4, 4, 4)};
  c.p.use_qk_l2norm = true;
  c.p.has_initial_state = true;
  c.seed = 6;
  check_gradients(c);
}

TEST(ReferenceGrad, GateInKernel) {
  FdCase c{varlen({4, 1, 0, 5}, 1, 2, 4, 4)};
  c.p.gate_in_kernel = true;
  c.p.has_initial_state = true;
  c.seed = 7;
  check_gradients(c);
}

TEST(ReferenceGrad, GateInKernelNoDtBias) {
  FdCase c{small(1, 8, 1, 2, 4, 4)};
  c.p.gate_in_kernel = true;
  c.with_dt_bias = false;
  c.seed = 8;
  check_gradients(c);
}

// Activations above the softplus threshold (20) take the linear branch, as torch does.
TEST(ReferenceGrad, GateInKernelLargeActivation) {
  FdCase c{small(1, 6, 1, 2, 4, 4)};
  c.p.gate_in_kernel = true;
  c.p.has_initial_state = true;
  c.large_activation = true;
  c.seed = 13;
  check_gradients(c);
}

TEST(ReferenceGrad, AllOptionsCustomScaleCheckpoints) {
  FdCase c{varlen({5, 0, 1, 4}, 2, 6, 4, 8)};
  c.p.use_qk_l2norm = true;
  c.p.gate_in_kernel = true;
  c.p.has_initial_state = true;
  c.p.scale = 0.37;
  c.p.checkpoint_every = 2;  // must not change o, ht or the gradients
  c.seed = 9;
  check_gradients(c);
}

TEST(ReferenceGrad, StronglyDecayingGate) {
  FdCase c{small(2, 5, 1, 2, 4, 4)};
  c.p.has_initial_state = true;
  c.gate = GateMode::StrongDecay;
  c.seed = 10;
  check_gradients(c);
}

TEST(ReferenceGrad, ZeroGate) {
  FdCase c{small(1, 10, 2, 2, 4, 4)};
  c.p.has_initial_state = true;
  c.gate = GateMode::Zero;
  c.seed = 11;
  check_gradients(c);
}

TEST(ReferenceGrad, EmptyDhtEqualsZeroDht) {
  ref::Problem p = varlen({3, 0, 4}, 1, 2, 4, 4);
  p.has_initial_state = true;
  const ref::Inputs in = make_inputs(p, 12);
  std::mt19937_64 rng(12);
  const std::vector<double> d_o = uniform(rng, p.T * p.Hv * p.V, -1.0, 1.0);
  const ref::Grads a = ref::backward(p, in, d_o, {});
  const ref::Grads b =
      ref::backward(p, in, d_o, std::vector<double>(p.num_seqs() * p.Hv * p.K * p.V, 0.0));
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(a.dg, b.dg);
  EXPECT_EQ(a.dbeta, b.dbeta);
  EXPECT_EQ(a.dh0, b.dh0);
  EXPECT_GT(norm(a.dh0), 0.0);
}

// ---- 2. forward sanity ----------------------------------------------------------------------

// beta = 0 and g = 0: nothing is written and nothing decays, so S_t = h0 for every t,
// o_t = scale * h0^T q_t and ht = h0.
TEST(ReferenceForward, FrozenStateReadsInitialState) {
  ref::Problem p = varlen({3, 0, 2}, 1, 2, 4, 3);
  p.has_initial_state = true;
  p.scale = 0.6;
  ref::Inputs in = make_inputs(p, 20, GateMode::Zero);
  in.beta.assign(in.beta.size(), 0.0);
  const ref::Outputs out = ref::forward(p, in);
  EXPECT_EQ(out.ht, in.h0);
  const int64_t K = p.K, V = p.V;
  for (int64_t n = 0; n < p.num_seqs(); ++n)
    for (int64_t t = p.seq_begin(n); t < p.seq_begin(n) + p.seq_len(n); ++t)
      for (int64_t h = 0; h < p.Hv; ++h)
        for (int64_t j = 0; j < V; ++j) {
          double expect = 0.0;
          for (int64_t i = 0; i < K; ++i)
            expect += in.h0[((n * p.Hv + h) * K + i) * V + j] * in.q[(t * p.Hq + 0) * K + i];
          EXPECT_NEAR(out.o[(t * p.Hv + h) * V + j], p.scale * expect, 1e-14);
        }
}

// One token, K = V = 1, numbers worked by hand:
//   S0 = 2, q = 3, k = 0.5, v = 1, alpha = 0.5, beta = 0.5, scale = 1
//   S~ = 1;  r = 1 - 1 * 0.5 = 0.5;  S1 = 1 + 0.5 * 0.5 * 0.5 = 1.125;  o = 3 * 1.125 = 3.375
TEST(ReferenceForward, SingleTokenByHand) {
  ref::Problem p = small(1, 1, 1, 1, 1, 1);
  p.has_initial_state = true;
  p.scale = 1.0;
  ref::Inputs in;
  in.q = {3.0};
  in.k = {0.5};
  in.v = {1.0};
  in.g = {std::log(0.5)};
  in.beta = {0.5};
  in.h0 = {2.0};
  const ref::Outputs out = ref::forward(p, in);
  EXPECT_NEAR(out.ht[0], 1.125, 1e-15);
  EXPECT_NEAR(out.o[0], 3.375, 1e-15);
}

// One token with every option, against the closed form
//   S1 = alpha (I - beta k k^T) S0 + beta k v^T,  o = scale S1^T q
// with q, k l2-normalised and g = -exp(A_log) softplus(a + dt_bias), written out directly.
TEST(ReferenceForward, SingleTokenClosedFormAllOptions) {
  ref::Problem p = small(1, 1, 1, 2, 3, 2);  // GVA: both value heads read q/k head 0
  p.has_initial_state = true;
  p.use_qk_l2norm = true;
  p.gate_in_kernel = true;
  const ref::Inputs in = make_inputs(p, 21);
  const ref::Outputs out = ref::forward(p, in);
  const int64_t K = p.K, V = p.V;
  const double scale = 1.0 / std::sqrt(3.0);

  double qq = 0.0, kk = 0.0;
  for (int64_t i = 0; i < K; ++i) {
    qq += in.q[i] * in.q[i];
    kk += in.k[i] * in.k[i];
  }
  std::vector<double> qn(K), kn(K);
  for (int64_t i = 0; i < K; ++i) {
    qn[i] = in.q[i] / std::sqrt(qq + 1e-6);
    kn[i] = in.k[i] / std::sqrt(kk + 1e-6);
  }
  for (int64_t h = 0; h < p.Hv; ++h) {
    const double x = in.g[h] + in.dt_bias[h];
    const double g = -std::exp(in.A_log[h]) * std::log(1.0 + std::exp(x));
    const double alpha = std::exp(g), beta = in.beta[h];
    const double* S0 = &in.h0[h * K * V];
    std::vector<double> S1(K * V);
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) {
        double proj = 0.0;  // ((I - beta k k^T) S0)[i][j]
        for (int64_t l = 0; l < K; ++l)
          proj += ((i == l ? 1.0 : 0.0) - beta * kn[i] * kn[l]) * S0[l * V + j];
        S1[i * V + j] = alpha * proj + beta * kn[i] * in.v[h * V + j];
        EXPECT_NEAR(out.ht[(h * K + i) * V + j], S1[i * V + j], 1e-14);
      }
    for (int64_t j = 0; j < V; ++j) {
      double o = 0.0;
      for (int64_t i = 0; i < K; ++i) o += S1[i * V + j] * qn[i];
      EXPECT_NEAR(out.o[h * V + j], scale * o, 1e-14);
    }
  }
}

// Value head h reads q/k head h / (Hv / Hq): a GVA run equals a run with q, k repeated per
// value head (repeat_interleave), Hq = Hv.
TEST(ReferenceForward, GvaEqualsRepeatedHeads) {
  ref::Problem p = small(2, 5, 2, 6, 4, 4);
  p.has_initial_state = true;
  const ref::Inputs in = make_inputs(p, 22);
  ref::Problem pr = p;
  pr.Hq = p.Hv;
  ref::Inputs ir = in;
  const int64_t G = p.Hv / p.Hq, K = p.K;
  ir.q.assign(p.B * p.T * p.Hv * K, 0.0);
  ir.k.assign(p.B * p.T * p.Hv * K, 0.0);
  for (int64_t bt = 0; bt < p.B * p.T; ++bt)
    for (int64_t h = 0; h < p.Hv; ++h)
      for (int64_t i = 0; i < K; ++i) {
        ir.q[(bt * p.Hv + h) * K + i] = in.q[(bt * p.Hq + h / G) * K + i];
        ir.k[(bt * p.Hv + h) * K + i] = in.k[(bt * p.Hq + h / G) * K + i];
      }
  const ref::Outputs a = ref::forward(p, in), b = ref::forward(pr, ir);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.ht, b.ht);
}

// Dense B sequences of T tokens == varlen with cu_seqlens {0, T, 2T, ...}.
TEST(ReferenceForward, DenseEqualsVarlen) {
  ref::Problem p = small(3, 4, 1, 2, 4, 4);
  p.has_initial_state = true;
  const ref::Inputs in = make_inputs(p, 23);
  ref::Problem pv = varlen({4, 4, 4}, 1, 2, 4, 4);
  pv.has_initial_state = true;
  const ref::Outputs a = ref::forward(p, in), b = ref::forward(pv, in);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.ht, b.ht);
}

// Checkpoint j of sequence n (row offset_n + j) is the final state of a run over the first
// (j + 1) * every tokens of that sequence, from the same initial state.
TEST(ReferenceForward, CheckpointsEqualTruncatedRuns) {
  const int64_t every = 2, Hq = 1, Hv = 2, K = 4, V = 3, KV = K * V;
  ref::Problem p = varlen({5, 0, 7, 1, 2}, Hq, Hv, K, V);
  p.has_initial_state = true;
  p.gate_in_kernel = true;
  p.use_qk_l2norm = true;
  p.checkpoint_every = every;
  const ref::Inputs in = make_inputs(p, 24);
  const ref::Outputs out = ref::forward(p, in);
  ASSERT_EQ(p.num_checkpoints(), 2 + 0 + 3 + 0 + 1);
  ASSERT_EQ(out.checkpoints.size(), static_cast<size_t>(6 * Hv * KV));

  int64_t row = 0;
  for (int64_t n = 0; n < p.num_seqs(); ++n) {
    const int64_t begin = p.seq_begin(n);
    for (int64_t j = 0; j < p.seq_len(n) / every; ++j, ++row) {
      const int64_t len = (j + 1) * every;
      ref::Problem pt = varlen({len}, Hq, Hv, K, V);
      pt.has_initial_state = true;
      pt.gate_in_kernel = true;
      pt.use_qk_l2norm = true;
      ref::Inputs it;
      it.q.assign(in.q.begin() + begin * Hq * K, in.q.begin() + (begin + len) * Hq * K);
      it.k.assign(in.k.begin() + begin * Hq * K, in.k.begin() + (begin + len) * Hq * K);
      it.v.assign(in.v.begin() + begin * Hv * V, in.v.begin() + (begin + len) * Hv * V);
      it.g.assign(in.g.begin() + begin * Hv, in.g.begin() + (begin + len) * Hv);
      it.beta.assign(in.beta.begin() + begin * Hv, in.beta.begin() + (begin + len) * Hv);
      it.A_log = in.A_log;
      it.dt_bias = in.dt_bias;
      it.h0.assign(in.h0.begin() + n * Hv * KV, in.h0.begin() + (n + 1) * Hv * KV);
      const ref::Outputs ot = ref::forward(pt, it);
      const std::vector<double> ck(out.checkpoints.begin() + row * Hv * KV,
                                   out.checkpoints.begin() + (row + 1) * Hv * KV);
      EXPECT_EQ(ck, ot.ht) << "sequence " << n << " checkpoint " << j;
    }
  }
  // Without checkpoints requested, none are produced, and o / ht do not change.
  ref::Problem p0 = p;
  p0.checkpoint_every = 0;
  const ref::Outputs out0 = ref::forward(p0, in);
  EXPECT_TRUE(out0.checkpoints.empty());
  EXPECT_EQ(out0.o, out.o);
  EXPECT_EQ(out0.ht, out.ht);
}

// Results are bitwise identical for any thread count.
TEST(ReferenceForward, DeterministicAcrossThreadCounts) {
  ref::Problem p = varlen({9, 0, 13, 1}, 2, 6, 8, 8);
  p.has_initial_state = true;
  p.gate_in_kernel = true;
  p.use_qk_l2norm = true;
  const ref::Inputs in = make_inputs(p, 25);
  std::mt19937_64 rng(25);
  const std::vector<double> d_o = uniform(rng, p.T * p.Hv * p.V, -1.0, 1.0);
  const std::vector<double> d_ht = uniform(rng, p.num_seqs() * p.Hv * p.K * p.V, -1.0, 1.0);

  const char* old = std::getenv("FLASHGDN_NUM_THREADS");
  const std::string saved = old ? old : "";
  setenv("FLASHGDN_NUM_THREADS", "1", 1);
  const ref::Outputs o1 = ref::forward(p, in);
  const ref::Grads g1 = ref::backward(p, in, d_o, d_ht);
  setenv("FLASHGDN_NUM_THREADS", "5", 1);
  const ref::Outputs o5 = ref::forward(p, in);
  const ref::Grads g5 = ref::backward(p, in, d_o, d_ht);
  if (old) {
    setenv("FLASHGDN_NUM_THREADS", saved.c_str(), 1);
  } else {
    unsetenv("FLASHGDN_NUM_THREADS");
  }

  EXPECT_EQ(o1.o, o5.o);
  EXPECT_EQ(o1.ht, o5.ht);
  EXPECT_EQ(g1.dq, g5.dq);
  EXPECT_EQ(g1.dk, g5.dk);
  EXPECT_EQ(g1.dv, g5.dv);
  EXPECT_EQ(g1.dg, g5.dg);
  EXPECT_EQ(g1.dbeta, g5.dbeta);
  EXPECT_EQ(g1.dA_log, g5.dA_log);
  EXPECT_EQ(g1.ddt_bias, g5.ddt_bias);
  EXPECT_EQ(g1.dh0, g5.dh0);
}

TEST(ReferenceForward, RejectsBadShapes) {
  ref::Problem p = small(1, 3, 1, 2, 4, 4);
  ref::Inputs in = make_inputs(p, 26);
  EXPECT_NO_THROW(ref::forward(p, in));
  ref::Inputs bad = in;
  bad.v.pop_back();
  EXPECT_THROW(ref::forward(p, bad), std::invalid_argument);
  ref::Problem pg = p;
  pg.Hq = 3;  // Hv % Hq != 0
  EXPECT_THROW(ref::forward(pg, in), std::invalid_argument);
  ref::Problem pc = p;
  pc.cu_seqlens = {0, 2};  // does not end at T
  EXPECT_THROW(ref::forward(pc, in), std::invalid_argument);
}
