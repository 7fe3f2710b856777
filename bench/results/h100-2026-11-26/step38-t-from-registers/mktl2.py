# Diagnostic only (never lands): clock64 stamps at 17 points of CTA 0's chunk loop, printed by one
# state thread at the kernel's end ("TL pos v0 .. v16").
import sys
root = sys.argv[1]
def edit(rel, old, new, count=1):
    p = f"{root}/{rel}"; s = open(p).read()
    assert s.count(old) == count, (rel, old, s.count(old)); s = s.replace(old, new); open(p, "w").write(s)
edit("csrc/sm90/fwd_smem.cuh", "namespace flashgdn::sm90 {\n",
     "namespace flashgdn::sm90 {\nstatic __device__ long long g_tl[20][160];\n"
     "#define TL(pt, pos) do { if (blockIdx.x == 0 && (pos) < 160) g_tl[pt][pos] = clock64(); } while (0)\n")
edit("csrc/sm90/fwd_load.cuh", "    sm.in_empty[pos.stage].wait(pos.phase ^ 1);\n    Mbarrier* full", "    TL(19, c0 + j);\n    sm.in_empty[pos.stage].wait(pos.phase ^ 1);\n    Mbarrier* full")
edit("csrc/sm90/fwd_load.cuh", "    full->arrive_expect_tx(Tr::kTmaBytes);\n",
     "    full->arrive_expect_tx(Tr::kTmaBytes);\n    TL(0, c0 + j);\n")
edit("csrc/sm90/fwd_load.cuh", "    sm.in_ready[pos.stage].arrive();\n",
     "    if (lane == 0) TL(4, c0 + j);\n    sm.in_ready[pos.stage].arrive();\n")
edit("csrc/sm90/fwd_row_norms.cuh", "    sm.in_full[pos.stage].wait(pos.phase);\n",
     "    sm.in_full[pos.stage].wait(pos.phase);\n    if (lane == 0 && is_k == 0) TL(1, c0 + j);\n")
edit("csrc/sm90/fwd_row_norms.cuh", "    sm.in_ready[pos.stage].arrive();\n",
     "    if (lane == 0) TL(2 + is_k, c0 + j);\n    sm.in_ready[pos.stage].arrive();\n")
cl = "csrc/sm90/fwd_chunk_local.cuh"
edit(cl, "    sm.in_ready[pin.stage].wait(pin.phase);\n", "    if (tid_in == 0) TL(17, c0 + j);\n    sm.in_ready[pin.stage].wait(pin.phase);\n    if (tid_in == 0) TL(5, c0 + j);\n")
edit(cl, "      wgmma_wait<0>();\n      fence_regs(kk);\n", "      wgmma_wait<0>();\n      if (tid_in == 0) TL(6, c0 + j);\n      fence_regs(kk);\n")
edit(cl, "    named_barrier_sync(kBar, 128);  // every T_ww; A's blocks left of the diagonal\n",
     "    named_barrier_sync(kBar, 128);  // every T_ww; A's blocks left of the diagonal\n    if (tid_in == 0) TL(7, c0 + j);\n")
edit(cl, "    fence_proxy_async();\n    sm.local_full[ploc.stage].arrive();\n", "    if (tid_in == 0) TL(8, c0 + j);\n    fence_proxy_async();\n    sm.local_full[ploc.stage].arrive();\n")
edit(cl, "    sm.local_full[ploc.stage].arrive();\n", "    sm.local_full[ploc.stage].arrive();\n    if (tid_in == 0) TL(9, c0 + j);\n")
edit(cl, "    named_barrier_sync(kBar, 128);\n  }\n", "    named_barrier_sync(kBar, 128);\n    if (tid_in == 0) TL(10, c0 + j);\n  }\n")
st = "csrc/sm90/fwd_state.cuh"
edit(st, "    sm.in_ready[pin.stage].wait(pin.phase);\n", "    if (sw == 0 && tid == 0) TL(18, c0 + j);\n    sm.in_ready[pin.stage].wait(pin.phase);\n    if (sw == 0 && tid == 0) TL(11, c0 + j);\n")
edit(st, "    // ---- Y^T = yb (.) (V^T - ykf (.) X^T)", "    if (sw == 0 && tid == 0) TL(12, c0 + j);\n    // ---- Y^T = yb (.) (V^T - ykf (.) X^T)")
edit(st, "    float vn[32] = {};\n", "    if (sw == 0 && tid == 0) TL(13, c0 + j);\n    float vn[32] = {};\n")
edit(st, "    // ---- S^T <- decay S^T", "    if (sw == 0 && tid == 0) TL(14, c0 + j);\n    // ---- S^T <- decay S^T")
edit(st, "    sm.local_empty[ploc.stage].arrive();\n", "    if (sw == 0 && tid == 0) TL(15, c0 + j);\n    sm.local_empty[ploc.stage].arrive();\n")
edit(st, "    sm.in_empty[pin.stage].arrive();\n", "    sm.in_empty[pin.stage].arrive();\n    if (sw == 0 && tid == 0) TL(16, c0 + j);\n")
edit("csrc/sm90/fwd_kernel.cuh", "    if (tid == 0) bulk_wait_group<0>();  // o's TMA stores (store_output) written before the CTA ends\n  }\n#endif",
     "    if (tid == 0) bulk_wait_group<0>();  // o's TMA stores (store_output) written before the CTA ends\n  }\n"
     "  __syncthreads();\n  if (blockIdx.x == 0 && threadIdx.x == 256) {\n    for (int c = 0; c < 160; ++c) {\n      long long* v[20]; for (int k = 0; k < 20; ++k) v[k] = &g_tl[k][c];\n"
     "      if (*v[16] == 0) continue;\n"
     "      printf(\"TL %d %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld\\n\", c, *v[0], *v[1], *v[2], *v[3], *v[4], *v[5], *v[6], *v[7], *v[8], *v[9], *v[10], *v[11], *v[12], *v[13], *v[14], *v[15], *v[16], *v[17], *v[18], *v[19]);\n"
     "      for (int k = 0; k < 20; ++k) *v[k] = 0;\n    }\n  }\n#endif")
