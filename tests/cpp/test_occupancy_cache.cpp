// The resident-CTA cache of the CP launchers (sm90/occupancy_cache.h), host side: one query per
// (kernel, device, threads, bytes), a separate entry when any of them differs, one query per key
// under concurrent callers. The query is a counter here, so no GPU is needed.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "sm90/occupancy_cache.h"

namespace {

using flashgdn::sm90::OccupancyCache;
using flashgdn::sm90::OccupancyKey;

int kernel_a, kernel_b;  // stand-ins for two kernels: only their addresses are used

TEST(OccupancyCache, QueriesOncePerKey) {
  OccupancyCache cache;
  int queries = 0;
  const OccupancyKey key{&kernel_a, 0, 256, 100000};
  EXPECT_EQ(cache.get(key, [&] { ++queries; return 2; }), 2);
  EXPECT_EQ(cache.get(key, [&] { ++queries; return 7; }), 2);  // read from the cache
  EXPECT_EQ(queries, 1);
}

TEST(OccupancyCache, EveryPartOfTheKeyCounts) {
  OccupancyCache cache;
  const OccupancyKey base{&kernel_a, 0, 256, 100000};
  EXPECT_EQ(cache.get(base, [] { return 1; }), 1);
  OccupancyKey other_kernel = base, other_device = base, other_threads = base, other_bytes = base;
  other_kernel.kernel = &kernel_b;
  other_device.device = 1;
  other_threads.threads = 128;
  other_bytes.smem_bytes = 50000;
  EXPECT_EQ(cache.get(other_kernel, [] { return 2; }), 2);
  EXPECT_EQ(cache.get(other_device, [] { return 3; }), 3);
  EXPECT_EQ(cache.get(other_threads, [] { return 4; }), 4);
  EXPECT_EQ(cache.get(other_bytes, [] { return 5; }), 5);
  // Each kept its own count.
  EXPECT_EQ(cache.get(base, [] { return -1; }), 1);
  EXPECT_EQ(cache.get(other_kernel, [] { return -1; }), 2);
  EXPECT_EQ(cache.get(other_device, [] { return -1; }), 3);
  EXPECT_EQ(cache.get(other_threads, [] { return -1; }), 4);
  EXPECT_EQ(cache.get(other_bytes, [] { return -1; }), 5);
}

TEST(OccupancyCache, AFailedQueryLeavesNoEntry) {
  OccupancyCache cache;
  const OccupancyKey key{&kernel_a, 0, 256, 100000};
  EXPECT_THROW(cache.get(key, []() -> int { throw std::runtime_error("query failed"); }), std::runtime_error);
  EXPECT_EQ(cache.get(key, [] { return 3; }), 3);
}

TEST(OccupancyCache, ConcurrentCallersQueryEachKeyOnce) {
  OccupancyCache cache;
  constexpr int kThreads = 8, kKeys = 4, kRounds = 200;
  std::atomic<int> queries{0};
  std::atomic<int> wrong{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t)
    pool.emplace_back([&] {
      for (int r = 0; r < kRounds; ++r)
        for (int k = 0; k < kKeys; ++k) {
          const OccupancyKey key{&kernel_a, 0, 128 * (k + 1), 1000};
          if (cache.get(key, [&] { ++queries; return k + 1; }) != k + 1) ++wrong;
        }
    });
  for (auto& th : pool) th.join();
  EXPECT_EQ(queries.load(), kKeys);
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
