// Host-side device-memory helpers of the API layer: reading index tensors back for validation
// and stream-ordered scratch allocation when the caller passes no workspace.
#include <cuda_runtime.h>

#include <string>

#include "cuda/cuda_backend.h"

namespace flashgdn::cuda {
namespace {

// A failed runtime call also leaves its error pending for the thread: taken here, so that it is
// reported once, by this call, and not again by the next launch's check.
void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw CudaError(std::string("flashgdn: ") + what + ": " + cudaGetErrorString(e));
}

// Makes device_id current for the scope and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device_id) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device_id) check(cudaSetDevice(device_id), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

}  // namespace

void copy_to_host(void* dst, const void* src, size_t bytes, int device_id, void* stream) {
  DeviceGuard guard(device_id);
  auto s = static_cast<cudaStream_t>(stream);
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), "reading cu_seqlens back");
  check(cudaStreamSynchronize(s), "reading cu_seqlens back");
}

bool stream_capturing(void* stream, int device_id) {
  DeviceGuard guard(device_id);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status), "querying the stream's capture");
  return status != cudaStreamCaptureStatusNone;
}

void raise_pending_error() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw CudaError(std::string("flashgdn: a CUDA error was pending before this call, from earlier work "
                                "on this thread (not a flashgdn kernel): ") +
                    cudaGetErrorString(e) + "; nothing was launched");
}

void* workspace_alloc(size_t bytes, int device_id, void* stream) {
  DeviceGuard guard(device_id);
  void* p = nullptr;
  check(cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)), "allocating the workspace");
  return p;
}

void workspace_free(void* ptr, void* stream) {
  if (ptr != nullptr) check(cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)), "freeing the workspace");
}

}  // namespace flashgdn::cuda
