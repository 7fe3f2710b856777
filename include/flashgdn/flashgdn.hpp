// flashgdn C++ API: the C ABI's structs with exceptions and small helpers.
//
//   flashgdn::FwdArgs a;                      // every tensor absent, every flag off
//   a.in.q = flashgdn::host_tensor(q, FGDN_BFLOAT16, {B, T, Hq, K});
//   ...
//   flashgdn::forward(a);                     // throws flashgdn::Error on a rejected call
#ifndef FLASHGDN_FLASHGDN_HPP_
#define FLASHGDN_FLASHGDN_HPP_

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "flashgdn/flashgdn.h"

namespace flashgdn {

// Thrown by every entry point; status() tells invalid argument from unsupported or CUDA error.
class Error : public std::runtime_error {
 public:
  Error(fgdn_status status, const std::string& what) : std::runtime_error(what), status_(status) {}
  fgdn_status status() const noexcept { return status_; }

 private:
  fgdn_status status_;
};

inline void check(fgdn_status s) {
  if (s != FGDN_SUCCESS) throw Error(s, fgdn_last_error());
}

// A contiguous (row-major) tensor view. An empty shape ({}: ndim 0) is an absent tensor; an
// extent of 0 makes an empty tensor, whose data may be NULL.
inline fgdn_tensor make_tensor(void* data, fgdn_dtype dtype, std::initializer_list<int64_t> shape,
                               fgdn_device_type device = FGDN_CPU, int32_t device_id = 0) {
  fgdn_tensor t = fgdn_tensor_none();
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  t.device_type = device;
  t.device_id = device_id;
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  // Unsigned, so that extents whose product overflows give wrapped strides (which validation
  // refuses, naming the tensor) rather than undefined behaviour here.
  uint64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = static_cast<int64_t>(stride);
    stride *= static_cast<uint64_t>(t.shape[d]);
  }
  return t;
}

inline fgdn_tensor host_tensor(void* data, fgdn_dtype dtype, std::initializer_list<int64_t> shape) {
  return make_tensor(data, dtype, shape, FGDN_CPU, 0);
}

// The C structs zero-initialised: every tensor absent, every flag off, precision
// FGDN_PRECISION_DEFAULT (forward and backward), context parallelism automatic.
struct FwdArgs : fgdn_fwd_args {
  FwdArgs() : fgdn_fwd_args() {}
};
struct BwdArgs : fgdn_bwd_args {
  BwdArgs() : fgdn_bwd_args() {}
};

inline size_t forward_workspace_size(const fgdn_fwd_args& a) {
  size_t n = 0;
  check(fgdn_forward_workspace_size(&a, &n));
  return n;
}
inline size_t backward_workspace_size(const fgdn_bwd_args& a) {
  size_t n = 0;
  check(fgdn_backward_workspace_size(&a, &n));
  return n;
}

// Rows of the saved_states the forward of a may write for its backward (0: none).
inline int64_t saved_states_rows(const fgdn_fwd_args& a) {
  int64_t r = 0;
  check(fgdn_saved_states_rows(&a, &r));
  return r;
}

// stream: a cudaStream_t (nullptr: default stream); ignored for host tensors.
inline void forward(const fgdn_fwd_args& a, void* workspace = nullptr, size_t workspace_bytes = 0,
                    void* stream = nullptr) {
  check(fgdn_forward(&a, workspace, workspace_bytes, stream));
}
inline void backward(const fgdn_bwd_args& a, void* workspace = nullptr, size_t workspace_bytes = 0,
                     void* stream = nullptr) {
  check(fgdn_backward(&a, workspace, workspace_bytes, stream));
}

inline bool has_cuda() { return fgdn_has_cuda() != 0; }

}  // namespace flashgdn

#endif  // FLASHGDN_FLASHGDN_HPP_
