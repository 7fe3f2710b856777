// The main job: one GDN forward + backward on a Qwen3.5-shaped problem (Hq = 16, Hv = 64,
// K = V = 128, bf16 q/k/v, fp32 g/beta, L2-normalised q/k in the kernel, initial state and
// final state), on the GPU when there is one and the build has CUDA, else on the CPU backend
// with a shorter sequence. Prints the time of each pass and every tensor's relative L2 error
// against the float64 oracle on the same (bf16-rounded) inputs.
//
//   flashgdn_run [--device auto|cpu|cuda] [--T n] [--Hq n] [--Hv n] [--K n] [--iters n]
//                [--precision default|fast|high[,...]] [--backward 0|1] [--check 0|1]
//                [--cp auto|on|off] [--cp-segment TOKENS] [--digest 0|1]
// With several precisions, the forward runs (and is checked) once for each; the backward once,
// at the first. --cp and --cp-segment set the forward's context parallelism and the backward's
// (its reverse pass).
// --digest 1 prints a hash of every output's bytes (bit-equality of two builds on one input).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "flashgdn/flashgdn.hpp"
#include "gdn_reference.h"
#ifdef FLASHGDN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using flashgdn::make_tensor;
namespace ref = flashgdn::reference;

using flashgdn::bf16_to_float;
using flashgdn::float_to_bf16;  // round to nearest even

double rel_l2(const std::vector<double>& x, const std::vector<double>& r) {
  double e = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    e += (x[i] - r[i]) * (x[i] - r[i]);
    n += r[i] * r[i];
  }
  return n > 0 ? std::sqrt(e / n) : std::sqrt(e);
}

struct Options {
  std::string device = "auto";
  int64_t T = -1, Hq = 16, Hv = 64, K = 128, iters = 5;
  std::vector<fgdn_precision> precisions{FGDN_PRECISION_DEFAULT};
  bool backward = true, check = true;
  bool digest = false;  // --digest 1: a 64-bit FNV-1a hash of every output's bytes
  int32_t cp = FGDN_CONTEXT_PARALLEL_AUTO;
  int64_t cp_segment = 0;
  bool qk_norm_in_kernel = true;  // --qk-norm in_kernel | prenormalized (rows normalised here)
};

const char* precision_name(fgdn_precision p) {
  return p == FGDN_PRECISION_FAST ? "fast" : p == FGDN_PRECISION_HIGH ? "high" : "default";
}

std::vector<fgdn_precision> parse_precisions(const std::string& list) {
  std::vector<fgdn_precision> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string name = list.substr(at, end - at);
    if (name == "default") out.push_back(FGDN_PRECISION_DEFAULT);
    else if (name == "fast") out.push_back(FGDN_PRECISION_FAST);
    else if (name == "high") out.push_back(FGDN_PRECISION_HIGH);
    else {
      std::fprintf(stderr, "--precision: expected default, fast or high (comma-separated), got '%s'\n", name.c_str());
      std::exit(2);
    }
    at = end + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--device") o.device = v;
    else if (k == "--T") o.T = std::atoll(v);
    else if (k == "--Hq") o.Hq = std::atoll(v);
    else if (k == "--Hv") o.Hv = std::atoll(v);
    else if (k == "--K") o.K = std::atoll(v);
    else if (k == "--iters") o.iters = std::atoll(v);
    else if (k == "--precision") o.precisions = parse_precisions(v);
    else if (k == "--backward") o.backward = std::atoi(v) != 0;
    else if (k == "--check") o.check = std::atoi(v) != 0;
    else if (k == "--digest") o.digest = std::atoi(v) != 0;
    else if (k == "--cp" && (std::string(v) == "on" || std::string(v) == "off" || std::string(v) == "auto"))
      o.cp = std::string(v) == "on" ? FGDN_CONTEXT_PARALLEL_ON
           : std::string(v) == "off" ? FGDN_CONTEXT_PARALLEL_OFF
                                     : FGDN_CONTEXT_PARALLEL_AUTO;
    else if (k == "--cp") {
      std::fprintf(stderr, "--cp: expected auto, on or off, got '%s'\n", v);
      std::exit(2);
    }
    else if (k == "--cp-segment") o.cp_segment = std::atoll(v);
    else if (k == "--qk-norm" && (std::string(v) == "in_kernel" || std::string(v) == "prenormalized"))
      o.qk_norm_in_kernel = std::string(v) == "in_kernel";
    else if (k == "--qk-norm") {
      std::fprintf(stderr, "--qk-norm: expected in_kernel or prenormalized, got '%s'\n", v);
      std::exit(2);
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return o;
}

bool cuda_available() {
#ifdef FLASHGDN_WITH_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

// Host or device storage for one tensor, filled from and read back to the host.
struct Buffer {
  std::vector<unsigned char> host;
  void* dev = nullptr;
  bool on_cuda = false;
  Buffer(size_t bytes, bool cuda) : host(bytes), on_cuda(cuda) {
#ifdef FLASHGDN_WITH_CUDA
    if (cuda && cudaMalloc(&dev, bytes) != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc failed\n");
      std::exit(1);
    }
#endif
  }
  ~Buffer() {
#ifdef FLASHGDN_WITH_CUDA
    if (dev) cudaFree(dev);
#endif
  }
  void* ptr() { return on_cuda ? dev : host.data(); }
  void upload() {
#ifdef FLASHGDN_WITH_CUDA
    if (on_cuda) cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice);
#endif
  }
  void download() {
#ifdef FLASHGDN_WITH_CUDA
    if (on_cuda) cudaMemcpy(host.data(), dev, host.size(), cudaMemcpyDeviceToHost);
#endif
  }
  std::vector<double> as_bf16() const {
    std::vector<double> out(host.size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, host.data() + 2 * i, 2);
      out[i] = bf16_to_float(h);
    }
    return out;
  }
  std::vector<double> as_f32() const {
    std::vector<double> out(host.size() / 4);
    for (size_t i = 0; i < out.size(); ++i) {
      float f;
      std::memcpy(&f, host.data() + 4 * i, 4);
      out[i] = f;
    }
    return out;
  }
};

void sync() {
#ifdef FLASHGDN_WITH_CUDA
  cudaDeviceSynchronize();
#endif
}

// FNV-1a over a buffer's bytes.
uint64_t fnv1a(const std::vector<unsigned char>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Median wall time in ms of f over iters runs after one warm-up.
double time_ms(int64_t iters, const std::function<void()>& f) {
  f();
  sync();
  std::vector<double> ms;
  for (int64_t i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    sync();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse(argc, argv);
  const bool cuda = opt.device == "cuda" || (opt.device == "auto" && cuda_available());
  if (cuda && !cuda_available()) {
    std::fprintf(stderr, "--device cuda: no CUDA device (or this build has no CUDA backend)\n");
    return 1;
  }
  if (opt.T < 0) opt.T = cuda ? 8192 : 256;
  const int64_t B = 1, T = opt.T, Hq = opt.Hq, Hv = opt.Hv, K = opt.K, V = opt.K, N = 1;
  std::printf("flashgdn %s main job: %s backend, B=%lld T=%lld Hq=%lld Hv=%lld K=V=%lld, bf16 q/k/v, "
              "%s, initial + final state\n",
              fgdn_version(), cuda ? "cuda" : "cpu", (long long)B, (long long)T, (long long)Hq,
              (long long)Hv, (long long)K,
              opt.qk_norm_in_kernel ? "l2norm in kernel" : "q/k normalised before the call");

  // Inputs with realistic gates: per head A in [0, 16], head 0 with A = 0 (no decay),
  // g = -A * softplus(x + 1); beta in (0, 1); q, k, v standard normal (q, k normalised in the
  // kernel, or before the call with --qk-norm prenormalized).
  // A counter-based generator (splitmix64: draw n is a function of n alone) and Box-Muller (two
  // draws a sample), so every buffer fills on all cores with the values of one sequential stream:
  // draws are numbered in the order A, q, k, v, dO, g, beta, h0, dht.
  const uint64_t seed = 20261123;
  auto draw = [seed](uint64_t n) {  // the (n+1)-th output of splitmix64 from seed
    uint64_t z = seed + (n + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  auto uni = [&](uint64_t n) { return (static_cast<double>(draw(n) >> 11) + 0.5) * 0x1.0p-53; };
  auto normal = [&](uint64_t n) {
    const double r = std::sqrt(-2.0 * std::log(uni(n)));
    return r * std::cos(6.283185307179586 * uni(n + 1));
  };
  uint64_t next_draw = 0;  // the first draw of the next buffer
  // f(i) for i in [0, n) on every core.
  auto parallel_for = [](size_t n, const std::function<void(size_t, size_t)>& f) {
    const size_t workers = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), 64));
    const size_t per = (n + workers - 1) / workers;
    std::vector<std::thread> pool;
    for (size_t b = 0; b < n; b += per) pool.emplace_back(f, b, std::min(n, b + per));
    for (auto& t : pool) t.join();
  };
  const size_t nq = B * T * Hq * K, nv = B * T * Hv * V, ng = B * T * Hv, ns = N * Hv * K * V;
  Buffer q(nq * 2, cuda), k(nq * 2, cuda), v(nv * 2, cuda), g(ng * 4, cuda), beta(ng * 4, cuda),
      h0(ns * 4, cuda), o(nv * 2, cuda), ht(ns * 4, cuda), d_o(nv * 2, cuda), dht(ns * 4, cuda),
      dq(nq * 2, cuda), dk(nq * 2, cuda), dv(nv * 2, cuda), dg(ng * 4, cuda), dbeta(ng * 4, cuda),
      dh0(ns * 4, cuda);
  auto fill_bf16 = [&](Buffer& b, double sd) {
    const uint64_t d0 = next_draw;
    parallel_for(b.host.size() / 2, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        const uint16_t h = float_to_bf16(static_cast<float>(sd * normal(d0 + 2 * i)));
        std::memcpy(b.host.data() + 2 * i, &h, 2);
      }
    });
    next_draw += b.host.size();  // two draws an element
    b.upload();
  };
  // f(i, first draw of element i); draws_per draws an element.
  auto fill_f32 = [&](Buffer& b, uint64_t draws_per, const std::function<double(size_t, uint64_t)>& f) {
    const uint64_t d0 = next_draw;
    parallel_for(b.host.size() / 4, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        const float x = static_cast<float>(f(i, d0 + draws_per * i));
        std::memcpy(b.host.data() + 4 * i, &x, 4);
      }
    });
    next_draw += draws_per * (b.host.size() / 4);
    b.upload();
  };
  std::vector<double> A(Hv);
  for (int64_t h = 0; h < Hv; ++h) A[h] = h == 0 ? 0.0 : 16.0 * uni(next_draw++);
  // q, k rows: standard normal, or (--qk-norm prenormalized) divided by sqrt(|x|^2 + 1e-6), the
  // in-kernel norm's formula, before rounding to bf16.
  auto fill_qk = [&](Buffer& b) {
    const uint64_t d0 = next_draw;
    parallel_for(b.host.size() / 2 / K, [&](size_t lo, size_t hi) {
      std::vector<double> row(static_cast<size_t>(K));
      for (size_t r = lo; r < hi; ++r) {
        double ss = 0;
        for (int64_t c = 0; c < K; ++c) {
          row[c] = normal(d0 + 2 * (r * K + c));
          ss += row[c] * row[c];
        }
        const double f = opt.qk_norm_in_kernel ? 1.0 : 1.0 / std::sqrt(ss + 1e-6);
        for (int64_t c = 0; c < K; ++c) {
          const uint16_t h = float_to_bf16(static_cast<float>(f * row[c]));
          std::memcpy(b.host.data() + 2 * (r * K + c), &h, 2);
        }
      }
    });
    next_draw += b.host.size();
    b.upload();
  };
  fill_qk(q);
  fill_qk(k);
  fill_bf16(v, 1.0);
  fill_bf16(d_o, 1.0);
  fill_f32(g, 2, [&](size_t i, uint64_t d) { const double x = normal(d) + 1.0; return -A[i % Hv] * std::log1p(std::exp(x)); });
  fill_f32(beta, 1, [&](size_t, uint64_t d) { return uni(d); });
  fill_f32(h0, 2, [&](size_t, uint64_t d) { return 0.1 * normal(d); });
  fill_f32(dht, 2, [&](size_t, uint64_t d) { return 0.1 * normal(d); });

  const fgdn_device_type dev = cuda ? FGDN_CUDA : FGDN_CPU;
  flashgdn::FwdArgs fa;
  fa.in.q = make_tensor(q.ptr(), FGDN_BFLOAT16, {B, T, Hq, K}, dev);
  fa.in.k = make_tensor(k.ptr(), FGDN_BFLOAT16, {B, T, Hq, K}, dev);
  fa.in.v = make_tensor(v.ptr(), FGDN_BFLOAT16, {B, T, Hv, V}, dev);
  fa.in.g = make_tensor(g.ptr(), FGDN_FLOAT32, {B, T, Hv}, dev);
  fa.in.beta = make_tensor(beta.ptr(), FGDN_FLOAT32, {B, T, Hv}, dev);
  fa.in.initial_state = make_tensor(h0.ptr(), FGDN_FLOAT32, {N, Hv, K, V}, dev);
  fa.in.use_qk_l2norm_in_kernel = opt.qk_norm_in_kernel ? 1 : 0;
  fa.o = make_tensor(o.ptr(), FGDN_BFLOAT16, {B, T, Hv, V}, dev);
  fa.final_state = make_tensor(ht.ptr(), FGDN_FLOAT32, {N, Hv, K, V}, dev);
  fa.output_final_state = 1;
  flashgdn::BwdArgs ba;
  ba.in = fa.in;
  ba.d_o = make_tensor(d_o.ptr(), FGDN_BFLOAT16, {B, T, Hv, V}, dev);
  ba.d_final_state = make_tensor(dht.ptr(), FGDN_FLOAT32, {N, Hv, K, V}, dev);
  ba.dq = make_tensor(dq.ptr(), FGDN_BFLOAT16, {B, T, Hq, K}, dev);
  ba.dk = make_tensor(dk.ptr(), FGDN_BFLOAT16, {B, T, Hq, K}, dev);
  ba.dv = make_tensor(dv.ptr(), FGDN_BFLOAT16, {B, T, Hv, V}, dev);
  ba.dg = make_tensor(dg.ptr(), FGDN_FLOAT32, {B, T, Hv}, dev);
  ba.dbeta = make_tensor(dbeta.ptr(), FGDN_FLOAT32, {B, T, Hv}, dev);
  ba.dh0 = make_tensor(dh0.ptr(), FGDN_FLOAT32, {N, Hv, K, V}, dev);
  ba.precision = opt.precisions.front();  // the backward runs once, at the first level
  ba.context_parallel = opt.cp;            // its reverse pass split as the forward's (--cp)
  ba.cp_segment = opt.cp_segment;

  // The float64 oracle on the same rounded inputs (once, for every precision).
  ref::Outputs ro;
  ref::Grads rg;
  double oracle_s = 0;
  if (opt.check) {
    ref::Problem rp;
    rp.B = B, rp.T = T, rp.Hq = Hq, rp.Hv = Hv, rp.K = K, rp.V = V;
    rp.use_qk_l2norm = opt.qk_norm_in_kernel;
    rp.has_initial_state = true;
    ref::Inputs ri{q.as_bf16(), k.as_bf16(), v.as_bf16(), g.as_f32(), beta.as_f32(), {}, {}, h0.as_f32()};
    const auto t0 = std::chrono::steady_clock::now();
    ro = ref::forward(rp, ri);
    if (opt.backward) rg = ref::backward(rp, ri, d_o.as_bf16(), dht.as_f32());
    oracle_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  bool finite = true;
  for (fgdn_precision prec : opt.precisions) {
    fa.precision = prec;
    fa.context_parallel = opt.cp;
    fa.cp_segment = opt.cp_segment;
    double fwd_ms = 0, bwd_ms = 0;
    size_t bws_bytes = 0;
    const bool with_backward = opt.backward && prec == opt.precisions.front();
    try {
      // The workspace allocated once, as a caller that runs many steps does (a null workspace
      // makes every call allocate and free its own).
      const size_t ws_bytes = flashgdn::forward_workspace_size(fa);
      Buffer ws(ws_bytes, fa.o.device_type == FGDN_CUDA && ws_bytes > 0);
      fwd_ms = time_ms(opt.iters, [&] { flashgdn::forward(fa, ws.ptr(), ws_bytes); });
      if (with_backward) {
        bws_bytes = flashgdn::backward_workspace_size(ba);
        Buffer bws(bws_bytes, ba.d_o.device_type == FGDN_CUDA && bws_bytes > 0);
        bwd_ms = time_ms(opt.iters, [&] { flashgdn::backward(ba, bws.ptr(), bws_bytes); });
      }
    } catch (const flashgdn::Error& e) {
      std::fprintf(stderr, "flashgdn error: %s\n", e.what());
      return 1;
    }
    for (Buffer* b : {&o, &ht, &dq, &dk, &dv, &dg, &dbeta, &dh0}) b->download();
    if (opt.digest) {  // the outputs' bits, for "same bits" claims across two builds
      std::printf("\ndigest %s:", precision_name(prec));
      const std::pair<const char*, const Buffer*> outs[] = {{"o", &o},   {"final_state", &ht}, {"dq", &dq},
                                                            {"dk", &dk}, {"dv", &dv},          {"dg", &dg},
                                                            {"dbeta", &dbeta}, {"dh0", &dh0}};
      for (const auto& [name, b] : outs)
        if (with_backward || b == &o || b == &ht) std::printf(" %s=%016llx", name, (unsigned long long)fnv1a(b->host));
      std::printf("\n");
    }
    std::printf("\nprecision %s\n\n| pass | ms (median of %lld) |\n|---|---|\n", precision_name(prec),
                (long long)opt.iters);
    std::printf("| forward | %.3f |\n", fwd_ms);
    if (with_backward)
      std::printf("| backward | %.3f |\n| forward+backward | %.3f |\n", bwd_ms, fwd_ms + bwd_ms);
    if (with_backward) std::printf("\nbackward workspace: %.3f GB\n", static_cast<double>(bws_bytes) / 1e9);
    if (!opt.check) continue;
    std::printf("\n| tensor | rel. L2 error vs float64 oracle |\n|---|---|\n");
    const struct {
      const char* name;
      std::vector<double> got;
      const std::vector<double>* want;
    } rows[] = {{"o", o.as_bf16(), &ro.o},          {"final_state", ht.as_f32(), &ro.ht},
                {"dq", dq.as_bf16(), &rg.dq},       {"dk", dk.as_bf16(), &rg.dk},
                {"dv", dv.as_bf16(), &rg.dv},       {"dg", dg.as_f32(), &rg.dg},
                {"dbeta", dbeta.as_f32(), &rg.dbeta}, {"dh0", dh0.as_f32(), &rg.dh0}};
    for (const auto& r : rows) {
      if (r.want->empty() || (!with_backward && r.want != &ro.o && r.want != &ro.ht)) continue;
      for (double x : r.got) finite &= std::isfinite(x);
      std::printf("| %s | %.3e |\n", r.name, rel_l2(r.got, *r.want));
    }
  }
  if (opt.check) std::printf("\n(oracle: %.1f s; every output finite: %s)\n", oracle_s, finite ? "yes" : "NO");
  return finite ? 0 : 1;
}
