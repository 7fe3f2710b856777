"""One contender's call on one cell, shared by the timed process (cli.py) and the warm-up's
worker processes (prewarm.py): the callable that is timed, and what an exception it raises means."""
from __future__ import annotations

import re
from typing import Dict


def classify(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".lower()
    if isinstance(e, (NotImplementedError, AssertionError, ValueError)) or re.search(
            r"not supported|unsupported|refus|only support|requires? |must be|incorrect results", msg):
        return "refused"
    return "failed"


def poisoned(e: BaseException) -> bool:
    m = str(e).lower()
    return any(s in m for s in ("illegal memory access", "illegal instruction", "unspecified launch failure",
                                "device-side assert", "misaligned address", "cuda error: an illegal"))


def make_fn(torch, c, x: Dict, mode: str, stream):
    """The callable that is timed for one converted input set."""
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return c.call(x)
        return fwd
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta", "h0")]
    if mode == "fwdbwd":
        def fwdbwd():
            o, ht = c.call(x)
            return torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]))
        return fwdbwd
    with torch.cuda.stream(stream):  # backward alone: the forward once, outside the timed call
        o, ht = c.call(x)
    torch.cuda.current_stream().wait_stream(stream)

    def bwd():
        return torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]), retain_graph=True)
    return bwd
