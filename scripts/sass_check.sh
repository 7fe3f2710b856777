#!/usr/bin/env bash
# SASS evidence for the Hopper kernels (issues 16 and 36): per kernel of the sm_90a objects of
# csrc/sm90 and of the backward (csrc/cuda/chunk_bwd*), the count of HGMMA (wgmma), UTMALDG (TMA
# tile loads), UTMASTG, UBLKCP (1-D bulk copies), LDL/STL (local memory) and the registers and
# stack frame from `cuobjdump -res-usage`. No GPU needed.
#
#   bash scripts/sass_check.sh [BUILD_DIR]     (default build/; prints a markdown table)
#
# cuobjdump comes with the CUDA toolkit, or from PyPI: pip install nvidia-cuda-cuobjdump
# (it lands under site-packages/nvidia/cu13/bin).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
if ! command -v cuobjdump >/dev/null; then
  for d in /usr/local/cuda/bin "$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "bin"))' 2>/dev/null)"; do
    [ -x "$d/cuobjdump" ] && PATH=$PATH:$d && break
  done
fi
command -v cuobjdump >/dev/null || { echo "cuobjdump not found (pip install nvidia-cuda-cuobjdump)" >&2; exit 1; }
objs=$(find "$BUILD" \( -path '*csrc/sm90/*.o' -o -path '*csrc/cuda/chunk_bwd*.o' \) | sort)
[ -n "$objs" ] || { echo "no sm90 objects under $BUILD (build first)" >&2; exit 1; }
echo "| object | kernel | regs | stack B | HGMMA | UTMALDG | UTMASTG | UBLKCP | LDL | STL |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for o in $objs; do
  cuobjdump -res-usage "$o" 2>/dev/null | awk -v obj="$(basename "$o" .o)" '
    /Function/ { sub(/.*Function /, ""); sub(/:$/, ""); fn = $0 }
    /REG:/ { match($0, /REG:[0-9]+/); r = substr($0, RSTART + 4, RLENGTH - 4)
             match($0, /STACK:[0-9]+/); st = substr($0, RSTART + 6, RLENGTH - 6); print obj "\t" fn "\t" r "\t" st }' \
    > /tmp/sass_res.$$ || true
  cuobjdump -sass "$o" 2>/dev/null | awk '
    /Function :/ { fn = $3 }
    /HGMMA/ { h[fn]++ } /UTMALDG/ { l[fn]++ } /UTMASTG/ { s[fn]++ } /UBLKCP/ { b[fn]++ }
    /[^A-Z]LDL[. ]/ { ll[fn]++ } /[^A-Z]STL[. ]/ { sl[fn]++ }
    /Function :/ { seen[fn] = 1 }
    END { for (f in seen) print f "\t" h[f] + 0 "\t" l[f] + 0 "\t" s[f] + 0 "\t" b[f] + 0 "\t" ll[f] + 0 "\t" sl[f] + 0 }' \
    > /tmp/sass_cnt.$$
  while IFS=$'\t' read -r obj fn regs stack; do
    cnt=$(awk -F'\t' -v f="$fn" '$1 == f { print $2 " | " $3 " | " $4 " | " $5 " | " $6 " | " $7 }' /tmp/sass_cnt.$$)
    short=$(echo "$fn" | c++filt 2>/dev/null | sed -E 's/^void //; s/\([^()]*\)$//; s/\(anonymous namespace\):://g;
      s/flashgdn::(sm90|cuda):://g; s/\(Precision\)0/fast/; s/\(Precision\)1/high/; s/\(Precision\)2/split_states/' | cut -c1-90)
    echo "| $obj | \`$short\` | $regs | $stack | ${cnt:-? | ? | ? | ? | ? | ?} |"
  done < /tmp/sass_res.$$
done
rm -f /tmp/sass_res.$$ /tmp/sass_cnt.$$
