// CPU backward: reverse mode of the chunked forward (chunk_fwd.cpp), per (sequence, value head).
// A forward sweep recomputes the chunk-start states S; a reverse sweep over chunks carries
// dS = dL/dS' (the gradient of the state at the chunk end; d_final_state, or zero, for the last).
// Forward per chunk (chunk_common.h for the intra-chunk quantities):
//   Vn = U - W S;  O = scale (Qe S + M Vn);  S' = G S + Kf^T Vn   (G = exp(c_m))
// Reverse per chunk, given dO and dS':
//   dVn  = Kf dS' + scale M^T dO                dM  = lower(scale dO Vn^T)
//   dQe  = scale dO S^T                          dKf = Vn dS'^T          dG = <dS', S>
//   dW   = -dVn S^T,  dU = dVn
//   dTm  = dW X^T + dU Y^T;  dX = Tm^T dW;  dY = Tm^T dU
//   dAb  = strict_lower(-Tm^T dTm Tm^T)          (Tm = (I + Ab)^{-1})
//   dS   = G dS' + scale Qe^T dO - W^T dVn      (the gradient carried to the previous chunk)
// then to the inputs (b = beta, e/f/D as in chunk_common.h):
//   dv_i    = b_i dY_i
//   dbeta_i = dX_i . (e_i k_i) + dY_i . v_i + sum_{j<i} dAb_ij (k_i . k_j) D_ij
//   dk     = diag(b e) dX + H K + H^T K + dP^T Q + dKf (.) f,   H = dAb (.) D (.) b_i, dP = dM (.) D
//   dq     = dP K + dQe (.) e
//   dc_i   = sum_j L_ij - sum_j L_ji + dX_i . X_i + dQe_i . Qe_i - dKf_i . Kf_i
//            + [i = m] (sum_l dKf_l . Kf_l + dG G),        L = dAb (.) Ab + dM (.) M
//   dg_i   = sum_{l >= i} dc_l                  (c is the in-chunk cumulative sum of g)
//            and 0 where the gate floor applied (g < -128: its derivative is 0)
// and through the in-kernel pre-processing (gate.h): l2norm of q and k (after summing dq^, dk^
// over the value heads sharing a q/k head), the gate g(a, A_log, dt_bias).
// Determinism: each pair writes only its own dv, dg, dbeta, dh0 entries and its own slots of the
// partial buffers (dq^, dk^ per value head when Hv > Hq; dA_log, ddt_bias per pair); those are
// reduced afterwards in a fixed order (value heads ascending, sequences ascending).
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "cpu/chunk_common.h"
#include "cpu/chunk_math.h"
#include "cpu/cpu_backend.h"
#include "cpu/gate.h"
#include "cpu/thread_pool.h"

namespace flashgdn::cpu {

namespace {

constexpr int64_t C = kChunk;
inline size_t sz(int64_t n) { return static_cast<size_t>(n); }

struct BwdScratch {
  ChunkBuf buf;
  std::vector<float> S, dS, states;           // [K x V], [K x V], [chunks x K x V]
  std::vector<float> ST, dST;                 // [V x K]
  std::vector<float> Vn, VnT, dO, dVn, dY, YT;  // [C x V] / [V x C]
  std::vector<float> dQe, dKf, dW, dX, XT, dQ, dK;  // [C x K] / [K x C]
  std::vector<float> dM, dTm, TmT, Z, dAb, H, dP;   // [C x C]
  std::vector<float> dc;                      // [C]
  std::vector<float> xh;                      // [K]: a re-normalised q/k row
  BwdScratch(int64_t K, int64_t V)
      : buf(K, V), S(sz(K * V)), dS(sz(K * V)), ST(sz(V * K)), dST(sz(V * K)), Vn(sz(C * V)),
        VnT(sz(V * C)), dO(sz(C * V)), dVn(sz(C * V)), dY(sz(C * V)), YT(sz(V * C)),
        dQe(sz(C * K)), dKf(sz(C * K)), dW(sz(C * K)), dX(sz(C * K)), XT(sz(K * C)),
        dQ(sz(C * K)), dK(sz(C * K)), dM(sz(C * C)), dTm(sz(C * C)), TmT(sz(C * C)),
        Z(sz(C * C)), dAb(sz(C * C)), H(sz(C * C)), dP(sz(C * C)), dc(sz(C)), xh(sz(K)) {}
};

// Writes the gradient w.r.t. the raw q (or k) row from dxhat (w.r.t. the normalised row):
// dx = r (dxhat - xhat (xhat . dxhat)) with l2norm, dx = dxhat without. dxhat is clobbered.
void store_qk_grad(const Problem& p, const fgdn_tensor& x, const fgdn_tensor& dx, int64_t b,
                   int64_t t, int64_t hq, float* dxhat, float* xhat_scratch) {
  const int64_t K = p.K;
  if (p.l2norm) {
    const float r = load_qk_row(x.data, p.qkv_dtype, tok_off(x, b, t, hq), K, true, xhat_scratch);
    l2norm_backward(xhat_scratch, r, dxhat, K);
  }
  store_row(dx.data, p.qkv_dtype, tok_off(dx, b, t, hq), K, dxhat);
}

}  // namespace

void backward(const Problem& p, const fgdn_bwd_args& a) {
  const fgdn_inputs& in = a.in;
  const int64_t K = p.K, V = p.V;
  const int64_t tasks = p.N * p.Hv;
  const int workers = workers_for(tasks);
  const bool gik = p.gate_in_kernel;

  const StateView h0 = p.has_initial_state ? StateView(in.initial_state, p.state_v_first)
                                           : StateView();
  const StateView dht = p.has_d_final_state ? StateView(a.d_final_state, p.state_v_first)
                                            : StateView();
  const StateView dh0 = p.want_dh0 ? StateView(a.dh0, p.state_v_first) : StateView();

  // Partial buffers: dq^, dk^ per (b, t, value head) when value heads share q/k heads.
  const bool grouped = p.group > 1;
  std::vector<float> dq_part, dk_part;
  if (grouped) {
    dq_part.assign(sz(p.B * p.T * p.Hv * K), 0.f);
    dk_part.assign(sz(p.B * p.T * p.Hv * K), 0.f);
  }
  auto part_off = [&](int64_t b, int64_t t, int64_t h) { return ((b * p.T + t) * p.Hv + h) * K; };
  // dA_log, ddt_bias per pair (sum over the pair's tokens, in double).
  std::vector<double> dA_part, ddt_part;
  if (gik) {
    dA_part.assign(sz(tasks), 0.0);
    ddt_part.assign(sz(tasks), 0.0);
  }

  std::vector<BwdScratch> scratch;
  scratch.reserve(sz(workers));
  for (int w = 0; w < workers; ++w) scratch.emplace_back(K, V);

  const float scale = p.scale;

  parallel_for(tasks, workers, [&](int64_t task, int w) {
    BwdScratch& s = scratch[sz(w)];
    ChunkBuf& buf = s.buf;
    float* S = s.S.data();
    float* dS = s.dS.data();
    const Pair pr = pair_of(p, task);
    const int64_t row = state_row(p, in, pr.n);
    const int64_t nch = (pr.len + C - 1) / C;
    const float A_log = gik ? static_cast<const float*>(in.A_log.data)[pr.h] : 0.f;
    const float dt_bias = (gik && p.has_dt_bias) ? static_cast<const float*>(in.dt_bias.data)[pr.h] : 0.f;

    // ---- forward sweep: states[c] = S at the start of chunk c; S' = G S + Kf^T (U - W S)
    if (s.states.size() < sz(nch * K * V)) s.states.resize(sz(nch * K * V));
    if (row >= 0) h0.load(row, pr.h, K, V, S);
    else std::fill(s.S.begin(), s.S.end(), 0.f);
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t tc = c * C, m = std::min(C, pr.len - tc);
      std::memcpy(&s.states[sz(c * K * V)], S, sizeof(float) * sz(K * V));
      if (c == nch - 1) break;  // the last chunk's end state is not needed
      load_chunk(p, in, pr, tc, m, buf);
      chunk_intra(buf);
      std::memcpy(s.Vn.data(), buf.U.data(), sizeof(float) * sz(m * V));
      gemm_nn(m, V, K, -1.f, buf.W.data(), K, S, V, true, s.Vn.data(), V);
      for (int64_t i = 0; i < K * V; ++i) S[i] *= buf.gamma;
      gemm_tn(K, V, m, 1.f, buf.Kf.data(), K, s.Vn.data(), V, true, S, V);
    }

    // ---- dS' of the last chunk: d_final_state or zero
    if (p.has_d_final_state) dht.load(pr.n, pr.h, K, V, dS);
    else std::fill(s.dS.begin(), s.dS.end(), 0.f);

    double dA_acc = 0.0, ddt_acc = 0.0;
    for (int64_t c = nch - 1; c >= 0; --c) {
      const int64_t tc = c * C, m = std::min(C, pr.len - tc);
      load_chunk(p, in, pr, tc, m, buf);
      chunk_intra(buf);
      std::memcpy(S, &s.states[sz(c * K * V)], sizeof(float) * sz(K * V));
      for (int64_t r = 0; r < m; ++r)
        load_row(a.d_o.data, p.qkv_dtype, tok_off(a.d_o, pr.b, pr.t0 + tc + r, pr.h), V,
                 &s.dO[sz(r * V)]);
      // Vn = U - W S
      std::memcpy(s.Vn.data(), buf.U.data(), sizeof(float) * sz(m * V));
      gemm_nn(m, V, K, -1.f, buf.W.data(), K, S, V, true, s.Vn.data(), V);
      transpose(K, V, S, V, s.ST.data(), K);    // S^T  [V x K]
      transpose(K, V, dS, V, s.dST.data(), K);  // dS'^T [V x K]
      transpose(m, V, s.Vn.data(), V, s.VnT.data(), C);  // Vn^T [V x m]

      // dVn = Kf dS' + scale M^T dO
      gemm_nn(m, V, K, 1.f, buf.Kf.data(), K, dS, V, false, s.dVn.data(), V);
      gemm_tn(m, V, m, scale, buf.M.data(), C, s.dO.data(), V, true, s.dVn.data(), V);
      // dM = lower(scale dO Vn^T)
      gemm_nn(m, m, V, scale, s.dO.data(), V, s.VnT.data(), C, false, s.dM.data(), C);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = i + 1; j < m; ++j) s.dM[sz(i * C + j)] = 0.f;
      // dQe = scale dO S^T;  dKf = Vn dS'^T;  dG = <dS', S>
      gemm_nn(m, K, V, scale, s.dO.data(), V, s.ST.data(), K, false, s.dQe.data(), K);
      gemm_nn(m, K, V, 1.f, s.Vn.data(), V, s.dST.data(), K, false, s.dKf.data(), K);
      double dG = 0.0;
      for (int64_t i = 0; i < K * V; ++i) dG += static_cast<double>(dS[i]) * S[i];
      // dW = -dVn S^T  (dU = dVn)
      gemm_nn(m, K, V, -1.f, s.dVn.data(), V, s.ST.data(), K, false, s.dW.data(), K);
      // dTm = dW X^T + dU Y^T
      transpose(m, K, buf.X.data(), K, s.XT.data(), C);
      transpose(m, V, buf.Y.data(), V, s.YT.data(), C);
      gemm_nn(m, m, K, 1.f, s.dW.data(), K, s.XT.data(), C, false, s.dTm.data(), C);
      gemm_nn(m, m, V, 1.f, s.dVn.data(), V, s.YT.data(), C, true, s.dTm.data(), C);
      // dX = Tm^T dW;  dY = Tm^T dU
      gemm_tn(m, K, m, 1.f, buf.Tm.data(), C, s.dW.data(), K, false, s.dX.data(), K);
      gemm_tn(m, V, m, 1.f, buf.Tm.data(), C, s.dVn.data(), V, false, s.dY.data(), V);
      // dAb = strict_lower(-Tm^T (dTm Tm^T))
      transpose(m, m, buf.Tm.data(), C, s.TmT.data(), C);
      gemm_nn(m, m, m, 1.f, s.dTm.data(), C, s.TmT.data(), C, false, s.Z.data(), C);
      gemm_tn(m, m, m, -1.f, buf.Tm.data(), C, s.Z.data(), C, false, s.dAb.data(), C);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = i; j < m; ++j) s.dAb[sz(i * C + j)] = 0.f;

      // dS <- G dS' + scale Qe^T dO - W^T dVn   (dS' no longer needed: dST, dKf, dVn hold it)
      for (int64_t i = 0; i < K * V; ++i) dS[i] *= buf.gamma;
      gemm_tn(K, V, m, scale, buf.Qe.data(), K, s.dO.data(), V, true, dS, V);
      gemm_tn(K, V, m, -1.f, buf.W.data(), K, s.dVn.data(), V, true, dS, V);

      // H = dAb (.) D (.) b_i,  dP = dM (.) D,  L = dAb (.) Ab + dM (.) M
      float* dc = s.dc.data();
      std::fill(s.dc.begin(), s.dc.end(), 0.f);
      // (the diagonal of L has no effect, c_i - c_i = 0: it is left out so that it cannot add
      //  rounding noise of its own size to dc_i)
      for (int64_t i = 0; i < m; ++i) {
        const float bi = buf.beta[sz(i)];
        for (int64_t j = 0; j < m; ++j) {
          const int64_t ij = i * C + j;
          const float d = buf.D[sz(ij)];
          s.H[sz(ij)] = s.dAb[sz(ij)] * d * bi;
          s.dP[sz(ij)] = s.dM[sz(ij)] * d;
          if (j >= i) continue;
          const float L = s.dAb[sz(ij)] * buf.Ab[sz(ij)] + s.dM[sz(ij)] * buf.M[sz(ij)];
          dc[i] += L;  // d c_i  from D_ij = exp(c_i - c_j)
          dc[j] -= L;  // d c_j
        }
      }
      // dq^ = dP K + dQe (.) e
      gemm_nn(m, K, m, 1.f, s.dP.data(), C, buf.k.data(), K, false, s.dQ.data(), K);
      // dk^ = H K + H^T K + dP^T Q + diag(b e) dX + dKf (.) f
      gemm_nn(m, K, m, 1.f, s.H.data(), C, buf.k.data(), K, false, s.dK.data(), K);
      gemm_tn(m, K, m, 1.f, s.H.data(), C, buf.k.data(), K, true, s.dK.data(), K);
      gemm_tn(m, K, m, 1.f, s.dP.data(), C, buf.q.data(), K, true, s.dK.data(), K);
      float lf_sum = 0.f;
      for (int64_t i = 0; i < m; ++i) {
        const float ei = buf.e[sz(i)], fi = buf.f[sz(i)], bei = buf.beta[sz(i)] * ei;
        float sx = 0.f, sq = 0.f, sf = 0.f, sxk = 0.f;
        for (int64_t d = 0; d < K; ++d) {
          const int64_t id = i * K + d;
          s.dQ[sz(id)] += s.dQe[sz(id)] * ei;
          s.dK[sz(id)] += bei * s.dX[sz(id)] + s.dKf[sz(id)] * fi;
          sx += s.dX[sz(id)] * buf.X[sz(id)];
          sxk += s.dX[sz(id)] * ei * buf.k[sz(id)];
          sq += s.dQe[sz(id)] * buf.Qe[sz(id)];
          sf += s.dKf[sz(id)] * buf.Kf[sz(id)];
        }
        // Kf_i = k_i exp(c_m - c_i): +sf to dc_m, -sf to dc_i (nothing for i = m)
        if (i == m - 1) sf = 0.f;
        dc[i] += sx + sq - sf;
        lf_sum += sf;
        // dbeta_i = dX_i . (e_i k_i) + dY_i . v_i + sum_{j<i} dAb_ij (k_i . k_j) D_ij
        float sy = 0.f;
        for (int64_t d = 0; d < V; ++d) sy += s.dY[sz(i * V + d)] * buf.v[sz(i * V + d)];
        float sa = 0.f;
        for (int64_t j = 0; j < i; ++j)
          sa += s.dAb[sz(i * C + j)] * buf.KKt[sz(i * C + j)] * buf.D[sz(i * C + j)];
        const float dbeta = sxk + sy + sa;
        const int64_t t = pr.t0 + tc + i;
        store_float(a.dbeta.data, p.beta_dtype, gate_off(a.dbeta, pr.b, t, pr.h), dbeta);
        // dv_i = b_i dY_i
        float* dyi = &s.dY[sz(i * V)];
        for (int64_t d = 0; d < V; ++d) dyi[d] *= buf.beta[sz(i)];
        store_row(a.dv.data, p.qkv_dtype, tok_off(a.dv, pr.b, t, pr.h), V, dyi);
      }
      dc[m - 1] += lf_sum + static_cast<float>(dG) * buf.gamma;
      // dg_i = sum_{l >= i} dc_l (0 through the floor), then through the gate when it is
      // computed in the kernel. The sequence's first gate scales only its initial state: with
      // none (row < 0) its gradient is exactly zero, which the sum gives only up to float32
      // cancellation (docs/reliability.md, D1).
      float run = 0.f;
      for (int64_t i = m - 1; i >= 0; --i) {
        run += dc[i];
        const int64_t t = pr.t0 + tc + i;
        const bool zero_start_gate = row < 0 && tc == 0 && i == 0;
        float out = gate_floored(buf.g[sz(i)]) || zero_start_gate ? 0.f : run;
        if (gik) {
          const GateGrad gg =
              gate_activation_backward(out, buf.a[sz(i)] + dt_bias, A_log, buf.g[sz(i)]);
          out = gg.dx;
          dA_acc += gg.dA_log;
          ddt_acc += gg.dx;
        }
        store_float(a.dg.data, p.g_dtype, gate_off(a.dg, pr.b, t, pr.h), out);
      }
      // dq, dk: finished here when this value head owns its q/k head, else into the partials
      for (int64_t i = 0; i < m; ++i) {
        const int64_t t = pr.t0 + tc + i;
        if (grouped) {
          std::memcpy(&dq_part[sz(part_off(pr.b, t, pr.h))], &s.dQ[sz(i * K)], sizeof(float) * sz(K));
          std::memcpy(&dk_part[sz(part_off(pr.b, t, pr.h))], &s.dK[sz(i * K)], sizeof(float) * sz(K));
        } else {
          store_qk_grad(p, in.q, a.dq, pr.b, t, pr.hq, &s.dQ[sz(i * K)], s.xh.data());
          store_qk_grad(p, in.k, a.dk, pr.b, t, pr.hq, &s.dK[sz(i * K)], s.xh.data());
        }
      }
    }
    if (gik) {
      dA_part[sz(task)] = dA_acc;
      ddt_part[sz(task)] = ddt_acc;
    }
    // dh0 = dS at the start of chunk 0 (zero for a sequence whose state index is negative)
    if (p.want_dh0) {
      if (p.has_state_indices && row < 0) std::fill(s.dS.begin(), s.dS.end(), 0.f);
      dh0.store(pr.n, pr.h, K, V, dS);
    }
  });

  // ---- GVA reduction: dq^ = sum over the group's value heads (ascending), then l2norm reverse
  if (grouped) {
    const int64_t rows = p.B * p.T;
    const int rw = workers_for(rows);
    std::vector<std::vector<float>> acc(sz(rw), std::vector<float>(sz(2 * K)));
    parallel_for(rows, rw, [&](int64_t bt, int w) {
      const int64_t b = bt / p.T, t = bt % p.T;
      float* sum = acc[sz(w)].data();
      float* xh = sum + K;
      for (int64_t hq = 0; hq < p.Hq; ++hq) {
        for (int which = 0; which < 2; ++which) {
          const std::vector<float>& part = which == 0 ? dq_part : dk_part;
          std::fill(sum, sum + K, 0.f);
          for (int64_t h = hq * p.group; h < (hq + 1) * p.group; ++h) {
            const float* src = &part[sz(part_off(b, t, h))];
            for (int64_t d = 0; d < K; ++d) sum[d] += src[d];
          }
          if (which == 0) store_qk_grad(p, in.q, a.dq, b, t, hq, sum, xh);
          else store_qk_grad(p, in.k, a.dk, b, t, hq, sum, xh);
        }
      }
    });
  }

  // ---- dA_log[h], ddt_bias[h]: sum over sequences (ascending) of the per-pair sums
  if (gik) {
    for (int64_t h = 0; h < p.Hv; ++h) {
      double sa = 0.0, sd = 0.0;
      for (int64_t n = 0; n < p.N; ++n) {
        sa += dA_part[sz(n * p.Hv + h)];
        sd += ddt_part[sz(n * p.Hv + h)];
      }
      if (a.dA_log.data) static_cast<float*>(a.dA_log.data)[h] = static_cast<float>(sa);
      if (a.ddt_bias.data) static_cast<float*>(a.ddt_bias.data)[h] = static_cast<float>(sd);
    }
  }
}

}  // namespace flashgdn::cpu
