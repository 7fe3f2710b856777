// The resident-CTA counts of the CP kernels, kept per (kernel, device, threads, dynamic shared
// memory bytes): each of those changes the count, and the launchers ask on every launch, so the
// occupancy query runs once per key and later calls read the cache. Host code only, no CUDA
// headers: the query is a parameter, so the tests exercise the cache without a GPU.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <tuple>

namespace flashgdn::sm90 {

struct OccupancyKey {
  const void* kernel;  // the kernel's host-side handle, as the CUDA runtime takes it
  int device;          // the ordinal current when the kernel is launched
  int threads;         // threads per CTA
  size_t smem_bytes;   // dynamic shared memory per CTA

  bool operator<(const OccupancyKey& o) const {
    return std::tie(kernel, device, threads, smem_bytes) < std::tie(o.kernel, o.device, o.threads, o.smem_bytes);
  }
};

// Safe to share between host threads: hits take a shared lock; a miss takes the exclusive lock
// and runs the query under it, so each key is queried exactly once.
class OccupancyCache {
 public:
  // The count for key; query() (returning int) computes it on the first call for that key.
  template <class Query>
  int get(const OccupancyKey& key, Query&& query) {
    {
      std::shared_lock<std::shared_mutex> read(mutex_);
      const auto it = counts_.find(key);
      if (it != counts_.end()) return it->second;
    }
    std::unique_lock<std::shared_mutex> write(mutex_);
    const auto it = counts_.find(key);  // another thread may have filled it meanwhile
    if (it != counts_.end()) return it->second;
    const int count = query();
    counts_.emplace(key, count);
    return count;
  }

 private:
  std::shared_mutex mutex_;
  std::map<OccupancyKey, int> counts_;
};

}  // namespace flashgdn::sm90
