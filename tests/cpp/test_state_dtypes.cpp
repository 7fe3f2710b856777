// States in float32, bfloat16 or float16 (initial state, state pool, final state, d_final_state,
// dh0), on each backend: the recurrence is float32 whatever the state dtype, so
//   - a bf16/fp16 initial state gives bitwise the results of a float32 one holding the same
//     values (the conversion on load is exact);
//   - a bf16/fp16 final state (or pool row, or dh0) is bitwise the float32 one rounded once to
//     nearest even (float_to_bf16 / float_to_fp16 of csrc/common/dtype.h);
//   - a pool is read and written in place in its own dtype and layout (V-major here), and the
//     rows no sequence writes keep their bytes.
// The accuracy against the float64 oracle is checked by the parametrized backend suites
// (test_cpu_backend.cpp, test_cuda_forward.cpp, test_cuda_backward.cpp). The CUDA variants skip
// without a device.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "cuda_check.h"
#include "flashgdn/flashgdn.hpp"
#include "test_util.h"

namespace ft = flashgdn::test;

namespace {

enum class Where { kCpu, kCuda };

const char* where_name(Where w) { return w == Where::kCpu ? "cpu" : "cuda"; }
void PrintTo(Where w, std::ostream* os) { *os << where_name(w); }

// One forward of c with fa, on the host or the device (outputs back in c's buffers).
void run_forward(ft::Case& c, flashgdn::FwdArgs& fa, Where w) {
  if (w == Where::kCpu) {
    ASSERT_NO_THROW(flashgdn::forward(fa)) << c.s.name;
    return;
  }
#ifdef FLASHGDN_WITH_CUDA
  ASSERT_NO_FATAL_FAILURE(ft::run_forward_on_device(c, fa));
#endif
}

// One backward of c (gradients back in c's buffers).
void run_backward(ft::Case& c, Where w) {
  if (w == Where::kCpu) {
    flashgdn::BwdArgs a = c.bwd_args();
    ASSERT_NO_THROW(flashgdn::backward(a)) << c.s.name;
    return;
  }
#ifdef FLASHGDN_WITH_CUDA
  ASSERT_NO_FATAL_FAILURE(ft::run_backward_on_device(c));
#endif
}

bool skip(Where w) { return w == Where::kCuda && !ft::have_cuda_device(); }

// The bits float32 value x has once stored in dt.
uint16_t rounded_bits(float x, fgdn_dtype dt) {
  return dt == FGDN_BFLOAT16 ? flashgdn::float_to_bf16(x) : flashgdn::float_to_fp16(x);
}

// Every element of `got` (n elements of dt from offset got_off) is element i of the float32
// buffer `f32` (from f32_off) rounded to dt.
void expect_rounded_once(const ft::HostBuffer& got, int64_t got_off, const ft::HostBuffer& f32,
                         int64_t f32_off, int64_t n, fgdn_dtype dt, const std::string& what) {
  ASSERT_EQ(got.dtype, dt) << what;
  ASSERT_EQ(f32.dtype, FGDN_FLOAT32) << what;
  const auto* g = reinterpret_cast<const uint16_t*>(got.bytes.data()) + got_off;
  const auto* f = reinterpret_cast<const float*>(f32.bytes.data()) + f32_off;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (g[i] != rounded_bits(f[i], dt)) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " elements are not the float32 state "
                    << "rounded to " << flashgdn::dtype_name(dt) << " (first at " << first << ")";
}

// A small problem both backends run: bf16 q/k/v, D = 64, varlen with an empty, a one-token and
// partial-chunk sequences, initial states and final-state gradients.
ft::Spec base_spec(const std::string& name) {
  ft::Spec s = ft::with_states(ft::varlen_d(name, {0, 0, 1, 70, 200, 263}, 2, 4, 64));
  s.l2norm = true;
  s.seed = 77;
  return s;
}

class StateDtypes : public ::testing::TestWithParam<std::tuple<Where, fgdn_dtype>> {
 protected:
  Where where() const { return std::get<0>(GetParam()); }
  fgdn_dtype dt() const { return std::get<1>(GetParam()); }
};

// A bf16/fp16 initial state is converted exactly: o, the final state and every gradient are
// bitwise those of a float32 initial state holding the same values.
TEST_P(StateDtypes, InitialStateLoadedExactly) {
  if (skip(where())) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = base_spec("h0_exact");
  s.h0_dt = dt();
  ft::Case c(s);
  flashgdn::FwdArgs fa = c.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward(c, fa, where()));
  const auto o16 = c.o.bytes, ht16 = c.ht.bytes;
  ASSERT_NO_FATAL_FAILURE(run_backward(c, where()));
  const auto dq16 = c.dq.bytes, dg16 = c.dg.bytes, dh016 = c.dh0.bytes;

  c.s.h0_dt = FGDN_FLOAT32;  // the same (already rounded) values, stored as float32
  c.reset_initial_state();
  ASSERT_EQ(c.h0.dtype, FGDN_FLOAT32);
  fa = c.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward(c, fa, where()));
  EXPECT_EQ(c.o.bytes, o16) << where_name(where()) << ": o";
  EXPECT_EQ(c.ht.bytes, ht16) << where_name(where()) << ": final state";
  ASSERT_NO_FATAL_FAILURE(run_backward(c, where()));
  EXPECT_EQ(c.dq.bytes, dq16) << where_name(where()) << ": dq";
  EXPECT_EQ(c.dg.bytes, dg16) << where_name(where()) << ": dg";
  EXPECT_EQ(c.dh0.bytes, dh016) << where_name(where()) << ": dh0";
}

// A bf16/fp16 final state is the float32 final state rounded once (nearest even); so is dh0, and
// a bf16/fp16 d_final_state is read exactly.
TEST_P(StateDtypes, FinalStateAndDh0RoundedOnce) {
  if (skip(where())) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = base_spec("ht_rounded");
  s.h0_dt = dt();
  s.dht_dt = dt();
  ft::Case c(s);
  const int64_t n = s.N() * s.Hv * s.K * s.V;
  flashgdn::FwdArgs fa = c.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward(c, fa, where()));
  const ft::HostBuffer ht32 = c.ht;
  ASSERT_NO_FATAL_FAILURE(run_backward(c, where()));
  const ft::HostBuffer dh032 = c.dh0;

  c.s.ht_dt = c.s.dh0_dt = dt();
  fa = c.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward(c, fa, where()));
  expect_rounded_once(c.ht, 0, ht32, 0, n, dt(), std::string(where_name(where())) + ": final_state");
  ASSERT_NO_FATAL_FAILURE(run_backward(c, where()));
  expect_rounded_once(c.dh0, 0, dh032, 0, n, dt(), std::string(where_name(where())) + ": dh0");
}

// A V-major pool [P, Hv, V, K] in bf16/fp16 read and written in place through state_indices:
// each written row is the float32 final state of its sequence (the same call without a pool,
// from the same initial values) rounded once; the other rows keep their bytes.
TEST_P(StateDtypes, PoolReadAndWrittenInPlace) {
  if (skip(where())) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = base_spec("pool_in_place");
  s.h0_dt = dt();
  s.state_indices = true;
  s.v_first = true;
  s.checkpoint_every = 64;  // checkpoints stay float32 beside a 16-bit pool
  ft::Case c(s);
  const std::vector<unsigned char> before = c.h0.bytes;
  flashgdn::FwdArgs fa = c.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward(c, fa, where()));
  ASSERT_EQ(c.h0.dtype, dt());

  // The same problem (same seed: the same q, k, v, g, beta) with per-sequence float32 initial
  // states equal to the rows the pool call read (zero for the negative index) and a float32
  // final state.
  ft::Spec s2 = s;
  s2.state_indices = false;
  s2.h0_dt = FGDN_FLOAT32;
  ft::Case c2(s2);
  c2.ri.h0 = c.ri.h0;
  c2.h0 = ft::state_buffer(c.ri.h0, s.N(), s.Hv, s.K, s.V, s.v_first, FGDN_FLOAT32);
  flashgdn::FwdArgs fa2 = c2.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward(c2, fa2, where()));
  EXPECT_EQ(c2.o.bytes, c.o.bytes) << where_name(where()) << ": o differs with the pool";
  EXPECT_EQ(c2.ck.bytes, c.ck.bytes) << where_name(where()) << ": checkpoints differ with the pool";

  const int64_t HKV = s.Hv * s.K * s.V;
  std::vector<char> written(static_cast<size_t>(c.P), 0);
  for (int64_t seq = 0; seq < s.N(); ++seq) {
    const int64_t r = c.idx[static_cast<size_t>(seq)];
    if (r < 0) continue;
    written[static_cast<size_t>(r)] = 1;
    expect_rounded_once(c.h0, r * HKV, c2.ht, seq * HKV, HKV, dt(),
                        std::string(where_name(where())) + ": pool row " + std::to_string(r) +
                            " (sequence " + std::to_string(seq) + ")");
  }
  ft::expect_unwritten_rows_unchanged(c, written, before);
}

// With no tokens the final state is the initial state: a 16-bit pool keeps every byte, and a
// 16-bit initial state comes back exactly in a float32 final state.
TEST_P(StateDtypes, NoTokensRoundTrip) {
  if (skip(where())) GTEST_SKIP() << "no CUDA device";
  ft::Spec s = ft::with_h0(ft::varlen_d("no_tokens_pool", {0, 0, 0}, 1, 2, 64));
  s.h0_dt = dt();
  s.state_indices = true;
  s.v_first = true;
  ft::Case c(s);
  const std::vector<unsigned char> before = c.h0.bytes;
  flashgdn::FwdArgs fa = c.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward(c, fa, where()));
  EXPECT_EQ(c.h0.bytes, before) << where_name(where()) << ": the pool changed";

  ft::Spec d = ft::with_h0(ft::dense_d("no_tokens", 2, 0, 1, 2, 64));
  d.h0_dt = dt();
  ft::Case cd(d);
  fa = cd.fwd_args();
  ASSERT_NO_FATAL_FAILURE(run_forward(cd, fa, where()));
  EXPECT_EQ(cd.ht.to_double(), cd.ri.h0) << where_name(where()) << ": final state != initial state";
}

INSTANTIATE_TEST_SUITE_P(
    All, StateDtypes,
    ::testing::Combine(::testing::Values(Where::kCpu, Where::kCuda),
                       ::testing::Values(FGDN_BFLOAT16, FGDN_FLOAT16)),
    [](const ::testing::TestParamInfo<std::tuple<Where, fgdn_dtype>>& i) {
      return std::string(where_name(std::get<0>(i.param))) + "_" +
             (std::get<1>(i.param) == FGDN_BFLOAT16 ? "bf16" : "fp16");
    });

}  // namespace
