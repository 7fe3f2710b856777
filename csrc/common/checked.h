// Overflow-checked int64 arithmetic for the sizes validation derives from caller-given extents
// and strides: every product and sum that could wrap goes through these, so a hostile extent
// (T = 2^62, a stride-0 dimension of 2^59 elements) is refused instead of wrapping into a small
// number that a backend then trusts.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace flashgdn {

// *out = a * b; false (and *out unspecified) when the product does not fit in int64.
inline bool checked_mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
inline bool checked_add(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

// The product of factors, or false when any partial product overflows.
inline bool checked_product(std::initializer_list<int64_t> factors, int64_t* out) {
  int64_t p = 1;
  for (int64_t f : factors)
    if (!checked_mul(p, f, &p)) return false;
  *out = p;
  return true;
}

}  // namespace flashgdn
