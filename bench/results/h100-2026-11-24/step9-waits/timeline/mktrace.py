def edit(path, pairs):
    s=open(path).read()
    for old,new in pairs:
        assert s.count(old)==1, (path, old)
        s=s.replace(old,new)
    open(path,'w').write(s)
edit('csrc/sm90/fwd_scheduler.cuh', [("namespace flashgdn::sm90 {\n", """namespace flashgdn::sm90 {

// Timeline instrumentation (not for main): clock64 of chunks 16..31 of CTA 0 into shared memory,
// flushed to p.trace at the end of each role.
__device__ __forceinline__ unsigned long long* fgdn_trace_buf() {
  __shared__ unsigned long long b[32 * 16];
  return b;
}
#define FGDN_TRACE(ev, j) do { if (p.trace != nullptr && blockIdx.x == 0 && (threadIdx.x & 31) == 0 && (j) >= 16 && (j) < 32) fgdn_trace_buf()[(ev) * 16 + (j) - 16] = clock64(); } while (0)
#define FGDN_TRACE_FLUSH() do { if (p.trace != nullptr && blockIdx.x == 0 && (threadIdx.x & 31) == 0) for (int e_ = 0; e_ < 32 * 16; ++e_) { const unsigned long long v_ = fgdn_trace_buf()[e_]; if (v_ != 0) p.trace[e_] = v_; } } while (0)
""", )])
edit('csrc/sm90/fwd_params.h', [("struct FwdParams {\n", "struct FwdParams {\n  unsigned long long* trace = nullptr;\n")])
edit('csrc/sm90/fwd_kernel.cuh', [
("""  __syncthreads();
""", """  for (int e = threadIdx.x; e < 32 * 16; e += blockDim.x) fgdn_trace_buf()[e] = 0;
  __syncthreads();
"""),
("""      fwd_load_gates<Tr>(p, sm, w, tid & 31);
    }""", """      fwd_load_gates<Tr>(p, sm, w, tid & 31);
    }
    FGDN_TRACE_FLUSH();"""),
("""    fwd_chunk_local<Tr>(p, sm, w, tid);""", """    fwd_chunk_local<Tr>(p, sm, w, tid);
    FGDN_TRACE_FLUSH();"""),
("""    fwd_state<Tr>(p, sm, w, wg - 2, tid);""", """    fwd_state<Tr>(p, sm, w, wg - 2, tid);
    FGDN_TRACE_FLUSH();"""),
])
edit('csrc/sm90/fwd_load.cuh', [
("""    full->arrive_expect_tx(Tr::kTmaBytes);""", """    FGDN_TRACE(0, j);
    full->arrive_expect_tx(Tr::kTmaBytes);"""),
("""    *reinterpret_cast<float2*>(&st.beta[2 * lane]) = make_float2(b[0], b[1]);""", """    *reinterpret_cast<float2*>(&st.beta[2 * lane]) = make_float2(b[0], b[1]);
    FGDN_TRACE(1, j);"""),
])
_rn = open('csrc/sm90/fwd_row_norms.cuh').read()
if 'chunk_row_norms<Tr>(p, sm.in[pos.stage]' in _rn:
    edit('csrc/sm90/fwd_row_norms.cuh', [
    ("""    sm.in_full[pos.stage].wait(pos.phase);
    chunk_row_norms<Tr>(p, sm.in[pos.stage], w.chunk_len(j), is_k, 0, lane);""", """    sm.in_full[pos.stage].wait(pos.phase);
    if (!is_k) FGDN_TRACE(2, j);
    chunk_row_norms<Tr>(p, sm.in[pos.stage], w.chunk_len(j), is_k, 0, lane);
    if (!is_k) FGDN_TRACE(3, j); else FGDN_TRACE(28, j);"""),
    ])
if 'chunk_row_norms<Tr>(p, sm.in[pos.stage]' not in _rn:
  edit('csrc/sm90/fwd_row_norms.cuh', [
("""    sm.in_full[pos.stage].wait(pos.phase);
    const int len""", """    sm.in_full[pos.stage].wait(pos.phase);
    if (!is_k) FGDN_TRACE(2, j);
    const int len"""),
("""    fence_proxy_async();  // the zeroed / rescaled rows, before the tensor cores read them
""", """    fence_proxy_async();  // the zeroed / rescaled rows, before the tensor cores read them
    if (!is_k) FGDN_TRACE(3, j); else FGDN_TRACE(28, j);
"""),
])
cl = open('csrc/sm90/fwd_chunk_local.cuh').read()
pairs = [
("""    sm.in_ready[pin.stage].wait(pin.phase);
""", """    sm.in_ready[pin.stage].wait(pin.phase);
    if (warp == 0) FGDN_TRACE(4, j);
"""),
("""      fence_regs(kk);
      sm.local_empty[ploc.stage].wait(ploc.phase ^ 1);""", """      fence_regs(kk);
      if (warp == 0) FGDN_TRACE(5, j);
      sm.local_empty[ploc.stage].wait(ploc.phase ^ 1);
      if (warp == 0) FGDN_TRACE(6, j);"""),
("""      fence_regs(qk);
      sm.local_empty[ploc.stage].wait(ploc.phase ^ 1);""", """      fence_regs(qk);
      if (warp == 0) FGDN_TRACE(5, j);
      sm.local_empty[ploc.stage].wait(ploc.phase ^ 1);
      if (warp == 0) FGDN_TRACE(6, j);"""),
("""      invert_diagonal_block(sm, diag, warp, lane);
    }""", """      if (warp == 0) FGDN_TRACE(29, j);
      if (warp == 3) FGDN_TRACE(10, j);
      invert_diagonal_block(sm, diag, warp, lane);
      if (warp == 0) FGDN_TRACE(7, j);
      if (warp == 3) FGDN_TRACE(8, j);
    }"""),
("""    named_barrier_sync(kBar, 128);  // every T_ww; A's blocks left of the diagonal
""", """    named_barrier_sync(kBar, 128);  // every T_ww; A's blocks left of the diagonal
    if (warp == 3) FGDN_TRACE(9, j);
"""),
("""      merge_block_pair<Tr::kSplitLocal>(sm, warp, lane);
    } else {
      token_factors(p, in, loc, len, warp >> 1, lane);
      if (warp == 0) store_t_rows<Tr>(sm, loc, 0, lane);
    }""", """      merge_block_pair<Tr::kSplitLocal>(sm, warp, lane);
      if (warp == 3) FGDN_TRACE(10, j);
    } else {
      token_factors(p, in, loc, len, warp >> 1, lane);
      if (warp == 0) store_t_rows<Tr>(sm, loc, 0, lane);
      if (warp == 0) FGDN_TRACE(11, j);
    }"""),
("""    named_barrier_sync(kBar, 128);  // T_LL and T_32
""", """    named_barrier_sync(kBar, 128);  // T_LL and T_32
    if (warp == 3) FGDN_TRACE(12, j);
"""),
("""    if (warp >= 2) merge_halves_x<Tr::kSplitLocal>(sm, warp, lane);
    named_barrier_sync(kBar, 128);  // X_2, X_3""", """    if (warp >= 2) merge_halves_x<Tr::kSplitLocal>(sm, warp, lane);
    if (warp == 3) FGDN_TRACE(13, j);
    named_barrier_sync(kBar, 128);  // X_2, X_3
    if (warp == 3) FGDN_TRACE(14, j);"""),
("""      merge_halves_t<Tr::kSplitLocal>(sm, warp, lane);
      __syncwarp();
      store_t_rows<Tr>(sm, loc, warp, lane);""", """      merge_halves_t<Tr::kSplitLocal>(sm, warp, lane);
      if (warp == 3) FGDN_TRACE(15, j);
      __syncwarp();
      store_t_rows<Tr>(sm, loc, warp, lane);
      if (warp == 3) FGDN_TRACE(16, j);"""),
("""    sm.local_full[ploc.stage].arrive();
    sm.in_empty[pin.stage].arrive();
    // The next chunk rewrites af and tf.
    named_barrier_sync(kBar, 128);""", """    sm.local_full[ploc.stage].arrive();
    if (warp == 0) FGDN_TRACE(17, j);
    if (warp == 3) FGDN_TRACE(18, j);
    sm.in_empty[pin.stage].arrive();
    // The next chunk rewrites af and tf.
    named_barrier_sync(kBar, 128);
    if (warp == 0) FGDN_TRACE(19, j);"""),
]
# tolerate missing hunks in chunk-local (the code may have moved): apply those that match
for old,new in pairs:
    if cl.count(old)==1: cl=cl.replace(old,new)
    else: print("skip chunk-local hunk:", old.splitlines()[0][:60])
open('csrc/sm90/fwd_chunk_local.cuh','w').write(cl)
_st = open('csrc/sm90/fwd_state.cuh').read()
if 'sm.in_ready[pin.stage].wait(pin.phase);' in _st:
  edit('csrc/sm90/fwd_state.cuh', [
  ("""    sm.in_ready[pin.stage].wait(pin.phase);
""", """    sm.in_ready[pin.stage].wait(pin.phase);
    if (sw == 0 && warp == 0) FGDN_TRACE(20, j);
"""),
  ("""      if (part == (kSS ? 1 : 0)) sm.local_full[ploc.stage].wait(ploc.phase);
""", """      if (part == (kSS ? 1 : 0)) sm.local_full[ploc.stage].wait(ploc.phase);
      if (part == (kSS ? 1 : 0) && sw == 0 && warp == 0) FGDN_TRACE(21, j);
      if (part == (kSS ? 1 : 0) && sw == 1 && warp == 0) FGDN_TRACE(26, j);
"""),
  ])
else:
  edit('csrc/sm90/fwd_state.cuh', [
("""    sm.in_full[pin.stage].wait(pin.phase);
    sm.local_full[ploc.stage].wait(ploc.phase);
""", """    sm.in_full[pin.stage].wait(pin.phase);
    if (sw == 0 && warp == 0) FGDN_TRACE(20, j);
    sm.local_full[ploc.stage].wait(ploc.phase);
    if (sw == 0 && warp == 0) FGDN_TRACE(21, j);
    if (sw == 1 && warp == 0) FGDN_TRACE(26, j);
"""),
  ])
edit('csrc/sm90/fwd_state.cuh', [

("""    // ---- Y^T = yb (.) (V^T - ykf (.) X^T)""", """    if (sw == 0 && warp == 0) FGDN_TRACE(22, j);
    // ---- Y^T = yb (.) (V^T - ykf (.) X^T)"""),
("""    // ---- S^T <- decay S^T + (vd (.) Vn^T) K;  O^T = O1^T + Vn^T P^T -----------------------
    {""", """    if (sw == 0 && warp == 0) FGDN_TRACE(23, j);
    // ---- S^T <- decay S^T + (vd (.) Vn^T) K;  O^T = O1^T + Vn^T P^T -----------------------
    {"""),
("""    sm.local_empty[ploc.stage].arrive();
    const bool owned""", """    if (sw == 0 && warp == 0) FGDN_TRACE(24, j);
    sm.local_empty[ploc.stage].arrive();
    const bool owned"""),
("""    sm.in_empty[pin.stage].arrive();
    if (p.ckpt.data""", """    sm.in_empty[pin.stage].arrive();
    if (sw == 0 && warp == 0) FGDN_TRACE(25, j);
    if (sw == 1 && warp == 0) FGDN_TRACE(27, j);
    if (p.ckpt.data"""),
])
edit('csrc/sm90/fwd_launch_kernel.cuh', [
("""#include "sm90/fwd_kernel.cuh"
""", """#include "sm90/fwd_kernel.cuh"

#include <cstdio>
#include <cstdlib>
#include <vector>
"""),
("""  kern<<<static_cast<unsigned>(items), Tr::kThreads, smem, stream>>>(fp);
  FGDN_CHECK_LAUNCH("gdn_fwd_kernel");""", """  static unsigned long long* tbuf = nullptr;
  const char* tpath = std::getenv("FLASHGDN_TRACE");
  FwdParams f2 = fp;
  if (tpath != nullptr) {
    if (tbuf == nullptr) cudaMalloc(&tbuf, 32 * 16 * 8);
    cudaMemsetAsync(tbuf, 0, 32 * 16 * 8, stream);
    f2.trace = tbuf;
  }
  kern<<<static_cast<unsigned>(items), Tr::kThreads, smem, stream>>>(f2);
  FGDN_CHECK_LAUNCH("gdn_fwd_kernel");
  if (tpath != nullptr) {
    std::vector<unsigned long long> h(32 * 16);
    cudaMemcpyAsync(h.data(), tbuf, h.size() * 8, cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    if (FILE* fo = std::fopen(tpath, "w")) {
      const unsigned long long t0 = h[4 * 16];
      for (int j = 0; j < 16; ++j) {
        std::fprintf(fo, "%d", j + 16);
        for (int e = 0; e < 30; ++e) std::fprintf(fo, " %lld", h[e * 16 + j] ? (long long)(h[e * 16 + j] - t0) : -1LL);
        std::fprintf(fo, "\\n");
      }
      std::fclose(fo);
    }
  }"""),
])
