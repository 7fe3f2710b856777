// CPU backend: the chunked algorithm (gdn-math section 3, chunk 64) in float32 with a float32
// state (the caller's states, fp32 | bf16 | fp16, converted on load and rounded on store), forward
// and backward, multithreaded over (sequence, value head).
#pragma once

#include "common/problem.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::cpu {

constexpr int64_t kChunk = 64;

void forward(const Problem& p, const fgdn_fwd_args& a);
void backward(const Problem& p, const fgdn_bwd_args& a);

}  // namespace flashgdn::cpu
