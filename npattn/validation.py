"""Checks at the boundary: bad input is caught before any computation.

Every public entry point of npattn calls one function of this module on its
first line. Each check raises

* ``TypeError`` for a value of the wrong kind: not an array, an array of
  another library, a dtype that differs from the expected one, a non-bool flag;
* ``ValueError`` for a value of the right kind that is out of range: a wrong
  shape, a mask that does not broadcast, a probability outside [0, 1), an
  array on another device, NaN/Inf under ``check_finite=True``;

and the message names the argument, what was expected and what was received,
so the caller can act on it. ``MultiHeadAttention.backward`` before any
forward raises ``RuntimeError``.

Nothing here computes on, copies or writes into its arguments; apart from the
opt-in finite check, only shapes, dtypes, namespaces and devices are read,
so the checks cost no device work and no synchronisation.

Shape legend: B batch, H heads, Lq query length, Lk key length,
D = d_model, Dk = kdim, Dv = vdim, Dh head width.
"""

from __future__ import annotations

import math
import numbers

import array_api_compat
import numpy as np

from .backend import backend_name, device_of

__all__ = [
    "FLOAT_DTYPES",
    "ParameterDict",
    "check_module_args",
    "check_forward_inputs",
    "check_backward_inputs",
    "check_param",
    "check_sdpa_inputs",
    "check_finite_values",
    "check_mask",
]

#: Parameter dtypes a module accepts (when its backend has them).
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


# --------------------------------------------------------------------------
# small pieces


def _kind(x) -> str:
    """How to call ``x`` in a message: 'numpy.ndarray', 'list', 'None'..."""
    if x is None:
        return "None"
    t = type(x)
    if t.__module__ in ("builtins",):
        return t.__name__
    return f"{t.__module__.split('.')[0]}.{t.__name__}"


def _dtype_name(dtype) -> str:
    """'float32' for numpy, torch and array_api_strict dtypes alike."""
    if isinstance(dtype, np.dtype):
        return dtype.name
    if isinstance(dtype, type):  # NumPy scalar types, as array_api_compat.numpy.float32
        return dtype.__name__
    return str(dtype).rsplit(".", 1)[-1]


def _shape(x) -> tuple:
    return tuple(int(n) for n in x.shape)


def _same_namespace(xp_a, xp_b) -> bool:
    return xp_a is xp_b or backend_name(xp_a) == backend_name(xp_b)


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {_kind(value)} {value!r}")


def _check_positive_int(name, value, *, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int, got {_kind(value)} {value!r}")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _check_probability(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}: expected a float drop probability in [0, 1), got {_kind(value)} {value!r}"
        )
    if not (0.0 <= float(value) < 1.0):  # also False for NaN
        raise ValueError(f"{name}: expected a drop probability in [0, 1), got {value!r}")


def _check_array(name, x, xp=None, device=None, where="where the parameters live"):
    """``x`` is an array of namespace ``xp`` on ``device`` (each when given)."""
    if not array_api_compat.is_array_api_obj(x):
        expected = f"a {backend_name(xp)} array" if xp is not None else "an array"
        raise TypeError(f"{name}: expected {expected}, got {_kind(x)}")
    if xp is not None:
        got = array_api_compat.array_namespace(x)
        if not _same_namespace(got, xp):
            raise TypeError(
                f"{name}: expected a {backend_name(xp)} array (the module's backend), "
                f"got a {backend_name(got)} array ({_kind(x)}); convert it first, "
                "or build the module with that backend"
            )
    if device is not None and device_of(x) != device:
        raise ValueError(
            f"{name}: expected an array on device {device!r} ({where}), "
            f"got one on device {device_of(x)!r}"
        )


def _is_floating(xp, dtype) -> bool:
    return xp.isdtype(dtype, "real floating")


def _is_bool(xp, dtype) -> bool:
    return xp.isdtype(dtype, "bool")


def _broadcast_error(name, shape, target, target_text):
    return ValueError(
        f"{name}: expected a shape that broadcasts to {target_text} = {target} "
        f"(each axis 1 or equal to it), got shape {shape}"
    )


# --------------------------------------------------------------------------
# construction


def check_module_args(xp, *, d_model, n_head, dropout, bias, kdim, vdim, dtype, seed,
                      **layer_args) -> str:
    """Check the arguments of ``MultiHeadAttention(...)``; ``backend`` was resolved to ``xp``.

    ``layer_args`` may hold the optional layer-shape arguments ``qdim`` and
    ``n_kv_head`` (None or a positive int; ``n_kv_head`` divides ``n_head``)
    and the flags ``qkv_bias``, ``out_bias`` (None or bool), ``add_bias_kv``,
    ``add_zero_attn`` (bool).

    Returns the name of the parameter dtype ("float32", ...), which may be
    given as a string or as a dtype object of any library.
    """
    _check_positive_int("d_model", d_model)
    _check_positive_int("n_head", n_head)
    if d_model % n_head != 0:
        raise ValueError(
            f"d_model: expected a multiple of n_head={n_head}, got d_model={d_model} "
            f"(d_model % n_head = {d_model % n_head})"
        )
    _check_probability("dropout", dropout)
    _check_bool("bias", bias)
    _check_positive_int("kdim", kdim, allow_none=True)
    _check_positive_int("vdim", vdim, allow_none=True)
    for name, value in layer_args.items():
        if name in ("qdim", "n_kv_head"):
            _check_positive_int(name, value, allow_none=True)
        elif name in ("qkv_bias", "out_bias", "add_bias_kv", "add_zero_attn"):
            if value is not None:
                _check_bool(name, value)
        else:
            raise TypeError(f"check_module_args: unexpected argument {name!r}")
    n_kv_head = layer_args.get("n_kv_head")
    if n_kv_head is not None and n_head % n_kv_head != 0:
        raise ValueError(f"n_kv_head: expected a divisor of n_head={n_head}, got {n_kv_head}")
    if seed is not None:
        if isinstance(seed, (bool, np.bool_)):
            raise TypeError(f"seed: expected None or a non-negative int, got bool {seed!r}")
        try:
            np.random.SeedSequence(seed)
        except TypeError:
            raise TypeError(
                f"seed: expected None or a non-negative int, got {_kind(seed)} {seed!r}"
            ) from None
        except ValueError:
            raise ValueError(f"seed: expected None or a non-negative int, got {seed!r}") from None
    return _dtype_arg(xp, dtype)


def _dtype_arg(xp, dtype) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name  # NumPy dtypes and scalar types
        except TypeError:
            name = _dtype_name(dtype)  # torch.float32, array_api_strict.float32
    available = [n for n in FLOAT_DTYPES if hasattr(xp, n)]
    if name not in available:
        if not isinstance(dtype, str) and name not in FLOAT_DTYPES:
            raise TypeError(
                f"dtype: expected one of {available} (a name or a dtype), got {_kind(dtype)} {dtype!r}"
            )
        raise ValueError(
            f"dtype: expected one of {available} for backend {backend_name(xp)!r}, got {dtype!r}"
        )
    return name


# --------------------------------------------------------------------------
# parameters


def check_param(name, value, *, like, xp):
    """Check ``value`` as a replacement for parameter ``name`` currently holding ``like``.

    Same library, device, dtype and shape as the array it replaces.
    """
    label = f"params[{name!r}]"
    _check_array(label, value, xp, device_of(like))
    if value.dtype != like.dtype:
        raise TypeError(
            f"{label}: expected dtype {_dtype_name(like.dtype)} (the module's dtype), "
            f"got {_dtype_name(value.dtype)}; cast it first (no silent promotion)"
        )
    if _shape(value) != _shape(like):
        raise ValueError(f"{label}: expected shape {_shape(like)}, got {_shape(value)}")


class ParameterDict(dict):
    """The module's ``params``: a ``dict`` whose keys are fixed and whose values are checked.

    Assigning ``params[name] = array`` goes through ``check_param``: the array
    must have the library, device, dtype and shape of the one it replaces, or
    ``TypeError``/``ValueError`` is raised and nothing changes. Unknown names
    raise ``ValueError``; parameters cannot be deleted (``TypeError``).
    ``update`` checks every value before assigning any. Copies
    (``copy.copy``, ``copy.deepcopy``, ``pickle``, ``.copy()``) are plain
    dicts, ready to be assigned back with ``module.params = saved``.
    """

    def __init__(self, params, *, xp):
        super().__init__(params)
        self._xp = xp

    def _check_item(self, name, value):
        if name not in self:
            raise ValueError(
                f"params: expected one of the names {sorted(self)}, got {name!r}"
            )
        check_param(name, value, like=dict.__getitem__(self, name), xp=self._xp)

    def __setitem__(self, name, value):
        self._check_item(name, value)
        super().__setitem__(name, value)

    def update(self, *args, **kwargs):
        new = dict(*args, **kwargs)
        for name, value in new.items():
            self._check_item(name, value)
        for name, value in new.items():
            super().__setitem__(name, value)

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, name, default=None):
        if name in self:
            return self[name]
        self._check_item(name, default)  # raises: the names are fixed

    def _fixed(self, *args, **kwargs):
        raise TypeError("params: parameters cannot be removed; assign a new array instead")

    __delitem__ = pop = popitem = clear = _fixed

    def replace_all(self, new):
        """``module.params = new``: ``new`` must hold exactly the same names; all checked first."""
        if not isinstance(new, dict):
            raise TypeError(f"params: expected a dict of arrays, got {_kind(new)}")
        if set(new) != set(self):
            raise ValueError(
                f"params: expected exactly the names {sorted(self)}, got {sorted(map(str, new))}"
            )
        self.update(new)

    def __reduce__(self):
        return (dict, (dict(self),))


# --------------------------------------------------------------------------
# masks


def check_mask(name, mask, xp, *, target, target_text, dtype, device=None, ndims=None,
               bool_only=False, where="where the parameters live"):
    """Check a mask against the score shape ``target``.

    ``mask`` must be an array of ``xp`` (on ``device``), boolean or, unless
    ``bool_only``, real floating of ``dtype``; integers are rejected as
    ambiguous. Its shape must broadcast to ``target`` without changing
    ``target``: right-aligned, each axis 1 or equal. ``ndims`` restricts the
    accepted number of axes.
    """
    if mask is None:
        return
    _check_array(name, mask, xp, device, where)
    if _is_bool(xp, mask.dtype):
        pass
    elif bool_only:
        raise TypeError(
            f"{name}: expected a bool keep-mask (True = keep), got dtype {_dtype_name(mask.dtype)}"
        )
    elif _is_floating(xp, mask.dtype):
        if mask.dtype != dtype:
            raise TypeError(
                f"{name}: expected a floating mask of dtype {_dtype_name(dtype)} (the inputs' "
                f"dtype), got {_dtype_name(mask.dtype)}; cast it first (no silent promotion)"
            )
    else:
        raise TypeError(
            f"{name}: expected dtype bool (True = may attend) or {_dtype_name(dtype)} (added to "
            f"the scores, -inf allowed), got {_dtype_name(mask.dtype)}; integer masks are "
            "ambiguous, convert with mask != 0 or mask.astype(float)"
        )
    shape = _shape(mask)
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


# --------------------------------------------------------------------------
# finite check (opt-in: reads the data)


def check_finite_values(name, x, xp, *, allow_neg_inf=False):
    """``ValueError`` when ``x`` holds NaN or an infinity (``-inf`` allowed when asked)."""
    if x is None or not _is_floating(xp, x.dtype):
        return
    if allow_neg_inf:
        bad = xp.logical_or(xp.isnan(x), x == math.inf)
        what = "NaN or +inf (-inf is allowed in an additive mask)"
    else:
        bad = xp.logical_not(xp.isfinite(x))
        what = "NaN or inf"
    n_bad = int(xp.sum(xp.astype(bad, xp.int64)))
    if n_bad:
        raise ValueError(f"{name}: expected finite values, got {n_bad} entries that are {what}")


# --------------------------------------------------------------------------
# MultiHeadAttention.forward / backward


def check_forward_inputs(module, query, key, value, *, mask, dropout_mask, is_causal,
                         need_weights, check_finite: bool = False):
    """Check the arguments of ``MultiHeadAttention.forward`` against ``module``.

    query (B, Lq, D), key (B, Lk, Dk), value (B, Lk, Dv): arrays of the
    module's backend and device, of the parameters' dtype exactly; masks of
    2 or 4 axes broadcasting to (B, H, Lq, Lk).
    """
    _check_bool("is_causal", is_causal)
    _check_bool("need_weights", need_weights)
    _check_bool("check_finite", check_finite)
    xp = module.xp
    device = device_of(module.params["w_q"])
    dtype = module.dtype
    # input widths are those of the weights (PyTorch layout: (out, in))
    widths = {n: int(module.params[w].shape[1]) for n, w in
              (("query", "w_q"), ("key", "w_k"), ("value", "w_v"))}
    inputs = {"query": query, "key": key, "value": value}
    for name, x in inputs.items():
        _check_array(name, x, xp, device)
        if x.ndim != 3:
            raise ValueError(
                f"{name}: expected a 3-D array (B, L, {widths[name]}), got shape {_shape(x)}"
            )
    for name, x in inputs.items():
        if x.dtype != dtype:
            raise TypeError(
                f"{name}: expected dtype {_dtype_name(dtype)} (the parameters' dtype), got "
                f"{_dtype_name(x.dtype)}; cast the input or build the module with "
                f"dtype={_dtype_name(x.dtype)!r} (no silent promotion)"
            )
    B, Lq, _ = _shape(query)
    for name, x in inputs.items():
        if x.shape[0] != B:
            raise ValueError(
                f"{name}: expected batch size {B} (that of query), got shape {_shape(x)}"
            )
        if x.shape[-1] != widths[name]:
            w = {"query": "w_q", "key": "w_k", "value": "w_v"}[name]
            raise ValueError(
                f"{name}: expected last axis {widths[name]} (the input width of {w}), "
                f"got shape {_shape(x)}"
            )
    Lk = int(key.shape[1])
    if value.shape[1] != Lk:
        raise ValueError(
            f"value: expected length {Lk} (that of key), got shape {_shape(value)}"
        )
    for name, n in (("batch size of query", B), ("query length", Lq), ("key length", Lk)):
        if n == 0:
            raise ValueError(f"{name}: expected at least 1, got 0")
    target = (B, module.n_head, Lq, Lk)
    check_mask("mask", mask, xp, target=target, target_text="(B, H, Lq, Lk)", dtype=dtype,
               device=device, ndims=(2, 4))
    # the keep-mask also covers the extra keys of add_bias_kv / add_zero_attn, if any
    n_extra = int(bool(getattr(module, "add_bias_kv", False))) + int(
        bool(getattr(module, "add_zero_attn", False)))
    check_mask("dropout_mask", dropout_mask, xp, target=(B, module.n_head, Lq, Lk + n_extra),
               target_text="(B, H, Lq, Lk + n)" if n_extra else "(B, H, Lq, Lk)",
               dtype=dtype, device=device, ndims=(2, 4), bool_only=True)
    if check_finite:
        for name, x in inputs.items():
            check_finite_values(name, x, xp)
        check_finite_values("mask", mask, xp, allow_neg_inf=True)
        for name, p in module.params.items():
            check_finite_values(f"params[{name!r}]", p, xp)


def check_backward_inputs(module, dout):
    """Check ``MultiHeadAttention.backward(dout)``: a forward ran, ``dout`` matches its output."""
    cache = module._cache
    if cache is None:
        raise RuntimeError(
            "backward: expected a forward call first (there is no cached forward to "
            "differentiate); call module(query, key, value) and then backward(dout)"
        )
    _check_array("dout", dout, module.xp, device_of(cache.out_proj.w))
    if _shape(dout) != tuple(cache.out_shape):
        raise ValueError(
            f"dout: expected shape {tuple(cache.out_shape)} (that of the last forward's "
            f"output), got {_shape(dout)}"
        )
    if dout.dtype != cache.out_dtype:
        raise TypeError(
            f"dout: expected dtype {_dtype_name(cache.out_dtype)} (that of the last forward's "
            f"output), got {_dtype_name(dout.dtype)}"
        )


# --------------------------------------------------------------------------
# functional.sdpa_forward


def check_sdpa_inputs(q, k, v, *, mask, dropout_mask, dropout_p, scale, is_causal,
                      enable_gqa=False):
    """Check the arguments of ``functional.sdpa_forward``.

    q (..., Lq, Dh), k (..., Lk, Dh), v (..., Lk, Dv): arrays of one library
    and device with the same leading axes and one real floating dtype; masks
    broadcast to the scores (..., Lq, Lk) without changing their shape. With
    ``enable_gqa`` the head axes of k and v may differ from q's; that rule is
    checked by sdpa's grouped-query code.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x)
    xp = array_api_compat.array_namespace(q)
    device = device_of(q)
    for name, x in (("k", k), ("v", v)):
        _check_array(name, x, xp, device, where="like q")
    if not _is_floating(xp, q.dtype):
        raise TypeError(f"q: expected a real floating dtype, got {_dtype_name(q.dtype)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name}: expected dtype {_dtype_name(q.dtype)} (that of q), got "
                f"{_dtype_name(x.dtype)} (no silent promotion)"
            )
    if q.ndim < 2:
        raise ValueError(f"q: expected at least 2 axes (..., Lq, Dh), got shape {_shape(q)}")
    lead = _shape(q)[:-2]
    for name, x in (("k", k), ("v", v)):
        if enable_gqa:
            break
        if x.ndim != q.ndim or _shape(x)[:-2] != lead:
            raise ValueError(
                f"{name}: expected shape ({', '.join(map(str, lead + ('L', 'D')))}) with the "
                f"leading axes of q {_shape(q)}, got {_shape(x)}"
            )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k: expected last axis {q.shape[-1]} (that of q), got shape {_shape(k)}"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v: expected length {k.shape[-2]} (that of k), got shape {_shape(v)}")
    target = lead + (int(q.shape[-2]), int(k.shape[-2]))
    check_mask("mask", mask, xp, target=target, target_text="the scores (..., Lq, Lk)",
               dtype=q.dtype, device=device, where="like q")
    check_mask("dropout_mask", dropout_mask, xp, target=target,
               target_text="the scores (..., Lq, Lk)", dtype=q.dtype, device=device,
               bool_only=True, where="like q")
    _check_probability("dropout_p", dropout_p)
    _check_bool("is_causal", is_causal)
    if scale is not None:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale: expected None or a float, got {_kind(scale)} {scale!r}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale: expected a finite float, got {scale!r}")
