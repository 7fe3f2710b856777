// Concurrency (issue 38, point 4), CPU: several std::threads calling forward and backward through
// the C++ API at once, each on its own problem, get the bytes the same call gets alone; and the
// error of a rejected call is the calling thread's own (fgdn_last_error is per thread) while other
// threads' calls fail or succeed beside it. The CPU backend's fork-join pool (csrc/cpu/thread_pool.h)
// starts its workers per call, so concurrent callers each run their own; these tests are what
// checks that nothing else is shared. They also pass under ThreadSanitizer (-fsanitize=thread on
// the library and the tests, FLASHGDN_NUM_THREADS=3) with no report.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "test_util.h"

namespace {

using flashgdn::test::HostCall;

// One problem of the concurrent run: HostCall's varlen fp32 call, with or without the gate computed
// in the kernel, with checkpoints every 64 tokens.
struct Problem {
  std::vector<int64_t> cu;
  int64_t Hq, Hv, K, V;
  bool gate;
};

std::vector<Problem> problems() {
  return {
      {{0, 40, 40, 41, 105}, 1, 2, 16, 16, false},
      {{0, 64}, 2, 4, 32, 32, true},
      {{0, 1, 17, 80, 130}, 1, 1, 64, 64, false},
      {{0, 33, 66}, 2, 2, 16, 64, true},
      {{0, 0, 0, 7}, 1, 4, 32, 16, false},
      {{0, 120}, 1, 2, 64, 32, true},
  };
}

int64_t ck_rows(const Problem& p) { return p.cu.back() / 64 + static_cast<int64_t>(p.cu.size()); }

// HostCall keeps views of its own vectors in its args, so it lives behind a pointer, never copied.
std::unique_ptr<HostCall> make_call(const Problem& p) {
  auto c = std::make_unique<HostCall>(p.cu, p.Hq, p.Hv, p.K, p.V, p.gate, ck_rows(p));
  c->fa.checkpoint_every = 64;
  c->fa.checkpoints = flashgdn::host_tensor(c->ck.data(), FGDN_FLOAT32, {ck_rows(p), p.Hv, p.K, p.V});
  if (p.gate) {  // the forward computes the gate the same way as the backward
    c->fa.in = c->ba.in;
  }
  return c;
}

// Forward then backward; every output's bytes.
std::vector<std::vector<float>> run(HostCall& c) {
  flashgdn::forward(c.fa);
  flashgdn::backward(c.ba);
  return {c.o, c.ht, c.ck, c.dq, c.dk, c.dv, c.dg, c.dbeta, c.dh0, c.dA_log, c.ddt_bias};
}

bool same_bytes(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) return false;
    if (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) return false;
  }
  return true;
}

TEST(Concurrency, ThreadsGetTheSerialBytes) {
  const std::vector<Problem> ps = problems();
  std::vector<std::vector<std::vector<float>>> serial;
  for (const Problem& p : ps) {
    auto c = make_call(p);
    serial.push_back(run(*c));
  }
  // The comparison sees one flipped bit of one output.
  {
    auto flipped = serial[0];
    uint32_t bits;
    std::memcpy(&bits, &flipped[5][3], sizeof bits);
    bits ^= 1u;
    std::memcpy(&flipped[5][3], &bits, sizeof bits);
    ASSERT_FALSE(same_bytes(flipped, serial[0]));
  }
  // Two threads per problem, each on its own buffers, several rounds each, all started together.
  constexpr int kRounds = 20;
  const int n_threads = 2 * static_cast<int>(ps.size());
  std::atomic<int> ready{0};
  std::vector<int> mismatches(static_cast<size_t>(n_threads), 0);
  std::vector<std::string> errors(static_cast<size_t>(n_threads));
  std::vector<std::thread> threads;
  for (int t = 0; t < n_threads; ++t) {
    threads.emplace_back([&, t] {
      const size_t pi = static_cast<size_t>(t) % ps.size();
      ready.fetch_add(1);
      while (ready.load() < n_threads) std::this_thread::yield();
      try {
        for (int r = 0; r < kRounds; ++r) {
          auto c = make_call(ps[pi]);  // fresh outputs, filled with the sentinel
          if (!same_bytes(run(*c), serial[pi])) ++mismatches[static_cast<size_t>(t)];
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(t)] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < n_threads; ++t) {
    EXPECT_EQ(errors[static_cast<size_t>(t)], "") << "thread " << t;
    EXPECT_EQ(mismatches[static_cast<size_t>(t)], 0) << "thread " << t << " (problem " << t % ps.size() << ")";
  }
}

// Rejected calls on several threads at once, beside valid ones: each thread's exception (and
// fgdn_last_error on that thread) names that thread's own defect, as the same call alone does.
TEST(Concurrency, EachThreadReadsItsOwnError) {
  using Breaker = void (*)(HostCall&);
  const std::vector<Breaker> breakers = {
      [](HostCall& c) { c.fa.in.q.ndim = 3; },
      [](HostCall& c) { c.fa.in.g.dtype = FGDN_INT32; },
      [](HostCall& c) { c.fa.in.beta.shape[2] = 1; },
      [](HostCall& c) { c.ba.in.k.strides[3] = 2; },
      [](HostCall& c) { c.fa.in.v.shape[2] = 3; },
      nullptr,  // a valid call
  };
  auto attempt = [](HostCall& c, Breaker b) -> std::string {
    if (b) b(c);
    try {
      flashgdn::forward(c.fa);
      flashgdn::backward(c.ba);
    } catch (const flashgdn::Error& e) {
      const std::string last = fgdn_last_error();
      if (last != e.what()) return "fgdn_last_error differs from the exception: " + last;
      return e.what();
    }
    return "ok";
  };
  const Problem p = problems()[0];
  std::vector<std::string> serial;
  for (Breaker b : breakers) {
    auto c = make_call(p);
    serial.push_back(attempt(*c, b));
  }
  for (size_t i = 0; i + 1 < serial.size(); ++i) {
    EXPECT_NE(serial[i], "ok") << "breaker " << i << " did not break the call";
    for (size_t j = 0; j < i; ++j) EXPECT_NE(serial[i], serial[j]) << "breakers " << j << " and " << i;
  }
  EXPECT_EQ(serial.back(), "ok");

  constexpr int kRounds = 200;
  const size_t n = breakers.size();
  std::atomic<size_t> ready{0};
  std::vector<std::string> wrong(n);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      auto c = make_call(p);  // outputs are written only by the valid thread, on its own call
      ready.fetch_add(1);
      while (ready.load() < n) std::this_thread::yield();
      for (int r = 0; r < kRounds && wrong[t].empty(); ++r) {
        const std::string got = attempt(*c, breakers[t]);
        if (got != serial[t]) wrong[t] = got;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < n; ++t) EXPECT_EQ(wrong[t], "") << "thread " << t << " expected: " << serial[t];
}

}  // namespace
