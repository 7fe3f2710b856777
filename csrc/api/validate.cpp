// Argument validation for fgdn_forward / fgdn_backward (see validate.h).
#include "api/validate.h"

#include <cmath>
#include <initializer_list>
#include <sstream>
#include <utility>
#include <vector>

#include "common/dtype.h"
#ifdef FLASHGDN_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace flashgdn {
namespace {

// One expected extent: a fixed value, or "any" (a free extent, named for the message).
struct Dim {
  int64_t value;  // -1: any non-negative extent
  const char* name;
};
constexpr int64_t kAny = -1;

std::string shape_str(const fgdn_tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < t.ndim && i < FGDN_MAX_DIMS; ++i) s << (i ? ", " : "") << t.shape[i];
  s << "]";
  return s.str();
}

std::string expected_str(std::initializer_list<Dim> dims) {
  std::ostringstream s;
  s << "[";
  int i = 0;
  for (const Dim& d : dims) {
    s << (i++ ? ", " : "") << d.name;
    if (d.value != kAny) s << "=" << d.value;
  }
  s << "]";
  return s.str();
}

std::string device_str(int32_t type, int32_t id) {
  if (type == FGDN_CPU) return "cpu";
  if (type == FGDN_CUDA) return "cuda:" + std::to_string(id);
  return "device type " + std::to_string(type);
}

std::string dtypes_str(std::initializer_list<fgdn_dtype> dts) {
  std::string s;
  int i = 0;
  for (fgdn_dtype d : dts) s += std::string(i++ ? " or " : "") + dtype_name(d);
  return s;
}

// Collects the context ("fgdn_forward") so every message starts the same way.
class Checker {
 public:
  explicit Checker(const char* fn) : fn_(fn) {}

  [[noreturn]] void fail(const std::string& arg, const std::string& expected,
                         const std::string& got) const {
    throw InvalidArgument(std::string(fn_) + ": argument '" + arg + "': expected " + expected +
                          ", got " + got);
  }

  // How the CUDA kernels read a tensor: whole rows with 16-byte vector accesses (q, k, v, o,
  // states and their gradients), or element by element (per-token gates and indices).
  enum class Access { kRows, kScalars };

  // The tensor's rank, extents, dtype, device and strides. The reference device is the one
  // of q, set by set_device(); tensors checked before it only need a supported device.
  void tensor(const std::string& name, const fgdn_tensor& t, std::initializer_list<Dim> dims,
              std::initializer_list<fgdn_dtype> dtypes, Access access = Access::kRows) const {
    if (t.data == nullptr) fail(name, "a tensor of shape " + expected_str(dims), "none");
    const int nd = static_cast<int>(dims.size());
    if (t.ndim != nd)
      fail(name, std::to_string(nd) + " dimensions " + expected_str(dims),
           std::to_string(t.ndim) + " dimensions" +
               (t.ndim >= 0 && t.ndim <= FGDN_MAX_DIMS ? " " + shape_str(t) : std::string()));
    int i = 0;
    for (const Dim& d : dims) {
      if (t.shape[i] < 0 || (d.value != kAny && t.shape[i] != d.value))
        fail(name, "shape " + expected_str(dims), "shape " + shape_str(t));
      ++i;
    }
    bool dtype_ok = false;
    for (fgdn_dtype d : dtypes) dtype_ok |= (t.dtype == d);
    if (!dtype_ok) fail(name, "dtype " + dtypes_str(dtypes), std::string("dtype ") + dtype_name(t.dtype));
    if (t.device_type != FGDN_CPU && t.device_type != FGDN_CUDA)
      fail(name, "a cpu or cuda tensor", device_str(t.device_type, t.device_id));
    if (have_device_ && (t.device_type != device_type_ || t.device_id != device_id_))
      fail(name, "a tensor on " + device_str(device_type_, device_id_) + " (the device of q)",
           "a tensor on " + device_str(t.device_type, t.device_id));
    // Strides: the last dimension is contiguous, the others non-negative (any layout).
    for (int d = 0; d < nd; ++d) {
      if (t.strides[d] < 0)
        fail(name, "non-negative strides", "stride " + std::to_string(t.strides[d]) +
                                               " in dimension " + std::to_string(d));
    }
    if (t.shape[nd - 1] > 1 && t.strides[nd - 1] != 1)
      fail(name, "a contiguous last dimension (stride 1)",
           "stride " + std::to_string(t.strides[nd - 1]));
    if (t.device_type == FGDN_CUDA && access == Access::kRows) cuda_alignment(name, t);
    if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
      fail(name, "a data pointer aligned to its element size", "an unaligned pointer");
  }

  void optional_tensor(const std::string& name, const fgdn_tensor& t,
                       std::initializer_list<Dim> dims, std::initializer_list<fgdn_dtype> dtypes,
                       Access access = Access::kRows) const {
    if (t.data != nullptr) tensor(name, t, dims, dtypes, access);
  }

  void absent(const std::string& name, const fgdn_tensor& t, const std::string& why) const {
    if (t.data != nullptr) fail(name, "no tensor (" + why + ")", "a tensor of shape " + shape_str(t));
  }

  void set_device(const fgdn_tensor& t) {
    have_device_ = true;
    device_type_ = t.device_type;
    device_id_ = t.device_id;
  }

 private:
  // The CUDA kernels load rows with 16-byte vector accesses.
  void cuda_alignment(const std::string& name, const fgdn_tensor& t) const {
    const size_t es = dtype_size(t.dtype);
    if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
      fail(name, "a 16-byte aligned data pointer on cuda", "an unaligned pointer");
    if (t.ndim >= 2 && t.shape[t.ndim - 1] * es >= 16) {
      for (int d = 0; d + 1 < t.ndim; ++d)
        if ((t.strides[d] * static_cast<int64_t>(es)) % 16 != 0 && t.shape[d] > 1)
          fail(name, "strides that are multiples of 16 bytes on cuda",
               "stride " + std::to_string(t.strides[d]) + " in dimension " + std::to_string(d));
    }
  }

  const char* fn_;
  bool have_device_ = false;
  int32_t device_type_ = 0, device_id_ = 0;
};

const std::initializer_list<fgdn_dtype> kInputDtypes = {FGDN_BFLOAT16, FGDN_FLOAT16, FGDN_FLOAT32};
const std::initializer_list<fgdn_dtype> kGateDtypes = {FGDN_FLOAT32, FGDN_BFLOAT16};
const std::initializer_list<fgdn_dtype> kIndexDtypes = {FGDN_INT32, FGDN_INT64};

// Reads a 1-D index tensor (host or device) into int64 on the host.
std::vector<int64_t> read_indices(const fgdn_tensor& t, void* stream) {
  const int64_t n = t.shape[0];
  std::vector<int64_t> out(static_cast<size_t>(n));
  if (n == 0) return out;
  const void* src = t.data;
  std::vector<unsigned char> staging;
  if (t.device_type == FGDN_CUDA) {
#ifdef FLASHGDN_WITH_CUDA
    staging.resize(static_cast<size_t>(n) * dtype_size(t.dtype));
    cuda::copy_to_host(staging.data(), t.data, staging.size(), t.device_id, stream);
    src = staging.data();
#else
    (void)stream;
    throw NotSupported("flashgdn: this build has no CUDA backend");
#endif
  }
  for (int64_t i = 0; i < n; ++i) out[i] = load_index(src, static_cast<fgdn_dtype>(t.dtype), i);
  return out;
}

// The last two extents of every state tensor: [K, V], or [V, K] with state_v_first.
std::pair<Dim, Dim> state_dims(const Problem& p) {
  if (p.state_v_first) return {Dim{p.V, "V"}, Dim{p.K, "K"}};
  return {Dim{p.K, "K"}, Dim{p.V, "V"}};
}

// The part shared by forward and backward: the inputs.
Problem validate_inputs(Checker& c, const fgdn_inputs& in, void* stream) {
  Problem p;
  // q fixes B, T, Hq, K, the dtype and the device.
  c.tensor("q", in.q, {{kAny, "B"}, {kAny, "T"}, {kAny, "Hq"}, {kAny, "K"}}, kInputDtypes);
  c.set_device(in.q);
  p.B = in.q.shape[0];
  p.T = in.q.shape[1];
  p.Hq = in.q.shape[2];
  p.K = in.q.shape[3];
  p.on_cuda = in.q.device_type == FGDN_CUDA;
  p.device_id = in.q.device_id;
  p.qkv_dtype = static_cast<fgdn_dtype>(in.q.dtype);
  if (p.B < 1) c.fail("q", "batch size B >= 1", "B=" + std::to_string(p.B));
  if (p.Hq < 1) c.fail("q", "Hq >= 1 heads", "Hq=" + std::to_string(p.Hq));

  const auto same_dtype = {p.qkv_dtype};
  c.tensor("k", in.k, {{p.B, "B"}, {p.T, "T"}, {p.Hq, "Hq"}, {p.K, "K"}}, same_dtype);
  c.tensor("v", in.v, {{p.B, "B"}, {p.T, "T"}, {kAny, "Hv"}, {kAny, "V"}}, same_dtype);
  p.Hv = in.v.shape[2];
  p.V = in.v.shape[3];
  if (p.Hv < 1 || p.Hv % p.Hq != 0)
    c.fail("v", "a head count Hv that is a positive multiple of Hq=" + std::to_string(p.Hq),
           "Hv=" + std::to_string(p.Hv));
  p.group = p.Hv / p.Hq;

  if (p.on_cuda) {
#ifndef FLASHGDN_WITH_CUDA
    throw NotSupported("flashgdn: q is a cuda tensor but this build has no CUDA backend");
#else
    if (!cuda_supports_head_dims(p.K, p.V))
      c.fail("q", "head dims K = V in {64, 128} on cuda",
             "K=" + std::to_string(p.K) + ", V=" + std::to_string(p.V));
    if (p.qkv_dtype == FGDN_FLOAT32)
      throw NotSupported("flashgdn: float32 q/k/v are supported on the cpu only; use bfloat16 "
                         "or float16 on cuda");
#endif
  } else {
    if (!cpu_supports_head_dim(p.K))
      c.fail("q", "head dim K in {16, 32, 64, 128, 256}", "K=" + std::to_string(p.K));
    if (!cpu_supports_head_dim(p.V))
      c.fail("v", "head dim V in {16, 32, 64, 128, 256}", "V=" + std::to_string(p.V));
  }

  // Gate and write strength.
  p.gate_in_kernel = in.gate_in_kernel != 0;
  const char* g_name = p.gate_in_kernel ? "g (the activation a, gate_in_kernel)" : "g";
  c.tensor(g_name, in.g, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}}, kGateDtypes, Checker::Access::kScalars);
  c.tensor("beta", in.beta, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}}, kGateDtypes, Checker::Access::kScalars);
  p.g_dtype = static_cast<fgdn_dtype>(in.g.dtype);
  p.beta_dtype = static_cast<fgdn_dtype>(in.beta.dtype);
  if (p.gate_in_kernel) {
    c.tensor("A_log", in.A_log, {{p.Hv, "Hv"}}, {FGDN_FLOAT32}, Checker::Access::kScalars);
    c.optional_tensor("dt_bias", in.dt_bias, {{p.Hv, "Hv"}}, {FGDN_FLOAT32}, Checker::Access::kScalars);
    p.has_dt_bias = in.dt_bias.data != nullptr;
  } else {
    c.absent("A_log", in.A_log, "gate_in_kernel is 0");
    c.absent("dt_bias", in.dt_bias, "gate_in_kernel is 0");
  }

  // Sequences: dense B x T, or varlen with cu_seqlens.
  if (in.cu_seqlens.data != nullptr) {
    c.tensor("cu_seqlens", in.cu_seqlens, {{kAny, "N+1"}}, kIndexDtypes, Checker::Access::kScalars);
    if (in.cu_seqlens.shape[0] < 2)
      c.fail("cu_seqlens", "at least 2 entries (N + 1 with N >= 1 sequences)",
             std::to_string(in.cu_seqlens.shape[0]) + " entries");
    if (p.B != 1)
      c.fail("q", "batch size B=1 when cu_seqlens is given (sequences are packed along T)",
             "B=" + std::to_string(p.B));
    p.varlen = true;
    p.N = in.cu_seqlens.shape[0] - 1;
    const char* src_name = "cu_seqlens";
    if (in.cu_seqlens_host.data != nullptr) {
      if (in.cu_seqlens_host.device_type != FGDN_CPU || in.cu_seqlens_host.ndim != 1 ||
          in.cu_seqlens_host.shape[0] != p.N + 1 ||
          (in.cu_seqlens_host.dtype != FGDN_INT64 && in.cu_seqlens_host.dtype != FGDN_INT32) ||
          (p.N + 1 > 1 && in.cu_seqlens_host.strides[0] != 1))
        c.fail("cu_seqlens_host",
               "a contiguous int32 or int64 cpu tensor of shape [N+1=" + std::to_string(p.N + 1) +
                   "] (a host copy of cu_seqlens)",
               std::string("a ") + dtype_name(in.cu_seqlens_host.dtype) + " " +
                   device_str(in.cu_seqlens_host.device_type, in.cu_seqlens_host.device_id) +
                   " tensor of shape " + shape_str(in.cu_seqlens_host));
      p.cu = read_indices(in.cu_seqlens_host, stream);
      src_name = "cu_seqlens_host";
    } else {
      p.cu = read_indices(in.cu_seqlens, stream);
    }
    p.have_host_seqlens = true;
    if (p.cu[0] != 0)
      c.fail(src_name, "a first entry of 0", "cu_seqlens[0]=" + std::to_string(p.cu[0]));
    for (int64_t n = 0; n < p.N; ++n)
      if (p.cu[n + 1] < p.cu[n])
        c.fail(src_name, "non-decreasing offsets",
               "cu_seqlens[" + std::to_string(n + 1) + "]=" + std::to_string(p.cu[n + 1]) +
                   " < cu_seqlens[" + std::to_string(n) + "]=" + std::to_string(p.cu[n]));
    if (p.cu[p.N] != p.T)
      c.fail(src_name, "a last entry equal to T=" + std::to_string(p.T),
             "cu_seqlens[" + std::to_string(p.N) + "]=" + std::to_string(p.cu[p.N]));
  } else {
    c.absent("cu_seqlens_host", in.cu_seqlens_host, "cu_seqlens is not given");
    p.N = p.B;
    p.cu.resize(static_cast<size_t>(p.N + 1));
    for (int64_t n = 0; n <= p.N; ++n) p.cu[n] = n * p.T;
    p.have_host_seqlens = true;
  }

  // States: [N, Hv, K, V], or [N, Hv, V, K] with state_v_first.
  p.state_v_first = in.state_v_first != 0;
  const auto [sd2, sd3] = state_dims(p);
  p.has_state_indices = in.state_indices.data != nullptr;
  if (p.has_state_indices) {
    c.tensor("state_indices", in.state_indices, {{p.N, "N"}}, kIndexDtypes, Checker::Access::kScalars);
    if (in.initial_state.data == nullptr)
      c.fail("initial_state", "a state pool [P, Hv, K, V] when state_indices is given", "none");
    c.tensor("initial_state", in.initial_state, {{kAny, "P"}, {p.Hv, "Hv"}, sd2, sd3},
             {FGDN_FLOAT32});
    p.pool_rows = in.initial_state.shape[0];
    // Indices are checked where they can be read without a host synchronisation.
    if (in.state_indices.device_type == FGDN_CPU) {
      const std::vector<int64_t> idx = read_indices(in.state_indices, stream);
      std::vector<char> used(static_cast<size_t>(p.pool_rows), 0);
      for (int64_t n = 0; n < p.N; ++n) {
        if (idx[n] >= p.pool_rows)
          c.fail("state_indices", "indices below the pool size P=" + std::to_string(p.pool_rows) +
                                      " (negative: no state)",
                 "state_indices[" + std::to_string(n) + "]=" + std::to_string(idx[n]));
        if (idx[n] >= 0) {
          if (used[idx[n]])
            c.fail("state_indices", "distinct non-negative indices",
                   "index " + std::to_string(idx[n]) + " twice");
          used[idx[n]] = 1;
        }
      }
    }
  } else {
    c.optional_tensor("initial_state", in.initial_state, {{p.N, "N"}, {p.Hv, "Hv"}, sd2, sd3},
                      {FGDN_FLOAT32});
    p.pool_rows = p.N;
  }
  p.has_initial_state = in.initial_state.data != nullptr;

  // Scale.
  if (in.has_scale) {
    if (!std::isfinite(in.scale)) {
      std::ostringstream s;
      s << in.scale;
      c.fail("scale", "a finite number", s.str());
    }
    p.scale = static_cast<float>(in.scale);
  } else {
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.K)));
  }
  p.l2norm = in.use_qk_l2norm_in_kernel != 0;
  return p;
}

}  // namespace

bool cpu_supports_head_dim(int64_t d) {
  return d == 16 || d == 32 || d == 64 || d == 128 || d == 256;
}

bool cuda_supports_head_dims(int64_t K, int64_t V) { return K == V && (K == 64 || K == 128); }

Problem validate_forward(const fgdn_fwd_args* a, void* stream) {
  Checker c("fgdn_forward");
  if (a == nullptr) throw InvalidArgument("fgdn_forward: argument 'args': expected a pointer, got NULL");
  Problem p = validate_inputs(c, a->in, stream);
  const auto [sd2, sd3] = state_dims(p);

  c.tensor("o", a->o, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}, {p.V, "V"}}, {p.qkv_dtype});

  p.output_final_state = a->output_final_state != 0;
  if (p.output_final_state && !p.has_state_indices) {
    c.tensor("final_state", a->final_state, {{p.N, "N"}, {p.Hv, "Hv"}, sd2, sd3}, {FGDN_FLOAT32});
  } else if (p.output_final_state) {
    c.absent("final_state", a->final_state,
             "with state_indices the final state is written back into the initial_state pool");
  } else {
    c.absent("final_state", a->final_state, "output_final_state is 0");
  }

  p.checkpoint_every = a->checkpoint_every;
  if (p.checkpoint_every < 0 || p.checkpoint_every % 64 != 0)
    c.fail("checkpoint_every", "0 or a positive multiple of 64",
           std::to_string(p.checkpoint_every));
  if (p.checkpoint_every > 0) {
    int64_t rows = 0;
    for (int64_t n = 0; n < p.N; ++n) rows += p.seq(n).len / p.checkpoint_every;
    c.tensor("checkpoints", a->checkpoints, {{kAny, "R"}, {p.Hv, "Hv"}, sd2, sd3}, {FGDN_FLOAT32});
    if (a->checkpoints.shape[0] < rows)
      c.fail("checkpoints", "at least R=" + std::to_string(rows) +
                                " rows (sum over sequences of floor(len / checkpoint_every))",
             "shape " + shape_str(a->checkpoints));
  } else {
    c.absent("checkpoints", a->checkpoints, "checkpoint_every is 0");
  }
  return p;
}

Problem validate_backward(const fgdn_bwd_args* a, void* stream) {
  Checker c("fgdn_backward");
  if (a == nullptr) throw InvalidArgument("fgdn_backward: argument 'args': expected a pointer, got NULL");
  Problem p = validate_inputs(c, a->in, stream);
  const auto [sd2, sd3] = state_dims(p);

  c.tensor("d_o", a->d_o, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}, {p.V, "V"}}, {p.qkv_dtype});
  c.optional_tensor("d_final_state", a->d_final_state, {{p.N, "N"}, {p.Hv, "Hv"}, sd2, sd3},
                    {FGDN_FLOAT32});
  p.has_d_final_state = a->d_final_state.data != nullptr;

  c.tensor("dq", a->dq, {{p.B, "B"}, {p.T, "T"}, {p.Hq, "Hq"}, {p.K, "K"}}, {p.qkv_dtype});
  c.tensor("dk", a->dk, {{p.B, "B"}, {p.T, "T"}, {p.Hq, "Hq"}, {p.K, "K"}}, {p.qkv_dtype});
  c.tensor("dv", a->dv, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}, {p.V, "V"}}, {p.qkv_dtype});
  c.tensor("dg", a->dg, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}}, {p.g_dtype}, Checker::Access::kScalars);
  c.tensor("dbeta", a->dbeta, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}}, {p.beta_dtype}, Checker::Access::kScalars);
  if (p.gate_in_kernel) {
    c.tensor("dA_log", a->dA_log, {{p.Hv, "Hv"}}, {FGDN_FLOAT32}, Checker::Access::kScalars);
    if (p.has_dt_bias)
      c.tensor("ddt_bias", a->ddt_bias, {{p.Hv, "Hv"}}, {FGDN_FLOAT32}, Checker::Access::kScalars);
    else
      c.absent("ddt_bias", a->ddt_bias, "dt_bias is not given");
  } else {
    c.absent("dA_log", a->dA_log, "gate_in_kernel is 0");
    c.absent("ddt_bias", a->ddt_bias, "gate_in_kernel is 0");
  }
  if (p.has_initial_state) {
    c.optional_tensor("dh0", a->dh0, {{p.N, "N"}, {p.Hv, "Hv"}, sd2, sd3}, {FGDN_FLOAT32});
  } else {
    c.absent("dh0", a->dh0, "initial_state is not given");
  }
  p.want_dh0 = a->dh0.data != nullptr;
  return p;
}

}  // namespace flashgdn
