"""CPU test of bench/ncu_stalls.py's grouping of Nsight Compute's stall samples by role and stage of
the fused walk (--sass): a synthetic kernel source, nvdisasm line table and ncu CSV whose every
sample has a known place, so a wrong join (offsets, innermost line, role or stage boundary) moves
samples between rows."""
import subprocess
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"

SOURCE = textwrap.dedent("""\
    void walk() {
      if (wg == 3) {  // ---- producer: loads
        load();
      } else if (wg == 0) {  // ---- C: the carry
        wait_stage();
        if (s == 1) {
          decay();
        }
        if (s == 11) {
          product();
        }
      } else {  // ---- R: recompute
        wait_stage();
        if (s == 7) {
          staged();
        }
      }
    }
    """)
# Offsets 0x00-0x50 of the profiled function; each instruction's table innermost first, the
# kernel file's line reached through a helper (ptx.cuh) for the waits.
SASS = textwrap.dedent("""\
    .text._Zother:
    \t//## File "/x/bwd_fused_kernel.cuh", line 7
    \t/*0000*/ FADD R0, R0, R0 ;
    .text._ZN8flashgdn4sm909fused_bwd9fused_bwdILb1EEEvNS1_6ParamsE:
    \t//## File "/x/bwd_fused_kernel.cuh", line 3
    \t/*0000*/ LDG R1, [R2] ;
    \t//## File "/x/ptx.cuh", line 40 inlined at "/x/bwd_fused_kernel.cuh", line 5
    \t//## File "/x/bwd_fused_kernel.cuh", line 5
    \t/*0010*/ SYNCS.PHASECHK P0, [R3] ;
    \t//## File "/x/bwd_fused_kernel.cuh", line 7
    \t/*0020*/ FMUL R4, R4, R5 ;
    \t//## File "/x/bwd_fused_kernel.cuh", line 10
    \t/*0030*/ HGMMA.64x128x16 R8, gdesc[UR4], R8 ;
    \t//## File "/x/frag.cuh", line 9 inlined at "/x/bwd_fused_kernel.cuh", line 15
    \t//## File "/x/bwd_fused_kernel.cuh", line 15
    \t/*0040*/ STS [R6], R7 ;
    \t//## File "/x/bwd_fused_kernel.cuh", line 18
    \t/*0050*/ EXIT ;
    """)
# Samples (long scoreboard, no instruction) at each offset, from base 0x7f00.
SAMPLES = {0x00: (5, 0), 0x10: (40, 2), 0x20: (0, 7), 0x30: (1, 3), 0x40: (2, 20), 0x50: (0, 1)}


def test_by_stage_groups_samples_by_role_and_stage(tmp_path):
    (tmp_path / "bwd_fused_kernel.cuh").write_text(SOURCE)
    (tmp_path / "walk.sass").write_text(SASS)
    rows = ['"ID","Kernel Name"', '"1","fused_bwd"',
            '"Address","Source","stall_long_sb","stall_no_inst","stall_long_sb (Not Issued)"']
    rows += [f'"0x{0x7f00 + off:x}","X","{a}","{b}","99"' for off, (a, b) in SAMPLES.items()]
    (tmp_path / "walk.csv").write_text("\n".join(rows) + "\n")
    out = subprocess.run([sys.executable, str(BENCH / "ncu_stalls.py"), str(tmp_path / "walk.csv"), "--sass",
                          str(tmp_path / "walk.sass"), "--source", str(tmp_path / "bwd_fused_kernel.cuh")],
                         capture_output=True, text=True, check=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] in ("P", "C", "D", "R", "other") and parts[2].isdigit():
            table[(parts[0], parts[1])] = (int(parts[2]), int(parts[4]))
    # (samples, instructions): the producer's load; C's waits (through ptx.cuh), its stage 1 and
    # 11; R's stage 7 (through frag.cuh); the function's last line outside every role.
    assert table == {("P", "-"): (5, 1), ("C", "-"): (42, 1), ("C", "1"): (7, 1), ("C", "11"): (4, 1),
                     ("R", "7"): (22, 1), ("other", "-"): (1, 1)}, out
    assert "C:  65.4% of samples, 3 instructions" in out, out  # 53 of 81


def test_code_sizes_counts_each_stage_and_the_change_from_a_base(tmp_path):
    """--sass without a CSV: the instructions of each role and stage, and against a base listing
    (here the same kernel with R's stage 7 store become two) the change and its opcodes."""
    (tmp_path / "bwd_fused_kernel.cuh").write_text(SOURCE)
    (tmp_path / "walk.sass").write_text(SASS)
    base = SASS.replace("\t/*0040*/ STS [R6], R7 ;\n", "\t/*0040*/ STS [R6], R7 ;\n\t/*0048*/ @!P0 STS.64 [R6], R8 ;\n")
    base = base.replace("\t/*0020*/ FMUL R4, R4, R5 ;", "\t/*0020*/ FFMA R4, R4, R5, R4 ;")
    (tmp_path / "base.sass").write_text(base)
    out = subprocess.run([sys.executable, str(BENCH / "ncu_stalls.py"), "--sass", str(tmp_path / "walk.sass"),
                          "--source", str(tmp_path / "bwd_fused_kernel.cuh"), "--base-sass", str(tmp_path / "base.sass")],
                         capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] in ("P", "C", "D", "R", "other") and parts[2].isdigit():
            rows[(parts[0], parts[1])] = (int(parts[2]), int(parts[3]), " ".join(parts[5:]))
    # (instructions, the base's, the opcodes that changed): the other function's FADD counts nowhere.
    assert rows == {("P", "-"): (1, 1, ""), ("C", "-"): (1, 1, ""), ("C", "1"): (1, 1, "FFMA -1, FMUL +1"),
                    ("C", "11"): (1, 1, ""), ("R", "7"): (1, 2, "STS -1"), ("other", "-"): (1, 1, "")}, out
    assert "R: 1 instructions, base 2" in out, out
