"""Blockwise scaled dot-product attention in the FlashAttention-2 style.

``sdpa_blocked_forward`` / ``sdpa_blocked_backward`` compute exactly what
``npattn.functional.sdpa_forward`` / ``sdpa_backward`` compute (same
arguments, same gradients, same conventions) but never form a
``[B, H, Lq, Lk]`` array: memory grows linearly with the sequence length.

* The forward walks query blocks, and inside each one the key blocks, with an
  *online softmax*: a running row maximum ``m``, a running row sum ``l`` and
  an output accumulator that is rescaled whenever ``m`` grows. It saves only
  the output and the per-row log-sum-exp ``lse = m + log(l)``.
* The backward recomputes each block of probabilities from the saved
  ``lse`` (``p = exp(s - lse)``, already normalised) and uses
  ``D = rowsum(dout * out)`` in place of the row sum ``sum_j dp_j p_j`` of
  the dense softmax backward.

Both loops run in a fixed order, so results are deterministic; the block
sizes are arguments. For NumPy arrays, independent slices of the leading
(batch, head) axes run on the tile pool of ``npattn._fast`` (BLAS held to one
thread there), each with the same loops, so the numbers do not depend on the
number of threads; dropout drawn from the generator and a floating mask run
in one piece (``_pool_split``). ``attention_forward`` / ``attention_backward`` choose
between this path and the dense one (``impl="auto" | "dense" | "blocked"``).

What the blocked path does not do
---------------------------------
* It returns no attention weights (they are the ``[B, H, Lq, Lk]`` array it
  avoids). ``impl="auto"`` with weights requested uses the dense path;
  ``impl="blocked"`` with weights requested raises ``ValueError``.
* Dropout with a generator (``dropout_p > 0``, no ``dropout_mask``) draws the
  keep-mask block by block, each block from its own generator keyed by
  ``(key, first query row, first key column)`` where ``key`` is one integer
  drawn from ``rng``. The mask is therefore deterministic for a given ``rng``
  and block sizes, but it is not the mask the dense path draws from the same
  ``rng`` (that one is drawn in one piece). ``blocked_keep_mask`` rebuilds
  the full mask of a forward for checking. With a caller's ``dropout_mask``
  both paths use that mask and agree exactly.

Shape legend
------------
B batch, H heads (in general: any leading batch axes ``...``), Lq query
length, Lk key length, Dh head width, bq / bk the lengths of one query / key
block. All code uses only the Python Array API standard through ``xp``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

from . import _fast
from . import functional as F
from . import validation as V
from .backend import (
    device_of,
    is_bool,
    is_floating,
    keep_mask,
    limit_blas_threads,
    make_rng,
    namespace,
)

__all__ = [
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
    "AUTO_BLOCKED_MIN_SCORES",
    "AUTO_BLOCKED_MAX_DENSE_SCORES",
    "BLAS_THREADS",
    "BlockedSDPACache",
    "sdpa_blocked_forward",
    "sdpa_blocked_backward",
    "blocked_keep_mask",
    "select_impl",
    "attention_forward",
    "attention_backward",
    "GQABlockedCache",
]

#: Default query / key block lengths, read at call time (assigning new values
#: here tunes every caller, the module included). A block of scores holds
#: B*H*bq*bk entries (8 heads, 128 x 512: 2 MiB in float32).
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 512

#: ``impl="auto"`` takes the blocked path when ``Lq * Lk`` reaches this
#: (2**25 = 33.5 M scores per head, e.g. 8192 x 4096). Measured with both
#: paths on the pool (docs/performance-blocked.md): at 1x8192x512x8 (2**26 per
#: head) the blocked path was as fast as the dense one (3.5 against 3.6 s)
#: in a sixth of the memory; at 1x4096x512x8 and below the dense path was
#: 1.1-1.3x faster.
AUTO_BLOCKED_MIN_SCORES = 2**25

#: ``impl="auto"`` also takes the blocked path when the dense probabilities,
#: ``B * H * Lq * Lk`` entries, would reach this (2**28: 1 GiB in float32),
#: whatever the length: then memory, not speed, decides.
AUTO_BLOCKED_MAX_DENSE_SCORES = 2**28

#: BLAS threads while the blocked forward and backward run (None: leave BLAS
#: as it is). Their matmuls are small ([bq, Dh] x [Dh, bk]); on a 2-core
#: machine shared with other work, OpenBLAS with 2 threads ran them 4-15x
#: slower than with 1 (docs/performance-blocked.md). Needs threadpoolctl; a
#: no-op without it.
BLAS_THREADS = 1

IMPLS = ("auto", "dense", "blocked")


# --------------------------------------------------------------------------
# helpers


def _pad_to(xp, a, ndim: int):
    """View ``a`` with leading 1-axes added up to ``ndim`` axes (a reshape, no copy)."""
    if a.ndim == ndim:
        return a
    return xp.reshape(a, (1,) * (ndim - a.ndim) + tuple(a.shape))


def _check_mask_shape(name: str, a, target: tuple):
    """``a`` must broadcast to ``target`` without growing it."""
    shape = tuple(a.shape)
    ok = len(shape) <= len(target) and all(
        s == 1 or s == t for s, t in zip(reversed(shape), reversed(target))
    )
    if not ok:
        raise ValueError(f"{name}: expected a shape broadcastable to {target}, got {shape}")


def _blocks(n: int, size: int):
    """``[(0, size), (size, 2 size), ..., (., n)]``: the last block may be shorter."""
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _slice_qk(a, i0: int, i1: int, j0: int, j1: int):
    """The ``[i0:i1, j0:j1]`` block of a mask that may be broadcast (size 1) on either axis."""
    rows = slice(None) if a.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if a.shape[-1] == 1 else slice(j0, j1)
    return a[..., rows, cols]


def _with_blas_threads(f):
    """Run ``f`` with host BLAS held to ``BLAS_THREADS`` threads."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        with limit_blas_threads(BLAS_THREADS):
            return f(*args, **kwargs)

    return wrapper


def _check_block(name: str, size):
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{name}: expected a positive int, got {size!r}")


def _block_keep(key: int, batch: tuple, i0, i1, j0, j1, p: float, xp, device):
    """Keep-mask of block ``[i0:i1, j0:j1]``, from the generator keyed by ``(key, i0, j0)``."""
    rng = make_rng([key, i0, j0])
    return keep_mask(rng, batch + (i1 - i0, j1 - j0), p, xp, device)  # [..., bq, bk] bool


def blocked_keep_mask(cache: "BlockedSDPACache", xp=None):
    """The full keep-mask ``[..., Lq, Lk]`` that a blocked forward drew from its generator.

    For checking against the dense path on small inputs: this builds the
    ``[..., Lq, Lk]`` array that the blocked path avoids. Returns None when
    that forward drew no mask (no dropout, or a caller's ``dropout_mask``).
    """
    if cache.dropout_key is None:
        return None
    xp = namespace(cache.q) if xp is None else xp
    batch, Lq, Lk = tuple(cache.q.shape[:-2]), cache.q.shape[-2], cache.k.shape[-2]
    dev = device_of(cache.q)
    rows = []
    for i0, i1 in _blocks(Lq, cache.block_q):
        row = [
            _block_keep(cache.dropout_key, batch, i0, i1, j0, j1, cache.dropout_p, xp, dev)
            for j0, j1 in _blocks(Lk, cache.block_k)
        ]
        rows.append(xp.concat(row, axis=-1))
    return xp.concat(rows, axis=-2)  # [..., Lq, Lk] bool


# --------------------------------------------------------------------------
# blocked scaled dot-product attention


class BlockedSDPACache(NamedTuple):
    q: Any  # [..., Lq, Dh] q * scale (compute dtype): the scale is folded into q once
    k: Any  # [..., Lk, Dh]
    v: Any  # [..., Lk, Dh]
    out: Any  # [..., Lq, Dh] output in the compute dtype, for D = rowsum(dout * out)
    lse: Any  # [..., Lq, 1] log-sum-exp of each score row (0 for a row with nothing to attend)
    mask: Any  # the caller's mask with leading axes up to q.ndim, or None
    is_causal: bool
    dropout_mask: Any  # caller's keep-mask with leading axes up to q.ndim, or None
    dropout_key: Optional[int]  # key of the block generators when the mask was drawn
    dropout_p: float
    scale: float
    mask_shape: Optional[tuple]  # shape of a floating mask as given, for dmask
    block_q: int
    block_k: int
    in_dtype: Any  # dtype of q, k, v; gradients are cast back to it


def _block_scores(xp, c, qs_i, k_j, i0, i1, j0, j1):
    """Steps 2.-3. of the forward for one block: masked scores ``z`` of ``[i0:i1, j0:j1]``.

    ``c`` is the cache (it carries ``mask`` and ``is_causal``); entries that
    may not be attended are ``-inf``.
    """
    z = qs_i @ xp.matrix_transpose(k_j)  # 2. s = (q * scale) @ k^T      [..., bq, bk]
    allowed = None
    if c.mask is not None:
        m_blk = _slice_qk(c.mask, i0, i1, j0, j1)
        if is_bool(xp, m_blk):
            allowed = m_blk
        else:
            z = z + m_blk  # 3. z = s + mask                            [..., bq, bk]
    if c.is_causal and j1 - 1 > i0:  # the block crosses the diagonal
        i = xp.arange(i0, i1, device=device_of(z))  # [bq]
        j = xp.arange(j0, j1, device=device_of(z))  # [bk]
        causal = xp.expand_dims(i, axis=1) >= xp.expand_dims(j, axis=0)  # [bq, bk]
        allowed = causal if allowed is None else xp.logical_and(allowed, causal)
    if allowed is not None:
        z = xp.where(allowed, z, -math.inf)  # 3. z = where(allowed, z, -inf)
    return z


def _block_dropout(xp, c, batch, i0, i1, j0, j1, device):
    """Keep-mask of one block: the caller's, sliced, or drawn from the block generator."""
    if c.dropout_mask is not None:
        return _slice_qk(c.dropout_mask, i0, i1, j0, j1)
    if c.dropout_key is not None:
        return _block_keep(c.dropout_key, batch, i0, i1, j0, j1, c.dropout_p, xp, device)
    return None


def _pool_split(xp, c: BlockedSDPACache):
    """Tasks for the tile pool, or None to run the loops once over every slice.

    The (batch, head) slices of the leading axes are independent: each task
    takes a contiguous range of the longest leading axis and writes only its
    own slices of the outputs, so the result does not depend on the number of
    threads or their order (every matmul and row reduction acts per slice).
    Used for NumPy arrays only (``npattn._fast``, BLAS held to one thread in
    the pool), and not with dropout drawn from the generator (a block's
    keep-mask is drawn for all slices at once) or a floating mask (its
    gradient sums over broadcast axes across slices): those run in one piece.
    """
    if not (_fast.pools(c.q) and c.q.ndim > 2):
        return None
    if c.dropout_key is not None or c.mask_shape is not None:
        return None
    n = _fast.pool_threads()
    lead = c.q.shape[:-2]
    axis = max(range(len(lead)), key=lambda a: lead[a])
    size = lead[axis]
    if n <= 1 or size < 2:
        return None
    n = min(n, size)
    bounds = [size * t // n for t in range(n + 1)]
    pre = (slice(None),) * axis
    return [(pre + (slice(a, b),),) for a, b in zip(bounds[:-1], bounds[1:])]


def _slice_cache(c: BlockedSDPACache, index: tuple):
    """Cache ``c`` restricted to ``index`` (slices of the leading axes); broadcast (size-1) mask axes stay."""

    def cut(a):
        if a is None:
            return None
        return a[tuple(s if a.shape[ax] != 1 else slice(None) for ax, s in enumerate(index))]

    return c._replace(q=c.q[index], k=c.k[index], v=c.v[index], mask=cut(c.mask),
                      dropout_mask=cut(c.dropout_mask), out=cut(c.out), lse=cut(c.lse))


def _forward_loops(xp, c):
    """Steps 2.-9. of ``sdpa_blocked_forward`` on the arrays of cache ``c``: ``(out, lse)``."""
    qs, k, v = c.q, c.k, c.v
    work, dev = qs.dtype, device_of(qs)
    batch, Lq, Dh = tuple(qs.shape[:-2]), qs.shape[-2], qs.shape[-1]
    Lk = k.shape[-2]
    block_q, block_k, is_causal = c.block_q, c.block_k, c.is_causal
    drop_scale = 1.0 / (1.0 - c.dropout_p)
    outs, lses = [], []
    for i0, i1 in _blocks(Lq, block_q):
        qs_i = qs[..., i0:i1, :]  # [..., bq, Dh]
        m = xp.full(batch + (i1 - i0, 1), -math.inf, dtype=work, device=dev)  # [..., bq, 1]
        l = xp.zeros(batch + (i1 - i0, 1), dtype=work, device=dev)  # [..., bq, 1]
        acc = xp.zeros(batch + (i1 - i0, Dh), dtype=work, device=dev)  # [..., bq, Dh]
        for j0, j1 in _blocks(Lk, block_k):
            if is_causal and j0 > i1 - 1:
                break  # causal: this block and every later one lie above the diagonal
            z = _block_scores(xp, c, qs_i, k[..., j0:j1, :], i0, i1, j0, j1)  # 2.-3. [.., bq, bk]
            m_new = xp.maximum(m, xp.max(z, axis=-1, keepdims=True))  # 4.     [..., bq, 1]
            shift = xp.where(m_new == -math.inf, 0.0, m_new)  # no -inf - -inf on empty rows
            e = xp.exp(z - shift)  # 5.                                   [..., bq, bk]
            alpha = xp.exp(m - shift)  # 0 on the first block (m = -inf)  [..., bq, 1]
            l = alpha * l + xp.sum(e, axis=-1, keepdims=True)  # 6.       [..., bq, 1]
            keep = _block_dropout(xp, c, batch, i0, i1, j0, j1, dev)
            if keep is not None:
                e = xp.where(keep, e * drop_scale, 0.0)  # 7. dropout(e)   [..., bq, bk]
            acc = alpha * acc + e @ v[..., j0:j1, :]  # 7.                  [..., bq, Dh]
            m = m_new
        empty = l == 0.0  # a row with nothing to attend                  [..., bq, 1]
        safe_l = xp.where(empty, 1.0, l)
        outs.append(acc / safe_l)  # 8.                                    [..., bq, Dh]
        shift = xp.where(empty, 0.0, m)
        lses.append(xp.where(empty, 0.0, shift + xp.log(safe_l)))  # 9.  [..., bq, 1]
    if Lq == 0:
        out = xp.zeros(batch + (0, Dh), dtype=work, device=dev)
        lse = xp.zeros(batch + (0, 1), dtype=work, device=dev)
    else:
        out = xp.concat(outs, axis=-2)  # [..., Lq, Dh]
        lse = xp.concat(lses, axis=-2)  # [..., Lq, 1]
    return out, lse


@_with_blas_threads
def sdpa_blocked_forward(
    q,
    k,
    v,
    *,
    mask=None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    dropout_mask=None,
    rng=None,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
):
    """Scaled dot-product attention by blocks, ``softmax(q k^T * scale + mask) v``.

    The same function as ``npattn.functional.sdpa_forward``, computed one
    ``[bq, bk]`` block of scores at a time with an online softmax. For each
    query block ``i`` (rows ``i0:i1``), starting from ``m = -inf``,
    ``l = 0``, ``acc = 0``, and for each key block ``j`` (columns ``j0:j1``;
    with ``is_causal``, blocks wholly above the diagonal are skipped):

    1. ``qs = q * scale``                               (once, [..., Lq, Dh])
    2. ``s = qs_i @ k_j^T``                              [..., bq, bk]
    3. ``z = s + mask`` or ``where(allowed, s, -inf)``   (mask, causal)
    4. ``m' = max(m, rowmax(z))``, shifted by ``m* = m'`` or 0 where ``m' = -inf``
    5. ``e = exp(z - m*)``, ``alpha = exp(m - m*)``     [..., bq, bk], [..., bq, 1]
    6. ``l = alpha * l + rowsum(e)``                      [..., bq, 1]
    7. ``acc = alpha * acc + dropout(e) @ v_j``          [..., bq, Dh]

    and after the last key block

    8. ``out_i = acc / l`` (0 for a row with ``l = 0``: nothing to attend)
    9. ``lse_i = m + log(l)`` (0 for such a row), saved for the backward.

    ``acc / l`` equals ``dropout(p) @ v`` with ``p = e_all / l``: every
    ``e`` and ``acc`` is scaled by ``exp(m_old - m_new)`` when the maximum
    grows, so all of them end up relative to the final row maximum.

    Parameters
    ----------
    q : array, shape (..., Lq, Dh)
    k, v : arrays, shape (..., Lk, Dh), the same leading axes as ``q``
    mask : array broadcastable to (..., Lq, Lk), optional
        Boolean (True = may attend) or floating (added to the scaled scores,
        ``-inf`` allowed). It is sliced per block, never broadcast out.
    is_causal : bool
        Query ``i`` attends keys ``j <= i`` (top-left); ANDed with ``mask``.
    scale : float, optional
        Defaults to ``1 / sqrt(Dh)``.
    dropout_p : float
        Drop probability on the attention probabilities.
    dropout_mask : bool array broadcastable to (..., Lq, Lk), optional
        Keep-mask (True = keep), sliced per block.
    rng : int, numpy.random.Generator or None
        With ``dropout_p > 0`` and no ``dropout_mask``: one integer key is
        drawn from it, and block ``[i0:, j0:]`` draws its keep-mask from a
        generator seeded with ``(key, i0, j0)`` (see the module docstring).
    block_q, block_k : int, optional
        Query and key block lengths; need not divide ``Lq`` / ``Lk``.
        Default ``DEFAULT_BLOCK_Q`` / ``DEFAULT_BLOCK_K``.

    Returns
    -------
    out : array, shape (..., Lq, Dh), dtype of ``q``
    cache : BlockedSDPACache (no attention weights: see the module docstring)

    Notes
    -----
    Memory beyond inputs and output: ``O(B H (bq bk + Lq))``. float16 and
    bfloat16 inputs are computed in float32, the output cast back.
    """
    # [..., Lq, Dh], [..., Lk, Dh], [..., Lk, Dh] -> [..., Lq, Dh]
    V.check_sdpa_inputs(q, k, v, mask=mask, dropout_mask=dropout_mask, dropout_p=dropout_p,
                        scale=scale, is_causal=is_causal)
    xp = namespace(q, k, v, mask, dropout_mask)
    block_q = DEFAULT_BLOCK_Q if block_q is None else block_q
    block_k = DEFAULT_BLOCK_K if block_k is None else block_k
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            f"q, k, v: expected arrays of one rank >= 2, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if (
        tuple(k.shape) != tuple(v.shape)
        or tuple(k.shape[:-2]) != tuple(q.shape[:-2])
        or (k.shape[-1] != q.shape[-1])
    ):
        raise ValueError(
            f"q, k, v: expected shapes (..., Lq, Dh), (..., Lk, Dh), (..., Lk, Dh) with the "
            f"same leading axes, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    batch, Lq, Dh = tuple(q.shape[:-2]), q.shape[-2], q.shape[-1]
    Lk = k.shape[-2]
    target = batch + (Lq, Lk)
    if mask is not None:
        _check_mask_shape("mask", mask, target)
    if dropout_mask is not None:
        _check_mask_shape("dropout_mask", dropout_mask, target)
        if not is_bool(xp, dropout_mask):
            raise TypeError(f"dropout_mask: expected a bool array, got dtype {dropout_mask.dtype}")

    in_dtype = q.dtype
    work = F._compute_dtype(xp, in_dtype)
    if work != in_dtype:
        q, k, v = (xp.astype(t, work) for t in (q, k, v))
        if mask is not None and is_floating(xp, mask):
            mask = xp.astype(mask, work)
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    mask_shape = tuple(mask.shape) if mask is not None and is_floating(xp, mask) else None
    if mask is not None:
        mask = _pad_to(xp, mask, q.ndim)  # [..., Lq or 1, Lk or 1]

    # dropout: the caller's keep-mask, or a key for per-block generators
    keep_all, key = None, None
    if dropout_p > 0.0 or dropout_mask is not None:
        if dropout_mask is not None:
            keep_all = _pad_to(xp, dropout_mask, q.ndim)
        else:
            key = int(make_rng(rng).integers(0, 2**63))

    qs = q * scale  # 1.                                              [..., Lq, Dh]
    c = BlockedSDPACache(  # out and lse are filled in after the loops
        q=qs, k=k, v=v, out=None, lse=None, mask=mask, is_causal=bool(is_causal),
        dropout_mask=keep_all, dropout_key=key, dropout_p=float(dropout_p), scale=scale,
        mask_shape=mask_shape, block_q=block_q, block_k=block_k, in_dtype=in_dtype,
    )  # fmt: skip

    split = _pool_split(xp, c)
    if split is None:
        out, lse = _forward_loops(xp, c)
    else:  # NumPy: independent slices of the leading axes on the tile pool
        out = xp.empty(batch + (Lq, Dh), dtype=work, device=device_of(q))  # [..., Lq, Dh]
        lse = xp.empty(batch + (Lq, 1), dtype=work, device=device_of(q))  # [..., Lq, 1]

        def task(index):
            out[index], lse[index] = _forward_loops(xp, _slice_cache(c, index))

        _fast._run_tiles(task, split)

    cache = c._replace(out=out, lse=lse)
    if work != in_dtype:
        out = xp.astype(out, in_dtype)
    return out, cache


@_with_blas_threads
def sdpa_blocked_backward(dout, cache: BlockedSDPACache):
    """Gradients of blocked scaled dot-product attention, recomputing each block.

    With ``D = rowsum(dout * out)``  [..., Lq, 1], for each key block ``j``
    and, inside it, each query block ``i`` (the forward's blocks):

    * ``p = exp(z - lse)``: the softmax block, from steps 2.-3. and 9.
    * ``a = dropout(p)``;  ``dv_j += a^T @ dout_i``
    * ``da = dout_i @ v_j^T``;  ``dp = dropout_backward(da)``
    * ``ds = p * (dp - D_i)``  (the dense ``p * (dp - rowsum(dp * p))``:
      ``rowsum(dp * p) = rowsum(da * a) = dout . (a @ v) = rowsum(dout * out)``)
    * ``dq_i += ds @ k_j * scale``;  ``dk_j += ds^T @ qs_i``;
      ``dmask += ds`` summed to the mask's shape.

    Returns
    -------
    dq : array, shape (..., Lq, Dh)
    dk : array, shape (..., Lk, Dh)
    dv : array, shape (..., Lk, Dh)
    dmask : array of the floating mask's own shape, or None for a boolean or
        no mask.
    """
    # [..., Lq, Dh] -> [..., Lq, Dh], [..., Lk, Dh], [..., Lk, Dh], mask shape
    c = cache
    xp = namespace(dout, c.q)
    split = _pool_split(xp, c)
    if split is None:
        return _backward_loops(dout, c)
    # NumPy: independent slices of the leading axes on the tile pool
    dq, dk, dv = (xp.empty(a.shape, dtype=c.in_dtype, device=device_of(a)) for a in (c.q, c.k, c.v))

    def task(index):
        dq[index], dk[index], dv[index], _ = _backward_loops(dout[index], _slice_cache(c, index))

    _fast._run_tiles(task, split)
    return dq, dk, dv, None  # split only without a floating mask: no dmask


def _backward_loops(dout, cache: BlockedSDPACache):
    """The body of ``sdpa_blocked_backward`` on the arrays of ``cache``."""
    c = cache
    xp = namespace(dout, c.q)
    qs, k, v = c.q, c.k, c.v
    work = qs.dtype
    if dout.dtype != work:
        dout = xp.astype(dout, work)
    batch, Lq, Dh = tuple(qs.shape[:-2]), qs.shape[-2], qs.shape[-1]
    Lk = k.shape[-2]
    dev = device_of(qs)
    drop_scale = 1.0 / (1.0 - c.dropout_p)
    q_blocks, k_blocks = _blocks(Lq, c.block_q), _blocks(Lk, c.block_k)

    # 8. out = acc / l = a @ v row by row, so sum_j dp_j p_j = rowsum(dout * out)
    Dr = xp.sum(dout * c.out, axis=-1, keepdims=True)  # [..., Lq, 1]

    pad_mask = None if c.mask_shape is None else c.mask  # floating mask, padded
    dmask_parts: dict = {}  # (row block, column block) -> dmask block
    dq_parts = [None] * len(q_blocks)
    dks, dvs = [], []
    for jb, (j0, j1) in enumerate(k_blocks):
        k_j, v_j = k[..., j0:j1, :], v[..., j0:j1, :]  # [..., bk, Dh]
        dk_j = xp.zeros(batch + (j1 - j0, Dh), dtype=work, device=dev)  # [..., bk, Dh]
        dv_j = xp.zeros(batch + (j1 - j0, Dh), dtype=work, device=dev)  # [..., bk, Dh]
        for ib, (i0, i1) in enumerate(q_blocks):
            if c.is_causal and j0 > i1 - 1:
                continue  # the forward skipped this block: p = 0 there
            qs_i, do_i = qs[..., i0:i1, :], dout[..., i0:i1, :]  # [..., bq, Dh]
            # 2.-3. and 9.: z as in the forward; p = exp(z - lse) = e / l, 0 where masked
            z = _block_scores(xp, c, qs_i, k_j, i0, i1, j0, j1)  # [..., bq, bk]
            p = xp.exp(z - c.lse[..., i0:i1, :])  # [..., bq, bk]
            # 7. acc += dropout(p) @ v_j: dv_j += a^T @ dout_i, da = dout_i @ v_j^T
            keep = _block_dropout(xp, c, batch, i0, i1, j0, j1, dev)
            a = p if keep is None else xp.where(keep, p * drop_scale, 0.0)  # [..., bq, bk]
            dv_j = dv_j + xp.matrix_transpose(a) @ do_i  # [..., bk, Dh]
            dp = do_i @ xp.matrix_transpose(v_j)  # [..., bq, bk]
            if keep is not None:
                dp = xp.where(keep, dp * drop_scale, 0.0)  # dropout backward
            # 4.-6. p = softmax(z): dz = p * (dp - sum_j dp_j p_j) = p * (dp - D)
            ds = p * (dp - Dr[..., i0:i1, :])  # [..., bq, bk]
            # 3. z = s + mask: dmask = dz, summed to the mask's shape (0 where masked: p = 0)
            if pad_mask is not None:
                mq, mk = pad_mask.shape[-2] != 1, pad_mask.shape[-1] != 1
                target = tuple(pad_mask.shape[:-2]) + (
                    i1 - i0 if mq else 1,
                    j1 - j0 if mk else 1,
                )
                g = F.sum_to_shape(xp, ds, target)
                where_ = (ib if mq else 0, jb if mk else 0)
                prev = dmask_parts.get(where_)
                dmask_parts[where_] = g if prev is None else prev + g
            # 2. s = qs_i @ k_j^T: dqs_i = ds @ k_j, dk_j = ds^T @ qs_i; 1. qs = q * scale
            dq_i = (ds @ k_j) * c.scale  # [..., bq, Dh]
            dq_parts[ib] = dq_i if dq_parts[ib] is None else dq_parts[ib] + dq_i
            dk_j = dk_j + xp.matrix_transpose(ds) @ qs_i  # [..., bk, Dh]
        dks.append(dk_j)
        dvs.append(dv_j)

    def zeros(shape):
        return xp.zeros(shape, dtype=work, device=dev)

    dq_parts = [
        zeros(batch + (i1 - i0, Dh)) if d is None else d for d, (i0, i1) in zip(dq_parts, q_blocks)
    ]
    dq = xp.concat(dq_parts, axis=-2) if dq_parts else zeros(batch + (0, Dh))  # [..., Lq, Dh]
    dk = xp.concat(dks, axis=-2) if dks else zeros(batch + (0, Dh))  # [..., Lk, Dh]
    dv = xp.concat(dvs, axis=-2) if dvs else zeros(batch + (0, Dh))  # [..., Lk, Dh]

    dmask = None
    if pad_mask is not None:
        dmask = _assemble_dmask(xp, dmask_parts, pad_mask.shape, q_blocks, k_blocks, work, dev)
        dmask = xp.reshape(dmask, c.mask_shape)  # drop the leading 1-axes added in the forward

    if c.in_dtype != work:
        dq, dk, dv = (xp.astype(t, c.in_dtype) for t in (dq, dk, dv))
        if dmask is not None:
            dmask = xp.astype(dmask, c.in_dtype)
    return dq, dk, dv, dmask


def _assemble_dmask(xp, parts, shape, q_blocks, k_blocks, dtype, device):
    """Concatenate the per-block mask gradients; blocks never visited are 0."""
    shape = tuple(shape)
    lead = shape[:-2]
    rows_b = q_blocks if shape[-2] != 1 else [(0, 1)]
    cols_b = k_blocks if shape[-1] != 1 else [(0, 1)]
    if not rows_b or not cols_b:
        return xp.zeros(shape, dtype=dtype, device=device)
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


# --------------------------------------------------------------------------
# choosing a path


def select_impl(impl: str, Lq: int, Lk: int, *, need_weights: bool = False,
                n_slices: int = 1) -> str:
    """``"dense"`` or ``"blocked"`` for ``impl`` in ``"auto" | "dense" | "blocked"``.

    ``"auto"`` picks ``"blocked"`` when no weights are needed and either
    ``Lq * Lk >= AUTO_BLOCKED_MIN_SCORES`` (long sequences, where it is as
    fast) or ``n_slices * Lq * Lk >= AUTO_BLOCKED_MAX_DENSE_SCORES`` (the
    dense probabilities of all ``n_slices = B * H`` heads would be large),
    else ``"dense"``. ``"blocked"`` with
    ``need_weights`` raises ``ValueError`` (the blocked path has no weights).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "blocked" and need_weights:
        raise ValueError(
            "impl='blocked' cannot return attention weights (it never forms them); "
            "use need_weights=False, or impl='dense' or 'auto'"
        )
    if impl == "auto":
        long = Lq * Lk >= AUTO_BLOCKED_MIN_SCORES
        long = long or n_slices * Lq * Lk >= AUTO_BLOCKED_MAX_DENSE_SCORES
        return "blocked" if long and not need_weights else "dense"
    return impl


class GQABlockedCache(NamedTuple):
    """Cache of the blocked path under grouped-query attention."""

    inner: "BlockedSDPACache"  # the blocked cache, with K/V repeated to Hq heads
    groups: int  # G = Hq // Hkv


def attention_forward(
    q,
    k,
    v,
    *,
    impl: str = "auto",
    need_weights: bool = False,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    enable_gqa: bool = False,
    **kwargs,
):
    """Scaled dot-product attention on the path ``select_impl`` chooses.

    ``kwargs`` are those of ``sdpa_forward`` (mask, is_causal, scale,
    dropout_p, dropout_mask, rng). Returns ``(out, cache)``; pass the cache to
    ``attention_backward``. With ``need_weights`` the dense path is used and
    ``cache.probs`` holds the weights.

    Grouped-query attention (``enable_gqa``) on the blocked path repeats each
    K/V head ``G = Hq // Hkv`` times (query head h uses K/V head h // G, as in
    SDPA; memory linear in Lk) and the backward sums dk, dv over each group.
    """
    # [..., Lq, Dh], [..., Lk, Dh], [..., Lk, Dh] -> [..., Lq, Dh]
    path = select_impl(impl, q.shape[-2], k.shape[-2], need_weights=need_weights,
                       n_slices=math.prod(q.shape[:-2]))
    if path == "dense":
        return F.sdpa_forward(q, k, v, enable_gqa=enable_gqa, **kwargs)
    G = F._gqa_groups(q, k, v, enable_gqa)
    if G > 1:
        xp = namespace(q, k, v)
        k = xp.repeat(k, G, axis=-3)  # [B, Hq, Lk, Dh]
        v = xp.repeat(v, G, axis=-3)  # [B, Hq, Lk, Dh]
    out, cache = sdpa_blocked_forward(q, k, v, block_q=block_q, block_k=block_k, **kwargs)
    return out, (cache if G == 1 else GQABlockedCache(cache, G))


def attention_backward(dout, cache):
    """The backward that matches the cache: blocked or dense. Returns ``(dq, dk, dv, dmask)``."""
    if isinstance(cache, GQABlockedCache):
        dq, dk, dv, dmask = sdpa_blocked_backward(dout, cache.inner)
        xp = namespace(dk)
        *lead, Hq, Lk, Dh = dk.shape
        grouped = (*lead, Hq // cache.groups, cache.groups, Lk, Dh)
        # k was repeated G times along the heads: sum dk, dv over each group
        dk = xp.sum(xp.reshape(dk, grouped), axis=-3)  # [B, Hkv, Lk, Dh]
        dv = xp.sum(xp.reshape(dv, grouped), axis=-3)  # [B, Hkv, Lk, Dh]
        return dq, dk, dv, dmask
    if isinstance(cache, BlockedSDPACache):
        return sdpa_blocked_backward(dout, cache)
    return F.sdpa_backward(dout, cache)
