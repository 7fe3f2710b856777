// Numerics of the call contract (issue 15):
//   - the host dtype conversions (common/dtype.h) against independent references, over every
//     float32 bit pattern for fp16, and fp16 results of the CPU backend element by element;
//   - g = -inf (a hard reset) and in-kernel gates that overflow or underflow in float32, on the
//     oracle, the CPU backend and the CUDA backend (the gate floor, common/numerics.h);
//   - q / k rows whose sum of squares overflows float32 with the in-kernel l2norm;
//   - how far a NaN or infinity in one input element reaches (docs/api.md, "Non-finite values").
// CUDA tests skip without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "cpu_check.h"
#include "cuda_check.h"
#include "flashgdn/flashgdn.hpp"
#include "gdn_reference.h"
#include "test_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FGDN_TEST_X86 1
#endif

namespace ft = flashgdn::test;
namespace ref = flashgdn::reference;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The same bits as another type of the same size (std::bit_cast of C++20).
template <class To, class From>
To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "sizes differ");
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}
uint32_t bits_of(float f) { return bit_cast<uint32_t>(f); }
float float_of(uint32_t u) { return bit_cast<float>(u); }

// Runs body(lo, hi) on disjoint parts of [0, n) on every hardware thread; returns the sum of
// what the calls return (a count of mismatches).
uint64_t parallel_count(uint64_t n, const std::function<uint64_t(uint64_t, uint64_t)>& body) {
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<uint64_t> total{0};
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < nt; ++w)
    pool.emplace_back([&, w] { total += body(n * w / nt, n * (w + 1) / nt); });
  for (auto& t : pool) t.join();
  return total;
}

// ---- independent references for float <-> fp16 ------------------------------------------------
// The x86 F16C instructions (the hardware conversion, round to nearest even); without them GCC's
// _Float16 (software, slow: the sweep is then reduced, see Fp16Conversion).

bool have_f16c() {
#if defined(FGDN_TEST_X86)
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

#if defined(FGDN_TEST_X86)
// out[0, 8) = fp16 of f[0, 8)
__attribute__((target("avx,f16c"))) void f16c_from_float8(const float* f, uint16_t* out) {
  const __m128i r =
      _mm256_cvtps_ph(_mm256_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), r);
}
__attribute__((target("f16c"))) float f16c_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Mismatches of flashgdn::float_to_fp16 against F16C on every bit pattern in [lo, hi) (both
// multiples of 8), the first few printed.
__attribute__((target("avx2,f16c"))) uint64_t f16c_sweep(uint64_t lo, uint64_t hi) {
  uint64_t bad = 0;
  __m256i u = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(lo))),
                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  alignas(32) float f[8];
  alignas(16) uint16_t want[8];
  for (uint64_t i = lo; i < hi; i += 8) {
    const __m256 x = _mm256_castsi256_ps(u);
    _mm_store_si128(reinterpret_cast<__m128i*>(want),
                    _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm256_store_ps(f, x);
    for (int j = 0; j < 8; ++j) {
      const uint16_t got = flashgdn::float_to_fp16(f[j]);
      if (got != want[j] && ++bad <= 5)
        std::printf("float_to_fp16(0x%08x) = 0x%04x, F16C 0x%04x\n",
                    static_cast<unsigned>(i + j), got, want[j]);
    }
    u = _mm256_add_epi32(u, _mm256_set1_epi32(8));
  }
  return bad;
}
#endif

#if defined(__FLT16_MAX__)
uint16_t soft_from_float(float f) { return bit_cast<uint16_t>(static_cast<_Float16>(f)); }
float soft_to_float(uint16_t u) { return static_cast<float>(bit_cast<_Float16>(u)); }
#endif

bool have_fp16_reference() {
#if defined(__FLT16_MAX__)
  return true;
#else
  return have_f16c();
#endif
}

// The reference conversion of f[0, n) (n <= 8) into out.
void ref_from_float(const float* f, int n, uint16_t* out) {
#if defined(FGDN_TEST_X86)
  if (have_f16c()) {
    float in[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    uint16_t r[8];
    std::copy(f, f + n, in);
    f16c_from_float8(in, r);
    std::copy(r, r + n, out);
    return;
  }
#endif
#if defined(__FLT16_MAX__)
  for (int i = 0; i < n; ++i) out[i] = soft_from_float(f[i]);
#else
  (void)f, (void)n, (void)out;
#endif
}

float ref_to_float(uint16_t h) {
#if defined(FGDN_TEST_X86)
  if (have_f16c()) return f16c_to_float(h);
#endif
#if defined(__FLT16_MAX__)
  return soft_to_float(h);
#else
  (void)h;
  return 0.f;
#endif
}

// The sign bit of an fp16 NaN, -1 for any other value.
int fp16_nan_sign(uint16_t h) { return (h & 0x7fffu) > 0x7c00u ? h >> 15 : -1; }

// Mismatches of flashgdn::float_to_fp16 against the reference on the bit patterns
// [lo, hi) step `step` (the first few printed).
uint64_t fp16_mismatches(uint64_t lo, uint64_t hi, uint64_t step) {
  uint64_t bad = 0;
  float f[8];
  uint16_t want[8];
  for (uint64_t i = lo; i < hi;) {
    int n = 0;
    for (; n < 8 && i < hi; ++n, i += step) f[n] = float_of(static_cast<uint32_t>(i));
    ref_from_float(f, n, want);
    for (int j = 0; j < n; ++j) {
      const uint16_t got = flashgdn::float_to_fp16(f[j]);
      if (got == want[j]) continue;
      // without F16C the reference may encode NaN otherwise: any NaN of the same sign
      const int sign = fp16_nan_sign(got);
      if (!have_f16c() && sign >= 0 && sign == fp16_nan_sign(want[j])) continue;
      if (++bad <= 5)
        std::printf("float_to_fp16(0x%08x) = 0x%04x, reference 0x%04x\n", bits_of(f[j]), got,
                    want[j]);
    }
  }
  return bad;
}

TEST(Fp16Conversion, FromFloatMatchesHardwareOnEveryFloat32) {
  if (!have_fp16_reference()) GTEST_SKIP() << "neither F16C nor _Float16 on this machine";
#if defined(FGDN_TEST_X86)
  if (have_f16c() && __builtin_cpu_supports("avx2")) {
    // all 2^32 bit patterns
    EXPECT_EQ(0u, parallel_count(uint64_t{1} << 29, [](uint64_t lo, uint64_t hi) {
                return f16c_sweep(8 * lo, 8 * hi);
              }));
    return;
  }
#endif
  // _Float16 (software on x86) is too slow for every pattern: every fp16 value of both signs
  // with the float32 neighbours of it and of the midpoint to the next one (the rounding
  // boundaries; 65520 for the largest, the overflow boundary), a dense sweep of [2^-40, 2^-13]
  // (every 7th pattern: underflow and subnormals) and a strided sweep of the rest.
  uint64_t bad = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    if ((h & 0x7c00u) == 0x7c00u) continue;  // inf, NaN
    const float a = flashgdn::fp16_to_float(static_cast<uint16_t>(h));
    const float b = (h & 0x7fffu) == 0x7bffu ? std::copysign(65536.f, a)
                                            : flashgdn::fp16_to_float(static_cast<uint16_t>(h + 1));
    for (const float c : {a, 0.5f * (a + b)})  // exact: fp16 values have 11 significant bits
      for (int d = -2; d <= 2; ++d) {
        const uint32_t u = bits_of(c) + static_cast<uint32_t>(d);
        bad += fp16_mismatches(u, uint64_t{u} + 1, 1);
      }
  }
  for (uint32_t sign : {0u, 0x80000000u})
    bad += fp16_mismatches(sign | 0x2b800000u, sign | 0x39000000u, 7);
  bad += fp16_mismatches(0, uint64_t{1} << 32, 997);
  EXPECT_EQ(0u, bad);
}

TEST(Fp16Conversion, ToFloatMatchesHardwareOnEveryHalf) {
  if (!have_fp16_reference()) GTEST_SKIP() << "neither F16C nor _Float16 on this machine";
  int bad = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float got = flashgdn::fp16_to_float(static_cast<uint16_t>(h));
    const float want = ref_to_float(static_cast<uint16_t>(h));
    // F16C returns a NaN quiet, payload kept; compare bits (NaN to NaN only without F16C)
    const bool same = have_f16c() || !std::isnan(want) ? bits_of(got) == bits_of(want)
                                                       : std::isnan(got);
    if (!same && ++bad <= 5)
      std::printf("fp16_to_float(0x%04x) = 0x%08x, reference 0x%08x\n", h, bits_of(got),
                  bits_of(want));
  }
  EXPECT_EQ(0, bad);
}

// Independent reference for float -> bf16: the two bf16 neighbours of f (truncation, and one
// step up in magnitude, inf above the largest) and the exact midpoint between them in double.
uint16_t bf16_reference(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
  if (lo == u) return static_cast<uint16_t>(u >> 16);
  const double d = std::fabs(static_cast<double>(f));
  const double dlo = std::fabs(static_cast<double>(float_of(lo)));
  // one step above the largest finite bf16 is 2^128: rounding there overflows to inf
  const double dhi = (hi & 0x7fffffffu) == 0x7f800000u
                         ? std::ldexp(1.0, 128)
                         : std::fabs(static_cast<double>(float_of(hi)));
  const double mid = 0.5 * (dlo + dhi);
  if (d < mid) return static_cast<uint16_t>(lo >> 16);
  if (d > mid) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);  // tie: even
}

// Every bf16 value (all 2^16 upper halves) with the lower halves around its rounding boundary
// (0, 1, half - 1, half, half + 1, max and a few between), then a strided sweep of all 2^32.
TEST(Bf16Conversion, FromFloatRoundsToNearestEven) {
  const uint32_t lows[] = {0x0000u, 0x0001u, 0x4000u, 0x7ffeu, 0x7fffu, 0x8000u,
                           0x8001u, 0x8002u, 0xc000u, 0xfffeu, 0xffffu};
  uint64_t bad = 0;
  auto check = [&](uint32_t u) {
    const float f = float_of(u);
    const uint16_t got = flashgdn::float_to_bf16(f), want = bf16_reference(f);
    if (got != want && ++bad <= 5)
      std::printf("float_to_bf16(0x%08x) = 0x%04x, reference 0x%04x\n", u, got, want);
  };
  for (uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (uint32_t lo : lows) check(hi << 16 | lo);
  for (uint64_t i = 0; i < (uint64_t{1} << 32); i += 331) check(static_cast<uint32_t>(i));
  EXPECT_EQ(0u, bad);
  // the round trip is exact
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = flashgdn::bf16_to_float(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(h, flashgdn::float_to_bf16(f));
    }
  }
}

// ---- fp16 outputs through the public API ----------------------------------------------------

// Every element of `got` (stored in dt) is the oracle's `want` up to the storage rounding and
// float32 arithmetic: |got - want| <= u |want| + 2^-25 (half the smallest fp16 subnormal, the
// absolute rounding below 2^-14; 0 for float32) + 1e-4 max |want|. Garbage in a single element
// fails this where a relative L2 bound over the tensor might not.
void expect_elementwise(const std::string& name, const std::vector<double>& got,
                        const std::vector<double>& want, fgdn_dtype dt) {
  ASSERT_EQ(got.size(), want.size()) << name;
  double wmax = 0.0;
  for (double w : want) wmax = std::max(wmax, std::fabs(w));
  const double u = dt == FGDN_FLOAT32 ? 0.0 : ft::unit_roundoff(dt);
  const double sub = dt == FGDN_FLOAT16 ? std::ldexp(1.0, -25) : 0.0;
  int64_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const double bound = u * std::fabs(want[i]) + sub + 1e-4 * wmax;
    if (!(err <= bound)) {
      if (++bad <= 5)
        ADD_FAILURE() << name << "[" << i << "] = " << got[i] << ", oracle " << want[i]
                      << " (bound " << bound << ")";
      worst = std::isnan(err) ? err : std::max(worst, err);
    }
  }
  EXPECT_EQ(0, bad) << name << ": elements off, worst absolute error " << worst;
}

// fp16 values between 2^-38 and 2^-32 came out as garbage (the conversion shifted a 32-bit value
// by 32 or more places): a forward with scale = 1e-9 gave -54688 and NaN where the answer is 0.
TEST(Fp16Outputs, TinyScaleForwardMatchesOracleElementwise) {
  ft::Spec s = ft::with_h0(ft::varlen("fp16_scale_1e-9", {0, 100, 230}, 1, 2, 64, 64,
                                      FGDN_FLOAT16));
  s.scale = 1e-9;
  ft::Case c(s);
  flashgdn::FwdArgs fa = c.fwd_args();
  ASSERT_NO_THROW(flashgdn::forward(fa));
  const ref::Outputs ro = ref::forward(c.rp, c.ri);
  expect_elementwise("o", c.o.to_double(), ro.o, FGDN_FLOAT16);
  expect_elementwise("ht", ft::state_dense(c.ht, s.N(), s.Hv, s.K, s.V, false), ro.ht,
                     FGDN_FLOAT32);
}

// Ordinary fp16 training inputs with the output gradient of a mean-reduced loss (d_o ~ 1e-6,
// at least the smallest fp16 subnormal): about 8% of the elements of dq, dk, dv (17k of 205k)
// fall between 2^-38 and 2^-32.
TEST(Fp16Outputs, BackwardMatchesOracleElementwise) {
  ft::Spec s = ft::with_states(ft::varlen("fp16_small_grads", {0, 130, 300, 400}, 2, 4, 64, 64,
                                          FGDN_FLOAT16));
  s.l2norm = true;
  ft::Case c(s);
  const double tiny = std::ldexp(1.0, -24);
  for (double& x : c.d_o) x = ft::round_to(std::copysign(std::max(std::fabs(x) * 1e-6, tiny), x),
                                           FGDN_FLOAT16);
  c.d_o_buf = c.padded(c.d_o, s.dt, s.Hv * s.V);
  for (double& x : c.d_ht) x = ft::round_to(x * 1e-6, FGDN_FLOAT32);
  c.d_ht_buf = ft::state_buffer(c.d_ht, s.N(), s.Hv, s.K, s.V, false);
  flashgdn::BwdArgs ba = c.bwd_args();
  ASSERT_NO_THROW(flashgdn::backward(ba));
  const ref::Grads rg = ref::backward(c.rp, c.ri, c.d_o, c.d_ht);
  expect_elementwise("dq", c.dq.to_double(), rg.dq, FGDN_FLOAT16);
  expect_elementwise("dk", c.dk.to_double(), rg.dk, FGDN_FLOAT16);
  expect_elementwise("dv", c.dv.to_double(), rg.dv, FGDN_FLOAT16);
  expect_elementwise("dg", c.dg.to_double(), rg.dg, FGDN_FLOAT32);
  expect_elementwise("dbeta", c.dbeta.to_double(), rg.dbeta, FGDN_FLOAT32);
  expect_elementwise("dh0", ft::state_dense(c.dh0, s.N(), s.Hv, s.K, s.V, false), rg.dh0,
                     FGDN_FLOAT32);
}

// ---- inputs set element by element ---------------------------------------------------------

// The inputs of a Case that the tests below overwrite.
enum class In { q, k, v, g, beta, h0, A_log };

const char* in_name(In x) {
  switch (x) {
    case In::q: return "q";
    case In::k: return "k";
    case In::v: return "v";
    case In::g: return "g";
    case In::beta: return "beta";
    case In::h0: return "initial_state";
    case In::A_log: return "A_log";
  }
  return "?";
}

// Sets element i (dense index) of input `which` of c to x: in the oracle's inputs (rounded to the
// dtype the library reads) and in the buffer the library reads. The case's tensors must be dense
// (no padded strides, no state pool, K-major states).
void set_input(ft::Case& c, In which, int64_t i, double x) {
  const ft::Spec& s = c.s;
  ASSERT_FALSE(s.strided || s.state_indices || s.v_first) << "set_input needs dense tensors";
  std::vector<double>* r = nullptr;
  ft::HostBuffer* b = nullptr;
  fgdn_dtype dt = s.dt;
  switch (which) {
    case In::q: r = &c.ri.q, b = &c.q; break;
    case In::k: r = &c.ri.k, b = &c.k; break;
    case In::v: r = &c.ri.v, b = &c.v; break;
    case In::g: r = &c.ri.g, b = &c.g, dt = s.g_dt; break;
    case In::beta: r = &c.ri.beta, b = &c.beta, dt = s.beta_dt; break;
    case In::h0: r = &c.ri.h0, b = &c.h0, dt = FGDN_FLOAT32; break;
    case In::A_log: r = &c.ri.A_log, b = &c.A_log, dt = FGDN_FLOAT32; break;
  }
  (*r)[static_cast<size_t>(i)] = ft::round_to(x, dt);
  flashgdn::store_float(b->data(), dt, i, static_cast<float>(x));
}

// Flat token index (b * T + t) of token t of sequence n.
int64_t flat_token(const ft::Spec& s, int64_t n, int64_t t) {
  return s.cu.empty() ? n * s.T + t : s.cu[static_cast<size_t>(n)] + t;
}
// Dense index of element d of (token, head) in q / k, in v / o, and of (token, head) in g / beta.
int64_t qk_index(const ft::Spec& s, int64_t tok, int64_t hq, int64_t d) {
  return (tok * s.Hq + hq) * s.K + d;
}
int64_t vo_index(const ft::Spec& s, int64_t tok, int64_t h, int64_t d) {
  return (tok * s.Hv + h) * s.V + d;
}
int64_t gate_index(const ft::Spec& s, int64_t tok, int64_t h) { return tok * s.Hv + h; }

// ---- g = -inf: a hard reset -----------------------------------------------------------------

ft::ErrorSummary& cpu_errors = ft::add_error_summary("Numerics (CPU)");
[[maybe_unused]] ft::ErrorSummary& cuda_errors = ft::add_error_summary("Numerics (CUDA)");

// The oracle itself: g = -inf at token r is exp(g) = 0, so the outputs from r on are those of
// the tokens [r, T) run alone from a zero state, the outputs before r those of [0, r) alone, and
// the gradients split the same way (the prefix's final state has no influence: its gradient is
// 0), with dg = 0 at r. Everything finite.
TEST(ReferenceReset, NegInfGateRestartsTheRecurrence) {
  const int64_t T = 40, r = 17, Hv = 2, K = 8, V = 8;
  ft::Rng rng(11);
  ref::Problem full;
  full.T = T, full.Hq = 1, full.Hv = Hv, full.K = K, full.V = V;
  full.use_qk_l2norm = true;
  full.has_initial_state = true;
  ref::Inputs in;
  in.q = rng.normals(T * K), in.k = rng.normals(T * K), in.v = rng.normals(T * Hv * V);
  in.g = rng.uniforms(T * Hv, -1.0, 0.0), in.beta = rng.uniforms(T * Hv, 0.0, 1.0);
  in.h0 = rng.normals(Hv * K * V);
  for (int64_t h = 0; h < Hv; ++h) in.g[static_cast<size_t>(r * Hv + h)] = -kInf;
  const std::vector<double> d_o = rng.normals(T * Hv * V), d_ht = rng.normals(Hv * K * V);

  // the token range [t0, t1) as a problem of its own (with h0 only from token 0)
  auto part = [&](int64_t t0, int64_t t1, ref::Problem& p, ref::Inputs& x) {
    p = full;
    p.T = t1 - t0;
    p.has_initial_state = t0 == 0;
    auto rows = [&](const std::vector<double>& a, int64_t w) {
      return std::vector<double>(a.begin() + t0 * w, a.begin() + t1 * w);
    };
    x.q = rows(in.q, K), x.k = rows(in.k, K), x.v = rows(in.v, Hv * V);
    x.g = rows(in.g, Hv), x.beta = rows(in.beta, Hv);
    if (t0 == 0) x.h0 = in.h0;
  };
  ref::Problem pp, ps;
  ref::Inputs ip, is;
  part(0, r, pp, ip);
  part(r, T, ps, is);
  auto cat = [](std::vector<double> a, const std::vector<double>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  auto expect_same = [](const char* what, const std::vector<double>& got,
                        const std::vector<double>& want) {
    EXPECT_TRUE(ft::all_finite(got)) << what;
    EXPECT_LE(ft::rel_l2(got, want), 1e-13) << what;
  };

  const ref::Outputs of = ref::forward(full, in), op = ref::forward(pp, ip),
                     os = ref::forward(ps, is);
  expect_same("o", of.o, cat(op.o, os.o));
  expect_same("final state", of.ht, os.ht);

  const ref::Grads gf = ref::backward(full, in, d_o, d_ht);
  const auto split = d_o.begin() + r * Hv * V;
  const ref::Grads gp = ref::backward(pp, ip, std::vector<double>(d_o.begin(), split), {});
  const ref::Grads gs = ref::backward(ps, is, std::vector<double>(split, d_o.end()), d_ht);
  expect_same("dq", gf.dq, cat(gp.dq, gs.dq));
  expect_same("dk", gf.dk, cat(gp.dk, gs.dk));
  expect_same("dv", gf.dv, cat(gp.dv, gs.dv));
  expect_same("dg", gf.dg, cat(gp.dg, gs.dg));
  expect_same("dbeta", gf.dbeta, cat(gp.dbeta, gs.dbeta));
  expect_same("dh0", gf.dh0, gp.dh0);
  for (int64_t h = 0; h < Hv; ++h) EXPECT_EQ(0.0, gf.dg[static_cast<size_t>(r * Hv + h)]);
}

// Tokens [t0, t1) of sequence n, value head h.
struct TokenRun {
  int64_t n, h, t0, t1;
};

// Three sequences (200, 60, 200 tokens), one q/k head read by two value heads; g = -inf at the
// first token (seq 0 head 0), mid-chunk and at the last token of a chunk (seq 0 head 1: 30, 63),
// twice in one chunk (seq 0 head 0: 100, 120), on every token of a partial chunk (seq 1 head 1:
// all 60), on every token of a full chunk (seq 2 head 0: 64..127) and at the last token of a
// sequence (seq 2 head 1: 199).
const TokenRun kResets[] = {{0, 0, 0, 1},     {0, 1, 30, 31},  {0, 1, 63, 64},
                            {0, 0, 100, 101}, {0, 0, 120, 121}, {1, 1, 0, 60},
                            {2, 0, 64, 128},  {2, 1, 199, 200}};

ft::Spec reset_spec(const std::string& name, int64_t D, fgdn_dtype dt, bool states) {
  ft::Spec s = ft::varlen(name, {0, 200, 260, 460}, 1, 2, D, D, dt);
  s.h0 = s.dht = states;
  s.checkpoint_every = 64;
  return s;
}

// Sets a (the gate's raw activation) so that a + dt_bias = x at the tokens of run.
void set_activation(ft::Case& c, const TokenRun& run, double x) {
  const double bias = c.ri.dt_bias.empty() ? 0.0 : c.ri.dt_bias[static_cast<size_t>(run.h)];
  for (int64_t t = run.t0; t < run.t1; ++t)
    set_input(c, In::g, gate_index(c.s, flat_token(c.s, run.n, t), run.h), x - bias);
}

// A case with the resets of kResets (dense g), or (gate_in_kernel) with float32 overflow and
// underflow of the in-kernel gate: head 0 has A_log = 100 (exp(A_log) = inf in float32, so
// g = -inf, a reset, on every token) except where a + dt_bias = -200 (g = -exp(-100), no
// decay); head 1 has an ordinary A_log with a + dt_bias = +200 (g = -200 exp(A_log): below the
// floor or nearly) and -200 (softplus = 0 in float32: g = 0) at a few tokens.
ft::Case reset_case(const ft::Spec& s) {
  ft::Case c(s);
  if (!s.gate_in_kernel) {
    for (const TokenRun& r : kResets)
      for (int64_t t = r.t0; t < r.t1; ++t)
        set_input(c, In::g, gate_index(s, flat_token(s, r.n, t), r.h), -kInf);
    return c;
  }
  set_input(c, In::A_log, 0, 100.0);
  for (const TokenRun& r : {TokenRun{0, 0, 10, 41}, TokenRun{2, 0, 150, 200}})
    set_activation(c, r, -200.0);
  for (const TokenRun& r : {TokenRun{0, 1, 5, 6}, TokenRun{0, 1, 70, 72}, TokenRun{1, 1, 59, 60}})
    set_activation(c, r, 200.0);
  for (const TokenRun& r : {TokenRun{0, 1, 6, 7}, TokenRun{2, 1, 80, 82}})
    set_activation(c, r, -200.0);
  return c;
}

std::vector<ft::Spec> reset_specs(int64_t D, fgdn_dtype dt) {
  const std::string d = std::string(flashgdn::dtype_name(dt)) + "_D" + std::to_string(D);
  std::vector<ft::Spec> v = {reset_spec("neg_inf_g_" + d, D, dt, true),
                             reset_spec("neg_inf_g_no_state_" + d, D, dt, false)};
  ft::Spec s = reset_spec("neg_inf_bf16_g_" + d, D, dt, true);
  s.g_dt = FGDN_BFLOAT16;
  v.push_back(s);
  s = reset_spec("gate_in_kernel_extremes_" + d, D, dt, true);
  s.gate_in_kernel = true;
  s.l2norm = true;
  v.push_back(s);
  s.name = "gate_in_kernel_extremes_no_dt_bias_" + d;
  s.dt_bias = false;
  s.h0 = s.dht = false;
  v.push_back(s);
  return v;
}

TEST(GateReset, CpuMatchesOracle) {
  for (const fgdn_dtype dt : {FGDN_FLOAT32, FGDN_BFLOAT16})
    for (const ft::Spec& s : reset_specs(32, dt)) {
      SCOPED_TRACE(s.name);
      ft::Case c = reset_case(s);
      ft::expect_cpu_matches_oracle(c, cpu_errors);
    }
}

TEST(GateReset, CudaMatchesOracle) {
  if (!ft::have_cuda_device()) GTEST_SKIP() << "no CUDA device";
#if defined(FLASHGDN_WITH_CUDA)
  for (const ft::Spec& s : reset_specs(64, FGDN_BFLOAT16)) {
    SCOPED_TRACE(s.name);
    ft::Case c = reset_case(s);
    ft::expect_cuda_forward_matches_oracle(c, cuda_errors);
    ft::expect_cuda_backward_matches_oracle(c, cuda_errors);
    // `high` (split products) holds dA_log and ddt_bias to the plain relative bound even where
    // their terms cancel 600-fold (gate_in_kernel_extremes_no_dt_bias).
    ft::Spec sh = s;
    sh.precision = FGDN_PRECISION_HIGH;
    sh.name += "_high";
    ft::Case ch = reset_case(sh);
    ft::expect_cuda_backward_matches_oracle(ch, cuda_errors);
  }
#endif
}

// ---- q / k rows whose sum of squares overflows float32 (use_qk_l2norm_in_kernel) --------------

// Row (flat token tok, q/k head hq) of q or k, scaled to the given norm.
struct HugeRow {
  In which;
  int64_t tok, hq;
  double norm;
};

// Two sequences of 150 tokens, Hq = 2, Hv = 4. With several huge rows in one chunk (CPU): keys
// of norm 1e19 (sum of squares 1e38, still finite), 3e19 (9e38: overflows) and 1e30, two
// huge keys in one chunk, a huge query and a huge key on the same token, queries of all three
// norms, a huge key on the last token.
const HugeRow kHugeRowsDense[] = {
    {In::k, 3, 0, 1e19},  {In::k, 5, 1, 3e19},    {In::k, 70, 0, 1e30},  {In::k, 71, 0, 1e30},
    {In::q, 71, 0, 1e30}, {In::q, 160, 1, 3e19}, {In::q, 200, 0, 1e19}, {In::k, 299, 1, 1e30}};
// One huge row per chunk and no huge query after a huge key of its chunk (CUDA: its forward
// forms the raw Gram products k_i . k_j and q_i . k_j in float32 before scaling them, which
// overflows for two rows of norm 1e30 in one chunk; the l2norm factors are what is tested).
const HugeRow kHugeRowsSparse[] = {{In::k, 10, 0, 1e30},
                                   {In::q, 70, 0, 1e30},
                                   {In::k, 140, 1, 3e19},
                                   {In::q, 200, 1, 3e19},
                                   {In::k, 260, 0, 1e19}};

template <size_t R>
ft::Case huge_row_case(const ft::Spec& s, const HugeRow (&rows)[R]) {
  ft::Case c(s);
  for (const HugeRow& r : rows) {
    const std::vector<double>& x = r.which == In::q ? c.ri.q : c.ri.k;
    const int64_t i0 = qk_index(s, r.tok, r.hq, 0);
    const std::vector<double> row = ft::slice(x, i0 / s.K, s.K);
    double nrm = 0.0;
    for (double e : row) nrm += e * e;
    const double f = r.norm / std::sqrt(nrm);
    for (int64_t d = 0; d < s.K; ++d)
      set_input(c, r.which, i0 + d, row[static_cast<size_t>(d)] * f);
  }
  return c;
}

// The gradient rows of the huge q / k rows are ~1 / norm: invisible in a relative error over the
// whole tensor, so each is checked on its own (relative L2 over the row).
template <size_t R>
void expect_huge_row_grads(const ft::Case& c, const HugeRow (&rows)[R], const ref::Grads& rg,
                           double tol) {
  const std::vector<double> dq = c.dq.to_double(), dk = c.dk.to_double();
  for (const HugeRow& r : rows) {
    const int64_t i0 = qk_index(c.s, r.tok, r.hq, 0);
    const bool is_q = r.which == In::q;
    const std::vector<double> got = ft::slice(is_q ? dq : dk, i0 / c.s.K, c.s.K);
    const std::vector<double> want = ft::slice(is_q ? rg.dq : rg.dk, i0 / c.s.K, c.s.K);
    EXPECT_LE(ft::rel_l2(got, want), tol)
        << c.s.name << ": d" << in_name(r.which) << " of the row of norm " << r.norm
        << " at token " << r.tok << " head " << r.hq;
  }
}

ft::Spec huge_row_spec(const std::string& name, int64_t D, fgdn_dtype dt) {
  ft::Spec s = ft::with_states(ft::varlen(name, {0, 150, 300}, 2, 4, D, D, dt));
  s.l2norm = true;
  return s;
}

TEST(L2NormHugeRows, CpuMatchesOracle) {
  for (const fgdn_dtype dt : {FGDN_FLOAT32, FGDN_BFLOAT16}) {
    const ft::Spec s = huge_row_spec(std::string("huge_rows_") + flashgdn::dtype_name(dt), 32, dt);
    SCOPED_TRACE(s.name);
    ft::Case c = huge_row_case(s, kHugeRowsDense);
    ft::expect_cpu_matches_oracle(c, cpu_errors);
    const ref::Grads rg = ref::backward(c.rp, c.ri, c.d_o, c.d_ht);
    const double u = dt == FGDN_FLOAT32 ? 0.0 : ft::unit_roundoff(dt);
    expect_huge_row_grads(c, kHugeRowsDense, rg, 1e-4 + u);
  }
}

TEST(L2NormHugeRows, CudaMatchesOracle) {
  if (!ft::have_cuda_device()) GTEST_SKIP() << "no CUDA device";
#if defined(FLASHGDN_WITH_CUDA)
  const ft::Spec s = huge_row_spec("huge_rows_bf16_D64", 64, FGDN_BFLOAT16);
  ft::Case c = huge_row_case(s, kHugeRowsSparse);
  ft::expect_cuda_forward_matches_oracle(c, cuda_errors);
  ft::expect_cuda_backward_matches_oracle(c, cuda_errors);
  const ref::Grads rg = ref::backward(c.rp, c.ri, c.d_o, c.d_ht);
  expect_huge_row_grads(c, kHugeRowsSparse, rg, ft::kCudaBwdTolSlice);
#endif
}

// ---- how far a non-finite input reaches (docs/api.md, "Non-finite values") --------------------

// One element of one input set to a non-finite value: token t of sequence n, value head h for v,
// g, beta and the initial state, q/k head h for q and k; element d of the row (or of the state).
struct Poison {
  In which;
  int64_t n, t, h, d;
  double value;
};

// Every output of one forward and one backward, as stored (bitwise comparable).
enum Out { kO, kHt, kCk, kDq, kDk, kDv, kDg, kDbeta, kDh0, kDALog, kDdtBias, kOuts };
const char* const kOutNames[kOuts] = {"o",  "final_state", "checkpoints", "dq",     "dk",      "dv",
                                      "dg", "dbeta",       "dh0",         "dA_log", "ddt_bias"};
using Outputs = std::vector<ft::HostBuffer>;

void run_all(ft::Case& c, bool cuda, Outputs& out) {
  flashgdn::FwdArgs fa = c.fwd_args();
  if (cuda) {
#if defined(FLASHGDN_WITH_CUDA)
    ASSERT_NO_FATAL_FAILURE(ft::run_forward_on_device(c, fa));
    ASSERT_NO_FATAL_FAILURE(ft::run_backward_on_device(c));
#endif
  } else {
    ASSERT_NO_THROW(flashgdn::forward(fa));
    flashgdn::BwdArgs ba = c.bwd_args();
    ASSERT_NO_THROW(flashgdn::backward(ba));
  }
  out = {c.o, c.ht, c.ck, c.dq, c.dk, c.dv, c.dg, c.dbeta, c.dh0, c.dA_log, c.ddt_bias};
}

// Where element i of output `which` belongs: its sequence n and token t in it (-1 for states and
// per-head tensors), its head (q/k head for dq, dk; value head otherwise) and, for checkpoints,
// the number of tokens the state comes after.
struct Place {
  int64_t n = -1, t = -1, head = -1, after = -1;
};
Place place_of(const ft::Spec& s, Out which, int64_t i) {
  Place p;
  int64_t tok = -1;
  const int64_t HKV = s.Hv * s.K * s.V;
  switch (which) {
    case kO: case kDv: tok = i / (s.Hv * s.V), p.head = (i / s.V) % s.Hv; break;
    case kDq: case kDk: tok = i / (s.Hq * s.K), p.head = (i / s.K) % s.Hq; break;
    case kDg: case kDbeta: tok = i / s.Hv, p.head = i % s.Hv; break;
    case kHt: case kDh0: p.n = i / HKV, p.head = (i / (s.K * s.V)) % s.Hv; break;
    case kCk: {
      int64_t row = i / HKV;
      p.head = (i / (s.K * s.V)) % s.Hv;
      for (p.n = 0; row >= s.seq_len(p.n) / s.checkpoint_every; ++p.n)
        row -= s.seq_len(p.n) / s.checkpoint_every;
      p.after = (row + 1) * s.checkpoint_every;
      break;
    }
    default: p.head = i; break;
  }
  if (tok >= 0) {
    for (p.n = 0; tok >= flat_token(s, p.n, s.seq_len(p.n)); ++p.n) {}
    p.t = tok - flat_token(s, p.n, 0);
  }
  return p;
}

// The documented reach (docs/api.md, "Non-finite values") of a non-finite input element at
// token t of sequence n, for value head h (v, g, beta, initial state) or for every value head
// of the group of q/k head h (q, k):
//   forward: o at token t only (q); o from the first token of t's 64-token chunk (counted from
//     the sequence's start) to the end of the sequence, the final state and the checkpoints after
//     t (k, v, g, beta); o at every token, the final state, every checkpoint (initial state);
//   backward: every gradient of sequence n for those value heads (dv, dg, dbeta, dh0) and for
//     their q/k head (dq, dk), at any token, and dA_log, ddt_bias of those value heads.
// Nothing of another sequence, and nothing of another head.
bool may_reach(const ft::Spec& s, const Poison& p, Out which, const Place& at) {
  const int64_t group = s.Hv / s.Hq;
  const bool qk = p.which == In::q || p.which == In::k;
  const int64_t hq = qk ? p.h : p.h / group;
  const bool value_head = qk ? at.head / group == hq : at.head == p.h;
  if (which == kDALog || which == kDdtBias) return value_head;
  if (at.n != p.n) return false;
  if (which == kDq || which == kDk) return at.head == hq;
  if (!value_head) return false;
  const int64_t chunk_start = p.t / 64 * 64;
  switch (which) {
    case kO:
      if (p.which == In::q) return at.t == p.t;
      return p.which == In::h0 || at.t >= chunk_start;
    case kHt: return p.which != In::q;
    case kCk: return p.which != In::q && (p.which == In::h0 || at.after > p.t);
    default: return true;  // backward
  }
}

// Sets the poison in c.
void put_poison(ft::Case& c, const Poison& p) {
  const ft::Spec& s = c.s;
  const int64_t tok = flat_token(s, p.n, p.t);
  switch (p.which) {
    case In::q: case In::k: set_input(c, p.which, qk_index(s, tok, p.h, p.d), p.value); break;
    case In::v: set_input(c, p.which, vo_index(s, tok, p.h, p.d), p.value); break;
    case In::g: case In::beta: set_input(c, p.which, gate_index(s, tok, p.h), p.value); break;
    case In::h0: set_input(c, p.which, (p.n * s.Hv + p.h) * s.K * s.V + p.d, p.value); break;
    case In::A_log: break;
  }
}

bool same_element(const ft::HostBuffer& a, const ft::HostBuffer& b, int64_t i) {
  const size_t es = flashgdn::dtype_size(a.dtype);
  return std::memcmp(a.bytes.data() + i * es, b.bytes.data() + i * es, es) == 0;
}

// Three sequences (150, 150, 100 tokens), Hq = 2, Hv = 4, initial states, final-state
// gradients and checkpoints every 64 tokens; with the in-kernel l2norm and gate as asked.
ft::Spec poison_spec(int64_t D, fgdn_dtype dt, bool l2norm, bool gate_in_kernel) {
  ft::Spec s = ft::with_states(ft::varlen(std::string("poison") + (l2norm ? "_l2norm" : "") +
                                              (gate_in_kernel ? "_gate_in_kernel" : ""),
                                          {0, 150, 300, 400}, 2, 4, D, D, dt));
  s.checkpoint_every = 64;
  s.l2norm = l2norm;
  s.gate_in_kernel = gate_in_kernel;
  return s;
}

// NaN, +inf and -inf in one element of q, k (q/k head 1: value heads 2, 3), v, g, beta, the
// initial state (value head 1), at token 80 of sequence 1 (its second chunk): every output
// outside the documented reach is finite and bitwise the run without the poison, and the poison
// does reach o. A gate of -inf (or an in-kernel activation of +-inf) is no poison but a reset
// (or no decay): every output stays finite.
void check_poison_reach(const ft::Spec& s, bool cuda, bool exact) {
  ft::Case clean_case(s);
  Outputs clean;
  ASSERT_NO_FATAL_FAILURE(run_all(clean_case, cuda, clean));
  for (int o = 0; o < kOuts; ++o)
    ASSERT_TRUE(ft::all_finite(clean[o].to_double())) << s.name << ": " << kOutNames[o];
  const bool verbose = std::getenv("FLASHGDN_TEST_VERBOSE") != nullptr;
  for (const In which : {In::q, In::k, In::v, In::g, In::beta, In::h0}) {
    for (const double value : {kNaN, kInf, -kInf}) {
      const bool reset = which == In::g && (s.gate_in_kernel ? std::isinf(value) : value < 0.0);
      const Poison p{which, 1, 80, 1, 3, value};
      const std::string what = std::string(in_name(which)) + " = " + std::to_string(value);
      SCOPED_TRACE(s.name + ": " + what);
      ft::Case c(s);
      put_poison(c, p);
      Outputs got;
      ASSERT_NO_FATAL_FAILURE(run_all(c, cuda, got));
      if (reset) {
        for (int o = 0; o < kOuts; ++o)
          EXPECT_TRUE(ft::all_finite(got[o].to_double())) << kOutNames[o] << " not finite";
        continue;
      }
      for (int o = 0; o < kOuts; ++o) {
        const Out out = static_cast<Out>(o);
        // reached: the tokens (or rows) that differ from the clean run, per head
        std::map<int64_t, std::pair<int64_t, int64_t>> reached;
        int64_t outside = 0;
        for (int64_t i = 0; i < got[o].n; ++i) {
          if (same_element(got[o], clean[o], i)) continue;
          const Place at = place_of(s, out, i);
          auto& r = reached.emplace(at.head, std::make_pair(INT64_MAX, INT64_MIN)).first->second;
          const int64_t key = at.t >= 0 ? at.t : at.after;
          r.first = std::min(r.first, key), r.second = std::max(r.second, key);
          if (!may_reach(s, p, out, at) && ++outside <= 3)
            ADD_FAILURE() << kOutNames[o] << " element " << i << " (sequence " << at.n
                          << ", token " << at.t << ", head " << at.head
                          << ") is outside the documented reach: " << got[o].to_double()[i]
                          << " instead of " << clean[o].to_double()[i];
        }
        EXPECT_EQ(0, outside) << kOutNames[o] << ": elements outside the documented reach changed";
        if (verbose)
          for (const auto& [head, r] : reached)
            std::printf("  %-32s %-14s %-11s head %lld: from %lld to %lld\n", s.name.c_str(),
                        what.c_str(), kOutNames[o], static_cast<long long>(head),
                        static_cast<long long>(r.first), static_cast<long long>(r.second));
      }
      // The poison is there: o is not finite at token t (q) or at the first and the last token
      // of the documented reach (k, v, g, beta: from t's chunk on; initial state: every token)
      // of a value head it reaches; with `exact` (the CPU backend) at both ends.
      const int64_t h = (which == In::q || which == In::k) ? p.h * (s.Hv / s.Hq) : p.h;
      const int64_t first = which == In::q ? p.t : which == In::h0 ? 0 : p.t / 64 * 64;
      const int64_t last = which == In::q ? p.t : s.seq_len(p.n) - 1;
      const std::vector<double> o = got[kO].to_double();
      const std::vector<int64_t> ends = exact ? std::vector<int64_t>{first, last}
                                              : std::vector<int64_t>{p.t};
      for (const int64_t t : ends) {
        const int64_t i0 = vo_index(s, flat_token(s, p.n, t), h, 0);
        bool hit = false;
        for (int64_t d = 0; d < s.V; ++d)
          hit = hit || !std::isfinite(o[static_cast<size_t>(i0 + d)]);
        EXPECT_TRUE(hit) << "o at token " << t << " of head " << h << " is finite";
      }
    }
  }
}

TEST(NonFiniteReach, CpuStaysInItsSequenceAndHead) {
  for (const bool l2norm : {false, true})
    check_poison_reach(poison_spec(16, FGDN_FLOAT32, l2norm, false), false, true);
  check_poison_reach(poison_spec(16, FGDN_BFLOAT16, true, true), false, true);
}

TEST(NonFiniteReach, CudaStaysInItsSequenceAndHead) {
  if (!ft::have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  for (const bool l2norm : {false, true})
    check_poison_reach(poison_spec(64, FGDN_BFLOAT16, l2norm, false), true, false);
  check_poison_reach(poison_spec(64, FGDN_BFLOAT16, true, true), true, false);
}

}  // namespace
