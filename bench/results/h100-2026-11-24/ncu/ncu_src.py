# Condense ncu's source page (SASS, CSV) to the instructions that matter.
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
# find header row
h = next(i for i, r in enumerate(rows) if any("Source" == c or c.startswith("Source") for c in r) and len(r) > 5)
hdr = rows[h]; data = [r for r in rows[h + 1:] if len(r) == len(hdr)]
print("columns:", hdr)
def col(name):
    for i, c in enumerate(hdr):
        if c.startswith(name): return i
    return None
src = col("Source"); addr = col("Address")
def num(x):
    try: return float(x.replace(",", ""))
    except: return 0.0
for key in ["Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)", "L1 Wavefronts Shared Excessive", "L2 Theoretical Sectors Global Excessive", "Instructions Executed"]:
    c = col(key)
    if c is None: print("no column", key); continue
    tot = sum(num(r[c]) for r in data)
    print(f"\n== top by {key} (total {tot:.0f})")
    for r in sorted(data, key=lambda r: -num(r[c]))[:45]:
        print(f"{num(r[c]):10.0f} {100*num(r[c])/max(tot,1):5.1f}% {r[addr] if addr is not None else ''} {r[src][:90]}")
# per-opcode aggregate of stall samples
c = col("Warp Stall Sampling (All Samples)")
agg = collections.Counter()
for r in data: agg[r[src].split()[0] if not r[src].startswith("@") else r[src].split()[1]] += num(r[c])
print("\n== stall samples by opcode"); [print(f"{v:10.0f} {k}") for k, v in agg.most_common(30)]
