"""The host's decision of step 17 (cp_best_case_pays, csrc/sm90/cp_cost_model.h) in Python, over
the measured cells of cpab-b009aed.txt: for each extra pipeline cost PIPE (chunk-steps), which
cells would run without the pipeline, and the geometric-mean change of the measured times
(auto where the pipeline runs, off where it does not).  python3 decision_model.py"""
import math
import os
import re

SMS, F, FIXC, SCAN, GAIN = 132, 2, 2, 0.45, 0.9


def waves(work, length):
    return 0.0 if length <= 0 else math.ceil(work / (SMS * length)) * length


def min_chunks(balanced):
    L = 4
    while 2 * L <= balanced // 2:
        L *= 2
    return L


def best_case_pays(tokens, hv, varlen, pipe):
    c = [(t + 63) // 64 for t in tokens]
    sum_c, max_c, n = sum(c), max(c), len(c)
    slots = (sum(tokens) + 63) // 64 + n if varlen else sum_c
    Lmin = min_chunks((hv * slots + SMS - 1) // SMS)
    longest = (sum(tokens) + 63) // 64 if varlen else max_c
    if not (longest >= 2 * ((hv * slots + SMS - 1) // SMS) and longest > Lmin):
        return False  # cp_layout's shape test
    bar = GAIN * waves(hv * (sum_c + F * n), max_c + F)
    for i in range(6):
        L = Lmin << i
        if max_c <= L:
            continue
        items = sum((x + L - 1) // L if x > L else 1 for x in c)
        warm = sum(((x + L - 1) // L - 1) * hv if x > L else 0 for x in c)
        ctas1 = hv * items
        len1 = min(max_c, L) + (1 if warm else 0) + F
        cost = waves(hv * sum_c + warm + F * ctas1, len1) + SCAN * (math.ceil(max_c / L) - 1) + FIXC
        if cost + pipe < bar:
            return True
    return False


def layout(name):
    for pat, f in ((r"1x(\d+)$", lambda m: ([int(m[1])], False)),
                   (r"B(\d+)x(\d+)$", lambda m: ([int(m[2])] * int(m[1]), False)),
                   (r"(\d+)x(\d+)$", lambda m: ([int(m[2])] * int(m[1]), True))):
        m = re.match(pat, name)
        if m:
            return f(m)
    return None, None


rows = []
for line in open(os.path.join(os.path.dirname(__file__), "cpab-b009aed.txt")):
    p = line.split()
    if len(p) >= 6 and "/" in p[0] and p[2] == "auto":
        toks, vl = layout(p[1])
        if toks:
            rows.append((int(p[0].split("/")[1]), p[1], toks, vl, float(p[3]), float(p[5])))
for pipe in (0, 4, 8, 10, 12, 16, 20):
    s, off_cells, lose = 0.0, [], []
    for hv, name, toks, vl, a, o in rows:
        on = best_case_pays(toks, hv, vl, pipe)
        t = a if on else o
        s += math.log(t / a)
        if not on and o > 1.03 * a:
            lose.append(f"{hv}:{name}")
        if not on and abs(o - a) > 0.03 * a:
            off_cells.append(f"{hv}:{name}")
    print(f"PIPE {pipe:2}: geomean {math.exp(s / len(rows)) - 1:+.2%}; turned off {len(off_cells)} changed cells, "
          f"of which slower {lose}")
