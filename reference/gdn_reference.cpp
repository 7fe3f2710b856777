// float64 oracle of the gated delta rule (see gdn_reference.h and gdn-math sections 1-2).
//
// Work is split into independent (sequence, value head) pairs that run on std::threads. Every
// pair writes only its own slice of the outputs, or its own slice of a partial-sum buffer; the
// few cross-pair sums (dq/dk over the value heads of a GVA group, dA_log/ddt_bias over all
// tokens) are reduced afterwards in a fixed order, so results are bitwise independent of the
// thread count and of scheduling.
//
// States are contiguous K x V row-major double arrays; every inner loop runs over V.

#include "gdn_reference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>

namespace flashgdn::reference {

// ---- Problem helpers ------------------------------------------------------------------------

int64_t Problem::num_seqs() const {
  return cu_seqlens.empty() ? B : static_cast<int64_t>(cu_seqlens.size()) - 1;
}

int64_t Problem::seq_begin(int64_t n) const { return cu_seqlens.empty() ? 0 : cu_seqlens[n]; }

int64_t Problem::seq_len(int64_t n) const {
  return cu_seqlens.empty() ? T : cu_seqlens[n + 1] - cu_seqlens[n];
}

int64_t Problem::seq_batch(int64_t n) const { return cu_seqlens.empty() ? n : 0; }

double Problem::resolved_scale() const {
  return scale != 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(K));
}

int64_t Problem::num_checkpoints() const {
  if (checkpoint_every <= 0) return 0;
  int64_t total = 0;
  for (int64_t n = 0; n < num_seqs(); ++n) total += seq_len(n) / checkpoint_every;
  return total;
}

namespace {

constexpr double kL2NormEps = 1e-6;          // FLA: x * rsqrt(sum(x^2) + 1e-6)
constexpr double kSoftplusThreshold = 20.0;  // torch.nn.functional.softplus default

// softplus(x) = log(1 + exp(x)), linear above the threshold (as torch does).
double softplus(double x) { return x > kSoftplusThreshold ? x : std::log1p(std::exp(x)); }

// d softplus / dx = sigmoid(x) (1 above the threshold, matching the forward's linear branch).
double softplus_grad(double x) {
  if (x > kSoftplusThreshold) return 1.0;
  if (x >= 0.0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

// ---- validation -----------------------------------------------------------------------------

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("flashgdn::reference: " + what);
}

void require_size(const std::vector<double>& x, int64_t n, const char* name) {
  require(static_cast<int64_t>(x.size()) == n,
          std::string(name) + " has " + std::to_string(x.size()) + " elements, expected " +
              std::to_string(n));
}

void validate(const Problem& p, const Inputs& in) {
  require(p.B >= 1 && p.T >= 0 && p.Hq >= 1 && p.Hv >= 1 && p.K >= 1 && p.V >= 1,
          "dimensions must be positive (T >= 0)");
  require(p.Hv % p.Hq == 0, "Hv must be a multiple of Hq");
  require(std::isfinite(p.scale), "scale must be finite");
  require(p.checkpoint_every >= 0, "checkpoint_every must be >= 0");
  if (!p.cu_seqlens.empty()) {
    require(p.B == 1, "cu_seqlens requires B == 1");
    require(p.cu_seqlens.size() >= 2, "cu_seqlens needs at least 2 entries");
    require(p.cu_seqlens.front() == 0, "cu_seqlens must start at 0");
    require(p.cu_seqlens.back() == p.T, "cu_seqlens must end at T");
    for (size_t i = 1; i < p.cu_seqlens.size(); ++i)
      require(p.cu_seqlens[i] >= p.cu_seqlens[i - 1], "cu_seqlens must be non-decreasing");
  }
  const int64_t BT = p.B * p.T;
  require_size(in.q, BT * p.Hq * p.K, "q");
  require_size(in.k, BT * p.Hq * p.K, "k");
  require_size(in.v, BT * p.Hv * p.V, "v");
  require_size(in.g, BT * p.Hv, "g");
  require_size(in.beta, BT * p.Hv, "beta");
  if (p.gate_in_kernel) {
    require_size(in.A_log, p.Hv, "A_log");
    if (!in.dt_bias.empty()) require_size(in.dt_bias, p.Hv, "dt_bias");
  }
  if (p.has_initial_state) require_size(in.h0, p.num_seqs() * p.Hv * p.K * p.V, "h0");
}

// ---- threading ------------------------------------------------------------------------------

int num_threads() {
  if (const char* env = std::getenv("FLASHGDN_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

// Runs body(i) for i in [0, count). Each i must write only memory no other i touches, so the
// result does not depend on which thread runs which i.
void parallel_for(int64_t count, const std::function<void(int64_t)>& body) {
  const int64_t workers = std::min<int64_t>(num_threads(), count);
  if (workers <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next++; i < count; i = next++) body(i);
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

// ---- per-token inputs -----------------------------------------------------------------------

// Index arithmetic for the dense row-major layouts of the header.
struct Layout {
  int64_t T, Hq, Hv, K, V;
  explicit Layout(const Problem& p) : T(p.T), Hq(p.Hq), Hv(p.Hv), K(p.K), V(p.V) {}
  int64_t qk(int64_t b, int64_t t, int64_t hq) const { return ((b * T + t) * Hq + hq) * K; }
  int64_t vo(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hv + h) * V; }
  int64_t gb(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * Hv + h; }
  // per-value-head copy of a K-vector (partial dq/dk before the GVA reduction)
  int64_t qk_per_vhead(int64_t b, int64_t t, int64_t h) const {
    return ((b * T + t) * Hv + h) * K;
  }
  int64_t state(int64_t n, int64_t h) const { return (n * Hv + h) * K * V; }
};

// x_hat = x / sqrt(sum x^2 + eps); returns 1 / sqrt(sum x^2 + eps).
double l2normalize(const double* x, int64_t n, double* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss + kL2NormEps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
  return inv;
}

// The inputs of one token as the recurrence sees them (after l2norm and the gate computation)
// for one value head h of sequence n.
struct TokenInputs {
  const Problem& p;
  const Inputs& in;
  Layout L;
  int64_t b, begin, h, hq;
  std::vector<double> q, k;  // K, normalised when use_qk_l2norm
  const double* v = nullptr;
  double g = 0.0, alpha = 1.0, beta = 0.0;
  double gate_x = 0.0;  // gate_in_kernel: x = a + dt_bias[h]

  TokenInputs(const Problem& p_, const Inputs& in_, int64_t n, int64_t h_)
      : p(p_), in(in_), L(p_), b(p_.seq_batch(n)), begin(p_.seq_begin(n)), h(h_),
        hq(h_ / (p_.Hv / p_.Hq)), q(p_.K), k(p_.K) {}

  // Loads token t (0-based within the sequence). With need_q false, q is left untouched.
  void load(int64_t t, bool need_q) {
    const int64_t tt = begin + t;
    const double* qr = &in.q[L.qk(b, tt, hq)];
    const double* kr = &in.k[L.qk(b, tt, hq)];
    if (p.use_qk_l2norm) {
      if (need_q) l2normalize(qr, p.K, q.data());
      l2normalize(kr, p.K, k.data());
    } else {
      if (need_q) std::copy(qr, qr + p.K, q.begin());
      std::copy(kr, kr + p.K, k.begin());
    }
    v = &in.v[L.vo(b, tt, h)];
    beta = in.beta[L.gb(b, tt, h)];
    if (p.gate_in_kernel) {
      // g = -exp(A_log[h]) * softplus(a + dt_bias[h])
      gate_x = in.g[L.gb(b, tt, h)] + (in.dt_bias.empty() ? 0.0 : in.dt_bias[h]);
      g = -std::exp(in.A_log[h]) * softplus(gate_x);
    } else {
      g = in.g[L.gb(b, tt, h)];
    }
    alpha = std::exp(g);
  }
};

// ---- the two halves of one recurrence step -------------------------------------------------

// Delta: r = v - S~^T k with S~ = alpha * S_prev   (S_prev is K x V row-major).
void delta(const double* S_prev, const double* k, const double* v, double alpha, int64_t K,
           int64_t V, double* r) {
  for (int64_t j = 0; j < V; ++j) r[j] = 0.0;
  for (int64_t i = 0; i < K; ++i) {  // r = S_prev^T k
    const double ki = k[i];
    const double* row = S_prev + i * V;
    for (int64_t j = 0; j < V; ++j) r[j] += ki * row[j];
  }
  for (int64_t j = 0; j < V; ++j) r[j] = v[j] - alpha * r[j];
}

// Write and read: S = alpha * S_prev + beta * k r^T; then, if o is given, o = scale * S^T q.
// S may alias S_prev (the update is element-wise).
void write_read(const double* S_prev, double* S, const double* k, const double* r, double alpha,
                double beta, int64_t K, int64_t V, const double* q, double scale, double* o) {
  if (o)
    for (int64_t j = 0; j < V; ++j) o[j] = 0.0;
  for (int64_t i = 0; i < K; ++i) {
    const double bk = beta * k[i];
    const double* prev = S_prev + i * V;
    double* row = S + i * V;
    for (int64_t j = 0; j < V; ++j) row[j] = alpha * prev[j] + bk * r[j];
    if (o) {
      const double qi = q[i];
      for (int64_t j = 0; j < V; ++j) o[j] += qi * row[j];
    }
  }
  if (o)
    for (int64_t j = 0; j < V; ++j) o[j] *= scale;
}

// ---- forward --------------------------------------------------------------------------------

// Runs the recurrence of one (sequence n, value head h) pair, writing o, ht and checkpoints.
void forward_pair(const Problem& p, const Inputs& in, int64_t n, int64_t h,
                  int64_t checkpoint_row0, Outputs& out) {
  const Layout L(p);
  const int64_t K = p.K, V = p.V, len = p.seq_len(n);
  const double scale = p.resolved_scale();
  TokenInputs tok(p, in, n, h);

  // S_0 = h0 (or zero)
  std::vector<double> S(K * V, 0.0);
  if (p.has_initial_state) {
    const double* h0 = &in.h0[L.state(n, h)];
    std::copy(h0, h0 + K * V, S.begin());
  }
  std::vector<double> r(V);
  for (int64_t t = 0; t < len; ++t) {
    tok.load(t, /*need_q=*/true);
    double* o = &out.o[L.vo(tok.b, tok.begin + t, h)];
    delta(S.data(), tok.k.data(), tok.v, tok.alpha, K, V, r.data());
    write_read(S.data(), S.data(), tok.k.data(), r.data(), tok.alpha, tok.beta, K, V,
               tok.q.data(), scale, o);
    // checkpoint j (0-based) holds the state after (j + 1) * checkpoint_every tokens
    if (p.checkpoint_every > 0 && (t + 1) % p.checkpoint_every == 0) {
      const int64_t row = checkpoint_row0 + (t + 1) / p.checkpoint_every - 1;
      std::copy(S.begin(), S.end(), out.checkpoints.begin() + (row * p.Hv + h) * K * V);
    }
  }
  std::copy(S.begin(), S.end(), out.ht.begin() + L.state(n, h));
}

// Row of sequence n's first checkpoint: sum_{m < n} floor(len_m / checkpoint_every).
std::vector<int64_t> checkpoint_offsets(const Problem& p) {
  std::vector<int64_t> off(p.num_seqs() + 1, 0);
  for (int64_t n = 0; n < p.num_seqs(); ++n)
    off[n + 1] = off[n] + (p.checkpoint_every > 0 ? p.seq_len(n) / p.checkpoint_every : 0);
  return off;
}

// ---- backward -------------------------------------------------------------------------------

// Per-pair partial sums that cross pairs: reduced in fixed order after all pairs finish.
struct PairPartials {
  double dA_log = 0.0, ddt_bias = 0.0;
};

// Reverse mode of one (sequence n, value head h) pair (gdn-math section 2).
//
// Memory: the states S_{t-1} are recomputed blockwise. A forward sweep stores the state at the
// start of every block of C ~ sqrt(len) tokens; the backward sweep then, block by block from the
// last, recomputes the C states of the block and walks its tokens in reverse. This needs
// ~2 sqrt(len) states instead of len, for one extra forward sweep.
//
// Writes dv, dbeta, dg (w.r.t. g, or w.r.t. the activation a with gate_in_kernel) and dh0 of
// this pair directly, and the gradients w.r.t. the (normalised) q and k of this value head into
// dq_part / dk_part [B, T, Hv, K].
void backward_pair(const Problem& p, const Inputs& in, const std::vector<double>& d_o,
                   const std::vector<double>& d_ht, int64_t n, int64_t h, Grads& gr,
                   std::vector<double>& dq_part, std::vector<double>& dk_part,
                   PairPartials& partial) {
  const Layout L(p);
  const int64_t K = p.K, V = p.V, KV = K * V, len = p.seq_len(n);
  const double scale = p.resolved_scale();
  TokenInputs tok(p, in, n, h);

  const int64_t C = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(std::sqrt(double(len)))));
  const int64_t num_blocks = (len + C - 1) / C;

  // Forward sweep: block_start[c] = S_{c*C}, the state before token c*C.
  std::vector<double> block_start(num_blocks * KV);
  std::vector<double> S(KV, 0.0), r(V);
  if (p.has_initial_state) {
    const double* h0 = &in.h0[L.state(n, h)];
    std::copy(h0, h0 + KV, S.begin());
  }
  for (int64_t t = 0; t < len; ++t) {
    if (t % C == 0) std::copy(S.begin(), S.end(), block_start.begin() + (t / C) * KV);
    tok.load(t, /*need_q=*/false);
    delta(S.data(), tok.k.data(), tok.v, tok.alpha, K, V, r.data());
    write_read(S.data(), S.data(), tok.k.data(), r.data(), tok.alpha, tok.beta, K, V, nullptr,
               0.0, nullptr);
  }

  // dS = dS_T (zero if d_ht is empty)
  std::vector<double> dS(KV, 0.0);
  if (!d_ht.empty()) {
    const double* src = &d_ht[L.state(n, h)];
    std::copy(src, src + KV, dS.begin());
  }

  std::vector<double> S_prev(C * KV);  // S_prev[t - t0] = S_{t-1} for token t of the block
  std::vector<double> r_blk(C * V);    // r_t of the block's tokens
  std::vector<double> u(V), du(V), dr(V), dq(K), dk(K);
  const double neg_exp_A = p.gate_in_kernel ? -std::exp(in.A_log[h]) : 0.0;

  for (int64_t c = num_blocks - 1; c >= 0; --c) {
    const int64_t t0 = c * C, t1 = std::min(len, t0 + C);
    // Recompute the block: S_{t-1} and r_t for t in [t0, t1).
    std::copy(block_start.begin() + c * KV, block_start.begin() + (c + 1) * KV, S_prev.begin());
    for (int64_t t = t0; t < t1; ++t) {
      tok.load(t, /*need_q=*/false);
      const double* Sp = &S_prev[(t - t0) * KV];
      double* rt = &r_blk[(t - t0) * V];
      delta(Sp, tok.k.data(), tok.v, tok.alpha, K, V, rt);
      if (t + 1 < t1)
        write_read(Sp, &S_prev[(t + 1 - t0) * KV], tok.k.data(), rt, tok.alpha, tok.beta, K, V,
                   nullptr, 0.0, nullptr);
    }

    // Walk the block's tokens in reverse. On entry dS holds the gradient w.r.t. S_t coming from
    // later tokens (and d_ht); on exit, the gradient w.r.t. S_{t-1}.
    for (int64_t t = t1 - 1; t >= t0; --t) {
      tok.load(t, /*need_q=*/true);
      const int64_t tt = tok.begin + t;
      const double* Sp = &S_prev[(t - t0) * KV];  // S_{t-1}; S~_t = alpha * S_{t-1}
      const double* rt = &r_blk[(t - t0) * V];
      const double* dot = &d_o[L.vo(tok.b, tt, h)];
      const double* k = tok.k.data();
      const double* q = tok.q.data();
      const double alpha = tok.alpha, beta = tok.beta;

      // u_t = beta r_t
      for (int64_t j = 0; j < V; ++j) u[j] = beta * rt[j];

      // dS_t += scale q_t do_t^T;  dk_t = dS_t u_t;  du_t = dS_t^T k_t
      for (int64_t j = 0; j < V; ++j) du[j] = 0.0;
      for (int64_t i = 0; i < K; ++i) {
        const double sq = scale * q[i], ki = k[i];
        double* row = &dS[i * V];
        double acc = 0.0;
        for (int64_t j = 0; j < V; ++j) {
          row[j] += sq * dot[j];
          acc += row[j] * u[j];
          du[j] += row[j] * ki;
        }
        dk[i] = acc;
      }

      // dbeta_t = r_t . du_t;  dr_t = beta du_t;  dv_t = dr_t
      double dbeta = 0.0, r_dot_do = 0.0;
      double* dv = &gr.dv[L.vo(tok.b, tt, h)];
      for (int64_t j = 0; j < V; ++j) {
        dbeta += rt[j] * du[j];
        r_dot_do += rt[j] * dot[j];
        dr[j] = beta * du[j];
        dv[j] = dr[j];
      }

      // With S_t = alpha S_{t-1} + beta k r^T and S~_t = alpha S_{t-1}:
      //   dq_t   = scale S_t do_t = scale (alpha S_{t-1} do_t + beta k_t (r_t . do_t))
      //   dk_t  -= S~_t dr_t      = alpha S_{t-1} dr_t
      //   dS~_t  = dS_t - k_t dr_t^T
      //   dg_t   = <dS~_t, S~_t>  = alpha <dS~_t, S_{t-1}>
      //   dS_{t-1} = alpha dS~_t
      double frob = 0.0;
      for (int64_t i = 0; i < K; ++i) {
        const double ki = k[i];
        const double* sp = Sp + i * V;
        double* row = &dS[i * V];
        double s_do = 0.0, s_dr = 0.0;
        for (int64_t j = 0; j < V; ++j) {
          s_do += sp[j] * dot[j];
          s_dr += sp[j] * dr[j];
          const double dst = row[j] - ki * dr[j];  // dS~_t
          frob += dst * sp[j];
          row[j] = alpha * dst;  // dS_{t-1}
        }
        dq[i] = scale * (alpha * s_do + beta * ki * r_dot_do);
        dk[i] -= alpha * s_dr;
      }
      const double dg = alpha * frob;

      std::copy(dq.begin(), dq.end(), dq_part.begin() + L.qk_per_vhead(tok.b, tt, h));
      std::copy(dk.begin(), dk.end(), dk_part.begin() + L.qk_per_vhead(tok.b, tt, h));
      gr.dbeta[L.gb(tok.b, tt, h)] = dbeta;

      if (p.gate_in_kernel) {
        // g = -exp(A_log) softplus(x), x = a + dt_bias:
        //   dA_log += dg * g;   da = ddt_bias contribution = dg * (-exp(A_log)) softplus'(x)
        // At a reset (alpha = 0, so dg = 0) both are 0, also where g or exp(A_log) is infinite.
        const double da = dg == 0.0 ? 0.0 : dg * neg_exp_A * softplus_grad(tok.gate_x);
        if (dg != 0.0) partial.dA_log += dg * tok.g;
        partial.ddt_bias += da;
        gr.dg[L.gb(tok.b, tt, h)] = da;
      } else {
        gr.dg[L.gb(tok.b, tt, h)] = dg;
      }
    }
  }

  // dS_0 is the gradient of the initial state.
  if (p.has_initial_state) std::copy(dS.begin(), dS.end(), gr.dh0.begin() + L.state(n, h));
}

// l2norm backward: for x_hat = x * inv with inv = 1/sqrt(sum x^2 + eps),
//   dx = inv * (dx_hat - x_hat (x_hat . dx_hat)).
void l2normalize_backward(const double* x, const double* dx_hat, int64_t n, double* dx,
                          double* scratch) {
  const double inv = l2normalize(x, n, scratch);  // scratch = x_hat
  double proj = 0.0;
  for (int64_t i = 0; i < n; ++i) proj += scratch[i] * dx_hat[i];
  for (int64_t i = 0; i < n; ++i) dx[i] = inv * (dx_hat[i] - scratch[i] * proj);
}

}  // namespace

// ---- public entry points --------------------------------------------------------------------

Outputs forward(const Problem& p, const Inputs& in) {
  validate(p, in);
  const int64_t N = p.num_seqs(), KV = p.K * p.V;
  Outputs out;
  out.o.assign(p.B * p.T * p.Hv * p.V, 0.0);
  out.ht.assign(N * p.Hv * KV, 0.0);
  out.checkpoints.assign(p.num_checkpoints() * p.Hv * KV, 0.0);
  const std::vector<int64_t> ck_off = checkpoint_offsets(p);

  parallel_for(N * p.Hv, [&](int64_t pair) {
    const int64_t n = pair / p.Hv, h = pair % p.Hv;
    forward_pair(p, in, n, h, ck_off[n], out);
  });
  return out;
}

Grads backward(const Problem& p, const Inputs& in, const std::vector<double>& d_o,
               const std::vector<double>& d_ht) {
  validate(p, in);
  const int64_t N = p.num_seqs(), KV = p.K * p.V, BT = p.B * p.T;
  require_size(d_o, BT * p.Hv * p.V, "d_o");
  if (!d_ht.empty()) require_size(d_ht, N * p.Hv * KV, "d_ht");

  Grads gr;
  gr.dq.assign(in.q.size(), 0.0);
  gr.dk.assign(in.k.size(), 0.0);
  gr.dv.assign(in.v.size(), 0.0);
  gr.dg.assign(in.g.size(), 0.0);
  gr.dbeta.assign(in.beta.size(), 0.0);
  if (p.gate_in_kernel) {
    gr.dA_log.assign(p.Hv, 0.0);
    gr.ddt_bias.assign(p.Hv, 0.0);
  }
  if (p.has_initial_state) gr.dh0.assign(in.h0.size(), 0.0);

  // Per value head gradients w.r.t. the normalised q and k: [B, T, Hv, K].
  std::vector<double> dq_part(BT * p.Hv * p.K, 0.0), dk_part(BT * p.Hv * p.K, 0.0);
  std::vector<PairPartials> partials(N * p.Hv);

  parallel_for(N * p.Hv, [&](int64_t pair) {
    const int64_t n = pair / p.Hv, h = pair % p.Hv;
    backward_pair(p, in, d_o, d_ht, n, h, gr, dq_part, dk_part, partials[pair]);
  });

  // GVA reduction in fixed order: dq[b,t,hq] = sum over h = hq*G .. hq*G+G-1 of dq_part[b,t,h],
  // then back through the l2norm to the raw q (same for k). Parallel over tokens (disjoint).
  const Layout L(p);
  const int64_t G = p.Hv / p.Hq, K = p.K;
  parallel_for(BT, [&](int64_t bt) {
    const int64_t b = bt / p.T, t = bt % p.T;
    std::vector<double> dq_hat(K), dk_hat(K), scratch(K);
    for (int64_t hq = 0; hq < p.Hq; ++hq) {
      std::fill(dq_hat.begin(), dq_hat.end(), 0.0);
      std::fill(dk_hat.begin(), dk_hat.end(), 0.0);
      for (int64_t h = hq * G; h < (hq + 1) * G; ++h) {
        const double* pq = &dq_part[L.qk_per_vhead(b, t, h)];
        const double* pk = &dk_part[L.qk_per_vhead(b, t, h)];
        for (int64_t i = 0; i < K; ++i) {
          dq_hat[i] += pq[i];
          dk_hat[i] += pk[i];
        }
      }
      const int64_t off = L.qk(b, t, hq);
      if (p.use_qk_l2norm) {
        l2normalize_backward(&in.q[off], dq_hat.data(), K, &gr.dq[off], scratch.data());
        l2normalize_backward(&in.k[off], dk_hat.data(), K, &gr.dk[off], scratch.data());
      } else {
        std::copy(dq_hat.begin(), dq_hat.end(), gr.dq.begin() + off);
        std::copy(dk_hat.begin(), dk_hat.end(), gr.dk.begin() + off);
      }
    }
  });

  // dA_log[h], ddt_bias[h]: sum over sequences in order n = 0..N-1 (each pair summed its tokens
  // in reverse token order).
  if (p.gate_in_kernel) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < p.Hv; ++h) {
        gr.dA_log[h] += partials[n * p.Hv + h].dA_log;
        gr.ddt_bias[h] += partials[n * p.Hv + h].ddt_bias;
      }
  }
  return gr;
}

}  // namespace flashgdn::reference
