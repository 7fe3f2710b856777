"""Where a context-parallel call's time goes, per benchmark cell, from CUDA graph replays of one
flashgdn forward call with the benchmark's inputs (gdnbench.inputs: realistic gates, head 0
without decay).

    python bench/cp_timeline.py "2/8 1x2048;4/16 1x8192"
        each cell's replay time with CP automatic and off, and the end of every kernel of the
        automatic call (bounds, certify, plan, fwd, scan, correct, fwd), in us after the first
        kernel's start: the median of four replays under torch.profiler.

    python bench/cp_timeline.py --segments "2/8 1x32768:16,20,24;4/16 1x16384:12,16,20"
        each cell's replay time with CP automatic, then with CP on at each fixed segment length
        (cp_segment = 64 L tokens): which L the cost model should pick.

    --saved-states: the forward that also writes the chunk-start states for the backward (what
        autograd's forward runs on the fused backward's calls: chunk_gated_delta_rule_fwd with
        saved_states), whose CP walks the exact segments a second time for them.

    --seed N: the benchmark's input set N (it rotates sets 0, 1, .., two for the largest cells;
        the plan's choice follows the gates, and at step 32e 8/32 mix32768 declined to split with
        set 1 only: bench/NOTES.md).

Times are medians of five runs of 20 replays (CUDA events). bench/NOTES.md has the readings.
"""
import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import flashgdn
from gdnbench.configs import FWD_LAYOUTS
from gdnbench.inputs import make_inputs

LAYOUTS = {layout.name: layout for layout in FWD_LAYOUTS}
KERNELS = ("bounds", "certify", "plan", "scan", "correct", "pack_rows", "checkpoint")


SEED = 0  # the input set (--seed)
SAVED_STATES = False  # the saving forward (--saved-states)


def cell_inputs(cell):
    heads, layout = cell.split()
    hq, hv = map(int, heads.split("/"))
    x = make_inputs(hq, hv, LAYOUTS[layout], seed=SEED)
    x.setdefault("scale", 128 ** -0.5)
    return x


def captured(x, cp, segment=0):
    """A CUDA graph of one forward call (after three warm-up calls on a side stream)."""
    saved = None
    if SAVED_STATES:
        from flashgdn._core import saved_states_rows
        rows = saved_states_rows(x["q"], x["k"], x["v"], x["cu"])
        if rows == 0:
            raise SystemExit("cp_timeline.py --saved-states: this call saves no states (not the fused backward's)")
        hv, d = x["v"].shape[2], x["v"].shape[3]
        saved = torch.empty(rows, hv, d, d, dtype=torch.bfloat16, device=x["q"].device)

    def call():
        if saved is not None:
            flashgdn.chunk_gated_delta_rule_fwd(
                x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], True, True, x["cu"],
                cu_seqlens_host=x["cu_host"], context_parallel=cp, cp_segment=segment, saved_states=saved)
            return
        flashgdn.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"],
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"],
            cu_seqlens_cpu=x["cu_host"], context_parallel=cp, cp_segment=segment)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
        with torch.cuda.graph(graph):
            call()
    torch.cuda.current_stream().wait_stream(side)
    return graph


def replay_us(graph, runs=5, replays=20):
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays * 1e3)
    return statistics.median(times)


def short_name(name):
    for k in KERNELS:
        if k in name:
            return k
    return "fwd" if "gdn_fwd" in name else name[:30]


def kernel_ends(graph, replays=4):
    """Each kernel's end, us after the replay's first kernel started (median over replays)."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    per = len(events) // replays  # the same kernels every replay
    ends = [[] for _ in range(per)]
    for r in range(replays):
        run = events[r * per:(r + 1) * per]
        for i, e in enumerate(run):
            ends[i].append(e.time_range.end - run[0].time_range.start)
    return [(short_name(events[i].name), statistics.median(ends[i])) for i in range(per)]


def timeline(cells):
    for cell in cells:
        x = cell_inputs(cell)
        auto, off = captured(x, None), captured(x, False)
        ends = " ".join(f"{name} {t:.1f}" for name, t in kernel_ends(auto))
        print(f"{cell:16} auto {replay_us(auto):7.1f} us  off {replay_us(off):7.1f} us  | kernel ends: {ends}",
              flush=True)
        del x, auto, off
        torch.cuda.empty_cache()


def segments(specs):
    for spec in specs:
        cell, lengths = spec.split(":")
        x = cell_inputs(cell)
        line = f"{cell:16} auto {replay_us(captured(x, None)):7.1f} us |"
        for L in map(int, lengths.split(",")):
            line += f" L{L} {replay_us(captured(x, True, 64 * L)):7.1f}"
        print(line, flush=True)
        del x
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cells", help='";"-separated cells, e.g. "2/8 1x2048;4/16 1x8192" (with --segments: "CELL:L,L,..")')
    ap.add_argument("--segments", action="store_true", help="replay times at fixed segment lengths L (chunks)")
    ap.add_argument("--seed", type=int, default=0, help="the benchmark's input set (default 0)")
    ap.add_argument("--saved-states", action="store_true", help="the forward that writes the backward's states")
    args = ap.parse_args()
    global SEED, SAVED_STATES
    SEED = args.seed
    SAVED_STATES = args.saved_states
    if not torch.cuda.is_available():
        raise SystemExit("cp_timeline.py: no CUDA device")
    specs = [c.strip() for c in args.cells.split(";") if c.strip()]
    if args.segments:
        segments(specs)
    else:
        timeline(specs)


if __name__ == "__main__":
    main()
