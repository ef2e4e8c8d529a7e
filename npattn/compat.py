"""Drop-in entry points with the signatures of flash-attn, torch's SDPA and JAX's attention.

A kernel's test that calls ``flash_attn.flash_attn_func`` (or
``flash_attn_varlen_func``, ``flash_attn_with_kvcache``, the packed forms
``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``,
``flash_attn_varlen_qkvpacked_func``, ``flash_attn_varlen_kvpacked_func``,
``torch.nn.functional.scaled_dot_product_attention``,
``jax.nn.dot_product_attention``) swaps one import and gets npattn's numbers:
the same positional order, defaults, tensor layout and return values, on any
Array API backend (a torch tensor in, a torch tensor out). Each function
validates its arguments in its own layout and calls
``npattn.attention.sdpa_forward`` on the (B, H, L, D) layout; a packed form
checks its packed array in its own layout, takes q, k and v out of it by
indexing (views in NumPy and torch: no copy) and calls the unpacked
function's forward.

``vjp(fn, *args, **kwargs)`` runs one of them and returns ``(result, pullback)``;
``pullback(dout)`` gives the gradients of the positional arguments by
``npattn.attention.sdpa_backward``, the hand-derived backward (flash-attn's
``flash_attn_with_kvcache`` has none; here it has one).

Where npattn's conventions and the original's differ, the function converts
or says so in its docstring (``docs/compat.md`` lists every difference):

* ``softmax_lse`` of the flash functions holds ``+inf`` for a row with
  nothing to attend, as flash-attn writes (npattn's ``cache.lse`` holds ``-inf``);
* ``S_dmask`` holds the exact probabilities before dropout, negated where dropped;
* a dropout keep-mask (``dropout_mask=``, True = keep) can replay a kernel's
  own dropout pattern; ``rng=`` seeds npattn's draw otherwise.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Lq/Lk query/key
lengths, Dh key width, Dv value width; total_q/total_k packed tokens
(varlen); Lc cache length, Lnew appended tokens (kvcache); the 3 of qkv and
the 2 of kv are the packed axis (q, k, v; k, v), and D = Dh = Dv. JAX names
them T = Lq, S = Lk, N = Hq, K = Hkv, H = Dh.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any, Callable, Optional

import array_api_compat
import numpy as np

from . import attention as A
from . import functional as F
from . import validation as V
from .backend import (copy_array, device_of, generator_kept_on_failure, isdtype, make_rng,
                      may_share_memory, namespace, scalar, shares_memory)

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "scaled_dot_product_attention",
    "dot_product_attention",
    "vjp",
]

#: grads_of(dout, dlse) -> {parameter name: gradient}: what each private forward returns
#: next to its result, for ``vjp``
GradsOf = Callable[[Any, Any], dict]


# --------------------------------------------------------------------------
# small pieces: layouts, argument checks, flash-attn's conventions


def _swap_lh(xp: Any, x: Any) -> Any:
    """[B, L, H, D] <-> [B, H, L, D]: the flash/JAX layout and npattn's (its own inverse)."""
    return xp.permute_dims(x, (0, 2, 1, 3))


def _zeros(xp: Any, shape: tuple, like: Any, dtype: Any = None) -> Any:
    """Zeros of ``shape`` in the dtype (or ``dtype``) and on the device of ``like``."""
    return xp.zeros(shape, dtype=like.dtype if dtype is None else dtype, device=device_of(like))


def _check_rank(name: str, x: Any, ndim: int, layout: str) -> None:
    """``TypeError`` unless ``x`` is an array (``validation.check_array``), ``ValueError`` unless it
    has ``ndim`` axes."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name}: expected an array of shape {layout}, got {V.type_name(x)}")
    V.check_array(name, x)  # a masked array, a matrix, another byte order: refused here, before
    # anything runs (flash_attn_with_kvcache writes into its caches next)
    if len(x.shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} axes {layout}, got shape {V.shape_of(x)}")


def _check_axis(name: str, x: Any, axis: int, size: int, what: str) -> None:
    """``ValueError`` unless axis ``axis`` of ``x`` has ``size`` entries (``what`` says whose)."""
    if int(x.shape[axis]) != int(size):
        raise ValueError(f"{name}: expected {what} = {size} on axis {axis}, got shape {V.shape_of(x)}")


def _check_sizes(name: str, x: Any, axes: tuple) -> None:
    """``ValueError`` unless each ``(axis, what)`` of ``axes`` has at least one entry, named in
    the function's own layout."""
    for axis, what in axes:
        if int(x.shape[axis]) < 1:
            raise ValueError(f"{name}: expected a {what} (axis {axis}) of at least 1, got shape "
                             f"{V.shape_of(x)}")


def _check_call(xp: Any, q: Any, k: Any, v: Any, *, batch: int, alibi_slopes: Any,
                **options: Any) -> None:
    """The dispatcher's checks of a call (``attention.check_forward``) on one-token
    stand-ins of q, k and v (their dtypes, device and heads), with ``softmax_scale`` named as
    the caller knows it: a call is refused before anything is written or computed, also when
    no sequence has both queries and keys."""
    V.check_scale("softmax_scale", options.get("scale"))
    (Hq, Dh), (Hkv, Dv) = (int(n) for n in q.shape[-2:]), (int(n) for n in v.shape[-2:])
    one = (lambda t, H, D: xp.zeros((1, H, 1, D), dtype=t.dtype, device=device_of(t)))
    slopes = alibi_slopes
    if slopes is not None and hasattr(slopes, "shape"):
        if V.shape_of(slopes) not in ((Hq,), (batch, Hq)):
            raise ValueError(f"alibi_slopes: expected shape {(Hq,)} or {(batch, Hq)} (nheads of q, "
                             f"or batch and nheads), got {V.shape_of(slopes)}")
        if len(slopes.shape) == 2:
            slopes = slopes[0, ...]  # [Hq]: its dtype and library checked like the call's
    A.check_forward(one(q, Hq, Dh), one(k, Hkv, Dh), one(v, Hkv, Dv), alibi_slopes=slopes,
                    align="bottom_right", **options)


def _gqa(q: Any, kv: Any, *, name: str, axis: int, layout: str, q_axis: int,
         q_name: str = "q") -> bool:
    """Whether the K/V heads (axis ``axis`` of ``kv``) are fewer than the query heads (axis
    ``q_axis`` of ``q``): grouped-query attention. ``ValueError`` unless they divide them; the
    message names the axes it read in ``layout``, so that arrays passed in another layout
    ((B, H, L, D) to a (B, L, H, D) function) show which of their axes was taken for heads."""
    q_heads, kv_heads = int(q.shape[q_axis]), int(kv.shape[axis])
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(
            f"{name}: expected key/value heads (axis {axis} of {layout}) that divide the query "
            f"heads ({q_heads}, axis {q_axis} of {q_name}), got {kv_heads} in shape {V.shape_of(kv)}"
        )
    return q_heads != kv_heads


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _int_list(name: str, x: Any, what: str) -> list:
    """The entries of a 1-D integer array (or a list of ints) as Python ints."""
    if isinstance(x, (list, tuple)):
        if not all(_is_int(n) for n in x):
            raise TypeError(f"{name}: expected {what} as ints, got {x!r}")
        return [int(n) for n in x]
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name}: expected {what}, a 1-D integer array, got {V.type_name(x)}")
    V.check_array(name, x)  # no masked array (its mask would be ignored), matrix or foreign order
    if len(x.shape) != 1:
        raise ValueError(f"{name}: expected {what}, a 1-D integer array, got shape {V.shape_of(x)}")
    if not isdtype(namespace(x), x.dtype, "integral"):
        raise TypeError(f"{name}: expected an integer dtype ({what}), got {V.dtype_name(x.dtype)}")
    return [int(x[i]) for i in range(int(x.shape[0]))]


def _flash_window(window_size: Any, causal: Any) -> tuple[bool, Optional[tuple]]:
    """flash-attn's ``(causal, window_size)`` as npattn's ``(is_causal, window)``.

    A negative side is unbounded (None); ``causal`` sets the right side to 0,
    as flash-attn does; a window ``(None, 0)`` is ``is_causal`` itself.
    """
    V.check_bool("causal", causal)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(_is_int(w) for w in window_size)):
        raise TypeError(
            "window_size: expected a pair (left, right) of ints, -1 for an unbounded side, "
            f"got {V.described(window_size)}"
        )
    left, right = (None if int(w) < 0 else int(w) for w in window_size)
    if causal:
        right = 0
    if left is None and right == 0:
        return True, None
    return False, None if left is None and right is None else (left, right)


def _flash_softcap(softcap: Any) -> Optional[float]:
    """flash-attn's ``softcap`` (0.0 = off) as npattn's (None = off)."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a float, 0.0 for off, got {V.described(softcap)}")
    s = V.real_value(softcap)
    if not (math.isfinite(s) and s >= 0.0):
        raise ValueError(f"softcap: expected 0.0 (off) or a finite float > 0, got {V.real_text(softcap)}")
    return s if s > 0.0 else None


def _flash_lse(xp: Any, lse: Any) -> Any:
    """npattn's log-sum-exp in flash-attn's convention: ``+inf`` for a row with nothing to attend."""
    # [...] -> [...]
    return xp.where(lse == -math.inf, scalar(xp, math.inf, lse), lse)


def _s_dmask(xp: Any, cache: Any, dtype: Any) -> Any:
    """flash-attn's testing output ``S_dmask``: the probabilities before dropout, negated where dropped.

    ``abs(S_dmask)`` are the probabilities; ``xp.signbit(S_dmask)`` is the drop
    pattern exactly (``S_dmask >= 0``, flash-attn's own test, misreads a
    dropped entry of probability 0, whose ``-0.0`` compares as kept).
    """
    # cache of [B, H, Lq, Lk] -> [B, H, Lq, Lk]
    probs = A.weights(cache)  # [B, H, Lq, Lk] before dropout
    keep = A.dropout_keep_mask(cache)  # [B, H, Lq, Lk] bool, or None
    s = probs if keep is None else xp.where(keep, probs, -probs)
    return xp.astype(s, dtype)


def _trim_keep_mask(mask: Any, Lq: int, Lk: int) -> Any:
    """A keep-mask whose last two axes may be longer (flash-attn rounds ``S_dmask`` up to
    multiples of 128): its leading ``(Lq, Lk)`` block."""
    # [..., >= Lq, >= Lk] -> [..., Lq, Lk]
    if mask is None or not hasattr(mask, "shape") or len(mask.shape) < 2:
        return mask  # the core says what is wrong with it
    if int(mask.shape[-2]) > Lq:
        mask = mask[..., :Lq, :]
    if int(mask.shape[-1]) > Lk:
        mask = mask[..., :Lk]
    return mask


def _check_dout(dout: Any, out: Any) -> None:
    """``ValueError`` unless the upstream gradient has the shape of the output it belongs to."""
    if not (hasattr(dout, "shape") and hasattr(dout, "dtype")):
        raise TypeError(f"dout: expected an array of the output's shape {V.shape_of(out)}, "
                        f"got {V.type_name(dout)}")
    if V.shape_of(dout) != V.shape_of(out):
        raise ValueError(f"dout: expected the shape of the output (the first one returned), "
                         f"{V.shape_of(out)}, got {V.shape_of(dout)}")


def _check_dlse(dlse: Any, shape: tuple, *, returned: bool, fn: str, flag: str) -> None:
    """``dlse`` for a pullback: None, or an array of the shape of the log-sum-exp ``fn`` returned.

    Without ``flag`` the function returned no log-sum-exp, and a ``dlse`` would add the
    gradient of an output the caller never received: refused, as
    ``scaled_dot_product_attention``'s pullback refuses it.
    """
    if dlse is None:
        return
    if not returned:
        raise ValueError(f"dlse: {fn} returned no log-sum-exp (it returns one with {flag}); "
                         f"pass None, or call it with {flag}")
    if not hasattr(dlse, "shape"):
        raise TypeError(f"dlse: expected an array of the shape of the returned log-sum-exp, "
                        f"{tuple(shape)}, got {V.type_name(dlse)}")
    if V.shape_of(dlse) != tuple(shape):
        raise ValueError(f"dlse: expected the shape of the returned log-sum-exp, {tuple(shape)}, "
                         f"got {V.shape_of(dlse)}")


def _check_flash_bshd(q: Any, k: Any, v: Any) -> bool:
    """The shape checks of ``flash_attn_func``; whether K/V have fewer heads (GQA)."""
    layout = "(batch, seqlen, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, t, 4, layout)
    for name, t in (("q", q), ("k", k), ("v", v)):  # each on its own first, as the varlen
        # function does: k and v are checked against q's axes below
        _check_sizes(name, t, ((1, "seqlen"), (2, "nheads"), (3, "headdim")))
    B, _, Hq, Dh = q.shape
    _, Lk, Hkv, _ = k.shape
    _check_axis("k", k, 0, B, "the batch of q")
    _check_axis("k", k, 3, Dh, "the head width of q")
    for axis, size, what in ((0, B, "the batch of q"), (1, Lk, "the key length of k"),
                             (2, Hkv, "the heads of k")):
        _check_axis("v", v, axis, size, what)
    return _gqa(q, k, name="k", axis=2, layout=layout, q_axis=2)


# --------------------------------------------------------------------------
# flash-attn 2.x


def flash_attn_func(
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_mask: Any = None,
    rng: Any = None,
) -> Any:
    """flash-attn 2.x's ``flash_attn_func``, on npattn.

    Parameters
    ----------
    q : array, shape (B, Lq, Hq, Dh)
    k : array, shape (B, Lk, Hkv, Dh)
    v : array, shape (B, Lk, Hkv, Dv)
        ``Hkv`` divides ``Hq``: query head ``h`` uses K/V head ``h // (Hq // Hkv)``
        (multi- and grouped-query attention). ``Dv`` may differ from ``Dh``
        (flash-attn requires them equal).
    dropout_p : float
        Drop probability on the attention probabilities, scaled by ``1 / (1 - p)``.
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(Dh)``.
    causal : bool
        Bottom-right aligned: query ``i`` attends keys ``j <= i + Lk - Lq``; it
        sets the window's right side to 0.
    window_size : (left, right)
        Query ``i`` attends keys ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``;
        a side of -1 (any negative) is unbounded.
    softcap : float
        0.0 is off; ``> 0`` makes the scaled scores ``softcap * tanh(s / softcap)``.
        flash-attn refuses it with dropout; npattn computes both.
    alibi_slopes : array, shape (Hq,) or (B, Hq), optional
        Adds ``-slope * |i + Lk - Lq - j|`` to the scores after the softcap.
        A constant: ``vjp`` gives it no gradient (nor does flash-attn).
    deterministic : bool
        Accepted and ignored: npattn's backward is always deterministic.
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``S_dmask``.
    dropout_mask : bool array broadcastable to (B, Hq, Lq, Lk), optional
        npattn's extension: the keep-mask (True = keep) to apply in place of a
        drawn one, e.g. a kernel's own (``S_dmask >= 0``). Its last two axes
        may be longer (flash-attn's ``S_dmask`` is rounded up to multiples of
        128); the leading ``(Lq, Lk)`` block is used. Applied whenever given, also
        at ``dropout_p = 0`` (scale 1), where the kernels drop nothing.
    rng : int, numpy.random.SeedSequence, BitGenerator, Generator or None
        npattn's extension: draws the keep-mask when ``dropout_p > 0`` and no
        ``dropout_mask`` is given (None: fresh entropy, as a kernel's RNG).

    Returns
    -------
    out : array, shape (B, Lq, Hq, Dv)
    softmax_lse : array, shape (B, Hq, Lq) (``return_attn_probs`` only)
        Natural log-sum-exp of each row's final scores (softcap and ALiBi
        included), ``+inf`` for a row with nothing to attend, as flash-attn
        writes (npattn's own ``cache.lse`` holds ``-inf`` there). In the
        compute dtype: float32 for float16/bfloat16/float32 inputs (flash-attn's
        float32), float64 for float64.
    S_dmask : array, shape (B, Hq, Lq, Lk) (``return_attn_probs`` only)
        The exact attention probabilities before dropout, negated where
        dropout dropped them, in the dtype of ``q``: ``abs(S_dmask)`` are the
        probabilities, ``signbit(S_dmask)`` the drop pattern (flash-attn's
        ``S_dmask`` is unnormalised, rounded up to multiples of 128 and "for
        testing only"; its sign carries the same pattern). A row with nothing
        to attend is all zero; so is its output.

    Notes
    -----
    float16 and bfloat16 are computed in float32 and cast back, as in
    flash-attn's kernel.
    """
    # [B, Lq, Hq, Dh], [B, Lk, Hkv, Dh], [B, Lk, Hkv, Dv] -> [B, Lq, Hq, Dv]
    return _flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, deterministic, return_attn_probs,
                            dropout_mask=dropout_mask, rng=rng)[0]


def _keeps_callers_generator(forward: Callable) -> Callable:
    """``forward`` (a function below that takes ``rng=``) putting the caller's generator back in
    the state it found should the call fail: the draws of its dropout keys come before steps
    that can fail (forming ``S_dmask``, another sequence's attention: out of memory, an
    interrupt), and a failed call changes nothing."""
    @functools.wraps(forward)
    def kept(*args: Any, **kwargs: Any) -> Any:
        with generator_kept_on_failure(kwargs.get("rng")):  # rng is keyword-only everywhere
            return forward(*args, **kwargs)
    return kept


@_keeps_callers_generator
def _flash_attn_func(q: Any, k: Any, v: Any, dropout_p: float = 0.0,
                     softmax_scale: Optional[float] = None, causal: bool = False,
                     window_size: Any = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                     deterministic: bool = False, return_attn_probs: bool = False, *,
                     dropout_mask: Any = None, rng: Any = None,
                     caller: str = "flash_attn_func") -> tuple[Any, GradsOf]:
    """``flash_attn_func``'s result and its ``grads_of`` (for ``vjp``); ``caller`` is the public
    function the pullback's messages name (a packed form calls this one)."""
    # [B, Lq, Hq, Dh], [B, Lk, Hkv, Dh], [B, Lk, Hkv, Dv] -> [B, Lq, Hq, Dv]
    gqa = _check_flash_bshd(q, k, v)
    is_causal, window = _flash_window(window_size, causal)
    cap = _flash_softcap(softcap)
    V.check_bool("deterministic", deterministic)  # (npattn's backward is always deterministic)
    V.check_bool("return_attn_probs", return_attn_probs)
    V.check_scale("softmax_scale", softmax_scale)
    V.check_rng("rng", rng)
    xp = namespace(q, k, v, names=("q", "k", "v"))
    Lq, Lk = int(q.shape[1]), int(k.shape[1])
    out, cache = A.sdpa_forward(
        _swap_lh(xp, q), _swap_lh(xp, k), _swap_lh(xp, v), scale=softmax_scale,
        dropout_p=dropout_p, dropout_mask=_trim_keep_mask(dropout_mask, Lq, Lk), rng=rng,
        enable_gqa=gqa, align="bottom_right", is_causal=is_causal, window=window, softcap=cap,
        alibi_slopes=alibi_slopes, need_weights=bool(return_attn_probs),
    )  # [B, Hq, Lq, Dv]
    out = _swap_lh(xp, out)  # [B, Lq, Hq, Dv]
    result = out
    if return_attn_probs:
        result = (out, _flash_lse(xp, cache.lse), _s_dmask(xp, cache, q.dtype))

    def grads_of(dout: Any, dlse: Any) -> dict:
        # [B, Lq, Hq, Dv], [B, Hq, Lq] -> [B, Lq, Hq, Dh], [B, Lk, Hkv, Dh], [B, Lk, Hkv, Dv]
        _check_dout(dout, out)
        _check_dlse(dlse, V.shape_of(cache.lse), returned=bool(return_attn_probs),
                    fn=caller, flag="return_attn_probs=True")
        g = A.sdpa_backward(_swap_lh(xp, dout), cache, dlse=dlse)
        return {"q": _swap_lh(xp, g.dq), "k": _swap_lh(xp, g.dk), "v": _swap_lh(xp, g.dv)}

    return result, grads_of


def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Any = None,
    *,
    dropout_mask: Any = None,
    rng: Any = None,
) -> Any:
    """flash-attn 2.x's ``flash_attn_varlen_func`` (packed sequences), on npattn.

    Sequence ``b`` holds queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` and
    keys ``k[cu_seqlens_k[b]:cu_seqlens_k[b+1]]``; each attends only itself,
    with ``causal``, ``window_size`` and ALiBi bottom-right aligned on its own
    lengths ``(Lq_b, Lk_b)``. npattn runs one ``sdpa_forward`` per sequence
    (the alignment offset ``Lk_b - Lq_b`` is per sequence).

    Parameters
    ----------
    q : array, shape (total_q, Hq, Dh)
    k : array, shape (total_k, Hkv, Dh)
    v : array, shape (total_k, Hkv, Dv)
    cu_seqlens_q, cu_seqlens_k : integer arrays, shape (B + 1,)
        Cumulative lengths: non-decreasing, from 0 to total_q (total_k).
        No gradient.
    max_seqlen_q, max_seqlen_k : int
        At least the longest sequence (checked; flash-attn trusts them). They
        set the last two axes of ``S_dmask`` and ``dropout_mask``.
    dropout_p, softmax_scale, causal, window_size, softcap
        As ``flash_attn_func``.
    alibi_slopes : array, shape (Hq,) or (B, Hq), optional
    deterministic : bool
        As ``flash_attn_func``.
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``S_dmask``.
    block_table : None
        The paged KV cache is not implemented: ``NotImplementedError`` if given.
    dropout_mask : bool array broadcastable to (B, Hq, max_seqlen_q, max_seqlen_k), optional
        Keep-mask (True = keep) in ``S_dmask``'s layout: sequence ``b`` uses
        ``dropout_mask[b, :, :Lq_b, :Lk_b]``. The last two axes may be longer.
    rng : int, numpy.random.SeedSequence, BitGenerator, Generator or None
        Without ``dropout_mask``: one generator, made once, draws each
        sequence's keep-mask in turn.

    Returns
    -------
    out : array, shape (total_q, Hq, Dv)
    softmax_lse : array, shape (Hq, total_q) (``return_attn_probs`` only)
        As ``flash_attn_func``'s, ``+inf`` for a row with nothing to attend,
        in the layout of flash-attn's varlen kernel.
    S_dmask : array, shape (B, Hq, max_seqlen_q, max_seqlen_k) (``return_attn_probs`` only)
        Sequence ``b``'s probabilities, negated where dropped, in
        ``[b, :, :Lq_b, :Lk_b]``; zeros elsewhere.

    Notes
    -----
    A sequence with ``Lk_b = 0`` and queries gives zero output and
    ``softmax_lse = +inf``; one with ``Lq_b = 0`` gives nothing.
    """
    # [total_q, Hq, Dh], [total_k, Hkv, Dh], [total_k, Hkv, Dv] -> [total_q, Hq, Dv]
    return _flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                   softcap, alibi_slopes, deterministic, return_attn_probs,
                                   block_table, dropout_mask=dropout_mask, rng=rng)[0]


def _check_cu_seqlens(name: str, cu: Any, total: int, of: str) -> list:
    """The entries of ``cu_seqlens_*``: non-decreasing from 0 to ``total`` (the tokens of ``of``)."""
    c = _int_list(name, cu, "cumulative sequence lengths (B + 1,)")
    if len(c) < 1 or c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(
            f"{name}: expected cumulative lengths, non-decreasing from 0 to {total} "
            f"(the tokens of {of}), got {c}"
        )
    return c


@_keeps_callers_generator
def _flash_attn_varlen_func(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                            max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Any = (-1, -1), softcap: float = 0.0,
                            alibi_slopes: Any = None, deterministic: bool = False,
                            return_attn_probs: bool = False, block_table: Any = None, *,
                            dropout_mask: Any = None, rng: Any = None,
                            caller: str = "flash_attn_varlen_func") -> tuple[Any, GradsOf]:
    """``flash_attn_varlen_func``'s result and its ``grads_of`` (for ``vjp``); ``caller`` is the
    public function the pullback's messages name (a packed form calls this one)."""
    # [total_q, Hq, Dh], [total_k, Hkv, Dh], [total_k, Hkv, Dv] -> [total_q, Hq, Dv]
    if block_table is not None:
        raise NotImplementedError(
            "block_table: the paged KV cache is not implemented in npattn.compat; "
            "pass k and v packed, (total_k, Hkv, D)"
        )
    layout = "(total_tokens, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, t, 3, layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_sizes(name, t, ((1, "nheads"), (2, "headdim")))
    total_q, Hq, Dh = (int(n) for n in q.shape)
    total_k, Hkv = int(k.shape[0]), int(k.shape[1])
    _check_axis("k", k, 2, Dh, "the head width of q")
    _check_axis("v", v, 0, total_k, "the tokens of k")
    _check_axis("v", v, 1, Hkv, "the heads of k")
    gqa = _gqa(q, k, name="k", axis=1, layout=layout, q_axis=1)
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "q")
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "k")
    if len(ck) != len(cq):
        raise ValueError(f"cu_seqlens_k: expected B + 1 = {len(cq)} entries like cu_seqlens_q, "
                         f"got {len(ck)}")
    B = len(cq) - 1
    lens_q = [cq[b + 1] - cq[b] for b in range(B)]
    lens_k = [ck[b + 1] - ck[b] for b in range(B)]
    for name, m, lens in (("max_seqlen_q", max_seqlen_q, lens_q), ("max_seqlen_k", max_seqlen_k, lens_k)):
        V.check_size(name, m, maximum=None)  # the grid check below bounds it
        if lens and m < max(lens):
            raise ValueError(f"{name}: expected at least the longest sequence, {max(lens)}, got {m}")
    is_causal, window = _flash_window(window_size, causal)
    cap = _flash_softcap(softcap)
    V.check_bool("deterministic", deterministic)  # (npattn's backward is always deterministic)
    V.check_bool("return_attn_probs", return_attn_probs)
    V.check_rng("rng", rng)
    if (return_attn_probs or dropout_mask is not None) and \
            B * Hq * int(max_seqlen_q) * int(max_seqlen_k) >= 2**62:  # S_dmask / the keep-mask grid
        raise ValueError(f"max_seqlen_q, max_seqlen_k: expected a (B, Hq, max_seqlen_q, max_seqlen_k) "
                         f"grid of fewer than 2**62 entries (S_dmask, dropout_mask), got "
                         f"{(B, Hq, int(max_seqlen_q), int(max_seqlen_k))}")
    xp = namespace(q, k, v, names=("q", "k", "v"))
    if alibi_slopes is not None and hasattr(alibi_slopes, "shape") and len(alibi_slopes.shape) == 2:
        _check_axis("alibi_slopes", alibi_slopes, 0, B, "the number of sequences B")
    keep = None
    if dropout_mask is not None:
        V.check_array("dropout_mask", dropout_mask, xp, device_of(q), where="like q",
                      library="that of q")
        keep = _trim_keep_mask(dropout_mask, int(max_seqlen_q), int(max_seqlen_k))
        full = (B, Hq, int(max_seqlen_q), int(max_seqlen_k))
        V.check_broadcasts_to("dropout_mask", V.shape_of(keep), full,
                              "(B, Hq, max_seqlen_q, max_seqlen_k)")
        keep = xp.broadcast_to(keep, full)  # [B, Hq, max_q, max_k]
    _check_call(xp, q, k, v, batch=B, alibi_slopes=alibi_slopes, scale=softmax_scale,
                dropout_p=dropout_p, rng=rng, enable_gqa=gqa, is_causal=is_causal, window=window,
                softcap=cap)
    gen = make_rng(rng, "rng") if dropout_p and dropout_mask is None else rng  # one stream for all

    caches: list = []
    outs, lses, probs = [], [], []
    Dv = int(v.shape[2])
    for b in range(B):
        lq, lk = lens_q[b], lens_k[b]
        if lq == 0 or lk == 0:  # nothing to compute: no rows, or rows with nothing to attend
            caches.append(None)
            outs.append(_zeros(xp, (lq, Hq, Dv), q))  # [Lq_b, Hq, Dv]
            lses.append(xp.full((Hq, lq), math.inf, dtype=F.compute_dtype(xp, q.dtype),
                                device=device_of(q)))
            probs.append(_zeros(xp, (Hq, int(max_seqlen_q), int(max_seqlen_k)), q))
            continue
        qb = _swap_lh(xp, xp.expand_dims(q[cq[b]:cq[b + 1], ...], axis=0))  # [1, Hq, Lq_b, Dh]
        kb = _swap_lh(xp, xp.expand_dims(k[ck[b]:ck[b + 1], ...], axis=0))  # [1, Hkv, Lk_b, Dh]
        vb = _swap_lh(xp, xp.expand_dims(v[ck[b]:ck[b + 1], ...], axis=0))  # [1, Hkv, Lk_b, Dv]
        slopes = alibi_slopes
        if slopes is not None and hasattr(slopes, "shape") and len(slopes.shape) == 2:
            slopes = slopes[b:b + 1, ...]  # [1, Hq]
        out_b, cache = A.sdpa_forward(
            qb, kb, vb, scale=softmax_scale, dropout_p=dropout_p,
            dropout_mask=None if keep is None else keep[b:b + 1, :, :lq, :lk], rng=gen,
            enable_gqa=gqa, align="bottom_right", is_causal=is_causal, window=window,
            softcap=cap, alibi_slopes=slopes, need_weights=bool(return_attn_probs),
        )  # [1, Hq, Lq_b, Dv]
        caches.append(cache)
        outs.append(_swap_lh(xp, out_b)[0, ...])  # [Lq_b, Hq, Dv]
        if return_attn_probs:
            lses.append(_flash_lse(xp, cache.lse)[0, ...])  # [Hq, Lq_b]
            s = _s_dmask(xp, cache, q.dtype)[0, ...]  # [Hq, Lq_b, Lk_b]
            s = xp.concat([s, _zeros(xp, (Hq, lq, int(max_seqlen_k) - lk), s)], axis=2)
            probs.append(xp.concat([s, _zeros(xp, (Hq, int(max_seqlen_q) - lq, int(max_seqlen_k)), s)],
                                   axis=1))  # [Hq, max_q, max_k]
    out = xp.concat(outs, axis=0) if outs else _zeros(xp, (0, Hq, Dv), q)  # [total_q, Hq, Dv]
    result = out
    if return_attn_probs:
        lse = xp.concat(lses, axis=1) if lses else _zeros(xp, (Hq, 0), q, F.compute_dtype(xp, q.dtype))
        S = xp.stack(probs, axis=0) if probs else _zeros(xp, (0, Hq, int(max_seqlen_q), int(max_seqlen_k)), q)
        result = (out, lse, S)  # [total_q, Hq, Dv], [Hq, total_q], [B, Hq, max_q, max_k]

    def grads_of(dout: Any, dlse: Any) -> dict:
        # [total_q, Hq, Dv], [Hq, total_q] -> [total_q, Hq, Dh], [total_k, Hkv, Dh], [total_k, Hkv, Dv]
        _check_dout(dout, out)
        _check_dlse(dlse, (Hq, total_q), returned=bool(return_attn_probs),
                    fn=caller, flag="return_attn_probs=True")
        dqs, dks, dvs = [], [], []
        for b, cache in enumerate(caches):
            if cache is None:
                dqs.append(_zeros(xp, (lens_q[b], Hq, Dh), q))
                dks.append(_zeros(xp, (lens_k[b], Hkv, Dh), k))
                dvs.append(_zeros(xp, (lens_k[b], Hkv, Dv), v))
                continue
            rows = slice(cq[b], cq[b + 1])
            dout_b = _swap_lh(xp, xp.expand_dims(dout[rows, ...], axis=0))  # [1, Hq, Lq_b, Dv]
            dlse_b = None if dlse is None else xp.expand_dims(dlse[:, rows], axis=0)  # [1, Hq, Lq_b]
            g = A.sdpa_backward(dout_b, cache, dlse=dlse_b)
            dqs.append(_swap_lh(xp, g.dq)[0, ...])  # [Lq_b, Hq, Dh]
            dks.append(_swap_lh(xp, g.dk)[0, ...])  # [Lk_b, Hkv, Dh]
            dvs.append(_swap_lh(xp, g.dv)[0, ...])  # [Lk_b, Hkv, Dv]
        dq = xp.concat(dqs, axis=0) if dqs else _zeros(xp, tuple(q.shape), q)
        dk = xp.concat(dks, axis=0) if dks else _zeros(xp, tuple(k.shape), k)
        dv = xp.concat(dvs, axis=0) if dvs else _zeros(xp, tuple(v.shape), v)
        return {"q": dq, "k": dk, "v": dv}

    return result, grads_of


def flash_attn_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    block_table: Any = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """flash-attn 2.x's ``flash_attn_with_kvcache`` (incremental decoding), on npattn.

    With ``k`` and ``v``, the new keys and values are written **in place**
    into ``k_cache`` and ``v_cache`` at positions ``cache_seqlens[b] ...
    cache_seqlens[b] + Lnew - 1`` of batch ``b`` (the one npattn function
    that writes into its inputs, as the original does). Then the queries of
    batch ``b`` attend its first ``Lk_b = cache_seqlens[b] + Lnew`` keys (the
    cache after the append), with ``causal``, ``window_size`` and ALiBi
    bottom-right aligned on ``(Lq, Lk_b)``: one ``sdpa_forward`` per batch
    entry. Query ``i`` stands at key position ``p = cache_seqlens[b] + Lnew -
    Lq + i`` (``cache_seqlens[b] + i`` when ``Lq = Lnew``) and attends key ``j``
    exactly when ``max(0, p - left) <= j <= min(Lk_b - 1, p + right)`` (a side
    of -1 unbounded; ``causal`` sets ``right = 0``): the cache's free space is
    never attended, and a query with no such key gets zeros. This is
    flash-attn's rule (its kernel's per-row ``actual_seqlen_k``); its kernel
    departs from it only when ``Lq > Lc + 1`` (docs/compat.md). No dropout, as
    in flash-attn.

    Parameters
    ----------
    q : array, shape (B, Lq, Hq, Dh)
    k_cache : array, shape (Bc, Lc, Hkv, Dh), Bc >= B (batch ``b`` uses row ``b``)
    v_cache : array, shape (Bc, Lc, Hkv, Dv)
        Of the dtype of ``q``; with ``k`` and ``v``, writable in place (not a JAX array),
        and not sharing memory with each other (``k`` and ``v`` may be views of either:
        they are read before anything is written).
    k : array, shape (B, Lnew, Hkv, Dh), optional
    v : array, shape (B, Lnew, Hkv, Dv), optional
        Both or neither.
    rotary_cos, rotary_sin : None
        Rotary embeddings are not implemented: ``NotImplementedError`` if given.
    cache_seqlens : int or integer array (B,), optional
        Keys already in the cache per batch entry; None: all ``Lc`` (then no
        ``k``/``v`` may be given). ``cache_seqlens[b] + Lnew <= Lc`` is checked.
    cache_batch_idx, cache_leftpad, block_table : None
        Cache indirection, left padding and the paged cache are not implemented:
        ``NotImplementedError`` if given.
    softmax_scale, causal, window_size, softcap
        As ``flash_attn_func``.
    rotary_interleaved : bool
        Ignored (no rotary embedding).
    alibi_slopes
        As ``flash_attn_func``.
    num_splits : int
        Ignored: npattn splits nothing.
    return_softmax_lse : bool
        Also return ``softmax_lse``.

    Returns
    -------
    out : array, shape (B, Lq, Hq, Dv)
    softmax_lse : array, shape (B, Hq, Lq) (``return_softmax_lse`` only)
        ``+inf`` for a row with nothing to attend, as ``flash_attn_func``'s.

    Notes
    -----
    flash-attn has no backward for this function; ``vjp`` gives one: the
    gradient of ``k_cache`` (``v_cache``) is that of its contents before the
    call, zero past ``cache_seqlens[b]`` (overwritten or unread), and that of
    ``k`` (``v``) the new keys'.
    """
    # [B, Lq, Hq, Dh], [Bc, Lc, Hkv, Dh], [Bc, Lc, Hkv, Dv] -> [B, Lq, Hq, Dv]
    return _flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                    cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                                    softmax_scale, causal, window_size, softcap,
                                    rotary_interleaved, alibi_slopes, num_splits,
                                    return_softmax_lse)[0]


def _strides(a: Any) -> Optional[tuple]:
    """The strides of ``a`` (NumPy's in bytes, torch's in elements), or None where the library
    has none to show."""
    st = getattr(a, "strides", None)
    if st is None and callable(getattr(a, "stride", None)):
        try:
            st = a.stride()
        except (TypeError, RuntimeError):  # pragma: no cover - a layout without strides
            st = None
    return None if st is None else tuple(int(x) for x in st)


def _overlaps_itself(a: Any) -> bool:
    """Whether an axis of more than one entry has stride 0 (an expanded or broadcast view)."""
    st = _strides(a)
    return st is not None and any(x == 0 and int(n) > 1 for x, n in zip(st, a.shape))


def _write_in_place(name: str, cache: Any, b: int, start: int, new: Any) -> None:
    """``cache[b, start:start + Lnew] = new[b]``: flash-attn's in-place append."""
    try:
        cache[b, start:start + int(new.shape[1]), ...] = new[b, ...]
    except (TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise TypeError(
            f"{name}: expected an array that can be written in place (the new keys/values are "
            f"appended into it), got {V.type_name(cache)} ({exc})"
        ) from exc


def _flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None,
                             rotary_cos: Any = None, rotary_sin: Any = None,
                             cache_seqlens: Any = None, cache_batch_idx: Any = None,
                             cache_leftpad: Any = None, block_table: Any = None,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size: Any = (-1, -1), softcap: float = 0.0,
                             rotary_interleaved: bool = True, alibi_slopes: Any = None,
                             num_splits: int = 0,
                             return_softmax_lse: bool = False) -> tuple[Any, GradsOf]:
    """``flash_attn_with_kvcache``'s result and its ``grads_of`` (for ``vjp``)."""
    # [B, Lq, Hq, Dh], [Bc, Lc, Hkv, Dh], [Bc, Lc, Hkv, Dv] -> [B, Lq, Hq, Dv]
    for name, a, what in (("rotary_cos", rotary_cos, "rotary embeddings are"),
                          ("rotary_sin", rotary_sin, "rotary embeddings are"),
                          ("cache_batch_idx", cache_batch_idx, "cache indirection is"),
                          ("cache_leftpad", cache_leftpad, "a left-padded cache is"),
                          ("block_table", block_table, "the paged KV cache is")):
        if a is not None:
            raise NotImplementedError(f"{name}: {what} not implemented in npattn.compat; pass None")
    layout = "(batch, seqlen, nheads, headdim)"
    V.check_bool("rotary_interleaved", rotary_interleaved)  # (no rotary embeddings: unused)
    V.check_size("num_splits", num_splits)  # (a kernel's work split: nothing to split here)
    _check_rank("q", q, 4, layout)
    _check_rank("k_cache", k_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _check_rank("v_cache", v_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _check_sizes("q", q, ((1, "seqlen"), (2, "nheads"), (3, "headdim")))
    B, Lq, Hq, Dh = (int(n) for n in q.shape)
    Bc, Lc, Hkv = (int(n) for n in k_cache.shape[:3])
    Dv = int(v_cache.shape[3])
    if Bc < B:
        raise ValueError(f"k_cache: expected at least the batch of q, {B}, on axis 0, "
                         f"got shape {V.shape_of(k_cache)}")
    _check_axis("k_cache", k_cache, 3, Dh, "the head width of q")
    for axis, size, what in ((0, Bc, "the batch of k_cache"), (1, Lc, "the length of k_cache"),
                             (2, Hkv, "the heads of k_cache")):
        _check_axis("v_cache", v_cache, axis, size, what)
    _check_sizes("v_cache", v_cache, ((3, "headdim"),))  # as flash_attn_func's v
    gqa = _gqa(q, k_cache, name="k_cache", axis=2,
               layout="(batch_cache, seqlen_cache, nheads_k, headdim)", q_axis=2)
    if (k is None) != (v is None):
        given = "k" if v is None else "v"
        raise ValueError(f"{given}: expected k and v together (new keys and values), got only {given}")
    Lnew = 0
    if k is not None:
        _check_rank("k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
        _check_rank("v", v, 4, "(batch, seqlen_new, nheads_k, headdim)")
        Lnew = int(k.shape[1])
        for axis, size, what in ((0, B, "the batch of q"), (2, Hkv, "the heads of k_cache"),
                                 (3, Dh, "the head width of q")):
            _check_axis("k", k, axis, size, what)
        for axis, size, what in ((0, B, "the batch of q"), (1, Lnew, "the new length of k"),
                                 (2, Hkv, "the heads of k_cache"), (3, Dv, "the value width of v_cache")):
            _check_axis("v", v, axis, size, what)
    xp = namespace(q, k_cache, v_cache, k, v, names=("q", "k_cache", "v_cache", "k", "v"))
    V.check_floating_array("q", q, xp)  # q's own dtype first: the others are compared with it
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if a is not None and a.dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q, {V.dtype_name(q.dtype)}, "
                            f"got {V.dtype_name(a.dtype)} (no silent promotion)")
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens: expected the cache's lengths with k and v (where to write "
                             "them), got None")
        seqlens = [Lc] * B
    elif _is_int(cache_seqlens):
        seqlens = [int(cache_seqlens)] * B
    else:
        seqlens = _int_list("cache_seqlens", cache_seqlens, "keys in the cache per batch entry (B,)")
        if len(seqlens) != B:
            raise ValueError(f"cache_seqlens: expected B = {B} entries (the batch of q), got {len(seqlens)}")
    for s in seqlens:
        if s < 0 or s + Lnew > Lc:
            raise ValueError(
                f"cache_seqlens: expected 0 <= cache_seqlens[b] <= Lc - Lnew = {Lc} - {Lnew}, "
                f"got {seqlens}"
            )
    is_causal, window = _flash_window(window_size, causal)
    cap = _flash_softcap(softcap)
    V.check_bool("return_softmax_lse", return_softmax_lse)
    if alibi_slopes is not None and hasattr(alibi_slopes, "shape") and len(alibi_slopes.shape) == 2:
        _check_axis("alibi_slopes", alibi_slopes, 0, B, "the batch of q")
    _check_call(xp, q, k_cache, v_cache, batch=B, alibi_slopes=alibi_slopes, scale=softmax_scale,
                enable_gqa=gqa, is_causal=is_causal, window=window, softcap=cap)
    if k is not None:  # a cache that cannot take the write fails here, not after a partial write
        for name, a, new in (("k_cache", k_cache, k), ("v_cache", v_cache, v)):
            if not getattr(getattr(a, "flags", None), "writeable", True):
                raise TypeError(f"{name}: expected an array that can be written in place (the new "
                                f"keys/values are appended into it), got a read-only {V.type_name(a)}")
            if _overlaps_itself(a):  # an expanded view: one entry's write would land in another's
                raise TypeError(f"{name}: expected an array whose entries have memory of their own "
                                f"(the new keys/values are appended into it), got a "
                                f"{V.type_name(a)} of strides {_strides(a)} for shape "
                                f"{V.shape_of(a)} (an expanded or broadcast view); pass a copy")
            if array_api_compat.is_torch_array(a):  # an empty write: torch refuses a leaf
                _write_in_place(name, a, 0, 0, new[:, :0, ...])  # that requires grad here
        if shares_memory(v_cache, k_cache):  # the values would land on the new keys
            raise ValueError("v_cache: expected a buffer apart from k_cache (the new keys and values "
                             "are written into each), got one sharing memory with it")
        # new keys or values that are views of the caches (their free space included) are
        # copied first: torch refuses a write from memory it overlaps, and the values would
        # otherwise be read after the keys were written
        k, v = (copy_array(xp, a) if may_share_memory(a, k_cache) or may_share_memory(a, v_cache)
                else a for a in (k, v))

    # (cache, b, the entries a write overwrote [1, Lnew, Hkv, Dh or Dv]) of each write done: a
    # call that fails after them (out of memory, an interrupt) puts them back, changing nothing
    written: list = []
    try:
        if k is not None:  # 1. the in-place append
            for b in range(B):
                for name, kv_cache, new in (("k_cache", k_cache, k), ("v_cache", v_cache, v)):
                    old = copy_array(xp, kv_cache[b:b + 1, seqlens[b]:seqlens[b] + Lnew, ...])
                    _write_in_place(name, kv_cache, b, seqlens[b], new)
                    written.append((kv_cache, b, old))

        caches: list = []
        outs, lses = [], []
        for b in range(B):  # 2. attention of batch b over its first Lk_b keys
            Lk = seqlens[b] + Lnew
            if Lk == 0:
                caches.append(None)
                outs.append(_zeros(xp, (1, Lq, Hq, Dv), q))  # [1, Lq, Hq, Dv]
                lses.append(xp.full((1, Hq, Lq), math.inf, dtype=F.compute_dtype(xp, q.dtype),
                                    device=device_of(q)))
                continue
            # copies: the cache changes under the next decoding step, the forward cache must not
            kb = _swap_lh(xp, copy_array(xp, k_cache[b:b + 1, :Lk, ...]))  # [1, Hkv, Lk_b, Dh]
            vb = _swap_lh(xp, copy_array(xp, v_cache[b:b + 1, :Lk, ...]))  # [1, Hkv, Lk_b, Dv]
            slopes = alibi_slopes
            if slopes is not None and hasattr(slopes, "shape") and len(slopes.shape) == 2:
                slopes = slopes[b:b + 1, ...]  # [1, Hq]
            out_b, cache = A.sdpa_forward(
                _swap_lh(xp, q[b:b + 1, ...]), kb, vb, scale=softmax_scale, enable_gqa=gqa,
                align="bottom_right", is_causal=is_causal, window=window, softcap=cap,
                alibi_slopes=slopes,
            )  # [1, Hq, Lq, Dv]
            caches.append(cache)
            outs.append(_swap_lh(xp, out_b))  # [1, Lq, Hq, Dv]
            lses.append(_flash_lse(xp, cache.lse))  # [1, Hq, Lq]
        out = xp.concat(outs, axis=0)  # [B, Lq, Hq, Dv]
        result = (out, xp.concat(lses, axis=0)) if return_softmax_lse else out
    except BaseException:
        for kv_cache, b, old in reversed(written):
            kv_cache[b, seqlens[b]:seqlens[b] + Lnew, ...] = old[0, ...]
        raise

    def grads_of(dout: Any, dlse: Any) -> dict:
        # [B, Lq, Hq, Dv], [B, Hq, Lq] -> q, k_cache, v_cache, k, v shapes
        _check_dout(dout, out)
        _check_dlse(dlse, (B, Hq, Lq), returned=bool(return_softmax_lse),
                    fn="flash_attn_with_kvcache", flag="return_softmax_lse=True")
        dq, dkc, dvc, dkn, dvn = [], [], [], [], []
        for b, cache in enumerate(caches):
            s = seqlens[b]
            if cache is None:
                dkb = _zeros(xp, (Lnew, Hkv, Dh), k_cache)  # [Lk_b = 0 + Lnew, Hkv, Dh]
                dvb = _zeros(xp, (Lnew, Hkv, Dv), v_cache)
                dq.append(_zeros(xp, (1, Lq, Hq, Dh), q))
            else:
                g = A.sdpa_backward(_swap_lh(xp, dout[b:b + 1, ...]), cache,
                                    dlse=None if dlse is None else dlse[b:b + 1, ...])
                dq.append(_swap_lh(xp, g.dq))  # [1, Lq, Hq, Dh]
                dkb = _swap_lh(xp, g.dk)[0, ...]  # [Lk_b, Hkv, Dh]
                dvb = _swap_lh(xp, g.dv)[0, ...]  # [Lk_b, Hkv, Dv]
            # keys [0, s) were in the cache; [s, s + Lnew) are the new ones; the rest unread
            dkc.append(xp.concat([dkb[:s, ...], _zeros(xp, (Lc - s, Hkv, Dh), k_cache)], axis=0))
            dvc.append(xp.concat([dvb[:s, ...], _zeros(xp, (Lc - s, Hkv, Dv), v_cache)], axis=0))
            dkn.append(dkb[s:, ...])  # [Lnew, Hkv, Dh]
            dvn.append(dvb[s:, ...])
        for _ in range(Bc - B):  # cache rows no query reads
            dkc.append(_zeros(xp, (Lc, Hkv, Dh), k_cache))
            dvc.append(_zeros(xp, (Lc, Hkv, Dv), v_cache))
        grads = {"q": xp.concat(dq, axis=0), "k_cache": xp.stack(dkc, axis=0),
                 "v_cache": xp.stack(dvc, axis=0)}  # [B, Lq, Hq, Dh], [Bc, Lc, Hkv, Dh], ...
        if k is not None:
            grads["k"] = xp.stack(dkn, axis=0)  # [B, Lnew, Hkv, Dh]
            grads["v"] = xp.stack(dvn, axis=0)  # [B, Lnew, Hkv, Dv]
        return grads

    return result, grads_of


# --------------------------------------------------------------------------
# flash-attn 2.x, packed forms: q, k and v (or k and v) stacked on one axis

_QKV = "(batch, seqlen, 3, nheads, headdim)"
_KV = "(batch, seqlen_k, 2, nheads_k, headdim)"
_VARLEN_QKV = "(total_tokens, 3, nheads, headdim)"
_VARLEN_KV = "(total_k, 2, nheads_k, headdim)"


#: q, k and v are qkv to a qkvpacked function's caller; the other arguments keep their names,
#: listed so that their messages' "(that of q)", "(like q)" name qkv too
_QKV_RENAMES = {"q": "qkv", "k": "qkv", "v": "qkv", "dropout_mask": "dropout_mask",
                "alibi_slopes": "alibi_slopes"}


def _check_packed(name: str, x: Any, layout: str, axis: int, count: int, sizes: tuple) -> None:
    """``TypeError`` unless ``x`` is an array, ``ValueError`` unless it has the axes of ``layout``
    with exactly ``count`` entries on the packed ``axis`` and each ``(axis, what)`` of ``sizes``
    at least 1: named in the packed layout, before it is unpacked."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name}: expected an array of shape {layout}, got {V.type_name(x)}")
    V.check_array(name, x)
    ndim = layout.count(",") + 1  # the axes the layout names
    if len(x.shape) != ndim or int(x.shape[axis]) != count:
        raise ValueError(f"{name}: expected shape {layout}, got shape {V.shape_of(x)}")
    _check_sizes(name, x, sizes)


def _check_kv_of(q: Any, kv: Any, *, layout: str, batched: bool) -> bool:
    """``kv``'s checks against ``q`` (batch, head width, heads), as ``flash_attn_func``'s of k and
    v, named in the packed layout; whether K/V have fewer heads (GQA)."""
    o = 0 if batched else 1  # varlen: no batch axis
    q_layout = "(batch, seqlen, nheads, headdim)" if batched else "(total_tokens, nheads, headdim)"
    _check_rank("q", q, 4 - o, q_layout)
    sizes = ((1, "seqlen"), (2, "nheads"), (3, "headdim")) if batched else \
        ((1, "nheads"), (2, "headdim"))
    _check_sizes("q", q, sizes)  # q on its own first: kv is checked against its axes
    # varlen: total_k may be 0 (every sequence without keys), as flash_attn_varlen_func's k
    kv_sizes = ((1, "seqlen_k"),) if batched else ()
    _check_packed("kv", kv, layout, 2 - o, 2, kv_sizes + ((3 - o, "nheads_k"), (4 - o, "headdim")))
    if batched:
        _check_axis("kv", kv, 0, int(q.shape[0]), "the batch of q")
    _check_axis("kv", kv, 4 - o, int(q.shape[3 - o]), "the head width of q")
    return _gqa(q, kv, name="kv", axis=3 - o, layout=layout, q_axis=2 - o)


def flash_attn_qkvpacked_func(
    qkv: Any,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_mask: Any = None,
    rng: Any = None,
) -> Any:
    """flash-attn 2.x's ``flash_attn_qkvpacked_func``: ``flash_attn_func`` on q, k and v stacked.

    ``flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...)``, with the
    three taken as views (no copy); ``vjp`` gives the gradient of ``qkv`` itself,
    ``dq``, ``dk`` and ``dv`` stacked on axis 2, as flash-attn's backward returns it.

    Parameters
    ----------
    qkv : array, shape (B, L, 3, H, D)
        Queries, keys and values on axis 2 (exactly 3 entries): one length and
        one head count for all (for grouped-query attention, flash-attn points
        to ``flash_attn_kvpacked_func``).
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
        As ``flash_attn_func`` (``causal``'s bottom-right alignment is top-left here:
        Lq = Lk).
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``S_dmask``.
    dropout_mask, rng
        npattn's extensions, as ``flash_attn_func``'s: a keep-mask broadcastable
        to (B, H, L, L), or the generator that draws one.

    Returns
    -------
    out : array, shape (B, L, H, D)
    softmax_lse : array, shape (B, H, L) (``return_attn_probs`` only)
    S_dmask : array, shape (B, H, L, L) (``return_attn_probs`` only)
        As ``flash_attn_func``'s.
    """
    # [B, L, 3, H, D] -> [B, L, H, D]
    return _flash_attn_qkvpacked_func(qkv, dropout_p, softmax_scale, causal, window_size, softcap,
                                      alibi_slopes, deterministic, return_attn_probs,
                                      dropout_mask=dropout_mask, rng=rng)[0]


@_keeps_callers_generator
def _flash_attn_qkvpacked_func(qkv: Any, dropout_p: float = 0.0,
                               softmax_scale: Optional[float] = None, causal: bool = False,
                               window_size: Any = (-1, -1), softcap: float = 0.0,
                               alibi_slopes: Any = None, deterministic: bool = False,
                               return_attn_probs: bool = False, *, dropout_mask: Any = None,
                               rng: Any = None) -> tuple[Any, GradsOf]:
    """``flash_attn_qkvpacked_func``'s result and its ``grads_of`` (for ``vjp``)."""
    # [B, L, 3, H, D] -> [B, L, H, D]
    _check_packed("qkv", qkv, _QKV, 2, 3, ((1, "seqlen"), (3, "nheads"), (4, "headdim")))
    q, k, v = qkv[:, :, 0, ...], qkv[:, :, 1, ...], qkv[:, :, 2, ...]  # 3 x [B, L, H, D] views
    with V.argument_names(_QKV_RENAMES):
        result, grads_of = _flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                            softcap, alibi_slopes, deterministic, return_attn_probs,
                                            dropout_mask=dropout_mask, rng=rng,
                                            caller="flash_attn_qkvpacked_func")
    xp = namespace(qkv)

    def packed_grads_of(dout: Any, dlse: Any) -> dict:
        # [B, L, H, D], [B, H, L] -> [B, L, 3, H, D]
        g = grads_of(dout, dlse)
        return {"qkv": xp.stack([g["q"], g["k"], g["v"]], axis=2)}

    return result, packed_grads_of


def flash_attn_kvpacked_func(
    q: Any,
    kv: Any,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_mask: Any = None,
    rng: Any = None,
) -> Any:
    """flash-attn 2.x's ``flash_attn_kvpacked_func``: ``flash_attn_func`` with k and v stacked.

    ``flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], ...)``, k and v taken as views
    (no copy); ``vjp`` gives the gradients of ``q`` and of ``kv`` itself, ``dk``
    and ``dv`` stacked on axis 2.

    Parameters
    ----------
    q : array, shape (B, Lq, Hq, D)
    kv : array, shape (B, Lk, 2, Hkv, D)
        Keys and values on axis 2 (exactly 2 entries). ``Hkv`` divides ``Hq``
        (multi- and grouped-query attention).
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
        As ``flash_attn_func``: ``causal`` and the window bottom-right aligned.
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``S_dmask``.
    dropout_mask, rng
        npattn's extensions, as ``flash_attn_func``'s: a keep-mask broadcastable
        to (B, Hq, Lq, Lk), or the generator that draws one.

    Returns
    -------
    out : array, shape (B, Lq, Hq, D)
    softmax_lse : array, shape (B, Hq, Lq) (``return_attn_probs`` only)
    S_dmask : array, shape (B, Hq, Lq, Lk) (``return_attn_probs`` only)
        As ``flash_attn_func``'s.
    """
    # [B, Lq, Hq, D], [B, Lk, 2, Hkv, D] -> [B, Lq, Hq, D]
    return _flash_attn_kvpacked_func(q, kv, dropout_p, softmax_scale, causal, window_size, softcap,
                                     alibi_slopes, deterministic, return_attn_probs,
                                     dropout_mask=dropout_mask, rng=rng)[0]


@_keeps_callers_generator
def _flash_attn_kvpacked_func(q: Any, kv: Any, dropout_p: float = 0.0,
                              softmax_scale: Optional[float] = None, causal: bool = False,
                              window_size: Any = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Any = None, deterministic: bool = False,
                              return_attn_probs: bool = False, *, dropout_mask: Any = None,
                              rng: Any = None) -> tuple[Any, GradsOf]:
    """``flash_attn_kvpacked_func``'s result and its ``grads_of`` (for ``vjp``)."""
    # [B, Lq, Hq, D], [B, Lk, 2, Hkv, D] -> [B, Lq, Hq, D]
    _check_kv_of(q, kv, layout=_KV, batched=True)
    xp = namespace(q, kv, names=("q", "kv"))
    k, v = kv[:, :, 0, ...], kv[:, :, 1, ...]  # 2 x [B, Lk, Hkv, D] views
    with V.argument_names({"k": "kv", "v": "kv"}):
        result, grads_of = _flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                            softcap, alibi_slopes, deterministic, return_attn_probs,
                                            dropout_mask=dropout_mask, rng=rng,
                                            caller="flash_attn_kvpacked_func")

    def packed_grads_of(dout: Any, dlse: Any) -> dict:
        # [B, Lq, Hq, D], [B, Hq, Lq] -> [B, Lq, Hq, D], [B, Lk, 2, Hkv, D]
        g = grads_of(dout, dlse)
        return {"q": g["q"], "kv": xp.stack([g["k"], g["v"]], axis=2)}

    return result, packed_grads_of


def flash_attn_varlen_qkvpacked_func(
    qkv: Any,
    cu_seqlens: Any,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_mask: Any = None,
    rng: Any = None,
) -> Any:
    """flash-attn 2.x's ``flash_attn_varlen_qkvpacked_func``: ``flash_attn_varlen_func`` on q, k
    and v stacked, one ``cu_seqlens`` for queries and keys.

    ``flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens,
    cu_seqlens, max_seqlen, max_seqlen, ...)``, the three taken as views (no copy);
    ``vjp`` gives the gradient of ``qkv`` itself, ``dq``, ``dk`` and ``dv`` stacked
    on axis 1. Like flash-attn's, it has no ``block_table``.

    Parameters
    ----------
    qkv : array, shape (total_tokens, 3, H, D)
        Queries, keys and values on axis 1 (exactly 3 entries).
    cu_seqlens : integer array, shape (B + 1,)
        Cumulative lengths of the sequences, from 0 to total_tokens, of the
        queries and the keys alike. No gradient.
    max_seqlen : int
        At least the longest sequence (checked; flash-attn trusts it).
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
        As ``flash_attn_varlen_func``.
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``S_dmask``.
    dropout_mask, rng
        npattn's extensions, as ``flash_attn_varlen_func``'s: a keep-mask
        broadcastable to (B, H, max_seqlen, max_seqlen), or the generator that
        draws each sequence's in turn.

    Returns
    -------
    out : array, shape (total_tokens, H, D)
    softmax_lse : array, shape (H, total_tokens) (``return_attn_probs`` only)
    S_dmask : array, shape (B, H, max_seqlen, max_seqlen) (``return_attn_probs`` only)
        As ``flash_attn_varlen_func``'s.
    """
    # [total, 3, H, D] -> [total, H, D]
    return _flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p,
                                             softmax_scale, causal, window_size, softcap,
                                             alibi_slopes, deterministic, return_attn_probs,
                                             dropout_mask=dropout_mask, rng=rng)[0]


#: the names of a packed varlen function's own arguments, for the messages of the unpacked one
_VARLEN_RENAMES = {"cu_seqlens_q": "cu_seqlens", "cu_seqlens_k": "cu_seqlens",
                   "max_seqlen_q": "max_seqlen", "max_seqlen_k": "max_seqlen",
                   "max_seqlen_q, max_seqlen_k": "max_seqlen"}


@_keeps_callers_generator
def _flash_attn_varlen_qkvpacked_func(qkv: Any, cu_seqlens: Any, max_seqlen: int,
                                      dropout_p: float = 0.0,
                                      softmax_scale: Optional[float] = None, causal: bool = False,
                                      window_size: Any = (-1, -1), softcap: float = 0.0,
                                      alibi_slopes: Any = None, deterministic: bool = False,
                                      return_attn_probs: bool = False, *, dropout_mask: Any = None,
                                      rng: Any = None) -> tuple[Any, GradsOf]:
    """``flash_attn_varlen_qkvpacked_func``'s result and its ``grads_of`` (for ``vjp``)."""
    # [total, 3, H, D] -> [total, H, D]
    _check_packed("qkv", qkv, _VARLEN_QKV, 1, 3, ((2, "nheads"), (3, "headdim")))
    _check_cu_seqlens("cu_seqlens", cu_seqlens, int(qkv.shape[0]), "qkv")
    q, k, v = qkv[:, 0, ...], qkv[:, 1, ...], qkv[:, 2, ...]  # 3 x [total, H, D] views
    with V.argument_names({**_QKV_RENAMES, **_VARLEN_RENAMES}):
        result, grads_of = _flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
            dropout_mask=dropout_mask, rng=rng, caller="flash_attn_varlen_qkvpacked_func")
    xp = namespace(qkv)

    def packed_grads_of(dout: Any, dlse: Any) -> dict:
        # [total, H, D], [H, total] -> [total, 3, H, D]
        g = grads_of(dout, dlse)
        return {"qkv": xp.stack([g["q"], g["k"], g["v"]], axis=1)}

    return result, packed_grads_of


def flash_attn_varlen_kvpacked_func(
    q: Any,
    kv: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_mask: Any = None,
    rng: Any = None,
) -> Any:
    """flash-attn 2.x's ``flash_attn_varlen_kvpacked_func``: ``flash_attn_varlen_func`` with k
    and v stacked.

    ``flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, ...)``, k and v taken as views (no copy); ``vjp``
    gives the gradients of ``q`` and of ``kv`` itself, ``dk`` and ``dv`` stacked
    on axis 1. Like flash-attn's, it has no ``block_table``.

    Parameters
    ----------
    q : array, shape (total_q, Hq, D)
    kv : array, shape (total_k, 2, Hkv, D)
        Keys and values on axis 1 (exactly 2 entries); ``Hkv`` divides ``Hq``.
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As ``flash_attn_varlen_func``'s.
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
        As ``flash_attn_varlen_func``: each sequence bottom-right aligned on its
        own lengths.
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``S_dmask``.
    dropout_mask, rng
        npattn's extensions, as ``flash_attn_varlen_func``'s.

    Returns
    -------
    out : array, shape (total_q, Hq, D)
    softmax_lse : array, shape (Hq, total_q) (``return_attn_probs`` only)
    S_dmask : array, shape (B, Hq, max_seqlen_q, max_seqlen_k) (``return_attn_probs`` only)
        As ``flash_attn_varlen_func``'s.
    """
    # [total_q, Hq, D], [total_k, 2, Hkv, D] -> [total_q, Hq, D]
    return _flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, dropout_p, softmax_scale, causal,
                                            window_size, softcap, alibi_slopes, deterministic,
                                            return_attn_probs, dropout_mask=dropout_mask,
                                            rng=rng)[0]


@_keeps_callers_generator
def _flash_attn_varlen_kvpacked_func(q: Any, kv: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                                     max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Any = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Any = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, dropout_mask: Any = None,
                                     rng: Any = None) -> tuple[Any, GradsOf]:
    """``flash_attn_varlen_kvpacked_func``'s result and its ``grads_of`` (for ``vjp``)."""
    # [total_q, Hq, D], [total_k, 2, Hkv, D] -> [total_q, Hq, D]
    _check_kv_of(q, kv, layout=_VARLEN_KV, batched=False)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, int(q.shape[0]), "q")  # in the order of the
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, int(kv.shape[0]), "kv")  # arguments; kv by name
    xp = namespace(q, kv, names=("q", "kv"))
    k, v = kv[:, 0, ...], kv[:, 1, ...]  # 2 x [total_k, Hkv, D] views
    with V.argument_names({"k": "kv", "v": "kv"}):
        result, grads_of = _flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, dropout_mask=dropout_mask, rng=rng,
            caller="flash_attn_varlen_kvpacked_func")

    def packed_grads_of(dout: Any, dlse: Any) -> dict:
        # [total_q, Hq, D], [Hq, total_q] -> [total_q, Hq, D], [total_k, 2, Hkv, D]
        g = grads_of(dout, dlse)
        return {"q": g["q"], "kv": xp.stack([g["k"], g["v"]], axis=1)}

    return result, packed_grads_of


# --------------------------------------------------------------------------
# torch.nn.functional.scaled_dot_product_attention


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    dropout_mask: Any = None,
    rng: Any = None,
) -> Any:
    """torch's ``scaled_dot_product_attention``, on npattn.

    Parameters
    ----------
    query : array, shape (..., Hq, Lq, Dh)
    key : array, shape (..., Hkv, Lk, Dh)
    value : array, shape (..., Hkv, Lk, Dv)
        Leading axes broadcast, as torch's.
    attn_mask : array broadcastable to (..., Hq, Lq, Lk), optional
        Boolean (True = take part) or floating (added to the scaled scores,
        ``-inf`` allowed; ``vjp`` gives its gradient).
    dropout_p : float
        Drop probability; torch draws its mask from its own RNG, which npattn
        cannot reproduce: pass ``dropout_mask`` (or ``rng``).
    is_causal : bool
        Top-left aligned: query ``i`` attends keys ``j <= i``; ANDed with
        ``attn_mask``. torch 2.13 on the CPU does the same on its fused path
        and refuses the pair on its math path (a value width unlike the key
        width, a mask that needs a gradient).
    scale : float, optional
        Defaults to ``1 / sqrt(Dh)``.
    enable_gqa : bool
        ``Hkv`` divides ``Hq``; query head ``h`` uses K/V head ``h // (Hq // Hkv)``.
    dropout_mask : bool array broadcastable to (..., Hq, Lq, Lk), optional
        npattn's extension: the keep-mask (True = keep) in place of a drawn one.
    rng : int, numpy.random.SeedSequence, BitGenerator, Generator or None
        npattn's extension: draws the keep-mask when ``dropout_p > 0`` without one.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv)
        A row with nothing to attend gives zeros (as torch 2.13 on the CPU).
    """
    # [..., Hq, Lq, Dh], [..., Hkv, Lk, Dh], [..., Hkv, Lk, Dv] -> [..., Hq, Lq, Dv]
    return _scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                         scale, enable_gqa, dropout_mask=dropout_mask, rng=rng)[0]


@_keeps_callers_generator
def _scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                  dropout_p: float = 0.0, is_causal: bool = False,
                                  scale: Optional[float] = None, enable_gqa: bool = False, *,
                                  dropout_mask: Any = None, rng: Any = None) -> tuple[Any, GradsOf]:
    """``scaled_dot_product_attention``'s result and its ``grads_of`` (for ``vjp``)."""
    # [..., Hq, Lq, Dh], [..., Hkv, Lk, Dh], [..., Hkv, Lk, Dv] -> [..., Hq, Lq, Dv]
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not (hasattr(t, "shape") and hasattr(t, "dtype")):
            raise TypeError(f"{name}: expected an array (..., L, E), got {V.type_name(t)}")
    if attn_mask is not None:
        V.check_array("query", query)
        xp = namespace(query)
        V.check_array("attn_mask", attn_mask, xp, device_of(query), where="like query",
                      library="that of query")
        if not (attn_mask.dtype == xp.bool or isdtype(xp, attn_mask.dtype, "real floating")):
            raise TypeError(f"attn_mask: expected a bool or real floating dtype, got "
                            f"{V.dtype_name(attn_mask.dtype)}")
    with V.argument_names({"q": "query", "k": "key", "v": "value", "mask": "attn_mask"}):
        out, cache = A.sdpa_forward(query, key, value, mask=attn_mask, is_causal=is_causal,
                                    scale=scale, dropout_p=dropout_p, dropout_mask=dropout_mask,
                                    rng=rng, enable_gqa=enable_gqa)  # [..., Hq, Lq, Dv]

    def grads_of(dout: Any, dlse: Any) -> dict:
        # [..., Hq, Lq, Dv] -> query, key, value and a floating attn_mask's shapes
        if dlse is not None:
            raise ValueError("dlse: scaled_dot_product_attention returns no log-sum-exp; pass None")
        _check_dout(dout, out)
        g = A.sdpa_backward(dout, cache)
        return {"query": g.dq, "key": g.dk, "value": g.dv, "attn_mask": g.dmask}

    return out, grads_of


# --------------------------------------------------------------------------
# jax.nn.dot_product_attention


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: Any = None,
    implementation: Optional[str] = None,
    return_residual: bool = False,
    dropout_p: float = 0.0,
    dropout_mask: Any = None,
    rng: Any = None,
) -> Any:
    """JAX's ``jax.nn.dot_product_attention`` (its XLA implementation), on npattn.

    Parameters
    ----------
    query : array, shape (B, T, N, H) or (T, N, H)
    key : array, shape (B, S, K, H) or (S, K, H)
    value : array, shape (B, S, K, Dv) or (S, K, Dv)
        ``K`` divides ``N``: query head ``n`` uses K/V head ``n // (N // K)``.
    bias : array broadcastable to (B, N, T, S), at most 4 axes, optional
        Added to the scaled logits; ``vjp`` gives its gradient.
    mask : bool array broadcastable to (B, N, T, S), at most 4 axes, optional
        True = takes part.
    scale : float, optional
        Defaults to ``1 / sqrt(H)``.
    is_causal : bool
        Top-left aligned: query ``t`` attends keys ``s <= t``.
    query_seq_lengths, key_value_seq_lengths : integer arrays (B,), optional
        Queries ``t >= query_seq_lengths[b]`` are padding: their output is 0,
        in JAX and here. Keys ``s >= key_value_seq_lengths[b]`` are masked.
        A length past T (or S) means the whole length, as in JAX; a negative
        one is refused.
    local_window_size : int or (left, right), optional
        Query ``t`` attends keys ``t - left <= s <= t + right``; an int ``w``
        is ``(w, w)``. Each side an int >= 0.
    implementation : {None, "xla", "cudnn"}
        All compute npattn's function; cuDNN's restrictions are not imitated.
    return_residual : bool
        Also return the log-sum-exp of each row, shape (B, T, N) (or (T, N)),
        in the compute dtype, ``-inf`` for a row with nothing to attend.
    dropout_p, dropout_mask, rng
        npattn's extension (JAX's function has no dropout): drop probability,
        keep-mask (True = keep) broadcastable to (B, N, T, S), and the
        generator that draws one without a keep-mask.

    Returns
    -------
    out : array, the shape of ``query`` with ``Dv`` last
    lse : array, shape (B, T, N) (``return_residual`` only)

    Notes
    -----
    Where npattn and JAX differ:

    * **Precision.** JAX computes the softmax in float32 whatever the input
      dtype, float64 included (``padded_logits.astype(float32)``): with float64
      inputs its results carry float32 rounding, which grows with the scores (relative
      to 1 + the entry, its ``dq`` differed from npattn's float64 one by a median of
      1.2e-7 with scores of standard deviation 1 and 1e-6 at 9, and by up to 3.8e-6 in
      225 small random configurations: a measurement, not a bound; docs/compat.md). npattn
      computes float64 in float64 and float16/bfloat16 in float32.
    * **A row with nothing to attend that is not query padding** (every key
      masked by ``mask``, ``key_value_seq_lengths[b] = 0``, or a window that
      leaves it no key): JAX fills masked logits with the finite
      ``F = -0.7 * finfo(float32).max`` (-2.3819763e38), so such a row gets
      uniform weights over all ``S`` keys and outputs the mean of the values,
      and its upstream gradient reaches ``value`` only (``dout / S`` to every
      key); npattn gives zeros and zero gradients. Padded query rows
      (``query_seq_lengths``) are 0 in both, with zero gradients.
    * **The residual** of either kind of row: JAX's is the log-sum-exp of
      ``S`` fill values, which rounds to ``F`` in float32, cast to the key
      dtype (``-inf`` for float16); npattn's is ``-inf`` in the compute
      dtype.
    * **The residual's gradient**: JAX stops it (``stop_gradient``); npattn's
      ``vjp`` pullback takes ``dlse=`` and differentiates it.
    * **A ``bias`` of ``-inf`` on every key a row may attend**: JAX's ``F``
      replaces only the logits the masks mask, and ``-inf < F``. If they
      masked ``m`` of the row's keys, ``0 < m < S``, JAX gives the row uniform
      weights over those ``m`` keys (the mean of their values, ``dout / m`` to
      each in ``value``, residual ``F``); if they masked none, NaN (residual
      ``-inf``, NaN gradients whatever the upstream gradient). npattn gives
      zeros, a residual of ``-inf`` and zero gradients.
    """
    # [B, T, N, H], [B, S, K, H], [B, S, K, Dv] -> [B, T, N, Dv]
    return _dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                  query_seq_lengths=query_seq_lengths,
                                  key_value_seq_lengths=key_value_seq_lengths,
                                  local_window_size=local_window_size,
                                  implementation=implementation, return_residual=return_residual,
                                  dropout_p=dropout_p, dropout_mask=dropout_mask, rng=rng)[0]


def _jax_window(local_window_size: Any) -> Optional[tuple]:
    """JAX's ``local_window_size`` (int or pair) as npattn's ``window``."""
    if local_window_size is None:
        return None
    w = (local_window_size, local_window_size) if _is_int(local_window_size) else local_window_size
    if not isinstance(w, (tuple, list)) or len(w) != 2 or not all(_is_int(n) for n in w):
        raise TypeError(f"local_window_size: expected None, an int or a pair (left, right) of ints, "
                        f"got {V.described(local_window_size)}")
    if w[0] < 0 or w[1] < 0:
        raise ValueError(f"local_window_size: expected sides >= 0, got {local_window_size!r}")
    return int(w[0]), int(w[1])


def _to_4d(name: str, x: Any, xp: Any) -> Any:
    """``x`` with leading axes of length 1 up to 4 axes, as JAX's ``_ensure_4d``."""
    if len(x.shape) > 4:
        raise ValueError(f"{name}: expected at most 4 axes, broadcastable to (B, N, T, S), "
                         f"got shape {V.shape_of(x)}")
    return xp.reshape(x, (1,) * (4 - len(x.shape)) + tuple(x.shape))


def _seq_valid(xp: Any, name: str, lengths: Any, B: int, L: int, device: Any) -> Any:
    """Bool [B, L]: position ``l < lengths[b]``."""
    n = _int_list(name, lengths, "sequence lengths (B,)")
    if len(n) != B:
        raise ValueError(f"{name}: expected shape (B,) = ({B},), got ({len(n)},)")
    if any(x < 0 for x in n):
        raise ValueError(f"{name}: expected lengths >= 0, got {n}")
    pos = xp.arange(L, device=device)  # [L]
    # a length past L leaves every position valid, as L does; as L it fits the library's
    # integers (10**30 was an overflow in torch and an object array in NumPy)
    lens = xp.asarray([min(x, L) for x in n], device=device)  # [B]
    return xp.expand_dims(pos, axis=0) < xp.expand_dims(lens, axis=1)  # [B, L]


@_keeps_callers_generator
def _dot_product_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                           scale: Optional[float] = None, is_causal: bool = False,
                           query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
                           local_window_size: Any = None, implementation: Optional[str] = None,
                           return_residual: bool = False, dropout_p: float = 0.0,
                           dropout_mask: Any = None, rng: Any = None) -> tuple[Any, GradsOf]:
    """``dot_product_attention``'s result and its ``grads_of`` (for ``vjp``)."""
    # [B, T, N, H], [B, S, K, H], [B, S, K, Dv] -> [B, T, N, Dv]
    V.check_choice("implementation", implementation, (None, "xla", "cudnn"))
    names = (("query", query, "(B, T, N, H)"), ("key", key, "(B, S, K, H)"),
             ("value", value, "(B, S, K, Dv)"))
    for name, t, layout in names:
        if not (hasattr(t, "shape") and hasattr(t, "dtype")):
            raise TypeError(f"{name}: expected an array {layout} or without B, got {V.type_name(t)}")
    if len(query.shape) not in (3, 4):
        raise ValueError(f"query: expected 4 axes (B, T, N, H) or 3 (T, N, H), got shape {V.shape_of(query)}")
    batched = len(query.shape) == 4
    for name, t, layout in names:
        _check_rank(name, t, 4 if batched else 3, layout if batched else layout.replace("B, ", ""))
    xp = namespace(query, key, value, names=("query", "key", "value"))
    # the checks read the arrays as given, in JAX's layout: without B, axis a of (B, T, N, H)
    # is a - 1 (the core's checks would name the (B, N, T, H) views made below)
    o = 0 if batched else 1
    T, N, H = (int(n) for n in query.shape[-3:])
    S, K = (int(n) for n in key.shape[-3:-1])
    if batched:
        for name, t in (("key", key), ("value", value)):
            _check_axis(name, t, 0, int(query.shape[0]), "the batch of query")
    _check_axis("key", key, 3 - o, H, "the head width of query")
    _check_axis("value", value, 1 - o, S, "the length S of key")
    _check_axis("value", value, 2 - o, K, "the heads K of key")
    _check_sizes("query", query, ((1 - o, "query length T"), (2 - o, "head count N"),
                                  (3 - o, "head width H")))
    _check_sizes("key", key, ((1 - o, "key length S"), (2 - o, "head count K")))
    _check_sizes("value", value, ((3 - o, "value width Dv"),))  # (flash_attn_func's "headdim")
    q, k, v = (t if batched else xp.expand_dims(t, axis=0) for t in (query, key, value))
    B = int(q.shape[0])
    gqa = _gqa(query, key, name="key", axis=2 - o, layout="(B, S, K, H)" if batched else "(S, K, H)",
               q_axis=2 - o, q_name="query")
    window = _jax_window(local_window_size)
    V.check_bool("return_residual", return_residual)
    dev = device_of(q)
    target = (B, N, T, S)

    # what may be attended: mask AND the padding of queries and keys   [B|1, N|1, T, S]
    allowed = None
    if mask is not None:
        V.check_array("mask", mask, xp, dev, where="like query", library="that of query")
        if mask.dtype != xp.bool:
            raise TypeError(f"mask: expected a bool array (True = takes part; an additive mask goes "
                            f"to bias), got dtype {V.dtype_name(mask.dtype)}")
        allowed = _to_4d("mask", mask, xp)
        V.check_broadcasts_to("mask", V.shape_of(allowed), target, "(B, N, T, S)")
    if query_seq_lengths is not None:
        qv = _seq_valid(xp, "query_seq_lengths", query_seq_lengths, B, T, dev)  # [B, T]
        qv = xp.reshape(qv, (B, 1, T, 1))
        allowed = qv if allowed is None else xp.logical_and(allowed, qv)
    if key_value_seq_lengths is not None:
        kv = _seq_valid(xp, "key_value_seq_lengths", key_value_seq_lengths, B, S, dev)  # [B, S]
        kv = xp.reshape(kv, (B, 1, 1, S))
        allowed = kv if allowed is None else xp.logical_and(allowed, kv)
    bias4 = None
    a_mask = allowed
    if bias is not None:
        V.check_floating_array("bias", bias, xp, dev, like="query")
        bias4 = _to_4d("bias", bias, xp)
        V.check_broadcasts_to("bias", V.shape_of(bias4), target, "(B, N, T, S)")
        a_mask = bias4 if allowed is None else xp.where(allowed, bias4, scalar(xp, -math.inf, bias4))
    renames = {"q": "query", "k": "key", "v": "value", "mask": "bias" if bias is not None else "mask"}
    with V.argument_names(renames):
        out, cache = A.sdpa_forward(
            _swap_lh(xp, q), _swap_lh(xp, k), _swap_lh(xp, v), mask=a_mask, is_causal=is_causal,
            scale=scale, dropout_p=dropout_p, dropout_mask=dropout_mask, rng=rng, enable_gqa=gqa,
            window=window,
        )  # [B, N, T, Dv]
    out = _swap_lh(xp, out)  # [B, T, N, Dv]
    if not batched:
        out = out[0, ...]  # [T, N, Dv]
    result = out
    if return_residual:
        lse = xp.permute_dims(cache.lse, (0, 2, 1))  # [B, N, T] -> [B, T, N]
        result = (out, lse if batched else lse[0, ...])

    def grads_of(dout: Any, dlse: Any) -> dict:
        # [B, T, N, Dv], [B, T, N] -> query, key, value, bias shapes
        _check_dout(dout, out)
        _check_dlse(dlse, (B, T, N) if batched else (T, N), returned=bool(return_residual),
                    fn="dot_product_attention", flag="return_residual=True")
        d4 = dout if batched else xp.expand_dims(dout, axis=0)
        dl = None
        if dlse is not None:
            dl = xp.permute_dims(dlse if batched else xp.expand_dims(dlse, axis=0), (0, 2, 1))
        g = A.sdpa_backward(_swap_lh(xp, d4), cache, dlse=dl)
        dq, dk, dv = (_swap_lh(xp, t) for t in (g.dq, g.dk, g.dv))  # [B, T, N, H], ...
        if not batched:
            dq, dk, dv = dq[0, ...], dk[0, ...], dv[0, ...]
        grads = {"query": dq, "key": dk, "value": dv}
        if bias is not None:  # the mask given to the core was bias, or where(allowed, bias, -inf)
            grads["bias"] = xp.reshape(F.sum_to_shape(xp, g.dmask, V.shape_of(bias4)),
                                       tuple(bias.shape))
        return grads

    return result, grads_of


# --------------------------------------------------------------------------
# vector-Jacobian products

#: each public function and the private forward that also returns its ``grads_of``
_FORWARDS: dict = {
    flash_attn_func: _flash_attn_func,
    flash_attn_varlen_func: _flash_attn_varlen_func,
    flash_attn_with_kvcache: _flash_attn_with_kvcache,
    flash_attn_qkvpacked_func: _flash_attn_qkvpacked_func,
    flash_attn_kvpacked_func: _flash_attn_kvpacked_func,
    flash_attn_varlen_qkvpacked_func: _flash_attn_varlen_qkvpacked_func,
    flash_attn_varlen_kvpacked_func: _flash_attn_varlen_kvpacked_func,
    scaled_dot_product_attention: _scaled_dot_product_attention,
    dot_product_attention: _dot_product_attention,
}


def _positional_names(fn: Callable) -> list:
    """The names of ``fn``'s parameters that a positional argument can fill, in order."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def vjp(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, Callable[..., tuple]]:
    """Run ``fn(*args, **kwargs)``, one of this module's functions, and return its result and
    a pullback for the gradients of its positional arguments.

    Parameters
    ----------
    fn : callable
        One of ``flash_attn_func``, ``flash_attn_varlen_func``,
        ``flash_attn_with_kvcache``, ``flash_attn_qkvpacked_func``,
        ``flash_attn_kvpacked_func``, ``flash_attn_varlen_qkvpacked_func``,
        ``flash_attn_varlen_kvpacked_func``, ``scaled_dot_product_attention``,
        ``dot_product_attention``.
    *args, **kwargs
        Its arguments, as in a direct call.

    Returns
    -------
    result
        What ``fn(*args, **kwargs)`` returns (a tuple with
        ``return_attn_probs`` / ``return_softmax_lse`` / ``return_residual``).
    pullback : callable
        ``pullback(dout, *, dlse=None) -> tuple``. ``dout`` is the upstream
        gradient of the output ``out``, the first entry when ``fn`` returns a
        tuple (``S_dmask`` gets no gradient). ``dlse``, optional, is that of
        the log-sum-exp, in the layout and dtype in which ``fn`` returns it:
        (B, Hq, Lq) for ``flash_attn_func``, ``flash_attn_with_kvcache`` and the
        packed forms of ``flash_attn_func``, (Hq, total_q) for
        ``flash_attn_varlen_func`` and its packed forms, (B, T, N) for
        ``dot_product_attention``; its entries in rows with nothing to
        attend do not matter. A ``dlse`` for a call that returned no
        log-sum-exp (``scaled_dot_product_attention``, or one without
        ``return_attn_probs`` / ``return_softmax_lse`` / ``return_residual``)
        is a ``ValueError``. The tuple has one entry per positional
        argument (``len(args)``), in order: the gradient of ``q``/``query``,
        ``k``, ``v``, ``k_cache``, ``v_cache``, a floating ``attn_mask`` or
        ``bias``, of ``qkv`` (``kv``) in its own shape, ``dq``, ``dk`` and
        ``dv`` (``dk`` and ``dv``) stacked on the packed axis; None for every
        other (``cu_seqlens*``, ``max_seqlen*``, a bool mask,
        ``alibi_slopes``, numbers). An argument passed by keyword is a
        constant of the pullback and gets no entry: pass ``attn_mask`` /
        ``bias``, or ``flash_attn_with_kvcache``'s ``k`` and ``v``,
        positionally for their gradients.

    Notes
    -----
    The gradients are ``npattn.attention.sdpa_backward``'s, with the
    forward's dropout keep-mask; ``pullback`` may be called more than once.
    """
    forward = next((f for public, f in _FORWARDS.items() if public is fn), None)
    if forward is None:
        known = ", ".join(f.__name__ for f in _FORWARDS)
        raise TypeError(f"fn: expected one of npattn.compat's functions ({known}), got {fn!r}")
    names = _positional_names(fn)[:len(args)]  # (before the forward: nothing fails after it)
    result, grads_of = forward(*args, **kwargs)

    def pullback(dout: Any, *, dlse: Any = None) -> tuple:
        grads = grads_of(dout, dlse)
        return tuple(grads.get(name) for name in names)

    return result, pullback
