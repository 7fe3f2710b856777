// The call contract through the C ABI on the CPU backend (docs/api.md, "Contract"): a table of
// hostile calls, each refused with a message naming the argument and nothing written (outputs
// are sentinel-filled), or run correctly; calls with no tokens; overlapping arguments; the
// workspace queries, which read no tensor memory. CI runs this file under AddressSanitizer
// and UndefinedBehaviorSanitizer (scripts/test.sh, build-asan): every buffer is a separate,
// exactly sized heap allocation, so a check that lets a bad call through shows up as a report.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.hpp"
#include "test_util.h"

namespace {

using flashgdn::host_tensor;

using flashgdn::test::kSentinel;
constexpr int64_t kBig59 = (int64_t{1} << 59) + 1;
constexpr int64_t kBig62 = int64_t{1} << 62;

fgdn_tensor none() { return fgdn_tensor_none(); }

// A small valid varlen problem (fp32, T = 70 in sequences of 30 and 40 tokens, Hq = 1, Hv = 2,
// K = V = 16) with an initial state, every output sentinel-filled, and the gate computed in the
// kernel in the backward (so dA_log and ddt_bias are outputs too).
struct Fixture : flashgdn::test::HostCall {
  static constexpr int64_t T = 70, Hq = 1, Hv = 2, K = 16, V = 16, N = 2;
  Fixture() : HostCall({0, 30, T}, Hq, Hv, K, V, true, 2) {}

  // Every token tensor of both calls: [1, T, H, ...] with T replaced by `t_ext` and the
  // token stride multiplied by `t_stride_scale` (and the batch stride 0, B = 1).
  void set_tokens(int64_t t_ext, int64_t t_stride_scale) {
    for (fgdn_tensor* x : {&fa.in.q, &fa.in.k, &fa.in.v, &fa.in.g, &fa.in.beta, &fa.o, &ba.in.q,
                           &ba.in.k, &ba.in.v, &ba.in.g, &ba.in.beta, &ba.d_o, &ba.dq, &ba.dk, &ba.dv,
                           &ba.dg, &ba.dbeta}) {
      x->shape[1] = t_ext;
      x->strides[1] *= t_stride_scale;
      x->strides[0] = 0;
    }
  }
  void dense() {  // B = 1 dense: no cu_seqlens, one sequence
    for (fgdn_inputs* in : {&fa.in, &ba.in}) {
      in->cu_seqlens = none();
      in->initial_state.shape[0] = 1;
    }
    fa.final_state.shape[0] = 1;
    ba.d_final_state.shape[0] = 1;
    ba.dh0.shape[0] = 1;
  }
};

enum Which { kFwd, kBwd, kBoth };

struct Hostile {
  std::string name;
  Which which;
  std::function<void(Fixture&)> mutate;
  fgdn_status expect;
  std::vector<std::string> parts;  // each must appear in the message
  bool needs_values = false;       // refused only once values are read (not by the size queries)
};

void inputs(Fixture& f, const std::function<void(fgdn_inputs&)>& m) {
  m(f.fa.in);
  m(f.ba.in);
}

std::vector<Hostile> hostile_calls() {
  std::vector<Hostile> h;
  auto add = [&](const char* name, Which w, std::function<void(Fixture&)> m, std::vector<std::string> parts,
                 fgdn_status st = FGDN_ERROR_INVALID_ARGUMENT) {
    h.push_back({name, w, std::move(m), st, std::move(parts)});
  };
  auto in = [&](const char* name, std::function<void(fgdn_inputs&)> m, std::vector<std::string> parts) {
    add(name, kBoth, [m](Fixture& f) { inputs(f, m); }, std::move(parts));
  };

  // ---- sizes that overflow int64 (item 2) ----
  for (Which w : {kFwd, kBwd})  // inputs broadcast along T fit; the first output's count does not
    add(w == kFwd ? "T_2e59_stride0" : "T_2e59_stride0_backward", w, [](Fixture& f) {
          f.dense();
          f.set_tokens(kBig59, 0);  // every token tensor, o and the gradients included
        }, {w == kFwd ? "'o'" : "'dq'", "element count fits in 64 bits"});
  add("T_2e57_stride0_o_contiguous", kFwd, [](Fixture& f) {
        // Inputs broadcast along T fit; o, a real layout, addresses 2^66 bytes.
        f.dense();
        f.set_tokens((int64_t{1} << 57) + 1, 0);
        f.fa.o.strides[1] = Fixture::Hv * Fixture::V;
      }, {"'o'", "addressed memory fits in 64 bits"});
  add("T_2e50_stride0_o_stride0", kFwd, [](Fixture& f) {
        f.dense();
        f.set_tokens(int64_t{1} << 50, 0);
      }, {"'o'", "no two elements"});
  add("T_2e62", kBoth, [](Fixture& f) { f.dense(); f.set_tokens(kBig62, 1); }, {"'q'", "64 bits"});
  add("B_2e40_stride0", kFwd, [](Fixture& f) {
        f.dense();
        for (fgdn_tensor* x : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta, &f.fa.o}) {
          x->shape[0] = int64_t{1} << 40;
          x->strides[0] = 0;
        }
        f.fa.output_final_state = 0;
        f.fa.final_state = none();
        f.fa.in.initial_state = none();
      }, {"'o'"});
  add("B_2e40_derived_sizes", kFwd, [](Fixture& f) {
        // Every tensor's own range fits (strides 0 over the huge batch in the inputs; o a real
        // layout of 2^40 * 70 * 32 * 4 bytes); what the backends would derive does not.
        f.dense();
        for (fgdn_tensor* x : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta, &f.fa.o}) {
          x->shape[0] = int64_t{1} << 40;
          x->strides[0] = x == &f.fa.o ? Fixture::T * Fixture::Hv * Fixture::V : 0;
        }
        f.fa.output_final_state = 0;
        f.fa.final_state = none();
        f.fa.in.initial_state = none();
      }, {"'q'", "derived sizes"});
  in("cu_seqlens_2e61_entries", [](fgdn_inputs& x) { x.cu_seqlens.shape[0] = int64_t{1} << 61; },
     {"'cu_seqlens'", "64 bits"});
  in("head_stride_2e62", [](fgdn_inputs& x) { x.v.strides[2] = kBig62; }, {"'v'", "64 bits"});
  add("checkpoints_numel_overflow", kFwd, [](Fixture& f) {
        f.fa.checkpoint_every = 64;
        f.fa.checkpoints = host_tensor(f.ck.data(), FGDN_FLOAT32, {int64_t{1} << 60, 2, 16, 16});
        f.fa.checkpoints.strides[0] = 0;
      }, {"'checkpoints'", "element count fits in 64 bits"});
  in("range_wraps_address_space", [](fgdn_inputs& x) {
       x.q.data = reinterpret_cast<void*>(~uintptr_t{0} - 4095);  // 4-byte aligned, 4 KiB below the top
     }, {"'q'", "does not wrap"});
  add("checkpoints_2e61_rows", kFwd, [](Fixture& f) {
        f.fa.checkpoint_every = 64;
        f.fa.checkpoints = host_tensor(f.ck.data(), FGDN_FLOAT32, {int64_t{1} << 61, 2, 16, 16});
      }, {"'checkpoints'", "64 bits"});
  add("dh0_rows_2e62_stride0", kBwd, [](Fixture& f) {
        f.ba.dh0.shape[0] = kBig62;
        f.ba.dh0.strides[0] = 0;
      }, {"'dh0'", "shape"});

  // ---- NULL data for a tensor with elements (item 3) ----
  in("q_null", [](fgdn_inputs& x) { x.q.data = nullptr; }, {"'q'", "NULL for a tensor of 1120 elements"});
  in("cu_seqlens_null", [](fgdn_inputs& x) { x.cu_seqlens.data = nullptr; }, {"'cu_seqlens'", "NULL"});
  in("initial_state_null", [](fgdn_inputs& x) { x.initial_state.data = nullptr; }, {"'initial_state'", "NULL"});
  add("o_null", kFwd, [](Fixture& f) { f.fa.o.data = nullptr; }, {"'o'", "NULL"});
  add("final_state_null", kFwd, [](Fixture& f) { f.fa.final_state.data = nullptr; }, {"'final_state'", "NULL"});
  add("dq_null", kBwd, [](Fixture& f) { f.ba.dq.data = nullptr; }, {"'dq'", "NULL"});
  add("dA_log_null", kBwd, [](Fixture& f) { f.ba.dA_log.data = nullptr; }, {"'dA_log'", "NULL"});
  add("A_log_null", kBwd, [](Fixture& f) { f.ba.in.A_log.data = nullptr; }, {"'A_log'", "NULL"});

  // ---- outputs that overlap themselves (item 2) ----
  add("o_stride0_tokens", kFwd, [](Fixture& f) { f.fa.o.strides[1] = 0; }, {"'o'", "no two elements"});
  add("o_heads_alias", kFwd, [](Fixture& f) { f.fa.o.strides[2] = 0; }, {"'o'", "no two elements"});
  add("o_rows_interleave", kFwd, [](Fixture& f) { f.fa.o.strides[1] = 8; }, {"'o'", "no two elements"});
  add("final_state_stride0_rows", kFwd, [](Fixture& f) { f.fa.final_state.strides[0] = 0; },
      {"'final_state'", "no two elements"});
  add("checkpoints_stride0_rows", kFwd, [](Fixture& f) {
        f.dense();
        f.fa.checkpoint_every = 64;
        f.fa.checkpoints = host_tensor(f.ck.data(), FGDN_FLOAT32, {2, 2, 16, 16});
        f.fa.checkpoints.strides[0] = 0;
      }, {"'checkpoints'", "no two elements"});
  add("dg_stride0_tokens", kBwd, [](Fixture& f) { f.ba.dg.strides[1] = 0; }, {"'dg'", "no two elements"});
  add("dh0_equal_strides", kBwd, [](Fixture& f) { f.ba.dh0.strides[1] = f.ba.dh0.strides[2]; },
      {"'dh0'", "no two elements"});
  for (int64_t rows : {int64_t{4}, kBig62}) {
    add(rows == 4 ? "pool_written_stride0" : "pool_written_2e62_rows", kFwd, [rows](Fixture& f) {
          static int32_t idx[] = {0, 1};
          f.fa.in.state_indices = host_tensor(idx, FGDN_INT32, {2});
          f.fa.in.initial_state.shape[0] = rows;
          f.fa.in.initial_state.strides[0] = 0;
          f.fa.final_state = none();
        }, {"'initial_state'", rows == 4 ? "no two elements" : "element count"});
  }

  // ---- arguments that overlap (item 4) ----
  add("q_inside_o", kFwd, [](Fixture& f) { f.fa.in.q.data = f.o.data() + 64; },
      {"'o'", "disjoint from argument 'q'"});
  add("o_is_v", kFwd, [](Fixture& f) { f.fa.o.data = f.v.data(); }, {"'o'", "argument 'v'"});
  add("final_state_is_initial_state", kFwd, [](Fixture& f) { f.fa.final_state.data = f.h0.data(); },
      {"'final_state'", "argument 'initial_state'"});
  add("checkpoints_over_initial_state", kFwd, [](Fixture& f) {
        f.dense();
        f.fa.checkpoint_every = 64;
        f.fa.checkpoints = host_tensor(f.h0.data() + 16, FGDN_FLOAT32, {1, 2, 16, 16});
      }, {"'checkpoints'", "'initial_state'"});
  add("o_over_cu_seqlens", kFwd, [](Fixture& f) {
        // A different dtype over the same bytes: not provably disjoint.
        // (refused before any value is read)
        f.fa.in.cu_seqlens.data = f.o.data() + 2;
      }, {"'o'", "'cu_seqlens'"});
  add("dq_is_dk", kBwd, [](Fixture& f) { f.ba.dk.data = f.dq.data(); }, {"'dq'", "argument 'dk'"});
  add("dv_half_over_d_o", kBwd, [](Fixture& f) { f.ba.dv.data = f.d_o.data() + 8; },
      {"'dv'", "'d_o'"});
  add("dh0_is_d_final_state", kBwd, [](Fixture& f) { f.ba.dh0.data = f.dht.data(); },
      {"'dh0'", "'d_final_state'"});
  add("dg_is_dbeta", kBwd, [](Fixture& f) { f.ba.dbeta.data = f.dg.data(); }, {"'dg'", "'dbeta'"});
  add("dg_over_g", kBwd, [](Fixture& f) { f.ba.dg.data = f.g.data(); }, {"'dg'", "'g"});
  add("ddt_bias_is_dA_log", kBwd, [](Fixture& f) { f.ba.ddt_bias.data = f.dA_log.data(); },
      {"'dA_log'", "'ddt_bias'"});
  add("dq_rows_interleaved_with_dk_shifted", kBwd, [](Fixture& f) {
        // Same layout, half a row apart: elements coincide (the exact test finds them).
        f.ba.dk.data = f.dq.data() + 8;
      }, {"'dq'", "'dk'"});
  add("pool_written_over_q", kFwd, [](Fixture& f) {
        static int64_t idx[] = {0, -1};
        f.fa.in.state_indices = host_tensor(idx, FGDN_INT64, {2});
        f.fa.in.initial_state = host_tensor(f.q.data(), FGDN_FLOAT32, {1, 2, 16, 16});
        f.fa.final_state = none();
      }, {"'initial_state'", "'q'"});

  // ---- calls with no tokens are validated like any other (item 3) ----
  auto empty = [](Fixture& f) {
    f.dense();
    f.set_tokens(0, 1);
    for (fgdn_tensor* x : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta, &f.fa.o,
                           &f.ba.in.q, &f.ba.in.k, &f.ba.in.v, &f.ba.in.g, &f.ba.in.beta, &f.ba.d_o,
                           &f.ba.dq, &f.ba.dk, &f.ba.dv, &f.ba.dg, &f.ba.dbeta})
      x->data = nullptr;  // as torch gives empty tensors
  };
  add("empty_bad_K", kBoth, [empty](Fixture& f) {
        empty(f);
        inputs(f, [](fgdn_inputs& x) { x.q.shape[3] = x.k.shape[3] = 48; });
      }, {"'q'", "K=48"});
  add("empty_mixed_dtypes", kBoth, [empty](Fixture& f) {
        empty(f);
        inputs(f, [](fgdn_inputs& x) { x.k.dtype = FGDN_BFLOAT16; });
      }, {"'k'", "dtype float32"});
  add("empty_nan_scale", kBoth, [empty](Fixture& f) {
        empty(f);
        inputs(f, [](fgdn_inputs& x) { x.has_scale = 1; x.scale = std::nan(""); });
      }, {"'scale'"});
  add("empty_final_state_shape", kFwd, [empty](Fixture& f) {
        empty(f);
        f.fa.final_state.shape[1] = 3;
      }, {"'final_state'", "shape"});
  add("empty_dh0_shape", kBwd, [empty](Fixture& f) {
        empty(f);
        f.ba.dh0.shape[0] = 2;
      }, {"'dh0'", "shape"});
  h.push_back({"empty_decreasing_cu_seqlens", kBoth, [](Fixture& f) {
                 static int64_t cu[] = {0, 1, 0};
                 f.set_tokens(0, 1);
                 inputs(f, [](fgdn_inputs& x) { x.cu_seqlens.data = cu; });
               },
               FGDN_ERROR_INVALID_ARGUMENT, {"'cu_seqlens'", "non-decreasing"}, true});
  in("empty_cu_seqlens_tensor", [](fgdn_inputs& x) { x.cu_seqlens.shape[0] = 0; x.cu_seqlens.data = nullptr; },
     {"'cu_seqlens'", "at least 2 entries", "0 entries"});

  // ---- descriptors that are garbage ----
  in("q_dtype_garbage", [](fgdn_inputs& x) { x.q.dtype = 99; }, {"'q'", "unknown dtype code 99"});
  in("g_dtype_negative", [](fgdn_inputs& x) { x.g.dtype = -1; }, {"'g", "dtype"});
  in("initial_state_transposed", [](fgdn_inputs& x) {
       x.initial_state.strides[2] = 1;
       x.initial_state.strides[3] = 16;
     }, {"'initial_state'", "contiguous last dimension", "state_v_first=True"});
  in("v_ndim_negative", [](fgdn_inputs& x) { x.v.ndim = -3; }, {"'v'", "-3 dimensions"});
  in("beta_ndim_huge", [](fgdn_inputs& x) { x.beta.ndim = 1000; }, {"'beta'", "1000 dimensions"});
  in("initial_state_ndim_5", [](fgdn_inputs& x) { x.initial_state.ndim = 5; }, {"'initial_state'", "5 dimensions"});
  in("q_shape_negative", [](fgdn_inputs& x) { x.q.shape[2] = -1; }, {"'q'", "shape"});
  in("k_stride_negative", [](fgdn_inputs& x) { x.k.strides[0] = -5; }, {"'k'", "non-negative strides"});
  in("device_type_zero", [](fgdn_inputs& x) { x.v.device_type = 0; }, {"'v'", "a cpu or cuda tensor"});
  in("cpu_device_id_1", [](fgdn_inputs& x) { x.beta.device_id = 1; }, {"'beta'", "cpu:1"});
  add("o_on_cpu_1", kFwd, [](Fixture& f) { f.fa.o.device_id = 1; }, {"'o'", "got a tensor on cpu:1"});
  add("o_on_cuda_7", kFwd, [](Fixture& f) { f.fa.o.device_type = FGDN_CUDA; f.fa.o.device_id = 7; },
      {"'o'", "a tensor on cpu (the device of q)", "cuda:7"});
  in("cuda_q_huge_stride_on_extent_1", [](fgdn_inputs& x) {
       // The CUDA alignment rule looks at strides of extents > 1 only (this one would overflow
       // in bytes); the call is then refused for k on another device.
       x.q.device_type = FGDN_CUDA;
       x.q.strides[2] = kBig62;
     }, {"'k'", "the device of q"});
#ifdef FLASHGDN_WITH_CUDA
  // q, k, v on cuda with K = 16 and a token stride of 24 bytes: the head dims are what to change,
  // so they are reported before the 16-byte stride rule (FLA's K = 100 case).
  in("cuda_head_dims_before_strides", [](fgdn_inputs& x) {
       for (fgdn_tensor* t : {&x.q, &x.k, &x.v}) t->device_type = FGDN_CUDA;
       x.q.strides[1] = 6;
     }, {"'q'", "head dims K = V in {64, 128} on cuda", "K=16"});
#endif
  in("cuda_device_id_negative", [](fgdn_inputs& x) { x.q.device_type = FGDN_CUDA; x.q.device_id = -1; },
     {"'q'", "device id"});
  in("cu_seqlens_host_on_cuda", [](fgdn_inputs& x) {
       x.cu_seqlens_host = x.cu_seqlens;
       x.cu_seqlens_host.device_type = FGDN_CUDA;
     }, {"'cu_seqlens_host'", "a cpu tensor"});
  h.push_back({"cu_seqlens_host_differs", kBoth, [](Fixture& f) {
                 static int64_t cu[] = {0, 40, 70};
                 inputs(f, [](fgdn_inputs& x) { x.cu_seqlens_host = host_tensor(cu, FGDN_INT64, {3}); });
               },
               FGDN_ERROR_INVALID_ARGUMENT, {"'cu_seqlens_host'", "equal to cu_seqlens", "cu_seqlens_host[1]=40"}, true});
  h.push_back({"cu_seqlens_host_invalid", kBoth, [](Fixture& f) {
                 static int32_t cu[] = {0, 80, 70};
                 inputs(f, [](fgdn_inputs& x) { x.cu_seqlens_host = host_tensor(cu, FGDN_INT32, {3}); });
               },
               FGDN_ERROR_INVALID_ARGUMENT, {"'cu_seqlens_host'"}, true});
  add("absent_tensor_with_garbage_ndim", kFwd, [](Fixture& f) {
        f.fa.in.dt_bias.ndim = 7;  // present (ndim != 0) while gate_in_kernel is off
      }, {"'dt_bias'", "gate_in_kernel is 0", "7 dimensions"});
  add("checkpoint_every_negative", kFwd, [](Fixture& f) { f.fa.checkpoint_every = -64; },
      {"'checkpoint_every'", "-64"});
  add("checkpoint_every_min", kFwd, [](Fixture& f) { f.fa.checkpoint_every = std::numeric_limits<int64_t>::min(); },
      {"'checkpoint_every'"});
  h.push_back({"state_indices_huge", kBoth, [](Fixture& f) {
                 static int64_t idx[] = {std::numeric_limits<int64_t>::max(), 0};
                 inputs(f, [](fgdn_inputs& x) { x.state_indices = host_tensor(idx, FGDN_INT64, {2}); });
                 f.fa.final_state = none();
               },
               FGDN_ERROR_INVALID_ARGUMENT, {"'state_indices'", "below the pool size"}, true});
  return h;
}

class HostileCall : public ::testing::TestWithParam<Hostile> {};

void run_hostile(const Hostile& c, bool backward) {
  Fixture f;
  c.mutate(f);
  const fgdn_status s = backward ? fgdn_backward(&f.ba, nullptr, 0, nullptr) : fgdn_forward(&f.fa, nullptr, 0, nullptr);
  const std::string msg = fgdn_last_error();
  EXPECT_EQ(s, c.expect) << (backward ? "backward: " : "forward: ") << msg;
  for (const std::string& part : c.parts)
    EXPECT_NE(msg.find(part), std::string::npos) << "missing \"" << part << "\" in: " << msg;
  EXPECT_TRUE(f.outputs_untouched()) << (backward ? "backward" : "forward") << " wrote into an output";
  size_t bytes = 1;
  const fgdn_status ws = backward ? fgdn_backward_workspace_size(&f.ba, &bytes) : fgdn_forward_workspace_size(&f.fa, &bytes);
  EXPECT_EQ(ws, c.needs_values ? FGDN_SUCCESS : c.expect) << "workspace query: " << fgdn_last_error();
}

TEST_P(HostileCall, RefusedWithMessageAndNothingWritten) {
  const Hostile& c = GetParam();
  if (c.which != kBwd) run_hostile(c, false);
  if (c.which != kFwd) run_hostile(c, true);
}

INSTANTIATE_TEST_SUITE_P(Contract, HostileCall, ::testing::ValuesIn(hostile_calls()),
                         [](const ::testing::TestParamInfo<Hostile>& i) { return i.param.name; });

TEST(Contract, HostileTableIsLarge) { EXPECT_GE(hostile_calls().size(), 50u); }

TEST(Contract, NullArgumentPointers) {
  EXPECT_EQ(fgdn_forward(nullptr, nullptr, 0, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("'args'"), std::string::npos);
  EXPECT_EQ(fgdn_backward(nullptr, nullptr, 0, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  size_t bytes = 0;
  EXPECT_EQ(fgdn_forward_workspace_size(nullptr, &bytes), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(fgdn_backward_workspace_size(nullptr, &bytes), FGDN_ERROR_INVALID_ARGUMENT);
  Fixture f;
  EXPECT_EQ(fgdn_backward_workspace_size(&f.ba, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
}

// The valid fixture runs (the table's cases are one change away from a valid call).
TEST(Contract, FixtureIsValid) {
  Fixture f;
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  for (const auto* out : {&f.o, &f.ht, &f.dq, &f.dk, &f.dv, &f.dg, &f.dbeta, &f.dh0, &f.dA_log, &f.ddt_bias})
    for (float x : *out) ASSERT_TRUE(std::isfinite(x) && x != kSentinel);
}

// ---- calls with no tokens (item 3) --------------------------------------------------------

// Empty tensors carry a NULL data pointer (as torch gives them); the call is validated and
// every sequence's final state is its initial state, every dh0 its dht.
TEST(Contract, NoTokensForwardFinalStateIsInitialState) {
  for (bool varlen : {false, true}) {
    Fixture f;
    if (!varlen) f.dense();
    f.set_tokens(0, 1);
    static int64_t cu0[] = {0, 0, 0};
    if (varlen) f.fa.in.cu_seqlens.data = cu0;
    for (fgdn_tensor* x : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta, &f.fa.o}) x->data = nullptr;
    ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
    const size_t n = static_cast<size_t>((varlen ? 2 : 1) * Fixture::Hv * Fixture::K * Fixture::V);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(f.ht[i], f.h0[i]) << "varlen=" << varlen << " element " << i;
    // Without an initial state: zero.
    f.fa.in.initial_state = none();
    ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(f.ht[i], 0.f);
  }
}

TEST(Contract, NoTokensPoolIsUnchanged) {
  Fixture f;
  f.set_tokens(0, 1);
  static int64_t cu0[] = {0, 0, 0};
  f.fa.in.cu_seqlens.data = cu0;
  for (fgdn_tensor* x : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta, &f.fa.o}) x->data = nullptr;
  static int32_t idx[] = {1, -1};
  f.fa.in.state_indices = host_tensor(idx, FGDN_INT32, {2});
  f.fa.final_state = none();
  const std::vector<float> before = f.h0;
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  EXPECT_EQ(f.h0, before);
}

TEST(Contract, NoTokensBackwardDh0IsDht) {
  Fixture f;
  f.dense();
  f.set_tokens(0, 1);
  for (fgdn_tensor* x : {&f.ba.in.q, &f.ba.in.k, &f.ba.in.v, &f.ba.in.g, &f.ba.in.beta, &f.ba.d_o, &f.ba.dq,
                         &f.ba.dk, &f.ba.dv, &f.ba.dg, &f.ba.dbeta})
    x->data = nullptr;
  ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  const size_t n = static_cast<size_t>(Fixture::Hv * Fixture::K * Fixture::V);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(f.dh0[i], f.dht[i]);
  for (float x : f.dA_log) EXPECT_EQ(x, 0.f);
  for (float x : f.ddt_bias) EXPECT_EQ(x, 0.f);
  f.ba.d_final_state = none();
  ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(f.dh0[i], 0.f);
}

// B = 0: no sequences at all; every tensor empty.
TEST(Contract, EmptyBatch) {
  Fixture f;
  f.dense();
  for (fgdn_tensor* x : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta, &f.fa.o,
                         &f.fa.in.initial_state, &f.fa.final_state}) {
    x->shape[0] = 0;
    x->data = nullptr;
  }
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  EXPECT_TRUE(f.outputs_untouched());
}

// ---- valid calls that were refused (item 8) ---------------------------------------------------

// Every sequence shorter than checkpoint_every: zero checkpoint rows (an empty tensor, NULL).
TEST(Contract, ZeroCheckpointRows) {
  Fixture f;
  f.fa.checkpoint_every = 64;  // sequences of 30 and 40 tokens
  f.fa.checkpoints = host_tensor(nullptr, FGDN_FLOAT32, {0, 2, 16, 16});
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  f.fa.checkpoint_every = int64_t{1} << 62;  // any multiple of 64
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
}

// A pool of 2^62 rows that are all one state (stride 0), read only: no table over its rows.
TEST(Contract, HugeReadOnlyPool) {
  Fixture f;
  static int64_t idx[] = {kBig62 - 1, 3};
  for (fgdn_inputs* in : {&f.fa.in, &f.ba.in}) {
    in->state_indices = host_tensor(idx, FGDN_INT64, {2});
    in->initial_state.shape[0] = kBig62;
    in->initial_state.strides[0] = 0;
  }
  f.fa.output_final_state = 0;
  f.fa.final_state = none();
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
}

// Duplicate pool rows are fine where nothing is written back (two sequences from one cached
// state), refused where the pool is written (the table's state_indices cases, test_validation).
TEST(Contract, DuplicateRowsReadOnly) {
  Fixture f;
  static int64_t idx[] = {1, 1};
  for (fgdn_inputs* in : {&f.fa.in, &f.ba.in}) in->state_indices = host_tensor(idx, FGDN_INT64, {2});
  f.fa.output_final_state = 0;
  f.fa.final_state = none();
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  f.fa.output_final_state = 1;
  EXPECT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fgdn_last_error()).find("index 1 twice"), std::string::npos) << fgdn_last_error();
}

// An absent tensor is ndim 0 whatever its other fields say.
TEST(Contract, AbsentIsNdimZero) {
  Fixture f;
  f.fa.in.dt_bias.data = f.q.data();  // garbage in an absent tensor
  f.fa.in.dt_bias.shape[0] = 99;
  f.fa.in.A_log.dtype = 77;
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
}

// ---- interleaved outputs that do not intersect are accepted (item 4) --------------------------

// dq and dk as the two halves of one [.., 2K] buffer, dg and dbeta alternate columns of one
// [.., 2 Hv] buffer: the results equal those of separate buffers, bitwise.
TEST(Contract, InterleavedOutputsAccepted) {
  Fixture sep;
  ASSERT_EQ(fgdn_backward(&sep.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  Fixture f;
  const int64_t T = Fixture::T, K = Fixture::K, Hv = Fixture::Hv;
  std::vector<float> qk(static_cast<size_t>(T * 2 * K), kSentinel), gb(static_cast<size_t>(T * 2 * Hv), kSentinel);
  f.ba.dq = host_tensor(qk.data(), FGDN_FLOAT32, {1, T, 1, K});
  f.ba.dk = host_tensor(qk.data() + K, FGDN_FLOAT32, {1, T, 1, K});
  for (fgdn_tensor* x : {&f.ba.dq, &f.ba.dk}) x->strides[1] = x->strides[0] = 2 * K;
  f.ba.dg = host_tensor(gb.data(), FGDN_FLOAT32, {1, T, Hv});
  f.ba.dbeta = host_tensor(gb.data() + Hv, FGDN_FLOAT32, {1, T, Hv});
  for (fgdn_tensor* x : {&f.ba.dg, &f.ba.dbeta}) x->strides[1] = x->strides[0] = 2 * Hv;
  ASSERT_EQ(fgdn_backward(&f.ba, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < K; ++d) {
      ASSERT_EQ(qk[static_cast<size_t>(t * 2 * K + d)], sep.dq[static_cast<size_t>(t * K + d)]);
      ASSERT_EQ(qk[static_cast<size_t>(t * 2 * K + K + d)], sep.dk[static_cast<size_t>(t * K + d)]);
    }
    for (int64_t h = 0; h < Hv; ++h) {
      ASSERT_EQ(gb[static_cast<size_t>(t * 2 * Hv + h)], sep.dg[static_cast<size_t>(t * Hv + h)]);
      ASSERT_EQ(gb[static_cast<size_t>(t * 2 * Hv + Hv + h)], sep.dbeta[static_cast<size_t>(t * Hv + h)]);
    }
  }
}

// o in the even rows of a buffer and the inputs q, k in its odd rows (inputs may overlap
// each other; an output may be interleaved with an input when no element is shared).
TEST(Contract, OutputInterleavedWithInputAccepted) {
  Fixture sep;
  sep.dense();
  ASSERT_EQ(fgdn_forward(&sep.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  Fixture f;
  f.dense();
  const int64_t T = Fixture::T, W = Fixture::Hv * Fixture::V;  // 32 floats per row of o
  std::vector<float> buf(static_cast<size_t>(2 * T * W), kSentinel);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < 16; ++d) buf[static_cast<size_t>((2 * t + 1) * W + d)] = f.q[static_cast<size_t>(t * 16 + d)];
  f.fa.o = host_tensor(buf.data(), FGDN_FLOAT32, {1, T, Fixture::Hv, Fixture::V});
  f.fa.o.strides[1] = f.fa.o.strides[0] = 2 * W;
  f.fa.in.q = host_tensor(buf.data() + W, FGDN_FLOAT32, {1, T, 1, 16});
  f.fa.in.q.strides[1] = f.fa.in.q.strides[0] = 2 * W;
  f.fa.in.k = f.fa.in.q;  // k == q here and there
  sep.fa.in.k = sep.fa.in.q;
  ASSERT_EQ(fgdn_forward(&sep.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  ASSERT_EQ(fgdn_forward(&f.fa, nullptr, 0, nullptr), FGDN_SUCCESS) << fgdn_last_error();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < W; ++d)
      ASSERT_EQ(buf[static_cast<size_t>(2 * t * W + d)], sep.o[static_cast<size_t>(t * W + d)]);
}

// ---- the workspace queries read no tensor memory (item 7) -----------------------------------

// Every tensor points into unmapped memory (the low megabytes below any executable's load
// address): a query that read cu_seqlens, state_indices or anything else would crash.
TEST(Contract, WorkspaceQueriesReadNoTensorMemory) {
  Fixture f;
  uintptr_t next = 0x10000;
  auto unmapped = [&next](fgdn_tensor& t) {
    if (t.ndim == 0) return;
    t.data = reinterpret_cast<void*>(next);
    next += 0x10000;  // ranges stay disjoint (each tensor is < 64 KiB)
  };
  static int32_t idx[] = {0, 1};
  f.fa.in.state_indices = host_tensor(idx, FGDN_INT32, {2});  // a pool written back
  f.fa.final_state = none();
  for (fgdn_tensor* t : {&f.fa.in.q, &f.fa.in.k, &f.fa.in.v, &f.fa.in.g, &f.fa.in.beta, &f.fa.in.cu_seqlens,
                         &f.fa.in.initial_state, &f.fa.in.state_indices, &f.fa.o})
    unmapped(*t);
  size_t bytes = 1;
  ASSERT_EQ(fgdn_forward_workspace_size(&f.fa, &bytes), FGDN_SUCCESS) << fgdn_last_error();
  EXPECT_EQ(bytes, 0u);
  next = 0x10000;
  for (fgdn_tensor* t : {&f.ba.in.q, &f.ba.in.k, &f.ba.in.v, &f.ba.in.g, &f.ba.in.beta, &f.ba.in.A_log,
                         &f.ba.in.dt_bias, &f.ba.in.cu_seqlens, &f.ba.in.initial_state, &f.ba.d_o,
                         &f.ba.d_final_state, &f.ba.dq, &f.ba.dk, &f.ba.dv, &f.ba.dg, &f.ba.dbeta,
                         &f.ba.dA_log, &f.ba.ddt_bias, &f.ba.dh0})
    unmapped(*t);
  ASSERT_EQ(fgdn_backward_workspace_size(&f.ba, &bytes), FGDN_SUCCESS) << fgdn_last_error();
}

}  // namespace
