"""flashgdn as a backend of FLA's ``chunk_gated_delta_rule`` (``fla-core`` >= 0.6).

FLA 0.6 routes ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` through a backend registry
(``fla/backends.py``): for each call it tries the registered backends of the operation
``gated_delta_rule`` in order of ``priority`` (lower first), skips those that are unavailable or
disabled, asks each one's ``chunk_gated_delta_rule_verifier(*args, **kwargs)`` whether it takes
the call, runs the first that does, and falls back to FLA's own Triton kernels when none does.

``import flashgdn`` arranges the registration without importing FLA: when FLA is installed, a
meta path hook registers the backend below the moment FLA imports ``fla.backends`` (every import
of an FLA op does), or at once when it was imported before flashgdn; FLA < 0.6 is left alone.
``FLASHGDN_FLA_BACKEND=0`` at ``import flashgdn`` skips all of it (FLA is not even looked up);
set later it turns the backend off from the next call (FLA reads ``env_var`` per call;
``FLA_FLASHGDN=1`` forces it on, FLA's rule for every backend type). Since FLA reads
``FLA_DISABLE_BACKEND_DISPATCH`` when it imports ``fla.backends``, deferring the import keeps that
switch working for programs that set it after importing flashgdn (the repository's peer
benchmark, bench/run.py, does).
``register()`` registers by hand (e.g. with another priority). The verifier accepts exactly the calls flashgdn runs
with FLA's meaning and declines the rest, so FLA runs them itself:

* FLA's arguments only (a keyword FLA 0.6 does not take is declined, since FLA would ignore it);
  no ``cp_context``; ``head_first`` false; ``chunk_size`` 16, 32 or 64 (flashgdn uses 64);
* shapes FLA accepts (``Hv`` a multiple of ``Hq``, one batch row with ``cu_seqlens``, as many
  initial states as sequences), every tensor on q's device;
* q, k, v of one dtype: bfloat16 or float16, float32 too on the CPU; g, beta float32, bfloat16
  or float16; initial states float32, bfloat16 or float16;
* on the CPU head dims K, V in {16, 32, 64, 128, 256}; on CUDA a build with the CUDA backend, a
  device of compute capability 9.0 and K = V in {64, 128}.

A declined call is not silent. FLA logs the reason at INFO level only
(``logging.getLogger("fla.backends")``), so the backend says it itself: on CUDA (and any device
but the CPU) the call still goes to FLA's kernels, with a ``DeclinedWarning`` once per distinct
reason; on CPU tensors, which FLA's Triton kernels cannot run (they fail with "0 active drivers"),
the backend takes the call and raises ``DeclinedError`` (a ValueError) with flashgdn's reason
instead. A call that does not bind to FLA's signature is left to FLA's own TypeError.

The backend returns what FLA returns: ``(o, final_state)``, ``o`` in q's dtype and the final
state in float32 whatever the initial state's dtype (``flashgdn.chunk_gated_delta_rule``'s
default is FLA's), and is differentiable like FLA's.

Priority: ``PRIORITY`` = 4, after FlashQLA's 3 and before the default 5, from measurement
(docs/engines.md; ``bench/fla_dispatch.py``): routed through FLA's dispatch, flashgdn's forward
is 1.5-1.9x FLA's own on the H100 and has a backward where FLA 0.6.0 refuses its own (Hopper,
Triton < 3.7.1); FlashQLA's forward is even with flashgdn's but its backward is ~14x faster.
``FLASHGDN_FLA_PRIORITY=n`` (an integer, read when the backend is registered) overrides it.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys
import warnings
from typing import Any, Optional, Tuple

import torch

__all__ = ["BACKEND_TYPE", "ENV_VAR", "PRIORITY", "PRIORITY_ENV_VAR", "MIN_FLA_VERSION",
           "DeclinedError", "DeclinedWarning", "verify", "verify_dispatch", "run", "make_backend_class",
           "register", "register_if_installed"]

BACKEND_TYPE = "flashgdn"
ENV_VAR = "FLASHGDN_FLA_BACKEND"
PRIORITY_ENV_VAR = "FLASHGDN_FLA_PRIORITY"
PRIORITY = 4
OPERATION = "gated_delta_rule"
MIN_FLA_VERSION = (0, 6)


def _fla_signature(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                   chunk_indices=None, cp_context=None, **kwargs):
    """FLA 0.6's ``chunk_gated_delta_rule`` signature (fla/ops/gated_delta_rule/chunk.py), for
    binding a call the way FLA does."""


_FLA_SIG = inspect.signature(_fla_signature)
# Keywords FLA 0.6 reads from its **kwargs, and chunk_offsets (a hint FLA ignores).
_FLA_KWARGS = ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size", "head_first",
               "transpose_state_layout", "chunk_offsets")
_QKV_DTYPES_CUDA = (torch.bfloat16, torch.float16)
_QKV_DTYPES_CPU = (torch.bfloat16, torch.float16, torch.float32)
_SCALAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEAD_DIMS_CPU = (16, 32, 64, 128, 256)
_HEAD_DIMS_CUDA = (64, 128)


class DeclinedError(ValueError):
    """A call of FLA's ``chunk_gated_delta_rule`` on CPU tensors that flashgdn declines: FLA's own
    kernels (Triton) need a GPU, so no backend can run it; the message says why flashgdn declined."""


class DeclinedWarning(UserWarning):
    """flashgdn declined a call of FLA's ``chunk_gated_delta_rule`` and FLA runs it on its own
    kernels; issued once per distinct reason."""


def _bind(args, kwargs) -> dict:
    b = _FLA_SIG.bind(*args, **kwargs)
    b.apply_defaults()
    out = dict(b.arguments)
    out.update(out.pop("kwargs"))
    return out


def _cuda_ok(device: torch.device) -> Optional[str]:
    from . import _core

    if not _core.has_cuda():
        return "this flashgdn build has no CUDA backend"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"flashgdn's CUDA backend needs compute capability 9.0 (Hopper), got {cap[0]}.{cap[1]}"
    return None


def verify(*args, **kwargs) -> Tuple[bool, Optional[str]]:
    """FLA's verifier protocol: ``(True, None)`` when flashgdn runs this call of FLA's
    ``chunk_gated_delta_rule`` with FLA's meaning, else ``(False, reason)``. Never raises."""
    try:
        return _verify(*args, **kwargs)
    except Exception as e:  # a call FLA itself will judge
        return False, f"flashgdn: {type(e).__name__}: {e}"


def _verify(*args, **kwargs) -> Tuple[bool, Optional[str]]:
    try:
        a = _bind(args, kwargs)
    except TypeError as e:
        return False, f"flashgdn: not FLA's call: {e}"
    extra = sorted(set(a) - set(_FLA_SIG.parameters) - set(_FLA_KWARGS) - {"kwargs"})
    if extra:
        return False, f"flashgdn: keyword(s) {extra} are not FLA 0.6's"
    if a["cp_context"] is not None:
        return False, "flashgdn does not support context parallelism (cp_context)"
    if a.get("head_first"):
        return False, "flashgdn does not support head_first (FLA 0.6 refuses it too)"
    if a.get("chunk_size", 64) not in (16, 32, 64):
        return False, "chunk_size must be 16, 32 or 64"
    if "transpose_state_layout" in a and a["state_v_first"]:
        return False, "both state_v_first and transpose_state_layout given"
    v_first = bool(a["state_v_first"] or a.get("transpose_state_layout", False))
    q, k, v, g, beta = (a[n] for n in ("q", "k", "v", "g", "beta"))
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            return False, f"{name}: expected a {nd}-D tensor"
    B, T, Hq, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if tuple(k.shape) != (B, T, Hq, K) or tuple(v.shape[:2]) != (B, T):
        return False, "k, v: shapes do not match q"
    if Hq == 0 or Hv % Hq != 0:
        return False, f"Hv={Hv} is not a multiple of Hq={Hq}"
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            return False, f"{name}: expected shape [B, T, Hv] = {[B, T, Hv]}, got {list(t.shape)}"
        if t.dtype not in _SCALAR_DTYPES:
            return False, f"{name}: dtype {t.dtype} (flashgdn takes float32, bfloat16, float16)"
    dev = q.device
    tensors = dict(k=k, v=v, g=g, beta=beta, initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"],
                   A_log=a.get("A_log"), dt_bias=a.get("dt_bias"))
    for name, t in tensors.items():
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != dev):
            return False, f"{name}: not a tensor on {dev}, the device of q"
    if not (q.dtype == k.dtype == v.dtype):
        return False, "q, k, v: dtypes differ"
    if dev.type == "cpu":
        if q.dtype not in _QKV_DTYPES_CPU:
            return False, f"q: dtype {q.dtype}"
        if K not in _HEAD_DIMS_CPU or V not in _HEAD_DIMS_CPU:
            return False, f"head dims K={K}, V={V} (the CPU backend takes {_HEAD_DIMS_CPU})"
    elif dev.type == "cuda":
        if q.dtype not in _QKV_DTYPES_CUDA:
            return False, f"q: dtype {q.dtype} (flashgdn's CUDA backend takes bfloat16, float16)"
        if K != V or K not in _HEAD_DIMS_CUDA:
            return False, f"head dims K={K}, V={V} (flashgdn's CUDA backend takes K = V in {_HEAD_DIMS_CUDA})"
        reason = _cuda_ok(dev)
        if reason:
            return False, reason
    else:
        return False, f"device {dev} (flashgdn runs on cpu and cuda)"
    cu = a["cu_seqlens"]
    N = B
    if cu is not None:
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) or cu.shape[0] < 2:
            return False, "cu_seqlens: expected a 1-D int32/int64 tensor of N + 1 >= 2 entries"
        if B != 1:
            return False, "cu_seqlens with a batch size other than 1"
        N = cu.shape[0] - 1
    h0 = a["initial_state"]
    if h0 is not None:
        want = (N, Hv, V, K) if v_first else (N, Hv, K, V)
        if tuple(h0.shape) != want:
            return False, f"initial_state: expected shape {list(want)}, got {list(h0.shape)}"
        if h0.dtype not in _SCALAR_DTYPES:
            return False, f"initial_state: dtype {h0.dtype}"
    gate = bool(a.get("use_gate_in_kernel", False))
    if gate and a.get("A_log") is None:
        return False, "use_gate_in_kernel without A_log"
    if not gate and (a.get("A_log") is not None or a.get("dt_bias") is not None):
        return False, "A_log / dt_bias without use_gate_in_kernel (FLA ignores them there)"
    for name in ("A_log", "dt_bias"):
        t = a.get(name)
        if t is not None and tuple(t.shape) != (Hv,):
            return False, f"{name}: expected shape [Hv] = [{Hv}]"
    if a["allow_neg_eigval"] and not a["use_beta_sigmoid_in_kernel"]:
        return False, "allow_neg_eigval without use_beta_sigmoid_in_kernel"
    return True, None


def _device_type(args, kwargs) -> Optional[str]:
    """q's device type ("cpu", "cuda", ...) when the call binds to FLA's signature with q a tensor,
    else None."""
    try:
        q = _bind(args, kwargs)["q"]
    except TypeError:
        return None
    return q.device.type if isinstance(q, torch.Tensor) else None


_warned: set = set()


def _plain(reason: Optional[str]) -> str:
    r = str(reason)
    return r[len("flashgdn: "):] if r.startswith("flashgdn: ") else r


def verify_dispatch(*args, **kwargs) -> Tuple[bool, Optional[str]]:
    """The verifier the registered backend gives FLA: ``verify``, except that a declined call is
    never silent. On CPU tensors it is accepted, so that ``run`` raises ``DeclinedError`` with the
    reason (FLA's Triton kernels cannot run it either); elsewhere it is declined with a
    ``DeclinedWarning`` once per distinct reason (numbers aside) and FLA runs it. A call that does
    not bind to FLA's signature (or whose q is no tensor) is declined quietly: FLA's own function
    raises its error."""
    ok, reason = verify(*args, **kwargs)
    if ok:
        return ok, reason
    dev = _device_type(args, kwargs)
    if dev is None:  # not FLA's call: FLA's own function raises its error
        return False, reason
    if dev == "cpu":
        return True, None
    key = re.sub(r"\d+", "#", str(reason))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"flashgdn declined a call of FLA's chunk_gated_delta_rule: {_plain(reason)}; FLA runs it "
                      f"on its own kernels ({ENV_VAR}=0 leaves FLA's calls to FLA)", DeclinedWarning, stacklevel=2)
    return False, reason


def run(*args, **kwargs):
    """Runs an accepted call of FLA's ``chunk_gated_delta_rule`` on flashgdn: ``(o, final_state)``
    with FLA's dtypes (o in q's dtype, the final state float32: flashgdn's call returns FLA's
    dtypes by default). A call on CPU tensors that ``verify`` declines (``verify_dispatch`` lets
    it through) raises ``DeclinedError`` with the reason."""
    from .ops import chunk_gated_delta_rule

    if _device_type(args, kwargs) == "cpu":
        ok, reason = verify(*args, **kwargs)
        if not ok:
            raise DeclinedError(
                f"flashgdn declined FLA's chunk_gated_delta_rule on CPU tensors: {_plain(reason)}. FLA's own "
                f"kernels (Triton) need CUDA tensors, so nothing can run this call on the CPU: change it to one "
                f"flashgdn takes (docs/engines.md), or move the tensors to a GPU for FLA's kernels")
    return chunk_gated_delta_rule(**_bind(args, kwargs))


def _priority_from_env(default: int) -> int:
    raw = os.environ.get(PRIORITY_ENV_VAR)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{PRIORITY_ENV_VAR}: expected an integer, got {raw!r}") from None


def make_backend_class(backends: Any, priority: Optional[int] = None) -> type:
    """The backend class for FLA's registry: a subclass of ``backends.BaseBackend`` (``backends``
    is the ``fla.backends`` module, or an object with the same ``BaseBackend``)."""
    prio = _priority_from_env(PRIORITY) if priority is None else int(priority)

    class FlashGDNBackend(backends.BaseBackend):
        """flashgdn (CPU backend, Hopper CUDA backend) for FLA's chunk_gated_delta_rule. Disable
        with FLASHGDN_FLA_BACKEND=0."""

        backend_type = BACKEND_TYPE
        package_name = None  # flashgdn is imported already: always available
        env_var = ENV_VAR
        default_enable = True
        priority = prio

        def chunk_gated_delta_rule_verifier(self, *args, **kwargs):
            return verify_dispatch(*args, **kwargs)

        def chunk_gated_delta_rule(self, *args, **kwargs):
            return run(*args, **kwargs)

    return FlashGDNBackend


def register(backends: Any = None, *, priority: Optional[int] = None):
    """Registers flashgdn with FLA's backend registry for ``gated_delta_rule`` (replacing an
    earlier registration of the same backend type) and returns the registered instance.
    ``backends``: the ``fla.backends`` module (imported when None) or an object with its
    ``BaseBackend`` and ``register(operation)`` (tests pass a stand-in). ``priority``: default
    ``PRIORITY``, or ``FLASHGDN_FLA_PRIORITY``."""
    if backends is None:
        import fla.backends as backends  # noqa: PLW0127 (FLA is an optional dependency)
    for attr in ("BaseBackend", "register"):
        if not hasattr(backends, attr):
            raise TypeError(f"backends: expected FLA's backend registry module (fla.backends, "
                            f"fla-core >= 0.6) with '{attr}', got {backends!r}")
    cls = make_backend_class(backends, priority)
    backends.register(OPERATION)(cls)
    return _registered_instance(backends, cls)


def _registered_instance(backends: Any, cls: type):
    """The instance FLA's register() created (fla.backends keeps it in its registry); None when
    the registry cannot be read (a stand-in without one)."""
    get = getattr(backends, "_get_operation_registry", None)
    if get is None:
        return None
    reg = get(OPERATION)
    inst = getattr(reg, "_backends", {}).get(BACKEND_TYPE)
    return inst if isinstance(inst, cls) else None


def _version_tuple(text: str) -> Tuple[int, ...]:
    out = []
    for part in text.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _register_fla_module(backends: Any) -> bool:
    """Registers with an imported ``fla.backends`` when FLA is >= 0.6; a failure is a
    RuntimeWarning, never an error of the import that triggered it."""
    try:
        fla = sys.modules.get("fla")
        version = _version_tuple(str(getattr(fla, "__version__", "0")))
        if version < MIN_FLA_VERSION:
            return False
        register(backends)
        return True
    except Exception as e:  # never let an optional integration break an import
        warnings.warn(f"flashgdn: not registered as an FLA backend ({type(e).__name__}: {e}); "
                      f"set {ENV_VAR}=0 to skip the attempt", RuntimeWarning, stacklevel=2)
        return False


class _LoaderThenRegister:
    """Wraps the loader of ``fla.backends``: runs it, then registers flashgdn with the module
    it made."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _remove_hook()
        _register_fla_module(module)

    def __getattr__(self, name):  # get_source, get_code, ...: the real loader's
        return getattr(self._inner, name)


class _RegisterWhenFLAImports:
    """A meta path finder that waits for ``fla.backends`` to be imported (by whoever imports
    FLA's ops) and registers flashgdn right after, so that ``import flashgdn`` imports nothing
    of FLA. It removes itself once ``fla.backends`` has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "fla.backends":
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        # The hook stays until the module is executed: a mere probe (importlib.util.find_spec)
        # executes nothing, and the import that follows finds the hook again.
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderThenRegister(spec.loader)
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterWhenFLAImports)]


def register_if_installed() -> str:
    """What ``import flashgdn`` does. Returns ``"off"`` when ``FLASHGDN_FLA_BACKEND=0`` (nothing
    looked up), ``"absent"`` when FLA is not installed (nothing imported), ``"registered"`` when
    ``fla.backends`` was imported already (registered now; ``"skipped"`` for FLA < 0.6 or a
    failure, with a RuntimeWarning), else ``"deferred"``:
    a hook registers flashgdn the moment FLA imports ``fla.backends`` (which every import of an
    FLA op does), so ``import flashgdn`` never imports FLA itself. Never raises."""
    if os.environ.get(ENV_VAR, "1").strip() == "0":
        return "off"
    if "fla.backends" in sys.modules:
        return "registered" if _register_fla_module(sys.modules["fla.backends"]) else "skipped"
    try:
        if "fla" not in sys.modules and importlib.util.find_spec("fla") is None:
            return "absent"
    except Exception:  # a finder that refuses the name: not installed for our purposes
        return "absent"
    _remove_hook()
    sys.meta_path.insert(0, _RegisterWhenFLAImports())
    return "deferred"
