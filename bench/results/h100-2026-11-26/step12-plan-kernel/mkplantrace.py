# clock64 stamps in the CP plan kernel (thread 0) and in CTA 0's scan chain (never lands).
def edit(path, pairs):
    s = open(path).read()
    for old, new in pairs:
        assert s.count(old) == 1, (path, old)
        s = s.replace(old, new)
    open(path, 'w').write(s)
edit('csrc/sm90/fwd_context_parallel.h', [("  int32_t* bound_warm;", "  unsigned long long* trace = nullptr;\n  int32_t* bound_warm;")])
F = 'csrc/sm90/fwd_context_parallel.cu'
edit(F, [
("namespace flashgdn::sm90 {\n", "namespace flashgdn::sm90 {\n#define FGDN_PT(i) do { if (t.trace != nullptr && threadIdx.x == 0) t.trace[i] = clock64(); } while (0)\n#define FGDN_ST(i) do { if (t.trace != nullptr && threadIdx.x == 0 && blockIdx.x == 0 && index == 0) t.trace[i] = clock64(); } while (0)\n"),
("""  const int64_t N = seq.N;

  if (candidates == 1) {""", """  const int64_t N = seq.N;
  FGDN_PT(0);

  if (candidates == 1) {"""),
("""    // Per (boundary, head): the segments' certificates.
    const int64_t entries""", """    FGDN_PT(1);
    // Per (boundary, head): the segments' certificates.
    const int64_t entries"""),
("""    PlanStats& all = tmp.stats;
""", """    FGDN_PT(2);
    PlanStats& all = tmp.stats;
"""),
("""    block_reduce_stats(own, all, partial);
""", """    block_reduce_stats(own, all, partial);
    FGDN_PT(3);
"""),
("""  const int64_t L = chosen;
""", """  const int64_t L = chosen;
  FGDN_PT(4);
"""),
("""  const int32_t n_slots = static_cast<int32_t>(min(static_cast<int64_t>(base[1]), max_slots));""", """  FGDN_PT(5);
  const int32_t n_slots = static_cast<int32_t>(min(static_cast<int64_t>(base[1]), max_slots));"""),
("""  __shared__ unsigned long long movable_exact[2];""", """  FGDN_PT(6);
  __shared__ unsigned long long movable_exact[2];"""),
("""  if (threadIdx.x == 0) {
    const unsigned long long mv = movable_exact[0], ex = movable_exact[1];""", """  FGDN_PT(7);
  if (threadIdx.x == 0) {
    const unsigned long long mv = movable_exact[0], ex = movable_exact[1];"""),
("""  unsigned long long after = 0;  // movable CTAs in the items behind this tile""", """  FGDN_PT(8);
  unsigned long long after = 0;  // movable CTAs in the items behind this tile"""),
("""  if (threadIdx.x == 0) {
    t.plan[kPlanDeferFrom] = defer_from;""", """  FGDN_PT(9);
  if (threadIdx.x == 0) {
    t.plan[kPlanDeferFrom] = defer_from;"""),
# scan: CTA 0's chain (index 0: split 0, head 0, columns 0-7)
("""    const bool run = exact_this;
    __syncthreads();""", """    const bool run = exact_this;
    if (s < 40) FGDN_ST(16 + 3 * s);
    __syncthreads();"""),
("""    __syncthreads();     // ... and everyone's, and St is written""", """    __syncthreads();     // ... and everyone's, and St is written
    if (s < 40) FGDN_ST(17 + 3 * s);"""),
("""    lo = make_float2(d[0], d[1]);
    hi = make_float2(d[2], d[3]);""", """    lo = make_float2(d[0], d[1]);
    hi = make_float2(d[2], d[3]);
    if (s < 40) FGDN_ST(18 + 3 * s);"""),
('#include "sm90/fwd_context_parallel.h"\n', '#include "sm90/fwd_context_parallel.h"\n#include <cstdio>\n#include <cstdlib>\n'),
("""  FGDN_CHECK_LAUNCH("cp_plan_kernel");""", """  FGDN_CHECK_LAUNCH("cp_plan_kernel");
  if (std::getenv("FLASHGDN_PLANTRACE") != nullptr) {
    static unsigned long long* buf = nullptr;
    if (buf == nullptr) cudaMalloc(&buf, 160 * 8);
    cudaMemsetAsync(buf, 0, 160 * 8, stream);
    CpTables t2 = t;
    t2.trace = buf;
    cp_plan_kernel<<<1, kPlanThreads, 0, stream>>>(fp.seq, static_cast<int32_t>(fp.Hv), c.sms, c.min_chunks,
                                                    c.candidates, c.max_items, c.max_slots, c.max_splits, t2);
    unsigned long long h[10];
    cudaMemcpyAsync(h, buf, sizeof(h), cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    if (FILE* f = std::fopen(std::getenv("FLASHGDN_PLANTRACE"), "a")) {
      std::fprintf(f, "plan");
      for (int i = 1; i < 10; ++i) std::fprintf(f, " %lld", h[i] ? (long long)(h[i] - h[0]) : -1LL);
      std::fprintf(f, "\\n");
      std::fclose(f);
    }
  }"""),
("""  cp_scan_kernel<kD><<<static_cast<unsigned>(grid), ScanTraits<kD>::kThreads, bytes, stream>>>(fp, t);""", """  static unsigned long long* sbuf = nullptr;
  CpTables t2 = t;
  if (std::getenv("FLASHGDN_PLANTRACE") != nullptr) {
    if (sbuf == nullptr) cudaMalloc(&sbuf, 160 * 8);
    cudaMemsetAsync(sbuf, 0, 160 * 8, stream);
    t2.trace = sbuf;
  }
  cp_scan_kernel<kD><<<static_cast<unsigned>(grid), ScanTraits<kD>::kThreads, bytes, stream>>>(fp, t2);
  if (sbuf != nullptr) {
    unsigned long long h[160];
    cudaMemcpyAsync(h, sbuf, sizeof(h), cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    if (FILE* f = std::fopen(std::getenv("FLASHGDN_PLANTRACE"), "a")) {
      unsigned long long t0 = h[19];
      std::fprintf(f, "scan (step: start wait-done product-done, from step 1 start)\\n");
      for (int s = 1; s < 40; ++s) if (h[16 + 3 * s]) std::fprintf(f, "  %d %lld %lld %lld\\n", s, (long long)(h[16 + 3 * s] - t0), h[17 + 3 * s] ? (long long)(h[17 + 3 * s] - t0) : -1LL, h[18 + 3 * s] ? (long long)(h[18 + 3 * s] - t0) : -1LL);
      std::fclose(f);
    }
  }"""),
])
