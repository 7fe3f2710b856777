// Check mode on the device (cuda_backend.h: run_value_checks). Per check one grid-stride scan
// that reduces the smallest offending row-major index into its result slot (atomicMin, so the
// reported element is the first, whatever the schedule); then one small kernel that fetches
// the offending values and packs the requested index tensors as int64; then one copy back and
// one stream synchronisation. Everything on the caller's stream, in order after its work.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "common/value_checks.h"
#include "cuda/cuda_backend.h"
#include "cuda/device_utils.cuh"

namespace flashgdn::cuda {
namespace {

constexpr int kThreads = 256;

// Offset (elements) of the element at row-major linear index l of check v; false for a pool
// sequence whose row is out of range or negative (skipped).
__device__ bool element_offset(const ValueCheck& v, uint64_t l, int64_t* off) {
  int64_t idx[FGDN_MAX_DIMS] = {};
  for (int d = v.ndim - 1; d >= 0; --d) {
    idx[d] = static_cast<int64_t>(l % static_cast<uint64_t>(v.shape[d]));
    l /= static_cast<uint64_t>(v.shape[d]);
  }
  if (v.rows != nullptr) {
    const int64_t r = load_index(v.rows, v.rows_dtype, idx[0]);
    if (r < 0 || r >= v.pool_rows) return false;
    idx[0] = r;
  }
  int64_t o = 0;
  for (int d = 0; d < v.ndim; ++d) o += idx[d] * v.strides[d];
  *off = o;
  return true;
}

__global__ void __launch_bounds__(kThreads) scan_kernel(ValueCheck v, uint64_t numel,
                                                        ValueCheckResult* result) {
  uint64_t first = kNoBadValue;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t l = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; l < numel; l += stride) {
    int64_t off = 0;
    if (!element_offset(v, l, &off)) continue;
    if (!value_ok(load_as_float(v.data, v.dtype, off), v.rule)) {
      first = l;  // increasing l: the first one this thread sees is its smallest
      break;
    }
  }
  for (int s = 16; s > 0; s >>= 1) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, first, s);
    first = other < first ? other : first;
  }
  if ((threadIdx.x & 31) == 0 && first != kNoBadValue)
    atomicMin(reinterpret_cast<unsigned long long*>(&result->first_bad),
              static_cast<unsigned long long>(first));
}

// More than a call ever has (input_value_checks: at most 10): the checks travel as a kernel
// parameter, so nothing is copied from pageable host memory (which could synchronise).
constexpr int kMaxChecks = 12;

struct PackParams {
  ValueCheck checks[kMaxChecks];
  ValueCheckResult* results;
  int32_t num_checks;
  const void* cu;
  int32_t cu_dtype;
  int64_t cu_n;
  int64_t* cu_out;
  const void* idx;
  int32_t idx_dtype;
  int64_t idx_n;
  int64_t* idx_out;
};

// The offending values (for the message) and the index copies, after every scan.
__global__ void __launch_bounds__(kThreads) pack_kernel(PackParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = i; c < p.num_checks; c += step) {
    ValueCheckResult& r = p.results[c];
    int64_t off = 0;
    if (r.first_bad != kNoBadValue && element_offset(p.checks[c], r.first_bad, &off))
      r.value = load_as_float(p.checks[c].data, p.checks[c].dtype, off);
  }
  for (int64_t j = i; j < p.cu_n; j += step) p.cu_out[j] = load_index(p.cu, p.cu_dtype, j);
  for (int64_t j = i; j < p.idx_n; j += step) p.idx_out[j] = load_index(p.idx, p.idx_dtype, j);
}

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

}  // namespace

ValueCheckOutcome run_value_checks(const std::vector<ValueCheck>& checks, const fgdn_tensor* cu_seqlens,
                                   const fgdn_tensor* state_indices, int device_id, void* stream) {
  DeviceScope scope(device_id);
  const auto s = static_cast<cudaStream_t>(stream);
  const size_t nc = checks.size();
  const int64_t cu_n = cu_seqlens ? cu_seqlens->shape[0] : 0;
  const int64_t idx_n = state_indices ? state_indices->shape[0] : 0;

  if (nc > static_cast<size_t>(kMaxChecks))
    throw CudaError("flashgdn: check_inputs: more value checks than the device path takes");

  // Scratch: [results | cu_seqlens int64 | state_indices int64], all of it copied back.
  const size_t res_bytes = align256(nc * sizeof(ValueCheckResult));
  const size_t cu_bytes = align256(static_cast<size_t>(cu_n) * sizeof(int64_t));
  const size_t idx_bytes = align256(static_cast<size_t>(idx_n) * sizeof(int64_t));
  const size_t total = res_bytes + cu_bytes + idx_bytes;
  std::vector<unsigned char> host(total, 0);

  char* dev = static_cast<char*>(workspace_alloc(total, device_id, stream));
  ValueCheckOutcome out;
  try {
    auto* results = reinterpret_cast<ValueCheckResult*>(dev);
    // All-ones bytes: first_bad = kNoBadValue in every result.
    FGDN_CUDA_CHECK(cudaMemsetAsync(dev, 0xff, res_bytes, s));
    for (size_t c = 0; c < nc; ++c) {
      uint64_t numel = 1;
      for (int d = 0; d < checks[c].ndim; ++d) numel *= static_cast<uint64_t>(checks[c].shape[d]);
      if (numel == 0) continue;
      const uint64_t blocks = std::min<uint64_t>((numel + kThreads - 1) / kThreads, 4096);
      scan_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(checks[c], numel, results + c);
      FGDN_CHECK_LAUNCH("check_inputs scan_kernel");
    }
    PackParams pp{};
    for (size_t c = 0; c < nc; ++c) pp.checks[c] = checks[c];
    pp.results = results;
    pp.num_checks = static_cast<int32_t>(nc);
    pp.cu = cu_seqlens ? cu_seqlens->data : nullptr;
    pp.cu_dtype = cu_seqlens ? cu_seqlens->dtype : FGDN_INT64;
    pp.cu_n = cu_n;
    pp.cu_out = reinterpret_cast<int64_t*>(dev + res_bytes);
    pp.idx = state_indices ? state_indices->data : nullptr;
    pp.idx_dtype = state_indices ? state_indices->dtype : FGDN_INT64;
    pp.idx_n = idx_n;
    pp.idx_out = reinterpret_cast<int64_t*>(dev + res_bytes + cu_bytes);
    const int64_t work = std::max<int64_t>({static_cast<int64_t>(nc), cu_n, idx_n, 1});
    const int64_t blocks = std::min<int64_t>((work + kThreads - 1) / kThreads, 1024);
    pack_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(pp);
    FGDN_CHECK_LAUNCH("check_inputs pack_kernel");
    FGDN_CUDA_CHECK(cudaMemcpyAsync(host.data(), dev, total, cudaMemcpyDeviceToHost, s));
    FGDN_CUDA_CHECK(cudaStreamSynchronize(s));
  } catch (...) {
    workspace_free(dev, stream);
    throw;
  }
  workspace_free(dev, stream);

  out.results.resize(nc);
  std::memcpy(out.results.data(), host.data(), nc * sizeof(ValueCheckResult));
  out.cu_seqlens.resize(static_cast<size_t>(cu_n));
  std::memcpy(out.cu_seqlens.data(), host.data() + res_bytes, static_cast<size_t>(cu_n) * sizeof(int64_t));
  out.state_indices.resize(static_cast<size_t>(idx_n));
  std::memcpy(out.state_indices.data(), host.data() + res_bytes + cu_bytes,
              static_cast<size_t>(idx_n) * sizeof(int64_t));
  return out;
}

}  // namespace flashgdn::cuda
