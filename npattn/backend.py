"""The one seam between npattn and array libraries.

Library code never imports NumPy or CuPy to compute: it asks this module for
the Array API namespace of its inputs (``xp = namespace(q, k, v)``) and then
calls only functions of the Python Array API standard on ``xp``.

Everything backend-specific lives here, each piece with a standard fallback:

* ``resolve_backend``: the module's ``backend=`` argument -> a namespace;
* ``to_numpy`` / ``from_numpy``: host copies, used by the gradient checker
  and by the dropout generator;
* ``dropout_key`` / ``keep_mask``: dropout keep-masks from a counter-based
  draw. One 63-bit key is drawn from the caller's generator per forward, and
  the keep decision of entry ``(b, h, i, j)`` is a hash of the key and those
  coordinates alone (``keyed_keep_mask`` on the host; ``keyed_keep_mask_on``
  in the array library of the inputs, where on CuPy the same integer hash runs
  on the device). So the reference, the blocked path at any block size, the
  NumPy kernel at any tile size or thread count, and every backend draw the
  same mask from one seed;
* ``exclusive`` / ``limit_blas_threads`` / ``run_tasks``: the NumPy kernel's
  tile pool and the BLAS thread count it holds (see "Threads and fork" below).

CuPy and torch are imported only when asked for.

Threads and fork
----------------
OpenBLAS keeps one thread count for the whole process, and its results
change in the last bits with that count. The NumPy kernel and the blocked
path hold BLAS to one thread while their tiles run on the pool, so npattn's
attention calls (``npattn.attention``, ``npattn.blocked``, the module) take
one process-wide lock (``exclusive``): two threads that run them at once run
one after the other, each exactly as it would run alone, and the BLAS thread
count is restored before the lock is released. A hold takes threadpoolctl's
control of OpenBLAS's count (from 3.8 on, one thread at a time has it) from
another thread that has it, inside a ``threadpool_limits`` of its own, say, and
gives it up when it ends (to the next thread that sets the count); meanwhile that
thread's own changes are ignored.
The pool is created in the process that uses it and dropped in a forked child
(``os.register_at_fork``), so a child makes its own; a BLAS hold of a
parent's thread that was inside npattn at the fork (and is not in the child)
is undone there (unless the forking thread is itself inside a hold: its hold
ends as it began). Code outside the lock (``functional``, the layers) runs
beside it, its BLAS calls held to one thread while a lock holder holds BLAS,
which can change their last bits.
Forking while another thread is inside a multi-threaded OpenBLAS call can
hang in OpenBLAS's own fork handler (plain NumPy too).

Safe to share between threads: the functions, read-only input arrays.
Not safe: one ``MultiHeadAttention`` used by two threads at once (its cache
and generator are its state), one ``Generator`` given as ``rng`` to calls
in two threads at once (a call that fails puts it back in the state it
found, undoing the draws of the other thread's calls in between, which the
next draws then repeat), and your own BLAS work in another thread while
npattn holds BLAS at one thread (it runs, with one BLAS thread).
The lock is re-entrant in its own thread only: do not compute a dask graph
that holds npattn's tasks inside ``with exclusive():`` (dask's threaded
scheduler runs the tasks in other threads, which wait for the lock forever).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import numbers
import os
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Optional, Sequence

import array_api_compat
import array_api_compat.numpy
import numpy as np

from .messages import described, real_text, type_name

__all__ = [
    "isdtype",
    "keeps_dtype",
    "float64_namespace",
    "float64_result",
    "widest_int",
    "BACKENDS",
    "namespace",
    "resolve_backend",
    "backend_name",
    "backend_ref",
    "backend_from_ref",
    "is_array",
    "device_of",
    "accelerator_memory",
    "check_same_device",
    "to_numpy",
    "from_numpy",
    "is_floating",
    "is_bool",
    "scalar",
    "zero_d",
    "elementwise",
    "MAX_BYTES",
    "check_array_bytes",
    "entry_bytes",
    "check_rng",
    "check_int_seed",
    "make_rng",
    "seed_sequence",
    "dropout_key",
    "generator_kept_on_failure",
    "overflow_unreported",
    "keep_mask",
    "keyed_keep_mask",
    "keyed_keep_mask_on",
    "blas_controller",
    "limit_blas_threads",
    "exclusive",
    "pool_threads",
    "run_tasks",
    "is_numpy_array",
    "is_dask_array",
    "persisted",
    "computed",
    "without_empty_chunks",
    "copy_array",
    "may_share_memory",
    "shares_memory",
    "row_major",
    "row_max",
]

#: Names accepted by ``backend=``, and the module that provides each namespace.
BACKENDS = {
    "numpy": "array_api_compat.numpy",
    "cupy": "array_api_compat.cupy",
    "torch": "array_api_compat.torch",
    "array_api_strict": "array_api_strict",
    "jax": "jax.numpy",
    "dask": "array_api_compat.dask.array",
}


def namespace(*arrays: Any, names: Optional[Sequence[str]] = None) -> Any:
    """The Array API namespace shared by ``arrays`` (``None`` entries ignored).

    Raises ``TypeError`` when the arrays come from different libraries; with
    ``names`` (the arguments' names, one per array) it names the first array
    that is not of the first one's library.

    Parameters
    ----------
    *arrays : array or None
    names : sequence of str, optional
        The arguments' names, one per array, for the message.

    Returns
    -------
    xp : namespace
        ``array_api_compat.numpy`` for plain NumPy arrays, else
        ``array_api_compat.array_namespace``'s.

    Raises
    ------
    TypeError
        For arrays of different libraries (see above), for no array (only None), and
        for something that is not an array of any library.
    """
    present = [(i, a) for i, a in enumerate(arrays) if a is not None]
    if present and all(type(a) is np.ndarray for _, a in present):
        # what array_namespace returns for plain NumPy arrays, without its per-call
        # inspection: small models call this hundreds of times a step
        return array_api_compat.numpy
    try:
        return array_api_compat.array_namespace(*(a for _, a in present))
    except TypeError as exc:
        def kind(a: Any) -> str:
            return type(a).__module__ + "." + type(a).__name__

        kinds = sorted({kind(a) for _, a in present})
        odd = [(i, a) for i, a in present if not array_api_compat.is_array_api_obj(a)]
        if not present or odd:  # no array at all, or a value that is no array: nothing mixed
            who = "arrays" if names is None or not present else names[odd[0][0]]
            got = "nothing (or only None)" if not present else kind(odd[0][1])
            raise TypeError(f"{who}: expected an array of an array library (NumPy, CuPy, torch, "
                            f"dask, JAX or an Array API one), got {got}") from exc
        if names is not None:
            i0, a0 = present[0]
            for i, a in present[1:]:
                try:
                    array_api_compat.array_namespace(a0, a)
                except TypeError:
                    raise TypeError(f"{names[i]}: expected an array of the library of {names[i0]} "
                                    f"({kind(a0)}), got {kind(a)}") from exc
        raise TypeError(
            f"arrays from different array libraries were mixed: {', '.join(kinds)}; "
            "pass every array from one backend"
        ) from exc


def resolve_backend(backend: Any, name: str = "backend") -> Any:
    """Turn ``backend=`` (a name in ``BACKENDS`` or a namespace module) into a namespace;
    ``name`` is the argument the messages name (``xp`` where a function calls it so).

    Parameters
    ----------
    backend : str or module
        A key of ``BACKENDS``, or a namespace module: ``numpy``, ``cupy``, ``torch`` and
        ``dask.array`` themselves become array-api-compat's namespaces of them, any other
        module with ``asarray`` and ``matmul`` is taken as it is.
    name : str

    Returns
    -------
    xp : namespace

    Raises
    ------
    TypeError
        For a value that is neither a name nor a namespace module, or a module without
        ``asarray`` and ``matmul``.
    ValueError
        For a name that is not a key of ``BACKENDS``.
    ImportError
        When the package of a named backend is not installed.
    """
    if isinstance(backend, types.ModuleType):
        if backend.__name__ in ("numpy", "cupy", "torch", "dask.array"):  # their compat namespaces
            return importlib.import_module("array_api_compat." + backend.__name__)
        if not hasattr(backend, "asarray") or not hasattr(backend, "matmul"):
            raise TypeError(
                f"{name}: expected an Array API namespace module, got module {backend.__name__!r}"
            )
        return backend
    if not isinstance(backend, str):
        raise TypeError(
            f"{name}: expected one of {sorted(BACKENDS)} or a namespace module, "
            f"got {type_name(backend)}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"{name}: expected one of {sorted(BACKENDS)}, got {backend!r}")
    try:
        return importlib.import_module(BACKENDS[backend])
    except ImportError as exc:
        raise ImportError(
            f"{name} {backend!r} needs a package that is not installed ({exc})"
        ) from exc


def backend_name(xp: Any) -> str:
    """A short name for a namespace: its name in ``BACKENDS`` ('numpy', 'cupy', 'torch',
    'array_api_strict', 'jax', 'dask') or its module name."""
    name = xp.__name__
    for short, module in BACKENDS.items():
        if name == module or name == short:
            return short
    return name


def backend_ref(xp: Any) -> str:
    """The name that ``backend_from_ref`` turns back into ``xp``; TypeError if there is none.

    How ``pickle`` and ``copy.deepcopy`` carry a backend: by name, resolved again on load.
    """
    name = backend_name(xp)
    if name in BACKENDS:
        return name
    try:
        if importlib.import_module(name) is xp:
            return name  # a namespace module importable by its name, e.g. "jax.numpy"
    except ImportError:
        pass
    raise TypeError(
        f"backend: expected a backend that can be named, to copy or pickle the object: one of "
        f"{sorted(BACKENDS)} or an importable namespace module, got the namespace {name!r}, "
        f"which cannot be imported by that name"
    )


def backend_from_ref(ref: str) -> Any:
    """The namespace named by ``backend_ref``."""
    if ref in BACKENDS:
        return resolve_backend(ref)
    return resolve_backend(importlib.import_module(ref))


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array of an Array API library; a class is not one (NumPy's scalar
    types, ``np.float64`` and the like, carry ``__array_namespace__`` as their instances do,
    and ``array_api_compat.is_array_api_obj`` takes them for arrays)."""
    return not isinstance(x, type) and array_api_compat.is_array_api_obj(x)


def device_of(x: Any) -> Any:
    """The device of array ``x``, as the Array API ``device=`` arguments take it.

    Parameters
    ----------
    x : array

    Returns
    -------
    device
        ``"cpu"`` for a NumPy array, else ``array_api_compat.device(x)``.
    """
    if type(x) is np.ndarray:
        return "cpu"  # array_api_compat.device's answer for a NumPy array
    if not is_array(x):
        raise TypeError(f"x: expected an array, got {type_name(x)}")
    return array_api_compat.device(x)


def accelerator_memory(x: Any) -> Optional[int]:
    """The memory, in bytes, of the accelerator that holds array ``x``: a CUDA device's
    total memory for a CuPy array or a torch tensor on CUDA; ``None`` for arrays in host
    memory (NumPy, dask, array_api_strict, torch on the CPU) and for other libraries'
    devices (JAX's among them: their memory is not read here).

    The device's total, not what is free now, so that ``impl="auto"`` chooses the
    same implementation for the same call on the same device whatever else is
    allocated (``npattn.attention.auto_blocked``).

    Parameters
    ----------
    x : array

    Returns
    -------
    int or None
    """
    library = type(x).__module__.partition(".")[0]  # not a library's import: it may be absent
    if library == "cupy" and array_api_compat.is_cupy_array(x):
        return int(x.device.mem_info[1])  # cupy.cuda.Device.mem_info: (free, total)
    if library == "torch" and array_api_compat.is_torch_array(x) and x.device.type == "cuda":
        import torch
        return int(torch.cuda.get_device_properties(x.device).total_memory)
    return None


def check_same_device(**arrays: Any) -> None:
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
            raise ValueError(f"{name}: expected an array on device {d0!r} (like {first}), got one on "
                             f"device {d!r}")


def isdtype(xp: Any, dtype: Any, kind: Any) -> bool:
    """``xp.isdtype(dtype, kind)``, and False for a dtype outside the standard's that the
    library's ``isdtype`` refuses (NumPy raises TypeError for extension dtypes such as
    ml_dtypes' bfloat16): such a dtype is none of the standard's kinds."""
    try:
        return bool(xp.isdtype(dtype, kind))
    except TypeError:
        return False


def is_floating(xp: Any, x: Any) -> bool:
    """Whether array ``x`` (any shape) has a real floating dtype."""
    return isdtype(xp, x.dtype, "real floating")


def is_bool(xp: Any, x: Any) -> bool:
    """Whether array ``x`` (any shape) is boolean."""
    return isdtype(xp, x.dtype, "bool")


def scalar(xp: Any, value: float, like: Any) -> Any:
    """``value`` as a constant operand of ``where`` and of the elementwise functions
    (``minimum``, ``maximum``) next to ``like``: the Python float itself where the namespace
    takes one, else a 0-d array of ``like``'s dtype on ``like``'s device.

    The Array API standard takes Python scalars as operands of operators (``x * 0.5``) in
    every revision, but as arguments of ``where`` and the elementwise functions only from its
    2024.12 revision. A namespace of that revision or later (NumPy's, torch's, CuPy's and
    dask's through a recent array-api-compat, JAX's) gets the float, as npattn's constants
    are everywhere else, with nothing made or copied to a device per call; an older one
    (array-api-strict set to 2023.12; array-api-compat 1.9's NumPy namespace, which reports
    an older revision) gets a 0-d array, which promotes with ``like`` as the
    float would (to ``like``'s dtype): ``xp.where(keep, x, scalar(xp, 0.0, x))`` is
    ``xp.where(keep, x, 0.0)`` either way.

    Parameters
    ----------
    xp : namespace
        The namespace of ``like``.
    value : float
    like : array
        The other operand.

    Returns
    -------
    float or array, shape ()
        ``value`` itself, or a 0-d array of ``like``'s dtype on its device.
    """
    if str(getattr(xp, "__array_api_version__", "2021.12")) >= "2024.12":  # 'YYYY.MM' in order
        return value
    return xp.asarray(value, dtype=like.dtype, device=device_of(like))  # [] (0-d)


def elementwise(fn: Callable[..., tuple], *arrays: Any) -> tuple:
    """``fn(*arrays)``: the tuple of arrays ``fn`` returns, for an ``fn`` made of elementwise
    operations on arrays of one shape (each entry of an output a function of the inputs'
    entries at its place). On dask arrays, one task per chunk runs ``fn`` on the chunks
    and one per chunk and output takes that output (``dask.array.blockwise``): the
    operations one by one would build a layer of tasks each, whose building costs more
    than the arithmetic on small arrays (an Adam step's dozen per parameter). The numbers
    are the same: ``fn`` runs on the chunks the operations dask's would. Elsewhere,
    ``fn(*arrays)`` as it is.

    Parameters
    ----------
    fn : callable
        Takes the arrays, returns a tuple of arrays of their shape.
    *arrays : array
        Of one shape. With a dask array among them, every one is made a dask array
        chunked as the first dask array.

    Returns
    -------
    tuple of arrays
        What ``fn`` returns; on dask, one dask array per output.
    """
    if not any(is_dask_array(a) for a in arrays):
        return fn(*arrays)
    import operator

    import dask.array as da
    from dask.array.utils import meta_from_array
    chunks = next(a.chunks for a in arrays if is_dask_array(a))  # one chunking for all
    arrays = tuple(a if getattr(a, "chunks", None) == chunks else da.asarray(a).rechunk(chunks)
                   for a in arrays)
    # the outputs' types: fn on empty arrays of the chunks' types
    metas = [meta_from_array(o, ndim=len(chunks)) for o in fn(*(meta_from_array(a, ndim=1) for a in arrays))]
    ind = tuple(range(len(chunks)))
    parts = da.blockwise(fn, ind, *(x for a in arrays for x in (a, ind)), meta=metas[0])  # tuples
    return tuple(parts.map_blocks(operator.getitem, i, meta=m) for i, m in enumerate(metas))


def zero_d(y: Any) -> Any:
    """``y``, an elementwise result, as an array: NumPy's arithmetic on 0-d arrays gives a
    NumPy scalar (``np.float64``), which comes back as a 0-d array of its dtype (also where the
    caller passed a NumPy scalar, which npattn takes as an array). Every other result, and every
    other library's (they keep 0-d arrays), is ``y`` itself: no copy, and no cost beyond one
    ``isinstance``."""
    return np.asarray(y) if isinstance(y, np.generic) else y  # [] a NumPy scalar -> a 0-d array


def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy copy of ``x`` (any supported backend), of the same shape and dtype.

    A JAX bfloat16 array comes back as ml_dtypes' bfloat16 (JAX's own host type); a torch
    bfloat16 tensor, which NumPy cannot hold, is a ``TypeError``: cast it first.

    Parameters
    ----------
    x : array
        Of NumPy (a NumPy scalar too), CuPy, torch, dask, JAX or a library that exports
        its memory through DLPack (a dask array is computed).

    Returns
    -------
    numpy.ndarray
        A new array, shared with nothing (a NumPy scalar gives a 0-d array).

    Raises
    ------
    TypeError
        For a value that is not an array, and for a torch bfloat16 tensor (see above).
    """
    if isinstance(x, (np.ndarray, np.generic)):  # a NumPy scalar too, np.sum's result
        return np.array(x, copy=True)
    if array_api_compat.is_cupy_array(x):
        return x.get()
    if array_api_compat.is_torch_array(x):
        if str(x.dtype) == "torch.bfloat16":
            raise TypeError("x: expected a tensor of a dtype NumPy has, got torch.bfloat16 "
                            "(cast it first: x.float() holds it exactly)")
        return x.detach().cpu().numpy().copy()
    if array_api_compat.is_dask_array(x):
        return np.array(x.compute(), copy=True)
    if array_api_compat.is_jax_array(x):  # not DLPack, which carries no bfloat16: JAX's own
        return np.array(x, copy=True)  # host copy (bfloat16 as ml_dtypes' bfloat16)
    if not is_array(x):
        raise TypeError(f"x: expected an array, got {type_name(x)}")
    try:
        return np.array(np.from_dlpack(x), copy=True)
    except BufferError:  # NumPy before 2.1 exports no read-only array (array_api_strict's
        # broadcast views hold one): a writable copy in x's own library crosses instead
        return np.array(np.from_dlpack(array_api_compat.array_namespace(x).asarray(x, copy=True)),
                        copy=True)


def from_numpy(a: np.ndarray, xp: Any, device: Any = None) -> Any:
    """Host array ``a`` as an array of namespace ``xp`` on ``device``, of the same shape and dtype.

    Parameters
    ----------
    a : numpy.ndarray
        Or what ``numpy.asarray`` takes; one that is not C-contiguous is copied first.
    xp : namespace
    device : optional
        None: the library's default device.

    Returns
    -------
    array of ``xp``
        ``xp.asarray`` of it, which keeps the dtype where the library has it (JAX without
        ``jax_enable_x64`` makes float64 float32).
    """
    a = np.asarray(a)
    return xp.asarray(a if a.flags.c_contiguous else a.copy(order="C"), device=device)  # 0-d stays 0-d


def keeps_dtype(xp: Any, dtype: Any) -> bool:
    """Whether ``xp`` makes arrays of ``dtype`` (JAX without x64 makes float64 requests float32)."""
    if array_api_compat.is_jax_namespace(xp):  # asked without making an array: JAX would warn
        # that it truncates, and silencing that (warnings.catch_warnings) changes the process's
        # warning filters, which another thread may be reading or changing
        import jax

        return jax.dtypes.canonicalize_dtype(dtype) == dtype
    return xp.zeros((1,), dtype=dtype).dtype == dtype


def widest_int(xp: Any) -> Any:
    """int64, or int32 where ``xp`` makes no int64 arrays (JAX without x64): the dtype of
    positions, lengths and token ids."""
    return xp.int64 if keeps_dtype(xp, xp.int64) else xp.int32


def float64_namespace(xp: Any) -> Any:
    """The namespace in which a step that must run in float64 runs: ``xp`` where it makes
    float64 arrays, else NumPy's on the host (JAX without x64). The step's inputs go there
    with ``to_numpy`` and its result comes back with ``float64_result``."""
    return xp if keeps_dtype(xp, xp.float64) else resolve_backend("numpy")


def float64_result(a: Any, xp: Any, dtype: Any = None, device: Any = None) -> Any:
    """A float64 array ``a`` of ``float64_namespace(xp)`` as an ``xp`` array on ``device``,
    in ``dtype`` (default: float64, or float32 where ``xp`` has no float64)."""
    if namespace(a) is not xp:  # computed on the host (or with another handle on xp)
        host = to_numpy(a)
        if not keeps_dtype(xp, xp.float64):
            host = host.astype(np.float32)  # xp's widest float: no truncation warning
        a = from_numpy(host, xp, device)
    return a if dtype is None else xp.astype(a, dtype)


def copy_array(xp: Any, a: Any) -> Any:
    """A copy of ``a`` that shares no memory with it, in ``a``'s library, dtype and device:
    ``xp.asarray(a, copy=True)``, and ``a.clone()`` for a torch tensor.

    ``clone`` keeps the copy on ``a``'s autograd graph on every torch release, so
    torch's autograd through a forward that copies reaches ``a``. ``torch.asarray``'s
    copy of a tensor that requires grad does only from torch 2.13, which warns
    there that its default changed from ``requires_grad=False``.
    """
    if array_api_compat.is_torch_array(a):
        return a.clone()
    return xp.asarray(a, copy=True)


def may_share_memory(a: Any, b: Any) -> bool:
    """Whether writing into ``b`` may change ``a``: NumPy's and CuPy's ``may_share_memory``,
    for torch the same test on the bytes each tensor spans (two views of one storage that
    span apart, a packed key-value buffer's halves, share none), NumPy's test on the host
    memory a library exports through DLPack (array_api_strict's); for arrays that have no
    memory to export (dask's, whose assignments replace a graph, torch's on the meta
    device), whether they are one object; True for an array whose library will not export
    its memory (``BufferError``: a read-only view, a broadcast one say, before NumPy 2.1),
    as the writers then copy it, which is always safe.

    torch refuses an assignment whose source overlaps its destination (a ``RuntimeError``
    that names no argument), and a writer of two buffers would read the second's source
    after writing the first: a writer copies a source that may share memory first.

    Parameters
    ----------
    a, b : array

    Returns
    -------
    bool
    """
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    if array_api_compat.is_torch_array(a) and array_api_compat.is_torch_array(b):
        if a.device.type == "meta" or b.device.type == "meta":  # no memory to share
            return a is b
        if a.device != b.device or a.numel() == 0 or b.numel() == 0:
            return False
        (a_lo, a_hi), (b_lo, b_hi) = _torch_bytes(a), _torch_bytes(b)
        return a_lo < b_hi and b_lo < a_hi
    if array_api_compat.is_cupy_array(a) and array_api_compat.is_cupy_array(b):
        import cupy  # present: a and b are its arrays
        return bool(cupy.may_share_memory(a, b))
    try:
        return bool(np.may_share_memory(np.from_dlpack(a), np.from_dlpack(b)))
    except BufferError:  # memory its library would not hand over: it may be the other's
        return True
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return a is b


def shares_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have a byte in common: ``may_share_memory``'s test made exact
    (NumPy's ``shares_memory``) for NumPy arrays, torch's CPU tensors and the host memory a
    library exports through DLPack; elsewhere (CuPy, torch on a GPU) ``may_share_memory``.

    Two interleaved views of one buffer share no byte though each spans the other: the
    keys ``kv[:, :, 0]`` and values ``kv[:, :, 1]`` of flash-attn's packed cache
    (B, L, 2, H, D). NumPy solves it exactly, at a cost that grows with the axes (a cache's
    four or five are nothing).
    """
    if not may_share_memory(a, b):
        return False
    host = _host_views(a, b)
    return True if host is None else bool(np.shares_memory(host[0], host[1]))


def _host_views(a: Any, b: Any) -> Optional[tuple]:
    """NumPy views of the host memory of ``a`` and ``b`` (torch's as integers of the same
    width, so bfloat16 has one), or None where either has none."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a, b
    if array_api_compat.is_torch_array(a) and array_api_compat.is_torch_array(b):
        ints = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
        if {a.device.type, b.device.type} != {"cpu"} or not {a.element_size(), b.element_size()} <= set(ints):
            return None
        import torch  # present: a and b are its tensors
        return tuple(t.detach().view(getattr(torch, ints[t.element_size()])).numpy() for t in (a, b))
    if array_api_compat.is_cupy_array(a) or array_api_compat.is_cupy_array(b):
        return None
    try:
        return np.from_dlpack(a), np.from_dlpack(b)
    except (AttributeError, TypeError, ValueError, BufferError, RuntimeError):
        return None


def _torch_bytes(t: Any) -> tuple:
    """The addresses ``[lo, hi)`` from the first to past the last byte that a non-empty torch
    tensor's elements span (NumPy's bounds: strides of torch are never negative)."""
    lo, size = t.data_ptr(), t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # the last element's offset
    return lo, lo + (last + 1) * size


def row_major(a: Any) -> Any:
    """``a``, or a C-ordered copy of a NumPy array whose matrices (last two axes) are not
    row-major: unit stride along the last axis, rows apart and in order.

    NumPy's ``matmul`` hands a transposed, reversed or Fortran-ordered matrix
    to another BLAS routine, or to its own loop, and ``einsum`` to another
    inner loop, each adding in its own order: with this, the same values give
    the same bits whatever their layout, and a computation that cuts the
    arrays into slices (the tile pool's) gets the bits of one that does not.
    The copy is of the inputs, (L, D) per head, never of the scores. Other
    namespaces, and leading axes of any strides (a broadcast batch included),
    are left as they are.
    """
    if not isinstance(a, np.ndarray) or a.ndim < 2 or a.flags.c_contiguous:
        return a
    item = a.itemsize
    if a.strides[-1] == item and a.strides[-2] >= a.shape[-1] * item:
        return a
    return np.ascontiguousarray(a)


def row_max(xp: Any, x: Any) -> Any:
    """``max(x)`` over the last axis, kept as an axis of 1: ``[..., L] -> [..., 1]``.

    ``xp.max`` on every backend, but for an array without entries (an empty
    batch): dask's max of a zero-size array fails at compute even over a
    non-empty axis (each chunk's reduction has no identity), so the result,
    which has no entries either, is taken as the slice ``x[..., :1]``. A dask
    array's chunks of length 0 fail there too, so they are left out first.
    Rows of length 0 give ``-inf``, the identity of the max (every backend's max
    raises there): a softmax row with nothing in it is one with nothing to attend.
    """
    if x.shape[-1] == 0:
        return xp.full(tuple(x.shape[:-1]) + (1,), -math.inf, dtype=x.dtype, device=device_of(x))
    if math.prod(x.shape) == 0:
        return x[..., :1]
    return xp.max(without_empty_chunks(x), axis=-1, keepdims=True)


#: The most bytes one array can hold (NumPy's ``intp``, Python's ``sys.maxsize``): a
#: larger array cannot exist at all, where NumPy says only "array is too big".
MAX_BYTES = int(np.iinfo(np.intp).max)


def entry_bytes(xp: Any, dtype: Any) -> int:
    """The bytes an entry of ``dtype`` (of namespace ``xp``) holds: 1 for bool, else from its
    ``iinfo`` or ``finfo`` (twice that of its real part for a complex dtype)."""
    if isdtype(xp, dtype, "bool"):
        return 1
    if isdtype(xp, dtype, "integral"):
        return xp.iinfo(dtype).bits // 8
    return xp.finfo(dtype).bits // 8 * (2 if isdtype(xp, dtype, "complex floating") else 1)


def check_array_bytes(names: Sequence[str], shape: Sequence[int], itemsize: int, what: str) -> None:
    """``ValueError`` naming the size arguments ``names`` when ``what``, an array of ``shape``
    (Python ints, checked) with ``itemsize`` bytes an entry, would hold more than
    ``MAX_BYTES``: an array that cannot exist at all. Called before the array is made; one
    that can exist but does not fit in memory is left to the library's ``MemoryError``."""
    nbytes = math.prod(shape) * itemsize
    if nbytes > MAX_BYTES:
        named = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        raise ValueError(f"{named}: expected sizes for which {what}, an array of shape {tuple(shape)} "
                         f"({itemsize} byte{'s' if itemsize != 1 else ''} an entry), fits in "
                         f"{MAX_BYTES} bytes (the largest array), got {nbytes} bytes")


def check_rng(name: str, value: Any) -> None:
    """A seed as npattn documents one: None, an int >= 0, a ``SeedSequence``, ``BitGenerator``
    or ``Generator``. A ``TypeError`` naming ``name`` for anything else, a bool or a sequence
    of ints among them (``numpy.random.default_rng`` takes both, so ``True`` would seed as
    1); a ``ValueError`` for a negative int."""
    if value is None or isinstance(value, (np.random.Generator, np.random.SeedSequence,
                                           np.random.BitGenerator)):
        return
    check_int_seed(name, value, "None, a non-negative int seed, a SeedSequence, a BitGenerator or a "
                                "numpy.random.Generator")


def check_int_seed(name: str, value: Any, kinds: str) -> int:
    """``value`` as a Python int seed >= 0 (any ``numbers.Integral``), the int part of
    ``check_rng`` and ``validation.check_seed``: a ``TypeError`` "``name``: expected ``kinds``,
    got ..." for a bool or a non-integer, a ``ValueError`` for a negative int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected {kinds}, got {described(value)}")
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative int seed, got {value!r}")
    return int(value)  # exact for NumPy ints and other Integrals


def make_rng(seed: Any, name: str = "seed") -> np.random.Generator:
    """A NumPy ``Generator`` from ``seed``, checked by ``check_rng`` (naming ``name``).

    Parameters
    ----------
    seed : int, SeedSequence, BitGenerator, Generator or None
        None: fresh entropy.
    name : str
        The argument the messages name.

    Returns
    -------
    numpy.random.Generator
        A ``Generator`` given is returned itself and a ``BitGenerator`` wrapped, not copied:
        drawing from the result advances the caller's state.
    """
    if isinstance(seed, np.random.Generator):
        return seed
    check_rng(name, seed)
    if isinstance(seed, numbers.Integral):  # any Integral as its int: NumPy takes only its own
        seed = int(seed)
    return np.random.default_rng(seed)


def seed_sequence(seed: Any) -> np.random.SeedSequence:
    """The root ``SeedSequence`` a constructor spawns its parts' seeds from, for a ``seed``
    checked by ``validation.check_seed``: ``SeedSequence(seed)`` for None or an int, a copy
    of a ``SeedSequence`` (spawned from as it stands; the caller's is not advanced). Any
    ``numbers.Integral`` seeds as its int (NumPy's ``SeedSequence`` takes only its own)."""
    if isinstance(seed, np.random.SeedSequence):
        return copy.deepcopy(seed)
    return np.random.SeedSequence(None if seed is None else int(seed))


def dropout_key(rng: Any) -> int:
    """One 63-bit dropout key, in ``[0, 2**63)``, drawn from ``rng`` (a seed, ``SeedSequence``,
    ``BitGenerator``, ``Generator`` or None; anything else is refused by ``make_rng``, naming
    ``rng``).

    Every implementation draws exactly one key per forward, in the same way,
    so one generator state gives one key, and one key one mask.

    Parameters
    ----------
    rng : int, SeedSequence, BitGenerator, Generator or None

    Returns
    -------
    int
        A Python int; a ``Generator`` or ``BitGenerator`` given is advanced by the draw.
    """
    return int(make_rng(rng, "rng").integers(0, 2**63))


@contextlib.contextmanager
def overflow_unreported() -> Iterator[None]:
    """Context manager: NumPy's ``RuntimeWarning`` on a float overflow is off inside (for NumPy
    arrays and the libraries computing with NumPy: array_api_strict, dask), for a computation
    whose caller finds an overflow by its result (an inf) and handles it, where the warning
    would be a false alarm. Other libraries do not warn of overflow. ``numpy.errstate``: the
    setting is the current context's (thread-safe), and is put back on leaving."""
    with np.errstate(over="ignore"):
        yield


@contextlib.contextmanager
def generator_kept_on_failure(rng: Any) -> Iterator[None]:
    """Context manager: should the body raise, ``rng`` (a ``Generator`` or ``BitGenerator``;
    a seed has no state to change) is put back in the state it had on entering.

    A forward draws its dropout key (``dropout_key``) before the work that can fail
    (memory, an interrupt); a failed call must leave the caller's generator as it was,
    so that a retry draws the mask the failed call would have used.
    """
    bits = rng.bit_generator if isinstance(rng, np.random.Generator) else rng
    if not isinstance(bits, np.random.BitGenerator):
        yield
        return
    state = bits.state
    try:
        yield
    except BaseException:
        bits.state = state
        raise


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio, odd: spreads consecutive coordinates


def _mix32(x):
    """lowbias32 (C. Wellons): a bijective 32-bit integer hash, in place on a uint32 array."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


def _check_draw(key: Any, p: Any) -> int:
    """``key`` an int in [0, 2**64), ``p`` a real number in [0, 1): a ``TypeError`` /
    ``ValueError`` naming them (a p of 1.5 overflowed the threshold's uint32). Returns the
    key as a Python int (a NumPy np.uint8 one overflows in ``key & 0xFFFFFFFF``)."""
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, numbers.Integral):
        raise TypeError(f"key: expected an int (from dropout_key), got {described(key)}")
    if not 0 <= int(key) < 2**64:
        raise ValueError(f"key: expected an int in [0, 2**64) (from dropout_key), got {int(key)}")
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real):
        raise TypeError(f"p: expected a drop probability in [0, 1), got {described(p)}")
    # compared as given (float(p) overflows for an int beyond the float range); NaN fails both
    if p < 0 or not p < 1:
        raise ValueError(f"p: expected a drop probability in [0, 1), got {real_text(p)}")
    return int(key)


#: Entries of the 32-bit hashes ``keyed_keep_mask`` works on at a time (1 MiB in cache): its
#: temporaries stay this size whatever the block, and only the bool mask is block-sized.
KEEP_SLAB = 1 << 18
#: the same on a GPU (CuPy), where each slab is a few kernel launches: larger slabs, fewer launches
#: (its uint32 temporaries, 4 bytes an entry, stay within a few hundred MiB of device memory)
DEVICE_KEEP_SLAB = 1 << 26


def keyed_keep_mask(key: int, p: float, lead: Sequence[Any], rows: Any, cols: Any, *,
                    out: Optional[np.ndarray] = None) -> np.ndarray:
    """Host keep-mask of entries ``(*lead, i, j)`` for ``i in rows``, ``j in cols``.

    The keep decision of one entry is a function of ``key`` and its
    coordinates only (a counter-based draw)::

        r = hash(... hash(hash(key_lo + c_0 G) + c_1 G) ... + i G)   per row
        u = hash(r ^ hash(key_hi + j G))                             per entry
        keep = u >= t,   t = min(round(p * 2^32), 2^32 - 1)

    with ``hash`` a 32-bit mixing bijection, ``G`` an odd constant and ``round``
    Python's (halves to even). So ``P(keep) = 1 - t / 2^32``: within 2^-33 of
    ``1 - p`` for ``p <= 1 - 2^-33``; above it the cap (``t`` stays a 32-bit number)
    keeps ``P(keep) = 2^-32`` rather than 0.

    Parameters
    ----------
    key : int
        From ``dropout_key``.
    p : float
        Drop probability, in [0, 1).
    lead : sequence of int arrays
        Coordinates of the leading axes (e.g. b and h), broadcastable to the
        leading shape of the block.
    rows, cols : 1-D int arrays
        Query rows i and key columns j of the block.

    out : numpy bool array of that shape, optional
        Written and returned instead of a new array (a view is fine).

    Returns
    -------
    numpy bool array, shape ``(*broadcast(lead), len(rows), len(cols))``

    The hashes are taken ``KEEP_SLAB`` entries at a time (rows of the block), so
    the memory beyond the mask itself stays small; the mask does not depend on it.
    """
    key = _check_draw(key, p)
    shape = _keep_shape(lead, rows, cols)  # [..., bq, bk]
    if out is None:
        out = np.empty(shape, dtype=np.bool_)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.bool_ and out.shape == shape):
        got = (f"dtype {out.dtype} and shape {out.shape}" if isinstance(out, np.ndarray)
               else type_name(out))
        raise ValueError(f"out: expected a numpy bool array of shape {shape}, got {got}")
    return _draw_keep(np, key, p, lead, rows, cols, out, KEEP_SLAB)


def _keep_shape(lead: Sequence[Any], rows: Any, cols: Any) -> tuple:
    """The shape ``(*broadcast(lead), len(rows), len(cols))`` of a keep-mask block; a
    ``ValueError`` naming ``rows`` / ``cols`` when one is not 1-D."""
    for name, c in (("rows", rows), ("cols", cols)):
        if np.ndim(c) != 1:
            raise ValueError(f"{name}: expected a 1-D array of coordinates, got {np.ndim(c)} axes")
    return (*np.broadcast_shapes(*(np.shape(c) for c in lead)), len(rows), len(cols))


def keyed_keep_mask_on(key: int, p: float, lead: Sequence[Any], rows: Any, cols: Any, xp: Any,
                       device: Any = None) -> Any:
    """``keyed_keep_mask(key, p, lead, rows, cols)`` as a bool array of ``xp`` on ``device``.

    The same bits on every backend. On CuPy the integer hash runs on the
    device, ``DEVICE_KEEP_SLAB`` entries at a time: only the coordinates go
    over, not the mask. Elsewhere the mask is drawn on the host and moved with
    ``from_numpy`` (on NumPy: the host array itself, no copy). This is the one
    place that chooses between the two draws.

    Parameters
    ----------
    key, p, lead, rows, cols
        As ``keyed_keep_mask``: the key, the drop probability, and host
        coordinates of the leading axes, the query rows and the key columns.
    xp : namespace
        Array library of the result.
    device : optional
        Its device (on CuPy a ``cupy.cuda.Device``, its number, or None for
        the current one).

    Returns
    -------
    bool array of ``xp``, shape ``(*broadcast(lead), len(rows), len(cols))``
    """
    key = _check_draw(key, p)
    shape = _keep_shape(lead, rows, cols)  # [..., bq, bk]
    if backend_name(xp) == "cupy":  # drawn on the device: no host hash, no copy of the mask
        import cupy

        with cupy.cuda.Device(getattr(device, "id", device)):
            out = cupy.empty(shape, dtype=cupy.bool_)  # [..., bq, bk]
            return _draw_keep(cupy, key, p, lead, rows, cols, out, DEVICE_KEEP_SLAB)
    return from_numpy(keyed_keep_mask(key, p, lead, rows, cols), xp, device)  # [..., bq, bk]


def _draw_keep(lib: Any, key: int, p: float, lead: Sequence[Any], rows: Any, cols: Any, out: Any,
               slab: int) -> Any:
    """``keyed_keep_mask``'s draw into the bool array ``out``, in the array library ``lib``:
    NumPy on the host, or CuPy on the current device (the same integer arithmetic, so the same
    bits), hashing about ``slab`` entries at a time. ``lead``, ``rows`` and ``cols`` are host
    coordinate arrays (``lib.asarray`` copies them to the device)."""
    lo, hi = key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF
    r = lib.full((), lo, dtype=lib.uint32)
    coords = [lib.asarray(c)[..., None, None] for c in lead] + [lib.asarray(rows)[:, None]]
    for c in coords:
        c = c.astype(lib.uint32)  # coordinates wrap at 2^32, as everything here
        r = _mix32(r + c * np.uint32(_GOLDEN))  # [..., bq, 1] per row: cheap
    col = _mix32(np.uint32(hi) + lib.asarray(cols).astype(lib.uint32) * np.uint32(_GOLDEN))  # [bk]
    threshold = np.uint32(min(int(round(float(p) * 2.0**32)), 2**32 - 1))  # (a float16 p overflows)
    shape = out.shape  # [..., bq, bk]
    bq = shape[-2]
    per_row = max(1, math.prod(shape) // max(bq, 1))  # entries of one row across the leading axes
    step = max(1, slab // per_row)
    for i0 in range(0, bq, step):  # [..., step, bk] at a time
        u = lib.bitwise_xor(r[..., i0:i0 + step, :], col)
        _mix32(u)
        lib.greater_equal(u, threshold, out=out[..., i0:i0 + step, :])
    return out


def keep_mask(key: int, p: float, shape: Sequence[int], xp: Any, device: Any = None) -> Any:
    """The keep-mask of every entry of an array of ``shape`` (coordinates ``0..n-1`` per axis).

    ``keyed_keep_mask_on`` over the whole grid, in ``xp`` on ``device``:
    entry ``(..., i, j)`` is kept with probability ``1 - p``. On CuPy the same
    integer hash runs on the device (the same bits, without hashing every
    entry on the host and copying the mask over).

    Parameters
    ----------
    key : int
        From ``dropout_key``.
    p : float
        Drop probability, in [0, 1).
    shape : sequence of int
        Any number of axes; a 0- or 1-D mask is the columns of one row.
    xp : namespace
        Array library of the result.
    device : optional
        Its device, as ``keyed_keep_mask_on`` takes it.

    Returns
    -------
    bool array of ``xp``, shape ``shape``
        True = kept.
    """
    key = _check_draw(key, p)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__") or not all(
            isinstance(n, numbers.Integral) and not isinstance(n, (bool, np.bool_)) for n in shape):
        raise TypeError(f"shape: expected a sequence of ints >= 0, got {shape!r}")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape: expected a sequence of ints >= 0, got {shape!r}")
    shape = tuple(int(s) for s in shape)
    check_array_bytes(["shape"], shape, 1, "the keep-mask")
    check_array_bytes(["shape"], (max(shape, default=1),), 8, "the coordinates of its longest axis")
    if len(shape) < 2:  # a vector: its entries are the columns of one row
        keep = keyed_keep_mask_on(key, p, [], np.arange(1), np.arange(shape[0] if shape else 1),
                                  xp, device)  # [1, n]
        return xp.reshape(keep, shape)
    lead = [np.arange(n).reshape((n,) + (1,) * (len(shape) - 3 - a))
            for a, n in enumerate(shape[:-2])]  # one coordinate array per leading axis
    # the leading coordinates broadcast to shape[:-2]: the mask is the whole grid, its own array
    return keyed_keep_mask_on(key, p, lead, np.arange(shape[-2]), np.arange(shape[-1]), xp, device)


def is_numpy_array(x: Any) -> bool:
    """Whether ``x`` is a plain ``numpy.ndarray`` (not a subclass: masked arrays, matrices)."""
    return type(x) is np.ndarray


def is_dask_array(x: Any) -> bool:
    """Whether ``x`` is a ``dask.array.Array`` (dask is not imported for the answer)."""
    return array_api_compat.is_dask_array(x)


def persisted(*arrays: Any) -> tuple:
    """``arrays`` with the dask ones computed now and kept computed (``dask.persist``, on
    the current scheduler: in memory, or on a distributed client's workers); the others
    (and None) as they are.

    A dask array built step by step keeps every step in its task graph: a KV cache
    written token by token and read at every token would compute each earlier
    token's keys again at each step, quadratic in the tokens. Persisted, the next
    step's graph starts from the computed chunks.
    """
    return _dask_call("persist", arrays)


def computed(*arrays: Any) -> tuple:
    """``arrays`` with the dask ones computed now, in one graph (``dask.compute``: NumPy
    arrays); the others (and None) as they are.

    Values read one at a time (``float(x)``) each run their own graph: two sums of one
    lazy array read that way compute it twice, where one ``dask.compute`` shares it.
    """
    return _dask_call("compute", arrays)


def _dask_call(name: str, arrays: tuple) -> tuple:
    """``arrays`` with the dask ones replaced by ``dask.<name>`` of them all, one call."""
    lazy = [i for i, a in enumerate(arrays) if is_dask_array(a)]
    if not lazy:
        return tuple(arrays)
    import dask
    done = getattr(dask, name)(*(arrays[i] for i in lazy))
    out = list(arrays)
    for i, a in zip(lazy, done):
        out[i] = a
    return tuple(out)


def without_empty_chunks(x: Any) -> Any:
    """``x`` rechunked without its chunks of length 0 if it is a dask array with some (an
    axis of length 0 keeps one); anything else as it is.

    dask allows such chunks (a filtered array's ``compute_chunk_sizes`` makes them)
    and its ``reshape`` fails on some: an ``IndexError``, a graph with a missing key,
    or a result of the wrong shape.
    """
    if not is_dask_array(x) or any(math.isnan(n) for n in x.shape) or all(map(all, x.chunks)):
        return x
    return x.rechunk(tuple(tuple(n for n in c if n) or c[:1] for c in x.chunks))


_blas_controller = None


def blas_controller() -> Any:
    """threadpoolctl's ``ThreadpoolController`` (made once), or None when it is not installed
    or finds no BLAS library (an unknown BLAS, or a threadpoolctl too old for NumPy's): a
    controller that holds no BLAS could not hold it to one thread, so npattn then does what it
    does without threadpoolctl (tiles one after another, BLAS at its own threads)."""
    global _blas_controller
    if _blas_controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _blas_controller = False
        else:
            ctl = ThreadpoolController()
            holds_blas = any(lc.user_api == "blas" for lc in ctl.lib_controllers)
            _blas_controller = ctl if holds_blas else False
    return _blas_controller or None


def limit_blas_threads(n: Optional[int]) -> Any:
    """Context manager: host BLAS libraries use at most ``n`` threads inside.

    Uses ``threadpoolctl`` when it is installed and finds a BLAS library; otherwise, or
    with ``n`` None, it changes nothing. It holds the BLAS libraries that were loaded when
    npattn first made its controller (``blas_controller``), NumPy's among them,
    which is the one npattn's NumPy code calls; one loaded later (SciPy's own
    OpenBLAS, say) keeps its count. The count is process-wide: npattn calls it only
    inside ``exclusive()``, and restores it before leaving.

    Parameters
    ----------
    n : int >= 1 or None
        The most threads; None changes nothing.

    Returns
    -------
    context manager
    """
    if n is not None and (isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral)):
        raise TypeError(f"n: expected None or an int >= 1 (BLAS threads), got {described(n)}")
    if n is not None and n < 1:
        raise ValueError(f"n: expected None or an int >= 1 (BLAS threads), got {n!r}")
    ctl = blas_controller()
    if n is None or ctl is None:
        return contextlib.nullcontext()
    return _blas_hold(ctl, int(n))


@contextlib.contextmanager
def _blas_hold(ctl: Any, n: int) -> Iterator[None]:
    # threadpoolctl (3.8 on) lets one Python thread at a time change OpenBLAS's count and
    # silently ignores the others: a caller's thread inside its own threadpool_limits (or one
    # that called it without a `with`) would turn this hold into nothing, and the tiles would
    # run on that caller's BLAS threads. The hold takes that control, and gives it up after.
    owner = _take_openblas_control()
    before = None
    try:
        # the counts to put back should an interrupt keep threadpoolctl from restoring them
        before = [lib.num_threads for lib in ctl.lib_controllers]
        limiter = ctl.limit(limits=n, user_api="blas")  # held from here
        hold = (threading.get_ident(), limiter)
        _blas_holds.append(hold)
        try:
            # entered and left as threadpoolctl's context manager: leaving restores the counts
            # and gives up this thread's control of OpenBLAS's count (a thread that kept it
            # would turn every other thread's hold into nothing)
            with limiter:
                yield
        finally:
            _blas_holds.remove(hold)
    finally:
        if before is not None:
            _put_back_counts(ctl, before)
        if owner is not None:
            _leave_openblas_control()


def _put_back_counts(ctl: Any, before: list) -> None:
    """The counts ``before`` (one per library of ``ctl``) set again where they differ now.

    An interrupt (Ctrl-C) that lands inside threadpoolctl, after it has set a count and
    before it returns the limiter, or inside the limiter's restore, would otherwise leave
    BLAS held at one thread for the rest of the process."""
    changed = False
    for lib, n in zip(ctl.lib_controllers, before):
        if lib.num_threads != n:
            lib.set_num_threads(n)
            changed = True
    if changed:  # setting the count made this thread threadpoolctl's controller: give it up
        _leave_openblas_control()


# --------------------------------------------------------------------------
# the tile pool: per process, behind one lock

_lock = threading.RLock()
_pool = None  # (pid, n, ThreadPoolExecutor) of this process, made on first use


#: The BLAS holds of ``limit_blas_threads`` that have not ended, outermost first, as
#: ``(thread ident, threadpoolctl limiter)``: a forked child restores the counts that the
#: threads it does not have were holding.
_blas_holds: list = []


def _openblas_control() -> Any:
    """threadpoolctl's record of which Python thread may change OpenBLAS's count, with its lock
    (from 3.8 on; None before, or when threadpoolctl is not in use)."""
    return getattr(getattr(sys.modules.get("threadpoolctl"), "OpenBLASController", None),
                   "_SHARED_STATE", None)


def _openblas_control_lock() -> Any:
    """threadpoolctl's lock over which Python thread may change OpenBLAS's count (from 3.8 on;
    None before, or when threadpoolctl is not in use)."""
    return getattr(_openblas_control(), "lock", None)


def _take_openblas_control() -> Any:
    """Make this thread the one that threadpoolctl lets change OpenBLAS's count; returns the
    live thread that had that control, or None when none other had it."""
    state = _openblas_control()
    if state is None or getattr(state, "lock", None) is None:
        return None
    me = threading.current_thread()
    with state.lock:
        owner = getattr(state, "controlling_thread", None)
        if owner is None or owner is me or not owner.is_alive():
            return None
        state.controlling_thread = me
    return owner


def _leave_openblas_control() -> None:
    """Give up the control ``_take_openblas_control`` took, to no thread: the next thread that
    sets the count takes it, the one it was taken from included.

    Not back to that thread: its ``threadpool_limits`` may have ended during the hold (its
    restore, ignored then, cannot clear the control it no longer has), and the control given
    back would stay with it for good, every other thread's limit ignored without a word. A
    thread still inside its limit takes the control again when it next sets the count (its
    restore at the end included). A thread still inside a hold of its own keeps it."""
    if any(h[0] == threading.get_ident() for h in _blas_holds):
        return
    openblas = getattr(sys.modules.get("threadpoolctl"), "OpenBLASController", None)
    clear = getattr(openblas, "clear_controlling_thread", None)  # 3.8 on: only where this thread has it
    if clear is not None:
        clear()


def _take_control_lock():
    """Before a fork: a fork while another thread holds threadpoolctl's lock would leave the
    child's copy locked for good, and the child's restore below would wait on it forever."""
    lock = _openblas_control_lock()
    if lock is not None:
        lock.acquire()


def _release_control_lock():
    """After a fork, in the parent and in the child (each has its own copy of the lock)."""
    lock = _openblas_control_lock()
    if lock is not None:
        lock.release()


def _after_fork_in_child():
    """A forked child inherits the parent's pool object without its threads: forget it. A
    thread of the parent that was inside npattn, holding BLAS to one thread, is not in the
    child and will never give the count back: restore it."""
    global _lock, _pool
    _release_control_lock()
    _lock = threading.RLock()
    _pool = None
    me = threading.get_ident()
    foreign = [h for h in _blas_holds if h[0] != me]
    _blas_holds[:] = [h for h in _blas_holds if h[0] == me]
    if foreign and not _blas_holds:  # (a fork from inside a hold of its own: the hold is
        # left as it stands, and restores what it found when it ends)
        foreign[0][1].restore_original_limits()  # the outermost's: the counts before any hold
        openblas = getattr(sys.modules.get("threadpoolctl"), "OpenBLASController", None)
        clear = getattr(openblas, "clear_controlling_thread", None)
        if clear is not None:  # setting the counts made this thread threadpoolctl's
            clear()  # controller: give it up


os.register_at_fork(before=_take_control_lock, after_in_parent=_release_control_lock,
                    after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Context manager: npattn's computations in this process run one at a time inside.

    Re-entrant in the thread that holds it. The NumPy kernel and the blocked
    path change the process-wide BLAS thread count while their tiles run;
    under this lock no other npattn computation sees that change, and the
    count is restored before release. Work that runs npattn in other threads
    and waits for them inside the lock (``dask.compute`` of npattn's tasks on
    the threaded scheduler) waits forever.
    """
    lock = _lock
    with lock:
        yield


def pool_threads() -> int:
    """Threads of the tile pool: ``NPATTN_NUM_THREADS``, else the usable CPUs (at most 8).

    The number changes the speed, never the numbers: every tile is computed
    the same way whichever thread runs it. Without ``threadpoolctl``, or when it
    finds no BLAS library, BLAS cannot be held to one thread, so tiles then run
    one after another (1), whatever ``NPATTN_NUM_THREADS`` says.
    Raises ``ValueError`` for a ``NPATTN_NUM_THREADS`` that is not a positive
    integer written in ASCII digits (surrounding spaces allowed; no sign, no
    ``_``, none of the other digits Python's ``int`` reads).
    """
    env = os.environ.get("NPATTN_NUM_THREADS")
    n = None
    if env is not None and env.strip() != "":
        digits = env.strip()
        n = int(digits) if digits.isascii() and digits.isdigit() else 0
        if n < 1:
            raise ValueError(
                f"NPATTN_NUM_THREADS: expected a positive integer (threads of npattn's tile pool), "
                f"got {env!r}"
            )
    if blas_controller() is None:
        return 1
    if n is not None:
        return n
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def run_tasks(fn: Callable, tasks: Sequence[tuple], threads: int) -> None:
    """``fn(*task)`` for every task, on the tile pool with BLAS held to one thread.

    With ``threads <= 1`` or one task they run in order, BLAS still held to
    one thread, so the numbers are the same for every thread count. Each task
    must write only its own output slices. Call inside ``exclusive()``. On the
    pool a task's exception is raised once every task has run; in order, at once
    (the tasks after it do not run). An interrupt of the waiting thread is raised
    once the running tasks have ended, the others never started.

    Parameters
    ----------
    fn : callable
    tasks : sequence of tuple
        The arguments of each call.
    threads : int
        Threads of the pool (``pool_threads()``); a pool of another size replaces the
        process's.
    """
    global _pool
    with limit_blas_threads(1):
        if threads <= 1 or len(tasks) <= 1:
            for t in tasks:
                fn(*t)
            return
        pid = os.getpid()
        if _pool is None or _pool[0] != pid or _pool[1] != threads:
            if _pool is not None and _pool[0] == pid:
                _pool[2].shutdown(wait=False)
            _pool = (pid, threads, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="npattn"))
        futures: list = []
        try:
            for t in tasks:
                futures.append(_pool[2].submit(fn, *t))
            wait(futures)  # every one, even when one fails, before BLAS threads come back
        except BaseException:  # an interrupt in this thread: the tiles not started never
            # start, and the running ones end before BLAS, the lock and the pool are released
            for f in futures:
                f.cancel()
            wait(futures)
            raise
    for f in futures:
        f.result()  # raises a tile's exception
