"""Checks at the boundary: bad input is caught before any computation.

Every public entry point of npattn checks its arguments on its first line,
with the functions of this module or with checks built from them. Each check
raises

* ``TypeError`` for a value of the wrong kind: not an array, an array of
  another library, a dtype that differs from the expected one, a non-bool flag;
* ``ValueError`` for a value of the right kind that is out of range: a wrong
  shape, a mask that does not broadcast, a probability outside [0, 1), an
  array on another device, NaN/Inf under ``check_finite=True``;

and the message names the argument, what was expected and what was received,
so the caller can act on it. This is the shared vocabulary; the checks of
``MultiHeadAttention``'s own arguments (``check_module_args``,
``check_forward_inputs``, ``check_backward_inputs``, ``ParameterDict``) live
with it in ``npattn.module`` and use these.

Nothing here copies or writes into its arguments. Apart from three checks,
only shapes, dtypes, namespaces and devices are read, so the checks cost no
device work and no synchronisation. The three: the opt-in finite check
(``check_finite_values``); ``check_ids``, which reads the range of the integer
ids (a min and a max, and with it a synchronisation on a GPU or a computation
on dask); and ``check_device``, which makes a one-entry array on the device it
is given.

Shape legend: B batch, H heads, Lq query length, Lk key length,
D = d_model, Dk = kdim, Dv = vdim, Dh head width.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from typing import Any, Iterator, Literal, NamedTuple, Optional, Sequence, overload

import numpy as np

from .backend import (MAX_BYTES, backend_name, check_array_bytes, check_int_seed, check_rng, computed,
                      device_of, is_array, is_dask_array, isdtype, keeps_dtype, namespace,
                      without_empty_chunks)
from .messages import described, real_text, type_name

__all__ = [
    "FLOAT_DTYPES",
    "check_sdpa_inputs",
    "check_kernel_options",
    "check_segment_dtypes",
    "scores_lead",
    "check_finite_values",
    "check_finite_arrays",
    "check_mask",
    "check_array",
    "check_device",
    "check_bool",
    "check_choice",
    "check_positive_int",
    "MAX_AXIS",
    "MAX_BYTES",
    "check_array_bytes",
    "check_probability",
    "check_size",
    "check_scale",
    "check_floating_array",
    "check_cache",
    "check_ids",
    "check_grad",
    "ArraySpec",
    "spec_of",
    "check_rng",
    "check_seed",
    "check_number",
    "check_softcap",
    "float_dtype_name",
    "real_value", "real_text",
    "argument_names",
    "check_broadcasts_to",
    "type_name",
    "described",
    "dtype_name",
    "shape_of",
]

#: Parameter dtypes a module accepts (when its backend has them).
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


# --------------------------------------------------------------------------
# small pieces


def article(word: str) -> str:
    """'a' or 'an' before ``word`` in a message ('a numpy', 'an array_api_strict')."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def dtype_name(dtype: Any) -> str:
    """'float32' for numpy, torch and array_api_strict dtypes alike."""
    if isinstance(dtype, np.dtype):
        return dtype.name
    if isinstance(dtype, type):  # NumPy scalar types, as array_api_compat.numpy.float32
        return dtype.__name__
    return str(dtype).rsplit(".", 1)[-1]


def not_floating(name: str, dtype: Any) -> TypeError:
    """The refusal of an array of ``dtype`` where a real floating one is expected. A NumPy
    extension dtype (ml_dtypes' bfloat16, which JAX installs) is floating to its own library
    but not to NumPy's arithmetic: the message says which dtypes to use instead (not for a
    structured dtype or raw bytes, also of kind 'V', whose type is numpy.void)."""
    hint = ""
    if isinstance(dtype, np.dtype) and dtype.kind == "V" and not issubclass(dtype.type, np.void):
        where = "; bfloat16 on torch or JAX" if dtype.name == "bfloat16" else ""
        hint = f" (a NumPy extension dtype: on NumPy npattn takes float16, float32 and float64{where})"
    return TypeError(f"{name}: expected a real floating dtype, got {dtype_name(dtype)}{hint}")


def shape_of(x: Any) -> tuple:
    """The shape of ``x`` as a tuple of Python ints, for messages and comparisons."""
    if type(x) is np.ndarray:
        return x.shape  # already a tuple of Python ints
    return tuple(int(n) for n in x.shape)


def _same_namespace(xp_a: Any, xp_b: Any) -> bool:
    return xp_a is xp_b or backend_name(xp_a) == backend_name(xp_b)


#: The longest an array axis can be (NumPy's ``intp``): a size beyond it is refused by the
#: checks below, where NumPy would say only "Maximum allowed dimension exceeded".
MAX_AXIS = int(np.iinfo(np.intp).max)


def check_bool(name: str, value: Any) -> None:
    """``TypeError`` unless ``value`` is a bool (Python or NumPy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {described(value)}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """``TypeError`` unless ``value`` is a str (or None, where ``choices`` holds None),
    ``ValueError`` unless it is one of ``choices``; the message lists them."""
    listed = [repr(c) for c in choices]
    expected = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " or " + listed[-1]
    if not (isinstance(value, str) or (value is None and None in choices)):
        raise TypeError(f"{name}: expected {expected}, got {described(value)}")
    if value not in choices:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


@overload
def check_positive_int(name: str, value: Any, *, allow_none: Literal[False] = False,
                       maximum: Optional[int] = ...) -> int: ...
@overload
def check_positive_int(name: str, value: Any, *, allow_none: bool,
                       maximum: Optional[int] = ...) -> Optional[int]: ...


def check_positive_int(name: str, value: Any, *, allow_none: bool = False,
                       maximum: Optional[int] = MAX_AXIS) -> Optional[int]:
    """``value`` as a Python int: ``TypeError`` unless it is an int (Python or NumPy, not a
    bool), ``ValueError`` unless 0 < value <= ``maximum`` (None: no bound, for a caller with
    a check of its own); None stays None under ``allow_none``.

    Callers use what it returns (``n = check_positive_int("n", n)``): a NumPy int would do
    the arithmetic that follows in its own dtype and wrap (``np.uint8(255) + 2`` is 1).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int, got {described(value)}")
    n = int(value)  # exact for NumPy ints too
    if n <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return _at_most(name, n, maximum, "a positive int")


def check_size(name: str, value: Any, *, minimum: int = 0,
               maximum: Optional[int] = MAX_AXIS) -> int:
    """``value`` as a Python int: ``TypeError`` unless it is an int (Python or NumPy, not a
    bool), ``ValueError`` below ``minimum`` or above ``maximum`` (None: no bound, for a seed
    or a caller with a check of its own).
    Use what it returns (see ``check_positive_int``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {described(value)}")
    n = int(value)  # exact for NumPy ints too
    if n < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return _at_most(name, n, maximum, "an int")


def check_seed(name: str, value: Any) -> Any:
    """A model's seed, as every constructor takes one: None (fresh entropy), an int >= 0
    (Python or NumPy, returned as a Python int) or a ``numpy.random.SeedSequence`` (returned
    as given; ``backend.seed_sequence`` spawns from a copy). A ``TypeError`` naming ``name``
    for anything else, a bool (NumPy would seed ``True`` as 1), a sequence of ints (which
    ``SeedSequence`` takes as entropy) or a ``Generator`` (a stream to draw from, which
    ``check_rng`` takes where one is drawn from); a ``ValueError`` for a negative int, worded
    as ``check_rng``'s."""
    if value is None or isinstance(value, np.random.SeedSequence):
        return value
    return check_int_seed(name, value, "None, a non-negative int seed or a SeedSequence")


def _at_most(name: str, n: int, maximum: Optional[int], expected: str) -> int:
    """``n``, or ``ValueError`` ("expected {expected} <= maximum") above ``maximum`` (None: no bound)."""
    if maximum is not None and n > maximum:
        what = " (the longest array axis)" if maximum == MAX_AXIS else ""
        raise ValueError(f"{name}: expected {expected} <= {maximum}{what}, got {n!r}")
    return n


@contextlib.contextmanager
def argument_names(names: dict) -> Iterator[None]:
    """Inside, a ``TypeError`` / ``ValueError`` whose message starts with ``"name: "`` for a key
    of ``names`` is raised again with ``names[name]`` there, and in its "that of name",
    "those of name", "heads of name", "and name" and "like name" references: the arguments
    as the caller of a wrapper calls them (``{"q": "query"}`` for torch's names)."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        head, sep, rest = str(exc).partition(": ")
        if sep and head in names:
            rest = re.sub(r"\b(that of|those of|n?heads of|and|like) (\w+)\b",
                          lambda m: f"{m.group(1)} {names.get(m.group(2), m.group(2))}", rest)
            raise type(exc)(f"{names[head]}: {rest}") from None
        raise


def real_value(value: Any) -> float:
    """``float(value)`` for a real number, ``+-inf`` for an int beyond the float range (``float``
    raises ``OverflowError`` there): for range checks, which then fail as for any infinite value."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_number(name: str, value: Any, *, allow_zero: bool = False, allow_none: bool = False) -> None:
    """``TypeError`` unless a real number (Python or NumPy, not a bool), ``ValueError`` unless
    finite and > 0 (>= 0 with ``allow_zero``)."""
    if value is None and allow_none:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {described(value)}")
    bound = ">= 0" if allow_zero else "> 0"
    x = real_value(value)
    if not (math.isfinite(x) and (x >= 0.0 if allow_zero else x > 0.0)):
        raise ValueError(f"{name}: expected a finite number {bound}, got {real_text(value)}")


def check_softcap(softcap: Any) -> None:
    """``softcap``: None or a finite float > 0 (``TypeError`` for a non-number or a bool)."""
    if softcap is None:
        return
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected None or a float > 0, got {described(softcap)}")
    if not (math.isfinite(real_value(softcap)) and real_value(softcap) > 0.0):
        raise ValueError(f"softcap: expected a finite float > 0, got {real_text(softcap)}")


def float_dtype_name(xp: Any, dtype: Any, name: str = "dtype",
                     choices: Sequence[str] = FLOAT_DTYPES) -> str:
    """The name ("float32", ...) of ``dtype``, one of ``choices`` (default ``FLOAT_DTYPES``) that
    ``xp`` has and keeps, given as a name or as a dtype object of any library; the dtype itself
    is ``getattr(xp, name)``. Messages list only the ``choices`` that ``xp`` has.

    ``TypeError`` for None or a dtype of another kind (an integer dtype would truncate),
    ``ValueError`` for a name ``xp`` has no float dtype of, or one it turns into another (JAX
    without x64 makes float32 of float64). How every ``dtype=`` argument is read.
    """
    available = [n for n in choices if hasattr(xp, n)]
    if dtype is None:  # np.dtype(None) would be float64: say so instead of guessing
        raise TypeError(f"{name}: expected one of {available} (a name or a dtype), got None")
    if isinstance(dtype, (bytes, bytearray)):  # np.dtype(b"float64") would read it as the name
        raise TypeError(f"{name}: expected one of {available} (a name or a dtype), got "
                        f"{described(dtype)}")
    if isinstance(dtype, str):
        given = dtype
    else:
        try:
            given = np.dtype(dtype).name  # NumPy dtypes and scalar types
        except TypeError:
            given = dtype_name(dtype)  # torch.float32, array_api_strict.float32
    if given in available and not keeps_dtype(xp, getattr(xp, given)):
        raise ValueError(
            f"{name}: expected one of {available} that backend {backend_name(xp)!r} keeps, got "
            f"{given!r}, which it turns into another dtype (JAX: float64 needs "
            "jax.config.update('jax_enable_x64', True) first)"
        )
    if given not in available:
        if not isinstance(dtype, str) and given not in FLOAT_DTYPES:
            raise TypeError(
                f"{name}: expected one of {available} (a name or a dtype), got {described(dtype)}"
            )
        raise ValueError(
            f"{name}: expected one of {available} for backend {backend_name(xp)!r}, got {dtype!r}"
        )
    return given


def check_scale(name: str, value: Any) -> None:
    """``TypeError`` unless ``value`` is None or a real number, ``ValueError`` unless it is a finite float."""
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected None or a float, got {described(value)}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond the float range, e.g. 2**1100
        raise ValueError(
            f"{name}: expected a finite float, got an int too large for a float "
            f"({int(value).bit_length()} bits)"  # type: ignore[call-overload]
        ) from None
    if not math.isfinite(as_float):
        raise ValueError(f"{name}: expected a finite float, got {value!r}")


def check_broadcasts_to(name: str, shape: Sequence[int], target: Sequence[int],
                        target_text: str) -> None:
    """``ValueError`` unless ``shape`` broadcasts to ``target`` without changing it."""
    shape, target = tuple(int(n) for n in shape), tuple(int(n) for n in target)
    if len(shape) > len(target) or any(
            n != 1 and n != t for n, t in zip(reversed(shape), reversed(target))):
        raise _broadcast_error(name, shape, target, target_text)


def check_probability(name: str, value: Any) -> None:
    """``TypeError`` unless ``value`` is a real number, ``ValueError`` unless it is in [0, 1)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}: expected a float drop probability in [0, 1), got {described(value)}"
        )
    if not (0.0 <= value < 1.0):  # type: ignore[operator]  # False for NaN; an int may overflow float()
        raise ValueError(f"{name}: expected a drop probability in [0, 1), got {real_text(value)}")


#: The module's arrays come from its backend; functional code takes that of q (or x).
MODULE_LIBRARY = "the module's backend"


def check_device(xp: Any, device: Any, name: str = "device") -> None:
    """``device`` (not None) is one that the backend ``xp`` can make arrays on.

    Each library says so in its own words (NumPy's and array_api_strict's
    ValueError, torch's RuntimeError, or AssertionError without CUDA), none of
    which names the argument: a one-entry array is made there first.
    """
    if device is None:
        return
    try:
        xp.zeros((1,), device=device)
    except MemoryError:  # not the device's fault: the error goes on as it is
        raise
    except Exception as exc:
        raise ValueError(f"{name}: expected a device of the {backend_name(xp)} backend, got "
                         f"{device!r} ({type(exc).__name__}: {exc})") from exc


def masked_array_kind(x: Any) -> str:
    """'numpy.ma.MaskedArray', or 'a dask array of numpy.ma.MaskedArray chunks' (dask.array.ma),
    for an array whose mask npattn would drop; '' for any other."""
    if isinstance(x, np.ma.MaskedArray):
        return "numpy.ma.MaskedArray"
    if is_dask_array(x) and isinstance(getattr(x, "_meta", None), np.ma.MaskedArray):
        return "a dask array of numpy.ma.MaskedArray chunks"
    return ""


def masked_data_call(x: Any) -> str:
    """How to take the data of an array ``masked_array_kind`` names, for the messages."""
    return "dask.array.ma.getdata(a)" if is_dask_array(x) else "np.ma.getdata(a)"


def check_array(name: str, x: Any, xp: Any = None, device: Any = None,
                where: str = "where the parameters live", library: str = MODULE_LIBRARY) -> None:
    """``x`` is an array of namespace ``xp`` on ``device`` (each when given).

    ``where`` says where ``device`` comes from and ``library`` where ``xp``
    comes from, for the messages ("the module's backend", "that of q").
    NumPy masked arrays (dask's of masked chunks too) and matrices are refused
    (npattn would ignore the mask, and a matrix is 2-D only), and so are NumPy arrays of non-native
    byte order (a big-endian float64 is not the float64 the computation
    uses; convert it first).
    """
    # first: array_api_compat (1.16) takes no matrix for an array at all, which would hide the hint
    if isinstance(x, np.matrix):
        raise TypeError(f"{name}: expected a plain numpy.ndarray, got numpy.matrix; use np.asarray(a)")
    if not is_array(x):
        want = backend_name(xp) if xp is not None else ""
        expected = f"{article(want)} {want} array" if want else "an array"
        raise TypeError(f"{name}: expected {expected}, got {type_name(x)}")
    masked = masked_array_kind(x)
    if masked:
        plain = "dask array of plain numpy.ndarray chunks" if is_dask_array(x) else "plain numpy.ndarray"
        raise TypeError(
            f"{name}: expected a {plain}, got {masked} (npattn would ignore its mask); pass its "
            f"data, {masked_data_call(x)}, and express the masked entries as an attention mask"
        )
    if type(x) is not np.ndarray and any(n is None or (isinstance(n, float) and math.isnan(n))
                                         for n in x.shape):
        raise ValueError(
            f"{name}: expected an array of known shape, got shape {tuple(x.shape)} (a dask array "
            f"of unknown chunk sizes: call its compute_chunk_sizes() first)"
        )
    dt = getattr(x, "dtype", None)
    if isinstance(dt, np.dtype) and not dt.isnative:
        raise TypeError(
            f"{name}: expected an array of native byte order, got dtype {dt.name} of "
            f"non-native byte order ({dt.str!r}); convert it with "
            "a.astype(a.dtype.newbyteorder('='))"
        )
    if xp is not None:
        got = namespace(x)
        if not _same_namespace(got, xp):
            hint = ("convert it first, or build the module with that backend"
                    if library == MODULE_LIBRARY else "pass every array from one library")
            want, have = backend_name(xp), backend_name(got)
            raise TypeError(
                f"{name}: expected {article(want)} {want} array ({library}), "
                f"got {article(have)} {have} array ({type_name(x)}); {hint}"
            )
    if device is not None and device_of(x) != device:
        raise ValueError(
            f"{name}: expected an array on device {device!r} ({where}), "
            f"got one on device {device_of(x)!r}"
        )


def check_floating_array(name: str, x: Any, xp: Any = None, device: Any = None, *,
                         dtype: Any = None, like: str = "") -> None:
    """``check_array``, then a real floating dtype (``dtype`` exactly, when given; ``like`` names it)."""
    library = f"that of {like}" if like else MODULE_LIBRARY
    check_array(name, x, xp, device, where=f"like {like}" if like else "where the parameters live",
                library=library)
    ns = namespace(x)
    if not _is_floating(ns, x.dtype):
        raise not_floating(name, x.dtype)
    if dtype is not None and x.dtype != dtype:
        source = f" (that of {like})" if like else ""
        raise TypeError(
            f"{name}: expected dtype {dtype_name(dtype)}{source}, got {dtype_name(x.dtype)} "
            "(no silent promotion)"
        )


def check_ids(name: str, ids: Any, n: int, xp: Any = None, device: Any = None, *,
              what: str = "ids", like: str = "", ignore: Optional[int] = None) -> None:
    """``ids``: an integer array (of ``xp`` on ``device``, like ``like``) of ``what``, each
    in [0, n) or equal to ``ignore`` (an ``ignore_index``): a ``TypeError`` / ``ValueError``
    naming ``name`` otherwise."""
    check_array(name, ids, xp, device, where=f"that of {like}" if like else "where the parameters live",
                library=f"that of {like}" if like else MODULE_LIBRARY)
    ns = namespace(ids)
    if not isdtype(ns, ids.dtype, "integral"):
        raise TypeError(f"{name}: expected an integer array of {what}, got dtype {dtype_name(ids.dtype)}")
    info = getattr(ns, "__array_namespace_info__", None)
    supported = None if info is None else list(info().dtypes(kind="integral").values())
    if supported is not None and ids.dtype not in supported:  # torch's uint16/32/64: no min, ==, ...
        raise TypeError(f"{name}: expected an integer array of {what} of a dtype its library computes "
                        f"with ({', '.join(dtype_name(d) for d in supported)}), got dtype "
                        f"{dtype_name(ids.dtype)}; cast it to int64 first")
    low, high = int(ns.iinfo(ids.dtype).min), int(ns.iinfo(ids.dtype).max)
    if ignore is not None:  # (one its dtype cannot hold equals no entry: a mistake, not a no-op)
        if not low <= ignore <= high:
            raise ValueError(f"ignore_index: expected an int that the {dtype_name(ids.dtype)} of "
                             f"{name} holds, in [{low}, {high}], got {ignore}")
    if math.prod(shape_of(ids)):
        whole = without_empty_chunks(ids)  # dask's min and max fail on chunks of length 0
        if ignore is None:
            least, most = ns.min(whole), ns.max(whole)  # []
        else:  # the range of the others: an ignored entry reads as the dtype's max for the
            # min and its min for the max
            counts = whole != ignore
            least = ns.min(ns.where(counts, whole, ns.full_like(whole, high)))  # []
            most = ns.max(ns.where(counts, whole, ns.full_like(whole, low)))  # []
        lo, hi = (int(a) for a in computed(least, most))  # dask: both in one graph, one pass over ids
        if lo > hi:  # only ignored entries (the dtype's max > its min): nothing out of range
            return
        if lo < 0 or hi >= n:
            if ignore is None:
                raise ValueError(f"{name}: expected {what} in [0, {n}), got values in [{lo}, {hi}]")
            raise ValueError(f"{name}: expected {what} in [0, {n}) or ignore_index = {ignore}, "
                             f"got others in [{lo}, {hi}]")


def check_cache(name: str, cache: Any, cls: type, producer: str) -> None:
    """``TypeError`` unless ``cache`` is a ``cls`` (the cache that ``producer`` returns)."""
    if not isinstance(cache, cls):
        raise TypeError(
            f"{name}: expected a {cls.__name__} (the cache {producer} returns), "
            f"got {type_name(cache)}"
        )


class ArraySpec(NamedTuple):
    """What an array was, kept by a cache instead of the array itself (which would stay alive
    until the backward): the upstream gradient of an output must match it."""

    shape: tuple  #: the array's shape
    dtype: Any  #: its dtype
    xp: Any  #: its Array API namespace
    device: Any  #: its device


def spec_of(x: Any) -> ArraySpec:
    """The ``ArraySpec`` of array ``x``: shape, dtype, namespace and device."""
    return ArraySpec(shape_of(x), x.dtype, namespace(x), device_of(x))


def check_grad(name: str, g: Any, *, shape: Sequence[int], dtype: Any, xp: Any, device: Any,
               of: str) -> None:
    """An upstream gradient: an array of ``xp`` on ``device`` with exactly ``shape`` and ``dtype`` (those of ``of``)."""
    check_array(name, g, xp, device, where=f"that of {of}", library=f"that of {of}")
    expected = tuple(int(n) for n in shape)
    if shape_of(g) != expected:
        raise ValueError(f"{name}: expected shape {expected} (that of {of}), got {shape_of(g)}")
    if g.dtype != dtype:
        raise TypeError(
            f"{name}: expected dtype {dtype_name(dtype)} (that of {of}), got {dtype_name(g.dtype)} "
            "(no silent promotion)"
        )


def _is_floating(xp: Any, dtype: Any) -> bool:
    return isdtype(xp, dtype, "real floating")


def _is_bool(xp: Any, dtype: Any) -> bool:
    return isdtype(xp, dtype, "bool")


def _broadcast_error(name: str, shape: tuple, target: tuple, target_text: str) -> ValueError:
    return ValueError(
        f"{name}: expected a shape that broadcasts to {target_text} = {target} "
        f"(each axis 1 or equal to it), got shape {shape}"
    )


# --------------------------------------------------------------------------
# masks


def check_mask(name: str, mask: Any, xp: Any, *, target: tuple, target_text: str, dtype: Any,
               device: Any = None, ndims: Optional[Sequence[int]] = None, bool_only: bool = False,
               where: str = "where the parameters live", library: str = MODULE_LIBRARY,
               dtype_source: str = "the inputs' dtype") -> None:
    """Check a mask against the score shape ``target``.

    ``mask`` must be an array of ``xp`` (on ``device``), boolean or, unless
    ``bool_only``, real floating of ``dtype``; integers are rejected as
    ambiguous. Its shape must broadcast to ``target`` without changing
    ``target``: right-aligned, each axis 1 or equal. ``ndims`` restricts the
    accepted number of axes.
    """
    if mask is None:
        return
    check_array(name, mask, xp, device, where, library)
    if _is_bool(xp, mask.dtype):
        pass
    elif bool_only:
        raise TypeError(
            f"{name}: expected a bool keep-mask (True = keep), got dtype {dtype_name(mask.dtype)}"
        )
    elif _is_floating(xp, mask.dtype):
        if mask.dtype != dtype:
            raise TypeError(
                f"{name}: expected a floating mask of dtype {dtype_name(dtype)} ({dtype_source}), "
                f"got {dtype_name(mask.dtype)}; cast it first (no silent promotion)"
            )
    else:
        raise TypeError(
            f"{name}: expected dtype bool (True = may attend) or {dtype_name(dtype)} (added to "
            f"the scores, -inf allowed), got {dtype_name(mask.dtype)}; integer masks are "
            "ambiguous, convert with mask != 0 or mask.astype(float)"
        )
    shape = shape_of(mask)
    if ndims is not None and len(shape) not in ndims:
        hint = ""
        if len(shape) == 3:
            hint = (
                "; a 3-D mask is ambiguous (batch or heads first?): reshape it to "
                "(B, 1, Lq, Lk) for one mask per batch element, or (1, H, Lq, Lk) per head"
            )
        raise ValueError(
            f"{name}: expected a {' or '.join(f'{n}-D' for n in ndims)} array broadcastable to "
            f"{target_text} = {target}, got shape {shape}{hint}"
        )
    if len(shape) > len(target):
        raise _broadcast_error(name, shape, target, target_text)
    for n, t in zip(reversed(shape), reversed(target)):
        if n != 1 and n != t:
            raise _broadcast_error(name, shape, target, target_text)


def heads_layout(q: Any, k: Any, v: Any, *masks: Any) -> bool:
    """Whether q (B, Hq, Lq, Dh), k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv) share one B,
    Hkv divides Hq, and every mask (None skipped) broadcasts to (B, Hq, Lq, Lk) without
    growing it: the layout the NumPy kernel and the chunked implementation take."""
    if not (q.ndim == k.ndim == v.ndim == 4 and q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    if k.shape[1:3] != v.shape[1:3] or k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        return False
    full = tuple(q.shape[:3]) + (k.shape[2],)
    for m in masks:
        if m is not None:
            try:
                if m.ndim > 4 or np.broadcast_shapes(tuple(m.shape), full) != full:
                    return False
            except ValueError:
                return False
    return True


# --------------------------------------------------------------------------
# finite check (opt-in: reads the data)


def check_finite_values(name: str, x: Any, xp: Any, *, allow_neg_inf: bool = False) -> None:
    """``ValueError`` when ``x`` holds NaN or an infinity (``-inf`` allowed when asked)."""
    check_finite_arrays([(name, x, allow_neg_inf)], xp)


def check_finite_arrays(entries: Sequence[tuple], xp: Any) -> None:
    """``check_finite_values`` of each ``(name, x, allow_neg_inf)`` in ``entries``, the first
    one with a NaN or an infinity named. The counts are read together: on dask in one
    graph, where a read per array runs a graph each (and reads an array given twice twice)."""
    counts = []
    for name, x, allow_neg_inf in entries:
        if x is None or not _is_floating(xp, x.dtype):
            continue
        if allow_neg_inf:
            bad = xp.logical_or(xp.isnan(x), x == math.inf)
            what = "NaN or +inf (-inf is allowed in an additive mask)"
        else:
            bad = xp.logical_not(xp.isfinite(x))
            what = "NaN or inf"
        counts.append((name, what, xp.sum(xp.astype(bad, xp.int64))))  # []
    for (name, what, _), n in zip(counts, computed(*(n for _, _, n in counts))):
        n_bad = int(n)
        if n_bad:
            raise ValueError(f"{name}: expected finite values, got {n_bad} entries that are {what}")


# --------------------------------------------------------------------------
# functional.sdpa_forward


def check_sdpa_inputs(q: Any, k: Any, v: Any, *, mask: Any, dropout_mask: Any, dropout_p: Any,
                      scale: Any, is_causal: Any, enable_gqa: Any = False, rng: Any = None) -> None:
    """Check the arguments of ``functional.sdpa_forward``.

    q (..., Lq, Dh), k (..., Lk, Dh), v (..., Lk, Dv): arrays of one library
    and device whose leading axes broadcast against each other (as in torch's
    SDPA) and one real floating dtype; masks broadcast to the scores
    (..., Lq, Lk) without changing their shape. With ``enable_gqa`` the head
    axes of k and v may differ from q's; that rule is checked by sdpa's
    grouped-query code.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
    xp = namespace(q)
    device = device_of(q)
    for name, x in (("k", k), ("v", v)):
        check_array(name, x, xp, device, where="like q", library="that of q")
    if not _is_floating(xp, q.dtype):
        raise not_floating("q", q.dtype)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name}: expected dtype {dtype_name(q.dtype)} (that of q), got "
                f"{dtype_name(x.dtype)} (no silent promotion)"
            )
    for name, x, layout in (("q", q, "(..., Lq, Dh)"), ("k", k, "(..., Lk, Dh)"),
                            ("v", v, "(..., Lk, Dv)")):
        if x.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 axes {layout}, got shape {shape_of(x)}")
    # enable_gqa chooses the rule for the head axes below: a bool first (an array's truth
    # value fails naming nothing, and None would pick the rule of plain attention)
    check_bool("enable_gqa", enable_gqa)
    lead = shape_of(q)[:-2]
    for name, x in (("k", k), ("v", v)):
        if enable_gqa:
            break
        try:  # leading (batch) axes broadcast against each other, as in torch's SDPA
            lead = tuple(np.broadcast_shapes(lead, shape_of(x)[:-2]))
        except ValueError:
            hint = ""
            if (q.ndim >= 3 and k.ndim >= 3 and v.ndim >= 3 and k.shape[-3] == v.shape[-3]
                    and 0 < k.shape[-3] < q.shape[-3] and q.shape[-3] % k.shape[-3] == 0):
                try:  # fewer heads that divide q's and batch axes that broadcast: grouped-query
                    np.broadcast_shapes(shape_of(q)[:-3], shape_of(k)[:-3], shape_of(v)[:-3])
                    hint = (f"; with enable_gqa=True, {x.shape[-3]} key/value heads would serve "
                            f"{q.shape[-3]} query heads")
                except ValueError:
                    pass
            raise ValueError(
                f"{name}: expected leading axes that broadcast with those of q "
                f"{shape_of(q)[:-2]} (and k), got shape {shape_of(x)}{hint}"
            ) from None
    if enable_gqa:
        lead = scores_lead(q, k, v, enable_gqa=True)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k: expected last axis {q.shape[-1]} (that of q), got shape {shape_of(k)}"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v: expected length {k.shape[-2]} (that of k), got shape {shape_of(v)}")
    # empty axes: nothing to attend from, to, or with (an empty batch axis is fine)
    for name, x, axis, what in (("q", q, -1, "head width Dh"), ("q", q, -2, "query length Lq"),
                                ("k", k, -2, "key length Lk")):
        if x.shape[axis] == 0:
            raise ValueError(
                f"{name}: expected a {what} (axis {axis}) of at least 1, got shape {shape_of(x)}"
            )
    target = lead + (int(q.shape[-2]), int(k.shape[-2]))
    check_mask("mask", mask, xp, target=target, target_text="the scores (..., Lq, Lk)",
               dtype=q.dtype, device=device, where="like q", library="that of q",
               dtype_source="that of q")
    check_mask("dropout_mask", dropout_mask, xp, target=target,
               target_text="the scores (..., Lq, Lk)", dtype=q.dtype, device=device,
               bool_only=True, where="like q", library="that of q")
    check_probability("dropout_p", dropout_p)
    check_rng("rng", rng)
    check_bool("is_causal", is_causal)
    check_scale("scale", scale)


def scores_lead(q: Any, k: Any, v: Any, *, enable_gqa: bool = False) -> tuple:
    """The leading axes of the scores: those of q, k and v broadcast together.

    Under grouped-query attention the head axis is q's (Hq) and the batch
    axes before it broadcast. Raises ``ValueError`` when they do not.
    """
    if not enable_gqa:
        try:
            return tuple(np.broadcast_shapes(shape_of(q)[:-2], shape_of(k)[:-2], shape_of(v)[:-2]))
        except ValueError:
            raise ValueError(
                "q, k, v: expected leading axes that broadcast against each other, got shapes "
                f"{shape_of(q)}, {shape_of(k)}, {shape_of(v)}"
            ) from None
    if min(q.ndim, k.ndim, v.ndim) < 3:
        return shape_of(q)[:-2]  # sdpa's grouped-query check names the missing head axis
    try:
        batch = np.broadcast_shapes(shape_of(q)[:-3], shape_of(k)[:-3], shape_of(v)[:-3])
    except ValueError:
        raise ValueError(
            "q, k, v: expected batch axes (before the head axis) that broadcast against each "
            f"other with enable_gqa, got shapes {shape_of(q)}, {shape_of(k)}, {shape_of(v)}"
        ) from None
    return tuple(batch) + (int(q.shape[-3]),)


ALIGNS = ("top_left", "bottom_right")


def _check_window_side(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected None or an int >= 0, got {described(value)}")
    if value < 0:
        raise ValueError(f"{name}: expected None or an int >= 0, got {value!r}")


def check_segment_dtypes(xp: Any, q_segments: Any, k_segments: Any) -> None:
    """``TypeError`` naming ``k_segments`` unless the library compares its ids with
    ``q_segments``' (``xp.result_type`` of the two dtypes: torch and array_api_strict
    promote no int64 with uint64, NumPy compares them as float64)."""
    try:
        xp.result_type(q_segments.dtype, k_segments.dtype)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"k_segments: expected an integer dtype that {xp.__name__} compares with q_segments' "
            f"{dtype_name(q_segments.dtype)}, got {dtype_name(k_segments.dtype)}"
        ) from None


def check_kernel_options(q: Any, k: Any, *, lead: tuple, align: Any = "top_left",
                         window: Any = None, softcap: Any = None, alibi_slopes: Any = None,
                         sinks: Any = None, q_segments: Any = None,
                         k_segments: Any = None) -> None:
    """Check the kernel options of ``functional.sdpa_forward`` (see there).

    ``lead`` is the leading shape of the scores (``scores_lead``): the last
    entry is the head count H, the one before it the batch B.
    """
    xp = namespace(q)
    device = device_of(q)
    check_choice("align", align, ALIGNS)
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(
                f"window: expected None or a pair (left, right) of ints >= 0 or None, got "
                f"{described(window)}"
            )
        _check_window_side("window[0] (left)", window[0])
        _check_window_side("window[1] (right)", window[1])
    check_softcap(softcap)
    H = lead[-1] if len(lead) >= 1 else None
    B = lead[-2] if len(lead) >= 2 else None
    Lq, Lk = int(q.shape[-2]), int(k.shape[-2])
    for name, a, shapes in (("alibi_slopes", alibi_slopes, ((H,), (B, H))), ("sinks", sinks, ((H,),))):
        if a is None:
            continue
        check_floating_array(name, a, xp, device, like="q")
        # sinks have a gradient, in q's dtype; slopes are constants, taken in the dtype of
        # the scores (flash-attn's are float32 whatever q's; a gradient check's q is float64)
        if name == "sinks" and a.dtype != q.dtype:
            raise TypeError(
                f"{name}: expected dtype {dtype_name(q.dtype)} (that of q), got "
                f"{dtype_name(a.dtype)} (no silent promotion)"
            )
        # the shapes the scores' leading axes can hold: (B, H) needs a batch axis
        fits = tuple(s_ for s_ in shapes if len(s_) <= len(lead))
        if shape_of(a) not in fits:
            want = " or ".join(str(s_) for s_ in fits) if fits else \
                f"(H,) with q of at least 3 axes (..., H, Lq, Dh) (q has shape {shape_of(q)})"
            raise ValueError(f"{name}: expected shape {want} (H heads of q), got {shape_of(a)}")
    if (q_segments is None) != (k_segments is None):
        given = "q_segments" if k_segments is None else "k_segments"
        raise ValueError(f"{given}: packed sequences need both q_segments and k_segments, got only {given}")
    for name, a, L in (("q_segments", q_segments, Lq), ("k_segments", k_segments, Lk)):
        if a is None:
            continue
        check_array(name, a, xp, device, where="like q", library="that of q")
        if not isdtype(xp, a.dtype, "integral"):
            raise TypeError(f"{name}: expected an integer array of segment ids, got dtype {dtype_name(a.dtype)}")
        if len(lead) != 2 or shape_of(a) != (B, L):
            want = f"(B, {L}) = {(B, L)}" if len(lead) == 2 else \
                f"(B, L) with q, k, v of 4 axes (B, H, L, Dh) (scores lead {lead})"
            raise ValueError(f"{name}: expected shape {want}, got {shape_of(a)}")
    if q_segments is not None:
        check_segment_dtypes(xp, q_segments, k_segments)
