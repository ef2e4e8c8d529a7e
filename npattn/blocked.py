"""Blocked scaled dot-product attention in the FlashAttention-2 style.

``sdpa_blocked_forward`` / ``sdpa_blocked_backward`` compute exactly what
``npattn.functional.sdpa_forward`` / ``sdpa_backward`` compute (same
arguments, same gradients, same conventions, the same dropout mask) but
never form a ``[B, H, Lq, Lk]`` array: memory grows linearly with the
sequence length.

* The forward walks query blocks, and inside each one the key blocks, with an
  *online softmax*: a running row maximum ``m``, a running row sum ``l`` and
  an output accumulator that is rescaled whenever ``m`` grows. It saves the
  output and, per row, the final ``m`` and ``l``.
* The backward recomputes each block of probabilities as ``p = exp(z - m) / l``
  (the dense softmax's ``e / sum(e)`` to rounding) and uses
  ``delta = rowsum(dout * out)`` in place of the row sum ``sum_j dp_j p_j`` of
  the dense softmax backward. It keeps ``m`` and ``l`` apart rather than one
  log-sum-exp ``m + log(l)``: at large scores ``m + log(l)`` rounds to the
  spacing of the numbers near ``m``, and the recomputed probabilities carry
  that error (2e-4 of ``p`` at scores of 1e4 in float32); once half the
  spacing near ``m`` exceeds ``log(l)`` it rounds away entirely (for ``l = 2``
  from 1.7e7 in float32, 9e15 in float64).

Everything is Python Array API code on ``xp``. Both loops run in a fixed
order, so results are deterministic; the block sizes are arguments and do
not change the dropout mask. For NumPy arrays, independent slices of the
leading (batch, head) axes run on the tile pool of ``npattn.backend`` (BLAS
held to one thread), each with the same loops, so the numbers do not depend
on the number of threads. ``npattn.attention`` chooses between this and the
dense implementations (``impl=``).

It returns no attention weights: they are the ``[B, H, Lq, Lk]`` array it
avoids.

Shape legend
------------
B batch, H heads (in general: any leading batch axes ``...``), Lq query
length, Lk key length, Dh key width, Dv value width, bq / bk the lengths of
one query / key block. Under grouped-query attention the leading axes are
``(B, Hkv, G)`` for q and ``(B, Hkv, 1)`` for k and v.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import numpy as np

from . import functional as F
from . import validation as V
from .backend import (
    copy_array,
    row_major,
    row_max,
    device_of,
    dropout_key,
    exclusive,
    generator_kept_on_failure,
    is_bool,
    is_dask_array,
    is_floating,
    is_numpy_array,
    keyed_keep_mask_on,
    limit_blas_threads,
    namespace,
    overflow_unreported,
    pool_threads,
    run_tasks,
    scalar,
)

__all__ = [
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
    "WINDOW_BLOCK_K",
    "default_blocks",
    "BlockedSDPACache",
    "sdpa_blocked_forward",
    "sdpa_blocked_backward",
    "sdpa_blocked_forward_core",
    "sdpa_blocked_backward_core",
    "blocked_keep_mask",
    "blocked_cache",
    "with_rows",
    "rows_of",
    "sink_start",
    "row_delta",
    "sink_grad_rows",
]

#: Default query / key block lengths. A block of scores holds B*H*bq*bk
#: entries (8 heads, 128 x 512: 2 MiB in float32).
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 512

#: Default key block length under a window bounded on the left (``window=(left, .)``):
#: a query block then meets about ``(bq + left + right) / bk`` key blocks, so shorter
#: key blocks waste less of each on keys outside the window.
WINDOW_BLOCK_K = 128


def default_blocks(block_q: Optional[int], block_k: Optional[int],
                   window_left: Optional[int]) -> tuple:
    """The (block_q, block_k) a blocked call runs with: those given, a None one replaced by
    ``DEFAULT_BLOCK_Q`` / ``DEFAULT_BLOCK_K``, or ``WINDOW_BLOCK_K`` keys when ``window_left``
    (the ``left`` of ``window=(left, right)``) bounds the left side. Not checked here.

    Parameters
    ----------
    block_q, block_k : int, optional
        The caller's block lengths; None takes the default.
    window_left : int, optional
        ``ScoreOptions.left`` of the call, the ``left`` of its window; None when the
        window is unbounded on the left.

    Returns
    -------
    block_q, block_k : int
        The given values as they are, a None one replaced.
    """
    block_q = DEFAULT_BLOCK_Q if block_q is None else block_q
    if block_k is None:  # a window bounded on the left: key blocks as short as query blocks
        block_k = DEFAULT_BLOCK_K if window_left is None else WINDOW_BLOCK_K
    return block_q, block_k


# --------------------------------------------------------------------------
# helpers


def _pad_to(xp, a, ndim: int):
    """View ``a`` with leading 1-axes added up to ``ndim`` axes (a reshape, no copy)."""
    if a.ndim == ndim:
        return a
    return xp.reshape(a, (1,) * (ndim - a.ndim) + tuple(a.shape))


def _blocks(n: int, size: int):
    """``[(0, size), (size, 2 size), ..., (., n)]``: the last block may be shorter."""
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _slice_qk(a, i0: int, i1: int, j0: int, j1: int):
    """The ``[i0:i1, j0:j1]`` block of a mask that may be broadcast (size 1) on either axis."""
    rows = slice(None) if a.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if a.shape[-1] == 1 else slice(j0, j1)
    return a[..., rows, cols]


def _grouped_mask(xp, a, ndim: int, G: int):
    """A mask over (..., Hq, Lq, Lk) as a mask over the grouped (..., Hkv, G, Lq, Lk) view."""
    a = _pad_to(xp, a, ndim)  # [..., Hq or 1, Lq or 1, Lk or 1]
    if a.shape[-3] == 1:
        return xp.expand_dims(a, axis=-3)  # [..., 1, 1, Lq, Lk]
    return xp.reshape(a, (*a.shape[:-3], a.shape[-3] // G, G, *a.shape[-2:]))


def _coords(lead: tuple, G: int):
    """Host coordinates of the leading axes, as the dropout generator counts them.

    Without GQA one array per leading axis; under GQA the grouped axes
    (Hkv, G) are one coordinate, the query head ``h = hkv * G + g``.
    """
    n = len(lead)
    axes = [np.arange(s).reshape((s,) + (1,) * (n - 1 - a)) for a, s in enumerate(lead)]
    if G > 1:  # lead = (..., Hkv, G): fold the last two into h
        axes = axes[:-2] + [axes[-2] * G + axes[-1]]
    return axes


# --------------------------------------------------------------------------
# blocked scaled dot-product attention


class BlockedSDPACache(NamedTuple):
    """What ``sdpa_blocked_backward`` needs from ``sdpa_blocked_forward``: the inputs, the
    output and each row's ``m`` and ``l`` (the probabilities are recomputed block by block)."""
    q: Any  #: [..., Lq, Dh] q (compute dtype); grouped (..., Hkv, G, Lq, Dh) under GQA
    k: Any  #: [..., Lk, Dh]; (..., Hkv, 1, Lk, Dh) under GQA
    v: Any  #: [..., Lk, Dv]
    out: Any  #: [..., Lq, Dv] output in the compute dtype, for delta = rowsum(dout * out)
    m: Any  #: [..., Lq, 1] row maximum of the scores (0 for a row with nothing to attend)
    l: Any  #: [..., Lq, 1] row sum of exp(z - m) (0 for a row with nothing to attend)
    mask: Any  #: the caller's mask in the layout of q (leading axes padded), or None
    is_causal: bool  #: whether the forward was causal (also folded into ``options``)
    dropout_mask: Any  #: caller's keep-mask in the layout of q, or None
    dropout_key: Optional[int]  #: key of the drawn mask, or None
    coords: Any  #: host coordinates of the leading axes, for the drawn mask
    dropout_p: float  #: the drop probability
    scale: float  #: the factor of the scores
    mask_shape: Optional[tuple]  #: shape of a floating mask as given, for dmask
    block_q: int  #: query rows per block
    block_k: int  #: keys per block
    groups: int  #: G; the caller's shapes are restored from q_shape / k_shape
    q_shape: tuple  #: shape of q as given
    k_shape: tuple  #: shape of k as given
    v_shape: tuple  #: shape of v as given
    in_dtype: Any  #: dtype of q, k, v; gradients are cast back to it
    options: Any = None  #: F.ScoreOptions, causal folded in, arrays in the layout of q
    lead_shape: tuple = ()  #: leading axes of the scores (q, k, v broadcast), for lse and dlse
    shapes_b: tuple = ()  #: shapes of q, k, v broadcast to lead_shape, before the grouped view
    sinks_shape: Optional[tuple] = None  #: (H,) with sinks, for dsinks

    @property
    def lse(self) -> Any:
        """(..., Lq) natural log-sum-exp of each row's final scores (sink included),
        ``m + log(l)``; -inf for a row with nothing to attend."""
        xp = namespace(self.q)
        empty = self.l == 0.0  # [..., Lq, 1]
        l_safe = xp.where(empty, scalar(xp, 1.0, self.l), self.l)
        lse = xp.where(empty, scalar(xp, -math.inf, self.l), self.m + xp.log(l_safe))
        return xp.reshape(lse, tuple(self.lead_shape) + (self.q.shape[-2],))


def _block_scores(xp, c, qs_i, k_j, i0, i1, j0, j1):
    """Steps 2.-3. of the forward for one block: the scores ``z`` of ``[i0:i1, j0:j1]``
    with every option applied, and ``s / softcap`` for the backward (None without)."""
    o = c.options
    z = qs_i @ xp.matrix_transpose(k_j)  # 2. s = (q * scale) @ k^T      [..., bq, bk]
    u = None
    if o.softcap is not None:
        with overflow_unreported():  # s / softcap = +-inf (a tiny softcap) gives tanh = +-1: the limit
            u = z / o.softcap
        z = o.softcap * xp.tanh(u)  # 2. c = softcap * tanh(s / softcap)
    cut = F.block_cut(o, i0, i1, j0, j1)  # the window crosses this block
    rows = cols = None  # the block's query and key positions, where ALiBi or the window needs them
    if o.alibi is not None or cut:
        rows = xp.arange(i0, i1, device=device_of(z))  # [bq]
        cols = xp.arange(j0, j1, device=device_of(z))  # [bk]
    if o.alibi is not None:
        z = z + F.alibi_bias(xp, o.alibi, rows, cols, o.offset)  # 2. z = c + alibi
    allowed = None
    if c.mask is not None:
        m_blk = _slice_qk(c.mask, i0, i1, j0, j1)
        if is_bool(xp, m_blk):
            allowed = m_blk
        else:
            z = z + m_blk  # 3. z = s + mask                            [..., bq, bk]
    if cut:
        allowed = F.combine_allowed(xp, allowed, F.positions_allowed(xp, rows, cols, o))
    if o.q_segments is not None:
        same = o.q_segments[..., i0:i1, :] == o.k_segments[..., j0:j1]  # [..., bq, bk]
        allowed = F.combine_allowed(xp, allowed, same)
    if allowed is not None:
        z = xp.where(allowed, z, scalar(xp, -math.inf, z))  # 3. z = where(allowed, z, -inf)
    return z, u


def _block_skipped(xp, c, i0, i1, j0, j1) -> bool:
    """Whether block ``[i0:i1, j0:j1]`` has nothing to attend by the window (causal
    included) or the segments: the forward and the backward skip it (its ``p`` is 0)."""
    o = c.options
    if not F.block_visible(o, i0, i1, j0, j1):
        return True
    if o.q_segments is not None and not is_dask_array(o.q_segments):  # (a lazy array's
        # answer would be computed here, one compute per block: its blocks are not skipped)
        same = o.q_segments[..., i0:i1, :] == o.k_segments[..., j0:j1]  # [..., bq, bk]
        return not bool(xp.any(same))
    return False


def _block_keep(xp, c, i0, i1, j0, j1, device):
    """Keep-mask of one block: the caller's, sliced, or drawn from the key (the one mask),
    in ``xp`` on ``device`` (on CuPy hashed there: no host draw, no copy)."""
    if c.dropout_mask is not None:
        return _slice_qk(c.dropout_mask, i0, i1, j0, j1)
    if c.dropout_key is not None:
        return keyed_keep_mask_on(c.dropout_key, c.dropout_p, c.coords, np.arange(i0, i1),
                                  np.arange(j0, j1), xp, device)  # [..., bq, bk]
    return None


def blocked_keep_mask(cache: BlockedSDPACache, xp: Any = None) -> Any:
    """The full keep-mask (in the caller's (..., Lq, Lk) layout) that a blocked forward drew.

    For checking against the other implementations on small inputs: this
    builds the array that the blocked path avoids. Returns None when that
    forward drew no mask (no dropout, or a caller's ``dropout_mask``).

    Parameters
    ----------
    cache : BlockedSDPACache
        Of ``sdpa_blocked_forward`` (or ``sdpa_blocked_forward_core``).
    xp : namespace, optional
        Array library of the result; None: that of ``cache.q``. The mask is made on
        the device of ``cache.q``.

    Returns
    -------
    keep : bool array, shape (..., Lq, Lk), or None
        True = kept. The leading axes are ``cache.lead_shape``, those of the scores:
        (B, Hq) under grouped-query attention.
    """
    c = cache
    if c.dropout_key is None:
        return None
    xp = namespace(c.q) if xp is None else xp
    Lq, Lk = c.q.shape[-2], c.k.shape[-2]
    # the coordinates broadcast to q's leading axes: the mask is the whole grid, its own array
    keep = keyed_keep_mask_on(c.dropout_key, c.dropout_p, c.coords, np.arange(Lq), np.arange(Lk),
                              xp, device_of(c.q))  # [..., Lq, Lk] in q's (grouped) layout
    return xp.reshape(keep, tuple(c.lead_shape) + (Lq, Lk))  # [B, Hq, Lq, Lk] under GQA


def _pool_split(xp, c: BlockedSDPACache):
    """Tasks for the tile pool, or None to run the loops once over every slice.

    The (batch, head) slices of the leading axes are independent: each task
    takes a contiguous range of the longest leading axis that q and k both
    have at full length (v's leading axes are k's), and writes only its own
    slices of the outputs, so the result does not depend on the number of
    threads or their order.
    NumPy arrays only, and not with a floating mask (its gradient sums over
    broadcast axes across slices): that runs in one piece.
    """
    if not (is_numpy_array(c.q) and c.q.ndim > 2) or c.mask_shape is not None:
        return None
    n = pool_threads()
    lead = c.q.shape[:-2]
    shared = [a for a in range(len(lead)) if c.k.shape[a] == lead[a]]
    if n <= 1 or not shared:
        return None
    axis = max(shared, key=lambda a: lead[a])
    size = lead[axis]
    if size < 2:
        return None
    n = min(n, size)
    bounds = [size * t // n for t in range(n + 1)]
    pre = (slice(None),) * axis
    return [(pre + (slice(a, b),),) for a, b in zip(bounds[:-1], bounds[1:])]


def _slice_cache(c: BlockedSDPACache, index: tuple):
    """Cache ``c`` restricted to ``index`` (slices of the leading axes); broadcast (size-1) axes stay."""

    def cut(a):
        if a is None:
            return None
        return a[tuple(s if a.shape[ax] != 1 else slice(None) for ax, s in enumerate(index))]

    coords = [cut(np.broadcast_to(a, (1,) * (len(c.q.shape) - 2 - a.ndim) + a.shape))
              for a in c.coords] if c.coords is not None else None
    o = c.options
    o = o._replace(alibi=cut(o.alibi), sinks=cut(o.sinks), q_segments=cut(o.q_segments),
                   k_segments=cut(o.k_segments))
    return c._replace(q=cut(c.q), k=cut(c.k), v=cut(c.v), mask=cut(c.mask),
                      dropout_mask=cut(c.dropout_mask), out=cut(c.out), m=cut(c.m),
                      l=cut(c.l), coords=coords, options=o)


def _forward_loops(xp, c):
    """Steps 1.-9. of ``sdpa_blocked_forward`` on the arrays of cache ``c``: ``(out, m, l)``."""
    q, k, v = c.q, c.k, c.v
    work, dev = q.dtype, device_of(q)
    batch = tuple(np.broadcast_shapes(tuple(q.shape[:-2]), tuple(k.shape[:-2])))
    Lq, Lk, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    drop_scale = 1.0 / (1.0 - c.dropout_p)
    zero, one = scalar(xp, 0.0, q), scalar(xp, 1.0, q)  # [] the constants of the wheres below
    qs = q * c.scale  # 1.                                          [..., Lq, Dh]
    outs, ms, ls = [], [], []
    sinks = c.options.sinks  # [..., 1, 1] or None
    for i0, i1 in _blocks(Lq, c.block_q):
        qs_i = qs[..., i0:i1, :]  # [..., bq, Dh]
        m = xp.full(batch + (i1 - i0, 1), -math.inf, dtype=work, device=dev)  # [..., bq, 1]
        l = xp.zeros(batch + (i1 - i0, 1), dtype=work, device=dev)  # [..., bq, 1]
        if sinks is not None:  # the sink is a first key with score `sink` and no value
            m, l = sink_start(xp, sinks, l)
        acc = xp.zeros(batch + (i1 - i0, Dv), dtype=work, device=dev)  # [..., bq, Dv]
        for j0, j1 in _blocks(Lk, c.block_k):
            if _block_skipped(xp, c, i0, i1, j0, j1):
                continue  # window, causal or segments: nothing in this block is attended
            z, _ = _block_scores(xp, c, qs_i, k[..., j0:j1, :], i0, i1, j0, j1)  # 2.-3.
            m_new = xp.maximum(m, row_max(xp, z))  # 4.                       [..., bq, 1]
            shift = xp.where(m_new == -math.inf, zero, m_new)  # no -inf - -inf on empty rows
            e = xp.exp(z - shift)  # 5.                                   [..., bq, bk]
            alpha = xp.exp(m - shift)  # 0 on a row's first block unless a sink set m  [..., bq, 1]
            l = alpha * l + xp.sum(e, axis=-1, keepdims=True)  # 6.       [..., bq, 1]
            keep = _block_keep(xp, c, i0, i1, j0, j1, dev)
            if keep is not None:
                e = xp.where(keep, e * drop_scale, zero)  # 7. dropout(e)  [..., bq, bk]
            acc = alpha * acc + e @ v[..., j0:j1, :]  # 7.                  [..., bq, Dv]
            m = m_new
        empty = l == 0.0  # a row with nothing to attend                  [..., bq, 1]
        outs.append(acc / xp.where(empty, one, l))  # 8.                   [..., bq, Dv]
        ms.append(xp.where(empty, zero, m))  # 9. the final row maximum   [..., bq, 1]
        ls.append(l)  # 9.                                                [..., bq, 1]
    out = xp.concat(outs, axis=-2)  # [..., Lq, Dv]
    return out, xp.concat(ms, axis=-2), xp.concat(ls, axis=-2)  # [..., Lq, 1] each


def sdpa_blocked_forward(q: Any, k: Any, v: Any, *, mask: Any = None, is_causal: bool = False,
                         scale: Optional[float] = None, dropout_p: float = 0.0,
                         dropout_mask: Any = None, rng: Any = None, enable_gqa: bool = False,
                         align: str = "top_left", window: Any = None,
                         softcap: Optional[float] = None, alibi_slopes: Any = None,
                         sinks: Any = None, q_segments: Any = None, k_segments: Any = None,
                         block_q: Optional[int] = None, block_k: Optional[int] = None
                         ) -> tuple[Any, BlockedSDPACache]:
    """Scaled dot-product attention by blocks, ``softmax(q k^T * scale + mask) v``.

    The same function as ``npattn.functional.sdpa_forward``, with the same
    arguments, computed one ``[bq, bk]`` block of scores at a time with an
    online softmax. For each query block ``i`` (rows ``i0:i1``), starting
    from ``m = -inf``, ``l = 0``, ``acc = 0``, and for each key block ``j``
    (columns ``j0:j1``; blocks that the window, ``is_causal`` or the segments
    leave wholly unattended are skipped), with ``m = sink``, ``l = 1`` in
    place of ``-inf``, 0 under attention sinks:

    1. ``qs = q * scale``                               (once, [..., Lq, Dh])
    2. ``s = qs_i @ k_j^T``, then ``softcap * tanh(s / softcap)`` and ALiBi's
       ``- slope * |i + o - j|``                         [..., bq, bk]
    3. ``z = s + mask`` (floating), then ``where(allowed, z, -inf)`` (boolean mask, window,
       segments)
    4. ``m' = max(m, rowmax(z))``, shifted by ``m* = m'`` or 0 where ``m' = -inf``
    5. ``e = exp(z - m*)``, ``alpha = exp(m - m*)``     [..., bq, bk], [..., bq, 1]
    6. ``l = alpha * l + rowsum(e)``                      [..., bq, 1]
    7. ``acc = alpha * acc + dropout(e) @ v_j``          [..., bq, Dv]

    and after the last key block

    8. ``out_i = acc / l`` (0 for a row with ``l = 0``: nothing to attend)
    9. ``m_i``, ``l_i`` saved for the backward (``m = 0`` for such a row);
       ``cache.lse = m + log(l)``.

    ``acc / l`` equals ``dropout(p) @ v`` with ``p = e_all / l``: every
    ``e`` and ``acc`` is scaled by ``exp(m_old - m_new)`` when the maximum
    grows, so all of them end up relative to the final row maximum.

    Parameters
    ----------
    q, k, v, mask, is_causal, scale, dropout_p, dropout_mask, rng, enable_gqa
        As ``npattn.functional.sdpa_forward``. Dropout from ``rng`` draws the
        same keep-mask as the reference, whatever the block sizes.
    align, window, softcap, alibi_slopes, sinks, q_segments, k_segments
        The kernel options of ``npattn.functional.sdpa_forward``.
    block_q, block_k : int, optional
        Query and key block lengths; need not divide ``Lq`` / ``Lk``.
        Default ``DEFAULT_BLOCK_Q`` / ``DEFAULT_BLOCK_K`` (``WINDOW_BLOCK_K``
        when ``window`` bounds the left side).

    Returns
    -------
    out : array, shape (..., Lq, Dv), dtype of ``q``
    cache : BlockedSDPACache (no attention weights)

    Notes
    -----
    Memory beyond inputs and output: ``O(B H (bq bk + Lq Dh))`` (the scaled copy
    of ``q``). float16 and bfloat16 inputs are computed in float32, the output cast back.
    """
    # [..., Lq, Dh], [..., Lk, Dh], [..., Lk, Dv] -> [..., Lq, Dv]
    V.check_sdpa_inputs(q, k, v, mask=mask, dropout_mask=dropout_mask, dropout_p=dropout_p,
                        scale=scale, is_causal=is_causal, enable_gqa=enable_gqa, rng=rng)
    # checked here, before the core draws its dropout key from rng (its own check comes after)
    block_q = V.check_positive_int("block_q", block_q, allow_none=True)
    block_k = V.check_positive_int("block_k", block_k, allow_none=True)
    G = F.gqa_groups(q, k, v, enable_gqa)
    options = F.checked_options(q, k, v, enable_gqa=enable_gqa, align=align, window=window,
                                softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                q_segments=q_segments, k_segments=k_segments)
    with generator_kept_on_failure(rng):  # a failed call leaves the caller's generator as it was
        return sdpa_blocked_forward_core(q, k, v, mask=mask, is_causal=is_causal, scale=scale,
                                         dropout_p=dropout_p, dropout_mask=dropout_mask, rng=rng,
                                         groups=G, block_q=block_q, block_k=block_k,
                                         options=options)


def sdpa_blocked_forward_core(q: Any, k: Any, v: Any, *, mask: Any, is_causal: bool,
                              scale: Optional[float], dropout_p: float, dropout_mask: Any, rng: Any,
                              groups: int, block_q: Optional[int] = None,
                              block_k: Optional[int] = None,
                              options: Optional[F.ScoreOptions] = None
                              ) -> tuple[Any, BlockedSDPACache]:
    """``sdpa_blocked_forward`` on arguments that are already checked (``options`` from
    ``functional.score_options``); for the dispatcher.

    Parameters
    ----------
    q, k, v, mask, is_causal, scale, dropout_p, dropout_mask, rng
        As ``sdpa_blocked_forward``; a key is drawn from ``rng`` when ``dropout_p > 0``
        and no ``dropout_mask`` is given.
    groups : int
        G = Hq // Hkv under grouped-query attention (``functional.gqa_groups``), else 1.
    block_q, block_k : int, optional
        As ``sdpa_blocked_forward``; None: the defaults (``default_blocks``).
    options : ScoreOptions, optional
        The kernel options; None: none (``is_causal`` is folded in either way).

    Returns
    -------
    out : array, shape (..., Lq, Dv), dtype of ``q``
    cache : BlockedSDPACache
    """
    # [..., Lq, Dh], [..., Lk, Dh], [..., Lk, Dv] -> [..., Lq, Dv]
    with exclusive():  # BLAS is held to one thread inside (npattn.backend: threads)
        return _forward(q, k, v, mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                        dropout_mask=dropout_mask, rng=rng, groups=groups, block_q=block_q,
                        block_k=block_k, options=options)


def blocked_cache(q: Any, k: Any, v: Any, *, mask: Any, is_causal: bool, scale: Optional[float],
                  dropout_p: float, dropout_mask: Any, groups: int, key: Optional[int] = None,
                  block_q: Optional[int] = None, block_k: Optional[int] = None,
                  options: Optional[F.ScoreOptions] = None) -> BlockedSDPACache:
    """The cache of a blocked forward before its loops run: inputs in the compute dtype and
    the grouped layout, ``out``, ``m`` and ``l`` still None (``with_rows`` fills them).

    For implementations that run the blocked steps on pieces of a larger problem
    (``npattn.chunked``): they compute the row statistics of the whole problem and
    hand each piece's back with ``with_rows`` before calling ``sdpa_blocked_backward``.
    Arguments as ``sdpa_blocked_forward_core``, checked already; ``key`` is
    the key drawn for a generated keep-mask (None: ``dropout_mask`` or no dropout).

    Parameters
    ----------
    q, k, v, mask, is_causal, scale, dropout_p, dropout_mask, groups
        As ``sdpa_blocked_forward_core`` (``rng`` aside: the key stands for it).
    key : int, optional
        From ``backend.dropout_key``.
    block_q, block_k, options
        As ``sdpa_blocked_forward_core``.

    Returns
    -------
    cache : BlockedSDPACache
        With ``out``, ``m`` and ``l`` None.
    """
    xp = namespace(q, k, v, mask, dropout_mask)
    o = F.causal_options(is_causal, options)
    block_q, block_k = default_blocks(block_q, block_k, o.left)
    # as Python ints: a NumPy one would do i0 + size in its own dtype and wrap
    block_q = V.check_positive_int("block_q", block_q)
    block_k = V.check_positive_int("block_k", block_k)
    G = groups
    q_shape, k_shape, v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    sinks_shape = None if o.sinks is None else (int(o.sinks.shape[-3]),)
    lead = V.scores_lead(q, k, v, enable_gqa=G > 1)
    # row-major NumPy matrices: the same bits in any layout, on the pool's slices as on the whole
    q, k, v = (row_major(t) for t in (q, k, v))
    # leading axes that broadcast (torch's SDPA) become equal, as views; backward sums them back
    batch = lead[:-1] if G > 1 else lead
    q, k, v = (xp.broadcast_to(t, batch + tuple(t.shape[-3 if G > 1 else -2:])) for t in (q, k, v))
    shapes_b = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
    in_dtype = q.dtype
    work = F.compute_dtype(xp, in_dtype)
    if work != in_dtype:
        q, k, v = (xp.astype(t, work) for t in (q, k, v))
        if mask is not None and is_floating(xp, mask):
            mask = xp.astype(mask, work)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    mask_shape = tuple(mask.shape) if mask is not None and is_floating(xp, mask) else None
    ndim = q.ndim
    if G > 1:  # grouped view: q (..., Hkv, G, Lq, Dh); k, v (..., Hkv, 1, Lk, D) broadcast over G
        qb = shapes_b[0]
        q = xp.reshape(q, (*qb[:-3], qb[-3] // G, G, *qb[-2:]))
        k, v = xp.expand_dims(k, axis=-3), xp.expand_dims(v, axis=-3)
    if mask is not None:
        mask = _grouped_mask(xp, mask, ndim, G) if G > 1 else _pad_to(xp, mask, ndim)
    if dropout_mask is not None:
        dropout_mask = (_grouped_mask(xp, dropout_mask, ndim, G) if G > 1
                        else _pad_to(xp, dropout_mask, ndim))

    def layout(a):  # an option array over the scores (..., H|1, Lq|1, Lk|1) in q's layout
        if a is None:
            return None
        return _grouped_mask(xp, a, ndim, G) if G > 1 else _pad_to(xp, a, ndim)

    o = o._replace(alibi=layout(o.alibi), sinks=layout(o.sinks), q_segments=layout(o.q_segments),
                   k_segments=layout(o.k_segments))
    return BlockedSDPACache(  # out, m and l are filled in after the loops
        q=q, k=k, v=v, out=None, m=None, l=None, mask=mask, is_causal=bool(is_causal),
        dropout_mask=dropout_mask, dropout_key=key,
        coords=_coords(tuple(q.shape[:-2]), G) if key is not None else None,
        dropout_p=float(dropout_p), scale=scale, mask_shape=mask_shape, block_q=block_q,
        block_k=block_k, groups=G, q_shape=q_shape, k_shape=k_shape, v_shape=v_shape,
        in_dtype=in_dtype, options=o, lead_shape=lead, shapes_b=shapes_b, sinks_shape=sinks_shape,
    )  # fmt: skip


def with_rows(cache: BlockedSDPACache, out: Any, m: Any, l: Any) -> BlockedSDPACache:
    """``cache`` with the output ``out`` (..., Lq, Dv) and row statistics ``m``, ``l``
    (..., Lq, 1) given in the caller's layout, in the compute dtype."""
    xp = namespace(cache.q)
    rows = tuple(cache.q.shape[:-1])
    return cache._replace(out=xp.reshape(out, rows + (cache.v.shape[-1],)),
                          m=xp.reshape(m, rows + (1,)), l=xp.reshape(l, rows + (1,)))


def rows_of(cache: BlockedSDPACache) -> tuple[Any, Any, Any]:
    """The output and row statistics ``(out, m, l)`` of a blocked forward, in the caller's
    layout ((..., Lq, Dv), (..., Lq, 1), (..., Lq, 1)) and the compute dtype."""
    xp = namespace(cache.q)
    rows = tuple(cache.lead_shape) + (cache.q.shape[-2],)
    return (xp.reshape(cache.out, rows + (cache.v.shape[-1],)), xp.reshape(cache.m, rows + (1,)),
            xp.reshape(cache.l, rows + (1,)))


def _forward(q, k, v, *, mask, is_causal, scale, dropout_p, dropout_mask, rng, groups, block_q,
             block_k, options):
    key = None
    if dropout_p > 0.0 and dropout_mask is None:
        key = dropout_key(rng)  # the one draw of every implementation
    c = blocked_cache(q, k, v, mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                      dropout_mask=dropout_mask, groups=groups, key=key,
                      block_q=block_q, block_k=block_k, options=options)
    xp = namespace(c.q, c.k, c.v, c.mask, c.dropout_mask)
    q, work, in_dtype, v_shape = c.q, c.q.dtype, c.in_dtype, c.v_shape
    split = _pool_split(xp, c)
    if split is None:
        with limit_blas_threads(1 if is_numpy_array(q) else None):  # small GEMMs: one thread
            out, m, l = _forward_loops(xp, c)
    else:  # NumPy: independent slices of the leading axes on the tile pool
        batch = tuple(q.shape[:-2])
        out = xp.empty(batch + (q.shape[-2], c.v.shape[-1]), dtype=work, device=device_of(q))
        m = xp.empty(batch + (q.shape[-2], 1), dtype=work, device=device_of(q))
        l = xp.empty(batch + (q.shape[-2], 1), dtype=work, device=device_of(q))

        def task(index):
            out[index], m[index], l[index] = _forward_loops(xp, _slice_cache(c, index))

        run_tasks(task, split, pool_threads())  # fewer slices than threads: the same pool, not a new one

    cache = c._replace(out=out, m=m, l=l)
    # the caller's layout, as a copy: the cache's out must not change if the caller writes into it
    out = xp.reshape(copy_array(xp, out), c.lead_shape + (q.shape[-2], v_shape[-1]))
    if work != in_dtype:
        out = xp.astype(out, in_dtype)
    return out, cache


def sdpa_blocked_backward(dout: Any, cache: BlockedSDPACache, *, dlse: Any = None) -> F.SDPAGrads:
    """Gradients of blocked scaled dot-product attention, recomputing each block.

    With ``delta = rowsum(dout * out) - dlse``  [..., Lq, 1], for each key block
    ``j`` and, inside it, each query block ``i`` (the forward's blocks, the
    same ones skipped):

    * ``p = exp(z - m) / l``: the softmax block, from steps 2.-3. and 9.
    * ``a = dropout(p)``;  ``dv_j += a^T @ dout_i``
    * ``da = dout_i @ v_j^T``;  ``dp = dropout_backward(da)``
    * ``dz = p * (dp - delta_i)``  (the dense ``p * (dp - rowsum(dp * p) + dlse)``:
      ``rowsum(dp * p) = rowsum(da * a) = dout . (a @ v) = rowsum(dout * out)``)
    * ``dmask += dz`` summed to the mask's shape; ``ds = dz * sech^2(s / softcap)``
      under a softcap, else ``ds = dz``
    * ``dq_i += ds @ k_j * scale``;  ``dk_j += ds^T @ qs_i``

    and, per row, ``dsink = p_sink * (-delta)`` with ``p_sink = exp(sink - m) / l``,
    summed over the batch and the rows of each head.

    Under grouped-query attention ``dk_j`` and ``dv_j`` are summed over the G
    query heads that share a K/V head (the broadcast axis).

    Parameters
    ----------
    dout : array, shape of the output (..., Lq, Dv)
    cache : BlockedSDPACache
    dlse : array, shape (..., Lq), optional
        Upstream gradient of ``cache.lse``, in its dtype; entries on rows with
        nothing to attend (lse = -inf) do not matter.

    Returns
    -------
    F.SDPAGrads
        ``dq``, ``dk``, ``dv`` in the shapes of q, k, v; ``dmask`` of the
        floating mask's own shape, None for a boolean or no mask; ``dsinks``
        (H,) with sinks, else None.
    """
    # [..., Lq, Dv] -> [..., Lq, Dh], [..., Lk, Dh], [..., Lk, Dv], mask shape, [H]
    V.check_cache("cache", cache, BlockedSDPACache, "sdpa_blocked_forward")
    xp, device = namespace(cache.q), device_of(cache.q)
    rows = tuple(cache.lead_shape) + (int(cache.q.shape[-2]),)  # that of cache.lse: [..., Lq]
    V.check_grad("dout", dout, shape=rows + (int(cache.v.shape[-1]),), dtype=cache.in_dtype,
                 xp=xp, device=device, of="the forward's out")
    if dlse is not None:
        V.check_grad("dlse", dlse, shape=rows, dtype=cache.m.dtype, xp=xp, device=device,
                     of="cache.lse")
    return sdpa_blocked_backward_core(dout, cache, dlse=dlse)


def sdpa_blocked_backward_core(dout: Any, cache: BlockedSDPACache, *,
                               dlse: Any = None) -> F.SDPAGrads:
    """``sdpa_blocked_backward`` on arguments that are already checked; for
    ``npattn.chunked``, whose pairs hand each piece's rows (``with_rows``) and ``dlse``
    [..., Lq, 1]."""
    # [..., Lq, Dv] -> [..., Lq, Dh], [..., Lk, Dh], [..., Lk, Dv], mask shape, [H]
    with exclusive():  # BLAS is held to one thread inside (npattn.backend: threads)
        return _backward(dout, cache, dlse)


def sink_start(xp: Any, sinks: Any, zeros: Any) -> tuple[Any, Any]:
    """A row's statistics after its sink, the first key (score ``sink``, no value): ``m = sink``,
    ``l = exp(sink - m) = 1``, and ``l = 0`` for a sink of -inf (no sink); ``sinks`` [..., 1, 1],
    ``zeros`` [..., bq, 1] of the rows' shape and dtype. The blocked forward starts each row
    here; ``npattn.chunked`` merges it once per row."""
    return zeros + sinks, xp.where(sinks == -math.inf, zeros, zeros + 1.0)  # [..., bq, 1] x 2


def row_delta(xp: Any, dout: Any, out: Any, l: Any, dlse: Any = None) -> Any:
    """``delta = rowsum(dout * out) - dlse`` [..., Lq, 1] of the softmax backward; ``dlse``
    [..., Lq, 1] or None.

    8. ``out = acc / l = a @ v`` row by row, so ``sum_j dp_j p_j = rowsum(dout * out)``; ``lse =
    m + log(l)`` adds ``d lse / dz_j = p_j``. A row with nothing to attend (``l = 0``) has
    lse -inf whatever its scores: its dlse does not count (an inf there would give 0 * inf)."""
    delta = xp.sum(dout * out, axis=-1, keepdims=True)  # [..., Lq, 1]
    if dlse is not None:
        delta = delta - xp.where(l == 0.0, scalar(xp, 0.0, dlse), dlse)
    return delta


def sink_grad_rows(xp: Any, sinks: Any, m: Any, l: Any, delta: Any) -> Any:
    """Each row's gradient of its sink, a logit with no value (``dp_sink = 0``):
    ``dz_sink = p_sink * (0 - delta)``, ``p_sink = exp(sink - m) / l`` [..., Lq, 1]. ``l >=
    exp(sink - m) > 0``, except under a sink of -inf on a row with nothing to attend."""
    l_safe = xp.where(l == 0.0, scalar(xp, 1.0, l), l)  # [..., Lq, 1]
    return -(xp.exp(sinks - m) / l_safe * delta)


def _backward(dout, cache: BlockedSDPACache, dlse=None):
    c = cache
    xp = namespace(dout, c.q)
    rows = tuple(c.q.shape[:-1])  # grouped under GQA
    dout = row_major(xp.reshape(dout, rows + (c.v.shape[-1],)))
    work = c.q.dtype
    if dout.dtype != work:
        dout = xp.astype(dout, work)
    dlse_rows = None if dlse is None else xp.reshape(xp.astype(dlse, work), rows + (1,))
    delta = row_delta(xp, dout, c.out, c.l, dlse_rows)  # [..., Lq, 1]
    split = _pool_split(xp, c)
    if split is None:
        with limit_blas_threads(1 if is_numpy_array(c.q) else None):
            dq, dk, dv, dmask = _backward_loops(dout, delta, c)
    else:  # NumPy: independent slices of the leading axes on the tile pool
        dq, dk, dv = (xp.empty(a.shape, dtype=work, device=device_of(a)) for a in (c.q, c.k, c.v))

        def task(index):
            dq[index], dk[index], dv[index], _ = _backward_loops(dout[index], delta[index],
                                                                 _slice_cache(c, index))

        run_tasks(task, split, pool_threads())  # fewer slices than threads: the same pool, not a new one
        dmask = None  # split only without a floating mask
    dsinks = None
    if c.options.sinks is not None:
        dsink = sink_grad_rows(xp, c.options.sinks, c.m, c.l, delta)  # [..., Lq, 1]
        dsinks = xp.reshape(F.sum_to_shape(xp, dsink, tuple(c.options.sinks.shape)), c.sinks_shape)
    qb, kb, vb = c.shapes_b
    dq = F.sum_to_shape(xp, xp.reshape(dq, qb), c.q_shape)  # broadcast leading axes summed back
    dk = F.sum_to_shape(xp, xp.reshape(dk, kb), c.k_shape)
    dv = F.sum_to_shape(xp, xp.reshape(dv, vb), c.v_shape)
    if c.in_dtype != dq.dtype:
        dq, dk, dv = (xp.astype(t, c.in_dtype) for t in (dq, dk, dv))
        if dmask is not None:
            dmask = xp.astype(dmask, c.in_dtype)
        if dsinks is not None:  # sinks are of q's dtype (validation.check_kernel_options)
            dsinks = xp.astype(dsinks, c.in_dtype)
    return F.SDPAGrads(dq, dk, dv, dmask, dsinks)


def _backward_loops(dout, delta, cache: BlockedSDPACache):
    """The body of ``sdpa_blocked_backward`` on the arrays of ``cache`` (compute dtype)."""
    c = cache
    xp = namespace(dout, c.q)
    q, k, v = c.q, c.k, c.v
    work = q.dtype
    Lq, Dh = q.shape[-2], q.shape[-1]
    Lk, Dv = k.shape[-2], v.shape[-1]
    q_lead, k_lead = tuple(q.shape[:-2]), tuple(k.shape[:-2])
    dev = device_of(q)
    drop_scale = 1.0 / (1.0 - c.dropout_p)
    q_blocks, k_blocks = _blocks(Lq, c.block_q), _blocks(Lk, c.block_k)
    zero = scalar(xp, 0.0, q)  # [] the constant of the dropout wheres below
    qs = q * c.scale  # 1.                                           [..., Lq, Dh]
    l_safe = xp.where(c.l == 0.0, scalar(xp, 1.0, c.l), c.l)  # rows with nothing to attend: p = 0 anyway

    fmask = None if c.mask_shape is None else c.mask  # floating mask, in q's layout
    dmask_parts: dict = {}  # (row block, column block) -> dmask block
    dq_parts = [None] * len(q_blocks)
    dks, dvs = [], []
    for jb, (j0, j1) in enumerate(k_blocks):
        k_j, v_j = k[..., j0:j1, :], v[..., j0:j1, :]  # [..., bk, Dh], [..., bk, Dv]
        dk_j = xp.zeros(k_lead + (j1 - j0, Dh), dtype=work, device=dev)  # [..., bk, Dh]
        dv_j = xp.zeros(k_lead + (j1 - j0, Dv), dtype=work, device=dev)  # [..., bk, Dv]
        for ib, (i0, i1) in enumerate(q_blocks):
            if _block_skipped(xp, c, i0, i1, j0, j1):
                continue  # the forward skipped this block: p = 0 there
            qs_i, do_i = qs[..., i0:i1, :], dout[..., i0:i1, :]  # [..., bq, Dh], [..., bq, Dv]
            # 2.-3. and 9.: z as in the forward; p = exp(z - m) / l, 0 where masked
            z, u = _block_scores(xp, c, qs_i, k_j, i0, i1, j0, j1)  # [..., bq, bk]
            p = xp.exp(z - c.m[..., i0:i1, :]) / l_safe[..., i0:i1, :]  # [..., bq, bk]
            # 7. acc += dropout(p) @ v_j: dv_j += a^T @ dout_i, da = dout_i @ v_j^T
            keep = _block_keep(xp, c, i0, i1, j0, j1, dev)
            a = p if keep is None else xp.where(keep, p * drop_scale, zero)  # [..., bq, bk]
            dv_j = dv_j + F.sum_to_shape(xp, xp.matrix_transpose(a) @ do_i, dv_j.shape)
            dp = do_i @ xp.matrix_transpose(v_j)  # [..., bq, bk]
            if keep is not None:
                dp = xp.where(keep, dp * drop_scale, zero)  # dropout backward
            # 4.-6. p = softmax(z): dz = p * (dp - sum_j dp_j p_j + dlse) = p * (dp - delta)
            dz = p * (dp - delta[..., i0:i1, :])  # [..., bq, bk]
            # 3. z = s + mask: dmask = dz, summed to the mask's shape (0 where masked: p = 0)
            if fmask is not None:
                mq, mk = fmask.shape[-2] != 1, fmask.shape[-1] != 1
                target = tuple(fmask.shape[:-2]) + (i1 - i0 if mq else 1, j1 - j0 if mk else 1)
                g = F.sum_to_shape(xp, dz, target)
                where_ = (ib if mq else 0, jb if mk else 0)
                prev = dmask_parts.get(where_)
                dmask_parts[where_] = g if prev is None else prev + g
            # 2. z = softcap * tanh(u) + alibi, u = s / softcap: ds = dz * sech^2(u) (= 1 - tanh^2)
            ds = dz if u is None else dz * F.sech_squared(xp, u)  # [..., bq, bk]
            # 2. s = qs_i @ k_j^T: dqs_i = ds @ k_j, dk_j = ds^T @ qs_i; 1. qs = q * scale
            dq_i = (ds @ k_j) * c.scale  # [..., bq, Dh]
            dq_parts[ib] = dq_i if dq_parts[ib] is None else dq_parts[ib] + dq_i
            dk_j = dk_j + F.sum_to_shape(xp, xp.matrix_transpose(ds) @ qs_i, dk_j.shape)
        dks.append(dk_j)
        dvs.append(dv_j)

    dq_parts = [
        xp.zeros(q_lead + (i1 - i0, Dh), dtype=work, device=dev) if d is None else d
        for d, (i0, i1) in zip(dq_parts, q_blocks)
    ]
    dq = xp.concat(dq_parts, axis=-2)  # [..., Lq, Dh]
    dk = xp.concat(dks, axis=-2)  # [..., Lk, Dh]
    dv = xp.concat(dvs, axis=-2)  # [..., Lk, Dv]

    dmask = None
    if fmask is not None:
        dmask = _assemble_dmask(xp, dmask_parts, fmask.shape, q_blocks, k_blocks, work, dev)
        dmask = xp.reshape(dmask, c.mask_shape)  # drop the leading axes added in the forward
    return dq, dk, dv, dmask  # compute dtype: _backward casts all four to the input's


def _assemble_dmask(xp, parts, shape, q_blocks, k_blocks, dtype, device):
    """Concatenate the per-block mask gradients; blocks never visited are 0."""
    shape = tuple(shape)
    lead = shape[:-2]
    rows_b = q_blocks if shape[-2] != 1 else [(0, 1)]
    cols_b = k_blocks if shape[-1] != 1 else [(0, 1)]
    rows = []
    for ib, (i0, i1) in enumerate(rows_b):
        row = []
        for jb, (j0, j1) in enumerate(cols_b):
            g = parts.get((ib, jb))
            if g is None:
                g = xp.zeros(lead + (i1 - i0, j1 - j0), dtype=dtype, device=device)
            row.append(g)
        rows.append(xp.concat(row, axis=-1))
    return xp.concat(rows, axis=-2)  # [mask shape]
