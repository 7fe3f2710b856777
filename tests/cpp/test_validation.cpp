// Every public entry point rejects bad input before writing anything, with a message that names
// the argument and what was expected. Each case below breaks one thing in an otherwise valid call.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "test_util.h"

namespace {

using flashgdn::host_tensor;

using flashgdn::test::kSentinel;

// A valid small varlen problem on the host (fp32; T = 70 in sequences of 30 and 40 tokens,
// Hq = 2, Hv = 4, K = 16, V = 32), with every output pre-filled by a sentinel.
struct Fixture : flashgdn::test::HostCall {
  Fixture() : HostCall({0, 30, 70}, 2, 4, 16, 32, false, 4) {}
};

struct Case {
  std::string name;
  bool backward;  // break the backward call instead of the forward one
  std::function<void(Fixture&)> mutate;
  std::vector<std::string> message_parts;  // each must appear in the error message
  // Refused only once tensor values are read: the workspace queries, which read none, accept it.
  bool needs_values = false;
};

// The forward made dense (one 70-token row) with a checkpoint every 64 tokens: 1 row needed.
void dense_checkpoints_every_64(Fixture& f) {
  f.fa.in.cu_seqlens = fgdn_tensor_none();
  f.fa.in.initial_state.shape[0] = 1;
  f.fa.final_state.shape[0] = 1;
  f.fa.checkpoint_every = 64;
}

// Both sides of every case start from the same valid inputs.
void apply_inputs(Fixture& f, const std::function<void(fgdn_inputs&)>& m) {
  m(f.fa.in);
  m(f.ba.in);
}

std::vector<Case> cases() {
  std::vector<Case> c;
  auto in_case = [&](const char* name, std::function<void(fgdn_inputs&)> m,
                     std::vector<std::string> parts, bool needs_values = false) {
    c.push_back({name, false, [m](Fixture& f) { apply_inputs(f, m); }, parts, needs_values});
    c.push_back({std::string(name) + "_backward", true, [m](Fixture& f) { apply_inputs(f, m); }, parts,
                 needs_values});
  };
  // Shapes and ranks.
  in_case("q_rank", [](fgdn_inputs& in) { in.q.ndim = 3; }, {"'q'", "4 dimensions"});
  in_case("k_shape", [](fgdn_inputs& in) { in.k.shape[3] = 32; in.k.strides[2] = 32; },
          {"'k'", "shape [B=1, T=70, Hq=2, K=16]", "got shape [1, 70, 2, 32]"});
  in_case("v_heads_not_multiple", [](fgdn_inputs& in) { in.v.shape[2] = 3; },
          {"'v'", "multiple of Hq=2", "Hv=3"});
  in_case("unsupported_head_dim", [](fgdn_inputs& in) { in.q.shape[3] = in.k.shape[3] = 48; },
          {"'q'", "head dim K in {16, 32, 64, 128, 256}", "K=48"});
  in_case("g_shape", [](fgdn_inputs& in) { in.g.shape[2] = 2; }, {"'g'", "[B=1, T=70, Hv=4]"});
  in_case("beta_rank", [](fgdn_inputs& in) { in.beta.ndim = 2; }, {"'beta'", "3 dimensions"});
  // Dtypes and devices.
  in_case("k_dtype_mismatch", [](fgdn_inputs& in) { in.k.dtype = FGDN_FLOAT16; },
          {"'k'", "dtype float32", "got dtype float16"});
  in_case("g_dtype", [](fgdn_inputs& in) { in.g.dtype = FGDN_INT32; },
          {"'g'", "float32 or bfloat16 or float16", "int32"});
  in_case("q_dtype_int", [](fgdn_inputs& in) { in.q.dtype = FGDN_INT32; }, {"'q'", "dtype bfloat16 or float16 or float32"});
  in_case("v_device_mismatch", [](fgdn_inputs& in) { in.v.device_type = FGDN_CUDA; },
          {"'v'", "a tensor on cpu (the device of q)", "cuda:0"});
  in_case("unknown_device", [](fgdn_inputs& in) { in.beta.device_type = 7; }, {"'beta'", "a cpu or cuda tensor"});
  // Strides.
  in_case("q_last_dim_strided", [](fgdn_inputs& in) { in.q.strides[3] = 2; },
          {"'q'", "contiguous last dimension", "stride 2"});
  in_case("v_negative_stride", [](fgdn_inputs& in) { in.v.strides[1] = -in.v.strides[1]; },
          {"'v'", "non-negative strides"});
  // cu_seqlens.
  in_case("cu_seqlens_not_from_zero", [](fgdn_inputs& in) { static int64_t cu[] = {1, 30, 70}; in.cu_seqlens.data = cu; },
          {"'cu_seqlens'", "first entry of 0", "cu_seqlens[0]=1"}, true);
  in_case("cu_seqlens_decreasing", [](fgdn_inputs& in) { static int64_t cu[] = {0, 71, 70}; in.cu_seqlens.data = cu; },
          {"'cu_seqlens'", "non-decreasing", "cu_seqlens[2]=70 < cu_seqlens[1]=71"}, true);
  in_case("cu_seqlens_not_ending_at_T", [](fgdn_inputs& in) { static int64_t cu[] = {0, 30, 69}; in.cu_seqlens.data = cu; },
          {"'cu_seqlens'", "last entry equal to T=70", "cu_seqlens[2]=69"}, true);
  in_case("cu_seqlens_float", [](fgdn_inputs& in) { in.cu_seqlens.dtype = FGDN_FLOAT32; },
          {"'cu_seqlens'", "int32 or int64"});
  in_case("cu_seqlens_one_entry", [](fgdn_inputs& in) { in.cu_seqlens.shape[0] = 1; },
          {"'cu_seqlens'", "at least 2 entries"});
  in_case("cu_seqlens_host_mismatch", [](fgdn_inputs& in) {
            static int64_t cu[] = {0, 70};
            in.cu_seqlens_host = host_tensor(cu, FGDN_INT64, {2});
          },
          {"'cu_seqlens_host'", "[N+1=3]"});
  // Initial state and pool.
  in_case("initial_state_shape", [](fgdn_inputs& in) { in.initial_state.shape[2] = 32; },
          {"'initial_state'", "[N=2, Hv=4, K=16, V=32]", "got shape [2, 4, 32, 32]"});
  in_case("initial_state_v_first_shape", [](fgdn_inputs& in) { in.state_v_first = 1; },
          {"'initial_state'", "[N=2, Hv=4, V=32, K=16]"});
  // States: float32, bfloat16 or float16, each in its own dtype; nothing else.
  in_case("initial_state_dtype_int32", [](fgdn_inputs& in) { in.initial_state.dtype = FGDN_INT32; },
          {"'initial_state'", "dtype float32 or bfloat16 or float16", "got dtype int32"});
  in_case("initial_state_dtype_unknown", [](fgdn_inputs& in) { in.initial_state.dtype = 9; },
          {"'initial_state'", "dtype float32 or bfloat16 or float16", "unknown dtype code 9"});
  // A pool written back (forward with output_final_state, final_state then absent) or only
  // read (backward): out-of-range rows are refused in both, duplicate rows where written.
  auto pool_case = [&](const char* name, bool backward, std::function<void(fgdn_inputs&)> m,
                       std::vector<std::string> parts) {
    c.push_back({name, backward, [m](Fixture& f) { apply_inputs(f, m); f.fa.final_state = fgdn_tensor_none(); },
                 parts, true});
  };
  for (bool backward : {false, true})
    pool_case(backward ? "state_indices_out_of_pool_backward" : "state_indices_out_of_pool", backward,
              [](fgdn_inputs& in) {
                static int64_t idx[] = {0, 2};
                in.state_indices = host_tensor(idx, FGDN_INT64, {2});
              },
              {"'state_indices'", "below the pool size P=2", "state_indices[1]=2"});
  for (bool backward : {false, true})  // refused in the workspace queries too
    c.push_back({backward ? "pool_dtype_int64_backward" : "pool_dtype_int64", backward,
                 [](Fixture& f) {
                   apply_inputs(f, [](fgdn_inputs& in) {
                     static int64_t idx[] = {1, 0};
                     in.state_indices = host_tensor(idx, FGDN_INT64, {2});
                     in.initial_state.dtype = FGDN_INT64;
                   });
                   f.fa.final_state = fgdn_tensor_none();
                 },
                 {"'initial_state'", "dtype float32 or bfloat16 or float16", "got dtype int64"}});
  pool_case("state_indices_duplicate", false, [](fgdn_inputs& in) {
              static int32_t idx[] = {1, 1};
              in.state_indices = host_tensor(idx, FGDN_INT32, {2});
            },
            {"'state_indices'", "distinct", "index 1 twice"});
  in_case("state_indices_without_pool", [](fgdn_inputs& in) {
            static int32_t idx[] = {0, 1};
            in.state_indices = host_tensor(idx, FGDN_INT32, {2});
            in.initial_state = fgdn_tensor_none();
          },
          {"'initial_state'", "state pool"});
  // Scale.
  in_case("scale_nan", [](fgdn_inputs& in) { in.has_scale = 1; in.scale = std::nan(""); },
          {"'scale'", "finite", "nan"});
  in_case("scale_inf", [](fgdn_inputs& in) { in.has_scale = 1; in.scale = HUGE_VAL; },
          {"'scale'", "finite", "inf"});
  // Gate computed in the kernel.
  in_case("gate_in_kernel_without_A_log", [](fgdn_inputs& in) { in.gate_in_kernel = 1; },
          {"'A_log'", "shape [Hv=4]", "none"});
  in_case("A_log_without_gate_in_kernel", [](fgdn_inputs& in) {
            static float a[4];
            in.A_log = host_tensor(a, FGDN_FLOAT32, {4});
          },
          {"'A_log'", "gate_in_kernel is 0"});

  // Forward outputs.
  auto fwd = [&](const char* name, std::function<void(Fixture&)> m, std::vector<std::string> p) {
    c.push_back({name, false, m, p});
  };
  fwd("o_dtype", [](Fixture& f) { f.fa.o.dtype = FGDN_BFLOAT16; }, {"'o'", "dtype float32"});
  fwd("o_shape", [](Fixture& f) { f.fa.o.shape[3] = 16; }, {"'o'", "[B=1, T=70, Hv=4, V=32]"});
  fwd("final_state_missing", [](Fixture& f) { f.fa.final_state = fgdn_tensor_none(); },
      {"'final_state'", "none"});
  fwd("final_state_unrequested", [](Fixture& f) { f.fa.output_final_state = 0; },
      {"'final_state'", "output_final_state is 0"});
  fwd("final_state_dtype_int64", [](Fixture& f) { f.fa.final_state.dtype = FGDN_INT64; },
      {"'final_state'", "dtype float32 or bfloat16 or float16", "got dtype int64"});
  fwd("checkpoints_bf16", [](Fixture& f) {  // checkpoints are float32 whatever the state dtypes
        f.fa.in.cu_seqlens = fgdn_tensor_none();
        f.fa.in.initial_state.shape[0] = 1;
        f.fa.in.initial_state.dtype = FGDN_BFLOAT16;
        f.fa.final_state.shape[0] = 1;
        f.fa.final_state.dtype = FGDN_BFLOAT16;
        f.fa.checkpoint_every = 64;
        f.fa.checkpoints = host_tensor(f.ck.data(), FGDN_BFLOAT16, {1, 4, 16, 32});
      },
      {"'checkpoints'", "dtype float32", "got dtype bfloat16"});
  fwd("checkpoint_every_not_64", [](Fixture& f) { f.fa.checkpoint_every = 48; },
      {"'checkpoint_every'", "multiple of 64", "48"});
  fwd("precision_unknown", [](Fixture& f) { f.fa.precision = 3; },
      {"'precision'", "FGDN_PRECISION_HIGH (2)", "3"});
  fwd("checkpoints_too_few_rows", [](Fixture& f) {
        // Sequences of 30 and 40 tokens every 64: 0 rows needed; every 64 on a 70-token dense
        // problem: 1 row. Make it dense with B = 1 and give zero rows.
        dense_checkpoints_every_64(f);
        f.fa.checkpoints = host_tensor(f.ck.data(), FGDN_FLOAT32, {0, 4, 16, 32});
      },
      {"'checkpoints'", "at least R=1 rows"});
  fwd("checkpoints_unrequested", [](Fixture& f) {
        f.fa.checkpoints = host_tensor(f.ck.data(), FGDN_FLOAT32, {1, 4, 16, 32});
      },
      {"'checkpoints'", "checkpoint_every is 0"});
  // saved_states: only where the CUDA backward takes them (fgdn_saved_states_rows > 0); never on
  // the CPU, and never with checkpoints.
  fwd("saved_states_on_the_cpu", [](Fixture& f) {
        f.fa.saved_states = host_tensor(f.ck.data(), FGDN_BFLOAT16, {1, 4, 16, 32});
      },
      {"'saved_states'", "fgdn_saved_states_rows is 0", "got a tensor"});
  fwd("saved_states_with_checkpoints", [](Fixture& f) {
        dense_checkpoints_every_64(f);
        f.fa.checkpoints = host_tensor(f.ck.data(), FGDN_FLOAT32, {1, 4, 16, 32});
        f.fa.saved_states = host_tensor(f.ck.data(), FGDN_BFLOAT16, {1, 4, 16, 32});
      },
      {"'saved_states'", "no tensor with checkpoints"});
  fwd("final_state_with_pool", [](Fixture& f) {
        static int64_t idx[] = {1, 0};
        f.fa.in.state_indices = host_tensor(idx, FGDN_INT64, {2});
      },
      {"'final_state'", "written back into the initial_state pool"});
  fwd("cu_seqlens_with_batch", [](Fixture& f) {
        // Two batch rows: cu_seqlens needs B == 1 (checked once the shapes agree).
        for (fgdn_tensor* t : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta, &f.fa.o}) {
          t->shape[0] = 2;
          t->shape[1] = 35;
        }
        static int64_t cu[] = {0, 30, 35};
        f.fa.in.cu_seqlens.data = cu;
      },
      {"'q'", "B=1 when cu_seqlens is given", "B=2"});

  // Backward outputs.
  auto bwd = [&](const char* name, std::function<void(Fixture&)> m, std::vector<std::string> p) {
    c.push_back({name, true, m, p});
  };
  bwd("d_o_missing", [](Fixture& f) { f.ba.d_o = fgdn_tensor_none(); }, {"'d_o'", "none"});
  bwd("saved_states_on_the_cpu_backward", [](Fixture& f) {
        f.ba.saved_states = host_tensor(f.ck.data(), FGDN_BFLOAT16, {1, 4, 16, 32});
      },
      {"'saved_states'", "fgdn_saved_states_rows is 0", "got a tensor"});
  bwd("saved_states_scratch_value", [](Fixture& f) { f.ba.saved_states_scratch = 2; },
      {"'saved_states_scratch'", "0 or 1", "got 2"});
  bwd("saved_states_scratch_without_saved_states", [](Fixture& f) { f.ba.saved_states_scratch = 1; },
      {"'saved_states_scratch'", "0 without saved_states", "got 1"});
  bwd("dq_shape", [](Fixture& f) { f.ba.dq.shape[2] = 4; }, {"'dq'", "[B=1, T=70, Hq=2, K=16]"});
  bwd("dv_dtype", [](Fixture& f) { f.ba.dv.dtype = FGDN_FLOAT16; }, {"'dv'", "dtype float32"});
  bwd("dg_missing", [](Fixture& f) { f.ba.dg = fgdn_tensor_none(); }, {"'dg'", "none"});
  bwd("dbeta_shape", [](Fixture& f) { f.ba.dbeta.shape[1] = 69; }, {"'dbeta'", "[B=1, T=70, Hv=4]"});
  bwd("d_final_state_shape", [](Fixture& f) { f.ba.d_final_state.shape[0] = 3; },
      {"'d_final_state'", "[N=2, Hv=4, K=16, V=32]"});
  bwd("d_final_state_dtype_int32", [](Fixture& f) { f.ba.d_final_state.dtype = FGDN_INT32; },
      {"'d_final_state'", "dtype float32 or bfloat16 or float16", "got dtype int32"});
  bwd("dh0_dtype_int64", [](Fixture& f) { f.ba.dh0.dtype = FGDN_INT64; },
      {"'dh0'", "dtype float32 or bfloat16 or float16", "got dtype int64"});
  bwd("dh0_dtype_unknown", [](Fixture& f) { f.ba.dh0.dtype = -1; },
      {"'dh0'", "dtype float32 or bfloat16 or float16", "unknown dtype code -1"});
  bwd("dh0_without_initial_state", [](Fixture& f) { f.ba.in.initial_state = fgdn_tensor_none(); },
      {"'dh0'", "initial_state is not given"});
  bwd("dA_log_missing", [](Fixture& f) {
        f.ba.in.gate_in_kernel = 1;
        f.ba.in.A_log = host_tensor(f.A_log.data(), FGDN_FLOAT32, {4});
      },
      {"'dA_log'", "none"});
  // The backward's precision level, validated as the forward's (same wording).
  bwd("precision_unknown_backward", [](Fixture& f) { f.ba.precision = 7; },
      {"'precision'", "FGDN_PRECISION_DEFAULT (0), FGDN_PRECISION_FAST (1) or FGDN_PRECISION_HIGH (2)",
       "got 7"});
  bwd("precision_negative_backward", [](Fixture& f) { f.ba.precision = -1; },
      {"'precision'", "FGDN_PRECISION_HIGH (2)", "got -1"});
  // The backward's context parallelism (its reverse pass), validated as the forward's.
  bwd("context_parallel_unknown_backward", [](Fixture& f) { f.ba.context_parallel = 3; },
      {"'context_parallel'", "FGDN_CONTEXT_PARALLEL_ON (2)", "got 3"});
  bwd("cp_segment_not_64_backward", [](Fixture& f) { f.ba.cp_segment = 100; },
      {"'cp_segment'", "0 or a positive multiple of 64", "100"});
  bwd("cp_segment_negative_backward", [](Fixture& f) { f.ba.cp_segment = -64; },
      {"'cp_segment'", "0 or a positive multiple of 64", "-64"});
  fwd("context_parallel_unknown", [](Fixture& f) { f.fa.context_parallel = -1; },
      {"'context_parallel'", "FGDN_CONTEXT_PARALLEL_AUTO (0)", "got -1"});
  return c;
}

class Validation : public ::testing::TestWithParam<Case> {};

TEST_P(Validation, RejectsWithMessageAndWritesNothing) {
  const Case& c = GetParam();
  Fixture f;
  c.mutate(f);
  const fgdn_status s = c.backward ? fgdn_backward(&f.ba, nullptr, 0, nullptr)
                                   : fgdn_forward(&f.fa, nullptr, 0, nullptr);
  const std::string msg = fgdn_last_error();
  EXPECT_EQ(s, FGDN_ERROR_INVALID_ARGUMENT) << msg;
  EXPECT_EQ(msg.rfind(c.backward ? "fgdn_backward: " : "fgdn_forward: ", 0), 0u) << msg;
  for (const std::string& part : c.message_parts)
    EXPECT_NE(msg.find(part), std::string::npos) << "missing \"" << part << "\" in: " << msg;
  EXPECT_TRUE(f.outputs_untouched());
  // The workspace queries validate the same way, except for what needs tensor values.
  size_t bytes = 0;
  const fgdn_status ws = c.backward ? fgdn_backward_workspace_size(&f.ba, &bytes)
                                    : fgdn_forward_workspace_size(&f.fa, &bytes);
  EXPECT_EQ(ws, c.needs_values ? FGDN_SUCCESS : FGDN_ERROR_INVALID_ARGUMENT) << fgdn_last_error();
}

INSTANTIATE_TEST_SUITE_P(Cases, Validation, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(ValidationApi, ValidCallsSucceedAndWrite) {
  Fixture f;
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  EXPECT_FALSE(f.outputs_untouched());
  EXPECT_STREQ(fgdn_last_error(), "");
}

// Every gradient of f's backward equal, bit for bit, to ref's.
void expect_same_gradients(const Fixture& f, const Fixture& ref, const std::string& what) {
  EXPECT_EQ(f.dq, ref.dq) << what;
  EXPECT_EQ(f.dk, ref.dk) << what;
  EXPECT_EQ(f.dv, ref.dv) << what;
  EXPECT_EQ(f.dg, ref.dg) << what;
  EXPECT_EQ(f.dbeta, ref.dbeta) << what;
  EXPECT_EQ(f.dh0, ref.dh0) << what;
}

// Every precision level is a valid backward; the CPU backend computes in float32 whatever the
// level, so each writes the same gradients, bit for bit.
TEST(ValidationApi, BackwardTakesEveryPrecisionLevel) {
  Fixture ref;
  ASSERT_EQ(ref.ba.precision, FGDN_PRECISION_DEFAULT);  // zero-initialised: the default level
  ASSERT_EQ(fgdn_backward(&ref.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  for (int32_t level : {FGDN_PRECISION_FAST, FGDN_PRECISION_HIGH}) {
    Fixture f;
    f.ba.precision = level;
    size_t bytes = 1;
    ASSERT_EQ(fgdn_backward_workspace_size(&f.ba, &bytes), FGDN_SUCCESS) << fgdn_last_error();
    EXPECT_EQ(bytes, 0u);
    ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
    expect_same_gradients(f, ref, "precision " + std::to_string(level));
  }
}

// Every context parallelism setting is a valid backward; the CPU backend has no reverse pass to
// split, so each writes the same gradients, bit for bit.
TEST(ValidationApi, BackwardTakesEveryContextParallelSetting) {
  Fixture ref;
  ASSERT_EQ(ref.ba.context_parallel, FGDN_CONTEXT_PARALLEL_AUTO);  // zero-initialised: automatic
  ASSERT_EQ(fgdn_backward(&ref.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  for (int32_t cp : {FGDN_CONTEXT_PARALLEL_OFF, FGDN_CONTEXT_PARALLEL_ON}) {
    Fixture f;
    f.ba.context_parallel = cp;
    f.ba.cp_segment = cp == FGDN_CONTEXT_PARALLEL_ON ? 64 : 0;
    ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
    expect_same_gradients(f, ref, "context_parallel " + std::to_string(cp));
  }
}

TEST(ValidationApi, NullPointers) {
  EXPECT_EQ(fgdn_forward(nullptr, nullptr, 0, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("'args'"), std::string::npos);
  EXPECT_EQ(fgdn_backward(nullptr, nullptr, 0, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  Fixture f;
  EXPECT_EQ(fgdn_forward_workspace_size(&f.fa, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("'bytes'"), std::string::npos);
}

TEST(ValidationApi, CppApiThrowsErrorWithStatus) {
  Fixture f;
  f.fa.in.v.shape[2] = 3;
  try {
    flashgdn::forward(f.fa);
    FAIL() << "expected flashgdn::Error";
  } catch (const flashgdn::Error& e) {
    EXPECT_EQ(e.status(), FGDN_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("'v'"), std::string::npos);
  }
}

TEST(ValidationApi, HostWorkspaceIsZero) {
  Fixture f;
  EXPECT_EQ(flashgdn::forward_workspace_size(f.fa), 0u);
  EXPECT_EQ(flashgdn::backward_workspace_size(f.ba), 0u);
}

TEST(ValidationApi, NoSavedStatesOnTheCpu) {
  Fixture f;
  EXPECT_EQ(flashgdn::saved_states_rows(f.fa), 0);
  int64_t rows = 7;
  EXPECT_EQ(fgdn_saved_states_rows(&f.fa, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("'rows'"), std::string::npos);
  f.fa.in.v.shape[2] = 3;  // the query validates as the workspace query does
  EXPECT_EQ(fgdn_saved_states_rows(&f.fa, &rows), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("'v'"), std::string::npos);
}

#ifndef FLASHGDN_WITH_CUDA
TEST(ValidationApi, CudaTensorsWithoutCudaBuildAreNotSupported) {
  Fixture f;
  for (fgdn_tensor* t : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta,
                         &f.fa.in.cu_seqlens, &f.fa.in.initial_state, &f.fa.o, &f.fa.final_state})
    t->device_type = FGDN_CUDA;
  EXPECT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_ERROR_NOT_SUPPORTED);
  EXPECT_NE(std::string(fgdn_last_error()).find("no CUDA backend"), std::string::npos);
  EXPECT_TRUE(f.outputs_untouched());
}
#endif

}  // namespace
