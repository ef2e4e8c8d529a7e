"""The pieces a small model needs around attention, each with a hand-derived backward.

Used by ``npattn demo`` (a sequence model built from npattn pieces only) and
tested by finite differences like the attention primitives. Same contract as
``npattn.functional``::

    out, cache = op_forward(*inputs)
    grads      = op_backward(dout, cache)

Shape legend
------------
B batch, L sequence length, V vocabulary size, D model width, N = B * L.

Code uses only the Python Array API standard through ``xp``.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, NamedTuple, Optional

from . import validation as Vd
from .backend import (computed, device_of, elementwise, entry_bytes, float64_namespace, float64_result,
                      namespace, overflow_unreported, persisted, resolve_backend, row_max, widest_int,
                      without_empty_chunks, zero_d)
from .functional import compute_dtype, sum_to_shape

__all__ = [
    "one_hot",
    "embedding_forward",
    "embedding_backward",
    "add_positions_forward",
    "add_positions_backward",
    "sinusoidal_positions",
    "cross_entropy_forward",
    "cross_entropy_backward",
    "check_ignore_index",
    "check_label_smoothing",
    "check_class_weight",
    "REDUCTIONS",
    "count_targets",
    "AdamState",
    "adam_init",
    "adam_step",
    "check_adam",
    "clip_grad_norm",
    "global_norm",
]


def one_hot(xp: Any, ids: Any, n: int, dtype: Any) -> Any:
    """``one_hot(ids)[..., c] = 1.0 if ids[...] == c else 0.0``. # [...] -> [..., n]

    ``xp`` a backend (a name or a namespace, as ``backend=``), ``ids`` an integer
    array of it with values in [0, n) (a ``ValueError`` otherwise, where
    ``torch.nn.functional.one_hot`` raises too), ``dtype`` a floating dtype of ``xp``
    or its name, as the constructors' ``dtype=`` (the rows multiply floating tables, as
    in ``embedding_forward``; torch's integer one-hot is ``one_hot(...) == 1.0``).
    Sizes whose rows (or classes ``0, ..., n - 1``) could not exist at all, more bytes than
    the largest array, are a ``ValueError`` naming ``ids`` and ``n``, before anything is made.

    Parameters
    ----------
    xp : str or namespace
        The backend, as ``backend=``.
    ids : integer array of ``xp``, shape (...)
        Class indices in [0, n).
    n : int > 0
        Number of classes.
    dtype : floating dtype of ``xp``, or its name

    Returns
    -------
    onehot : array, shape (..., n)
        In ``dtype``, on the device of ``ids``.
    """
    xp = resolve_backend(xp, "xp")
    n = Vd.check_positive_int("n", n)
    Vd.check_ids("ids", ids, n, xp, what="class indices", like="xp")
    dtype = getattr(xp, Vd.float_dtype_name(xp, dtype))
    Vd.check_array_bytes(["n"], (n,), entry_bytes(xp, widest_int(xp)), "the classes 0, ..., n - 1")
    Vd.check_array_bytes(["ids", "n"], (*Vd.shape_of(ids), n), entry_bytes(xp, dtype),
                         "the one-hot rows")  # (the largest array made; the bool rows of == are smaller)
    return _one_hot(xp, ids, n, dtype)


def _one_hot(xp: Any, ids: Any, n: int, dtype: Any) -> Any:
    """``one_hot`` on checked arguments. # [...] -> [..., n]"""
    classes = xp.arange(n, dtype=widest_int(xp), device=device_of(ids))  # [n]
    # ids compared in the classes' dtype: the standard does not promote uint64 with int64
    # (array-api-strict refuses the ==); the ids are checked to lie in [0, n) (an ignore_index
    # past int64's range wraps to a negative value, no class, and its row is zeroed anyway)
    ids = ids if ids.dtype == classes.dtype else xp.astype(ids, classes.dtype)  # [...]
    hit = xp.expand_dims(ids, axis=-1) == classes  # [..., n] bool
    return xp.astype(hit, dtype)  # [..., n]


# --------------------------------------------------------------------------
# token embedding: out = table[ids], written as a product with one-hot rows


class EmbeddingCache(NamedTuple):
    """What ``embedding_backward`` needs from ``embedding_forward``."""
    onehot: Any  #: [..., V] one-hot rows of ids, for dtable (in the table's dtype)
    width: Optional[int] = None  #: D, the table's width: dout is (..., D)


def embedding_forward(ids: Any, table: Any) -> tuple[Any, EmbeddingCache]:
    """Look up rows of ``table``: ``out[..., :] = table[ids[...], :]``.

    The math is ``out = one_hot(ids) @ table``, so that the backward is the
    transpose product; only the Array API standard is needed (it has no
    scatter-add). The forward computes it as the gather it equals (``take``):
    the product would make ``0 * inf = NaN`` of an infinite entry in the rows
    that do not read it. Sizes whose one-hot rows or looked-up rows could not exist at all
    (more bytes than the largest array) are a ``ValueError`` naming ``ids`` and ``table``.

    Parameters
    ----------
    ids : integer array, shape (...), values in [0, V)
    table : array, shape (V, D)

    Returns
    -------
    out : array, shape (..., D)
    cache : EmbeddingCache
    """
    # [...], [V, D] -> [..., D]
    Vd.check_floating_array("table", table)
    if table.ndim != 2:
        raise ValueError(f"table: expected shape (V, D), got {Vd.shape_of(table)}")
    xp = namespace(table)
    try:
        Vd.check_ids("ids", ids, table.shape[0], xp, device_of(table), what="token ids", like="table")
    except ValueError:
        if table.shape[0] == 0:  # no id is in [0, 0): the table, not the ids, is what is missing
            raise ValueError(f"table: expected a row for each id to look up, got shape "
                             f"{Vd.shape_of(table)} (no rows) for ids of shape "
                             f"{Vd.shape_of(ids)}") from None
        raise
    V = table.shape[0]
    itemsize = entry_bytes(xp, table.dtype)
    Vd.check_array_bytes(["ids", "table"], (*Vd.shape_of(ids), int(V)), itemsize, "the one-hot rows of ids")
    Vd.check_array_bytes(["ids", "table"], (*Vd.shape_of(ids), int(table.shape[1])), itemsize,
                         "the rows looked up")
    ids = without_empty_chunks(ids)  # dask's reshape fails on some chunks of length 0
    onehot = _one_hot(xp, ids, V, table.dtype)  # 1.  [..., V], for the backward
    # 2. out = onehot @ table, as the gather it equals; the ids as a 1-D array of the widest
    # int (torch takes int32 or int64 indices only; the ids are checked to lie in [0, V))
    flat = xp.astype(xp.reshape(ids, (-1,)), widest_int(xp))  # [N]
    out = xp.reshape(xp.take(table, flat, axis=0), (*ids.shape, table.shape[1]))  # [..., D]
    return out, EmbeddingCache(onehot, int(table.shape[1]))


def embedding_backward(dout: Any, cache: EmbeddingCache) -> tuple[None, Any]:
    """Gradient of the lookup: ``dtable = one_hot(ids)^T @ dout``, summed over all positions.

    Row ``v`` of ``dtable`` is the sum of ``dout`` over the positions that
    hold token ``v``. ``ids`` are integers and get no gradient (None).

    Parameters
    ----------
    dout : array, shape (..., D)
        The gradient of the forward's ``out``, in the table's dtype.
    cache : EmbeddingCache

    Returns
    -------
    dids : None
    dtable : array, shape (V, D)
    """
    # [..., D] -> None, [V, D]
    Vd.check_cache("cache", cache, EmbeddingCache, "embedding_forward")
    oh = cache.onehot
    if cache.width is not None:  # of the table's library, device and dtype, the out's shape
        Vd.check_grad("dout", dout, shape=(*Vd.shape_of(oh)[:-1], cache.width), dtype=oh.dtype,
                      xp=namespace(oh), device=device_of(oh), of="the forward's out")
    xp = namespace(dout, cache.onehot)
    dout = without_empty_chunks(dout)  # as the ids in the forward
    # 2. out = onehot @ table (N spelled out: a -1 beside a zero width, D = 0 or V = 0, is
    # ambiguous and NumPy refuses it)
    n = math.prod(Vd.shape_of(oh)[:-1])
    oh2 = xp.reshape(oh, (n, oh.shape[-1]))  # [N, V]
    d2 = xp.reshape(dout, (n, dout.shape[-1]))  # [N, D]
    dtable = xp.matrix_transpose(oh2) @ d2  # [V, D]
    return None, dtable


# --------------------------------------------------------------------------
# positional encodings


class PositionsCache(NamedTuple):
    """What ``add_positions_backward`` needs from ``add_positions_forward``."""
    pos_shape: tuple  #: shape of the positional table, for dpos
    like: Any = None  #: validation.ArraySpec of x: dout has its shape, library, device and dtype


def add_positions_forward(x: Any, pos: Any) -> tuple[Any, PositionsCache]:
    """Add a positional table: ``out[b, i, :] = x[b, i, :] + pos[i, :]``.

    ``pos`` is a learned parameter, or a fixed table such as
    ``sinusoidal_positions`` (then its gradient is simply not used).

    Parameters
    ----------
    x : array, shape (B, L, D)
    pos : array, shape (L, D)

    Returns
    -------
    out : array, shape (B, L, D)
    cache : PositionsCache
    """
    # [B, L, D], [L, D] -> [B, L, D]
    Vd.check_floating_array("x", x)
    if x.ndim < 2:
        raise ValueError(f"x: expected shape (B, L, D), got {Vd.shape_of(x)}")
    Vd.check_floating_array("pos", pos, namespace(x), device_of(x), dtype=x.dtype, like="x")
    if tuple(pos.shape) != tuple(x.shape[-2:]):
        raise ValueError(
            f"pos: expected shape {tuple(x.shape[-2:])} (L, D) to match x, got {tuple(pos.shape)}"
        )
    return x + pos, PositionsCache(tuple(pos.shape), Vd.spec_of(x))  # [B, L, D]


def add_positions_backward(dout: Any, cache: PositionsCache) -> tuple[Any, Any]:
    """``dx = dout``; ``dpos = sum_b dout[b]`` (the adjoint of broadcasting over the batch).

    Both are new arrays (never ``dout`` itself): a caller that adds into one changes
    neither the other nor ``dout``.

    Parameters
    ----------
    dout : array, shape (B, L, D)
        The gradient of the forward's ``out``, of its shape and dtype.
    cache : PositionsCache

    Returns
    -------
    dx : array, shape (B, L, D)
        A copy of ``dout``.
    dpos : array, shape (L, D)
    """
    # [B, L, D] -> [B, L, D], [L, D]
    Vd.check_cache("cache", cache, PositionsCache, "add_positions_forward")
    like = cache.like
    if like is not None:
        Vd.check_grad("dout", dout, shape=like.shape, dtype=like.dtype, xp=like.xp,
                      device=like.device, of="the forward's out")
    xp = namespace(dout)
    dpos = sum_to_shape(xp, dout, cache.pos_shape)  # dout itself when x is (L, D)
    if dpos is dout:
        dpos = xp.asarray(dout, copy=True)
    return xp.asarray(dout, copy=True), dpos


def sinusoidal_positions(xp: Any, L: int, D: int, dtype: Any = None, device: Any = None) -> Any:
    """The fixed encoding of "Attention Is All You Need".

    ``pe[i, 2k] = sin(i / 10000^(2k/D))``, ``pe[i, 2k+1] = cos(i / 10000^(2k/D))``.
    ``xp`` a backend (a name or a namespace, as ``backend=``), ``L`` an int >= 0,
    ``D`` an int >= 1; computed in float64 (on the host where the backend has
    no float64, as JAX without x64), returned in ``dtype`` (a floating dtype of
    ``xp`` or its name, as the constructors' ``dtype=``; default float64, or
    float32 where the backend has no float64), on ``device``. # -> [L, D]

    Parameters
    ----------
    xp : str or namespace
        The backend, as ``backend=``.
    L : int >= 0
        Number of positions.
    D : int > 0
        Width of the encoding.
    dtype : floating dtype of ``xp``, or its name, optional
        Default float64, or float32 where the backend has no float64.
    device : optional
        A device of ``xp``; None: its default.

    Returns
    -------
    pe : array, shape (L, D)
    """
    xp = resolve_backend(xp, "xp")
    L, D = Vd.check_size("L", L), Vd.check_positive_int("D", D)
    Vd.check_device(xp, device)
    if dtype is not None:  # an integer dtype would truncate the sines to 0 and 1
        dtype = getattr(xp, Vd.float_dtype_name(xp, dtype))
    fx = float64_namespace(xp)  # xp, or NumPy on the host
    Vd.check_array_bytes(["L", "D"], (L, D), 8, "the float64 encoding")  # (the largest array made)
    dev = device if fx is xp else None
    i = fx.astype(fx.arange(L, device=dev), fx.float64)  # [L]
    k = fx.astype(fx.arange(D, device=dev) // 2, fx.float64)  # [D]
    rate = fx.exp(k * (-2.0 * math.log(10000.0) / D))  # [D]
    angle = fx.expand_dims(i, axis=1) * rate  # [L, D]
    even = (fx.arange(D, device=dev) % 2) == 0  # [D]
    return float64_result(fx.where(even, fx.sin(angle), fx.cos(angle)), xp, dtype, device)  # [L, D]


# --------------------------------------------------------------------------
# softmax cross-entropy: the mean over the positions that count, their sum, or each one


class CrossEntropyCache(NamedTuple):
    """What ``cross_entropy_backward`` needs from ``cross_entropy_forward``."""
    p: Any  #: [..., V] softmax of the logits, in the compute dtype
    onehot: Any  #: [..., V] one-hot targets (rows of zeros where ignored), in the compute dtype
    #: what the losses are divided by, for "mean": N, the positions that count (with ``weight``,
    #: the sum of their targets' weights); else 1
    n: float
    dtype: Any = None  #: the logits' dtype (that of the loss and of dlogits); None: p's
    counted: Any = None  #: [..., 1] 1 where the target counts, 0 where ignored; None: all count
    smoothing: float = 0.0  #: label_smoothing, epsilon
    reduction: str = "mean"  #: "mean", "sum" or "none"
    weight: Any = None  #: [V] the classes' weights in the compute dtype; None: all 1


#: What ``cross_entropy_forward``'s ``reduction`` may be (torch's).
REDUCTIONS = ("mean", "sum", "none")


def check_ignore_index(ignore_index: Any) -> Optional[int]:
    """``ignore_index`` as None or a Python int: ``TypeError`` unless it is None or an int
    (not a bool)."""
    if ignore_index is not None and (isinstance(ignore_index, bool)
                                     or not isinstance(ignore_index, numbers.Integral)):
        raise TypeError(f"ignore_index: expected None or an int, got {Vd.type_name(ignore_index)} "
                        f"{ignore_index!r}")
    return None if ignore_index is None else int(ignore_index)


def check_label_smoothing(label_smoothing: Any) -> float:
    """``label_smoothing`` as a Python float: ``TypeError`` unless a real number (not a bool),
    ``ValueError`` unless in [0, 1] (torch's range)."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing: expected a real number in [0, 1], got "
                        f"{Vd.described(label_smoothing)}")
    eps = Vd.real_value(label_smoothing)
    if not 0.0 <= eps <= 1.0:  # (False for NaN)
        raise ValueError(f"label_smoothing: expected a real number in [0, 1], got "
                         f"{Vd.real_text(label_smoothing)}")
    return eps


def check_class_weight(weight: Any, V: int, xp: Any, device: Any, dtype: Any, like: str = "") -> None:
    """``weight``, the classes' weights of ``cross_entropy_forward``: a finite floating array of
    shape (V,), of ``xp`` on ``device`` with dtype ``dtype`` (those of ``like``, the logits, when
    named; else the parameters'): a ``TypeError`` / ``ValueError`` naming ``weight`` otherwise."""
    Vd.check_floating_array("weight", weight, xp, device, dtype=dtype, like=like)
    if Vd.shape_of(weight) != (V,):
        raise ValueError(f"weight: expected shape ({V},) (one weight per class), got "
                         f"{Vd.shape_of(weight)}")
    Vd.check_finite_values("weight", weight, xp)


def count_targets(xp: Any, targets: Any, ignore: Optional[int]) -> int:
    """How many of ``targets`` count (all, or those other than ``ignore``): the ``N`` of the
    mean; a ``ValueError`` for none (a mean over no positions is 0 / 0, torch's NaN).

    Parameters
    ----------
    xp : namespace
        That of ``targets``.
    targets : integer array, shape (...)
    ignore : int or None
        The ``ignore_index``; None: every target counts (their values are not read).

    Returns
    -------
    n : int
        A Python int.

    Raises
    ------
    ValueError
        When no target counts.
    """
    shape = Vd.shape_of(targets)
    if ignore is None:
        if math.prod(shape) == 0:
            raise ValueError(f"targets: expected at least one target, got none (shape {shape})")
        return math.prod(shape)
    # (counted as integers: a float32 sum of ones stops growing at 2**24)
    n = int(xp.sum(xp.astype(targets != ignore, xp.int64)))
    if n == 0:
        got = f"only {ignore}s" if math.prod(shape) else f"none (shape {shape})"
        raise ValueError(f"targets: expected at least one target other than ignore_index = "
                         f"{ignore}, got {got}")
    return n


def cross_entropy_forward(logits: Any, targets: Any, *, weight: Any = None,
                          ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                          reduction: str = "mean") -> tuple[Any, CrossEntropyCache]:
    """Softmax cross-entropy, by default the mean ``loss = -mean_n log softmax(logits_n)[t_n]``.

    Steps, per position ``n`` (``y`` the target distribution, ``one_hot(t)`` by default):

    1. ``m = max(logits)``                  (a shift for stability; cancels)
    2. ``lse = m + log(sum(exp(logits - m)))``   log-sum-exp, [..., 1]
    3. ``logp = logits - lse``               log-probabilities, [..., V]
    4. ``l_n = -sum_c y_c logp_c``           the position's loss, [...]
       ``= (1 - eps) w_t (-logp_t) + (eps / V) sum_c w_c (-logp_c)``  (the target's entry
       picked by a ``where``: a ``-inf`` logit elsewhere in the row would make ``0 * -inf``)
    5. ``loss = sum_n l_n / N``               (``reduction``: "mean"; "sum": ``sum_n l_n``;
       "none": ``l_n`` itself, shape (...))

    With ``label_smoothing = eps`` the target distribution is
    ``y = (1 - eps) one_hot(t) + eps / V``, as torch's ``cross_entropy(label_smoothing=)``;
    a ``-inf`` logit then gives an infinite loss (``y`` puts mass on it) and finite
    gradients. With ``ignore_index``, a position whose target equals it (padding, say) is
    left out: its ``y`` row is zero, ``N`` counts the other positions, and its logits get
    zero gradient, as torch's ``cross_entropy(..., ignore_index=)``. torch's default is -100;
    here it is None, every target counts, and a -100 is an out-of-range target.
    With ``weight`` (class weights ``w``, torch's ``weight=``), class ``c``'s entry of ``y`` is
    scaled by ``w_c``, and the mean divides by ``N = sum_n w_{t_n}`` over the positions that
    count; without it every ``w_c`` is 1. ``weight`` is a constant: it gets no gradient.
    A class of weight 0 adds nothing, also where its logit is ``-inf`` (not ``0 * inf``).

    Half-precision logits are computed in float32 (float16 ends at 65504: its sum of
    ``exp`` over 65520 equal logits is inf), and the loss is rounded to their dtype.
    Sizes for which that float32 copy, or the classes ``0, ..., V - 1`` the targets are
    compared with, could not exist at all (more bytes than the largest array) are a
    ``ValueError`` naming ``logits``, before the targets are read.

    Parameters
    ----------
    logits : array, shape (..., V); for "mean", at least one position (a ``ValueError`` for
        none, where torch's mean gives NaN)
    targets : integer array, shape (...), values in [0, V) or ``ignore_index``; for "mean", at
        least one of them not ignored (a ``ValueError`` for none, where torch gives NaN)
    weight : array, shape (V,), optional
        Finite weights of the classes, of the logits' library, device and dtype; for "mean",
        the weights of the targets that count may not sum to 0 (torch: NaN).
    ignore_index : int, optional
        The target value of positions to leave out; it may lie in [0, V) (a padding
        token's id) or outside it (torch's -100).
    label_smoothing : float in [0, 1], default 0
    reduction : "mean" (default), "sum" or "none"

    Returns
    -------
    loss : array, shape () ("mean", "sum") or (...) ("none": 0 where ignored)
    cache : CrossEntropyCache
    """
    # [..., V], [...] -> [] or [...]
    Vd.check_floating_array("logits", logits)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape (..., V) with V >= 1, got {Vd.shape_of(logits)}")
    Vd.check_choice("reduction", reduction, REDUCTIONS)
    eps = check_label_smoothing(label_smoothing)
    mean = reduction == "mean"
    if mean and math.prod(Vd.shape_of(logits)[:-1]) == 0:  # a mean over none is 0 / 0 (torch: NaN)
        raise ValueError(f"logits: expected at least one position (leading axes of nonzero "
                         f"length) for reduction 'mean', got shape {Vd.shape_of(logits)}")
    xp = namespace(logits)
    # the arrays made below whose size the logits' own does not vouch for, refused before the
    # targets are read when they cannot exist: the classes 0, ..., V - 1 of the one-hot rows,
    # and for half-precision logits their float32 copy (and the float32 one-hot rows, as large)
    Vd.check_array_bytes(["logits"], (Vd.shape_of(logits)[-1],), entry_bytes(xp, widest_int(xp)),
                         "the classes 0, ..., V - 1")
    ct = compute_dtype(xp, logits.dtype)
    if ct != logits.dtype:
        Vd.check_array_bytes(["logits"], Vd.shape_of(logits), entry_bytes(xp, ct),
                             "the float32 copy of the logits")
    ignore = check_ignore_index(ignore_index)
    Vd.check_ids("targets", targets, logits.shape[-1], xp, device_of(logits), what="class indices",
                 like="logits", ignore=ignore)
    if Vd.shape_of(targets) != Vd.shape_of(logits)[:-1]:
        raise ValueError(f"targets: expected shape {Vd.shape_of(logits)[:-1]} (that of logits "
                         f"without its last axis), got {Vd.shape_of(targets)}")
    V = logits.shape[-1]
    if weight is not None:
        check_class_weight(weight, V, xp, device_of(logits), logits.dtype, like="logits")
    n: float = count_targets(xp, targets, ignore) if mean else 1  # N for the mean
    counted = None if ignore is None else xp.astype(targets != ignore, ct)  # [...] 1 = counts
    w = None if weight is None else xp.astype(weight, ct)  # [V] in the compute dtype
    onehot = _one_hot(xp, targets, V, ct)  # [..., V]
    if counted is not None:
        counted = xp.expand_dims(counted, axis=-1)  # [..., 1]
        onehot = onehot * counted  # an ignored position's row: zeros (its target may be in range)
    if w is not None and mean:  # N = sum_n w_{t_n} over the targets that count
        n = float(xp.sum(onehot * w))  # (an ignored row of onehot is 0)
        if n == 0.0:
            raise ValueError("weight: expected the weights of the targets that count to have a "
                             "nonzero sum (the mean divides by it), got 0")
    z = logits if ct == logits.dtype else xp.astype(logits, ct)  # [..., V] in the compute dtype
    m = row_max(xp, z)  # 1. max over the classes                     [..., 1]
    lse = m + xp.log(xp.sum(xp.exp(z - m), axis=-1, keepdims=True))  # 2. [..., 1]
    logp = z - lse  # 3.                                                [..., V]
    # 4. w_c logp_c, 0 where w_c = 0 (a -inf logit of such a class: 0, not 0 * inf = NaN)
    logp_w = logp if w is None else xp.where(w == 0.0, xp.zeros_like(logp), logp) * w  # [..., V]
    picked = xp.where(onehot == 1.0, logp_w, xp.zeros_like(logp))  # 4. w_t logp[t], 0 elsewhere
    nll = -xp.sum(picked, axis=-1)  # 4. -w_t logp[t]                   [...]
    if eps == 0.0:
        losses = nll  # [...]
    else:  # 4. + eps / V times the sum over every class; eps = 1: that term alone (0 * inf)
        smooth = -xp.sum(logp_w, axis=-1) * (eps / V)  # [...]
        losses = smooth if eps == 1.0 else (1.0 - eps) * nll + smooth
    if counted is not None:  # an ignored row's loss is +0, by a where: its smoothing sum may
        # be -inf, and its nll is -0.0 (the negated sum of zeros)
        losses = xp.where(counted[..., 0] == 1.0, losses, xp.zeros_like(losses))  # [...]
    if reduction == "none":
        loss = losses  # 5.                                             [...]
    else:
        loss = xp.sum(losses) / float(n)  # 5.                         []
    loss = xp.astype(xp.asarray(loss), logits.dtype)  # an array (NumPy reduces to a scalar)
    return loss, CrossEntropyCache(xp.exp(logp), onehot, n, logits.dtype, counted, eps, reduction, w)


def cross_entropy_backward(dloss: Any, cache: CrossEntropyCache) -> tuple[Any, None]:
    """Gradient of the cross-entropy: ``dlogits = dloss * (s softmax(logits) - y) / N``.

    From 5. and 4.: ``dlogp = -dloss * y / N`` (``dloss_n`` of each position for "none",
    ``N = 1`` unless "mean"), and through ``logp = logits - lse`` with
    ``d lse / d logits = softmax``:
    ``dlogits = dlogp - softmax * sum(dlogp) = dloss * (s p - y) / N``, ``s = sum_c y_c``:
    1 where the position counts (each row of ``y`` sums to 1, smoothed or not) without
    ``weight``, and 0 where it is ignored (its ``y`` row is zero, so its ``dlogp`` is and
    its ``sum(dlogp)``: ``dlogits = 0`` there), which the ``counted`` factor on ``p`` says;
    with ``weight``, ``s_n = (1 - eps) w_{t_n} + (eps / V) sum_c w_c``. ``targets`` get None.

    ``dloss`` is a finite Python number, or an array of the loss's shape and dtype (shape
    () or (1,) for "mean" and "sum"). Computed in the forward's compute dtype, returned
    in the logits' dtype.

    Parameters
    ----------
    dloss : number or array
        The gradient of the loss: an array of shape () or (1,) ("mean", "sum") or (...)
        ("none"), in the loss's dtype; or a finite Python number (for "none", that of every
        position).
    cache : CrossEntropyCache

    Returns
    -------
    dlogits : array, shape (..., V)
    dtargets : None
    """
    # [] or [...] -> [..., V], None
    Vd.check_cache("cache", cache, CrossEntropyCache, "cross_entropy_forward")
    xp = namespace(cache.p)
    dtype = cache.p.dtype if cache.dtype is None else cache.dtype  # the loss's
    per_position = cache.reduction == "none"
    if isinstance(dloss, bool) or not isinstance(dloss, (int, float)):  # a number, or the loss's like
        Vd.check_array("dloss", dloss)
        if per_position:
            shape = Vd.shape_of(cache.p)[:-1]
        else:
            shape = Vd.shape_of(dloss) if Vd.shape_of(dloss) == (1,) else ()  # (1,): gradcheck's
        Vd.check_grad("dloss", dloss, shape=shape, dtype=dtype, xp=xp,
                      device=device_of(cache.p), of="the loss")
        dloss = xp.astype(dloss, cache.p.dtype)
        if per_position:
            dloss = xp.expand_dims(dloss, axis=-1)  # [..., 1]
    else:  # a Python float (a NumPy float64, a float subclass, would upcast float32 logits)
        if not math.isfinite(Vd.real_value(dloss)):  # (10**400 has no float: OverflowError)
            raise ValueError(f"dloss: expected a finite number, got {Vd.real_text(dloss)}")
        dloss = float(dloss)
    y = cache.onehot  # [..., V] the target distribution
    if cache.smoothing:
        V = Vd.shape_of(cache.p)[-1]
        rows = 1.0 if cache.counted is None else cache.counted  # [..., 1]
        y = (1.0 - cache.smoothing) * y + (cache.smoothing / V) * rows
    if cache.weight is None:  # s = 1 where the position counts, 0 where ignored
        p = cache.p if cache.counted is None else cache.p * cache.counted  # [..., V]
    else:  # y_c scaled by w_c; s = sum_c y_c
        y = y * cache.weight  # [..., V]
        p = cache.p * xp.sum(y, axis=-1, keepdims=True)  # [..., V]
    dlogits = dloss * (p - y) / float(cache.n)  # [..., V]
    return (dlogits if dlogits.dtype == dtype else xp.astype(dlogits, dtype)), None


# --------------------------------------------------------------------------
# Adam (Kingma & Ba, 2015), as a pure update


class AdamState(NamedTuple):
    """Adam's state between steps: ``adam_init`` makes it, ``adam_step`` returns the next one."""
    m: dict  #: first-moment estimates, keyed like the parameters
    v: dict  #: second-moment estimates
    t: int  #: number of steps taken
    #: updates each parameter has received, keyed like the parameters, once they differ from t
    #: (a parameter without a gradient in a step keeps its moments and its count, as in
    #: torch.optim.Adam); None: every parameter has received t
    steps: Optional[dict] = None


def adam_init(params: dict) -> AdamState:
    """Zero moments for every parameter in ``params`` (a dict of floating arrays).

    Parameters
    ----------
    params : dict of floating arrays
        Keyed by the parameters' names.

    Returns
    -------
    state : AdamState
        ``m`` and ``v``: zeros like each parameter (its shape, library, device and dtype),
        arrays of their own; ``t = 0``; ``steps`` None.
    """
    if not isinstance(params, dict):
        raise TypeError(f"params: expected a dict of arrays, got {Vd.type_name(params)}")
    for k, p in params.items():
        Vd.check_floating_array(f"params[{k!r}]", p)
    # two sets of arrays: a caller who writes into one moment in place leaves the other as it was
    m, v = ({k: namespace(p).zeros_like(p) for k, p in params.items()} for _ in range(2))
    return AdamState(m, v, 0)


def check_adam(params: Any, grads: Any, state: Any, *, lr: Any, betas: Any, eps: Any,
               weight_decay: Any) -> None:
    """The arguments of ``adam_step``: a ``TypeError`` / ``ValueError`` naming the argument.

    ``params`` and ``grads`` dicts of arrays, every gradient's name a parameter's, an array of
    its library, device, dtype and shape (or None); ``state`` an ``AdamState`` whose moments have the parameters' names and
    shapes, each an array of its parameter's library, device and dtype (nothing is promoted),
    and whose ``t`` is an int >= 0; ``lr``, ``eps`` and ``weight_decay`` finite and >= 0 (as
    torch.optim.Adam's), ``betas`` two numbers in [0, 1).
    """
    for name, d in (("params", params), ("grads", grads)):
        if not isinstance(d, dict):
            raise TypeError(f"{name}: expected a dict of arrays, got {Vd.type_name(d)}")
    for name, p in params.items():  # floating, as adam_init's: an int one came back float64
        Vd.check_floating_array(f"params[{name!r}]", p)
    unknown = sorted(set(grads) - set(params), key=str)
    if unknown:
        raise ValueError(f"grads: expected names of params {sorted(params, key=str)}, got {unknown} too")
    for name, g in grads.items():
        if g is None:
            continue
        p = params[name]
        if type(g) is not type(p) or getattr(g, "dtype", None) != p.dtype or device_of(g) != device_of(p):
            # (else as p: the fast path) an array of p's library, device and dtype: a float64
            # gradient would promote a float32 parameter and its moments
            Vd.check_grad(f"grads[{name!r}]", g, shape=Vd.shape_of(p), dtype=p.dtype,
                          xp=namespace(p), device=device_of(p), of=f"params[{name!r}]")
        if Vd.shape_of(g) != Vd.shape_of(p):
            raise ValueError(f"grads[{name!r}]: expected shape {Vd.shape_of(p)} (that of "
                             f"params[{name!r}]), got {Vd.shape_of(g)}")
    if not isinstance(state, AdamState):
        raise TypeError(f"state: expected an npattn.nn.AdamState (nn.adam_init(params)), got "
                        f"{Vd.type_name(state)}")
    for moments in (state.m, state.v):
        if not isinstance(moments, dict) or set(moments) != set(params):
            raise ValueError("state: expected the Adam moments of these parameters "
                             "(nn.adam_init(params)), got moments of other names")
    for label, moments in (("state.m", state.m), ("state.v", state.v)):
        for k, p in params.items():
            mk = moments[k]
            if (type(mk) is not type(p) or getattr(mk, "dtype", None) != p.dtype  # else as p: fast
                    or Vd.shape_of(mk) != Vd.shape_of(p) or device_of(mk) != device_of(p)):
                Vd.check_grad(f"{label}[{k!r}]", mk, shape=Vd.shape_of(p), dtype=p.dtype,
                              xp=namespace(p), device=device_of(p), of=f"params[{k!r}]")
    Vd.check_size("state.t", state.t)  # the steps taken
    if state.steps is not None:
        if not isinstance(state.steps, dict) or set(state.steps) != set(params):
            raise ValueError("state.steps: expected None or a dict of the updates of each of these "
                             "parameters, got " + (f"names {sorted(state.steps, key=str)}"
                                                   if isinstance(state.steps, dict)
                                                   else Vd.type_name(state.steps)))
        for k, n in state.steps.items():
            Vd.check_size(f"state.steps[{k!r}]", n)
    Vd.check_number("lr", lr, allow_zero=True)  # >= 0, as torch.optim.Adam's
    Vd.check_number("eps", eps, allow_zero=True)
    Vd.check_number("weight_decay", weight_decay, allow_zero=True)
    if not isinstance(betas, (tuple, list)):
        raise TypeError(f"betas: expected a tuple (or list) of two numbers in [0, 1), got "
                        f"{Vd.described(betas)}")
    if len(betas) != 2:
        raise ValueError(f"betas: expected two numbers in [0, 1), got a {type(betas).__name__} of "
                         f"{len(betas)}: {betas!r}")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, numbers.Real):  # (np.bool_ is no Real)
            raise TypeError(f"betas[{i}]: expected a real number in [0, 1), got {Vd.described(b)}")
        if not 0.0 <= Vd.real_value(b) < 1.0:  # (10**400: no float, out of range too)
            raise ValueError(f"betas[{i}]: expected a number in [0, 1), got {Vd.real_text(b)}")


def adam_step(params: dict, grads: dict, state: AdamState, *, lr: float = 1e-3,
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = 0.0) -> tuple[dict, AdamState]:
    """One Adam step; returns ``(new_params, new_state)`` and writes into nothing.

    For each parameter ``w`` with gradient ``g``, at its step ``t`` (the updates it has
    received, this one included: ``state.t + 1`` while every step gave every parameter a
    gradient), with ``(b1, b2) = betas``::

        g = g + weight_decay * w                (L2 penalty, off by default)
        m = b1 m + (1 - b1) g
        v = b2 v + (1 - b2) g^2
        w = w - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    Parameters missing from ``grads`` (or given None) are left unchanged, and so are their
    moments and their count of updates (``state.steps``), as in ``torch.optim.Adam``.
    The arguments are checked first (``check_adam``).

    The update is computed in the parameters' dtype, as ``torch.optim.Adam`` does. In
    float16 the default ``eps=1e-8`` rounds to 0, so an entry whose gradient and second
    moment are 0 (or underflow) gets ``0 / 0 = NaN``, in torch as here: pass an ``eps``
    float16 can hold (1e-4, say) or keep float32 parameters.

    On dask the updated parameters and moments are computed by this call and kept computed
    (``dask.persist``, in one graph): the next step's graph starts from them, where it would
    hold every earlier step and compute them all again at each step that reads a number.
    """
    check_adam(params, grads, state, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    b1, b2 = float(betas[0]), float(betas[1])
    # the counts as Python ints (checked): a NumPy one would wrap in + 1 (np.uint8(255) + 1 is
    # 0, and 1 - b1**0 = 0 divides the step)
    t = int(state.t) + 1
    before = ({k: int(n) for k, n in state.steps.items()} if state.steps is not None
              else dict.fromkeys(params, int(state.t)))
    steps = dict(before)
    new_p, new_m, new_v = dict(params), dict(state.m), dict(state.v)
    lr, eps, weight_decay = float(lr), float(eps), float(weight_decay)
    for name, g in grads.items():
        if g is None:
            continue
        steps[name] = tk = before[name] + 1  # this parameter's step
        update = functools.partial(_adam_update, b1=b1, b2=b2, c1=1.0 - b1**tk, c2=1.0 - b2**tk, lr=lr,
                                   eps=eps, weight_decay=weight_decay)
        # (on dask one task per chunk for the whole update, backend.elementwise)
        new_p[name], new_m[name], new_v[name] = elementwise(update, params[name], g, state.m[name],
                                                            state.v[name])
    # dask: the step computed now, in one persist (one per array would run the backward again
    # for each); the arrays of another library come back as they are
    updated = [name for name, g in grads.items() if g is not None]
    done = iter(persisted(*(d[name] for d in (new_p, new_m, new_v) for name in updated)))
    for d in (new_p, new_m, new_v):
        d.update((name, next(done)) for name in updated)
    same = all(n == t for n in steps.values())
    return new_p, AdamState(new_m, new_v, t, None if same else steps)


def _adam_update(w: Any, g: Any, m: Any, v: Any, *, b1: float, b2: float, c1: float, c2: float,
                 lr: float, eps: float, weight_decay: float) -> tuple[Any, Any, Any]:
    """One parameter's Adam update (``adam_step``'s formulas, ``c1 = 1 - b1^t``, ``c2 = 1 - b2^t``):
    its new ``(w, m, v)``."""
    if weight_decay:
        g = g + weight_decay * w
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * (g * g)
    w = w - lr * (m / c1) / (namespace(g).sqrt(v / c2) + eps)
    return zero_d(w), zero_d(m), zero_d(v)  # (a 0-d parameter's: 0-d arrays)


# --------------------------------------------------------------------------
# gradient clipping by the global norm


def clip_grad_norm(grads: dict, max_norm: float, *, eps: float = 1e-6) -> tuple[dict, float]:
    """Scale every gradient by one factor so that their joint 2-norm is at most ``max_norm``.

    ``total = sqrt(sum_k sum(g_k^2))`` over all entries of ``grads``; with
    ``c = max_norm / (total + eps)``, each gradient becomes ``g * min(c, 1)``
    (as ``torch.nn.utils.clip_grad_norm_``, same ``eps``). Returns
    ``(new_grads, total)``: a new dict (the arrays given are not written)
    and the norm before clipping as a Python float. ``None`` entries are
    kept as they are. Half-precision gradients are squared and summed in float32 (as
    torch does; 300 squared overflows float16), then scaled in their own dtype. On dask the
    gradients are computed first, in one graph, and kept computed (``dask.persist``): the
    norm and ``new_grads`` are taken from those, where each of the norm's sums would
    compute the gradients' graph again; the sums are then computed together, in one more.

    Where a square or a sum of squares overflows though every entry is finite (float32
    entries past 1.8e19, float64 ones past 1.3e154), ``total`` is still the norm whenever a
    Python float holds it: the sum is taken again with each array divided by its largest
    ``|g|`` first, ``total = hypot_k(amax_k * sqrt(sum((g_k / amax_k)^2)))``, and the
    gradients are scaled by ``c`` as above, without a warning (NumPy's of the first sum's
    overflow would be a false alarm). torch's total is inf there, which scales every
    gradient to 0. Non-finite entries give torch's result: an infinite one (and no NaN)
    makes ``total`` inf and ``c = 0``, so the finite entries become 0 and the infinite
    ones NaN (``inf * 0``); a NaN entry makes ``total`` and every gradient NaN.

    ``max_norm`` must be > 0: torch takes 0 and sets every gradient to 0, which
    no training wants, so it is refused by name. With ``eps=0`` and gradients
    that are all 0 (or none), ``c = max_norm / 0`` is inf, as in torch's
    tensor arithmetic: nothing is scaled.

    Parameters
    ----------
    grads : dict of floating arrays or None
    max_norm : float > 0
        Finite.
    eps : float >= 0
        Added to ``total`` in ``c``; default 1e-6.

    Returns
    -------
    new_grads : dict
        Keyed like ``grads``: each gradient times ``min(c, 1)`` (where that is 1, the array
        as given; on dask, computed), None entries kept.
    total : float
        The norm before clipping.
    """
    _check_grads(grads)
    Vd.check_number("max_norm", max_norm)
    Vd.check_number("eps", eps, allow_zero=True)
    grads = _computed(grads)
    total = _global_norm(grads)
    denom = total + float(eps)
    scale = 1.0 if denom == 0.0 else min(float(max_norm) / denom, 1.0)  # (Python's x / 0.0 raises)
    if scale == 1.0:
        return dict(grads), total
    return {k: (None if g is None else zero_d(g * scale)) for k, g in grads.items()}, total


def global_norm(grads: dict) -> float:
    """The joint 2-norm of ``grads`` (a dict of arrays; ``None`` entries are skipped), a Python
    float: ``clip_grad_norm``'s ``total``, as its docstring says (the true norm where the
    squares overflow, inf or NaN for an infinite or NaN entry), without clipping.

    Parameters
    ----------
    grads : dict of floating arrays or None

    Returns
    -------
    total : float
    """
    _check_grads(grads)
    return _global_norm(_computed(grads))


def _computed(grads: dict) -> dict:
    """``grads`` with its dask arrays computed now, in one graph, and kept computed
    (``backend.persisted``); the others as they are. The norm reads one sum per array as a
    Python float: on lazy dask arrays each of those would compute the whole backward again."""
    return dict(zip(grads, persisted(*grads.values())))


def _check_grads(grads: Any) -> None:
    """``grads``: a dict of floating arrays or None, a ``TypeError`` naming the entry otherwise."""
    if not isinstance(grads, dict):
        raise TypeError(f"grads: expected a dict of arrays, got {Vd.type_name(grads)}")
    for k, g in grads.items():
        if g is not None:
            Vd.check_floating_array(f"grads[{k!r}]", g)


def _global_norm(grads: dict) -> float:
    """``global_norm`` of checked ``grads``: ``sqrt(sum_k sum(g_k^2))``, taken again by
    ``_scaled_norm`` where that sum overflows."""
    sums = []
    for g in grads.values():
        if g is not None:
            xp = namespace(g)
            ct = compute_dtype(xp, g.dtype)
            g = g if ct == g.dtype else xp.astype(g, ct)
            with overflow_unreported():  # an overflow is an inf, found below: no false alarm
                sums.append(xp.sum(g * g))  # []
    sq = 0.0
    with overflow_unreported():  # dask: every sum in one graph (one read each runs its own)
        for s in computed(*sums):
            sq += float(s)
    if math.isinf(sq):  # a square or a sum overflowed, or an entry is infinite
        return _scaled_norm(grads)
    return math.sqrt(sq)


def _scaled_norm(grads: dict) -> float:
    """The joint 2-norm of ``grads`` (no NaN entry) with each array divided by its largest
    ``|g|`` before it is squared, so that no square overflows: ``math.hypot`` of each array's
    ``amax * sqrt(sum((g / amax)^2))``. inf when an entry is infinite, or the norm is past
    float64's range."""
    norms = []
    for g in grads.values():
        if g is None or math.prod(Vd.shape_of(g)) == 0:
            continue
        xp = namespace(g)
        ct = compute_dtype(xp, g.dtype)
        g = g if ct == g.dtype else xp.astype(g, ct)
        amax = float(xp.max(xp.abs(without_empty_chunks(g))))  # (dask's max fails on empty chunks)
        if math.isinf(amax):
            return math.inf
        if amax > 0.0:
            gs = g / amax  # [...] entries in [-1, 1]
            norms.append(amax * math.sqrt(float(xp.sum(gs * gs))))
    return math.hypot(*norms)
