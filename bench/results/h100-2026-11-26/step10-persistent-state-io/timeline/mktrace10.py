# Timeline instrumentation of CTA 0 for the persistent kernel (never lands): run in a copy of the tree.
import sys
def edit(path, pairs):
    s = open(path).read()
    for old, new in pairs:
        assert s.count(old) == 1, (path, old)
        s = s.replace(old, new)
    open(path, 'w').write(s)
edit('csrc/sm90/fwd_params.h', [("struct FwdParams {\n", "struct FwdParams {\n  unsigned long long* trace = nullptr;\n")])
edit('csrc/sm90/fwd_scheduler.cuh', [("namespace flashgdn::sm90 {\n", """namespace flashgdn::sm90 {
#define FGDN_TR(ev, c) do { if (p.trace != nullptr && blockIdx.x == 0 && (threadIdx.x & 31) == 0 && (c) < 64) p.trace[(ev) * 64 + (c)] = clock64(); } while (0)
""")])
edit('csrc/sm90/fwd_load.cuh', [
("""    Mbarrier* full = &sm.in_full[pos.stage];
""", """    Mbarrier* full = &sm.in_full[pos.stage];
    FGDN_TR(0, c0 + j);
"""),
("""    sm.in_empty[pos.stage].wait(pos.phase ^ 1);
    auto& st = sm.in[pos.stage];
    *reinterpret_cast<float2*>(&st.c2[2 * lane])""", """    sm.in_empty[pos.stage].wait(pos.phase ^ 1);
    FGDN_TR(8, c0 + j);
    auto& st = sm.in[pos.stage];
    *reinterpret_cast<float2*>(&st.c2[2 * lane])"""),
])
edit('csrc/sm90/fwd_row_norms.cuh', [
("""    sm.in_full[pos.stage].wait(pos.phase);
    const int len""", """    sm.in_full[pos.stage].wait(pos.phase);
    if (!is_k) FGDN_TR(1, c0 + j);
    const int len"""),
("""    if (is_k) named_barrier_sync(static_cast<uint32_t>(FwdBarrier::kGateNorm), 64);
    sm.in_ready[pos.stage].arrive();""", """    if (is_k) named_barrier_sync(static_cast<uint32_t>(FwdBarrier::kGateNorm), 64);
    if (is_k) FGDN_TR(2, c0 + j);
    sm.in_ready[pos.stage].arrive();"""),
])
edit('csrc/sm90/fwd_chunk_local.cuh', [
("""    sm.in_ready[pin.stage].wait(pin.phase);

    // ---- K K^T""", """    sm.in_ready[pin.stage].wait(pin.phase);
    if (tid < 32) FGDN_TR(3, c0 + j);

    // ---- K K^T"""),
("""    sm.local_full[ploc.stage].arrive();
    sm.in_empty[pin.stage].arrive();""", """    sm.local_full[ploc.stage].arrive();
    if (tid < 32) FGDN_TR(4, c0 + j);
    sm.in_empty[pin.stage].arrive();"""),
])
edit('csrc/sm90/fwd_state.cuh', [
("""  const StateSource src""", """  const int32_t item_ = c0 / (w.nchunks > 0 ? w.nchunks : 1);
  if (sw == 0 && tid < 32) FGDN_TR(9, item_);
  const StateSource src"""),
("""    sm.in_ready[pin.stage].wait(pin.phase);

    // ---- [O1""", """    sm.in_ready[pin.stage].wait(pin.phase);
    if (sw == 0 && tid_j < 32) FGDN_TR(5, c0 + j);

    // ---- [O1"""),
("""      wgmma_wait<0>();
      fence_regs(o1);
      fence_regs(xk);""", """      wgmma_wait<0>();
      fence_regs(o1);
      fence_regs(xk);
      if (sw == 0 && tid_j < 32) FGDN_TR(6, c0 + j);"""),
("""    sm.in_empty[pin.stage].arrive();
    if (p.ckpt.data""", """    sm.in_empty[pin.stage].arrive();
    if (sw == 0 && tid_j < 32) FGDN_TR(7, c0 + j);
    if (p.ckpt.data"""),
("""  // ---- final state ------------------------------------------------------------------------
""", """  // ---- final state ------------------------------------------------------------------------
  if (sw == 0 && tid < 32) FGDN_TR(10, item_);
"""),
("""  const float vscale =""", """  {
    float sum_ = 0.f;
    for (int b_ = 0; b_ < kB; ++b_) for (int x_ = 0; x_ < 32; ++x_) sum_ += S[b_][x_];
    if (sum_ == 123.456f) S[0][0] += 1e-30f;
    if (sw == 0 && tid < 32) FGDN_TR(12, item_);
  }
  const float vscale ="""),
])
s = open('csrc/sm90/fwd_state.cuh').read()
i = s.rindex('}\n\n}  // namespace')
s = s[:i] + "  if (sw == 0 && tid < 32) FGDN_TR(11, item_);\n" + s[i:]
open('csrc/sm90/fwd_state.cuh', 'w').write(s)
edit('csrc/sm90/fwd_launch_kernel.cuh', [
('#include "sm90/fwd_kernel.cuh"\n', '#include "sm90/fwd_kernel.cuh"\n#include <cstdio>\n#include <cstdlib>\n#include <vector>\n'),
("""  kern<<<static_cast<unsigned>(ctas), Tr::kThreads, smem, stream>>>(fp);""", """  static unsigned long long* tbuf = nullptr;
  const char* tpath = std::getenv("FLASHGDN_TRACE");
  FwdParams f2 = fp;
  if (tpath != nullptr) {
    if (tbuf == nullptr) cudaMalloc(&tbuf, 13 * 64 * 8);
    cudaMemsetAsync(tbuf, 0, 13 * 64 * 8, stream);
    f2.trace = tbuf;
  }
  if (std::getenv("FLASHGDN_NOSTATE") != nullptr) { f2.h0.data = nullptr; f2.write_final = 0; f2.ht.data = nullptr; }
  kern<<<static_cast<unsigned>(ctas), Tr::kThreads, smem, stream>>>(f2);
  if (tpath != nullptr) {
    std::vector<unsigned long long> h(13 * 64);
    cudaMemcpyAsync(h.data(), tbuf, h.size() * 8, cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    if (FILE* fo = std::fopen(tpath, "w")) {
      const unsigned long long t0 = h[9 * 64];
      for (int c = 0; c < 64; ++c) {
        std::fprintf(fo, "%d", c);
        for (int e = 0; e < 13; ++e) std::fprintf(fo, " %lld", h[e * 64 + c] ? (long long)(h[e * 64 + c] - t0) : -1LL);
        std::fprintf(fo, "\\n");
      }
      std::fclose(fo);
    }
  }"""),
])
