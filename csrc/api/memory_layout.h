// The memory a strided tensor addresses, and whether two tensors (or two elements of one)
// share any of it. Header-only so that the tests can exercise the exact overlap test directly.
//
// Every function here takes tensors that validation has already checked for rank (1..4),
// non-negative extents and non-negative strides, and whose byte range fits in int64
// (tensor_bytes succeeded).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/checked.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn {

// True when some extent is 0: nothing is addressed.
inline bool tensor_empty(const fgdn_tensor& t) {
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] == 0) return true;
  return false;
}

// Elements of t (false when the count overflows int64: a read-only input may, e.g. a pool of
// 2^62 rows with stride 0; what a call addresses is its byte range).
inline bool tensor_numel(const fgdn_tensor& t, int64_t* out) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d)
    if (!checked_mul(n, t.shape[d], &n)) return false;
  *out = n;
  return true;
}

// Bytes from t.data to one past its last addressed element, 1 + sum (shape - 1) * stride
// elements; 0 for a tensor with no elements. False when that overflows int64.
inline bool tensor_bytes(const fgdn_tensor& t, size_t elem_size, int64_t* out) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) {
      *out = 0;
      return true;
    }
    int64_t step = 0;
    if (!checked_mul(t.shape[d] - 1, t.strides[d], &step) || !checked_add(last, step, &last))
      return false;
  }
  int64_t bytes = 0;
  if (!checked_add(last, 1, &last) || !checked_mul(last, static_cast<int64_t>(elem_size), &bytes))
    return false;
  *out = bytes;
  return true;
}

// True when no two index tuples of t address the same element. The test: order the dimensions
// of extent > 1 by stride; each stride must exceed the reach of the smaller ones,
// sum (shape - 1) * stride. That holds for every slice, permutation or expansion-free view of
// a dense tensor (so for every layout torch gives an output); it refuses a stride 0 on an
// extent > 1 and two dimensions with one stride, and a few exotic interleavings that happen
// not to collide (strides {3, 4} on extents {3, 2}), which no caller needs for an output.
inline bool non_self_overlapping(const fgdn_tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, extent)
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return true;
    if (t.shape[d] > 1) dims.emplace_back(t.strides[d], t.shape[d]);
  }
  std::sort(dims.begin(), dims.end());
  __int128 reach = 0;  // largest offset the smaller dimensions reach
  for (const auto& [stride, extent] : dims) {
    if (stride <= reach) return false;
    reach += static_cast<__int128>(extent - 1) * stride;
  }
  return true;
}

enum class Overlap {
  kDisjoint,   // no byte of one is a byte of the other
  kIntersect,  // some element of one shares memory with the other
  kUnknown,    // the ranges interleave and the exact test does not apply (refuse)
};

namespace detail {

inline __int128 floor_div(__int128 a, __int128 b) {  // b > 0
  __int128 q = a / b;
  if ((a % b != 0) && (a < 0)) --q;
  return q;
}
inline __int128 ceil_div128(__int128 a, __int128 b) { return -floor_div(-a, b); }

// Is there k with k_d in [lo_d, hi_d] and sum k_d s_d == target? Dimensions in decreasing
// stride order; rest_lo/rest_hi[d] bound what dimensions d.. can still add. Each level tries
// only the k_d that leave a reachable remainder: with non-self-overlapping layouts that is at
// most two values, so the search stays tiny; budget caps pathological inputs (kUnknown).
struct Digits {
  std::vector<__int128> s, lo, hi, rest_lo, rest_hi;
  int64_t budget = 4096;

  // 1: found, 0: none, -1: budget exhausted.
  int search(size_t d, __int128 target) {
    if (--budget < 0) return -1;
    if (d == s.size()) return target == 0 ? 1 : 0;
    if (target < rest_lo[d] || target > rest_hi[d]) return 0;
    const __int128 nlo = d + 1 < s.size() ? rest_lo[d + 1] : 0;
    const __int128 nhi = d + 1 < s.size() ? rest_hi[d + 1] : 0;
    const __int128 kmin = std::max(lo[d], ceil_div128(target - nhi, s[d]));
    const __int128 kmax = std::min(hi[d], floor_div(target - nlo, s[d]));
    for (__int128 k = kmax; k >= kmin; --k) {
      const int r = search(d + 1, target - k * s[d]);
      if (r != 0) return r;
    }
    return 0;
  }
};

}  // namespace detail

// Whether tensors a and b (element sizes ea, eb) share memory. Address ranges first; when the
// ranges interleave and both are views with one element size and the same strides (two slices
// of one buffer: dq = buf[..., :64], dk = buf[..., 64:]; alternate rows), an exact test:
// elements a[i] and b[j] coincide iff sum (i_d - j_d) s_d == (b.data - a.data) / e, solved
// digit by digit from the largest stride. Anything else that interleaves is kUnknown.
inline Overlap memory_overlap(const fgdn_tensor& a, size_t ea, const fgdn_tensor& b, size_t eb) {
  if (tensor_empty(a) || tensor_empty(b)) return Overlap::kDisjoint;
  int64_t ba = 0, bb = 0;
  if (!tensor_bytes(a, ea, &ba) || !tensor_bytes(b, eb, &bb)) return Overlap::kUnknown;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  const uintptr_t a1 = a0 + static_cast<uintptr_t>(ba), b1 = b0 + static_cast<uintptr_t>(bb);
  if (a1 <= b0 || b1 <= a0) return Overlap::kDisjoint;

  if (ea != eb || a.ndim != b.ndim) return Overlap::kUnknown;
  const __int128 diff = static_cast<__int128>(b0) - static_cast<__int128>(a0);
  if (diff % static_cast<__int128>(ea) != 0) return Overlap::kUnknown;
  struct D {
    int64_t s, ext_a, ext_b;
  };
  std::vector<D> dims;
  for (int d = 0; d < a.ndim; ++d) {
    if (a.shape[d] == 1 && b.shape[d] == 1) continue;  // k_d = 0 whatever the stride
    if (a.strides[d] != b.strides[d]) return Overlap::kUnknown;
    if (a.strides[d] == 0) continue;  // adds nothing: any k_d
    dims.push_back({a.strides[d], a.shape[d], b.shape[d]});
  }
  std::sort(dims.begin(), dims.end(), [](const D& x, const D& y) { return x.s > y.s; });
  detail::Digits g;
  for (const D& d : dims) {
    g.s.push_back(d.s);
    g.lo.push_back(-static_cast<__int128>(d.ext_b - 1));  // k_d = i_d - j_d
    g.hi.push_back(static_cast<__int128>(d.ext_a - 1));
  }
  const size_t n = dims.size();
  g.rest_lo.assign(n, 0);
  g.rest_hi.assign(n, 0);
  for (size_t i = n; i-- > 0;) {
    g.rest_lo[i] = g.lo[i] * g.s[i] + (i + 1 < n ? g.rest_lo[i + 1] : 0);
    g.rest_hi[i] = g.hi[i] * g.s[i] + (i + 1 < n ? g.rest_hi[i + 1] : 0);
  }
  const int r = g.search(0, diff / static_cast<__int128>(ea));
  if (r < 0) return Overlap::kUnknown;
  return r > 0 ? Overlap::kIntersect : Overlap::kDisjoint;
}

}  // namespace flashgdn
