"""Positions inside attention: rotary embeddings and relative positions, each with a hand-derived backward.

Three ways of telling attention where a token is, as forward/backward pairs
with the contract of ``npattn.functional``::

    out, cache = op_forward(*inputs, ...)
    grads      = op_backward(dout, cache)

* **RoPE** (Su et al., RoFormer): ``rope_forward`` rotates pairs of
  coordinates of ``q`` or ``k`` by an angle proportional to the position, so
  that ``q_i . k_j`` depends on positions only through ``i - j``. Both pairings
  in use: half-split (GPT-NeoX, HF LLaMA's ``rotate_half``: ``(c, c + Dh/2)``)
  and interleaved (GPT-J, RoFormer: ``(2c, 2c + 1)``).
* **Shaw et al.'s relative embeddings**: a table ``R`` of ``2 M - 1`` rows,
  looked up at the clipped distance ``j - i`` (``relative_embedding_forward``),
  and the score term ``q_i . r_{j-i}`` (``relative_scores_forward``), a
  ``[B, H, Lq, Lk]`` bias to pass as the floating ``mask=`` of
  ``sdpa_forward``; ``sdpa_backward``'s ``dmask`` flows into
  ``relative_scores_backward``.
* **T5's bucketed bias**: ``t5_bucket`` (T5's ``_relative_position_bucket``)
  and ``relative_bias_forward``, a learned scalar per bucket and head.

A table lookup is a gather, and its backward a scatter-add, which the Array
API standard lacks. Here every table is looked up through the ``Lq + Lk - 1``
distances ``j - i`` that occur: (1) one row per distance, ``C @ table`` with
``C`` one-hot (it does the clipping or bucketing), then (2) each distance's row
spread along its diagonal of the ``[Lq, Lk]`` grid. The backward of (2) sums
``dout`` along the diagonals, with a pad-and-reshape that turns diagonals into
columns (``diagonal_sums``); that of (1) is ``C^T @ ...``. ``docs/positions.md``
derives each step. The forward computes (1) as the gather ``take(table, row)``
it equals: the product would turn an ``inf`` entry of the table (a ``-inf``
bias is a mask) into ``0 * inf = NaN`` in the rows that do not read it.

Shape legend
------------
B batch, H heads, Lq query length, Lk key length, Dh head width, L length
(RoPE), E width of a relative embedding, M = max_len (Shaw's table has
N = 2 M - 1 rows), NB number of buckets, T = Lq + Lk - 1 distances.

Code uses only the Python Array API standard through ``xp``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Optional

import numpy as np

from . import validation as V
from .backend import (backend_name, check_same_device, device_of, entry_bytes, float64_namespace,
                      float64_result, is_floating, isdtype, namespace, resolve_backend, to_numpy,
                      widest_int)
from .functional import compute_dtype, half_sum, sum_to_shape

__all__ = [
    "rope_angles",
    "rope_forward",
    "rope_backward",
    "relative_distances",
    "diagonal_spread",
    "diagonal_sums",
    "relative_embedding_forward",
    "relative_embedding_backward",
    "relative_scores_forward",
    "relative_scores_backward",
    "t5_bucket",
    "relative_bias_forward",
    "relative_bias_backward",
]


# --------------------------------------------------------------------------
# argument checks of this module (the shared vocabulary is npattn.validation)


def _check_int(name: str, value: Any) -> int:
    """An int (Python or NumPy, not a bool) of at most 62 bits: positions and offsets are summed
    in int64. Returns it as a Python int (a NumPy int would wrap in that arithmetic)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {V.described(value)}")
    if not -(2**62) <= int(value) <= 2**62:
        raise ValueError(f"{name}: expected an int within +-2**62 (positions are int64), got {int(value)}")
    return int(value)


def _check_base(value: Any) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"base: expected a float > 1, got {V.described(value)}")
    if not (math.isfinite(V.real_value(value)) and V.real_value(value) > 1.0):
        raise ValueError(f"base: expected a finite float > 1, got {V.real_text(value)}")


def _check_max_distance(value: Any) -> int:
    """A positive int that a float holds: T5's log step divides it in floating point. Returns
    it as a Python int."""
    value = V.check_positive_int("max_distance", value, maximum=None)
    if not math.isfinite(V.real_value(value)):  # (10**400 / 8: OverflowError)
        raise ValueError(f"max_distance: expected a positive int that a float holds, got "
                         f"{V.real_text(value)}")
    return value


def _check_table(name: str, table: Any, *, odd_rows: bool = False) -> None:
    V.check_floating_array(name, table, like=name)
    if table.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array, got shape {V.shape_of(table)}")
    n = int(table.shape[0])
    if odd_rows and n % 2 != 1:
        raise ValueError(
            f"{name}: expected an odd number of rows, 2 * max_len - 1, got shape {V.shape_of(table)}"
        )


def _check_positions(positions: Any, x: Any) -> None:
    if positions is None:
        return
    if isinstance(positions, numbers.Integral) and not isinstance(positions, (bool, np.bool_)):
        L = x.shape[-2] if x.ndim >= 2 else 0
        if not -(2**63) <= int(positions) <= 2**63 - 1 - L:  # arange(start, start + L) in int64
            raise ValueError(f"positions: expected an int start with start + L within int64 "
                             f"(L = {L}), got {int(positions)}")
        return
    xp = namespace(x)
    V.check_array("positions", positions, xp, device_of(x), where="that of x", library="that of x")
    if not (isdtype(xp, positions.dtype, "integral") or is_floating(xp, positions)):
        raise TypeError(
            f"positions: expected integer or real floating positions, got {V.dtype_name(positions.dtype)}"
        )
    V.check_broadcasts_to("positions", V.shape_of(positions), tuple(x.shape[:-1]),
                          "x.shape[:-1] = (..., L)")
    L = int(x.shape[-2])
    if L > 1 and (positions.ndim == 0 or int(positions.shape[-1]) == 1):
        # broadcast along L, every token of a row would sit at one position: a start per
        # sequence, (B, 1, 1), read as the positions themselves
        raise ValueError(f"positions: expected one position per token (a last axis of L = {L}), "
                         f"got shape {V.shape_of(positions)}, which would put all {L} tokens of a row "
                         f"at one position; for a start per sequence pass start[..., None] + arange(L), "
                         f"or an int start; to put them at one position, broadcast it to (..., L)")


# --------------------------------------------------------------------------
# rotary position embeddings


class RopeCache(NamedTuple):
    """What ``rope_backward`` needs from ``rope_forward``."""
    cos: Any  #: [..., L, Dh/2] cos(theta), compute dtype
    sin: Any  #: [..., L, Dh/2] sin(theta)
    interleaved: bool  #: pairs (2c, 2c+1) instead of (c, c + Dh/2)
    in_dtype: Any  #: dtype of x; dx is cast back to it
    x_shape: tuple = ()  #: shape of x, for checking dout


def rope_angles(xp: Any, positions: Any, Dh: int, base: float = 10000.0, dtype: Any = None) -> Any:
    """The rotation angles ``theta[..., l, c] = positions[..., l] * base^(-2c/Dh)``, c < Dh/2.

    Computed in float64 (``positions`` may be large; on the host where the
    backend has no float64, as JAX without x64), returned in ``dtype`` (a
    floating dtype of ``xp`` or its name, as the constructors' ``dtype=``;
    default float64, or float32 where the backend has no float64). ``xp`` a
    backend (a name or a namespace, as ``backend=``), ``positions`` a real
    array of it. # [..., L] -> [..., L, Dh/2]

    Parameters
    ----------
    xp : str or namespace
        The backend, as ``backend=``.
    positions : integer or real floating array of ``xp``, shape (..., L)
    Dh : int > 0, even
        The head width whose pairs ``rope_forward`` rotates.
    base : float > 1
        The frequency base.
    dtype : floating dtype of ``xp``, or its name, optional
        Default float64, or float32 where the backend has no float64.

    Returns
    -------
    theta : array, shape (..., L, Dh/2)
        On the device of ``positions``.
    """
    xp = resolve_backend(xp, "xp")
    V.check_array("positions", positions, xp, where="that of positions", library="xp")
    if not isdtype(xp, positions.dtype, ("integral", "real floating")):
        raise TypeError(f"positions: expected an integer or real floating array, got dtype "
                        f"{V.dtype_name(positions.dtype)}")
    Dh = V.check_positive_int("Dh", Dh)
    if Dh % 2:  # rope_forward's Dh; an odd one has no Dh/2 (c < Dh/2 would count ceil(Dh/2))
        raise ValueError(f"Dh: expected an even int (pairs of coordinates, the last axis that "
                         f"rope_forward rotates), got {Dh}")
    _check_base(base)
    if dtype is not None:  # an integer dtype would truncate the angles
        dtype = getattr(xp, V.float_dtype_name(xp, dtype))
    # theta [..., L, Dh/2], made in float64: one that cannot exist is named here
    V.check_array_bytes(["Dh"], V.shape_of(positions) + (Dh // 2,), 8, "theta")
    fx = float64_namespace(xp)
    return float64_result(_angles(fx, positions, Dh, base), xp, dtype, device_of(positions))


def _angles(fx: Any, positions: Any, Dh: int, base: float) -> Any:
    """``rope_angles`` in float64 in namespace ``fx`` (``float64_namespace``); ``positions``
    an array of fx or of the backend. # [..., L] -> [..., L, Dh/2]"""
    if namespace(positions) is not fx:  # the backend has no float64: on the host
        positions = fx.asarray(to_numpy(positions))
    pos = fx.astype(positions, fx.float64)  # [..., L]
    # [Dh/2] base^(-2c/Dh) by Python's pow, within an ulp (exp(-2c ln(base) / Dh) was up to 7 off)
    # (allocated whole first: a Dh too large for memory is NumPy's MemoryError at once, where
    # a list grew entry by entry until the process ran out of memory)
    inv_freq = np.fromiter((float(base) ** (-2.0 * c / Dh) for c in range(Dh // 2)),
                           dtype=np.float64, count=Dh // 2)
    inv_freq = fx.asarray(inv_freq, dtype=fx.float64, device=device_of(pos))
    return fx.expand_dims(pos, axis=-1) * inv_freq  # [..., L, Dh/2]


def _rope_split(xp: Any, x: Any, interleaved: bool) -> tuple[Any, Any]:
    """The two coordinates of each pair. # [..., Dh] -> [..., Dh/2], [..., Dh/2]"""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _rope_merge(xp: Any, a: Any, b: Any, interleaved: bool) -> Any:
    """The inverse of ``_rope_split``. # [..., Dh/2], [..., Dh/2] -> [..., Dh]"""
    if interleaved:
        pairs = xp.stack([a, b], axis=-1)  # [..., Dh/2, 2]
        return xp.reshape(pairs, (*a.shape[:-1], 2 * a.shape[-1]))
    return xp.concat([a, b], axis=-1)


def rope_forward(x: Any, positions: Any = None, *, base: float = 10000.0,
                 interleaved: bool = False) -> tuple[Any, RopeCache]:
    """Rotary position embedding: rotate each pair of coordinates of ``x`` by ``theta``.

    For a pair ``(x1, x2)`` of frequency ``c`` at position ``p``,
    ``theta = p * base^(-2c/Dh)`` and

    .. math::

        y_1 = x_1 \\cos\\theta - x_2 \\sin\\theta, \\qquad
        y_2 = x_2 \\cos\\theta + x_1 \\sin\\theta,

    which is ``out = x * cos + rotate_half(x) * sin`` of HF LLaMA in the
    half-split pairing. Steps (the backward walks them in reverse):

    1. ``theta = positions * inv_freq``          [..., L, Dh/2]
    2. ``cos, sin = cos(theta), sin(theta)``
    3. ``x1, x2 = split(x)``                     half-split or interleaved
    4. ``y1 = x1 cos - x2 sin``; ``y2 = x2 cos + x1 sin``
    5. ``out = merge(y1, y2)``                   [..., L, Dh]

    Parameters
    ----------
    x : array, shape (..., L, Dh), Dh even
        Queries or keys, e.g. (B, H, L, Dh).
    positions : None, int, or array broadcastable to (..., L)
        None: ``arange(L)``; an int ``start``: ``start + arange(L)`` (decoding
        with a KV cache; ``start + L`` within int64); an array: the positions themselves (integers or
        floats), e.g. (B, 1, L) for per-sequence offsets. Its last axis is L
        (where L > 1: an array of one position per row, broadcast along L,
        would put every token at it, and is refused; where that is meant, as
        flash-attn's non-causal rotary with a KV cache puts every new query at
        ``cache_seqlens[b]``, broadcast it to (..., L) first).
    base : float > 1
        The frequency base (10000 in RoFormer and LLaMA).
    interleaved : bool
        False: pairs ``(c, c + Dh/2)`` (GPT-NeoX, HF ``rotate_half``);
        True: pairs ``(2c, 2c + 1)`` (GPT-J, RoFormer).

    Returns
    -------
    out : array, shape (..., L, Dh)
        In the dtype of ``x``.
    cache : RopeCache

    Notes
    -----
    The angles are computed in float64 and the rotation in the compute dtype
    (float32 for float16/bfloat16 inputs). ``q_i . k_j`` after rotation
    depends on the positions only through ``p_i - p_j``.
    """
    # [..., L, Dh] -> [..., L, Dh]
    V.check_floating_array("x", x, like="x")
    if x.ndim < 2:
        raise ValueError(f"x: expected an array of shape (..., L, Dh), got shape {V.shape_of(x)}")
    if x.shape[-1] % 2 != 0 or x.shape[-1] == 0:
        raise ValueError(f"x: expected an even last axis Dh >= 2 (pairs of coordinates), got shape "
                         f"{V.shape_of(x)}")
    _check_positions(positions, x)
    _check_base(base)
    V.check_bool("interleaved", interleaved)
    xp = namespace(x)
    L, Dh = x.shape[-2], x.shape[-1]
    fx = float64_namespace(xp)  # xp, or NumPy on the host where xp has no float64
    if positions is None or isinstance(positions, numbers.Integral):
        start = 0 if positions is None else int(positions)
        dev = device_of(x) if fx is xp else None
        positions = fx.arange(start, start + L, dtype=fx.int64, device=dev)  # [L]
    in_dtype = x.dtype
    work = compute_dtype(xp, in_dtype)
    xw = x if work == in_dtype else xp.astype(x, work)

    theta = _angles(fx, positions, Dh, base)  # 1.           [..., L, Dh/2] float64
    cos, sin = (float64_result(t, xp, work, device_of(x)) for t in (fx.cos(theta), fx.sin(theta)))  # 2.
    x1, x2 = _rope_split(xp, xw, interleaved)  # 3.          [..., L, Dh/2] each
    y1 = x1 * cos - x2 * sin  # 4.                           [..., L, Dh/2]
    y2 = x2 * cos + x1 * sin
    out = _rope_merge(xp, y1, y2, interleaved)  # 5.         [..., L, Dh]
    if work != in_dtype:
        out = xp.astype(out, in_dtype)
    return out, RopeCache(cos, sin, bool(interleaved), in_dtype, tuple(x.shape))


def rope_backward(dout: Any, cache: RopeCache) -> tuple[Any, None]:
    """Gradient of the rotation: the rotation by ``-theta`` (its transpose).

    ``dx1 = dy1 cos + dy2 sin``, ``dx2 = -dy1 sin + dy2 cos``. Positions get
    no gradient (None).

    Parameters
    ----------
    dout : array, shape (..., L, Dh)
        The gradient of the forward's ``out``, of its shape and dtype.
    cache : RopeCache

    Returns
    -------
    dx : array, shape (..., L, Dh)
    dpositions : None
    """
    # [..., L, Dh] -> [..., L, Dh], None
    V.check_cache("cache", cache, RopeCache, "rope_forward")
    xp = namespace(cache.cos)
    V.check_floating_array("dout", dout, xp, device_of(cache.cos), dtype=cache.in_dtype,
                           like="the forward's out")
    if V.shape_of(dout) != cache.x_shape:
        raise ValueError(f"dout: expected shape {cache.x_shape} (that of the forward's out), got {V.shape_of(dout)}")
    cos, sin = cache.cos, cache.sin
    if dout.dtype != cos.dtype:
        dout = xp.astype(dout, cos.dtype)
    # 5. out = merge(y1, y2): split the gradient the same way
    dy1, dy2 = _rope_split(xp, dout, cache.interleaved)  # [..., L, Dh/2] each
    # 4. y1 = x1 cos - x2 sin; y2 = x2 cos + x1 sin: the transposed rotation
    dx1 = dy1 * cos + dy2 * sin  # [..., L, Dh/2]
    dx2 = dy2 * cos - dy1 * sin
    # 3. x1, x2 = split(x)
    dx = _rope_merge(xp, dx1, dx2, cache.interleaved)  # [..., L, Dh]
    # 2., 1.: the angles depend on the positions only, which get no gradient
    if dx.dtype != cache.in_dtype:
        dx = xp.astype(dx, cache.in_dtype)
    return dx, None


# --------------------------------------------------------------------------
# the diagonals of the [Lq, Lk] grid: a lookup by distance and its adjoint


def relative_distances(xp: Any, Lq: int, Lk: int, offset: int = 0, device: Any = None) -> Any:
    """The ``T = Lq + Lk - 1`` relative positions that occur, ``rel[t] = t - (Lq - 1) - offset``.

    Diagonal ``t`` of the grid holds the pairs with ``j - i = t - (Lq - 1)``;
    query ``i`` sits at key position ``i + offset``, so their relative
    position is ``j - (i + offset)``. Made by ``xp`` (a backend name or
    namespace) on ``device``. # -> [T] int64 (int32 where ``xp`` has no int64)

    Parameters
    ----------
    xp : str or namespace
        The backend, as ``backend=``.
    Lq, Lk : int > 0
    offset : int
        Query ``i`` sits at key position ``i + offset``.
    device : optional
        A device of ``xp``; None: its default.

    Returns
    -------
    rel : array, shape (T,), T = Lq + Lk - 1
        int64 (int32 where ``xp`` has no int64).
    """
    xp = resolve_backend(xp, "xp")
    Lq, Lk, offset = _check_lengths(Lq, Lk, offset)  # Python ints: Lq + Lk - 1 must not wrap
    V.check_device(xp, device)
    _check_positions_fit(xp, Lq, Lk, offset)
    V.check_array_bytes(["Lq", "Lk"], (Lq + Lk - 1,), entry_bytes(xp, widest_int(xp)),
                        "the relative positions")
    return xp.arange(Lq + Lk - 1, dtype=widest_int(xp), device=device) - (Lq - 1 + offset)  # [T]


def diagonal_spread(xp: Any, rows: Any, Lq: int, Lk: int) -> Any:
    """``out[i, j, :] = rows[j - i + Lq - 1, :]``: row ``t`` along diagonal ``t``. # [T, E] -> [Lq, Lk, E]

    A gather with ``xp.take``; its adjoint is ``diagonal_sums``. Sizes whose spread rows or
    gather indices could not exist at all (more bytes than the largest array) are a
    ``ValueError`` naming them, before anything is made.

    Parameters
    ----------
    xp : str or namespace
        The backend, as ``backend=``.
    rows : array of ``xp``, shape (T, E), T = Lq + Lk - 1
    Lq, Lk : int > 0

    Returns
    -------
    out : array, shape (Lq, Lk, E)
        In the dtype of ``rows``.
    """
    xp = resolve_backend(xp, "xp")
    Lq = V.check_positive_int("Lq", Lq)  # Python ints: Lq + Lk - 1 must not wrap
    Lk = V.check_positive_int("Lk", Lk)
    V.check_array("rows", rows, xp, where="that of rows", library="xp")
    if V.shape_of(rows)[:1] != (Lq + Lk - 1,) or len(V.shape_of(rows)) != 2:
        raise ValueError(f"rows: expected shape (Lq + Lk - 1, E) = ({Lq + Lk - 1}, E), got "
                         f"{V.shape_of(rows)}")
    # the largest arrays made below: the spread rows (the gather's, then reshaped) and the indices
    V.check_array_bytes(["Lq", "Lk", "rows"], (Lq, Lk, int(rows.shape[1])), entry_bytes(xp, rows.dtype),
                        "the spread rows")
    V.check_array_bytes(["Lq", "Lk"], (Lq, Lk), entry_bytes(xp, widest_int(xp)),
                        "the gather indices of the spread")
    dev = device_of(rows)
    i = xp.arange(Lq, dtype=widest_int(xp), device=dev)  # [Lq]
    j = xp.arange(Lk, dtype=widest_int(xp), device=dev)  # [Lk]
    t = xp.expand_dims(j, axis=0) - xp.expand_dims(i, axis=1) + (Lq - 1)  # [Lq, Lk] in [0, T)
    out = xp.take(rows, xp.reshape(t, (-1,)), axis=0)  # [Lq * Lk, E]
    return xp.reshape(out, (Lq, Lk, rows.shape[-1]))  # [Lq, Lk, E]


def diagonal_sums(xp: Any, a: Any) -> Any:
    """``sums[..., t] = sum over j - i = t - (Lq - 1) of a[..., i, j]``. # [..., Lq, Lk] -> [..., T]

    The adjoint of ``diagonal_spread`` (a scatter-add), with reshapes only:

    1. flip the rows, so ``(i', j)`` with ``i' = Lq - 1 - i`` lies on
       anti-diagonal ``i' + j = j - i + Lq - 1 = t``;
    2. pad each row with ``Lq`` zeros, ``[..., Lq, Lk + Lq]``, and flatten;
    3. keep the first ``Lq (Lk + Lq - 1)`` entries and read them as rows of
       width ``Lk + Lq - 1``: entry ``(i', j)`` was at flat index
       ``i' (Lk + Lq) + j = i' (Lk + Lq - 1) + (i' + j)``, so it lands in column
       ``i' + j = t``; every other entry of the new rows is a pad zero;
    4. sum over the rows.

    Parameters
    ----------
    xp : str or namespace
        The backend, as ``backend=``.
    a : array of ``xp``, shape (..., Lq, Lk), Lq, Lk >= 1

    Returns
    -------
    sums : array, shape (..., T), T = Lq + Lk - 1
        In the dtype of a floating ``a`` (float16 and bfloat16 summed in float32 and
        rounded once).
    """
    xp = resolve_backend(xp, "xp")
    V.check_array("a", a, xp, where="that of a", library="xp")
    if len(V.shape_of(a)) < 2 or 0 in V.shape_of(a)[-2:]:
        raise ValueError(f"a: expected shape (..., Lq, Lk) with Lq, Lk >= 1, got {V.shape_of(a)}")
    Lq, Lk = a.shape[-2], a.shape[-1]
    lead = tuple(a.shape[:-2])
    flipped = xp.flip(a, axis=-2)  # 1.                                        [..., Lq, Lk]
    zeros = xp.zeros((*lead, Lq, Lq), dtype=a.dtype, device=device_of(a))  # [..., Lq, Lq]
    padded = xp.reshape(xp.concat([flipped, zeros], axis=-1), (*lead, Lq * (Lk + Lq)))  # 2.
    skewed = xp.reshape(padded[..., :Lq * (Lk + Lq - 1)], (*lead, Lq, Lk + Lq - 1))  # 3.
    return half_sum(xp, skewed, axis=-2)  # 4.                                 [..., T]


def _one_hot(xp: Any, ids: Any, n: int, dtype: Any) -> Any:
    """``[ids[t] == r]`` as ``dtype``. # [T] -> [T, n]"""
    classes = xp.arange(n, dtype=ids.dtype, device=device_of(ids))  # [n]
    return xp.astype(xp.expand_dims(ids, axis=-1) == classes, dtype)  # [T, n]


def _check_lengths(Lq: Any, Lk: Any, offset: Any) -> tuple[int, int, int]:
    """Lq, Lk > 0 and an offset, as Python ints (summed as Lq + Lk - 1 and Lq - 1 + offset)."""
    return V.check_positive_int("Lq", Lq), V.check_positive_int("Lk", Lk), _check_int("offset", offset)


def _check_positions_fit(xp: Any, Lq: int, Lk: int, offset: int) -> None:
    """``ValueError`` naming Lq, Lk and offset unless the relative positions ``t - (Lq - 1 +
    offset)``, ``t < Lq + Lk - 1``, and the counts that make them, fit the positions' dtype
    (``widest_int``: int32 on JAX without x64, where they would wrap or fail naming nothing)."""
    index = widest_int(xp)
    lo, hi = int(xp.iinfo(index).min), int(xp.iinfo(index).max)
    c = Lq - 1 + offset  # rel[t] = t - c
    if not (Lq + Lk - 2 <= hi and lo <= c <= hi and lo <= -c and Lq + Lk - 2 - c <= hi):
        raise ValueError(
            f"Lq, Lk and offset: expected Lq - 1 + offset and the relative positions t - (Lq - 1 + "
            f"offset), 0 <= t < Lq + Lk - 1, within [{lo}, {hi}] ({V.dtype_name(index)}, the "
            f"positions' dtype on backend {backend_name(xp)!r}; on JAX, jax_enable_x64 gives int64), "
            f"got Lq={Lq}, Lk={Lk}, offset={offset}")


def _check_made(names: list, xp: Any, Lq: int, Lk: int, offset: int, table: Any, width: int,
                dtype: Any) -> None:
    """What a forward makes from the lengths ``names`` (checked ints) can exist: relative
    positions that fit their dtype (``_check_positions_fit``), and by ``V.check_array_bytes`` the
    relative positions [T], the one-hot C [T, N], the spread rows [Lq, Lk, width] and the gather
    indices [Lq, Lk] that spread them (larger than the rows when a row, width * itemsize bytes,
    is narrower than an index)."""
    _check_positions_fit(xp, Lq, Lk, offset)
    T, N, itemsize = Lq + Lk - 1, int(table.shape[0]), entry_bytes(xp, dtype)
    index_size = entry_bytes(xp, widest_int(xp))
    V.check_array_bytes(names, (T,), index_size, "the relative positions")
    V.check_array_bytes(names, (T, N), itemsize, "the one-hot rows C")
    V.check_array_bytes(names, (Lq, Lk, width), itemsize, "the spread rows")
    V.check_array_bytes(names, (Lq, Lk), index_size, "the gather indices of the spread")


# --------------------------------------------------------------------------
# Shaw et al.: a table of relative embeddings, looked up at the clipped distance


class RelativeEmbeddingCache(NamedTuple):
    """What ``relative_embedding_backward`` needs from ``relative_embedding_forward``."""
    onehot: Any  #: [T, N] C[t, r] = [row of distance t == r], for dtable
    Lq: int  #: query length
    Lk: int  #: key length
    E: int  #: the table's width, for dout's shape


def relative_embedding_forward(table: Any, Lq: int, Lk: int, *, offset: int = 0
                               ) -> tuple[Any, RelativeEmbeddingCache]:
    """Shaw et al.'s relative embeddings: ``out[i, j, :] = table[clip(j - i - offset, -K, K) + K, :]``.

    ``table`` has ``N = 2 M - 1`` rows, ``K = M - 1``; within ``M`` positions
    of each other that is the lookup at ``j - i + M - 1``, farther ones share
    the end rows (Shaw et al.'s clipping). Steps:

    1. ``rel = relative_distances(Lq, Lk, offset)``     [T], ``T = Lq + Lk - 1``
    2. ``C[t, r] = [clip(rel[t], -K, K) + K == r]``     [T, N] one-hot
    3. ``rows = C @ table``                             [T, E], one row per distance
    4. ``out = diagonal_spread(rows)``                  [Lq, Lk, E]

    Parameters
    ----------
    table : array, shape (2 M - 1, E)
    Lq, Lk : int > 0
    offset : int
        Query ``i`` sits at key position ``i + offset`` (``Lk - Lq`` when
        decoding the last ``Lq`` positions of ``Lk``).

    Returns
    -------
    out : array, shape (Lq, Lk, E)
    cache : RelativeEmbeddingCache
    """
    # [N, E] -> [Lq, Lk, E]
    _check_table("table", table, odd_rows=True)
    Lq, Lk, offset = _check_lengths(Lq, Lk, offset)
    _check_made(["Lq", "Lk"], namespace(table), Lq, Lk, offset, table, int(table.shape[1]), table.dtype)
    return _relative_embedding(table, Lq, Lk, offset)


def _relative_embedding(table, Lq, Lk, offset):
    xp = namespace(table)
    N = table.shape[0]
    K = (N - 1) // 2
    rel = relative_distances(xp, Lq, Lk, offset, device_of(table))  # 1.      [T]
    row = xp.clip(rel, -K, K) + K  # row of the table for each distance        [T]
    C = _one_hot(xp, row, N, table.dtype)  # 2.                                [T, N]
    rows = xp.take(table, row, axis=0)  # 3. C @ table, as a gather: an inf entry of an
    # unread row would make 0 * inf = NaN in every row of the product             [T, E]
    out = diagonal_spread(xp, rows, Lq, Lk)  # 4.                               [Lq, Lk, E]
    return out, RelativeEmbeddingCache(C, int(Lq), int(Lk), int(table.shape[1]))


def relative_embedding_backward(dout: Any, cache: RelativeEmbeddingCache) -> tuple[Any, None, None]:
    """Gradient into the table: ``dtable[r] = sum of dout[i, j]`` over the pairs that read row ``r``.

    ``drows = diagonal_sums(dout)`` (the adjoint of the spread), then
    ``dtable = C^T @ drows``. The lengths get None.

    Parameters
    ----------
    dout : array, shape (Lq, Lk, E)
        The gradient of the forward's ``out``, in the table's dtype.
    cache : RelativeEmbeddingCache

    Returns
    -------
    dtable : array, shape (2 M - 1, E)
    dLq, dLk : None
    """
    # [Lq, Lk, E] -> [N, E], None, None
    V.check_cache("cache", cache, RelativeEmbeddingCache, "relative_embedding_forward")
    C = cache.onehot
    xp = namespace(C)
    V.check_floating_array("dout", dout, xp, device_of(C), dtype=C.dtype, like="the forward's out")
    if V.shape_of(dout) != (cache.Lq, cache.Lk, cache.E):
        raise ValueError(
            f"dout: expected shape {(cache.Lq, cache.Lk, cache.E)} (that of the forward's out), "
            f"got {V.shape_of(dout)}"
        )
    return _relative_embedding_backward(xp, dout, C), None, None


def _relative_embedding_backward(xp, dout, C):
    # half precision in float32, rounded once: a diagonal's sum rounded to float16 may
    # overflow where its bucket's total does not
    work = compute_dtype(xp, dout.dtype)
    d = dout if work == dout.dtype else xp.astype(dout, work)  # [Lq, Lk, E]
    Cw = C if work == C.dtype else xp.astype(C, work)  # [T, N]
    # 4. out = diagonal_spread(rows): sum each diagonal of dout (per column e)
    d_e = xp.permute_dims(d, (2, 0, 1))  # [E, Lq, Lk]
    drows = xp.matrix_transpose(diagonal_sums(xp, d_e))  # [T, E]
    # 3. rows = C @ table: the weight gradient of a product
    # (2., 1.: C and rel are functions of integers; no gradient)
    dtable = xp.matrix_transpose(Cw) @ drows  # [N, E]
    return dtable if dtable.dtype == dout.dtype else xp.astype(dtable, dout.dtype)


class RelativeScoresCache(NamedTuple):
    """What ``relative_scores_backward`` needs from ``relative_scores_forward``."""
    q: Any  #: [..., Lq, E] (compute dtype), for drel
    rel: Any  #: [Lq, Lk, E] relative embeddings, for dq
    embedding: RelativeEmbeddingCache  #: the cache of the embeddings' lookup
    scale: float  #: the factor of the scores
    in_dtype: Any  #: dtype of q and table; gradients are cast back to it
    q_shape: tuple  #: shape of q, for checking dout


def relative_scores_forward(q: Any, table: Any, Lk: Optional[int] = None, *, offset: int = 0,
                            scale: Optional[float] = None) -> tuple[Any, RelativeScoresCache]:
    """Shaw et al.'s relative term of the scores, ``bias[..., i, j] = scale * q_i . r_{j-i}``.

    Add it to the scores with ``sdpa_forward(q, k, v, mask=bias)``: with the
    default scale that is Shaw's ``e_ij = q_i . (k_j + r_{j-i}) / sqrt(Dh)``.
    Steps:

    1.-4. ``rel = relative_embedding_forward(table, Lq, Lk)``   [Lq, Lk, E]
    5. ``bias[..., i, :] = (rel[i] @ q[..., i, :]) * scale``     [..., Lq, Lk]

    Parameters
    ----------
    q : array, shape (..., Lq, E), e.g. (B, H, Lq, Dh)
    table : array, shape (2 M - 1, E)
        In the dtype of ``q``.
    Lk : int, optional
        Key length; default Lq.
    offset : int
        Query ``i`` sits at key position ``i + offset``.
    scale : float, optional
        Default ``1 / sqrt(E)``, sdpa's; ``1.0`` gives the plain ``q_i . r_{j-i}``.

    Returns
    -------
    bias : array, shape (..., Lq, Lk)
    cache : RelativeScoresCache
    """
    # [..., Lq, E], [N, E] -> [..., Lq, Lk]
    V.check_floating_array("q", q, like="q")
    if q.ndim < 2 or q.shape[-1] < 1:  # (E = 0: the default scale 1 / sqrt(E) has no value)
        raise ValueError(f"q: expected shape (..., Lq, E) with E >= 1, got {V.shape_of(q)}")
    if q.shape[-2] < 1:  # Lq is q's, not an argument: the message names q
        raise ValueError(f"q: expected shape (..., Lq, E) with Lq >= 1, got {V.shape_of(q)}")
    _check_table("table", table, odd_rows=True)
    V.check_floating_array("table", table, namespace(q), device_of(q), dtype=q.dtype, like="q")
    if table.shape[1] != q.shape[-1]:
        raise ValueError(
            f"table: expected {q.shape[-1]} columns (E, the last axis of q), got shape {V.shape_of(table)}"
        )
    Lq = q.shape[-2]
    Lk = Lq if Lk is None else Lk
    Lq, Lk, offset = _check_lengths(Lq, Lk, offset)
    V.check_scale("scale", scale)
    xp = namespace(q, table)
    in_dtype = q.dtype
    work = compute_dtype(xp, in_dtype)
    _check_made(["q", "Lk"], xp, Lq, Lk, offset, table, int(table.shape[1]), work)  # (Lq is q's)
    if work != in_dtype:
        q, table = xp.astype(q, work), xp.astype(table, work)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)

    rel, emb = _relative_embedding(table, Lq, Lk, offset)  # 1.-4.   [Lq, Lk, E]
    col = xp.expand_dims(q, axis=-1)  # [..., Lq, E, 1]
    bias = (rel @ col)[..., 0] * scale  # 5.       [Lq, Lk, E] @ [..., Lq, E, 1] -> [..., Lq, Lk]
    if work != in_dtype:
        bias = xp.astype(bias, in_dtype)
    return bias, RelativeScoresCache(q, rel, emb, scale, in_dtype, tuple(q.shape))


def relative_scores_backward(dbias: Any, cache: RelativeScoresCache) -> tuple[Any, Any, None]:
    """Gradients of the relative term: ``dq_i = scale * rel[i]^T dbias_i`` and ``dtable``.

    ``drel[i] = scale * sum over the leading axes of dbias[..., i, :]^T q[..., i, :]``,
    then ``dtable = relative_embedding_backward(drel)``.

    Parameters
    ----------
    dbias : array, shape (..., Lq, Lk)
        The gradient of the forward's ``bias``, of its shape and dtype.
    cache : RelativeScoresCache

    Returns
    -------
    dq : array, shape (..., Lq, E)
    dtable : array, shape (2 M - 1, E)
    dLk : None
    """
    # [..., Lq, Lk] -> [..., Lq, E], [N, E], None
    V.check_cache("cache", cache, RelativeScoresCache, "relative_scores_forward")
    q, rel = cache.q, cache.rel
    xp = namespace(q)
    Lq, Lk = cache.embedding.Lq, cache.embedding.Lk
    V.check_floating_array("dbias", dbias, xp, device_of(q), dtype=cache.in_dtype, like="the forward's bias")
    expected = (*cache.q_shape[:-1], Lk)
    if V.shape_of(dbias) != expected:
        raise ValueError(f"dbias: expected shape {expected} (that of the forward's bias), got {V.shape_of(dbias)}")
    check_same_device(q=q, dbias=dbias)
    if dbias.dtype != q.dtype:
        dbias = xp.astype(dbias, q.dtype)
    # 5. bias[..., i, :] = (rel[i] @ q[..., i, :]) * scale
    g = dbias * cache.scale  # [..., Lq, Lk]
    dq = (xp.matrix_transpose(rel) @ xp.expand_dims(g, axis=-1))[..., 0]  # [Lq, E, Lk] @ [..., Lq, Lk, 1]
    E = q.shape[-1]
    g_i = xp.permute_dims(xp.reshape(g, (-1, Lq, Lk)), (1, 2, 0))  # [Lq, Lk, n] n = prod(leading)
    q_i = xp.permute_dims(xp.reshape(q, (-1, Lq, E)), (1, 0, 2))  # [Lq, n, E]
    drel = g_i @ q_i  # [Lq, Lk, E]: the sum over the leading axes is the contraction over n
    # 1.-4. rel = relative_embedding(table)
    dtable = _relative_embedding_backward(xp, drel, cache.embedding.onehot)  # [N, E]
    if cache.in_dtype != q.dtype:
        dq, dtable = xp.astype(dq, cache.in_dtype), xp.astype(dtable, cache.in_dtype)
    return dq, dtable, None


# --------------------------------------------------------------------------
# T5: a learned scalar per bucket of relative positions and per head


def t5_bucket(relative_position: Any, bidirectional: bool = True, num_buckets: int = 32,
              max_distance: int = 128) -> Any:
    """T5's bucket of each relative position ``memory_position - query_position``.

    Exactly HF transformers' ``T5Attention._relative_position_bucket``
    (Raffel et al.; the log step in float32, as there). With
    ``bidirectional`` half the buckets are for positive positions, offset by
    ``nb = num_buckets // 2``, else ``nb = num_buckets`` and positive positions
    fall in bucket 0 of the negative side. For ``n = |rel|`` (or
    ``max(-rel, 0)``) and ``max_exact = nb // 2``:

    .. math::

        b(n) = \\begin{cases}
        n, & n < m, \\\\
        \\min\\left(n_b - 1,\\ m + \\left\\lfloor
        \\dfrac{\\log(n / m)}{\\log(d_{max} / m)} (n_b - m) \\right\\rfloor\\right), & n \\ge m,
        \\end{cases}

    with ``m = max_exact``, ``n_b = nb`` and ``d_max = max_distance``.

    Parameters
    ----------
    relative_position : integer array, any shape
    bidirectional : bool
    num_buckets : int > 0
    max_distance : int, greater than max_exact

    Returns
    -------
    integer array, the shape and dtype of ``relative_position``, values in [0, num_buckets)
    """
    # [...] -> [...]
    V.check_array("relative_position", relative_position)
    xp = namespace(relative_position)
    if not isdtype(xp, relative_position.dtype, "signed integer"):
        raise TypeError(
            f"relative_position: expected a signed integer array, got {V.dtype_name(relative_position.dtype)}"
        )
    V.check_bool("bidirectional", bidirectional)
    num_buckets = V.check_positive_int("num_buckets", num_buckets)
    max_distance = _check_max_distance(max_distance)
    nb = num_buckets // 2 if bidirectional else num_buckets
    max_exact = nb // 2
    if max_exact < 1:
        raise ValueError(
            f"num_buckets: expected at least {4 if bidirectional else 2} (max_exact = num_buckets"
            f"{' // 2' if bidirectional else ''} // 2 >= 1), got {num_buckets}"
        )
    if max_distance <= max_exact:
        raise ValueError(f"max_distance: expected an int > max_exact = {max_exact}, got {max_distance}")
    top = int(xp.iinfo(relative_position.dtype).max)
    if num_buckets - 1 > top:
        raise ValueError(f"num_buckets: expected at most {top + 1}, the buckets a relative_position of "
                         f"dtype {V.dtype_name(relative_position.dtype)} can hold, got {num_buckets}")
    rp = xp.astype(relative_position, widest_int(xp))  # [...] (int32 on JAX without x64)
    # the minimum has no abs; one more lands in the same bucket (both far past max_distance)
    lo = int(xp.iinfo(rp.dtype).min)
    rp = xp.where(rp == lo, xp.full_like(rp, lo + 1), rp)
    zero = xp.zeros_like(rp)
    buckets = zero
    if bidirectional:
        buckets = buckets + xp.astype(rp > 0, rp.dtype) * nb
        n = xp.abs(rp)
    else:
        n = -xp.minimum(rp, zero)
    is_small = n < max_exact
    safe = xp.where(is_small, xp.full_like(n, max_exact), n)  # the log of large ones only (double where)
    ratio = xp.astype(safe, xp.float32) / float(max_exact)
    large = max_exact + xp.astype(
        xp.log(ratio) / math.log(max_distance / max_exact) * float(nb - max_exact), rp.dtype)
    large = xp.minimum(large, xp.full_like(large, nb - 1))
    return xp.astype(buckets + xp.where(is_small, n, large), relative_position.dtype)


class RelativeBiasCache(NamedTuple):
    """What ``relative_bias_backward`` needs from ``relative_bias_forward``."""
    onehot: Any  #: [T, NB] C[t, b] = [bucket of distance t == b], for dtable
    Lq: int  #: query length
    Lk: int  #: key length
    H: int  #: heads, the table's width


def relative_bias_forward(table: Any, Lq: int, Lk: int, *, bidirectional: bool = True,
                          max_distance: int = 128, offset: int = 0) -> tuple[Any, RelativeBiasCache]:
    """T5's relative attention bias: ``out[0, h, i, j] = table[t5_bucket(j - i - offset), h]``.

    ``num_buckets`` is ``table.shape[0]``. Add it to the scores as
    ``sdpa_forward(..., mask=out)`` (T5 uses ``scale=1.0``); its ``dmask``
    is this backward's ``dout``. Steps:

    1. ``rel = relative_distances(Lq, Lk, offset)``   [T], ``T = Lq + Lk - 1``
    2. ``C[t, b] = [t5_bucket(rel[t]) == b]``         [T, NB] one-hot
    3. ``rows = C @ table``                           [T, H]
    4. ``out = diagonal_spread(rows)``, heads first   [1, H, Lq, Lk]

    Parameters
    ----------
    table : array, shape (num_buckets, H)
    Lq, Lk : int > 0
    bidirectional, max_distance : as in ``t5_bucket``
    offset : int
        Query ``i`` sits at key position ``i + offset``.

    Returns
    -------
    out : array, shape (1, H, Lq, Lk)
    cache : RelativeBiasCache
    """
    # [NB, H] -> [1, H, Lq, Lk]
    _check_table("table", table)
    Lq, Lk, offset = _check_lengths(Lq, Lk, offset)
    V.check_bool("bidirectional", bidirectional)
    max_distance = _check_max_distance(max_distance)
    xp = namespace(table)
    NB = table.shape[0]
    nb = NB // 2 if bidirectional else NB
    if nb // 2 < 1 or max_distance <= nb // 2:
        raise ValueError(
            f"table: expected enough rows (num_buckets) for max_exact = {'num_buckets // 4' if bidirectional else 'num_buckets // 2'}"
            f" >= 1 and < max_distance = {max_distance}, got shape {V.shape_of(table)}"
        )
    _check_made(["Lq", "Lk"], xp, Lq, Lk, offset, table, int(table.shape[1]), table.dtype)
    rel = relative_distances(xp, Lq, Lk, offset, device_of(table))  # 1.         [T]
    bucket = t5_bucket(rel, bidirectional, NB, max_distance)  # [T]
    C = _one_hot(xp, bucket, NB, table.dtype)  # 2.                                [T, NB]
    rows = xp.take(table, bucket, axis=0)  # 3. C @ table, as a gather (a -inf bias of one
    # bucket, a mask, would make 0 * -inf = NaN in every other bucket's rows)        [T, H]
    spread = diagonal_spread(xp, rows, Lq, Lk)  # 4.                                [Lq, Lk, H]
    out = xp.expand_dims(xp.permute_dims(spread, (2, 0, 1)), axis=0)  # [1, H, Lq, Lk]
    return out, RelativeBiasCache(C, int(Lq), int(Lk), int(table.shape[1]))


def relative_bias_backward(dout: Any, cache: RelativeBiasCache) -> tuple[Any, None, None]:
    """Gradient into the bucket table: ``dtable = C^T @ diagonal_sums(dout)``.

    ``dtable[b, h]`` is the sum of ``dout[..., h, i, j]`` over the pairs whose
    relative position falls in bucket ``b`` (and over a leading batch axis,
    if ``dout`` has one, e.g. a ``dmask`` of shape (B, H, Lq, Lk)).

    Parameters
    ----------
    dout : array, shape (1, H, Lq, Lk) or (B, H, Lq, Lk)
        The gradient of the forward's ``out`` (or ``sdpa_backward``'s ``dmask`` where ``out``
        was the mask), in the table's dtype.
    cache : RelativeBiasCache

    Returns
    -------
    dtable : array, shape (num_buckets, H)
    dLq, dLk : None
    """
    # [1, H, Lq, Lk] -> [NB, H], None, None
    V.check_cache("cache", cache, RelativeBiasCache, "relative_bias_forward")
    C = cache.onehot
    xp = namespace(C)
    V.check_floating_array("dout", dout, xp, device_of(C), dtype=C.dtype, like="the forward's out")
    if dout.ndim != 4 or tuple(dout.shape[1:]) != (cache.H, cache.Lq, cache.Lk):
        raise ValueError(
            f"dout: expected shape (1, {cache.H}, {cache.Lq}, {cache.Lk}) or (B, {cache.H}, "
            f"{cache.Lq}, {cache.Lk}) (that of the forward's out, or of a dmask), "
            f"got {V.shape_of(dout)}"
        )
    # half precision in float32, rounded once: a diagonal's sum rounded to float16 may
    # overflow where its bucket's total does not
    work = compute_dtype(xp, dout.dtype)
    dw = dout if work == dout.dtype else xp.astype(dout, work)  # [B|1, H, Lq, Lk]
    Cw = C if work == C.dtype else xp.astype(C, work)  # [T, NB]
    # 4. out = diagonal_spread(rows), heads first: sum the batch, then each diagonal
    d = sum_to_shape(xp, dw, (1, *dw.shape[1:]))[0, ...]  # [H, Lq, Lk]
    drows = xp.matrix_transpose(diagonal_sums(xp, d))  # [T, H]
    # 3. rows = C @ table
    dtable = xp.matrix_transpose(Cw) @ drows  # [NB, H]
    # 2., 1.: buckets of integers; no gradient
    return (dtable if dtable.dtype == dout.dtype else xp.astype(dtable, dout.dtype)), None, None
