// A minimal fork-join pool for the CPU backend: run fn(task, worker) for task in [0, n) on up
// to num_threads() std::threads with dynamic scheduling. Every task must write only its own
// outputs (or its own slot of a partial buffer) so the result never depends on which worker
// ran it or on the thread count; `worker` only selects per-thread scratch.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace flashgdn::cpu {

// FLASHGDN_NUM_THREADS (a positive integer) overrides std::thread::hardware_concurrency().
// Read on every call so a process can change it between calls.
inline int num_threads() {
  if (const char* s = std::getenv("FLASHGDN_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(s, &end, 10);
    if (end != s && n > 0) return static_cast<int>(std::min<long>(n, 1024));
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

// Workers that parallel_for(n, ...) will use: min(num_threads(), n), at least 1.
inline int workers_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), n)));
}

// fn(int64_t task, int worker) with worker in [0, workers); workers from workers_for(n).
// The first exception thrown by a task is rethrown on the calling thread after all join.
template <class Fn>
void parallel_for(int64_t n, int workers, Fn&& fn) {
  if (n <= 0) return;
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto body = [&](int w) {
    try {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, w);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      next.store(n);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  for (int w = 1; w < workers; ++w) threads.emplace_back(body, w);
  body(0);
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace flashgdn::cpu
