// Argument validation for fgdn_forward / fgdn_backward and their workspace queries (see
// validate.h). Order: each tensor alone (presence, rank, extents, dtype, device, strides,
// memory range), then what the extents imply for the backends (sizes, grids), then the
// overlaps between arguments; only then, in a call, the values the call needs on the host and,
// in check mode, the inputs' values.
#include "api/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "api/memory_layout.h"
#include "api/value_checks.h"
#include "common/checked.h"
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

bool rank_ok(const fgdn_tensor& t) { return t.ndim >= 1 && t.ndim <= FGDN_MAX_DIMS; }

std::string list_str(const int64_t* x, int n) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < n; ++i) s << (i ? ", " : "") << x[i];
  s << "]";
  return s.str();
}

std::string shape_str(const fgdn_tensor& t) { return rank_ok(t) ? list_str(t.shape, t.ndim) : "[]"; }

std::string layout_str(const fgdn_tensor& t) {
  return "shape " + shape_str(t) + " with strides " + (rank_ok(t) ? list_str(t.strides, t.ndim) : "[]");
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

// Distinct strings for distinct devices (cpu:1 is not "cpu").
std::string device_str(int32_t type, int32_t id) {
  std::string s = type == FGDN_CPU ? "cpu" : type == FGDN_CUDA ? "cuda" : "device type " + std::to_string(type);
  if (type != FGDN_CPU || id != 0) s += ":" + std::to_string(id);
  return s;
}

std::string dtype_str(int32_t dt) {
  const std::string n = dtype_name(dt);
  return n == "unknown" ? "an unknown dtype code " + std::to_string(dt) : n;
}

std::string dtypes_str(std::initializer_list<fgdn_dtype> dts) {
  std::string s;
  int i = 0;
  for (fgdn_dtype d : dts) s += std::string(i++ ? " or " : "") + dtype_name(d);
  return s;
}

// How the CUDA kernels read a tensor: whole rows with 16-byte vector accesses (q, k, v, o,
// states and their gradients), or element by element (per-token gates and indices).
enum class Access { kRows, kScalars };
// Outputs are written: they may not overlap themselves nor any other argument.
enum class Role { kInput, kOutput };

struct Spec {
  Access access = Access::kRows;
  Role role = Role::kInput;
  bool on_host = false;  // a cpu tensor whatever the device of q (cu_seqlens_host)
  bool state = false;    // a state tensor: a strided last dimension gets the state_v_first hint
  bool v_first = false;  // (with state) the call's state_v_first
};
constexpr Spec kScalarInput{Access::kScalars, Role::kInput, false, false, false};
constexpr Spec kRowsOutput{Access::kRows, Role::kOutput, false, false, false};
constexpr Spec kScalarOutput{Access::kScalars, Role::kOutput, false, false, false};

Spec state_spec(bool v_first, Role role) { return Spec{Access::kRows, role, false, true, v_first}; }

// Collects the context ("fgdn_forward") so every message starts the same way, and every
// checked tensor for the overlap checks.
class Checker {
 public:
  explicit Checker(const char* fn) : fn_(fn) {}

  [[noreturn]] void fail(const std::string& arg, const std::string& expected,
                         const std::string& got) const {
    throw InvalidArgument(std::string(fn_) + ": argument '" + arg + "': expected " + expected +
                          ", got " + got);
  }

  // The tensor's rank, extents, dtype, device, strides and memory. The reference device is the
  // one of q, set by set_device(); tensors checked before it only need a supported device.
  void tensor(const std::string& name, const fgdn_tensor& t, std::initializer_list<Dim> dims,
              std::initializer_list<fgdn_dtype> dtypes, Spec spec = Spec{}) {
    const int nd = static_cast<int>(dims.size());
    if (!present(t)) fail(name, "a tensor of shape " + expected_str(dims), "none");
    if (t.ndim != nd)
      fail(name, std::to_string(nd) + " dimensions " + expected_str(dims),
           std::to_string(t.ndim) + " dimensions" + (rank_ok(t) ? " " + shape_str(t) : std::string()));
    int i = 0;
    for (const Dim& d : dims) {
      if (t.shape[i] < 0 || (d.value != kAny && t.shape[i] != d.value))
        fail(name, "shape " + expected_str(dims), "shape " + shape_str(t));
      ++i;
    }
    bool dtype_ok = false;
    for (fgdn_dtype d : dtypes) dtype_ok |= (t.dtype == d);
    if (!dtype_ok) fail(name, "dtype " + dtypes_str(dtypes), "dtype " + dtype_str(t.dtype));
    if (t.device_type != FGDN_CPU && t.device_type != FGDN_CUDA)
      fail(name, "a cpu or cuda tensor", "a tensor on " + device_str(t.device_type, t.device_id));
    if (t.device_id < 0 || (t.device_type == FGDN_CPU && t.device_id != 0))
      fail(name, "a device id of 0 on cpu and >= 0 on cuda",
           "a tensor on " + device_str(t.device_type, t.device_id));
    if (spec.on_host && t.device_type != FGDN_CPU)
      fail(name, "a cpu tensor", "a tensor on " + device_str(t.device_type, t.device_id));
    if (!spec.on_host && have_device_ && (t.device_type != device_type_ || t.device_id != device_id_))
      fail(name, "a tensor on " + device_str(device_type_, device_id_) + " (the device of q)",
           "a tensor on " + device_str(t.device_type, t.device_id));
    // Strides: the last dimension is contiguous, the others non-negative (any layout).
    for (int d = 0; d < nd; ++d) {
      if (t.strides[d] < 0)
        fail(name, "non-negative strides", "stride " + std::to_string(t.strides[d]) +
                                               " in dimension " + std::to_string(d));
    }
    if (t.shape[nd - 1] > 1 && t.strides[nd - 1] != 1)
      fail(name, std::string("a contiguous last dimension (stride 1)") + state_hint(spec),
           "stride " + std::to_string(t.strides[nd - 1]));

    // Memory: the addressed range [data, data + bytes) fits in int64 and does not wrap the
    // address space (and an output's element count fits: it writes each element); data may be
    // NULL only when there is nothing to address. Inputs are read through the problem's
    // indices, which check_derived_sizes bounds, so a read-only input may have more elements
    // than int64 counts (a pool of 2^62 rows of stride 0).
    int64_t numel = 0, bytes = 0;
    const bool numel_ok = tensor_numel(t, &numel);
    if (spec.role == Role::kOutput && !numel_ok)
      fail(name, "extents whose element count fits in 64 bits", "shape " + shape_str(t));
    if (!tensor_bytes(t, dtype_size(t.dtype), &bytes))
      fail(name, "extents and strides whose addressed memory fits in 64 bits", layout_str(t));
    if (tensor_empty(t)) return;  // nothing is read or written through it
    if (t.data == nullptr)
      fail(name, "a data pointer",
           "NULL for a tensor of " + (numel_ok ? std::to_string(numel) : std::string("more than 2^63")) +
               " elements");
    uintptr_t end = 0;
    if (__builtin_add_overflow(reinterpret_cast<uintptr_t>(t.data), static_cast<uintptr_t>(bytes), &end))
      fail(name, "a memory range [data, data + " + std::to_string(bytes) +
                     " bytes) that does not wrap the address space",
           "data at address " + std::to_string(reinterpret_cast<uintptr_t>(t.data)));
    if (t.device_type == FGDN_CUDA && spec.access == Access::kRows) cuda_alignment(name, t);
    if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
      fail(name, "a data pointer aligned to its element size", "an unaligned pointer");
    if (spec.role == Role::kOutput && !non_self_overlapping(t))
      fail(name,
           "an output in which no two elements share memory (no stride 0 on an extent > 1; each "
           "stride, in increasing order, larger than the reach of the smaller ones)",
           layout_str(t));
    seen_.push_back({name, t, spec.role});
  }

  void optional_tensor(const std::string& name, const fgdn_tensor& t,
                       std::initializer_list<Dim> dims, std::initializer_list<fgdn_dtype> dtypes,
                       Spec spec = Spec{}) {
    if (present(t)) tensor(name, t, dims, dtypes, spec);
  }

  void absent(const std::string& name, const fgdn_tensor& t, const std::string& why) const {
    if (present(t))
      fail(name, "no tensor (" + why + ")",
           rank_ok(t) ? "a tensor of shape " + shape_str(t) : "a tensor of " + std::to_string(t.ndim) + " dimensions");
  }

  void set_device(const fgdn_tensor& t) {
    have_device_ = true;
    device_type_ = t.device_type;
    device_id_ = t.device_id;
  }

  // Every output against every other argument, in the order they were checked. Inputs may
  // share memory with each other (q, k, v as slices of one fused projection); no documented
  // in-place alias exists besides the state pool, which is one argument read and written.
  void overlaps() const {
    for (size_t i = 0; i < seen_.size(); ++i) {
      if (seen_[i].role != Role::kOutput) continue;
      for (size_t j = 0; j < seen_.size(); ++j) {
        if (j == i || (seen_[j].role == Role::kOutput && j < i)) continue;  // each pair once
        const Seen& a = seen_[i];
        const Seen& b = seen_[j];
        if (a.t.device_type != b.t.device_type || a.t.device_id != b.t.device_id) continue;
        const Overlap o = memory_overlap(a.t, dtype_size(a.t.dtype), b.t, dtype_size(b.t.dtype));
        if (o == Overlap::kIntersect)
          fail(a.name, "memory disjoint from argument '" + b.name + "' (an output shares no memory with another argument)",
               "overlapping memory");
        if (o == Overlap::kUnknown)
          fail(a.name,
               "memory disjoint from argument '" + b.name +
                   "' (an output shares no memory with another argument; interleaved views are "
                   "accepted when they have one dtype and the same strides)",
               "interleaved memory ranges whose disjointness cannot be shown (" + layout_str(a.t) +
                   " against " + layout_str(b.t) + ")");
      }
    }
  }

  // The caller's workspace [ptr, ptr + bytes) on q's device: scratch the call writes, so no
  // byte of it may be a byte of any tensor argument; 256-byte aligned (the backends carve
  // 256-byte aligned arrays out of it).
  void workspace(const void* ptr, size_t bytes) const {
    if (ptr == nullptr) return;
    const uintptr_t w0 = reinterpret_cast<uintptr_t>(ptr);
    if (w0 % 256 != 0) fail("workspace", "a 256-byte aligned pointer", "address " + std::to_string(w0));
    uintptr_t w1 = 0;
    if (__builtin_add_overflow(w0, static_cast<uintptr_t>(bytes), &w1))
      fail("workspace_bytes", "a range that does not wrap the address space", std::to_string(bytes) + " bytes");
    for (const Seen& s : seen_) {
      if (s.t.device_type != device_type_ || s.t.device_id != device_id_) continue;
      int64_t n = 0;
      tensor_bytes(s.t, dtype_size(s.t.dtype), &n);  // validated: fits
      const uintptr_t t0 = reinterpret_cast<uintptr_t>(s.t.data), t1 = t0 + static_cast<uintptr_t>(n);
      if (w0 < t1 && t0 < w1)
        fail("workspace", "memory disjoint from argument '" + s.name + "' (the call writes its workspace)",
             "overlapping memory");
    }
  }

 private:
  struct Seen {
    std::string name;
    fgdn_tensor t;
    Role role;
  };

  static std::string state_hint(const Spec& spec) {
    if (!spec.state) return "";
    return spec.v_first
               ? " (with state_v_first states are stored [.., V, K] with K contiguous; a state "
                 "stored [.., K, V] is passed with state_v_first off)"
               : " (a state stored [.., V, K], K contiguous, e.g. a transposed view, is passed "
                 "as such with state_v_first=True)";
  }

  // The CUDA kernels load rows with 16-byte vector accesses.
  void cuda_alignment(const std::string& name, const fgdn_tensor& t) const {
    const size_t es = dtype_size(t.dtype);
    if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
      fail(name, "a 16-byte aligned data pointer on cuda", "an unaligned pointer");
    if (t.ndim >= 2 && t.shape[t.ndim - 1] * static_cast<int64_t>(es) >= 16) {
      for (int d = 0; d + 1 < t.ndim; ++d)
        if (t.shape[d] > 1 && (t.strides[d] * static_cast<int64_t>(es)) % 16 != 0)  // (fits: < bytes)
          fail(name, "strides that are multiples of 16 bytes on cuda",
               "stride " + std::to_string(t.strides[d]) + " in dimension " + std::to_string(d));
    }
  }

  const char* fn_;
  bool have_device_ = false;
  int32_t device_type_ = 0, device_id_ = 0;
  std::vector<Seen> seen_;
};

const std::initializer_list<fgdn_dtype> kInputDtypes = {FGDN_BFLOAT16, FGDN_FLOAT16, FGDN_FLOAT32};
// g and beta (and dg, dbeta in the same dtypes): every backend reads them element by element
// through a run-time dtype switch (load_float / cuda::load_as_float), fp16 included.
const std::initializer_list<fgdn_dtype> kGateDtypes = {FGDN_FLOAT32, FGDN_BFLOAT16, FGDN_FLOAT16};
const std::initializer_list<fgdn_dtype> kIndexDtypes = {FGDN_INT32, FGDN_INT64};
// States the caller passes or receives (initial state / pool, final state, their gradients):
// each in its own dtype, converted to float32 on load and rounded to nearest even on store.
// Checkpoints are float32.
const std::initializer_list<fgdn_dtype> kStateDtypes = {FGDN_FLOAT32, FGDN_BFLOAT16, FGDN_FLOAT16};

// Reads a validated 1-D index tensor (host or device) into int64 on the host; a device tensor
// is read on `stream`, ordered after the caller's work on it (one host synchronisation).
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

// State indices: each below the pool size (negative: no state), and, when the call writes
// final states back into the pool, no row twice (two sequences would write one row). A sort,
// not a table over the pool: a pool may have 2^62 rows (stride 0, read only).
void check_state_indices(const Checker& c, const std::vector<int64_t>& idx, int64_t pool_rows,
                         bool written) {
  for (size_t n = 0; n < idx.size(); ++n)
    if (idx[n] >= pool_rows)
      c.fail("state_indices", "indices below the pool size P=" + std::to_string(pool_rows) + " (negative: no state)",
             "state_indices[" + std::to_string(n) + "]=" + std::to_string(idx[n]));
  if (!written) return;
  std::vector<std::pair<int64_t, size_t>> rows;
  for (size_t n = 0; n < idx.size(); ++n)
    if (idx[n] >= 0) rows.emplace_back(idx[n], n);
  std::sort(rows.begin(), rows.end());
  for (size_t i = 1; i < rows.size(); ++i)
    if (rows[i].first == rows[i - 1].first)
      c.fail("state_indices",
             "distinct non-negative indices (with output_final_state each sequence writes its row)",
             "index " + std::to_string(rows[i].first) + " twice (state_indices[" +
                 std::to_string(rows[i - 1].second) + "] and state_indices[" +
                 std::to_string(rows[i].second) + "])");
}

// The part shared by forward and backward: the inputs, without their values.
Problem validate_inputs(Checker& c, const fgdn_inputs& in, bool pool_written) {
  Problem p;
#ifdef FLASHGDN_WITH_CUDA
  // Head dims before the cuda tensors' strides: K = 100 would otherwise be refused for a row
  // stride that is not a multiple of 16 bytes, which is true but does not say what to change.
  // Only where q, k and v all claim a cuda device (a bad device is the first thing to report).
  const bool qkv_on_cuda = in.q.device_type == FGDN_CUDA && in.q.device_id >= 0 &&
                           in.k.device_type == FGDN_CUDA && in.v.device_type == FGDN_CUDA;
  if (qkv_on_cuda && in.q.ndim == 4 && in.v.ndim == 4 &&
      !cuda_supports_head_dims(in.q.shape[3], in.v.shape[3]))
    c.fail("q", "head dims K = V in {64, 128} on cuda",
           "K=" + std::to_string(in.q.shape[3]) + ", V=" + std::to_string(in.v.shape[3]));
#endif
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
    // (Head dims: checked first, at the top, once q, k and v claim a cuda device; a call that
    // reaches here with q on cuda has all three there.)
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
  c.tensor(g_name, in.g, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}}, kGateDtypes, kScalarInput);
  c.tensor("beta", in.beta, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}}, kGateDtypes, kScalarInput);
  p.g_dtype = static_cast<fgdn_dtype>(in.g.dtype);
  p.beta_dtype = static_cast<fgdn_dtype>(in.beta.dtype);
  if (p.gate_in_kernel) {
    c.tensor("A_log", in.A_log, {{p.Hv, "Hv"}}, {FGDN_FLOAT32}, kScalarInput);
    c.optional_tensor("dt_bias", in.dt_bias, {{p.Hv, "Hv"}}, {FGDN_FLOAT32}, kScalarInput);
    p.has_dt_bias = present(in.dt_bias);
  } else {
    c.absent("A_log", in.A_log, "gate_in_kernel is 0");
    c.absent("dt_bias", in.dt_bias, "gate_in_kernel is 0");
  }

  // Sequences: dense B x T, or varlen with cu_seqlens (its values are read later, in a call).
  if (present(in.cu_seqlens)) {
    c.tensor("cu_seqlens", in.cu_seqlens, {{kAny, "N+1"}}, kIndexDtypes, kScalarInput);
    if (in.cu_seqlens.shape[0] < 2)
      c.fail("cu_seqlens", "at least 2 entries (N + 1 with N >= 1 sequences)",
             std::to_string(in.cu_seqlens.shape[0]) + " entries");
    if (p.B != 1)
      c.fail("q", "batch size B=1 when cu_seqlens is given (sequences are packed along T)",
             "B=" + std::to_string(p.B));
    p.varlen = true;
    p.N = in.cu_seqlens.shape[0] - 1;
    c.optional_tensor("cu_seqlens_host", in.cu_seqlens_host, {{p.N + 1, "N+1"}}, kIndexDtypes,
                      Spec{Access::kScalars, Role::kInput, true, false, false});
  } else {
    c.absent("cu_seqlens_host", in.cu_seqlens_host, "cu_seqlens is not given");
    p.N = p.B;
    p.have_host_seqlens = true;  // seq(n) from the shapes; p.cu stays empty (B may be 2^39)
  }

  // States: [N, Hv, K, V], or [N, Hv, V, K] with state_v_first.
  p.state_v_first = in.state_v_first != 0;
  const auto [sd2, sd3] = state_dims(p);
  p.has_state_indices = present(in.state_indices);
  if (p.has_state_indices) {
    c.tensor("state_indices", in.state_indices, {{p.N, "N"}}, kIndexDtypes, kScalarInput);
    if (!present(in.initial_state))
      c.fail("initial_state", "a state pool [P, Hv, K, V] when state_indices is given", "none");
    // Written back in place with output_final_state: then an output of the call.
    c.tensor("initial_state", in.initial_state, {{kAny, "P"}, {p.Hv, "Hv"}, sd2, sd3}, kStateDtypes,
             state_spec(p.state_v_first, pool_written ? Role::kOutput : Role::kInput));
    p.pool_rows = in.initial_state.shape[0];
  } else {
    c.optional_tensor("initial_state", in.initial_state, {{p.N, "N"}, {p.Hv, "Hv"}, sd2, sd3},
                      kStateDtypes, state_spec(p.state_v_first, Role::kInput));
    p.pool_rows = p.N;
  }
  p.has_initial_state = present(in.initial_state);

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

// The precision level (fgdn_precision) of the forward and the backward alike.
fgdn_precision check_precision(const Checker& c, int32_t precision) {
  if (precision != FGDN_PRECISION_DEFAULT && precision != FGDN_PRECISION_FAST &&
      precision != FGDN_PRECISION_HIGH)
    c.fail("precision", "FGDN_PRECISION_DEFAULT (0), FGDN_PRECISION_FAST (1) or FGDN_PRECISION_HIGH (2)",
           std::to_string(precision));
  return static_cast<fgdn_precision>(precision);
}

// context_parallel (fgdn_context_parallel) and cp_segment of the forward and the backward alike.
void check_context_parallel(const Checker& c, int32_t context_parallel, int64_t cp_segment, Problem& p) {
  if (context_parallel != FGDN_CONTEXT_PARALLEL_AUTO && context_parallel != FGDN_CONTEXT_PARALLEL_OFF &&
      context_parallel != FGDN_CONTEXT_PARALLEL_ON)
    c.fail("context_parallel",
           "FGDN_CONTEXT_PARALLEL_AUTO (0), FGDN_CONTEXT_PARALLEL_OFF (1) or FGDN_CONTEXT_PARALLEL_ON (2)",
           std::to_string(context_parallel));
  if (cp_segment < 0 || cp_segment % 64 != 0 || cp_segment > (int64_t{1} << 30))
    c.fail("cp_segment", "0 or a positive multiple of 64 up to 2^30", std::to_string(cp_segment));
  p.context_parallel = context_parallel;
  p.cp_segment = cp_segment;
}

// What the extents imply beyond each tensor's own range. Every size a backend derives is a
// product of at most (tokens + 64 per sequence and batch row) x heads x two head dims x a small
// constant: the CPU's partial buffers (B*T*Hv*K floats) and per-pair chunk states
// (ceil(len/64)*K*V floats), the CUDA workspaces (prep_workspace_bytes: B*T*Hv floats per
// array; backward_workspace_bytes: chunk slots x 64 x Hv x D x D floats; chunk slots <=
// ceil(T/64) + N or B*ceil(T/64)). Requiring the bound below, with 64 as the constant,
// leaves every such product and its sums well inside int64, so backends compute them plainly
// (docs/CONTRACT.md).
void check_derived_sizes(const Checker& c, const Problem& p) {
  const int64_t heads = std::max(p.Hq, p.Hv);
  const int64_t dim = std::max<int64_t>({p.K, p.V, 64});
  int64_t tokens = 0, extra = 0, padded = 0, bound = 0;
  const bool ok = checked_mul(p.B, p.T, &tokens) && checked_add(p.B, p.N, &extra) &&
                  checked_add(extra, 1, &extra) && checked_mul(extra, 64, &extra) &&
                  checked_add(tokens, extra, &padded) &&
                  checked_product({padded, heads, dim, dim, 64}, &bound);
  if (!ok)
    c.fail("q",
           "extents whose derived sizes fit in 64 bits ((B*T + 64*(B + N + 1)) * max(Hq, Hv) * "
           "max(K, V, 64)^2 * 64 < 2^63)",
           "B=" + std::to_string(p.B) + ", T=" + std::to_string(p.T) + ", N=" + std::to_string(p.N) +
               ", Hq=" + std::to_string(p.Hq) + ", Hv=" + std::to_string(p.Hv) +
               ", K=" + std::to_string(p.K) + ", V=" + std::to_string(p.V));
#ifdef FLASHGDN_WITH_CUDA
  if (p.on_cuda) {
    const std::string why = cuda::launch_limits_error(p);
    if (!why.empty()) throw NotSupported("flashgdn: " + why);
  }
#endif
}

// Whether the call's stream is capturing a CUDA graph (never, on the CPU).
bool capturing([[maybe_unused]] const Problem& p, [[maybe_unused]] void* stream) {
#ifdef FLASHGDN_WITH_CUDA
  return p.on_cuda && cuda::stream_capturing(stream, p.device_id);
#else
  return false;
#endif
}

// In a call: the sequence boundaries on the host (a device cu_seqlens read back once, on the
// caller's stream, unless the host copy is given; a cpu cu_seqlens compared with its copy) and
// host state indices.
void read_values(const Checker& c, Problem& p, const fgdn_inputs& in, bool pool_written,
                 void* stream) {
  if (p.varlen) {
    p.capturing = capturing(p, stream);
    const bool have_copy = present(in.cu_seqlens_host);
    const char* src_name = have_copy ? "cu_seqlens_host" : "cu_seqlens";
    if (!have_copy && in.cu_seqlens.device_type == FGDN_CUDA && p.capturing)
      c.fail("cu_seqlens", "its host copy cu_seqlens_host while the stream captures a CUDA graph "
             "(reading a device tensor back waits for the stream, which capture forbids)",
             "a device tensor and no host copy");
    p.cu = read_indices(have_copy ? in.cu_seqlens_host : in.cu_seqlens, stream);
    p.have_host_seqlens = true;
    if (have_copy && in.cu_seqlens.device_type == FGDN_CPU) {
      const std::vector<int64_t> cu = read_indices(in.cu_seqlens, stream);
      for (int64_t n = 0; n <= p.N; ++n)
        if (cu[n] != p.cu[n])
          c.fail("cu_seqlens_host", "a copy equal to cu_seqlens",
                 "cu_seqlens_host[" + std::to_string(n) + "]=" + std::to_string(p.cu[n]) +
                     " but cu_seqlens[" + std::to_string(n) + "]=" + std::to_string(cu[n]));
    }
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
  }
  // Device indices are read only in check mode: reading them would synchronise every call.
  if (p.has_state_indices && in.state_indices.device_type == FGDN_CPU)
    check_state_indices(c, read_indices(in.state_indices, stream), p.pool_rows, pool_written);
}

// ---- check mode -------------------------------------------------------------------------------

// "[i0, i1, ...]": the multi-index of a row-major linear index over shape[0, ndim).
std::string index_str(const int64_t* shape, int ndim, uint64_t linear) {
  int64_t idx[FGDN_MAX_DIMS] = {};
  for (int d = ndim - 1; d >= 0; --d) {
    idx[d] = static_cast<int64_t>(linear % static_cast<uint64_t>(shape[d]));
    linear /= static_cast<uint64_t>(shape[d]);
  }
  return list_str(idx, ndim);
}

// The inputs' values, at one host synchronisation on cuda; the first offending element named.
void check_input_values(const Checker& c, const Problem& p, const fgdn_inputs& in,
                        const fgdn_tensor* d_o, const fgdn_tensor* d_final_state,
                        bool pool_written, void* stream) {
  if (p.on_cuda && capturing(p, stream))
    c.fail("check_inputs", "off while the stream captures a CUDA graph (check mode reads the "
           "values back and waits for the stream)", "on");
  const std::vector<ValueCheck> checks = input_value_checks(p, in, d_o, d_final_state);
  // Copies the device needs to send back: cu_seqlens when the host copy stood in for it, the
  // state indices (read nowhere else on the device path).
  const bool cu_back = p.on_cuda && p.varlen && present(in.cu_seqlens_host);
  const bool idx_back = p.on_cuda && p.has_state_indices;
  ValueCheckOutcome out;
  if (p.on_cuda) {
#ifdef FLASHGDN_WITH_CUDA
    out = cuda::run_value_checks(checks, cu_back ? &in.cu_seqlens : nullptr,
                                 idx_back ? &in.state_indices : nullptr, p.device_id, stream);
#else
    (void)stream;
#endif
  } else {
    out = run_value_checks_host(checks);
  }
  if (cu_back)
    for (int64_t n = 0; n <= p.N; ++n)
      if (out.cu_seqlens[n] != p.cu[n])
        c.fail("cu_seqlens", "values equal to its host copy cu_seqlens_host (check_inputs)",
               "cu_seqlens[" + std::to_string(n) + "]=" + std::to_string(out.cu_seqlens[n]) +
                   " but cu_seqlens_host[" + std::to_string(n) + "]=" + std::to_string(p.cu[n]));
  if (idx_back) check_state_indices(c, out.state_indices, p.pool_rows, pool_written);
  for (size_t i = 0; i < checks.size(); ++i) {
    const ValueCheck& v = checks[i];
    const ValueCheckResult& r = out.results[i];
    if (r.first_bad == kNoBadValue) continue;
    std::ostringstream got;
    got << r.value << " at " << v.name;
    if (v.rows != nullptr) {  // a pool read through state_indices: name the row
      const std::vector<int64_t> idx = idx_back ? out.state_indices : read_indices(in.state_indices, stream);
      const uint64_t per_row = static_cast<uint64_t>(v.shape[1] * v.shape[2] * v.shape[3]);
      const int64_t n = static_cast<int64_t>(r.first_bad / per_row);
      got << "[" << idx[n] << ", " << index_str(v.shape + 1, v.ndim - 1, r.first_bad % per_row).substr(1)
          << " (pool row state_indices[" << n << "]=" << idx[n] << ")";
    } else {
      got << index_str(v.shape, v.ndim, r.first_bad);
    }
    c.fail(v.name,
           v.rule == kRuleFiniteNonPositive
               ? "finite values <= 0 (the log-space gate; check_inputs)"
               : "finite values (check_inputs)",
           got.str());
  }
}

}  // namespace

bool cpu_supports_head_dim(int64_t d) {
  return d == 16 || d == 32 || d == 64 || d == 128 || d == 256;
}

bool cuda_supports_head_dims(int64_t K, int64_t V) { return K == V && (K == 64 || K == 128); }

bool check_mode(const fgdn_inputs& in) {
  if (in.check_inputs != 0) return true;
  const char* s = std::getenv("FLASHGDN_CHECK_INPUTS");
  return s != nullptr && s[0] != '\0' && !(s[0] == '0' && s[1] == '\0');
}

int64_t saved_states_rows(const Problem& p) {
#ifdef FLASHGDN_WITH_CUDA
  return cuda::saved_states_rows(p);
#else
  (void)p;
  return 0;
#endif
}

namespace {

// saved_states (forward: written, backward: read): only where the CUDA backward takes them, as
// [R, Hv, K, V] bf16, row-major (the fused kernel maps it as rows of K x V tiles).
void check_saved_states(Checker& c, const fgdn_tensor& t, const Problem& p, Role role) {
  if (!present(t)) return;
  const int64_t rows = saved_states_rows(p);
  if (rows == 0)
    c.fail("saved_states",
           "no tensor (this call's backward recomputes its states: fgdn_saved_states_rows is 0 on the CPU, "
           "at `high`, for fp16 or K = V = 64, at `default` with gate_in_kernel, or with FLASHGDN_BWD_FUSED=0)",
           "a tensor");
  if (p.has_state_indices)
    c.fail("saved_states", "no tensor with state_indices (a pool: an inference call)", "a tensor");
  c.tensor("saved_states", t, {{rows, "R"}, {p.Hv, "Hv"}, {p.K, "K"}, {p.V, "V"}}, {FGDN_BFLOAT16},
           Spec{Access::kRows, role, false, false, false});
  const int64_t want[4] = {p.Hv * p.K * p.V, p.K * p.V, p.V, 1};
  for (int d = 0; d < 4; ++d)
    if (t.strides[d] != want[d])
      c.fail("saved_states", "a contiguous (row-major) tensor", "strides " + std::to_string(t.strides[0]) + ", " +
                                                                   std::to_string(t.strides[1]) + ", " +
                                                                   std::to_string(t.strides[2]) + ", " +
                                                                   std::to_string(t.strides[3]));
}

}  // namespace

Problem validate_forward(const fgdn_fwd_args* a, Mode mode, void* stream, const void* workspace,
                         size_t workspace_bytes) {
  Checker c("fgdn_forward");
  if (a == nullptr) c.fail("args", "a pointer", "NULL");
  const bool pool_written = a->output_final_state != 0 && present(a->in.state_indices);
  Problem p = validate_inputs(c, a->in, pool_written);
  const auto [sd2, sd3] = state_dims(p);

  c.tensor("o", a->o, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}, {p.V, "V"}}, {p.qkv_dtype}, kRowsOutput);

  p.output_final_state = a->output_final_state != 0;
  if (p.output_final_state && !p.has_state_indices) {
    c.tensor("final_state", a->final_state, {{p.N, "N"}, {p.Hv, "Hv"}, sd2, sd3}, kStateDtypes,
             state_spec(p.state_v_first, Role::kOutput));
  } else if (p.output_final_state) {
    c.absent("final_state", a->final_state,
             "with state_indices the final state is written back into the initial_state pool");
  } else {
    c.absent("final_state", a->final_state, "output_final_state is 0");
  }

  p.precision = check_precision(c, a->precision);
  check_context_parallel(c, a->context_parallel, a->cp_segment, p);

  p.checkpoint_every = a->checkpoint_every;
  if (p.checkpoint_every < 0 || p.checkpoint_every % 64 != 0)
    c.fail("checkpoint_every", "0 or a positive multiple of 64",
           std::to_string(p.checkpoint_every));
  if (p.checkpoint_every > 0) {
    c.tensor("checkpoints", a->checkpoints, {{kAny, "R"}, {p.Hv, "Hv"}, sd2, sd3}, {FGDN_FLOAT32},
             state_spec(p.state_v_first, Role::kOutput));
  } else {
    c.absent("checkpoints", a->checkpoints, "checkpoint_every is 0");
  }
  if (present(a->saved_states) && p.checkpoint_every > 0)
    c.fail("saved_states", "no tensor with checkpoints (checkpoint_every > 0)", "a tensor");
  check_saved_states(c, a->saved_states, p, Role::kOutput);
  p.has_saved_states = present(a->saved_states);
  check_derived_sizes(c, p);
  c.overlaps();
  if (p.on_cuda) c.workspace(workspace, workspace_bytes);
  if (mode == Mode::kShapes && p.varlen) return p;  // the row count below needs cu_seqlens

  if (mode == Mode::kCall) read_values(c, p, a->in, pool_written, stream);
  if (p.checkpoint_every > 0) {
    int64_t rows = 0;
    for (int64_t n = 0; n < p.N; ++n) rows += p.seq(n).len / p.checkpoint_every;
    if (a->checkpoints.shape[0] < rows)
      c.fail("checkpoints", "at least R=" + std::to_string(rows) +
                                " rows (sum over sequences of floor(len / checkpoint_every))",
             "shape " + shape_str(a->checkpoints));
  }
  if (mode == Mode::kCall && check_mode(a->in))
    check_input_values(c, p, a->in, nullptr, nullptr, pool_written, stream);
  return p;
}

Problem validate_backward(const fgdn_bwd_args* a, Mode mode, void* stream, const void* workspace,
                          size_t workspace_bytes) {
  Checker c("fgdn_backward");
  if (a == nullptr) c.fail("args", "a pointer", "NULL");
  Problem p = validate_inputs(c, a->in, false);
  const auto [sd2, sd3] = state_dims(p);

  c.tensor("d_o", a->d_o, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}, {p.V, "V"}}, {p.qkv_dtype});
  c.optional_tensor("d_final_state", a->d_final_state, {{p.N, "N"}, {p.Hv, "Hv"}, sd2, sd3},
                    kStateDtypes, state_spec(p.state_v_first, Role::kInput));
  p.has_d_final_state = present(a->d_final_state);

  c.tensor("dq", a->dq, {{p.B, "B"}, {p.T, "T"}, {p.Hq, "Hq"}, {p.K, "K"}}, {p.qkv_dtype}, kRowsOutput);
  c.tensor("dk", a->dk, {{p.B, "B"}, {p.T, "T"}, {p.Hq, "Hq"}, {p.K, "K"}}, {p.qkv_dtype}, kRowsOutput);
  c.tensor("dv", a->dv, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}, {p.V, "V"}}, {p.qkv_dtype}, kRowsOutput);
  c.tensor("dg", a->dg, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}}, {p.g_dtype}, kScalarOutput);
  c.tensor("dbeta", a->dbeta, {{p.B, "B"}, {p.T, "T"}, {p.Hv, "Hv"}}, {p.beta_dtype}, kScalarOutput);
  if (p.gate_in_kernel) {
    c.tensor("dA_log", a->dA_log, {{p.Hv, "Hv"}}, {FGDN_FLOAT32}, kScalarOutput);
    if (p.has_dt_bias)
      c.tensor("ddt_bias", a->ddt_bias, {{p.Hv, "Hv"}}, {FGDN_FLOAT32}, kScalarOutput);
    else
      c.absent("ddt_bias", a->ddt_bias, "dt_bias is not given");
  } else {
    c.absent("dA_log", a->dA_log, "gate_in_kernel is 0");
    c.absent("ddt_bias", a->ddt_bias, "gate_in_kernel is 0");
  }
  if (p.has_initial_state) {
    c.optional_tensor("dh0", a->dh0, {{p.N, "N"}, {p.Hv, "Hv"}, sd2, sd3}, kStateDtypes,
                      state_spec(p.state_v_first, Role::kOutput));
  } else {
    c.absent("dh0", a->dh0, "initial_state is not given");
  }
  p.want_dh0 = present(a->dh0);
  p.precision = check_precision(c, a->precision);
  check_context_parallel(c, a->context_parallel, a->cp_segment, p);
  if (a->saved_states_scratch != 0 && a->saved_states_scratch != 1)
    c.fail("saved_states_scratch", "0 or 1", std::to_string(a->saved_states_scratch));
  if (a->saved_states_scratch == 1 && !present(a->saved_states))
    c.fail("saved_states_scratch", "0 without saved_states (1: their memory as the backward's scratch)", "1");
  // As the backward's scratch the saved states are written: an output, overlapping nothing.
  check_saved_states(c, a->saved_states, p, a->saved_states_scratch == 1 ? Role::kOutput : Role::kInput);
  p.has_saved_states = present(a->saved_states);
  check_derived_sizes(c, p);
  c.overlaps();
  if (p.on_cuda) c.workspace(workspace, workspace_bytes);
  if (mode == Mode::kCall) {
    read_values(c, p, a->in, false, stream);
    if (check_mode(a->in))
      check_input_values(c, p, a->in, &a->d_o, p.has_d_final_state ? &a->d_final_state : nullptr,
                         false, stream);
  }
  return p;
}

}  // namespace flashgdn
