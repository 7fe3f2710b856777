// Check mode (fgdn_inputs.check_inputs, FLASHGDN_CHECK_INPUTS=1): the checks of the inputs'
// values, described as plain data so the CPU (csrc/api/value_checks.cpp) and CUDA
// (csrc/cuda/check_inputs.cu) evaluate the same list the same way.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/host_device.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn {

enum ValueRule : int32_t {
  kRuleFinite = 0,             // every element finite
  kRuleFiniteNonPositive = 1,  // every element finite and <= 0 (the log-space gate)
};

// One float tensor to scan, in row-major order of `shape`. With `rows` set, dimension 0 is the
// sequence n and its elements live at pool row rows[n] (a state pool read through
// state_indices): a sequence whose row is negative or >= pool_rows is skipped (the index check
// reports out-of-range rows).
struct ValueCheck {
  const char* name = nullptr;  // the argument, for the message (host only)
  const void* data = nullptr;
  int32_t dtype = FGDN_FLOAT32;
  int32_t ndim = 0;
  int64_t shape[FGDN_MAX_DIMS] = {};
  int64_t strides[FGDN_MAX_DIMS] = {};
  int32_t rule = kRuleFinite;
  const void* rows = nullptr;
  int32_t rows_dtype = FGDN_INT64;
  int64_t pool_rows = 0;
};

// The first offending element of one check: its row-major index over `shape` (kNoBadValue when
// every element passed) and its value.
constexpr uint64_t kNoBadValue = ~static_cast<uint64_t>(0);
struct ValueCheckResult {
  uint64_t first_bad = kNoBadValue;
  float value = 0.f;
  uint32_t pad = 0;
};

// What a run of the checks brings back to the host: one result per check, and the index
// tensors the device path was asked to copy back (int64, empty when not asked).
struct ValueCheckOutcome {
  std::vector<ValueCheckResult> results;
  std::vector<int64_t> cu_seqlens;
  std::vector<int64_t> state_indices;
};

// True when the element passes rule. Finiteness from the exponent bits, the same on host and
// device whatever floating-point flags a build uses.
FGDN_HOST_DEVICE inline bool value_ok(float x, int32_t rule) {
  uint32_t bits = 0;
  memcpy(&bits, &x, sizeof(bits));
  const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
  return rule == kRuleFiniteNonPositive ? finite && x <= 0.f : finite;
}

}  // namespace flashgdn
