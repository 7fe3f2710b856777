// Check mode: the list of value checks of a call and their evaluation on the host.
#include "api/value_checks.h"

#include "common/dtype.h"

namespace flashgdn {
namespace {

ValueCheck make_check(const char* name, const fgdn_tensor& t, int32_t rule) {
  ValueCheck v;
  v.name = name;
  v.data = t.data;
  v.dtype = t.dtype;
  v.ndim = t.ndim;
  for (int d = 0; d < t.ndim; ++d) {
    v.shape[d] = t.shape[d];
    v.strides[d] = t.strides[d];
  }
  v.rule = rule;
  return v;
}

}  // namespace

std::vector<ValueCheck> input_value_checks(const Problem& p, const fgdn_inputs& in,
                                           const fgdn_tensor* d_o, const fgdn_tensor* d_final_state) {
  std::vector<ValueCheck> c;
  c.push_back(make_check("q", in.q, kRuleFinite));
  c.push_back(make_check("k", in.k, kRuleFinite));
  c.push_back(make_check("v", in.v, kRuleFinite));
  c.push_back(make_check("g", in.g, p.gate_in_kernel ? kRuleFinite : kRuleFiniteNonPositive));
  c.push_back(make_check("beta", in.beta, kRuleFinite));
  if (p.gate_in_kernel) c.push_back(make_check("A_log", in.A_log, kRuleFinite));
  if (p.has_dt_bias) c.push_back(make_check("dt_bias", in.dt_bias, kRuleFinite));
  if (p.has_initial_state) {
    ValueCheck s = make_check("initial_state", in.initial_state, kRuleFinite);
    if (p.has_state_indices) {  // only the rows the call reads: a pool's other rows are not its business
      s.shape[0] = p.N;
      s.rows = in.state_indices.data;
      s.rows_dtype = in.state_indices.dtype;
      s.pool_rows = p.pool_rows;
    }
    c.push_back(s);
  }
  if (d_o != nullptr) c.push_back(make_check("d_o", *d_o, kRuleFinite));
  if (d_final_state != nullptr) c.push_back(make_check("d_final_state", *d_final_state, kRuleFinite));
  return c;
}

ValueCheckOutcome run_value_checks_host(const std::vector<ValueCheck>& checks) {
  ValueCheckOutcome out;
  out.results.resize(checks.size());
  for (size_t i = 0; i < checks.size(); ++i) {
    const ValueCheck& v = checks[i];
    int64_t numel = 1;
    for (int d = 0; d < v.ndim; ++d) numel *= v.shape[d];  // validated: fits in int64
    int64_t idx[FGDN_MAX_DIMS] = {};
    for (int64_t l = 0; l < numel; ++l) {
      // Row-major odometer over the shape; the offset from the strides (and the pool row).
      int64_t off = 0;
      bool skip = false;
      for (int d = 0; d < v.ndim; ++d) {
        int64_t x = idx[d];
        if (d == 0 && v.rows != nullptr) {
          x = load_index(v.rows, static_cast<fgdn_dtype>(v.rows_dtype), idx[0]);
          skip = x < 0 || x >= v.pool_rows;
          if (skip) break;
        }
        off += x * v.strides[d];
      }
      if (!skip) {
        const float x = load_float(v.data, static_cast<fgdn_dtype>(v.dtype), off);
        if (!value_ok(x, v.rule)) {
          out.results[i].first_bad = static_cast<uint64_t>(l);
          out.results[i].value = x;
          break;
        }
      }
      for (int d = v.ndim - 1; d >= 0; --d) {
        if (++idx[d] < v.shape[d]) break;
        idx[d] = 0;
      }
    }
  }
  return out;
}

}  // namespace flashgdn
