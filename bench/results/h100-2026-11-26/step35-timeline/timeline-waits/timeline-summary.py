# Summarise "TL pos v0..v16" lines: per point, the median offset from the chunk's TMA issue (point 0),
# over chunks lo..hi of every launch; the period from point 16 (o stored) of consecutive chunks.
import sys, statistics, collections
lo, hi = int(sys.argv[2]), int(sys.argv[3])
names = ["tma issued", "q-norm: tiles landed", "q-norm done", "k-norm done", "gates done",
         "local: in_ready", "local: grams done", "local: gated+diag blocks (barrier)", "local: T rows stored",
         "local: local_full arrive", "local: end barrier", "state: in_ready", "state: [O1|X] + local_full",
         "state: Y formed", "state: Vn done", "state: S, O done", "state: o stored, in_empty", "local: before in_ready wait", "state: before in_ready wait", "tma: before in_empty wait"]
runs = []  # list of dict pos -> values
cur = {}
for line in open(sys.argv[1]):
    if not line.startswith("TL "): continue
    f = line.split(); pos = int(f[1]); v = list(map(int, f[2:]))
    if pos in cur:
        runs.append(cur); cur = {}
    cur[pos] = v
if cur: runs.append(cur)
off = collections.defaultdict(list); per = collections.defaultdict(list)
for r in runs:
    for pos in range(lo, hi):
        if pos not in r or pos + 1 not in r: continue
        for k in range(len(v)): off[k].append(r[pos][k] - r[pos][0])
        for k in (0, 5, 10, 11, 16): per[k].append(r[pos + 1][k] - r[pos][k])
print(f"{len(runs)} launches, chunks {lo}..{hi - 1}")
for k in range(len(off)): print(f"  {k:2} {names[k]:38} {statistics.median(off[k]):8.0f}")
for k in per: print(f"  period at point {k:2} ({names[k]}): {statistics.median(per[k]):.0f} cycles")
