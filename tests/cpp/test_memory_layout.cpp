// The memory tests validation relies on (csrc/api/memory_layout.h), against brute force: the
// set of elements each layout addresses, enumerated. memory_overlap must never call
// intersecting tensors disjoint nor disjoint ones intersecting, and must decide (never
// kUnknown) for two views with one element size and the same strides; non_self_overlapping
// must never accept a layout that addresses an element twice.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "api/memory_layout.h"
#include "flashgdn/flashgdn.hpp"

namespace {

using flashgdn::memory_overlap;
using flashgdn::non_self_overlapping;
using flashgdn::Overlap;

// A float32 view at element offset `off` of a fake base address (never dereferenced).
fgdn_tensor view(int64_t off, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  fgdn_tensor t = fgdn_tensor_none();
  t.data = reinterpret_cast<void*>(static_cast<uintptr_t>(0x100000 + 4 * off));
  t.dtype = FGDN_FLOAT32;
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    t.shape[d] = shape[d];
    t.strides[d] = strides[d];
  }
  t.device_type = FGDN_CPU;
  return t;
}

// Element offsets (relative to the fake base) a view addresses, with repeats counted.
std::vector<int64_t> elements(const fgdn_tensor& t) {
  std::vector<int64_t> out{(reinterpret_cast<intptr_t>(t.data) - 0x100000) / 4};
  for (int d = 0; d < t.ndim; ++d) {
    std::vector<int64_t> next;
    for (int64_t base : out)
      for (int64_t i = 0; i < t.shape[d]; ++i) next.push_back(base + i * t.strides[d]);
    out.swap(next);
  }
  return out;
}

bool intersect(const fgdn_tensor& a, const fgdn_tensor& b) {
  const std::vector<int64_t> ea = elements(a);
  const std::set<int64_t> sa(ea.begin(), ea.end());
  for (int64_t x : elements(b))
    if (sa.count(x)) return true;
  return false;
}

Overlap overlap(const fgdn_tensor& a, const fgdn_tensor& b) { return memory_overlap(a, 4, b, 4); }

TEST(MemoryLayout, CommonCases) {
  const fgdn_tensor a = view(0, {1, 70, 2, 16}, {2240, 32, 16, 1});
  EXPECT_EQ(overlap(a, a), Overlap::kIntersect);
  EXPECT_EQ(overlap(a, view(2240, {1, 70, 2, 16}, {2240, 32, 16, 1})), Overlap::kDisjoint);  // after it
  // Halves of each row: dq = buf[..., :16], dk = buf[..., 16:].
  EXPECT_EQ(overlap(view(0, {1, 70, 1, 16}, {2240, 32, 16, 1}), view(16, {1, 70, 1, 16}, {2240, 32, 16, 1})),
            Overlap::kDisjoint);
  // Alternate rows.
  EXPECT_EQ(overlap(view(0, {70, 16}, {32, 1}), view(16, {70, 16}, {32, 1})), Overlap::kDisjoint);
  // Half a row apart: the second half of each row of one is the first half of the other's.
  EXPECT_EQ(overlap(view(0, {70, 16}, {16, 1}), view(8, {70, 16}, {16, 1})), Overlap::kIntersect);
  // Interleaved with different strides: not decided, refused.
  EXPECT_EQ(overlap(view(0, {70, 16}, {32, 1}), view(16, {35, 16}, {64, 1})), Overlap::kUnknown);
  // Different element sizes over one range: not decided.
  EXPECT_EQ(memory_overlap(view(0, {70, 16}, {32, 1}), 4, view(16, {70, 16}, {32, 1}), 8), Overlap::kUnknown);
  // Empty tensors share nothing, wherever they point.
  EXPECT_EQ(overlap(a, view(0, {1, 0, 2, 16}, {2240, 32, 16, 1})), Overlap::kDisjoint);
  // A stride-0 input (broadcast rows) against an output with the same strides elsewhere.
  EXPECT_EQ(overlap(view(0, {4, 8}, {0, 1}), view(8, {4, 8}, {0, 1})), Overlap::kDisjoint);
  EXPECT_EQ(overlap(view(0, {4, 8}, {0, 1}), view(7, {4, 8}, {0, 1})), Overlap::kIntersect);
}

TEST(MemoryLayout, SelfOverlap) {
  EXPECT_TRUE(non_self_overlapping(view(0, {1, 70, 2, 16}, {2240, 32, 16, 1})));
  EXPECT_TRUE(non_self_overlapping(view(0, {2, 16, 16}, {256, 1, 16})));  // transposed
  EXPECT_TRUE(non_self_overlapping(view(0, {5, 1, 16}, {16, 0, 1})));    // stride 0 on extent 1
  EXPECT_TRUE(non_self_overlapping(view(0, {0, 7}, {0, 0})));             // empty
  EXPECT_FALSE(non_self_overlapping(view(0, {5, 16}, {0, 1})));
  EXPECT_FALSE(non_self_overlapping(view(0, {5, 16}, {8, 1})));
  EXPECT_FALSE(non_self_overlapping(view(0, {2, 2, 4}, {4, 4, 1})));
}

// Random small layouts: every permutation of padded dense strides, random extents and offsets.
TEST(MemoryLayout, AgreesWithBruteForce) {
  std::mt19937_64 rng(20261124);
  auto pick = [&rng](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  int decided_same_strides = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const int nd = static_cast<int>(pick(1, 4));
    // A dense layout over padded extents, dimensions permuted, then sub-extents of it.
    std::vector<int64_t> full(static_cast<size_t>(nd)), order(static_cast<size_t>(nd));
    for (int d = 0; d < nd; ++d) {
      full[static_cast<size_t>(d)] = pick(1, 5);
      order[static_cast<size_t>(d)] = d;
    }
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int64_t> strides(static_cast<size_t>(nd));
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; --i) {
      const size_t d = static_cast<size_t>(order[static_cast<size_t>(i)]);
      strides[d] = pick(0, 4) == 0 ? 0 : s;  // now and then a broadcast dimension
      s *= full[d] + pick(0, 1);
    }
    std::vector<int64_t> sa(static_cast<size_t>(nd)), sb(static_cast<size_t>(nd));
    for (int d = 0; d < nd; ++d) {
      sa[static_cast<size_t>(d)] = pick(1, full[static_cast<size_t>(d)]);
      sb[static_cast<size_t>(d)] = pick(1, full[static_cast<size_t>(d)]);
    }
    const fgdn_tensor a = view(pick(0, 8), sa, strides);
    const bool same = pick(0, 3) != 0;
    std::vector<int64_t> strides_b = strides;
    if (!same) std::shuffle(strides_b.begin(), strides_b.end(), rng);
    const fgdn_tensor b = view(pick(0, 2 * s), sb, strides_b);

    const bool truth = intersect(a, b);
    const Overlap o = overlap(a, b);
    if (o == Overlap::kIntersect) {
      ASSERT_TRUE(truth) << "iteration " << iter;
    }
    if (o == Overlap::kDisjoint) {
      ASSERT_FALSE(truth) << "iteration " << iter;
    }
    if (same) {
      ASSERT_NE(o, Overlap::kUnknown) << "iteration " << iter;
      ++decided_same_strides;
    }

    const std::vector<int64_t> e = elements(a);
    const std::set<int64_t> distinct(e.begin(), e.end());
    if (non_self_overlapping(a)) {
      ASSERT_EQ(distinct.size(), e.size()) << "iteration " << iter;
    }
    bool broadcast = false;
    for (int d = 0; d < nd; ++d) broadcast |= strides[static_cast<size_t>(d)] == 0 && sa[static_cast<size_t>(d)] > 1;
    if (!broadcast) {  // a padded dense layout
      ASSERT_TRUE(non_self_overlapping(a)) << "iteration " << iter;
    }
  }
  EXPECT_GT(decided_same_strides, 10000);
}

}  // namespace
