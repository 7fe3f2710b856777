# Device: flashgdn forward with automatic CP against CP off, per cell (CUDA graph replays, events,
# median of 5 x 20 replays). PYTHONPATH=/tmp/site python3 .gpu/cpab.py
import sys, statistics, torch
sys.path.insert(0, "bench")
import flashgdn
from gdnbench.configs import FWD_LAYOUTS
from gdnbench.inputs import make_inputs
HEADS = [(16, 64), (8, 32), (4, 16), (2, 8), (2, 6), (4, 4), (8, 16), (16, 16), (16, 32)]
def timed(x, cp):
    f = lambda: flashgdn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"],
        initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"],
        cu_seqlens_cpu=x["cu_host"], context_parallel=cp)
    for _ in range(3): f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
        with torch.cuda.graph(g): f()
    torch.cuda.current_stream().wait_stream(s)
    ms = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20): g.replay()
        b.record(); torch.cuda.synchronize(); ms.append(a.elapsed_time(b) / 20)
    return statistics.median(ms)
want = sys.argv[1].split(",") if len(sys.argv) > 1 else None
for hq, hv in HEADS:
    for lay in FWD_LAYOUTS:
        if want and not any(w in lay.name for w in want): continue
        x = make_inputs(hq, hv, lay)
        x.setdefault("scale", 128 ** -0.5)
        a, o = timed(x, None), timed(x, False)
        print(f"{hq}/{hv} {lay.name:32} auto {a:.3f} off {o:.3f} {'OFF-FASTER' if o < 0.97 * a else ''}", flush=True)
        del x; torch.cuda.empty_cache()
