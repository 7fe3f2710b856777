// Host-side scalar conversions between the storage dtypes and float.
#pragma once

#include <cstdint>
#include <cstring>

#include "flashgdn/flashgdn.h"

namespace flashgdn {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even (overflow to signed inf, gradual underflow); NaN to a quiet NaN
// keeping the payload's top bits.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Exact (every fp16 value is a float); a NaN comes back quiet with its payload, as x86 F16C
// converts it.
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ffu;
      u = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13) | (man != 0 ? 0x400000u : 0u);  // inf, or a quiet NaN
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even, as the hardware conversions do (x86 F16C, CUDA
// __float2half_rn): overflow (|f| >= 65520) to signed inf, gradual underflow to subnormals,
// |f| <= 2^-25 to signed zero; NaN to a quiet NaN keeping the payload's top bits (as F16C).
inline uint16_t float_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u)  // NaN: quiet bit set, payload truncated
    return static_cast<uint16_t>(sign | 0x7e00u | ((au >> 13) & 0x3ffu));
  if (au >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (au >= 0x38800000u) {  // normal result (>= 2^-14): rebias the exponent 127 -> 15, round
    uint32_t r = au - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);  // ties to even; a carry into the exponent is right
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  // Below 2^-14 the result is the integer round(|f| 2^24) (subnormal mantissa; 0x400, the
  // smallest normal, when it rounds up). |f| <= 2^-25 (half the smallest subnormal, a tie that
  // goes to the even 0) gives zero.
  if (au <= 0x33000000u) return sign;
  // |f| = man 2^(e - 150) with e in [102, 112]: |f| 2^24 = man >> (126 - e), shift in [14, 24]
  const uint32_t man = (au & 0x7fffffu) | 0x800000u;
  const int shift = 126 - static_cast<int>(au >> 23);
  uint32_t r = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

inline float load_float(const void* base, fgdn_dtype dt, int64_t i) {
  switch (dt) {
    case FGDN_FLOAT32: return static_cast<const float*>(base)[i];
    case FGDN_BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case FGDN_FLOAT16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case FGDN_INT32: return static_cast<float>(static_cast<const int32_t*>(base)[i]);
    case FGDN_INT64: return static_cast<float>(static_cast<const int64_t*>(base)[i]);
  }
  return 0.f;
}

inline void store_float(void* base, fgdn_dtype dt, int64_t i, float x) {
  switch (dt) {
    case FGDN_FLOAT32: static_cast<float*>(base)[i] = x; break;
    case FGDN_BFLOAT16: static_cast<uint16_t*>(base)[i] = float_to_bf16(x); break;
    case FGDN_FLOAT16: static_cast<uint16_t*>(base)[i] = float_to_fp16(x); break;
    default: break;
  }
}

inline int64_t load_index(const void* base, fgdn_dtype dt, int64_t i) {
  return dt == FGDN_INT32 ? static_cast<int64_t>(static_cast<const int32_t*>(base)[i])
                          : static_cast<const int64_t*>(base)[i];
}

inline size_t dtype_size(int32_t dt) {
  switch (dt) {
    case FGDN_FLOAT32: case FGDN_INT32: return 4;
    case FGDN_FLOAT16: case FGDN_BFLOAT16: return 2;
    case FGDN_INT64: return 8;
  }
  return 0;
}

inline const char* dtype_name(int32_t dt) {
  switch (dt) {
    case FGDN_FLOAT32: return "float32";
    case FGDN_FLOAT16: return "float16";
    case FGDN_BFLOAT16: return "bfloat16";
    case FGDN_INT32: return "int32";
    case FGDN_INT64: return "int64";
  }
  return "unknown";
}

}  // namespace flashgdn
