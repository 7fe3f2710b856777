// Check mode on the CPU backend (fgdn_inputs.check_inputs, FLASHGDN_CHECK_INPUTS): the inputs'
// values are verified before anything is written, and a failure names the argument and the
// first offending element. Off, the same inputs run (non-finite values are the numerics'
// business, docs/api.md "Non-finite values").
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "test_util.h"

namespace {

using flashgdn::host_tensor;

using flashgdn::test::kSentinel;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Varlen T = 40 in two sequences of 20, Hq = 1, Hv = 2, K = V = 16, fp32, with an initial state;
// check mode on in both calls.
struct Fixture : flashgdn::test::HostCall {
  Fixture() : HostCall({0, 20, 40}, 1, 2, 16, 16, false, 0) { fa.in.check_inputs = ba.in.check_inputs = 1; }
};

void expect_refused(Fixture& f, bool backward, const std::vector<std::string>& parts) {
  const fgdn_status s = backward ? fgdn_backward(&f.ba, nullptr, 0, nullptr) : fgdn_forward(&f.fa, nullptr, 0, nullptr);
  const std::string msg = fgdn_last_error();
  EXPECT_EQ(s, FGDN_ERROR_INVALID_ARGUMENT) << msg;
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing \"" << p << "\" in: " << msg;
  EXPECT_TRUE(f.outputs_untouched());
}

TEST(CheckMode, NanInQNamesFirstElement) {
  Fixture f;
  // q[0, 32, 0, 3] and a later one: the first in row-major order is named.
  f.q[32 * 16 + 3] = kNaN;
  f.q[35 * 16 + 0] = kInf;
  expect_refused(f, false, {"'q'", "finite values (check_inputs)", "nan at q[0, 32, 0, 3]"});
  expect_refused(f, true, {"'q'", "nan at q[0, 32, 0, 3]"});
  // Off: the call runs (what the numbers become is the numerics' business).
  f.fa.in.check_inputs = 0;
  EXPECT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
}

TEST(CheckMode, PositiveLogGate) {
  Fixture f;
  f.g[5] = 0.25f;  // g[0, 2, 1]
  expect_refused(f, false, {"'g'", "finite values <= 0", "0.25 at g[0, 2, 1]"});
  // With the gate computed in the kernel, g is the raw activation: any finite value.
  f.fa.in.gate_in_kernel = 1;
  f.fa.in.A_log = host_tensor(f.A_log.data(), FGDN_FLOAT32, {2});
  EXPECT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  f.A_log[1] = kInf;
  f.ht.assign(f.ht.size(), kSentinel);
  f.o.assign(f.o.size(), kSentinel);
  expect_refused(f, false, {"'A_log'", "inf at A_log[1]"});
}

TEST(CheckMode, EveryInput) {
  {
    Fixture f;
    f.k[0] = -kInf;
    expect_refused(f, false, {"'k'", "-inf at k[0, 0, 0, 0]"});
  }
  {
    Fixture f;
    f.v.back() = kNaN;
    expect_refused(f, false, {"'v'", "at v[0, 39, 1, 15]"});
  }
  {
    Fixture f;
    f.beta[3] = kInf;
    expect_refused(f, true, {"'beta'", "at beta[0, 1, 1]"});
  }
  {
    Fixture f;
    f.h0[256 * 3 + 17] = kNaN;  // initial_state[1, 1, 1, 1]
    expect_refused(f, false, {"'initial_state'", "at initial_state[1, 1, 1, 1]"});
  }
  {
    Fixture f;
    f.d_o[7] = kNaN;
    expect_refused(f, true, {"'d_o'", "at d_o[0, 0, 0, 7]"});
  }
  {
    Fixture f;
    f.dht[1] = kInf;
    expect_refused(f, true, {"'d_final_state'", "at d_final_state[0, 0, 0, 1]"});
  }
}

// Strided inputs are checked through their strides: a NaN in padding nobody reads is fine.
TEST(CheckMode, OnlyAddressedElements) {
  Fixture f;
  std::vector<float> padded(static_cast<size_t>(40 * 32), kNaN);
  for (int64_t r = 0; r < 40; ++r)
    for (int64_t d = 0; d < 16; ++d) padded[static_cast<size_t>(r * 32 + d)] = f.q[static_cast<size_t>(r * 16 + d)];
  f.fa.in.q = host_tensor(padded.data(), FGDN_FLOAT32, {1, 40, 1, 16});
  f.fa.in.q.strides[0] = 40 * 32;
  f.fa.in.q.strides[1] = f.fa.in.q.strides[2] = 32;
  EXPECT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
}

// A pool: only the rows the call reads are checked (a serving pool's free rows hold anything).
TEST(CheckMode, PoolRowsRead) {
  Fixture f;
  std::vector<float> pool(static_cast<size_t>(4 * 2 * 16 * 16), 0.f);
  pool[0] = kNaN;  // row 0: not read
  static int64_t idx[] = {3, -1};
  f.fa.in.initial_state = host_tensor(pool.data(), FGDN_FLOAT32, {4, 2, 16, 16});
  f.fa.in.state_indices = host_tensor(idx, FGDN_INT64, {2});
  f.fa.final_state = fgdn_tensor_none();
  EXPECT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  pool[static_cast<size_t>(3 * 512 + 256 + 5)] = kInf;  // row 3, head 1, element 5
  f.o.assign(f.o.size(), kSentinel);
  expect_refused(f, false, {"'initial_state'", "inf at initial_state[3, 1, 0, 5] (pool row state_indices[0]=3)"});
}

class EnvGuard {
 public:
  explicit EnvGuard(const char* value) {
    if (const char* old = std::getenv("FLASHGDN_CHECK_INPUTS")) old_ = old, had_ = true;
    if (value) setenv("FLASHGDN_CHECK_INPUTS", value, 1);
    else unsetenv("FLASHGDN_CHECK_INPUTS");
  }
  ~EnvGuard() {
    if (had_) setenv("FLASHGDN_CHECK_INPUTS", old_.c_str(), 1);
    else unsetenv("FLASHGDN_CHECK_INPUTS");
  }

 private:
  std::string old_;
  bool had_ = false;
};

TEST(CheckMode, EnvironmentVariable) {
  Fixture f;
  f.fa.in.check_inputs = 0;
  f.q[0] = kNaN;
  {
    EnvGuard env("1");
    expect_refused(f, false, {"'q'", "check_inputs"});
  }
  for (const char* off : {"0", "", static_cast<const char*>(nullptr)}) {
    EnvGuard env(off);
    f.o.assign(f.o.size(), kSentinel);
    EXPECT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << (off ? off : "unset");
  }
}

// The workspace queries read no values, check mode or not.
TEST(CheckMode, WorkspaceQueryReadsNoValues) {
  Fixture f;
  f.q[0] = kNaN;
  size_t bytes = 1;
  EXPECT_EQ(fgdn_forward_workspace_size(&f.fa, &bytes), FGDN_SUCCESS) << fgdn_last_error();
  EXPECT_EQ(fgdn_backward_workspace_size(&f.ba, &bytes), FGDN_SUCCESS) << fgdn_last_error();
}

}  // namespace
