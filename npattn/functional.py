"""Stateless forward/backward pairs for every step of multi-head attention.

Each primitive is a pair that sits side by side::

    out, cache = op_forward(*inputs, ...)
    grads      = op_backward(dout, cache)

``cache`` is a ``NamedTuple`` holding exactly what the backward needs.
Gradients come back in the order of the forward's array inputs and are named
``d<name>``; a backward never writes into its arguments or its cache.

The forward numbers its steps; the backward walks them in reverse and quotes
the forward line it differentiates. ``docs/derivations.md`` derives the same
steps with the same names.

Shape legend
------------
B batch, H heads, Lq query length, Lk key length, D model width,
Dh head width (D = H * Dh), Dv value head width (may differ from Dh),
Hq / Hkv query and key/value heads under grouped-query attention, G = Hq // Hkv,
bq / bk the query / key block lengths of the tiled algorithms,
Din / Dout the two sides of a linear layer.

All code below uses only the Python Array API standard through ``xp``, the
namespace of the inputs; what is backend-specific lives in ``npattn.backend``.

Every ``*_forward`` / ``*_backward`` pair checks its arguments on its first
line (``npattn.validation``): a ``TypeError`` or ``ValueError`` that names
the argument, what was expected and what was received; so does ``causal_mask``
(its lengths). The other helpers that take ``xp`` first (``sum_to_shape``,
``compute_dtype``, ``half_sum``, ``group_heads``, ``ungroup_heads``,
``positions_allowed``, ``alibi_bias``, ``sech_squared``, ``combine_allowed``),
those of the kernel options (``score_options``, ``is_plain``, ``is_positional``,
``causal_options``, ``block_visible``, ``block_cut``) and ``sdpa_forward_core``
are the unchecked building blocks of the other implementations, called on
arguments checked already.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

from . import validation as V
from .backend import (check_same_device, copy_array, device_of, dropout_key, generator_kept_on_failure,
                      is_bool, is_floating, keep_mask, namespace, overflow_unreported, resolve_backend,
                      row_max, scalar, without_empty_chunks, zero_d)

__all__ = [
    "linear_forward",
    "linear_backward",
    "check_linear_inputs",
    "check_linear_grad",
    "split_heads_forward",
    "split_heads_backward",
    "merge_heads_forward",
    "merge_heads_backward",
    "masked_softmax_forward",
    "masked_softmax_backward",
    "SoftmaxGrads",
    "dropout_forward",
    "dropout_backward",
    "sdpa_forward",
    "sdpa_backward",
    "append_kv_forward",
    "append_kv_backward",
    "pad_mask_forward",
    "pad_mask_backward",
    "causal_mask",
    "sum_to_shape",
    "compute_dtype",
    "half_sum",
    "gqa_groups",
    "group_heads",
    "ungroup_heads",
    "sdpa_forward_core",
    "SDPAGrads",
    "ScoreOptions",
    "PLAIN",
    "score_options",
    "checked_options",
    "causal_options",
    "is_plain",
    "is_positional",
    "positions_allowed",
    "block_visible",
    "block_cut",
    "alibi_bias",
    "sech_squared",
    "combine_allowed",
]


# --------------------------------------------------------------------------
# helpers


def sum_to_shape(xp: Any, g: Any, shape: Sequence[int]) -> Any:
    """Sum ``g`` over the axes that broadcasting added or stretched to reach ``g.shape``.

    The adjoint of broadcasting ``shape`` up to ``g.shape``: the gradient of an
    array that was broadcast in the forward is summed back to its own shape.

    Parameters
    ----------
    xp : namespace
    g : array, shape ``shape`` broadcast to ``(..., *shape)``
    shape : tuple of int

    Returns
    -------
    array, shape ``shape``
    """
    in_dtype = g.dtype
    work = compute_dtype(xp, in_dtype)  # float16 / bfloat16 summed in float32 (see half_sum)
    kw = {} if work == in_dtype else {"dtype": work}
    lead = g.ndim - len(shape)
    if lead > 0:
        g = xp.sum(g, axis=tuple(range(lead)), **kw)
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if stretched:
        g = xp.sum(g, axis=stretched, keepdims=True, **kw)
    # (a sum to shape () is a NumPy scalar: zero_d makes it the 0-d array it stands for)
    return zero_d(g if g.dtype == in_dtype else xp.astype(g, in_dtype))


def causal_mask(xp: Any, Lq: int, Lk: int, device: Any = None) -> Any:
    """Top-left aligned causal mask, True = may attend: query i sees keys j <= i.

    This is SDPA's ``is_causal`` convention. Made by ``xp`` (a backend name or
    namespace) on ``device``.

    Parameters
    ----------
    xp : str or namespace
        The backend, as ``backend=``.
    Lq, Lk : int >= 0
    device : optional
        A device of ``xp``; None: its default.

    Returns
    -------
    array, shape (Lq, Lk), bool
    """
    xp = resolve_backend(xp, "xp")
    Lq, Lk = V.check_size("Lq", Lq), V.check_size("Lk", Lk)
    i = xp.arange(Lq, device=device)  # [Lq]
    j = xp.arange(Lk, device=device)  # [Lk]
    return xp.expand_dims(i, axis=1) >= xp.expand_dims(j, axis=0)  # [Lq, Lk]


def compute_dtype(xp: Any, dtype: Any) -> Any:
    """Scores and softmax of half-precision inputs are computed in float32.

    Parameters
    ----------
    xp : namespace
    dtype : dtype
        The inputs' dtype.

    Returns
    -------
    work : dtype
        ``xp.float32`` for float16 and bfloat16, else ``dtype`` itself.
    """
    # by name: dask's namespace (array_api_compat.dask.array) has no float16 to compare with
    return xp.float32 if V.dtype_name(dtype) in ("float16", "bfloat16") else dtype


def half_sum(xp: Any, x: Any, axis: Any) -> Any:
    """``xp.sum(x, axis=axis)`` in ``x``'s dtype, summed in ``compute_dtype`` (float32 for
    float16 / bfloat16) and rounded once: NumPy adds float16 along an axis in float16, where
    a sum of ones stops growing at 2048.

    Parameters
    ----------
    xp : namespace
    x : array, real floating
    axis : int or tuple of int
        The axes summed, as ``xp.sum``'s.

    Returns
    -------
    array, the shape of ``x`` without ``axis``, in ``x``'s dtype
        On NumPy a sum over every axis is a NumPy scalar, not a 0-d array.
    """
    work = compute_dtype(xp, x.dtype)
    if work == x.dtype:
        return xp.sum(x, axis=axis)
    return xp.astype(xp.sum(x, axis=axis, dtype=work), x.dtype)


# --------------------------------------------------------------------------
# linear: y = x @ w.T + b   (PyTorch layout: w is [Dout, Din])


class LinearCache(NamedTuple):
    """What ``linear_backward`` needs from ``linear_forward``."""
    x: Any  #: [..., Din]  input, for dw
    w: Any  #: [Dout, Din] weight, for dx
    has_bias: bool  #: whether the forward added a bias (``db`` is None without one)


def linear_forward(x: Any, w: Any, b: Any = None) -> tuple[Any, LinearCache]:
    """Affine map in PyTorch's layout: ``y = x @ w.T + b``.

    Parameters
    ----------
    x : array, shape (..., Din)
    w : array, shape (Dout, Din)
    b : array, shape (Dout,), optional

    Returns
    -------
    y : array, shape (..., Dout)
    cache : LinearCache
    """
    # [..., Din], [Dout, Din], [Dout] -> [..., Dout]
    check_linear_inputs(x, w, b)
    xp = namespace(x, w, b)
    x = without_empty_chunks(x)  # dask's reshape fails on some chunks of length 0
    # one (N, Din) x (Din, Dout) GEMM over all leading axes: NumPy's matmul
    # would otherwise run one smaller GEMM per batch entry (1.2-1.5x slower). N spelled
    # out: a -1 beside Din = 0 is ambiguous, and NumPy refuses it
    x2 = xp.reshape(x, (math.prod(V.shape_of(x)[:-1]), x.shape[-1]))  # [N, Din]
    y = xp.reshape(x2 @ xp.matrix_transpose(w), (*x.shape[:-1], w.shape[0]))  # [..., Dout]
    if b is not None:
        y = y + b  # [..., Dout]
    return y, LinearCache(x, w, b is not None)


def check_linear_inputs(x: Any, w: Any, b: Any = None) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``linear_forward`` takes ``(x, w, b)``."""
    V.check_floating_array("x", x)
    V.check_floating_array("w", w, namespace(x), device_of(x), dtype=x.dtype, like="x")
    if w.ndim != 2:
        raise ValueError(f"w: expected a 2-D weight (Dout, Din), got shape {V.shape_of(w)}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"x: expected shape (..., {w.shape[1]}) (Din, the input width of w), "
            f"got shape {V.shape_of(x)}"
        )
    if b is not None:
        V.check_floating_array("b", b, namespace(x), device_of(x), dtype=x.dtype, like="x")
        if V.shape_of(b) != (int(w.shape[0]),):
            raise ValueError(
                f"b: expected shape ({w.shape[0]},) (Dout, the output width of w), "
                f"got shape {V.shape_of(b)}"
            )


def linear_backward(dy: Any, cache: LinearCache) -> tuple[Any, Any, Any]:
    """Gradients of ``y = x @ w.T + b``.

    ``dx = dy @ w``, ``dw = dy^T x`` summed over every leading axis,
    ``db = sum(dy)`` over every leading axis (None without bias).

    Parameters
    ----------
    dy : array, shape (..., Dout)
    cache : LinearCache

    Returns
    -------
    dx : array, shape (..., Din)
    dw : array, shape (Dout, Din)
    db : array, shape (Dout,) or None
    """
    # [..., Dout] -> [..., Din], [Dout, Din], [Dout]
    check_linear_grad(dy, cache)
    xp = namespace(dy, cache.x)
    dy = without_empty_chunks(dy)  # as x in the forward
    x, w = cache.x, cache.w
    # forward: y = x @ w.T + b
    n = math.prod(V.shape_of(x)[:-1])  # N (a -1 beside a zero width is ambiguous)
    dy2 = xp.reshape(dy, (n, dy.shape[-1]))  # [N, Dout]
    x2 = xp.reshape(x, (n, x.shape[-1]))  # [N, Din]
    dx = xp.reshape(dy2 @ w, x.shape)  # [..., Din]
    dw = xp.matrix_transpose(dy2) @ x2  # [Dout, Din]
    db = half_sum(xp, dy2, axis=0) if cache.has_bias else None  # [Dout]
    return dx, dw, db


def check_linear_grad(dy: Any, cache: Any) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``linear_backward`` takes ``(dy, cache)``."""
    V.check_cache("cache", cache, LinearCache, "linear_forward")
    V.check_grad("dy", dy, shape=(*cache.x.shape[:-1], cache.w.shape[0]), dtype=cache.x.dtype,
                 xp=namespace(cache.x), device=device_of(cache.x), of="the forward's y")


# --------------------------------------------------------------------------
# split_heads / merge_heads: [B, L, D] <-> [B, H, L, Dh]
# Both are permutations of entries, so each one's backward is the other.


class HeadsCache(NamedTuple):
    """What the backward of ``split_heads_forward`` or ``merge_heads_forward`` needs."""
    n_head: int  #: H
    #: validation.ArraySpec of the forward's x: dout has the shape, dtype, library and
    #: device of its output; None: only the head count is checked
    like: Any = None


def _check_heads_cache(cache: HeadsCache, producer: str, ndim: int, axes: str) -> None:
    """``TypeError`` for the HeadsCache of the other function: split_heads_forward and
    merge_heads_forward share the class, and their x has 3 and 4 axes."""
    if cache.like is not None and len(cache.like.shape) != ndim:
        raise TypeError(
            f"cache: expected the HeadsCache {producer} returns (of an x {axes}), got one of "
            f"an x of shape {tuple(cache.like.shape)}"
        )


def split_heads_forward(x: Any, n_head: int) -> tuple[Any, HeadsCache]:
    """Split the feature axis into heads: ``[B, L, H*Dh] -> [B, H, L, Dh]``.

    Head ``h`` owns features ``h*Dh : (h+1)*Dh``, as in PyTorch.

    Parameters
    ----------
    x : array, shape (B, L, D)
    n_head : int
        H; must divide D.

    Returns
    -------
    xh : array, shape (B, H, L, Dh)
    cache : HeadsCache
    """
    # [B, L, D] -> [B, H, L, Dh]
    V.check_array("x", x)
    if x.ndim != 3:
        raise ValueError(f"x: expected a 3-D array (B, L, D), got shape {V.shape_of(x)}")
    n_head = V.check_positive_int("n_head", n_head)  # a Python int: a NumPy one breaks D // n_head
    if x.shape[-1] % n_head != 0:
        raise ValueError(
            f"n_head: expected a divisor of the last axis D={x.shape[-1]} of x, got {n_head}"
        )
    return _split_heads(x, n_head)


def _split_heads(x, n_head):
    """``split_heads_forward`` on checked arguments."""
    # [B, L, D] -> [B, H, L, Dh]
    xp = namespace(x)
    B, L, D = x.shape
    x4 = xp.reshape(x, (B, L, n_head, D // n_head))  # [B, L, H, Dh]
    return xp.permute_dims(x4, (0, 2, 1, 3)), HeadsCache(n_head, V.spec_of(x))  # [B, H, L, Dh]


def _check_dout_like(name: str, g: Any, like: V.ArraySpec, shape: tuple) -> None:
    """An upstream gradient of the forward's output: ``shape``, and the dtype, library and
    device of the forward's input (``like``, its spec: a permutation or a copy keeps them)."""
    V.check_grad(name, g, shape=shape, dtype=like.dtype, xp=like.xp, device=like.device,
                 of="the forward's output")


def split_heads_backward(dout: Any, cache: HeadsCache) -> Any:
    """Gradient of ``split_heads``: merge the heads of ``dout`` back.

    Parameters
    ----------
    dout : array, shape (B, H, L, Dh)
    cache : HeadsCache

    Returns
    -------
    dx : array, shape (B, L, D)
    """
    # [B, H, L, Dh] -> [B, L, D]
    V.check_cache("cache", cache, HeadsCache, "split_heads_forward")
    _check_heads_cache(cache, "split_heads_forward", 3, "(B, L, D)")
    V.check_array("dout", dout)
    if cache.like is not None:  # the forward's output: [B, H, L, Dh]
        B, L, D = cache.like.shape
        _check_dout_like("dout", dout, cache.like, (B, cache.n_head, L, D // cache.n_head))
    if dout.ndim != 4 or dout.shape[1] != cache.n_head:
        raise ValueError(
            f"dout: expected a 4-D array (B, {cache.n_head}, L, Dh) (the forward's heads), "
            f"got shape {V.shape_of(dout)}"
        )
    return _merge_heads(dout)[0]


def merge_heads_forward(x: Any) -> tuple[Any, HeadsCache]:
    """Concatenate the heads: ``[B, H, L, Dh] -> [B, L, H*Dh]``.

    Parameters
    ----------
    x : array, shape (B, H, L, Dh)

    Returns
    -------
    y : array, shape (B, L, D)
    cache : HeadsCache
    """
    # [B, H, L, Dh] -> [B, L, D]
    V.check_array("x", x)
    if x.ndim != 4:
        raise ValueError(f"x: expected a 4-D array (B, H, L, Dh), got shape {V.shape_of(x)}")
    return _merge_heads(x)


def _merge_heads(x):
    """``merge_heads_forward`` on checked arguments."""
    # [B, H, L, Dh] -> [B, L, D]
    xp = namespace(x)
    B, H, L, Dh = x.shape
    xt = xp.permute_dims(x, (0, 2, 1, 3))  # [B, L, H, Dh]
    return xp.reshape(xt, (B, L, H * Dh)), HeadsCache(H, V.spec_of(x))  # [B, L, D]


def merge_heads_backward(dout: Any, cache: HeadsCache) -> Any:
    """Gradient of ``merge_heads``: split ``dout`` into heads again.

    Parameters
    ----------
    dout : array, shape (B, L, D)
    cache : HeadsCache

    Returns
    -------
    dx : array, shape (B, H, L, Dh)
    """
    # [B, L, D] -> [B, H, L, Dh]
    V.check_cache("cache", cache, HeadsCache, "merge_heads_forward")
    _check_heads_cache(cache, "merge_heads_forward", 4, "(B, H, L, Dh)")
    V.check_array("dout", dout)
    if cache.like is not None:  # the forward's output: [B, L, H*Dh]
        B, H, L, Dh = cache.like.shape
        _check_dout_like("dout", dout, cache.like, (B, L, H * Dh))
    if dout.ndim != 3 or dout.shape[-1] % cache.n_head != 0:
        raise ValueError(
            f"dout: expected a 3-D array (B, L, D) with D a multiple of the forward's "
            f"{cache.n_head} heads, got shape {V.shape_of(dout)}"
        )
    return _split_heads(dout, cache.n_head)[0]


# --------------------------------------------------------------------------
# masked softmax over the last axis


class SoftmaxCache(NamedTuple):
    """What ``masked_softmax_backward`` needs from ``masked_softmax_forward``."""
    p: Any  #: [..., Lk] probabilities (compute dtype); the backward reads p, lse and p_sink
    mask_shape: Optional[tuple]  #: shape of an additive mask, for dmask; else None
    in_dtype: Any = None  #: dtype of x when it differs from p's (float16 -> float32)
    p_sink: Any = None  #: [..., 1] the sink's share of each row (attention sinks), else None
    lse: Any = None  #: [..., 1] log(exp(sink) + sum_j exp(z_j)), -inf for an empty row


class SoftmaxGrads(NamedTuple):
    """Gradients of ``masked_softmax_forward``, in the order of its array inputs."""
    dx: Any  #: [..., Lk], shape of x
    dmask: Any  #: floating mask's own shape, or None for a boolean or no mask
    dsink: Any  #: [..., 1], shape of sink, with a sink; else None


def masked_softmax_forward(x: Any, mask: Any = None, *, sink: Any = None) -> tuple[Any, SoftmaxCache]:
    """Numerically stable softmax over the last axis, with masking.

    ``mask`` is either boolean (True = may attend; False entries get
    probability exactly 0) or floating (added to ``x``; ``-inf`` entries get
    probability exactly 0). Entries of ``x + mask`` equal to ``-inf`` are
    masked too. A row with nothing to attend gives an all-zero row; a last
    axis of length 0 gives an empty ``p`` and ``lse = -inf`` (``lse = sink`` with a sink).
    float16 and bfloat16 ``x`` are computed in float32 (the max, the
    exponentials and their sum) and ``p`` is cast back to the input dtype.

    Steps (the backward walks them in reverse):

    1. ``z = x + mask``                       (floating mask only)
    2. ``z = where(mask, z, -inf)``           (boolean mask only)
    3. ``m = max(z)``, and 0 for a fully masked row (a finite shift)
    4. ``e = exp(z - m)``                     (exactly 0 where masked)
    5. ``p = e / sum(e)``, and 0 for a fully masked row (divide by 1)

    With ``sink`` (attention sinks) each row's denominator gains
    ``exp(sink)``, a logit that carries no value: ``p = e / (exp(sink - m) + sum(e))``,
    and ``cache.p_sink`` is the sink's share. ``cache.lse`` is each row's
    ``log(exp(sink) + sum(exp(z)))``, -inf for a row with nothing to attend.

    Parameters
    ----------
    x : array, shape (..., Lk), real floating
    mask : array broadcastable to ``x.shape``, bool or real floating, optional
    sink : array, shape (..., 1) (that of ``x`` with the last axis 1), optional

    Returns
    -------
    p : array, shape of ``x`` (``mask`` broadcasts to it)
    cache : SoftmaxCache
    """
    # [..., Lk], mask broadcastable, [..., 1] -> [..., Lk]
    V.check_floating_array("x", x)
    if x.ndim == 0:  # the softmax runs over the last axis
        raise ValueError(f"x: expected an array of shape (..., Lk), got shape {V.shape_of(x)}")
    V.check_mask("mask", mask, namespace(x), target=V.shape_of(x), target_text="x",
                 dtype=x.dtype, device=device_of(x), where="like x", library="that of x",
                 dtype_source="that of x")
    if sink is not None:
        V.check_floating_array("sink", sink, namespace(x), device_of(x), dtype=x.dtype, like="x")
        if V.shape_of(sink) != V.shape_of(x)[:-1] + (1,):
            raise ValueError(
                f"sink: expected shape {V.shape_of(x)[:-1] + (1,)} (that of x with the last "
                f"axis 1), got {V.shape_of(sink)}"
            )
    p, cache = _masked_softmax(x, mask, sink)
    # the caller's p as a copy where the cache holds it: the cache's p must not change if the
    # caller writes into p (as blocked's out)
    return (copy_array(namespace(x), p) if p is cache.p else p), cache


def _masked_softmax(x, mask, sink=None):
    """``masked_softmax_forward`` on checked arguments; ``sink`` [..., 1] joins each row's
    denominator as a logit that carries no value (attention sinks)."""
    # [..., Lk], mask broadcastable, sink [..., 1] -> [..., Lk]
    xp = namespace(x, mask)
    in_dtype = x.dtype
    work = compute_dtype(xp, in_dtype)  # float16 / bfloat16: work in float32
    if work != in_dtype:
        x = xp.astype(x, work)
        if mask is not None and is_floating(xp, mask):
            mask = xp.astype(mask, work)
    mask_shape = None
    z = x
    neg_inf, zero, one = (scalar(xp, c, z) for c in (-math.inf, 0.0, 1.0))  # in z's dtype
    if mask is not None and is_floating(xp, mask):
        z = x + mask  # 1.                                     [..., Lk]
        mask_shape = tuple(mask.shape)
    elif mask is not None:
        z = xp.where(mask, z, neg_inf)  # 2.                   [..., Lk]
    m = row_max(xp, z)  # 3.                                   [..., 1]
    if sink is not None:
        m = xp.maximum(m, sink)  # the sink is one more logit of the row
    m = xp.where(m == -math.inf, zero, m)  # fully masked row: no -inf - -inf
    e = xp.exp(z - m)  # 4.                                    [..., Lk]
    s = xp.sum(e, axis=-1, keepdims=True)  # 5.                [..., 1]
    e_sink = None if sink is None else xp.exp(sink - m)  # [..., 1]
    if e_sink is not None:
        s = s + e_sink
    s_safe = xp.where(s == 0.0, one, s)
    p = e / s_safe  # rows with nothing to attend stay 0
    p_sink = None if e_sink is None else e_sink / s_safe  # [..., 1]
    lse = xp.where(s == 0.0, neg_inf, m + xp.log(s_safe))  # [..., 1]
    if work != in_dtype:
        return xp.astype(p, in_dtype), SoftmaxCache(p, mask_shape, in_dtype, p_sink, lse)
    return p, SoftmaxCache(p, mask_shape, None, p_sink, lse)


def masked_softmax_backward(dp: Any, cache: SoftmaxCache, *, dlse: Any = None) -> SoftmaxGrads:
    """Gradient of the masked softmax, without forming a Jacobian.

    ``dx = p * (dp - sum(dp * p))``, summed over the last axis inside the
    bracket. Masked entries have ``p = 0`` and so ``dx = 0``; a fully masked
    row has ``dx = 0`` everywhere. An additive mask gets ``dmask = dx`` summed
    back to the mask's own shape; ``dmask`` is None for a boolean or no mask.
    An upstream gradient ``dlse`` of ``cache.lse`` adds ``p * dlse``
    (``d lse / dx_j = p_j``): ``dx = p * (dp - sum(dp * p) + dlse)``.
    A sink is one more logit of the row that carries no value (its ``dp`` is
    0): ``dsink = p_sink * (0 - sum(dp * p) + dlse)``.

    Parameters
    ----------
    dp : array, shape of ``p`` (..., Lk)
    cache : SoftmaxCache
    dlse : array, shape (..., 1), optional
        Gradient of ``cache.lse``, in its dtype; entries on rows with nothing to
        attend (lse = -inf) do not matter.

    Returns
    -------
    SoftmaxGrads
        ``(dx, dmask, dsink)``: ``dx`` of the shape of ``p``; ``dmask`` of the
        mask's shape, or None; ``dsink`` of the sink's shape (..., 1), or None
        without a sink.
    """
    # [..., Lk] -> [..., Lk], mask shape, [..., 1]
    V.check_cache("cache", cache, SoftmaxCache, "masked_softmax_forward")
    V.check_grad("dp", dp, shape=V.shape_of(cache.p),
                 dtype=cache.p.dtype if cache.in_dtype is None else cache.in_dtype,
                 xp=namespace(cache.p), device=device_of(cache.p), of="the forward's p")
    if dlse is not None:
        V.check_grad("dlse", dlse, shape=V.shape_of(cache.lse), dtype=cache.lse.dtype,
                     xp=namespace(cache.p), device=device_of(cache.p), of="the forward's lse")
    return _masked_softmax_backward(dp, cache, dlse)


def _masked_softmax_backward(dp, cache, dlse=None):
    """``masked_softmax_backward`` on checked arguments."""
    # [..., Lk], [..., 1] -> [..., Lk], mask shape, [..., 1]
    xp = namespace(dp, cache.p)
    p = cache.p
    if dp.dtype != p.dtype:  # half-precision input: the sums run in float32 too
        dp = xp.astype(dp, p.dtype)
    # 5.-3. p = softmax(z) on the attended entries:
    #       dz = p * (dp - sum_j dp_j p_j); the shift m cancels (p does not depend on it).
    #       lse = log(sum_j exp(z_j)) adds d lse / dz_j = p_j: dz = p * (dp - delta + dlse)
    delta = xp.sum(dp * p, axis=-1, keepdims=True)  # [..., 1]
    if dlse is not None:  # a row with nothing to attend has lse = -inf whatever its scores
        #                   (p = 0): its dlse does not matter, and an inf there would give 0 * inf
        delta = delta - xp.where(cache.lse == -math.inf, scalar(xp, 0.0, dlse), dlse)  # [..., 1]
    dz = p * (dp - delta)  # [..., Lk]
    # 2. z = where(mask, x, -inf): dx = where(mask, dz, 0), already 0 since p = 0 there
    # 1. z = x + mask: dx = dz, dmask = dz summed to the mask's shape
    dmask = None if cache.mask_shape is None else sum_to_shape(xp, dz, cache.mask_shape)
    # the sink: one more logit of the row, whose dp is 0: dsink = p_sink * (0 - delta)
    dsink = None if cache.p_sink is None else -(cache.p_sink * delta)  # [..., 1]
    if cache.in_dtype is not None:
        dz = xp.astype(dz, cache.in_dtype)
        dmask = None if dmask is None else xp.astype(dmask, cache.in_dtype)
        dsink = None if dsink is None else xp.astype(dsink, cache.in_dtype)
    return SoftmaxGrads(dz, dmask, dsink)


# --------------------------------------------------------------------------
# dropout (inverted): y = x * keep / (1 - p)


class DropoutCache(NamedTuple):
    """What ``dropout_backward`` needs from ``dropout_forward``."""
    keep: Any  #: bool keep-mask broadcastable to x, or None when dropout is off
    scale: float  #: 1 / (1 - p)
    key: Optional[int] = None  #: the dropout key when the mask was drawn, else None
    like: Any = None  #: validation.ArraySpec of x: dy has its shape, dtype, library and device


def dropout_forward(x: Any, p: float, *, mask: Any = None, rng: Any = None) -> tuple[Any, DropoutCache]:
    """Inverted dropout: ``y = where(keep, x / (1 - p), 0)``.

    ``p`` is the drop probability. ``mask`` is a boolean keep-mask (True =
    keep) broadcastable to ``x.shape``; without one, one key is drawn from
    ``rng`` (a seed or a NumPy ``Generator``) and entry ``(..., i, j)`` is
    kept with probability ``1 - p`` by a hash of the key and its coordinates
    (``npattn.backend.keep_mask``), the draw every implementation of
    attention makes. With ``p == 0`` and no mask this is the identity.

    Parameters
    ----------
    x : array, any shape (...)
    p : float
        Drop probability, in [0, 1).
    mask : bool array broadcastable to ``x.shape``, optional
    rng : int, numpy.random.SeedSequence, BitGenerator, Generator or None

    Returns
    -------
    y : array, shape of ``x``
    cache : DropoutCache
        Holds the keep-mask, so the backward reuses it.
    """
    # [...] -> [...]
    V.check_floating_array("x", x)
    V.check_probability("p", p)
    V.check_mask("mask", mask, namespace(x), target=V.shape_of(x), target_text="x",
                 dtype=x.dtype, device=device_of(x), bool_only=True, where="like x",
                 library="that of x")
    V.check_rng("rng", rng)
    with generator_kept_on_failure(rng):  # a failed call leaves the caller's generator as it was
        return _dropout(x, p, mask, rng)


def _dropout(x, p, mask, rng):
    """``dropout_forward`` on checked arguments."""
    # [...] -> [...]
    xp = namespace(x, mask)
    if mask is None and p == 0.0:
        return x, DropoutCache(None, 1.0, None, V.spec_of(x))
    keep, key = mask, None
    if keep is None:
        key = dropout_key(rng)
        keep = keep_mask(key, p, x.shape, xp, device_of(x))  # [...] bool
    scale = 1.0 / (1.0 - float(p))  # a Python float: a NumPy float64 p would upcast x
    y = xp.where(keep, x * scale, scalar(xp, 0.0, x))  # [...]
    return y, DropoutCache(keep, scale, key, V.spec_of(x))


def dropout_backward(dy: Any, cache: DropoutCache) -> Any:
    """Gradient of inverted dropout with the forward's keep-mask: ``dx = where(keep, dy / (1 - p), 0)``.

    Parameters
    ----------
    dy : array, shape of the forward's ``x``
    cache : DropoutCache

    Returns
    -------
    dx : array, shape of ``dy``
    """
    # [...] -> [...]
    V.check_cache("cache", cache, DropoutCache, "dropout_forward")
    V.check_floating_array("dy", dy)
    if cache.like is not None:
        _check_dout_like("dy", dy, cache.like, cache.like.shape)
    if cache.keep is not None:
        V.check_array("dy", dy, namespace(cache.keep), device_of(cache.keep),
                      where="that of the keep-mask", library="that of the keep-mask")
        V.check_broadcasts_to("cache.keep", V.shape_of(cache.keep), V.shape_of(dy),
                              "dy (the forward's x)")
    return _dropout_backward(dy, cache)


def _dropout_backward(dy, cache):
    """``dropout_backward`` on checked arguments."""
    # [...] -> [...]
    if cache.keep is None:  # p = 0, no mask: y = x
        return dy
    xp = namespace(dy, cache.keep)
    # y = where(keep, x * scale, 0): linear and diagonal, so dx = where(keep, dy * scale, 0)
    return xp.where(cache.keep, dy * cache.scale, scalar(xp, 0.0, dy))  # [...]


# --------------------------------------------------------------------------
# scaled dot-product attention on [B, H, L, Dh]


class SDPACache(NamedTuple):
    """What ``sdpa_backward`` needs from ``sdpa_forward`` (the reference's steps' caches)."""
    q: Any  #: [B, Hq, Lq, Dh]  (compute dtype)
    k: Any  #: [B, Hkv, Lk, Dh]
    v: Any  #: [B, Hkv, Lk, Dv]
    probs: Any  #: [B, H, Lq, Lk] softmax output, before dropout (the returned weights)
    attn: Any  #: [B, H, Lq, Lk] after dropout; the same array as probs without dropout
    softmax: SoftmaxCache  #: step 5's cache
    dropout: DropoutCache  #: step 6's cache
    scale: float  #: the factor of the scores (``1 / sqrt(Dh)`` unless given)
    mask_shape: Optional[tuple]  #: shape of a floating mask, for dmask
    in_dtype: Any  #: dtype of q, k, v; gradients are cast back to it
    groups: int = 1  #: G = Hq // Hkv query heads per K/V head (grouped-query attention)
    options: Any = None  #: ScoreOptions of the call (window, softcap, ALiBi, sinks, segments)
    capped: Any = None  #: [B, H, Lq, Lk] s / softcap with a softcap, for its derivative sech^2
    shapes: tuple = ()  #: (q, k, v, sinks) shapes as given, for gradients of broadcast inputs

    @property
    def lse(self) -> Any:
        """[B, H, Lq] natural log-sum-exp of each row's final scores (sink included); -inf
        for a row with nothing to attend (and no sink)."""
        xp = namespace(self.probs)
        return xp.reshape(self.softmax.lse, tuple(self.probs.shape[:-1]))


class SDPAGrads(NamedTuple):
    """Gradients of ``sdpa_forward``, in the order of its array inputs."""
    dq: Any  #: [B, Hq, Lq, Dh], shape of q
    dk: Any  #: [B, Hkv, Lk, Dh], shape of k
    dv: Any  #: [B, Hkv, Lk, Dv], shape of v
    dmask: Any  #: floating mask's own shape, or None for a boolean or no mask
    dsinks: Any  #: (H,) with sinks, else None


class ScoreOptions(NamedTuple):
    """The kernel options of one call, checked, in the layout of the scores [B, H, Lq, Lk].

    Query ``i`` sits at key position ``i + offset``; it may attend key ``j``
    when ``-left <= j - (i + offset) <= right`` (None: unbounded) and, with
    segments, when their ids are equal. ``is_causal`` is ``right = 0``
    (``causal_options``).
    """
    offset: int = 0  #: 0 top-left, Lk - Lq bottom-right (align)
    left: Optional[int] = None  #: keys before the query's position it may attend; None: all
    right: Optional[int] = None  #: keys after the query's position it may attend; None: all
    softcap: Optional[float] = None  #: ``softcap * tanh(s / softcap)`` of the scores; None: off
    alibi: Any = None  #: [B or 1, H, 1, 1] slopes, compute dtype
    sinks: Any = None  #: [1, H, 1, 1] sink logits, compute dtype
    q_segments: Any = None  #: [B, 1, Lq, 1] segment ids of the queries
    k_segments: Any = None  #: [B, 1, 1, Lk] segment ids of the keys


#: No option: the plain ``softmax(q k^T * scale + mask) v``.
PLAIN = ScoreOptions()


def score_options(q: Any, k: Any, *, align: str = "top_left", window: Any = None,
                  softcap: Optional[float] = None, alibi_slopes: Any = None, sinks: Any = None,
                  q_segments: Any = None, k_segments: Any = None) -> ScoreOptions:
    """The ``ScoreOptions`` of checked arguments (``validation.check_kernel_options``),
    their arrays in the compute dtype and the layout of the scores [B, H, Lq, Lk].

    Parameters
    ----------
    q : array, shape (B, Hq, Lq, Dh)
    k : array, shape (B, Hkv, Lk, Dh)
        Only their lengths, numbers of axes, namespace and ``q``'s dtype are read.
    align : {"top_left", "bottom_right"}
    window : (left, right), optional
        Each side an int >= 0 or None (unbounded).
    softcap : float > 0, optional
    alibi_slopes : array, shape (Hq,) or (B, Hq), optional
    sinks : array, shape (Hq,), optional
    q_segments, k_segments : integer arrays, shapes (B, Lq) and (B, Lk), optional
        Both or neither.

    Returns
    -------
    ScoreOptions
        ``offset`` 0 (top-left) or ``Lk - Lq`` (bottom-right); ``left`` and ``right`` capped
        at ``max(Lq, Lk)``; ``alibi`` (B or 1, Hq, 1, 1) and ``sinks`` (1, Hq, 1, 1) in the
        compute dtype; the segments as (B, 1, Lq, 1) and (B, 1, 1, Lk), in their own dtype.
    """
    xp = namespace(q)
    work = compute_dtype(xp, q.dtype)
    Lq, Lk = q.shape[-2], k.shape[-2]
    n_lead = max(q.ndim, k.ndim) - 2  # leading axes of the scores; the last is H
    left, right = (None, None) if window is None else (window[0], window[1])
    alibi = None
    if alibi_slopes is not None:
        a = xp.astype(alibi_slopes, work)
        alibi = xp.reshape(a, (1,) * (n_lead - a.ndim) + tuple(a.shape) + (1, 1))  # [B|1, H, 1, 1]
    sink = None
    if sinks is not None:
        sink = xp.reshape(xp.astype(sinks, work), (1,) * (n_lead - 1) + (sinks.shape[0], 1, 1))
    qs = ks = None
    if q_segments is not None:
        qs = xp.reshape(q_segments, (q_segments.shape[0], 1, Lq, 1))  # [B, 1, Lq, 1]
        ks = xp.reshape(k_segments, (k_segments.shape[0], 1, 1, Lk))  # [B, 1, 1, Lk]
    # |j - (i + offset)| < max(Lq, Lk) for every pair, in both aligns: a wider side allows the
    # same keys, and as max(Lq, Lk) it stays within the integers every library compares its
    # positions with (Lq + Lk overflowed int32 on JAX without x64)
    reach = int(max(Lq, Lk))
    return ScoreOptions(offset=0 if align == "top_left" else int(Lk - Lq),
                        left=None if left is None else min(int(left), reach),
                        right=None if right is None else min(int(right), reach),
                        softcap=None if softcap is None else float(softcap),
                        alibi=alibi, sinks=sink, q_segments=qs, k_segments=ks)


def checked_options(q: Any, k: Any, v: Any, *, enable_gqa: bool = False, align: str = "top_left",
                    window: Any = None, softcap: Optional[float] = None, alibi_slopes: Any = None,
                    sinks: Any = None, q_segments: Any = None,
                    k_segments: Any = None) -> ScoreOptions:
    """The kernel options of an ``sdpa_forward`` call, checked (``validation.check_kernel_options``
    against the scores' leading axes) and as ``score_options`` (q, k, v checked already)."""
    lead = V.scores_lead(q, k, v, enable_gqa=enable_gqa)
    V.check_kernel_options(q, k, lead=lead, align=align, window=window, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, q_segments=q_segments,
                           k_segments=k_segments)
    return score_options(q, k, align=align, window=window, softcap=softcap,
                         alibi_slopes=alibi_slopes, sinks=sinks, q_segments=q_segments,
                         k_segments=k_segments)


def is_plain(options: ScoreOptions, is_causal: bool) -> bool:
    """Whether ``options`` compute the plain attention (with ``is_causal`` top-left): no
    window, softcap, ALiBi, sinks or segments, and an alignment that changes nothing."""
    o = options
    arrays = (o.alibi, o.sinks, o.q_segments, o.k_segments)
    return (o.left is None and o.right is None and o.softcap is None
            and all(a is None for a in arrays) and (o.offset == 0 or not is_causal))


def is_positional(options: ScoreOptions) -> bool:
    """Whether ``options`` hold at most a window and an alignment: no softcap, ALiBi, sinks
    or segments (what the NumPy kernel takes)."""
    o = options
    return o.softcap is None and all(a is None for a in (o.alibi, o.sinks, o.q_segments,
                                                         o.k_segments))


def causal_options(is_causal: bool, options: Optional[ScoreOptions]) -> ScoreOptions:
    """``options`` with ``is_causal`` folded in: causal is the window's ``right = 0``.

    Parameters
    ----------
    is_causal : bool
    options : ScoreOptions or None
        None: ``PLAIN``.

    Returns
    -------
    ScoreOptions
        ``options``, with ``right = 0`` where ``is_causal`` and its ``right`` is None or > 0.
    """
    o = PLAIN if options is None else options
    if is_causal and (o.right is None or o.right > 0):
        o = o._replace(right=0)
    return o


def positions_allowed(xp: Any, rows: Any, cols: Any, o: ScoreOptions) -> Any:
    """Bool [bq, bk]: query rows ``rows`` [bq] may attend key columns ``cols`` [bk] by the
    window about the diagonal ``j = i + offset``; None when the window is unbounded.

    Parameters
    ----------
    xp : namespace
    rows : integer array, shape (bq,)
        Query positions ``i``.
    cols : integer array, shape (bk,)
        Key positions ``j``.
    o : ScoreOptions
        Its ``offset``, ``left`` and ``right`` are read.

    Returns
    -------
    allowed : bool array, shape (bq, bk), or None
        True where ``-left <= j - (i + offset) <= right`` (a side None: unbounded); None
        when both sides are None.
    """
    if o.left is None and o.right is None:
        return None
    d = xp.expand_dims(cols, axis=0) - (xp.expand_dims(rows, axis=1) + o.offset)  # j - (i + o)
    allowed = None if o.right is None else d <= o.right  # [bq, bk]
    if o.left is not None:
        after = d >= -o.left
        allowed = after if allowed is None else xp.logical_and(allowed, after)
    return allowed


def block_visible(o: ScoreOptions, i0: int, i1: int, j0: int, j1: int) -> bool:
    """Whether some query of rows ``i0:i1`` may attend some key of ``j0:j1`` by the window."""
    lo, hi = j0 - (i1 - 1 + o.offset), (j1 - 1) - (i0 + o.offset)  # extremes of j - (i + o)
    return (o.right is None or lo <= o.right) and (o.left is None or hi >= -o.left)


def block_cut(o: ScoreOptions, i0: int, i1: int, j0: int, j1: int) -> bool:
    """Whether the window forbids some pair of rows ``i0:i1`` and keys ``j0:j1``."""
    lo, hi = j0 - (i1 - 1 + o.offset), (j1 - 1) - (i0 + o.offset)
    return (o.right is not None and hi > o.right) or (o.left is not None and lo < -o.left)


def alibi_bias(xp: Any, slopes: Any, rows: Any, cols: Any, offset: int) -> Any:
    """ALiBi's ``-slope * |i + offset - j|`` for rows [bq] and columns [bk]: [..., bq, bk]
    with the leading axes of ``slopes`` [..., 1, 1].

    Parameters
    ----------
    xp : namespace
    slopes : array, shape (..., 1, 1), real floating
    rows : integer array, shape (bq,)
        Query positions ``i``.
    cols : integer array, shape (bk,)
        Key positions ``j``.
    offset : int

    Returns
    -------
    bias : array, shape (..., bq, bk)
        In the dtype of ``slopes``.
    """
    d = xp.expand_dims(cols, axis=0) - (xp.expand_dims(rows, axis=1) + offset)  # [bq, bk]
    return slopes * (-xp.astype(xp.abs(d), slopes.dtype))  # [..., bq, bk]


def sech_squared(xp: Any, u: Any) -> Any:
    """``sech^2(u) = 1 - tanh^2(u)``, the derivative of ``tanh``, as ``(1 / cosh(u))^2``.

    Where ``tanh(u)`` rounds towards +-1, ``1 - tanh^2`` computed from it cancels
    (to 0 from ``abs(u)`` of about 9 to 10 in float32, depending on the library's
    ``tanh``); this form does not. ``abs(u)`` is
    clamped at ``C = -log(tiny) / 2`` (``tiny`` the dtype's smallest normal
    number; C = 43.7 in float32, 354 in float64), where ``cosh`` is still
    finite: beyond it the result is ``4 tiny`` instead of a smaller number.
    """
    clamp = -0.5 * math.log(float(xp.finfo(u.dtype).smallest_normal))
    r = 1.0 / xp.cosh(xp.minimum(xp.abs(u), scalar(xp, clamp, u)))
    return r * r


def combine_allowed(xp: Any, a: Any, b: Any) -> Any:
    """``a AND b`` for bool masks where None means everything is allowed."""
    if a is None:
        return b
    return a if b is None else xp.logical_and(a, b)


def group_heads(xp: Any, x: Any, G: int) -> Any:
    """View query-head rows as rows of their K/V head: ``[..., Hq, L, X] -> [..., Hkv, G*L, X]``.

    Query head ``h = hkv * G + g`` lands in K/V head ``hkv = h // G``, at rows
    ``g*L : (g+1)*L``. A row-major reshape: no data is repeated.

    Parameters
    ----------
    xp : namespace
    x : array, shape (..., Hq, L, X)
    G : int > 0
        Query heads per K/V head; divides Hq.

    Returns
    -------
    array, shape (..., Hkv, G*L, X), Hkv = Hq // G
        ``x`` itself when ``G == 1``.
    """
    if G == 1:
        return x
    *lead, Hq, L, X = x.shape
    # two steps, each only splitting or merging axes: dask reshapes chunked arrays only so
    x = xp.reshape(x, (*lead, Hq // G, G, L, X))  # [..., Hkv, G, L, X]
    return xp.reshape(x, (*lead, Hq // G, G * L, X))  # [..., Hkv, G*L, X]


def ungroup_heads(xp: Any, x: Any, G: int) -> Any:
    """Inverse of ``group_heads``: ``[..., Hkv, G*L, X] -> [..., Hq, L, X]``.

    Parameters
    ----------
    xp : namespace
    x : array, shape (..., Hkv, G*L, X)
    G : int > 0

    Returns
    -------
    array, shape (..., Hq, L, X), Hq = Hkv * G
        ``x`` itself when ``G == 1``.
    """
    if G == 1:
        return x
    *lead, Hkv, GL, X = x.shape
    x = xp.reshape(x, (*lead, Hkv, G, GL // G, X))  # [..., Hkv, G, L, X]
    return xp.reshape(x, (*lead, Hkv * G, GL // G, X))  # [..., Hq, L, X]


def gqa_groups(q: Any, k: Any, v: Any, enable_gqa: bool) -> int:
    """Number of query heads per K/V head, with the shape checks of grouped-query attention.

    Parameters
    ----------
    q : array, shape (..., Hq, Lq, Dh)
    k : array, shape (..., Hkv, Lk, Dh)
    v : array, shape (..., Hkv, Lk, Dv)
    enable_gqa : bool

    Returns
    -------
    G : int
        ``Hq // Hkv``; 1 without ``enable_gqa`` (nothing is checked then).

    Raises
    ------
    ValueError
        With ``enable_gqa``: q, k or v without a head axis, v's heads other than k's, Hq
        not a positive multiple of Hkv (or Hkv = 0), or batch axes that do not broadcast.
    """
    if not enable_gqa:
        return 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim < 3:
            raise ValueError(
                f"{name}: expected shape (..., H, L, Dh), with a head axis for enable_gqa, "
                f"got shape {tuple(t.shape)}"
            )
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != Hkv:
        raise ValueError(
            f"v: expected {Hkv} heads like k with enable_gqa, got shape {tuple(v.shape)}"
        )
    if Hq == 0 and Hkv != 0:  # G = 0 query heads per K/V head: nothing to group
        raise ValueError(
            f"q: expected at least one query head per key/value head with enable_gqa "
            f"(Hkv={Hkv}), got Hq=0"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"k: with enable_gqa the query heads Hq={Hq} must be a multiple of the "
            f"key/value heads, got Hkv={Hkv}"
        )
    V.scores_lead(q, k, v, enable_gqa=True)  # the batch axes broadcast
    return Hq // Hkv


def sdpa_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    dropout_mask: Any = None,
    rng: Any = None,
    enable_gqa: bool = False,
    align: str = "top_left",
    window: Any = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    q_segments: Any = None,
    k_segments: Any = None,
) -> tuple[Any, SDPACache]:
    """Scaled dot-product attention, ``softmax(q k^T * scale + mask) v``, with the options
    of attention kernels (windows, softcap, ALiBi, sinks, packed sequences).

    Steps (the backward walks them in reverse):

    0. ``qg = group_heads(q)``  (grouped-query attention only: the G query
       heads of one K/V head become G blocks of rows, ``[B, Hkv, G*Lq, Dh]``)
    1. ``s = (q @ k^T) * scale``                          [B, H, Lq, Lk]
    2. ``c = softcap * tanh(s / softcap)``                (``softcap`` only)
    3. ``z = c - slope * |i + o - j|``                    (``alibi_slopes`` only)
    4. ``a_mask = mask`` AND causal AND window AND segments (boolean: AND;
       floating: added to ``z``, ``-inf`` where the others forbid)
    5. ``p = softmax(z, a_mask, sink)``                    [B, H, Lq, Lk]:
       ``p_j = exp(z_j) / (exp(sink) + sum_k exp(z_k))``, no sink: ``exp(sink) = 0``;
       ``lse = log(exp(sink) + sum_k exp(z_k))``           [B, H, Lq]
    6. ``a = dropout(p)``                                  [B, H, Lq, Lk]
    7. ``out = a @ v``                                     [B, H, Lq, Dv]

    With ``enable_gqa``, steps 1 and 7 multiply in the grouped view,
    ``s = ungroup(qg @ k^T) * scale`` and ``out = ungroup(group(a) @ v)``;
    steps 2-6 act on ``[B, Hq, Lq, Lk]`` as usual, so masks keep their shapes.

    Parameters
    ----------
    q : array, shape (B, H, Lq, Dh)   (H = Hq with ``enable_gqa``)
    k : array, shape (B, H, Lk, Dh)   (H = Hkv with ``enable_gqa``)
    v : array, shape (B, H, Lk, Dv)   (H = Hkv with ``enable_gqa``; Dv may differ from Dh)
        The leading (batch) axes of q, k and v broadcast against each other
        as in torch's SDPA; each gradient is summed back to its input's shape.
    mask : array broadcastable to (B, H, Lq, Lk), optional
        Boolean (True = may attend) or floating (added to the scores after the
        softcap and ALiBi, ``-inf`` allowed).
    is_causal : bool
        Query ``i`` attends keys ``j <= i + o`` (``o`` from ``align``); ANDed
        with ``mask``. The same as ``window=(None, 0)``.
    scale : float, optional
        Defaults to ``1 / sqrt(Dh)``.
    dropout_p : float
        Drop probability on the attention probabilities.
    dropout_mask : bool array broadcastable to (B, H, Lq, Lk), optional
        Keep-mask (True = keep); replaces the generator. Applied whenever given,
        also at ``dropout_p = 0`` (scale 1), where torch's SDPA drops nothing;
        ``MultiHeadAttention`` applies it only in training mode with dropout > 0.
    rng : int, numpy.random.SeedSequence, BitGenerator, Generator or None
        Draws the keep-mask when ``dropout_p > 0`` and no mask is given.
    enable_gqa : bool
        Grouped-query attention, as SDPA's ``enable_gqa``: Hq is a multiple of
        Hkv and query head ``h`` uses K/V head ``h // (Hq // Hkv)``. K and V
        are not repeated: each K/V head multiplies the stacked rows of its
        ``G = Hq // Hkv`` query heads. Masks and ``dropout_mask`` broadcast
        to (B, Hq, Lq, Lk).
    align : {"top_left", "bottom_right"}
        Where the diagonal of ``is_causal``, ``window`` and ALiBi lies: query
        ``i`` sits at key position ``i + o``, ``o = 0`` (top-left, SDPA's) or
        ``o = Lk - Lq`` (bottom-right, flash-attn's, the one a KV cache needs).
    window : (left, right), optional
        Query ``i`` may attend key ``j`` only if ``i + o - left <= j <= i + o + right``;
        each side an int >= 0 or None (unbounded).
    softcap : float > 0, optional
        The scaled scores become ``softcap * tanh(s / softcap)`` (flash-attn, Gemma 2).
    alibi_slopes : array, shape (H,) or (B, H), optional
        Adds ``-slope * |i + o - j|`` after the softcap (flash-attn's ALiBi).
        Constants of any real floating dtype, used in the dtype of the scores.
    sinks : array, shape (H,), optional
        A per-head logit in every row's softmax denominator that carries no
        value (gpt-oss's attention sinks); -inf is no sink. Of q's dtype, and so
        is ``dsinks``. A row with every key masked gives zeros.
    q_segments, k_segments : integer arrays (B, Lq) and (B, Lk), optional
        Packed sequences: query ``i`` attends key ``j`` only when their ids are equal.

    Returns
    -------
    out : array, shape (B, H, Lq, Dv)
    cache : SDPACache
        ``cache.probs`` (B, H, Lq, Lk) are the attention weights before
        dropout; ``cache.lse`` (B, H, Lq) the log-sum-exp of each row's
        scores, ``-inf`` for a row with nothing to attend (flash-attn writes
        ``+inf`` there; ``docs/conventions.md``).

    Notes
    -----
    float16 and bfloat16 inputs are computed in float32 throughout and the
    output is cast back to the input dtype. A query row with nothing to attend
    gets an all-zero row of weights and zero output.

    This is the readable reference: it runs as written on every backend.
    ``npattn.attention.sdpa_forward(..., impl=)`` chooses between it, the
    blocked algorithm and the NumPy kernel, which compute the same function.
    """
    # [B, H, Lq, Dh], [B, H, Lk, Dh], [B, H, Lk, Dv] -> [B, H, Lq, Dv]
    # dask allows chunks of length 0, and its reshape and concatenate fail on some
    q, k, v, mask, dropout_mask, alibi_slopes, sinks, q_segments, k_segments = (
        without_empty_chunks(a) for a in (q, k, v, mask, dropout_mask, alibi_slopes, sinks,
                                          q_segments, k_segments))
    V.check_sdpa_inputs(q, k, v, mask=mask, dropout_mask=dropout_mask, dropout_p=dropout_p,
                        scale=scale, is_causal=is_causal, enable_gqa=enable_gqa, rng=rng)
    G = gqa_groups(q, k, v, enable_gqa)
    options = checked_options(q, k, v, enable_gqa=enable_gqa, align=align, window=window,
                              softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                              q_segments=q_segments, k_segments=k_segments)
    with generator_kept_on_failure(rng):  # a failed call leaves the caller's generator as it was
        return sdpa_forward_core(q, k, v, mask=mask, is_causal=is_causal, scale=scale,
                                 dropout_p=dropout_p, dropout_mask=dropout_mask, rng=rng,
                                 groups=G, options=options)


def sdpa_forward_core(q: Any, k: Any, v: Any, *, mask: Any, is_causal: bool, scale: Optional[float],
                      dropout_p: float, dropout_mask: Any, rng: Any, groups: int,
                      options: Optional[ScoreOptions] = None) -> tuple[Any, SDPACache]:
    """``sdpa_forward`` on arguments that are already checked (``groups`` = G, ``options``
    from ``score_options``); for the dispatcher.

    Parameters
    ----------
    q, k, v, mask, is_causal, scale, dropout_p, dropout_mask, rng
        As in ``sdpa_forward``, checked.
    groups : int
        G, from ``gqa_groups``: 1 without grouped-query attention.
    options : ScoreOptions, optional
        None: ``PLAIN``.

    Returns
    -------
    out : array, shape (B, H, Lq, Dv)
    cache : SDPACache
        As ``sdpa_forward``'s.
    """
    # [B, H, Lq, Dh], [B, H, Lk, Dh], [B, H, Lk, Dv] -> [B, H, Lq, Dv]
    xp = namespace(q, k, v, mask, dropout_mask)
    G = groups
    o = causal_options(is_causal, options)
    shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape),
              None if o.sinks is None else (o.sinks.shape[-3],))
    # leading (batch) axes that broadcast become equal, as views, so that the scores, the
    # weights and lse have the output's leading axes; the backward sums each gradient back
    lead = V.scores_lead(q, k, v, enable_gqa=G > 1)
    batch, own = (lead[:-1], 3) if G > 1 else (lead, 2)  # under GQA the head axes differ
    q, k, v = (xp.broadcast_to(t, batch + tuple(t.shape[-own:])) for t in (q, k, v))
    in_dtype = q.dtype
    work = compute_dtype(xp, in_dtype)
    if work != in_dtype:
        q, k, v = (xp.astype(t, work) for t in (q, k, v))
        if mask is not None and is_floating(xp, mask):
            mask = xp.astype(mask, work)
    Dh = q.shape[-1]
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    Lq, Lk = q.shape[-2], k.shape[-2]
    rows = xp.arange(Lq, device=device_of(q))  # [Lq] query positions
    cols = xp.arange(Lk, device=device_of(q))  # [Lk] key positions

    qg = group_heads(xp, q, G)  # 0.                              [B, Hkv, G*Lq, Dh]
    s = ungroup_heads(xp, (qg @ xp.matrix_transpose(k)) * scale, G)  # 1. [B, H, Lq, Lk]
    c, capped = s, None  # 2. c = softcap * tanh(s / softcap), or s without a softcap
    if o.softcap is not None:
        with overflow_unreported():  # s / softcap = +-inf (a tiny softcap) gives tanh = +-1: the limit
            capped = s / o.softcap  # [B, H, Lq, Lk]
        c = o.softcap * xp.tanh(capped)  # [B, H, Lq, Lk]
    z = c  # 3. z = c + alibi, or c without ALiBi
    if o.alibi is not None:
        z = c + alibi_bias(xp, o.alibi, rows, cols, o.offset)  # [B, H, Lq, Lk]

    # 4. what may be attended: the window (causal included) AND the segments, then the mask
    allowed = positions_allowed(xp, rows, cols, o)  # [Lq, Lk] or None
    if o.q_segments is not None:
        allowed = combine_allowed(xp, allowed, o.q_segments == o.k_segments)  # [B, 1, Lq, Lk]
    mask_shape = None
    a_mask = mask
    if mask is not None and is_floating(xp, mask):
        mask_shape = tuple(mask.shape)
        if allowed is not None:
            a_mask = xp.where(allowed, mask, scalar(xp, -math.inf, mask))
    elif allowed is not None:
        a_mask = combine_allowed(xp, mask, allowed)

    sink = o.sinks  # [1, H, 1, 1] or None, broadcast over rows
    if sink is not None:
        sink = xp.broadcast_to(sink, tuple(z.shape[:-1]) + (1,))  # [B, H, Lq, 1]
    p, sm_cache = _masked_softmax(z, a_mask, sink)  # 5.           [B, H, Lq, Lk]
    a, do_cache = _dropout(p, dropout_p, dropout_mask, rng)  # 6.
    out = ungroup_heads(xp, group_heads(xp, a, G) @ v, G)  # 7.   [B, H, Lq, Dv]

    if work != in_dtype:
        out = xp.astype(out, in_dtype)
    cache = SDPACache(q, k, v, p, a, sm_cache, do_cache, scale, mask_shape, in_dtype, G,
                      o, capped, shapes)
    return out, cache


def sdpa_backward(dout: Any, cache: SDPACache, *, dlse: Any = None) -> SDPAGrads:
    """Gradients of scaled dot-product attention.

    Parameters
    ----------
    dout : array, shape (B, H, Lq, Dv)
    cache : SDPACache
    dlse : array, shape (B, H, Lq), optional
        Upstream gradient of ``cache.lse`` (ring and split-KV attention merge
        partial results through it), in the dtype of ``cache.lse``. Entries on
        rows with nothing to attend and no sink (lse = -inf) do not matter, inf and
        NaN included; with ``sinks`` such a row's lse is its sink's, and its dlse
        reaches ``dsinks``.

    Returns
    -------
    SDPAGrads
        ``dq`` (B, H, Lq, Dh); ``dk`` (B, H, Lk, Dh), ``dv`` (B, H, Lk, Dv), with the K/V
        heads' shape under ``enable_gqa``; ``dmask`` of the floating mask's
        own shape (the gradient with respect to the additive mask, summed over
        the axes it was broadcast along), None for a boolean or no mask;
        ``dsinks`` (H,) with sinks, else None. Each in the shape of its input.
    """
    # [B, H, Lq, Dv] -> [B, H, Lq, Dh], [B, H, Lk, Dh], [B, H, Lk, Dv], mask shape, [H]
    V.check_cache("cache", cache, SDPACache, "sdpa_forward")
    dout, dlse = without_empty_chunks(dout), without_empty_chunks(dlse)  # as in the forward
    xp_c, dev = namespace(cache.q), device_of(cache.q)
    V.check_grad("dout", dout, shape=(*cache.probs.shape[:-1], cache.v.shape[-1]),
                 dtype=cache.in_dtype, xp=xp_c, device=dev, of="the forward's out")
    if dlse is not None:
        V.check_grad("dlse", dlse, shape=tuple(cache.probs.shape[:-1]),
                     dtype=cache.softmax.lse.dtype, xp=xp_c, device=dev, of="cache.lse")
    xp = namespace(dout, cache.q)
    check_same_device(q=cache.q, dout=dout)
    q, k, v, a = cache.q, cache.k, cache.v, cache.attn
    o = PLAIN if cache.options is None else cache.options
    if dout.dtype != q.dtype:
        dout = xp.astype(dout, q.dtype)

    G = cache.groups
    # 7. out = ungroup(group(a) @ v): the grouped view is a plain matmul, so
    #    da = dout @ v^T and dv = a^T @ dout in that view; the contraction over
    #    the G*Lq rows of dv sums each K/V head's gradient over its G query heads
    dout_g = group_heads(xp, dout, G)  # [B, Hkv, G*Lq, Dv]
    da = ungroup_heads(xp, dout_g @ xp.matrix_transpose(v), G)  # [B, H, Lq, Lk]
    dv = xp.matrix_transpose(group_heads(xp, a, G)) @ dout_g  # [B, Hkv, Lk, Dv]
    # 6. a = dropout(p)
    dp = dropout_backward(da, cache.dropout)  # [B, H, Lq, Lk]
    # 5. p = softmax(z, a_mask, sink): dz = p * (dp - delta + dlse), delta = rowsum(dp * p)
    dlse_rows = None  # [B, H, Lq, 1]; 0 on rows with nothing to attend (lse = -inf, p = 0)
    if dlse is not None:
        dlse_col = xp.expand_dims(dlse, axis=-1)  # [B, H, Lq, 1]
        dlse_rows = xp.where(cache.softmax.lse == -math.inf, scalar(xp, 0.0, dlse_col), dlse_col)
    dz, da_mask, dsink = masked_softmax_backward(dp, cache.softmax, dlse=dlse_rows)  # [B, H, Lq, Lk]
    # 4. a_mask = where(allowed, mask, -inf): dmask = da_mask where allowed, and
    #    da_mask is already 0 where it forbids (p = 0 there); sum to mask's shape
    dmask = None
    if cache.mask_shape is not None:
        dmask = sum_to_shape(xp, da_mask, cache.mask_shape)
    dsinks = None
    if o.sinks is not None:  # the sink: one more logit of every row (b, h, i), with dp = 0,
        #                      so dsink = p_sink * (0 - delta + dlse), [B, H, Lq, 1]; summed to (H,)
        dsinks = xp.reshape(sum_to_shape(xp, dsink, tuple(o.sinks.shape)), cache.shapes[3])
    # 3. z = c + alibi: dc = dz (the bias is a constant)
    dc = dz  # [B, H, Lq, Lk]
    # 2. c = softcap * tanh(s / softcap): ds = dc * (1 - tanh^2(s / softcap)) = dc * sech^2(...)
    #    (sech^2 from s / softcap: 1 - tanh^2 cancels where tanh rounds to 1); ds = dc without one
    ds = dc if cache.capped is None else dc * sech_squared(xp, cache.capped)  # [B, H, Lq, Lk]
    # 1. s = ungroup(qg @ k^T) * scale: dqg = ds_g @ k * scale, and
    #    dk = ds_g^T @ qg * scale, again summed over the G query heads of a group
    ds_g = group_heads(xp, ds, G)  # [B, Hkv, G*Lq, Lk]
    dqg = (ds_g @ k) * cache.scale  # [B, Hkv, G*Lq, Dh]
    dk = (xp.matrix_transpose(ds_g) @ group_heads(xp, q, G)) * cache.scale  # [B, Hkv, Lk, Dh]
    # 0. qg = group_heads(q): a reshape, undone
    dq = ungroup_heads(xp, dqg, G)  # [B, H, Lq, Dh]
    if cache.shapes:  # leading axes that broadcast in the forward: sum back to each input
        dq, dk, dv = (sum_to_shape(xp, g, shp) for g, shp in zip((dq, dk, dv), cache.shapes))

    if cache.in_dtype != q.dtype:
        dq, dk, dv = (xp.astype(t, cache.in_dtype) for t in (dq, dk, dv))
        if dmask is not None:
            dmask = xp.astype(dmask, cache.in_dtype)
        if dsinks is not None:  # sinks are of q's dtype (validation.check_kernel_options)
            dsinks = xp.astype(dsinks, cache.in_dtype)
    return SDPAGrads(dq, dk, dv, dmask, dsinks)


# --------------------------------------------------------------------------
# extra keys/values (torch's add_bias_kv, add_zero_attn): [..., Lk, D] -> [..., Lk + n, D]


class AppendKVCache(NamedTuple):
    """What ``append_kv_backward`` needs from ``append_kv_forward``."""
    n_given: int  #: Lk, the number of keys the caller gave
    has_bias: bool  #: whether row Lk is the learned bias
    out_shape: Optional[tuple] = None  #: y's shape: dy has it (and like's dtype, library, device)
    like: Any = None  #: validation.ArraySpec of x


def append_kv_forward(x: Any, bias: Any = None, *, add_zero_attn: bool = False
                      ) -> tuple[Any, AppendKVCache]:
    """Append torch's extra key (or value) positions after the given ones.

    Applied alike to the projected keys (with ``bias_k``) and values (with
    ``bias_v``), in the order of ``torch.nn.MultiheadAttention``:

    1. ``x = concat([x, bias], axis=-2)``   (``bias`` given)   [..., Lk + 1, D]
    2. ``x = concat([x, 0], axis=-2)``      (``add_zero_attn``) [..., Lk + n, D]

    Parameters
    ----------
    x : array, shape (..., Lk, D)
    bias : array, shape (D,), optional
        Learned extra position, broadcast over the leading axes.
    add_zero_attn : bool
        Append a position of zeros last.

    Returns
    -------
    y : array, shape (..., Lk + n, D), n = (bias given) + add_zero_attn
    cache : AppendKVCache
    """
    # [..., Lk, D], [D] -> [..., Lk + n, D]
    V.check_floating_array("x", x)
    if x.ndim < 2:
        raise ValueError(f"x: expected at least 2 axes (..., Lk, D), got shape {V.shape_of(x)}")
    if bias is not None:
        V.check_floating_array("bias", bias, namespace(x), device_of(x), dtype=x.dtype, like="x")
        if V.shape_of(bias) != (int(x.shape[-1]),):
            raise ValueError(
                f"bias: expected shape ({x.shape[-1]},) (the last axis of x), got shape "
                f"{V.shape_of(bias)}"
            )
    V.check_bool("add_zero_attn", add_zero_attn)
    xp = namespace(x, bias)
    row_shape = tuple(x.shape[:-2]) + (1, x.shape[-1])
    parts = [x]
    if bias is not None:
        parts.append(xp.broadcast_to(bias, row_shape))  # 1.          [..., 1, D]
    if add_zero_attn:
        parts.append(xp.zeros(row_shape, dtype=x.dtype, device=device_of(x)))  # 2. [..., 1, D]
    y = xp.concat(parts, axis=-2) if len(parts) > 1 else x  # [..., Lk + n, D]
    return y, AppendKVCache(x.shape[-2], bias is not None, V.shape_of(y), V.spec_of(x))


def append_kv_backward(dy: Any, cache: AppendKVCache) -> tuple[Any, Any]:
    """Gradients of ``append_kv``: ``dx`` is the first Lk positions of ``dy``.

    The zero position has no inputs and its gradient is dropped; ``dbias`` is
    the gradient of the bias position summed over the leading axes it was
    broadcast along (None without a bias).

    Parameters
    ----------
    dy : array, shape (..., Lk + n, D)
        The gradient of the forward's ``y``.
    cache : AppendKVCache

    Returns
    -------
    dx : array, shape (..., Lk, D)
    dbias : array, shape (D,) or None
    """
    # [..., Lk + n, D] -> [..., Lk, D], [D]
    V.check_cache("cache", cache, AppendKVCache, "append_kv_forward")
    V.check_floating_array("dy", dy)
    if cache.like is not None and cache.out_shape is not None:
        _check_dout_like("dy", dy, cache.like, cache.out_shape)
    n_min = cache.n_given + int(cache.has_bias)
    if dy.ndim < 2 or dy.shape[-2] < n_min:
        raise ValueError(
            f"dy: expected shape (..., Lk + n, D) with Lk + n >= {n_min} (the forward's "
            f"output), got shape {V.shape_of(dy)}"
        )
    xp = namespace(dy)
    Lk = cache.n_given
    # 2. x = concat([x, 0]): the zero row is a constant, its gradient goes nowhere
    # 1. x = concat([x, bias]): row Lk came from the bias, broadcast over [...]
    dbias = None
    if cache.has_bias:
        db = dy[..., Lk, :]  # [..., D]
        n = math.prod(V.shape_of(db)[:-1])  # N (a -1 beside D = 0 is ambiguous)
        dbias = half_sum(xp, xp.reshape(db, (n, db.shape[-1])), axis=0)  # [D]
    dx = dy[..., :Lk, :]  # [..., Lk, D]
    return dx, dbias


class PadMaskCache(NamedTuple):
    """What ``pad_mask_backward`` needs from ``pad_mask_forward``."""
    n_given: int  #: Lk
    causal: Any  #: [Lq, Lk] bool causal mask that was applied to a floating mask, else None
    mask_shape: Optional[tuple]  #: shape of a floating mask, for dmask; else None


def pad_mask_forward(mask: Any, Lq: int, Lk: int, n_extra: int, *, is_causal: bool = False,
                     like: Any = None) -> tuple[Any, PadMaskCache]:
    """Extend a mask over the Lk given keys to ``n_extra`` appended keys, which are always attendable.

    This is how torch pads its masks for ``add_bias_kv`` and ``add_zero_attn``
    (``pad(mask, (0, 1))``: False = attend, or 0.0 added). ``is_causal``
    (top-left, query i sees given keys j <= i) is folded in first, so it
    never hides the extra keys.

    1. ``m = mask`` combined with ``causal(Lq, Lk)``: boolean AND, floating
       ``where(causal, mask, -inf)``, no mask: the causal mask
    2. ``m`` broadcast to length Lk on its last axis                 [..., Lk]
    3. ``m = concat([m, fill], axis=-1)``, fill True or 0.0           [..., Lk + n_extra]

    Parameters
    ----------
    mask : array broadcastable to (..., Lq, Lk), bool (True = may attend) or floating, optional
    Lq, Lk : int
        Query length and number of given keys.
    n_extra : int
        Number of appended keys.
    is_causal : bool
    like : array, optional
        Gives the namespace and device of the causal mask when ``mask`` is None.

    Returns
    -------
    m : array, shape (..., Lk + n_extra), or None when ``mask`` is None and not causal
    cache : PadMaskCache
    """
    # [..., Lk] -> [..., Lk + n]
    Lq, Lk = V.check_size("Lq", Lq, minimum=1), V.check_size("Lk", Lk, minimum=1)
    n_extra = V.check_size("n_extra", n_extra)
    V.check_bool("is_causal", is_causal)
    if like is not None:
        V.check_array("like", like)
    if mask is not None:
        V.check_array("mask", mask)
        if like is not None:  # the mask joins like's computation: its library and device
            V.check_array("mask", mask, namespace(like), device_of(like), where="like like",
                          library="that of like")
        if mask.ndim < 1:
            raise ValueError(f"mask: expected shape (..., Lk) or (..., Lq, Lk), got shape {V.shape_of(mask)}")
        mxp = namespace(mask)
        if not (is_bool(mxp, mask) or is_floating(mxp, mask)):
            raise TypeError(
                f"mask: expected dtype bool (True = may attend) or a real floating dtype (added "
                f"to the scores), got {V.dtype_name(mask.dtype)}; integer masks are ambiguous"
            )
        shape = V.shape_of(mask)
        V.check_broadcasts_to("mask", shape, (*shape[:-2], Lq, Lk), "(..., Lq, Lk)")
    if mask is None and not is_causal:
        return None, PadMaskCache(Lk, None, None)
    floating = mask is not None and is_floating(namespace(mask), mask)
    mask_shape = tuple(mask.shape) if floating else None
    m = mask
    causal = None
    if is_causal:  # 1.
        ref = mask if mask is not None else like
        if ref is None:
            raise ValueError("like: expected an array (the namespace and device of the causal mask) "
                             "with is_causal=True and mask=None, got None")
        xp = namespace(ref)
        causal = causal_mask(xp, Lq, Lk, device_of(ref))  # [Lq, Lk]
        if mask is None:
            m = causal
        elif floating:
            m = xp.where(causal, mask, scalar(xp, -math.inf, mask))  # [..., Lq, Lk]
        else:
            m = xp.logical_and(mask, causal)  # [..., Lq, Lk]
        causal = causal if floating else None
    xp = namespace(m)
    if m.shape[-1] != Lk:  # 2.
        m = xp.broadcast_to(m, tuple(m.shape[:-1]) + (Lk,))  # [..., Lk]
    fill_shape = tuple(m.shape[:-1]) + (n_extra,)
    if floating:
        fill = xp.zeros(fill_shape, dtype=m.dtype, device=device_of(m))  # [..., n]
    else:
        fill = xp.ones(fill_shape, dtype=xp.bool, device=device_of(m))  # [..., n]
    m = xp.concat([m, fill], axis=-1)  # 3.                            [..., Lk + n]
    return m, PadMaskCache(Lk, causal, mask_shape)


def pad_mask_backward(dm: Any, cache: PadMaskCache) -> Any:
    """Gradient of ``pad_mask`` for a floating mask: ``dmask`` of the mask's own shape.

    None for a boolean or no mask (``dm`` may then be None too).

    Parameters
    ----------
    dm : array, shape (..., Lk + n_extra), or None
        The gradient of the forward's ``m``; read only for a floating mask.
    cache : PadMaskCache

    Returns
    -------
    dmask : array of the floating mask's shape, or None
    """
    # [..., Lk + n] -> mask shape
    V.check_cache("cache", cache, PadMaskCache, "pad_mask_forward")
    if cache.mask_shape is None:
        return None
    V.check_floating_array("dm", dm)
    if dm.ndim < 1 or dm.shape[-1] < cache.n_given:
        raise ValueError(
            f"dm: expected shape (..., Lk + n) with Lk + n >= {cache.n_given} (the forward's "
            f"padded mask), got shape {V.shape_of(dm)}"
        )
    xp = namespace(dm)
    # 3. m = concat([m, 0]): keep the given keys' columns
    d = dm[..., : cache.n_given]  # [..., Lk]
    # 1. m = where(causal, mask, -inf): no gradient where causal forbids
    if cache.causal is not None:
        d = xp.where(cache.causal, d, scalar(xp, 0.0, d))  # [..., Lq, Lk]
    # 2. and 1.: sum over what broadcasting added
    return sum_to_shape(xp, d, cache.mask_shape)
