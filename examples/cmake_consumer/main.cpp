// A consumer of the installed C++ package: one small forward on the CPU backend through the C++
// API, checked against the recurrence's first step, one call the library refuses, and the
// version that find_package, the headers and the loaded library each report. Exit code 0 when
// every check holds.
#include <flashgdn/flashgdn.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

int fail(const char* what) {
  std::fprintf(stderr, "flashgdn_consumer: FAILED: %s\n", what);
  return 1;
}

}  // namespace

int main() {
  const std::string lib = fgdn_version();
  std::printf("flashgdn_consumer: package %s, headers %s, library %s, CUDA backend %s\n",
              FLASHGDN_PACKAGE_VERSION, FGDN_VERSION_STRING, lib.c_str(),
              flashgdn::has_cuda() ? "yes" : "no");
  // All three come from flashgdn's VERSION file; a mismatch means headers and library from
  // different installs.
  if (lib != FLASHGDN_PACKAGE_VERSION || lib != FGDN_VERSION_STRING)
    return fail("the package, header and library versions differ");

  constexpr int64_t B = 1, T = 8, H = 2, D = 16;  // Hq = Hv = 2, K = V = 16
  std::vector<float> q(B * T * H * D), k(q.size()), v(q.size()), g(B * T * H), beta(g.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = static_cast<float>(std::sin(0.3 * i));
    k[i] = static_cast<float>(std::cos(0.7 * i)) * 0.25f;
    v[i] = static_cast<float>(std::sin(0.05 * i + 1.0));
  }
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = -0.05f * static_cast<float>(i % 5);
    beta[i] = 0.75f;
  }
  std::vector<float> o(q.size(), NAN), ht(H * D * D, NAN);

  flashgdn::FwdArgs a;
  a.in.q = flashgdn::host_tensor(q.data(), FGDN_FLOAT32, {B, T, H, D});
  a.in.k = flashgdn::host_tensor(k.data(), FGDN_FLOAT32, {B, T, H, D});
  a.in.v = flashgdn::host_tensor(v.data(), FGDN_FLOAT32, {B, T, H, D});
  a.in.g = flashgdn::host_tensor(g.data(), FGDN_FLOAT32, {B, T, H});
  a.in.beta = flashgdn::host_tensor(beta.data(), FGDN_FLOAT32, {B, T, H});
  a.o = flashgdn::host_tensor(o.data(), FGDN_FLOAT32, {B, T, H, D});
  a.final_state = flashgdn::host_tensor(ht.data(), FGDN_FLOAT32, {1, H, D, D});
  a.output_final_state = 1;
  try {
    flashgdn::forward(a);
  } catch (const flashgdn::Error& e) {
    std::fprintf(stderr, "flashgdn_consumer: forward: %s\n", e.what());
    return fail("the forward was refused");
  }

  for (float x : o)
    if (!std::isfinite(x)) return fail("o has a non-finite (or unwritten) element");
  for (float x : ht)
    if (!std::isfinite(x)) return fail("the final state has a non-finite (or unwritten) element");

  // From a zero state the first token gives S_1 = beta_1 k_1 v_1^T, so
  // o_1 = scale beta_1 (k_1 . q_1) v_1 with scale = 1 / sqrt(K), for each head.
  double err = 0.0, ref = 0.0;
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = &q[h * D];
    const float* kh = &k[h * D];
    const float* vh = &v[h * D];
    double kq = 0.0;
    for (int64_t i = 0; i < D; ++i) kq += static_cast<double>(kh[i]) * qh[i];
    for (int64_t j = 0; j < D; ++j) {
      const double want = beta[h] * kq * vh[j] / std::sqrt(static_cast<double>(D));
      const double diff = want - o[h * D + j];
      err += diff * diff;
      ref += want * want;
    }
  }
  const double rel = std::sqrt(err / ref);
  std::printf("flashgdn_consumer: forward on the CPU, relative L2 error of o at t = 0: %.3g\n", rel);
  if (!(rel < 1e-5)) return fail("o at the first token differs from beta (k . q) v / sqrt(K)");

  // A refused call throws flashgdn::Error with the status and a message naming the argument
  // (here beta without its head dimension; nothing is read or written).
  a.in.beta = flashgdn::host_tensor(beta.data(), FGDN_FLOAT32, {B, T});
  try {
    flashgdn::forward(a);
    return fail("a beta of the wrong shape was accepted");
  } catch (const flashgdn::Error& e) {
    if (e.status() != FGDN_ERROR_INVALID_ARGUMENT || std::strstr(e.what(), "beta") == nullptr)
      return fail("the refusal did not name 'beta' as an invalid argument");
    std::printf("flashgdn_consumer: refused as expected: %s\n", e.what());
  }
  std::printf("flashgdn_consumer: OK\n");
  return 0;
}
