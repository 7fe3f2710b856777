# Diagnostic only (never lands): globaltimer stamps at the plan kernel's passes, printed by
# thread 0 at its end (ns from the kernel's first instruction).
import sys
p = sys.argv[1] + '/csrc/sm90/fwd_context_parallel.cu'
s = open(p).read()
def once(old, new):
    global s
    assert s.count(old) == 1, old
    s = s.replace(old, new)
once('namespace flashgdn::sm90 {\n', 'namespace flashgdn::sm90 {\n__device__ __forceinline__ unsigned long long gtimer() { unsigned long long x; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(x)); return x; }\n', )
once('  grid_dependency_wait();  // the certificates\n', '  unsigned long long ts[10]; ts[0] = gtimer();\n  grid_dependency_wait();  // the certificates\n  ts[1] = gtimer();\n')
once('    block_reduce_stats(own, all, partial);\n', '    ts[3] = gtimer();\n    block_reduce_stats(own, all, partial);\n    ts[4] = gtimer();\n')
once('    if (threadIdx.x == 0) chosen = cp_pick_from(cost, cand, cost[kCpMaxCandidates]);\n', '    if (threadIdx.x == 0) chosen = cp_pick_from(cost, cand, cost[kCpMaxCandidates]);\n    ts[5] = gtimer();\n')
once('  const int32_t n_slots = static_cast<int32_t>(min(static_cast<int64_t>(base[1]), max_slots));\n', '  ts[6] = gtimer();\n  const int32_t n_slots = static_cast<int32_t>(min(static_cast<int64_t>(base[1]), max_slots));\n')
once('  // Pass 4: how many movable CTAs', '  ts[7] = gtimer();\n  // Pass 4: how many movable CTAs')
once('    t.plan[kPlanExact] = exact_count;\n', '    t.plan[kPlanExact] = exact_count;\n    ts[8] = gtimer();\n    printf("PT wait %llu p0 %llu p1 %llu red %llu pick %llu p2 %llu p3 %llu p4 %llu\\n", ts[1]-ts[0], ts[2]-ts[1], ts[3]-ts[2], ts[4]-ts[3], ts[5]-ts[4], ts[6]-ts[5], ts[7]-ts[6], ts[8]-ts[7]);\n')
# after pass 0's barrier: the first "__syncthreads();\n\n  if (cand.count == 1) {"
once('  __syncthreads();\n\n  if (cand.count == 1) {', '  __syncthreads();\n  ts[2] = gtimer();\n\n  if (cand.count == 1) {')
s = s.replace('    ts[3] = gtimer();', '    ts[3] = gtimer();')
open(p, 'w').write(s)
