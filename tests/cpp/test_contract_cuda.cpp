// The call contract on the CUDA backend (docs/api.md, "Contract"): calls with no tokens, check
// mode's device kernel (csrc/cuda/check_inputs.cu), the read of a device cu_seqlens ordered on
// the caller's stream, and the launch limits. The GPU tests skip without a device; the limits
// need only a CUDA build (validation refuses them before touching memory).
#include <gtest/gtest.h>

#ifdef FLASHGDN_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "flashgdn/flashgdn.hpp"

namespace {

#ifdef FLASHGDN_WITH_CUDA

using flashgdn::make_tensor;

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define REQUIRE_DEVICE() \
  if (!have_device()) GTEST_SKIP() << "no CUDA device"

// A dense bf16 forward of T tokens, Hq = 1, Hv heads, K = V = 64, whose tensors are fake device
// addresses, each in its own 256 MiB window: never dereferenced (validation refuses first).
flashgdn::FwdArgs fake_forward(int64_t T, int64_t Hv) {
  uintptr_t next = 0x10000000;
  auto fake = [&next](fgdn_dtype dt, std::initializer_list<int64_t> shape) {
    const uintptr_t at = next;
    next += 0x10000000;
    return make_tensor(reinterpret_cast<void*>(at), dt, shape, FGDN_CUDA, 0);
  };
  flashgdn::FwdArgs a;
  a.in.q = fake(FGDN_BFLOAT16, {1, T, 1, 64});
  a.in.k = fake(FGDN_BFLOAT16, {1, T, 1, 64});
  a.in.v = fake(FGDN_BFLOAT16, {1, T, Hv, 64});
  a.in.g = fake(FGDN_FLOAT32, {1, T, Hv});
  a.in.beta = fake(FGDN_FLOAT32, {1, T, Hv});
  a.o = fake(FGDN_BFLOAT16, {1, T, Hv, 64});
  return a;
}

void expect_query(const flashgdn::FwdArgs& a, fgdn_status want, const std::string& part) {
  size_t bytes = 0;
  EXPECT_EQ(fgdn_forward_workspace_size(&a, &bytes), want) << fgdn_last_error();
  EXPECT_NE(std::string(fgdn_last_error()).find(part), std::string::npos) << fgdn_last_error();
}

// Calls larger than the kernels' grids: FGDN_ERROR_NOT_SUPPORTED with the reason, already from
// the workspace query (which reads nothing).
TEST(CudaContract, LaunchLimitsNotSupported) {
  // 65536 value heads (grid y is at most 65535): every tensor small enough to exist.
  expect_query(fake_forward(1, 65536), FGDN_ERROR_NOT_SUPPORTED, "65535 heads");
  // 2^31 sequences, and 2^29 sequences of 4 value heads (the forward's grid x, one CTA per
  // (sequence, value head), is at most 2^31 - 1).
  flashgdn::FwdArgs a = fake_forward(1, 1);
  a.in.cu_seqlens = make_tensor(reinterpret_cast<void*>(uintptr_t{1} << 40), FGDN_INT32,
                                {(int64_t{1} << 31) + 1}, FGDN_CUDA, 0);
  expect_query(a, FGDN_ERROR_NOT_SUPPORTED, "2^31 - 1 (sequence, value head) pairs");
  flashgdn::FwdArgs b = fake_forward(1, 4);
  b.in.cu_seqlens = make_tensor(reinterpret_cast<void*>(uintptr_t{1} << 40), FGDN_INT32,
                                {(int64_t{1} << 29) + 1}, FGDN_CUDA, 0);
  expect_query(b, FGDN_ERROR_NOT_SUPPORTED, "2^31 - 1 (sequence, value head) pairs");
}

// The caller's workspace is written: 256-byte aligned and disjoint from every tensor. Refused
// in validation, before anything touches the (fake) device memory.
TEST(CudaContract, WorkspaceChecked) {
  flashgdn::FwdArgs a = fake_forward(64, 1);
  void* unaligned = static_cast<char*>(a.o.data) + 0x1000010;
  EXPECT_EQ(fgdn_forward(&a, unaligned, 4096, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("'workspace': expected a 256-byte aligned pointer"), std::string::npos)
      << fgdn_last_error();
  EXPECT_EQ(fgdn_forward(&a, static_cast<char*>(a.o.data) - 256, 4096, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("argument 'o'"), std::string::npos) << fgdn_last_error();
}

#define CU(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

// Device buffers freed at scope end.
struct Arena {
  std::vector<void*> ptrs;
  ~Arena() {
    for (void* p : ptrs) cudaFree(p);
  }
  template <class T>
  T* alloc(size_t n) {
    void* p = nullptr;
    if (cudaMalloc(&p, n * sizeof(T) + 16) != cudaSuccess) return nullptr;
    ptrs.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  T* upload(const std::vector<T>& h) {
    T* d = alloc<T>(h.size());
    if (d && !h.empty()) cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
    return d;
  }
};

template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

std::vector<uint16_t> bf16(size_t n, float scale, float shift) {
  std::vector<uint16_t> x(n);
  for (size_t i = 0; i < n; ++i)
    x[i] = flashgdn::float_to_bf16(shift + scale * std::sin(0.37f * static_cast<float>(i)));
  return x;
}
std::vector<float> f32(size_t n, float scale, float shift) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = shift + scale * std::sin(0.11f * static_cast<float>(i));
  return x;
}

constexpr int64_t Hq = 1, Hv = 2, D = 64, S = Hv * D * D;  // one sequence's state: S floats

// No tokens: the empty tensors have NULL data; final states are the initial ones, a pool is
// unchanged, dh0 is dht, dA_log and ddt_bias are zero; nothing is launched on an empty grid.
TEST(CudaContract, NoTokens) {
  REQUIRE_DEVICE();
  Arena a;
  const std::vector<float> h0 = f32(2 * S, 0.5f, 0.f), dht = f32(2 * S, 0.3f, 0.1f);
  float* d_h0 = a.upload(h0);
  float* d_dht = a.upload(dht);
  float* d_ht = a.upload(std::vector<float>(2 * S, std::nanf("")));
  float* d_dh0 = a.upload(std::vector<float>(2 * S, std::nanf("")));
  const std::vector<float> alog = f32(Hv, 0.1f, 0.f);
  float* d_alog = a.upload(alog);
  float* d_dtb = a.upload(alog);
  float* d_dalog = a.upload(std::vector<float>(Hv, std::nanf("")));
  float* d_ddtb = a.upload(std::vector<float>(Hv, std::nanf("")));
  ASSERT_TRUE(d_h0 && d_dht && d_ht && d_dh0 && d_alog && d_dtb && d_dalog && d_ddtb);

  auto empty = [](fgdn_dtype dt, std::initializer_list<int64_t> shape) {
    return make_tensor(nullptr, dt, shape, FGDN_CUDA, 0);
  };
  flashgdn::FwdArgs f;
  f.in.q = empty(FGDN_BFLOAT16, {2, 0, Hq, D});
  f.in.k = empty(FGDN_BFLOAT16, {2, 0, Hq, D});
  f.in.v = empty(FGDN_BFLOAT16, {2, 0, Hv, D});
  f.in.g = empty(FGDN_FLOAT32, {2, 0, Hv});
  f.in.beta = empty(FGDN_FLOAT32, {2, 0, Hv});
  f.in.initial_state = make_tensor(d_h0, FGDN_FLOAT32, {2, Hv, D, D}, FGDN_CUDA);
  f.o = empty(FGDN_BFLOAT16, {2, 0, Hv, D});
  f.final_state = make_tensor(d_ht, FGDN_FLOAT32, {2, Hv, D, D}, FGDN_CUDA);
  f.output_final_state = 1;
  ASSERT_EQ(fgdn_forward(&f, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaDeviceSynchronize());
  EXPECT_EQ(download(d_ht, 2 * S), h0);

  // A pool with one row read and written back, one sequence without: unchanged.
  std::vector<int32_t> idx{1, -1};
  int32_t* d_idx = a.upload(idx);
  flashgdn::FwdArgs fp = f;
  fp.in.state_indices = make_tensor(d_idx, FGDN_INT32, {2}, FGDN_CUDA);
  fp.final_state = fgdn_tensor_none();
  ASSERT_EQ(fgdn_forward(&fp, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaDeviceSynchronize());
  EXPECT_EQ(download(d_h0, 2 * S), h0);

  // Without an initial state: zero.
  f.in.initial_state = fgdn_tensor_none();
  ASSERT_EQ(fgdn_forward(&f, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaDeviceSynchronize());
  EXPECT_EQ(download(d_ht, 2 * S), std::vector<float>(2 * S, 0.f));

  flashgdn::BwdArgs b;
  b.in = f.in;
  b.in.initial_state = make_tensor(d_h0, FGDN_FLOAT32, {2, Hv, D, D}, FGDN_CUDA);
  b.in.gate_in_kernel = 1;
  b.in.A_log = make_tensor(d_alog, FGDN_FLOAT32, {Hv}, FGDN_CUDA);
  b.in.dt_bias = make_tensor(d_dtb, FGDN_FLOAT32, {Hv}, FGDN_CUDA);
  b.d_o = empty(FGDN_BFLOAT16, {2, 0, Hv, D});
  b.d_final_state = make_tensor(d_dht, FGDN_FLOAT32, {2, Hv, D, D}, FGDN_CUDA);
  b.dq = empty(FGDN_BFLOAT16, {2, 0, Hq, D});
  b.dk = empty(FGDN_BFLOAT16, {2, 0, Hq, D});
  b.dv = empty(FGDN_BFLOAT16, {2, 0, Hv, D});
  b.dg = empty(FGDN_FLOAT32, {2, 0, Hv});
  b.dbeta = empty(FGDN_FLOAT32, {2, 0, Hv});
  b.dA_log = make_tensor(d_dalog, FGDN_FLOAT32, {Hv}, FGDN_CUDA);
  b.ddt_bias = make_tensor(d_ddtb, FGDN_FLOAT32, {Hv}, FGDN_CUDA);
  b.dh0 = make_tensor(d_dh0, FGDN_FLOAT32, {2, Hv, D, D}, FGDN_CUDA);
  ASSERT_EQ(fgdn_backward(&b, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaDeviceSynchronize());
  EXPECT_EQ(download(d_dh0, 2 * S), dht);
  EXPECT_EQ(download(d_dalog, Hv), std::vector<float>(Hv, 0.f));
  EXPECT_EQ(download(d_ddtb, Hv), std::vector<float>(Hv, 0.f));
  b.d_final_state = fgdn_tensor_none();
  ASSERT_EQ(fgdn_backward(&b, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaDeviceSynchronize());
  EXPECT_EQ(download(d_dh0, 2 * S), std::vector<float>(2 * S, 0.f));

  // B = 0: nothing at all.
  flashgdn::FwdArgs z;
  z.in.q = empty(FGDN_BFLOAT16, {0, 5, Hq, D});
  z.in.k = empty(FGDN_BFLOAT16, {0, 5, Hq, D});
  z.in.v = empty(FGDN_BFLOAT16, {0, 5, Hv, D});
  z.in.g = empty(FGDN_FLOAT32, {0, 5, Hv});
  z.in.beta = empty(FGDN_FLOAT32, {0, 5, Hv});
  z.o = empty(FGDN_BFLOAT16, {0, 5, Hv, D});
  z.final_state = empty(FGDN_FLOAT32, {0, Hv, D, D});
  z.output_final_state = 1;
  ASSERT_EQ(fgdn_forward(&z, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaDeviceSynchronize());
}

// A valid varlen forward on the device (T = 150 in sequences of 100 and 50 tokens, pool of 4
// rows) with check mode on; each case breaks one value and expects the refusal, with o untouched.
struct CheckCase {
  static constexpr int64_t T = 150, N = 2, P = 4;
  Arena a;
  std::vector<uint16_t> q = bf16(T * Hq * D, 0.5f, 0.f), k = bf16(T * Hq * D, 0.1f, 0.f), v = bf16(T * Hv * D, 0.5f, 0.f);
  std::vector<float> g = f32(T * Hv, 0.2f, -0.5f), beta = f32(T * Hv, 0.2f, 0.5f), pool = f32(P * S, 0.1f, 0.f);
  std::vector<int64_t> cu{0, 100, T};
  std::vector<int32_t> idx{3, 1};
  uint16_t *d_q, *d_k, *d_v, *d_o;
  float *d_g, *d_beta, *d_pool;
  int64_t* d_cu;
  int32_t* d_idx;
  flashgdn::FwdArgs f;

  void upload() {
    d_q = a.upload(q), d_k = a.upload(k), d_v = a.upload(v);
    d_o = a.upload(std::vector<uint16_t>(T * Hv * D, 0xffff));
    d_g = a.upload(g), d_beta = a.upload(beta), d_pool = a.upload(pool);
    d_cu = a.upload(cu);
    d_idx = a.upload(idx);
    f = flashgdn::FwdArgs();
    f.in.q = make_tensor(d_q, FGDN_BFLOAT16, {1, T, Hq, D}, FGDN_CUDA);
    f.in.k = make_tensor(d_k, FGDN_BFLOAT16, {1, T, Hq, D}, FGDN_CUDA);
    f.in.v = make_tensor(d_v, FGDN_BFLOAT16, {1, T, Hv, D}, FGDN_CUDA);
    f.in.g = make_tensor(d_g, FGDN_FLOAT32, {1, T, Hv}, FGDN_CUDA);
    f.in.beta = make_tensor(d_beta, FGDN_FLOAT32, {1, T, Hv}, FGDN_CUDA);
    f.in.cu_seqlens = make_tensor(d_cu, FGDN_INT64, {N + 1}, FGDN_CUDA);
    f.in.initial_state = make_tensor(d_pool, FGDN_FLOAT32, {P, Hv, D, D}, FGDN_CUDA);
    f.in.state_indices = make_tensor(d_idx, FGDN_INT32, {N}, FGDN_CUDA);
    f.in.check_inputs = 1;
    f.o = make_tensor(d_o, FGDN_BFLOAT16, {1, T, Hv, D}, FGDN_CUDA);
    f.output_final_state = 1;
  }

  void expect(fgdn_status want, const std::vector<std::string>& parts) {
    upload();
    const fgdn_status s = fgdn_forward(&f, nullptr, 0, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::string msg = fgdn_last_error();
    EXPECT_EQ(s, want) << msg;
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing \"" << p << "\" in: " << msg;
    if (want != FGDN_SUCCESS) {
      EXPECT_EQ(download(d_o, T * Hv * D), std::vector<uint16_t>(T * Hv * D, 0xffff)) << "o written";
      EXPECT_EQ(download(d_pool, P * S), pool) << "pool written";
    }
  }
};

TEST(CudaContract, CheckModeKernel) {
  REQUIRE_DEVICE();
  {
    CheckCase c;
    c.pool[0] = std::nanf("");  // row 0 is not read: a free pool row may hold anything
    c.expect(FGDN_SUCCESS, {});
  }
  {
    CheckCase c;
    c.q[(120 * Hq + 0) * D + 9] = flashgdn::float_to_bf16(std::nanf(""));
    c.q[(130 * Hq + 0) * D + 0] = flashgdn::float_to_bf16(INFINITY);
    c.expect(FGDN_ERROR_INVALID_ARGUMENT, {"'q'", "nan at q[0, 120, 0, 9]"});
  }
  {
    CheckCase c;
    c.g[77 * Hv + 1] = 0.5f;
    c.expect(FGDN_ERROR_INVALID_ARGUMENT, {"'g'", "<= 0", "0.5 at g[0, 77, 1]"});
  }
  {
    CheckCase c;
    c.beta[5] = -INFINITY;
    c.expect(FGDN_ERROR_INVALID_ARGUMENT, {"'beta'", "-inf at beta[0, 2, 1]"});
  }
  {
    CheckCase c;
    c.pool[1 * S + D * D + 3] = INFINITY;  // row 1 (sequence 1), head 1, element 3
    c.expect(FGDN_ERROR_INVALID_ARGUMENT, {"'initial_state'", "inf at initial_state[1, 1, 0, 3]", "state_indices[1]=1"});
  }
  {
    CheckCase c;
    c.idx = {3, 4};  // past the pool
    c.expect(FGDN_ERROR_INVALID_ARGUMENT, {"'state_indices'", "below the pool size P=4", "state_indices[1]=4"});
  }
  {
    CheckCase c;
    c.idx = {2, 2};  // written twice
    c.expect(FGDN_ERROR_INVALID_ARGUMENT, {"'state_indices'", "index 2 twice"});
  }
  {
    CheckCase c;
    static int64_t host[] = {0, 90, 150};  // a host copy that is not the device's
    c.upload();
    c.f.in.cu_seqlens_host = flashgdn::host_tensor(host, FGDN_INT64, {3});
    const fgdn_status s = fgdn_forward(&c.f, nullptr, 0, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(s, FGDN_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(fgdn_last_error()).find("cu_seqlens[1]=100 but cu_seqlens_host[1]=90"), std::string::npos)
        << fgdn_last_error();
  }
}

// A device cu_seqlens is read on the caller's stream, after the work queued there. The stream is
// non-blocking (the legacy default stream does not wait for it); a host callback holds it for
// 200 ms, then a copy writes the real cu_seqlens over an invalid pattern. The workspace query
// before it reads nothing (a read on any other stream would see the invalid pattern and
// refuse); the call sees the real values (it computes the same o as a call on ready data).
TEST(CudaContract, CuSeqlensReadOnTheCallersStream) {
  REQUIRE_DEVICE();
  CheckCase ref;
  ref.upload();
  ref.f.in.check_inputs = 0;
  ref.f.in.state_indices = fgdn_tensor_none();
  ref.f.in.initial_state = fgdn_tensor_none();
  ref.f.output_final_state = 0;
  ASSERT_EQ(fgdn_forward(&ref.f, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaDeviceSynchronize());
  const std::vector<uint16_t> want = download(ref.d_o, CheckCase::T * Hv * D);

  CheckCase c;
  c.cu = {0, 151, 7};  // invalid: a query or read that ran early would refuse the call
  c.upload();
  c.f = ref.f;
  c.f.in.cu_seqlens.data = c.d_cu;
  c.f.o.data = c.d_o;
  int64_t* pinned = nullptr;
  CU(cudaMallocHost(&pinned, 3 * sizeof(int64_t)));
  pinned[0] = 0, pinned[1] = 100, pinned[2] = CheckCase::T;
  cudaStream_t s = nullptr;
  CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CU(cudaLaunchHostFunc(s, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }, nullptr));
  CU(cudaMemcpyAsync(c.d_cu, pinned, 3 * sizeof(int64_t), cudaMemcpyHostToDevice, s));
  size_t bytes = 0;
  EXPECT_EQ(fgdn_forward_workspace_size(&c.f, &bytes), FGDN_SUCCESS) << fgdn_last_error();
  void* ws = nullptr;
  CU(cudaMalloc(&ws, bytes + 256));
  EXPECT_EQ(fgdn_forward(&c.f, ws, bytes, s), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaStreamSynchronize(s));
  EXPECT_EQ(download(c.d_o, CheckCase::T * Hv * D), want);
  cudaFree(ws);
  cudaStreamDestroy(s);
  cudaFreeHost(pinned);
}

// Under CUDA graph capture a call that would read a device tensor back (cu_seqlens without its
// host copy; check mode) is refused before it enqueues anything, naming the argument: the
// capture is still valid when it ends, no error is left pending, and the next ordinary call on
// the stream runs and gives the same bits.
TEST(CudaContract, GraphCaptureRefusesReadBacks) {
  REQUIRE_DEVICE();
  CheckCase c;
  c.upload();
  c.f.in.check_inputs = 0;
  c.f.in.state_indices = fgdn_tensor_none();
  c.f.in.initial_state = fgdn_tensor_none();
  c.f.output_final_state = 0;
  ASSERT_EQ(fgdn_forward(&c.f, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaDeviceSynchronize());
  const std::vector<uint16_t> want = download(c.d_o, CheckCase::T * Hv * D);
  cudaStream_t s = nullptr;
  CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  size_t bytes = 0;
  ASSERT_EQ(fgdn_forward_workspace_size(&c.f, &bytes), FGDN_SUCCESS) << fgdn_last_error();
  void* ws = nullptr;
  CU(cudaMalloc(&ws, bytes + 256));
  for (int check = 0; check < 2; ++check) {
    fgdn_fwd_args a = c.f;
    a.in.check_inputs = check;
    if (check) a.in.cu_seqlens_host = make_tensor(c.cu.data(), FGDN_INT64, {CheckCase::N + 1}, FGDN_CPU);
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    EXPECT_EQ(fgdn_forward(&a, ws, bytes, s), FGDN_ERROR_INVALID_ARGUMENT);
    const std::string why = fgdn_last_error();
    EXPECT_NE(why.find(check ? "'check_inputs'" : "'cu_seqlens'"), std::string::npos) << why;
    EXPECT_NE(why.find("captures a CUDA graph"), std::string::npos) << why;
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  EXPECT_EQ(fgdn_forward(&c.f, ws, bytes, s), FGDN_SUCCESS) << fgdn_last_error();
  CU(cudaStreamSynchronize(s));
  EXPECT_EQ(download(c.d_o, CheckCase::T * Hv * D), want);
  cudaFree(ws);
  cudaStreamDestroy(s);
}

// Overlaps are refused on device tensors as on host ones.
TEST(CudaContract, OverlappingOutputs) {
  REQUIRE_DEVICE();
  CheckCase c;
  c.upload();
  c.f.in.check_inputs = 0;
  c.f.o.data = c.d_v;  // o is v
  EXPECT_EQ(fgdn_forward(&c.f, nullptr, 0, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("argument 'v'"), std::string::npos) << fgdn_last_error();
}

#endif  // FLASHGDN_WITH_CUDA

}  // namespace
