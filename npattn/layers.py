"""The pieces of a Transformer block around attention, each with a hand-derived backward.

Layer normalisation, ReLU, GELU (exact and tanh), the position-wise feed-forward
network, the residual connection and mean pooling over the sequence (a
classifier's readout). Same contract as ``npattn.functional``::

    out, cache = op_forward(*inputs, ...)
    grads      = op_backward(dout, cache)

``cache`` is a ``NamedTuple`` holding exactly what the backward needs;
gradients come back in the order of the forward's array inputs, named
``d<name>``; nothing writes into its arguments or its cache. The forward
numbers its steps and the backward walks them in reverse, quoting the line it
differentiates; ``docs/layers.md`` derives the same steps with the same names.

Shape legend
------------
``...`` any leading axes (B, L in a Transformer), D model width,
F the feed-forward width (4 D in GPT-2), L the sequence axis that mean pooling
averages over.

Half precision: layer norm and the activations compute in float32 for
float16/bfloat16 inputs (``functional.compute_dtype``) and return the input's
dtype; gradients come back in the dtype of what they differentiate.

Code uses only the Python Array API standard through ``xp``, the namespace of
the inputs. The exact GELU needs ``erf``, which the standard lacks; ``erf``
below computes it from a series and a continued fraction.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Optional

from . import functional as F
from . import validation as V
from .backend import (copy_array, device_of, generator_kept_on_failure, namespace, scalar,
                      without_empty_chunks, zero_d)

__all__ = [
    "erf",
    "layer_norm_forward",
    "check_layer_norm_inputs",
    "layer_norm_backward",
    "relu_forward",
    "relu_backward",
    "gelu_forward",
    "gelu_backward",
    "feed_forward_forward",
    "feed_forward_backward",
    "residual_forward",
    "residual_backward",
    "mean_pool_forward",
    "mean_pool_backward",
]

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
GELU_FORMS = ("none", "tanh")


def check_eps(name: str, value: Any, xp: Any = None, dtype: Any = None) -> None:
    """``TypeError`` unless ``value`` is a real number, ``ValueError`` unless it is finite and > 0
    and, given ``xp`` and ``dtype``, one that layer norm's compute dtype holds: an ``eps`` that
    rounds to inf there turns every row into 0, one that rounds to 0 a constant row into NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a positive float, got {V.described(value)}")
    if not (0.0 < V.real_value(value) < math.inf):
        raise ValueError(f"{name}: expected a positive finite float, got {V.real_text(value)}")
    if dtype is None:
        return
    ct = F.compute_dtype(xp, dtype)
    fi = xp.finfo(ct)
    low, high = float(fi.smallest_normal) * float(fi.eps), float(fi.max)  # the least subnormal, max
    if not low <= V.real_value(value) <= high:
        within = f"{V.dtype_name(ct)}'s range [{low!r}, {high!r}]"  # exact: 1.4e-45 lies below 2**-149
        if V.dtype_name(ct) != V.dtype_name(dtype):
            within += f" ({V.dtype_name(dtype)} computes layer norm in {V.dtype_name(ct)})"
        raise ValueError(f"{name}: expected a positive float within {within}, got {value!r}")


def _compute(xp: Any, x: Any) -> Any:
    """``x`` in the dtype the arithmetic runs in (float32 for half precision)."""
    ct = F.compute_dtype(xp, x.dtype)
    return x if ct == x.dtype else xp.astype(x, ct)


# --------------------------------------------------------------------------
# erf, for the exact GELU


#: Below this |x| erf is summed as a series; above it erfc is a continued fraction.
ERF_SPLIT = 2.5
#: Terms of each; with these the float64 error against ``math.erf`` is at most 1.2e-15.
ERF_SERIES_TERMS = 40
ERF_FRACTION_TERMS = 40
#: erf(x) rounds to 1.0 in float64 beyond ~5.9; clamping keeps exp(-x^2) away from 0 * inf.
ERF_CLAMP = 10.0


def erf(x: Any) -> Any:
    """The error function ``erf(x) = 2/sqrt(pi) int_0^x exp(-t^2) dt``, elementwise.

    The Array API standard has no ``erf``; this computes it from ``|x|`` and
    sets the sign after, so ``erf(-x) == -erf(x)`` exactly:

    * ``|x| < 2.5``: the series with positive terms only (no cancellation),
      ``erf(a) = 2/sqrt(pi) exp(-a^2) sum_{k>=0} (2 a^2)^k a / (1 * 3 * ... * (2k+1))``,
      40 terms;
    * ``|x| >= 2.5``: ``erf(a) = 1 - erfc(a)`` with the continued fraction
      ``erfc(a) = exp(-a^2)/sqrt(pi) * 1/(a + (1/2)/(a + 1/(a + (3/2)/(a + 2/(a + ...)))))``,
      40 levels, evaluated from the bottom up.

    Measured in float64 against ``math.erf`` over 200001 evenly spaced
    points in [-10, 10]: max absolute error 1.2e-15, max relative error
    1.2e-15 (``tests/test_layers.py`` checks <= 2e-15 on 1e5 points). Half
    precision is computed in float32 and rounded to the input's dtype; NaN
    stays NaN and ``erf(+-inf) = +-1``.

    Parameters
    ----------
    x : array, any shape, real floating

    Returns
    -------
    array, shape and dtype of ``x``
    """
    # [...] -> [...]
    V.check_floating_array("x", x)
    return _erf(namespace(x), x)


def _erf(xp, x):
    """``erf`` on a checked argument."""
    # [...] -> [...]
    xc = _compute(xp, x)  # [...]
    a = xp.minimum(xp.abs(xc), scalar(xp, ERF_CLAMP, xc))  # [...] NaN stays NaN
    # double where: each branch only meets the |x| it is accurate (and finite) for
    small = a < ERF_SPLIT  # [...] bool
    s_in = xp.where(small, a, scalar(xp, 0.0, a))  # [...]
    s2 = s_in * s_in
    term, total = s_in, s_in  # k = 0: a
    for k in range(1, ERF_SERIES_TERMS):
        term = term * (2.0 * s2) / float(2 * k + 1)  # (2 a^2)^k a / (1 * 3 * ... * (2k+1))
        total = total + term
    series = (2.0 / math.sqrt(math.pi)) * xp.exp(-s2) * total  # [...]
    f_in = xp.where(small, scalar(xp, ERF_SPLIT, a), a)  # [...]
    t = f_in
    for k in range(ERF_FRACTION_TERMS, 0, -1):
        t = f_in + (0.5 * k) / t  # level k of the fraction: a + (k/2) / (level k+1)
    erfc = xp.exp(-f_in * f_in) / (math.sqrt(math.pi) * t)  # [...]
    e = xp.where(small, series, 1.0 - erfc)  # [...] erf(|x|)
    e = xp.where(xp.signbit(xc), -e, e)  # [...] (signbit: erf(-0.0) = -0.0, as math.erf)
    return e if e.dtype == x.dtype else xp.astype(e, x.dtype)


# --------------------------------------------------------------------------
# layer norm over the last axis: y = (x - mean) / sqrt(var + eps) * weight + bias


class LayerNormCache(NamedTuple):
    """What ``layer_norm_backward`` needs from ``layer_norm_forward``."""
    xhat: Any  #: [..., D] normalised x, in the compute dtype
    rstd: Any  #: [..., 1] 1 / sqrt(var + eps), in the compute dtype
    weight: Any  #: [D] or None
    has_bias: bool  #: whether the forward added a bias (``dbias`` is None without one)
    dtype: Any  #: dtype of x (and of dx)


def _square_safe(xp: Any, dtype: Any, D: int) -> float:
    """Largest ``max|xc|`` whose ``sum(xc^2)`` over ``D`` entries cannot overflow ``dtype``
    (halved for rounding)."""
    return math.sqrt(float(xp.finfo(dtype).max) / (2.0 * D))


def layer_norm_forward(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
                       ) -> tuple[Any, LayerNormCache]:
    """Layer normalisation over the last axis, as ``torch.nn.functional.layer_norm(x, (D,), ...)``.

    Steps, per row of ``D`` entries (biased variance, as torch):

    1. ``mu = mean(x)``                                   [..., 1]
    2. ``xc = x - mu``                                    [..., D]
    3. ``var = mean(xc^2)``                               [..., 1]
    4. ``rstd = 1 / sqrt(var + eps)``                     [..., 1]
    5. ``xhat = xc * rstd``                               [..., D]
    6. ``y = xhat * weight + bias``                       [..., D]

    A row whose squares could overflow (``max|xc| > sqrt(finfo.max / (2 D))``,
    about 2e17 in float32 at D = 4096) runs steps 3-5 in units of
    ``s = max|xc|``, with ``eps`` still added in x's units, so a float32 row
    of 1e20s is normalised as the same row divided by 1e20; every other row
    computes the steps exactly as written. NaN or inf in a row gives NaN,
    as does a row whose sum overflows in step 1 (entries near finfo.max / D).

    Parameters
    ----------
    x : array, shape (..., D), real floating
    weight : array, shape (D,), dtype of ``x``, optional (None: 1)
    bias : array, shape (D,), dtype of ``x``, optional (None: 0)
    eps : float
        Added to the variance, > 0 and within the compute dtype's range, from its least
        subnormal to its largest value (float32's for float32 and half precision: 2**-149,
        about 1.401e-45, to 3.403e38); far enough past it, eps would round to inf (every
        row 0) or to 0 (a constant row NaN), so it is refused (and so are the slivers just
        past the ends, which round to the ends).

    Returns
    -------
    y : array, shape and dtype of ``x``
    cache : LayerNormCache
    """
    # [..., D], [D], [D] -> [..., D]
    check_layer_norm_inputs(x, weight, bias, eps)
    xp = namespace(x)
    xc32 = _compute(xp, x)  # [..., D]
    mu = xp.mean(xc32, axis=-1, keepdims=True)  # 1.  [..., 1]
    xc = xc32 - mu  # 2.                                [..., D]
    # 3.-5. in units of s, xs = xc / s: s = max|xc| in a row whose xc^2 could overflow (there
    # mean(xs^2) lies in [1/D, 1], and eps / s^2 underflows only where it is negligible next to
    # it); s = 1 in every other row, which so computes the quoted lines exactly (a NaN row too)
    xr = without_empty_chunks(xc)  # (dask's max and min fail on chunks of length 0)
    amax = xp.maximum(xp.max(xr, axis=-1, keepdims=True),
                      -xp.min(xr, axis=-1, keepdims=True))  # max|xc|, [..., 1]
    overflows = amax > _square_safe(xp, xc.dtype, int(xc.shape[-1]))  # [..., 1] bool
    s = xp.where(overflows, amax, scalar(xp, 1.0, amax))  # [..., 1]
    xs = xc * (1.0 / s)  # [..., D] (a product: 1 / s is exact where s = 1)
    var_s = xp.mean(xs * xs, axis=-1, keepdims=True)  # 3. var / s^2,       [..., 1]
    rstd_s = 1.0 / xp.sqrt(var_s + float(eps) / s / s)  # 4. s * rstd,    [..., 1]
    rstd = rstd_s / s  # [..., 1]
    xhat = xs * rstd_s  # 5. xc * rstd,                 [..., D]
    y = xhat  # 6.                                      [..., D]
    if weight is not None:
        y = y * _compute(xp, weight)
    if bias is not None:
        y = y + _compute(xp, bias)
    y = y if y.dtype == x.dtype else xp.astype(y, x.dtype)
    if y is xhat:  # no weight, no bias, no cast: a copy, so that the cache's xhat does not
        y = copy_array(xp, y)  # change if the caller writes into y
    return y, LayerNormCache(xhat, rstd, weight, bias is not None, x.dtype)


def check_layer_norm_inputs(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``layer_norm_forward`` takes ``(x, weight, bias, eps)``."""
    V.check_floating_array("x", x)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x: expected shape (..., D) with D >= 1, got shape {V.shape_of(x)}")
    D = int(x.shape[-1])
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            V.check_floating_array(name, p, namespace(x), device_of(x), dtype=x.dtype, like="x")
            if V.shape_of(p) != (D,):
                raise ValueError(f"{name}: expected shape ({D},) (D, the last axis of x), got shape {V.shape_of(p)}")
    check_eps("eps", eps, namespace(x), x.dtype)


def layer_norm_backward(dout: Any, cache: LayerNormCache) -> tuple[Any, Any, Any]:
    """Gradients of layer norm, in the compact form.

    With ``g = dout * weight`` and means over the last axis:

    ``dx = rstd * (gc - xhat * mean(gc * xhat))`` with ``gc = g - mean(g)``,
    ``dweight = sum(dout * xhat)`` and ``dbias = sum(dout)`` over every
    leading axis (None where the forward had no weight or bias).

    Parameters
    ----------
    dout : array, shape and dtype of the forward's ``y``
    cache : LayerNormCache

    Returns
    -------
    dx : array, shape (..., D)
    dweight : array, shape (D,) or None
    dbias : array, shape (D,) or None
    """
    # [..., D] -> [..., D], [D], [D]
    V.check_cache("cache", cache, LayerNormCache, "layer_norm_forward")
    V.check_grad("dout", dout, shape=V.shape_of(cache.xhat), dtype=cache.dtype,
                 xp=namespace(cache.xhat), device=device_of(cache.xhat), of="the forward's y")
    xp = namespace(dout, cache.xhat)
    xhat, rstd, w = cache.xhat, cache.rstd, cache.weight
    lead = tuple(range(xhat.ndim - 1))
    d = _compute(xp, dout)  # [..., D]
    # 6. y = xhat * weight + bias
    dweight = None if w is None else xp.astype(xp.sum(d * xhat, axis=lead), w.dtype)  # [D]
    dbias = xp.astype(xp.sum(d, axis=lead), cache.dtype) if cache.has_bias else None  # [D]
    g = d if w is None else d * _compute(xp, w)  # dxhat = g, [..., D]
    # 5. xhat = xc * rstd; 4. rstd = 1 / sqrt(var + eps); 3. var = mean(xc^2);
    # 2. xc = x - mu; 1. mu = mean(x). Through xc, rstd and mu together (docs/layers.md):
    # (rstd is in x's units and finite for a finite row, 1e-20 for a row of 1e20s: nothing
    # below squares x, so nothing overflows)
    # mean(g * xhat) is taken of the centred gc = g - mean(g), equal since mean(xhat) = 0: a
    # large common part of g (dout of 1000 + small) cancels there, not in the sum that follows
    gc = g - xp.mean(g, axis=-1, keepdims=True)  # [..., D]
    gx_mean = xp.mean(gc * xhat, axis=-1, keepdims=True)  # [..., 1]
    dx = rstd * (gc - xhat * gx_mean)  # [..., D]
    dx = dx if dx.dtype == cache.dtype else xp.astype(dx, cache.dtype)
    return dx, dweight, dbias


# --------------------------------------------------------------------------
# ReLU: y = max(x, 0)


class ReluCache(NamedTuple):
    """What ``relu_backward`` needs from ``relu_forward``."""
    off: Any  #: [...] bool, x <= 0 (the entries ReLU zeroes)
    dtype: Any  #: dtype of x (and of dx)


def relu_forward(x: Any) -> tuple[Any, ReluCache]:
    """``y = where(x <= 0, 0, x)``; NaN passes through.

    Parameters
    ----------
    x : array, any shape, real floating

    Returns
    -------
    y : array, shape and dtype of ``x``
    cache : ReluCache
    """
    # [...] -> [...]
    V.check_floating_array("x", x)
    xp = namespace(x)
    off = x <= 0.0  # 1.            [...] bool
    y = xp.where(off, scalar(xp, 0.0, x), x)  # 2.  [...]
    return y, ReluCache(off, x.dtype)


def relu_backward(dout: Any, cache: ReluCache) -> Any:
    """``dx = where(x <= 0, 0, dout)`` (the derivative at 0 is taken as 0, as torch).

    Parameters
    ----------
    dout : array, shape of the forward's ``x``
    cache : ReluCache

    Returns
    -------
    dx : array, shape of ``dout``
    """
    # [...] -> [...]
    V.check_cache("cache", cache, ReluCache, "relu_forward")
    V.check_grad("dout", dout, shape=V.shape_of(cache.off), dtype=cache.dtype,
                 xp=namespace(cache.off), device=device_of(cache.off), of="the forward's y")
    xp = namespace(dout, cache.off)
    # 2. y = where(off, 0, x)
    return xp.where(cache.off, scalar(xp, 0.0, dout), dout)  # [...]


# --------------------------------------------------------------------------
# GELU: y = x * Phi(x), exact or with tanh


#: The tanh form's constants (Hendrycks & Gimpel, 2016), as torch's approximate="tanh".
GELU_TANH_C = 0.044715
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
#: Beyond this ``|x|`` GELU is flat in float32 and float64: the tanh form's t = tanh(u) is +-1 (from
#: ``|x|`` of 5.4 and 7.2), so 1 - t^2 = 0, and the exact form's exp(-x^2/2) is 0 (from 14.4 and 38.6).
#: The powers of x that these multiply (x^3 in u, x^2 in the slopes) are computed from x clipped to
#: it, where they are finite: unclipped, they overflow (x^3 past 7e12 in float32) to inf, which gives
#: the same numbers but sets NumPy's overflow flag, and 0 * inf = NaN in the tanh form's slope.
GELU_TANH_FLAT = 1e4


class GeluCache(NamedTuple):
    """What ``gelu_backward`` needs from ``gelu_forward``."""
    x: Any  #: [...] the input, in the compute dtype
    approximate: str  #: "none" (the exact GELU) or "tanh"
    dtype: Any  #: dtype of x (and of dx)
    g: Any  #: [...] Phi(x) (exact) or t = tanh(u) (tanh form), from the forward


def gelu_forward(x: Any, approximate: str = "none") -> tuple[Any, GeluCache]:
    """GELU, as ``torch.nn.functional.gelu(x, approximate=...)``.

    ``approximate="none"``, exact:

    1. ``phi_cdf = 0.5 * (1 + erf(x / sqrt(2)))``              (Phi, the normal CDF)
    2. ``y = x * phi_cdf``

    ``approximate="tanh"``:

    1. ``u = sqrt(2/pi) * (x + 0.044715 x^3)``
    2. ``t = tanh(u)``
    3. ``y = 0.5 * x * (1 + t)``

    ``erf`` is :func:`erf` (accurate to 1.2e-15 in float64).

    A finite ``x`` of any size gives a finite ``y`` (``x`` itself past 1e4, -0 past -1e4),
    with no overflow on the way (``GELU_TANH_FLAT``); ``x = +inf`` gives ``+inf`` and
    ``x = -inf`` NaN (``-inf * Phi(-inf) = -inf * 0``), in both forms, as torch's float64 gelu.

    Parameters
    ----------
    x : array, any shape, real floating
    approximate : {"none", "tanh"}

    Returns
    -------
    y : array, shape and dtype of ``x``
    cache : GeluCache
        Holds ``x`` and ``Phi(x)`` (or ``t``): the backward reuses them
        instead of computing erf (or tanh) a second time, the dearest part of
        GELU (two arrays kept instead of one).
    """
    # [...] -> [...]
    V.check_floating_array("x", x)
    V.check_choice("approximate", approximate, GELU_FORMS)
    xp = namespace(x)
    xc = _compute(xp, x)  # [...]
    if approximate == "none":
        g = 0.5 * (1.0 + _erf(xp, xc / math.sqrt(2.0)))  # 1. phi_cdf [...]
        y = xc * g  # 2.                                               [...]
    else:
        # (x^3 from x clipped to GELU_TANH_FLAT, past which t = +-1 clipped or not: x^3 overflows
        # past 7e12 in float32; the clip costs a pass over x)
        xs = xp.clip(xc, -GELU_TANH_FLAT, GELU_TANH_FLAT)  # [...] x itself for |x| <= 1e4
        u = SQRT_2_OVER_PI * (xs + GELU_TANH_C * (xs * xs * xs))  # 1.  [...]
        g = xp.tanh(u)  # 2. t                                          [...]
        y = 0.5 * xc * (1.0 + g)  # 3.                                  [...]
    y = y if y.dtype == x.dtype else xp.astype(y, x.dtype)
    return zero_d(y), GeluCache(xc, approximate, x.dtype, g)  # (a 0-d x: a 0-d y, not a scalar)


def gelu_backward(dout: Any, cache: GeluCache) -> Any:
    """Gradient of GELU.

    Exact: ``dx = dout * (Phi(x) + x * exp(-x^2/2) / sqrt(2 pi))``.

    Tanh: ``dx = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))``.

    The slope of a finite ``x`` is finite in both forms, 1 past 1e4 and 0 past -1e4, with
    no overflow on the way. At ``x = +-inf`` it is NaN in the exact form (``inf * 0``, as
    torch's) and 1 or 0 in the tanh form (torch's is NaN there too).

    Parameters
    ----------
    dout : array, shape and dtype of the forward's ``y``
    cache : GeluCache

    Returns
    -------
    dx : array, shape of ``dout``
    """
    # [...] -> [...]
    V.check_cache("cache", cache, GeluCache, "gelu_forward")
    V.check_grad("dout", dout, shape=V.shape_of(cache.x), dtype=cache.dtype,
                 xp=namespace(cache.x), device=device_of(cache.x), of="the forward's y")
    xp = namespace(dout, cache.x)
    x = cache.x
    d = _compute(xp, dout)  # [...]
    if cache.approximate == "none":
        phi_cdf = cache.g  # step 1's Phi(x), kept by the forward [...]
        # 2. y = x * phi_cdf:                      dy/dx = phi_cdf + x * d phi_cdf / dx
        # 1. phi_cdf = 0.5 (1 + erf(x / sqrt(2))): d phi_cdf / dx = phi(x), the normal density
        # (x^2 from x clipped to GELU_TANH_FLAT, past which pdf is 0 either way: x^2 overflows
        # past 1.8e19 in float32, 1.3e154 in float64; x * pdf takes x itself, so +-inf gives
        # inf * 0 = NaN, as torch's)
        xs = xp.clip(x, -GELU_TANH_FLAT, GELU_TANH_FLAT)  # [...] x itself for |x| <= 1e4
        pdf = xp.exp(-0.5 * (xs * xs)) / math.sqrt(2.0 * math.pi)  # [...]
        dx = d * (phi_cdf + x * pdf)  # [...]
    else:
        t = cache.g  # step 2's tanh(u), kept by the forward [...]
        # 3. y = 0.5 * x * (1 + t):  dy/dx = 0.5 (1 + t) + 0.5 x dt/dx
        # 2. t = tanh(u):            dt/du = 1 - t^2
        # 1. u = sqrt(2/pi) (x + 0.044715 x^3):  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
        # dx = d * (0.5 (1 + t) + (1 - t^2) * 0.5 x du/dx), built in place in three
        # new arrays: a fresh array per operation made this 4x slower at (16, 128, 512).
        # 0.5 x du/dx from x clipped to GELU_TANH_FLAT, where 1 - t^2 is 0 already: x^2
        # overflows past 1.8e19 in float32 (1.3e154 in float64), and 0 * inf would be NaN
        xs = xp.clip(x, -GELU_TANH_FLAT, GELU_TANH_FLAT)  # [...] x itself for |x| <= 1e4
        k = xs * xs  # [...]
        k *= 3.0 * GELU_TANH_C
        k += 1.0
        k *= xs
        k *= 0.5 * SQRT_2_OVER_PI  # 0.5 x du/dx
        dx = t * t  # [...]
        dx *= -1.0
        dx += 1.0  # dt/du = 1 - t^2
        dx *= k  # 0.5 x dt/dx
        dx += 0.5 * t
        dx += 0.5  # dy/dx
        dx *= d
    return zero_d(dx if dx.dtype == cache.dtype else xp.astype(dx, cache.dtype))


# --------------------------------------------------------------------------
# position-wise feed-forward: y = Linear2(dropout(act(Linear1(x))))


class FeedForwardCache(NamedTuple):
    """What ``feed_forward_backward`` needs from ``feed_forward_forward``: its steps' caches."""
    lin1: Any  #: functional.LinearCache of h = x @ w1.T + b1
    act: Any  #: ReluCache or GeluCache of a = act(h)
    drop: Any  #: functional.DropoutCache of d = dropout(a); holds the keep-mask
    lin2: Any  #: functional.LinearCache of y = d @ w2.T + b2


def _check_linear(name_w: str, w: Any, name_b: str, b: Any, x: Any, din: int, din_text: str) -> None:
    """A weight ``(Dout, din)`` and an optional bias ``(Dout,)`` of ``x``'s kind."""
    V.check_floating_array(name_w, w, namespace(x), device_of(x), dtype=x.dtype, like="x")
    if w.ndim != 2 or int(w.shape[1]) != din:
        raise ValueError(f"{name_w}: expected shape (n, {din}) ({din_text}), got shape {V.shape_of(w)}")
    if b is not None:
        V.check_floating_array(name_b, b, namespace(x), device_of(x), dtype=x.dtype, like="x")
        if V.shape_of(b) != (int(w.shape[0]),):
            raise ValueError(f"{name_b}: expected shape ({w.shape[0]},) (the first axis of {name_w}), "
                             f"got shape {V.shape_of(b)}")


def feed_forward_forward(x: Any, w1: Any, b1: Any, w2: Any, b2: Any, *, activation: str = "relu",
                         dropout_p: float = 0.0, dropout_mask: Any = None, rng: Any = None
                         ) -> tuple[Any, FeedForwardCache]:
    """The Transformer's position-wise feed-forward network.

    1. ``h = x @ w1.T + b1``              (``functional.linear_forward``)  [..., F]
    2. ``a = act(h)``                     (ReLU, exact GELU or tanh GELU)   [..., F]
    3. ``d = dropout(a, dropout_p)``      (``functional.dropout_forward``)  [..., F]
    4. ``y = d @ w2.T + b2``              (``functional.linear_forward``)  [..., D]

    Parameters
    ----------
    x : array, shape (..., D), real floating
    w1 : array, shape (F, D);  b1 : array, shape (F,), or None
    w2 : array, shape (D, F);  b2 : array, shape (D,), or None
    activation : {"relu", "gelu", "gelu_tanh"}
        "gelu" is the exact form, "gelu_tanh" GPT-2's.
    dropout_p : float
        Drop probability in [0, 1) of the hidden activations.
    dropout_mask : bool array broadcastable to (..., F), optional
        Keep-mask (True = keep); without one it is drawn from ``rng``.
    rng : int, numpy.random.SeedSequence, BitGenerator, Generator or None

    Returns
    -------
    y : array, shape (..., D)
    cache : FeedForwardCache
    """
    # [..., D], [F, D], [F], [D, F], [D] -> [..., D]
    V.check_floating_array("x", x)
    if x.ndim < 1:
        raise ValueError(f"x: expected shape (..., D), got shape {V.shape_of(x)}")
    _check_linear("w1", w1, "b1", b1, x, int(x.shape[-1]), "D, the last axis of x")
    _check_linear("w2", w2, "b2", b2, x, int(w1.shape[0]), "F, the first axis of w1")
    V.check_choice("activation", activation, ACTIVATIONS)
    V.check_probability("dropout_p", dropout_p)
    hidden = (*V.shape_of(x)[:-1], int(w1.shape[0]))
    V.check_mask("dropout_mask", dropout_mask, namespace(x), target=hidden,
                 target_text="the hidden activations (..., F)", dtype=x.dtype, device=device_of(x),
                 bool_only=True, where="like x", library="that of x")
    V.check_rng("rng", rng)
    h, lin1 = F.linear_forward(x, w1, b1)  # 1. [..., F]
    act: Any
    if activation == "relu":
        a, act = relu_forward(h)  # 2.          [..., F]
    else:
        a, act = gelu_forward(h, "none" if activation == "gelu" else "tanh")  # 2. [..., F]
    with generator_kept_on_failure(rng):  # a failed step 4 puts back the draw of step 3
        d, drop = F.dropout_forward(a, dropout_p, mask=dropout_mask, rng=rng)  # 3. [..., F]
        y, lin2 = F.linear_forward(d, w2, b2)  # 4. [..., D]
    return y, FeedForwardCache(lin1, act, drop, lin2)


def feed_forward_backward(dout: Any, cache: FeedForwardCache) -> tuple[Any, Any, Any, Any, Any]:
    """Gradients of the feed-forward network: each step's backward, in reverse.

    Parameters
    ----------
    dout : array, shape (..., D)
    cache : FeedForwardCache

    Returns
    -------
    dx : array, shape (..., D)
    dw1 : array, shape (F, D);  db1 : array, shape (F,) or None
    dw2 : array, shape (D, F);  db2 : array, shape (D,) or None
    """
    # [..., D] -> [..., D], [F, D], [F], [D, F], [D]
    V.check_cache("cache", cache, FeedForwardCache, "feed_forward_forward")
    with V.argument_names({"dy": "dout"}):  # linear_backward's dy is this function's dout
        F.check_linear_grad(dout, cache.lin2)
    # 4. y = d @ w2.T + b2
    dd, dw2, db2 = F.linear_backward(dout, cache.lin2)  # [..., F], [D, F], [D]
    # 3. d = dropout(a, dropout_p), with the forward's keep-mask
    da = F.dropout_backward(dd, cache.drop)  # [..., F]
    # 2. a = act(h)
    if isinstance(cache.act, ReluCache):
        dh = relu_backward(da, cache.act)  # [..., F]
    else:
        dh = gelu_backward(da, cache.act)  # [..., F]
    # 1. h = x @ w1.T + b1
    dx, dw1, db1 = F.linear_backward(dh, cache.lin1)  # [..., D], [F, D], [F]
    return dx, dw1, db1, dw2, db2


# --------------------------------------------------------------------------
# residual connection: out = x + y, with broadcasting


class ResidualCache(NamedTuple):
    """What ``residual_backward`` needs from ``residual_forward``."""
    x_shape: tuple  #: shape of x: dx is dout summed to it
    y_shape: tuple  #: shape of y: dy likewise
    like: Any = None  #: validation.ArraySpec of x: the library, device and dtype dout must have


def _broadcast_shape(a: tuple, b: tuple) -> Optional[tuple]:
    """The broadcast of shapes ``a`` and ``b``, or None when they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        m = a[-i] if i <= len(a) else 1
        n = b[-i] if i <= len(b) else 1
        if m != n and m != 1 and n != 1:
            return None
        out.append(max(m, n) if min(m, n) != 0 else 0)
    return tuple(reversed(out))


def residual_forward(x: Any, y: Any) -> tuple[Any, ResidualCache]:
    """The residual connection ``out = x + y``; the shapes broadcast against each other.

    Parameters
    ----------
    x : array, real floating
    y : array of the namespace, device and dtype of ``x``, shape broadcastable with ``x``'s

    Returns
    -------
    out : array, the broadcast shape
    cache : ResidualCache
    """
    # [...], [...] -> [...]
    V.check_floating_array("x", x)
    V.check_floating_array("y", y, namespace(x), device_of(x), dtype=x.dtype, like="x")
    xs, ys = V.shape_of(x), V.shape_of(y)
    if _broadcast_shape(xs, ys) is None:
        raise ValueError(f"y: expected a shape that broadcasts with x's {xs}, got shape {ys}")
    return zero_d(x + y), ResidualCache(xs, ys, V.spec_of(x))  # 1. [...]


def residual_backward(dout: Any, cache: ResidualCache) -> tuple[Any, Any]:
    """``dx = dout`` and ``dy = dout``, each summed back over the axes broadcasting stretched.

    Parameters
    ----------
    dout : array, the broadcast shape of the forward's ``x`` and ``y``
    cache : ResidualCache

    Returns
    -------
    dx : array, shape of ``x``
    dy : array, shape of ``y``
    """
    # [...] -> [...], [...]
    V.check_cache("cache", cache, ResidualCache, "residual_forward")
    expected = _broadcast_shape(cache.x_shape, cache.y_shape) or ()  # the forward checked they broadcast
    like = cache.like
    V.check_grad("dout", dout, shape=expected, dtype=like.dtype, xp=like.xp, device=like.device,
                 of="the forward's out")
    xp = namespace(dout)
    # 1. out = x + y
    dx = F.sum_to_shape(xp, dout, cache.x_shape)  # [x_shape]
    dy = F.sum_to_shape(xp, dout, cache.y_shape)  # [y_shape]
    # new arrays, not dout itself twice: a caller that adds into dx must not change dy or dout
    dx, dy = (xp.asarray(g, copy=True) if g is dout else g for g in (dx, dy))
    return dx, dy


# --------------------------------------------------------------------------
# mean pooling over the sequence: out = sum_i w_i x_i, w_i = m_i / count


class MeanPoolCache(NamedTuple):
    """What ``mean_pool_backward`` needs from ``mean_pool_forward``."""
    weights: Any  #: [..., L, 1] m_i / max(count, 1) in the compute dtype, or None without a mask
    x_shape: tuple  #: (..., L, D)
    dtype: Any  #: dtype of x (and of dx)
    like: Any = None  #: validation.ArraySpec of x: the library and device dout must have


def mean_pool_forward(x: Any, mask: Any = None) -> tuple[Any, MeanPoolCache]:
    """The mean over the sequence axis, of the tokens that ``mask`` keeps.

    Without a mask every token counts: ``out = sum_i x[..., i, :] / L``.
    With one (True = a token, False = padding):

    1. ``count = sum_i m_i``                                [..., 1, 1]
    2. ``w_i = m_i / max(count, 1)``                        [..., L, 1]
    3. ``out = sum_i w_i x[..., i, :]``                     [..., D]

    A row whose mask is all False gets ``out = 0`` and, in the backward,
    ``dx = 0``: its weights are all zero (``max(count, 1)`` keeps the
    division finite), never NaN.

    Parameters
    ----------
    x : array, shape (..., L, D), real floating
    mask : bool array, shape (..., L), optional
        Of ``x``'s namespace and device; True where a token is averaged.

    Returns
    -------
    out : array, shape (..., D), dtype of ``x``
    cache : MeanPoolCache
    """
    # [..., L, D], [..., L] -> [..., D]
    V.check_floating_array("x", x)
    xs = V.shape_of(x)
    if len(xs) < 2 or xs[-2] < 1:
        raise ValueError(f"x: expected shape (..., L, D) with L >= 1, got shape {xs}")
    xp = namespace(x)
    xc = _compute(xp, x)  # [..., L, D]
    if mask is None:
        out = xp.sum(xc, axis=-2) / float(xs[-2])  # 3. with w_i = 1 / L   [..., D]
        weights = None
    else:
        V.check_array("mask", mask, xp, device_of(x), where="like x", library="that of x")
        if mask.dtype != xp.bool:
            raise TypeError(f"mask: expected a bool mask (True = a token, False = padding), "
                            f"got dtype {V.dtype_name(mask.dtype)}")
        if V.shape_of(mask) != xs[:-1]:
            raise ValueError(f"mask: expected shape {xs[:-1]} (x's shape without D), "
                             f"got shape {V.shape_of(mask)}")
        m = xp.astype(xp.expand_dims(mask, axis=-1), xc.dtype)  # [..., L, 1]
        count = xp.sum(m, axis=-2, keepdims=True)  # 1.                  [..., 1, 1]
        weights = m / xp.maximum(count, scalar(xp, 1.0, count))  # 2.     [..., L, 1]
        out = xp.sum(weights * xc, axis=-2)  # 3.                         [..., D]
    out = out if out.dtype == x.dtype else xp.astype(out, x.dtype)
    return out, MeanPoolCache(weights, xs, x.dtype, V.spec_of(x))


def mean_pool_backward(dout: Any, cache: MeanPoolCache) -> Any:
    """``dx[..., i, :] = w_i * dout``: each token gets its share of the mean's gradient.

    ``w_i = 1 / L`` without a mask, ``m_i / max(count, 1)`` with one (zero
    on padding, and on every token of a row with nothing to average).

    Parameters
    ----------
    dout : array, shape (..., D), dtype of the forward's ``x``
    cache : MeanPoolCache

    Returns
    -------
    dx : array, shape (..., L, D)
    """
    # [..., D] -> [..., L, D]
    V.check_cache("cache", cache, MeanPoolCache, "mean_pool_forward")
    xs = cache.x_shape
    V.check_grad("dout", dout, shape=xs[:-2] + xs[-1:], dtype=cache.dtype, xp=cache.like.xp,
                 device=cache.like.device, of="the forward's out")
    xp = namespace(dout)
    d = xp.expand_dims(_compute(xp, dout), axis=-2)  # [..., 1, D]
    # 3. out = sum_i w_i x_i
    if cache.weights is None:
        # w_i = 1 / L, a new array (not a read-only view whose rows share memory)
        dx = xp.asarray(xp.broadcast_to(d / float(xs[-2]), xs), copy=True)  # [..., L, D]
    else:
        dx = cache.weights * d  # [..., L, D]
    return dx if dx.dtype == cache.dtype else xp.astype(dx, cache.dtype)
