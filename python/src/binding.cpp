// flashgdn._C: a thin nanobind layer over the C ABI (include/flashgdn/flashgdn.h) and the
// float64 oracle (reference/gdn_reference.h). Nothing here knows about torch.
//
// Tensors cross into forward/backward/*_workspace_size as plain descriptors built in Python
// (python/flashgdn/_core.py) from a tensor's metadata:
//
//     (data_ptr: int, dtype: int (fgdn_dtype), shape: tuple[int], strides: tuple[int]
//      (in elements), device_type: int (1 = CPU, 2 = CUDA), device_id: int)
//
// and are copied verbatim into fgdn_tensor; the library validates everything (shapes,
// dtypes, devices, strides) and names the offending argument. Why descriptors and not
// nb::ndarray (DLPack):
//   * bf16/fp16 torch tensors on the CPU and on CUDA go through unchanged (no framework
//     dtype negotiation, no numpy, which has no bfloat16);
//   * no DLPack capsule per tensor per call (a dozen or more tensors per call) and none of
//     the DLPack protocol's stream handshakes on CUDA tensors: the op runs on exactly the
//     stream Python passes, which is what CUDA graph capture and torch.compile need;
//   * arbitrary strides, expanded (stride 0) and empty tensors (whose data_ptr torch may make
//     0) reach the library's own validation, so Python users get the same messages as C users;
//   * the extension links no torch C++ code, so one stable-ABI (abi3) build serves any
//     torch version.
// The oracle functions take float64 arrays (numpy, C-contiguous) through nb::ndarray.
//
// Errors: FGDN_ERROR_INVALID_ARGUMENT -> ValueError, FGDN_ERROR_NOT_SUPPORTED ->
// NotImplementedError, anything else -> RuntimeError; the message is fgdn_last_error().
// Every call into the library releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flashgdn/flashgdn.h"
#include "gdn_reference.h"

namespace nb = nanobind;

namespace {

[[noreturn]] void throw_not_implemented(const std::string& msg) {
  PyErr_SetString(PyExc_NotImplementedError, msg.c_str());
  throw nb::python_error();
}

void check(fgdn_status s) {
  if (s == FGDN_SUCCESS) return;
  // Read the message before anything else can run on this thread.
  std::string msg = fgdn_last_error();
  if (msg.empty()) msg = "flashgdn: call failed with status " + std::to_string(static_cast<int>(s));
  switch (s) {
    case FGDN_ERROR_INVALID_ARGUMENT:
      throw nb::value_error(msg.c_str());
    case FGDN_ERROR_NOT_SUPPORTED:
      throw_not_implemented(msg);
    default:
      throw std::runtime_error(msg);
  }
}

// Keyword arguments, each consumed at most once; unknown keywords are a TypeError.
class Kwargs {
 public:
  Kwargs(const char* fn, nb::kwargs kw) : fn_(fn), kw_(std::move(kw)) {}

  nb::handle get(const char* name) {
    used_.insert(name);
    if (!kw_.contains(name)) return nb::handle();
    nb::handle h = kw_[name];
    return h.is_none() ? nb::handle() : h;
  }

  bool flag(const char* name) {
    nb::handle h = get(name);
    return h.is_valid() && cast<bool>(h, name, "a bool");
  }

  int64_t integer(const char* name, int64_t dflt = 0) {
    nb::handle h = get(name);
    return h.is_valid() ? cast<int64_t>(h, name, "an int") : dflt;
  }

  uintptr_t pointer(const char* name) {
    nb::handle h = get(name);
    return h.is_valid() ? cast<uintptr_t>(h, name, "an int (address)") : 0;
  }

  int64_t required_int(const char* name) {
    nb::handle h = get(name);
    if (!h.is_valid()) throw nb::type_error((fn_ + "(): missing keyword argument '" + name + "'").c_str());
    return cast<int64_t>(h, name, "an int");
  }

  // A tensor descriptor (see the top of this file); absent (ndim 0, the C ABI's rule) when None
  // or missing. Any descriptor is present, an empty tensor's NULL data pointer included.
  fgdn_tensor tensor(const char* name) {
    fgdn_tensor t = fgdn_tensor_none();
    nb::handle h = get(name);
    if (!h.is_valid()) return t;
    const std::string what = "a tensor descriptor (data_ptr, dtype, shape, strides, device_type, device_id)";
    if (!nb::isinstance<nb::tuple>(h)) bad(name, what);
    nb::tuple tup = nb::borrow<nb::tuple>(h);
    if (tup.size() != 6) bad(name, what);
    t.data = reinterpret_cast<void*>(cast<uintptr_t>(tup[0], name, what.c_str()));
    t.dtype = cast<int32_t>(tup[1], name, what.c_str());
    auto shape = cast<std::vector<int64_t>>(tup[2], name, what.c_str());
    auto strides = cast<std::vector<int64_t>>(tup[3], name, what.c_str());
    t.device_type = cast<int32_t>(tup[4], name, what.c_str());
    t.device_id = cast<int32_t>(tup[5], name, what.c_str());
    if (shape.empty() || shape.size() > FGDN_MAX_DIMS || strides.size() != shape.size())
      throw nb::value_error((std::string(name) + ": expected 1 to " + std::to_string(FGDN_MAX_DIMS) +
                             " dimensions with one stride each, got " + std::to_string(shape.size()) +
                             " dimensions and " + std::to_string(strides.size()) + " strides")
                                .c_str());
    t.ndim = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) {
      t.shape[i] = shape[i];
      t.strides[i] = strides[i];
    }
    return t;
  }

  // Raises TypeError naming every keyword that no getter asked for.
  void finish() {
    std::string unknown;
    for (auto item : kw_) {
      std::string key = nb::cast<std::string>(item.first);
      if (!used_.count(key)) unknown += (unknown.empty() ? "'" : ", '") + key + "'";
    }
    if (!unknown.empty())
      throw nb::type_error((fn_ + "(): unexpected keyword argument(s) " + unknown).c_str());
  }

  const std::string& fn() const { return fn_; }

 private:
  template <typename T>
  T cast(nb::handle h, const char* name, const char* what) {
    T out{};
    if (!nb::try_cast<T>(h, out)) bad(name, what);
    return out;
  }
  [[noreturn]] void bad(const char* name, const std::string& what) {
    throw nb::type_error((fn_ + "(): argument '" + name + "' must be " + what).c_str());
  }

  std::string fn_;
  nb::kwargs kw_;
  std::set<std::string> used_;
};

void parse_inputs(Kwargs& kw, fgdn_inputs& in) {
  in.q = kw.tensor("q");
  in.k = kw.tensor("k");
  in.v = kw.tensor("v");
  in.g = kw.tensor("g");
  in.beta = kw.tensor("beta");
  in.A_log = kw.tensor("A_log");
  in.dt_bias = kw.tensor("dt_bias");
  in.cu_seqlens = kw.tensor("cu_seqlens");
  in.cu_seqlens_host = kw.tensor("cu_seqlens_host");
  in.initial_state = kw.tensor("initial_state");
  in.state_indices = kw.tensor("state_indices");
  nb::handle scale = kw.get("scale");
  if (scale.is_valid()) {
    double s = 0.0;
    if (!nb::try_cast<double>(scale, s))
      throw nb::type_error((kw.fn() + "(): argument 'scale' must be a float or None").c_str());
    in.scale = s;
    in.has_scale = 1;
  }
  in.use_qk_l2norm_in_kernel = kw.flag("use_qk_l2norm_in_kernel");
  in.gate_in_kernel = kw.flag("gate_in_kernel");
  in.state_v_first = kw.flag("state_v_first");
  in.check_inputs = kw.flag("check_inputs");
}

fgdn_fwd_args parse_fwd(Kwargs& kw) {
  fgdn_fwd_args a;
  std::memset(&a, 0, sizeof(a));
  parse_inputs(kw, a.in);
  a.output_final_state = kw.flag("output_final_state");
  a.checkpoint_every = kw.integer("checkpoint_every");
  a.precision = static_cast<int32_t>(kw.integer("precision"));
  a.context_parallel = static_cast<int32_t>(kw.integer("context_parallel"));
  a.cp_segment = kw.integer("cp_segment");
  a.o = kw.tensor("o");
  a.final_state = kw.tensor("final_state");
  a.checkpoints = kw.tensor("checkpoints");
  a.saved_states = kw.tensor("saved_states");
  return a;
}

fgdn_bwd_args parse_bwd(Kwargs& kw) {
  fgdn_bwd_args a;
  std::memset(&a, 0, sizeof(a));
  parse_inputs(kw, a.in);
  a.d_o = kw.tensor("d_o");
  a.d_final_state = kw.tensor("d_final_state");
  a.dq = kw.tensor("dq");
  a.dk = kw.tensor("dk");
  a.dv = kw.tensor("dv");
  a.dg = kw.tensor("dg");
  a.dbeta = kw.tensor("dbeta");
  a.dA_log = kw.tensor("dA_log");
  a.ddt_bias = kw.tensor("ddt_bias");
  a.dh0 = kw.tensor("dh0");
  a.precision = static_cast<int32_t>(kw.integer("precision"));
  a.context_parallel = static_cast<int32_t>(kw.integer("context_parallel"));
  a.cp_segment = kw.integer("cp_segment");
  a.saved_states = kw.tensor("saved_states");
  a.saved_states_scratch = kw.flag("saved_states_scratch") ? 1 : 0;
  return a;
}

struct Launch {
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  void* stream = nullptr;
};

Launch parse_launch(Kwargs& kw) {
  Launch l;
  l.workspace = reinterpret_cast<void*>(kw.pointer("workspace"));
  int64_t bytes = kw.integer("workspace_bytes");
  if (bytes < 0) throw nb::value_error("workspace_bytes: must be >= 0");
  l.workspace_bytes = static_cast<size_t>(bytes);
  l.stream = reinterpret_cast<void*>(kw.pointer("stream"));
  return l;
}

// ---- float64 oracle ---------------------------------------------------------------------

using F64Array = nb::ndarray<const double, nb::c_contig, nb::device::cpu>;

std::vector<double> read_array(Kwargs& kw, const char* name, size_t expected, bool required) {
  nb::handle h = kw.get(name);
  if (!h.is_valid()) {
    if (required)
      throw nb::type_error((kw.fn() + "(): missing keyword argument '" + name + "'").c_str());
    return {};
  }
  F64Array arr;
  if (!nb::try_cast<F64Array>(h, arr))
    throw nb::type_error(
        (kw.fn() + "(): argument '" + name + "' must be a C-contiguous float64 array on the CPU").c_str());
  if (arr.size() != expected)
    throw nb::value_error((std::string(name) + ": expected " + std::to_string(expected) +
                           " elements, got " + std::to_string(arr.size()))
                              .c_str());
  return std::vector<double>(arr.data(), arr.data() + arr.size());
}

nb::object to_numpy(std::vector<double>&& v, std::initializer_list<size_t> shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  if (v.size() != n)
    throw std::runtime_error("flashgdn oracle: result has " + std::to_string(v.size()) +
                             " elements, expected " + std::to_string(n));
  auto* heap = new std::vector<double>(std::move(v));
  if (heap->capacity() == 0) heap->reserve(1);  // a valid pointer even when empty
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
  std::vector<size_t> shp(shape);
  return nb::cast(nb::ndarray<nb::numpy, double>(heap->data(), shp.size(), shp.data(), owner));
}

bool kw_has(Kwargs& kw, const char* name) { return kw.get(name).is_valid(); }

struct OracleArgs {
  flashgdn::reference::Problem p;
  flashgdn::reference::Inputs in;
  int64_t N = 0;
};

OracleArgs parse_oracle(Kwargs& kw) {
  OracleArgs o;
  auto& p = o.p;
  p.B = kw.required_int("B");
  p.T = kw.required_int("T");
  p.Hq = kw.required_int("Hq");
  p.Hv = kw.required_int("Hv");
  p.K = kw.required_int("K");
  p.V = kw.required_int("V");
  if (p.B < 1 || p.T < 0 || p.Hq < 1 || p.Hv < 1 || p.K < 1 || p.V < 1 || p.Hv % p.Hq != 0)
    throw nb::value_error("reference: need B, Hq, Hv, K, V >= 1, T >= 0 and Hv % Hq == 0");
  nb::handle cu = kw.get("cu_seqlens");
  if (cu.is_valid()) {
    if (!nb::try_cast<std::vector<int64_t>>(cu, p.cu_seqlens))
      throw nb::type_error("reference: 'cu_seqlens' must be a sequence of ints");
    const auto& c = p.cu_seqlens;
    bool ok = p.B == 1 && c.size() >= 2 && c.front() == 0 && c.back() == p.T;
    for (size_t i = 1; ok && i < c.size(); ++i) ok = c[i] >= c[i - 1];
    if (!ok)
      throw nb::value_error("cu_seqlens: expected B == 1 and [N + 1] non-decreasing values from 0 to T");
  }
  nb::handle scale = kw.get("scale");
  if (scale.is_valid() && !nb::try_cast<double>(scale, p.scale))
    throw nb::type_error("reference: 'scale' must be a float or None");
  p.use_qk_l2norm = kw.flag("use_qk_l2norm_in_kernel");
  p.gate_in_kernel = kw.flag("gate_in_kernel");
  p.checkpoint_every = kw.integer("checkpoint_every");
  if (p.checkpoint_every < 0) throw nb::value_error("checkpoint_every: must be >= 0");
  o.N = p.cu_seqlens.empty() ? p.B : static_cast<int64_t>(p.cu_seqlens.size()) - 1;

  const size_t BT = static_cast<size_t>(p.B * p.T);
  auto& in = o.in;
  in.q = read_array(kw, "q", BT * p.Hq * p.K, true);
  in.k = read_array(kw, "k", BT * p.Hq * p.K, true);
  in.v = read_array(kw, "v", BT * p.Hv * p.V, true);
  in.g = read_array(kw, "g", BT * p.Hv, true);
  in.beta = read_array(kw, "beta", BT * p.Hv, true);
  in.A_log = read_array(kw, "A_log", p.Hv, p.gate_in_kernel);
  in.dt_bias = read_array(kw, "dt_bias", p.Hv, false);
  if (!p.gate_in_kernel && (!in.A_log.empty() || !in.dt_bias.empty()))
    throw nb::value_error("A_log, dt_bias: given without gate_in_kernel");
  p.has_initial_state = kw_has(kw, "h0");
  in.h0 = read_array(kw, "h0", static_cast<size_t>(o.N * p.Hv * p.K * p.V), false);
  return o;
}

nb::dict reference_forward(nb::kwargs kwargs) {
  Kwargs kw("reference_forward", std::move(kwargs));
  OracleArgs a = parse_oracle(kw);
  kw.finish();
  flashgdn::reference::Outputs out;
  {
    nb::gil_scoped_release release;
    out = flashgdn::reference::forward(a.p, a.in);
  }
  const auto& p = a.p;
  const size_t B = p.B, T = p.T, Hv = p.Hv, K = p.K, V = p.V, N = a.N;
  nb::dict d;
  d["o"] = to_numpy(std::move(out.o), {B, T, Hv, V});
  d["final_state"] = to_numpy(std::move(out.ht), {N, Hv, K, V});
  const size_t R = p.checkpoint_every > 0 ? static_cast<size_t>(p.num_checkpoints()) : 0;
  d["checkpoints"] = to_numpy(std::move(out.checkpoints), {R, Hv, K, V});
  return d;
}

nb::dict reference_backward(nb::kwargs kwargs) {
  Kwargs kw("reference_backward", std::move(kwargs));
  OracleArgs a = parse_oracle(kw);
  const auto& p = a.p;
  const size_t B = p.B, T = p.T, Hq = p.Hq, Hv = p.Hv, K = p.K, V = p.V, N = a.N;
  std::vector<double> d_o = read_array(kw, "do", B * T * Hv * V, true);
  std::vector<double> d_ht = read_array(kw, "dht", N * Hv * K * V, false);
  kw.finish();
  if (p.checkpoint_every != 0) throw nb::value_error("reference_backward: checkpoint_every must be 0");
  flashgdn::reference::Grads gr;
  {
    nb::gil_scoped_release release;
    gr = flashgdn::reference::backward(p, a.in, d_o, d_ht);
  }
  nb::dict d;
  d["dq"] = to_numpy(std::move(gr.dq), {B, T, Hq, K});
  d["dk"] = to_numpy(std::move(gr.dk), {B, T, Hq, K});
  d["dv"] = to_numpy(std::move(gr.dv), {B, T, Hv, V});
  d["dg"] = to_numpy(std::move(gr.dg), {B, T, Hv});
  d["dbeta"] = to_numpy(std::move(gr.dbeta), {B, T, Hv});
  d["dA_log"] = p.gate_in_kernel ? to_numpy(std::move(gr.dA_log), {Hv}) : nb::none();
  d["ddt_bias"] = p.gate_in_kernel ? to_numpy(std::move(gr.ddt_bias), {Hv}) : nb::none();
  d["dh0"] = p.has_initial_state ? to_numpy(std::move(gr.dh0), {N, Hv, K, V}) : nb::none();
  return d;
}

// The workspace queries: parse the call's arguments, ask the C ABI, without the GIL.
template <class Args>
uint64_t workspace_size(const char* name, nb::kwargs kwargs, Args (*parse)(Kwargs&),
                        fgdn_status (*query)(const Args*, size_t*)) {
  Kwargs kw(name, std::move(kwargs));
  const Args a = parse(kw);
  kw.finish();
  size_t bytes = 0;
  fgdn_status s;
  {
    nb::gil_scoped_release release;
    s = query(&a, &bytes);
  }
  check(s);
  return static_cast<uint64_t>(bytes);
}

// forward / backward: parse the call's arguments and launch parameters, run without the GIL.
template <class Args>
void launch(const char* name, nb::kwargs kwargs, Args (*parse)(Kwargs&),
            fgdn_status (*run)(const Args*, void*, size_t, void*)) {
  Kwargs kw(name, std::move(kwargs));
  const Args a = parse(kw);
  const Launch l = parse_launch(kw);
  kw.finish();
  fgdn_status s;
  {
    nb::gil_scoped_release release;
    s = run(&a, l.workspace, l.workspace_bytes, l.stream);
  }
  check(s);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() =
      "flashgdn C ABI binding (thin). Use the flashgdn package; tensors are passed as "
      "(data_ptr, dtype, shape, strides, device_type, device_id) descriptors.";

  m.attr("FLOAT32") = static_cast<int>(FGDN_FLOAT32);
  m.attr("FLOAT16") = static_cast<int>(FGDN_FLOAT16);
  m.attr("BFLOAT16") = static_cast<int>(FGDN_BFLOAT16);
  m.attr("INT32") = static_cast<int>(FGDN_INT32);
  m.attr("INT64") = static_cast<int>(FGDN_INT64);
  m.attr("CPU") = static_cast<int>(FGDN_CPU);
  m.attr("CUDA") = static_cast<int>(FGDN_CUDA);

  m.def("version", []() { return std::string(fgdn_version()); }, "The library version string.");
  m.def("has_cuda", []() { return fgdn_has_cuda() != 0; }, "True if the library has the CUDA backend.");

  m.def(
      "forward_workspace_size",
      [](nb::kwargs kwargs) {
        return workspace_size("forward_workspace_size", std::move(kwargs), parse_fwd,
                              fgdn_forward_workspace_size);
      },
      "forward_workspace_size(**fwd_args) -> int: device scratch bytes for forward().");

  m.def(
      "backward_workspace_size",
      [](nb::kwargs kwargs) {
        return workspace_size("backward_workspace_size", std::move(kwargs), parse_bwd,
                              fgdn_backward_workspace_size);
      },
      "backward_workspace_size(**bwd_args) -> int: device scratch bytes for backward().");

  m.def(
      "saved_states_rows",
      [](nb::kwargs kwargs) {
        Kwargs kw("saved_states_rows", std::move(kwargs));
        const fgdn_fwd_args a = parse_fwd(kw);
        kw.finish();
        int64_t rows = 0;
        check(fgdn_saved_states_rows(&a, &rows));
        return rows;
      },
      "saved_states_rows(**fwd_args) -> int: rows of the saved_states the forward may write for its\n"
      "backward (0: the backward recomputes its states).");

  m.def(
      "forward",
      [](nb::kwargs kwargs) { launch("forward", std::move(kwargs), parse_fwd, fgdn_forward); },
      "forward(q=, k=, v=, g=, beta=, o=, [A_log=, dt_bias=, cu_seqlens=, cu_seqlens_host=,\n"
      "        initial_state=, state_indices=, scale=, use_qk_l2norm_in_kernel=, gate_in_kernel=,\n"
      "        state_v_first=, check_inputs=, output_final_state=, checkpoint_every=, final_state=,\n"
      "        checkpoints=, precision=, context_parallel=, cp_segment=, workspace=,\n"
      "        workspace_bytes=, stream=]): fgdn_forward. Tensors are descriptors; None (or\n"
      "        missing) is absent; precision is an fgdn_precision code (0 default, 1 fast, 2 high).");

  m.def(
      "backward",
      [](nb::kwargs kwargs) { launch("backward", std::move(kwargs), parse_bwd, fgdn_backward); },
      "backward(<inputs as forward>, d_o=, d_final_state=, dq=, dk=, dv=, dg=, dbeta=, dA_log=,\n"
      "         ddt_bias=, dh0=, precision=, context_parallel=, cp_segment=, saved_states=,\n"
      "         saved_states_scratch=, workspace=, workspace_bytes=, stream=): fgdn_backward;\n"
      "         precision, context_parallel and cp_segment as forward's (the CUDA backward's\n"
      "         arithmetic and reverse pass).");

  m.def("reference_forward", &reference_forward,
        "reference_forward(B=, T=, Hq=, Hv=, K=, V=, q=, k=, v=, g=, beta=, [cu_seqlens=, scale=,\n"
        "                  use_qk_l2norm_in_kernel=, gate_in_kernel=, A_log=, dt_bias=, h0=,\n"
        "                  checkpoint_every=]) -> {'o', 'final_state', 'checkpoints'}: the float64\n"
        "oracle over C-contiguous float64 arrays (dense [B, T, H, D] layouts, states [N, Hv, K, V]).");
  m.def("reference_backward", &reference_backward,
        "reference_backward(<as reference_forward>, do=, [dht=]) -> {'dq', 'dk', 'dv', 'dg', 'dbeta',\n"
        "                   'dA_log', 'ddt_bias', 'dh0'} (None where not applicable).");
}
