// Check mode on the host side: which values a call checks, and the CPU evaluation (the CUDA one
// is csrc/cuda/check_inputs.cu). The messages are composed by validate.cpp.
#pragma once

#include <vector>

#include "common/problem.h"
#include "common/value_checks.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn {

// The checks of a validated call, in the order they are reported: q, k, v, g (<= 0 unless
// gate_in_kernel), beta, A_log, dt_bias, initial_state (a pool: the rows state_indices reads),
// then the backward's d_o and d_final_state (nullptr: none).
std::vector<ValueCheck> input_value_checks(const Problem& p, const fgdn_inputs& in,
                                           const fgdn_tensor* d_o, const fgdn_tensor* d_final_state);

// Evaluates the checks on host tensors, in row-major order (the first offending element).
ValueCheckOutcome run_value_checks_host(const std::vector<ValueCheck>& checks);

}  // namespace flashgdn
