"""The one seam between npattn and array libraries.

Library code never imports NumPy or CuPy to compute: it asks this module for
the Array API namespace of its inputs (``xp = namespace(q, k, v)``) and then
calls only functions of the Python Array API standard on ``xp``.

Everything backend-specific lives here, each piece with a standard fallback:

* ``resolve_backend``: the module's ``backend=`` argument -> a namespace;
* ``to_numpy`` / ``from_numpy``: host copies, used by the gradient checker
  and by the dropout generator;
* ``keep_mask``: draws a dropout keep-mask from a seeded NumPy generator, on
  the host, so that one seed gives one mask on every backend;
* ``limit_blas_threads``: holds host BLAS to n threads (threadpoolctl), or
  does nothing when it is not installed.

CuPy and torch are imported only when asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import array_api_compat
import numpy as np

__all__ = [
    "BACKENDS",
    "namespace",
    "resolve_backend",
    "backend_name",
    "device_of",
    "check_same_device",
    "to_numpy",
    "from_numpy",
    "is_floating",
    "is_bool",
    "keep_mask",
    "make_rng",
    "limit_blas_threads",
]

#: Names accepted by ``backend=``, and the module that provides each namespace.
BACKENDS = {
    "numpy": "array_api_compat.numpy",
    "cupy": "array_api_compat.cupy",
    "torch": "array_api_compat.torch",
    "array_api_strict": "array_api_strict",
}


def namespace(*arrays):
    """The Array API namespace shared by ``arrays`` (``None`` entries ignored).

    Raises ``TypeError`` when the arrays come from different libraries.
    """
    arrays = [a for a in arrays if a is not None]
    try:
        return array_api_compat.array_namespace(*arrays)
    except TypeError as exc:
        kinds = sorted({type(a).__module__ + "." + type(a).__name__ for a in arrays})
        raise TypeError(
            f"arrays from different array libraries were mixed: {', '.join(kinds)}; "
            "pass every array from one backend"
        ) from exc


def resolve_backend(backend):
    """Turn ``backend=`` (a name in ``BACKENDS`` or a namespace module) into a namespace."""
    if isinstance(backend, types.ModuleType):
        if backend.__name__ in ("numpy", "cupy", "torch"):
            return importlib.import_module("array_api_compat." + backend.__name__)
        if not hasattr(backend, "asarray") or not hasattr(backend, "matmul"):
            raise TypeError(
                f"backend: expected an Array API namespace module, got module {backend.__name__!r}"
            )
        return backend
    if not isinstance(backend, str):
        raise TypeError(
            f"backend: expected one of {sorted(BACKENDS)} or a namespace module, "
            f"got {type(backend).__name__}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {backend!r}")
    try:
        return importlib.import_module(BACKENDS[backend])
    except ImportError as exc:
        raise ImportError(
            f"backend {backend!r} needs a package that is not installed ({exc})"
        ) from exc


def backend_name(xp) -> str:
    """A short name for a namespace: 'numpy', 'cupy', 'torch', 'array_api_strict' or its module name."""
    name = xp.__name__
    for short, module in BACKENDS.items():
        if name == module or name == short:
            return short
    return name


def device_of(x):
    """The device of array ``x``, as the Array API ``device=`` arguments take it."""
    return array_api_compat.device(x)


def check_same_device(**arrays):
    """Raise ``ValueError`` naming the first array that is not on the device of the first one.

    ``None`` entries are ignored. Libraries disagree on what mixing devices
    does (an error, a silent copy); npattn refuses it up front.
    """
    items = [(name, a) for name, a in arrays.items() if a is not None]
    if not items:
        return
    first, a0 = items[0]
    d0 = device_of(a0)
    for name, a in items[1:]:
        d = device_of(a)
        if d != d0:
            raise ValueError(f"{name}: expected an array on device {d0!r} like {first}, got device {d!r}")


def is_floating(xp, x) -> bool:
    """Whether array ``x`` (any shape) has a real floating dtype."""
    return xp.isdtype(x.dtype, "real floating")


def is_bool(xp, x) -> bool:
    """Whether array ``x`` (any shape) is boolean."""
    return xp.isdtype(x.dtype, "bool")


def to_numpy(x) -> np.ndarray:
    """A host NumPy copy of ``x`` (any supported backend), of the same shape and dtype."""
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
    if array_api_compat.is_cupy_array(x):
        return x.get()
    if array_api_compat.is_torch_array(x):
        return x.detach().cpu().numpy().copy()
    return np.array(np.from_dlpack(x), copy=True)


def from_numpy(a: np.ndarray, xp, device=None):
    """Host array ``a`` as an array of namespace ``xp`` on ``device``, of the same shape and dtype."""
    return xp.asarray(np.ascontiguousarray(a), device=device)


def make_rng(seed) -> np.random.Generator:
    """A NumPy ``Generator`` from ``seed`` (int, ``SeedSequence``, ``Generator`` or None)."""
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def keep_mask(rng: np.random.Generator, shape, p: float, xp, device=None):
    """Boolean keep-mask of ``shape``: each entry True with probability ``1 - p``.

    Drawn on the host from ``rng`` (float64 uniforms, ``u >= p``), then moved to
    ``xp`` on ``device``, so the same seed gives the same mask on every backend.
    """
    keep = rng.random(tuple(int(s) for s in shape)) >= p  # [*shape] bool
    return from_numpy(keep, xp, device)


_blas_controller = None


def blas_controller():
    """threadpoolctl's ``ThreadpoolController`` (made once), or None when it is not installed."""
    global _blas_controller
    if _blas_controller is None:
        try:
            from threadpoolctl import ThreadpoolController

            _blas_controller = ThreadpoolController()
        except ImportError:
            _blas_controller = False
    return _blas_controller or None


def limit_blas_threads(n):
    """Context manager: host BLAS libraries (NumPy's, torch's) use at most ``n`` threads inside.

    Uses ``threadpoolctl`` when it is installed; otherwise, or with ``n`` None,
    it changes nothing. Many small matmuls (the blocked attention path) run
    far slower when BLAS threads spin against other work for the cores.
    """
    ctl = blas_controller()
    if n is None or ctl is None:
        return contextlib.nullcontext()
    return ctl.limit(limits=int(n), user_api="blas")
