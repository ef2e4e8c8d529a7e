"""The NumPy kernel of dense attention: the reference's steps, tiled and in place.

``npattn.functional.sdpa_forward`` / ``sdpa_backward`` are the readable
reference. This module computes the same function for NumPy arrays, faster;
it is one of the implementations that ``npattn.attention`` dispatches to
(``impl="numpy"``, and ``"auto"``/``"dense"`` on NumPy arrays), and nothing
in ``functional`` calls it. ``tests/test_attention.py`` checks that every
implementation gives the same numbers in float64. The comments number the
steps as the reference's ``sdpa_forward`` does: 1. scores, 4. the mask and the
window, 5. softmax, 6. dropout, 7. ``out = a v`` (the kernel options 2.-3. are
not taken here).

What is different from the reference, and why it is faster:

* **Tiles.** The work is split into independent tiles of one batch entry
  (several, when all its heads fit in one tile and the call keeps at least
  ``TILE_MIN_TASKS`` tiles), a group of K/V heads (with their G query heads)
  and a block of query rows, of about ``TILE_ELEMS`` scores. A block's
  scores go into a per-tile scratch array, and ``exp`` writes ``e`` from it
  into the cache's array. When the call has at least ``POOL_MIN_SCORES``
  scores in all (and more than one tile), tiles run on the tile pool of
  ``npattn.backend`` with BLAS held to one thread (NumPy releases the GIL in
  ufuncs and BLAS); the numbers do not depend on the number of threads.
* **Row sums by BLAS.** The softmax denominator is ``e @ ones``, a
  matrix-vector product, instead of ``sum(e, axis=-1)`` (NumPy reduces one
  short row at a time).
* **In place.** The scores are computed into the tile's scratch array
  (``matmul(..., out=)``), the softmax steps update it in place and ``exp``
  writes ``e`` into the array the cache keeps: no temporaries of shape
  (B, H, Lq, Lk).
* **No max shift where the scores are bounded.** By Cauchy-Schwarz
  ``|s_ij| <= |q_i * scale| max_j |k_j|``. A block whose rows all have a
  bound of at most ``EXP_BOUND`` (and no floating mask) takes ``e = exp(s)``:
  the softmax does not change with the shift (docs/derivations.md), and
  without it ``exp`` cannot overflow or underflow there either. Other blocks
  subtract each row's maximum as the reference does.
* **Normalised on the small side.** The cache keeps ``e`` and the row factors
  ``ps = 1 / rowsum(e)`` (``p = e * ps``, formed only when the weights are
  asked for: ``NumpySDPACache.probs``). ``out = (e v) * ps`` scales (r, Dv)
  rows instead of (r, Lk); the backward moves ``ps`` (and the dropout's
  ``1 / (1 - p_drop)``) onto the rows of dout, ``do' = dout * ps / (1 - p_drop)``:
  ``dv = (e * keep)^T do'`` and ``ds = e * (keep * (do' v^T) - delta * ps)``.
  Without dropout ``- delta * ps`` is one more column of the GEMM,
  ``[do', -delta ps] @ [v, 1]^T``, and ``ds`` is one multiply by ``e``.
* **Scale folded into q.** ``s = (q * scale) @ k^T``: one pass over (Lq, Dh)
  instead of one over (Lq, Lk).
* **dv in one GEMM.** Without dropout and without a window (causal included),
  ``dv = e^T do'`` is one GEMM over all query rows of a tile instead of a sum of
  per-block GEMMs.
* **Causal blocks skipped.** A block of query rows ``i0:i1`` only meets keys
  ``0:i1``; the blocks above the diagonal are never computed.
* **Lean cache.** Only ``e`` and its row factors (the probabilities before
  dropout), the keep-mask and a copy of the output are kept. The dropped
  probabilities are recomputed in the backward, tile by tile, and the
  softmax backward uses
  ``delta = rowsum(dp * p) = rowsum(dout * out)`` (true with or without
  dropout, since ``out = a @ v``), a pass over (Lq, Dv) instead of (Lq, Lk).
* **Grouped heads as a broadcast.** Under grouped-query attention the G query
  heads of one K/V head are an axis of their own, ``q[b, hkv, g]``, and
  ``k[b, hkv]`` is broadcast over it: K and V are never repeated.
* **No head copies.** Outputs and gradients are written in the merged
  (B, L, H, D) layout, so ``merge_heads`` is a reshape and not a copy; the
  backward's GEMMs write dq there directly, BLAS taking the layout's row stride
  (``out=``), and dv when it is one GEMM, dk when one block meets every row and
  key without GQA (else they are summed block by block and copied there). A
  tile copies only its own heads' K and V (and in the backward q and dout)
  into contiguous arrays, scale folded into q and k: (L, Dh) each, against
  the (r, Lk) scores, and BLAS runs faster on them than on strided views.
* **Backward blocks of their own size.** The backward's blocks hold
  ``BACKWARD_TILE_FACTOR`` times the forward's scores (1; docs/performance.md
  has the measurements), except where a window
  (causal included) cuts the blocks: the forward wrote ``e`` only in the
  columns of its own blocks, and the backward takes those blocks.
* **Arrays lent by the caller.** With a ``Workspace`` a forward writes its
  ``e`` (and a drawn keep-mask) into a finished forward's arrays
  instead of fresh memory (see ``Workspace``).
* **Projections on the pool.** ``linear_forward`` / ``linear_backward``
  run the module's projections in ``LINEAR_PARTS`` row blocks on the same
  pool, BLAS at one thread: BLAS's own threads, left spinning after a
  two-thread GEMM, would take the cores from the attention tiles that follow.
  ``dw`` is the sum of the row blocks' ``dy^T x`` (square GEMMs, where blocks
  of dw's own rows were thin), and ``linear_backwards`` runs several
  projections in one hand-off (the module's q, k and v).

Dropout draws its keep-mask tile by tile from the counter-based generator of
``npattn.backend.keyed_keep_mask``: the same mask as every other
implementation, at any tile size.

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv,
Lq/Lk query/key lengths, Dh key width, Dv value width, hk K/V heads in a
tile, r query rows in a block, c keys a block meets.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import numpy as np

from . import validation as V
from .backend import (dropout_key, exclusive, is_numpy_array, keep_mask, keyed_keep_mask, pool_threads,
                      row_major, run_tasks)
from . import functional as F
from .functional import SDPAGrads, sum_to_shape

__all__ = ["NumpySDPACache", "Workspace", "accepts", "sdpa_forward", "sdpa_backward",
           "keep_mask_of", "linear_applies", "linear_forward", "linear_backward", "linear_backwards",
           "TILE_ELEMS", "BACKWARD_TILE_FACTOR", "TILE_MIN_TASKS", "POOL_MIN_SCORES", "EXP_BOUND",
           "POOL_MIN_LINEAR", "LINEAR_PARTS"]

#: Target number of score entries in one tile (float32: 4 MiB).
TILE_ELEMS = 1 << 20

#: Tiles of the backward hold this many times ``TILE_ELEMS`` scores: its
#: per-block GEMMs (da, dq, dk) may want taller blocks than the forward.
#: Calls whose window (causal included) cuts the blocks keep the forward's.
BACKWARD_TILE_FACTOR = 1

#: Heads that share a tile span several batch entries only while the call
#: keeps at least this many tiles (``B // TILE_MIN_TASKS`` entries at most):
#: enough to keep the pool's threads busy to the end.
TILE_MIN_TASKS = 4

#: Tiles run on the pool only when the call has at least this many scores in
#: all (``B * Hq * Lq * Lk``); below it the pool's hand-offs cost more than
#: they save, and tiles run in order with BLAS as it is (docs/performance.md
#: has the measurements behind the number).
POOL_MIN_SCORES = 1 << 21

#: A block of rows whose scores are all at most this large in magnitude, by
#: Cauchy-Schwarz ``|s_ij| <= |q_i * scale| |k_j|``, takes ``exp(s)`` without subtracting
#: each row's maximum: ``exp`` of ``[-16, 16]`` neither overflows nor underflows
#: (float32 included), and a row's sum stays far from the largest float.
EXP_BOUND = 16.0


def accepts(q, k, v, mask=None, dropout_mask=None) -> bool:
    """Whether the kernel takes these arguments: NumPy arrays q (B, Hq, Lq, Dh),
    k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv) with one B and Hkv >= 1 dividing Hq, and masks that broadcast
    to (B, Hq, Lq, Lk) without growing it.

    Parameters
    ----------
    q : array, shape (B, Hq, Lq, Dh)
    k : array, shape (B, Hkv, Lk, Dh)
    v : array, shape (B, Hkv, Lk, Dv)
    mask, dropout_mask : array, optional
        None: not given.

    Returns
    -------
    bool
        False for an array that is not a plain ``numpy.ndarray`` (a subclass neither) or
        shapes other than these.
    """
    arrays = (q, k, v, mask, dropout_mask)
    return all(a is None or is_numpy_array(a) for a in arrays) and V.heads_layout(q, k, v, mask,
                                                                                  dropout_mask)


# ------------------------------------------------------------------ layout


def _grouped(a, Hkv, G):
    """View ``[B, Hq, ...]`` as ``[B, Hkv, G, ...]`` (query head h = hkv * G + g); no copy."""
    return a.reshape(a.shape[0], Hkv, G, *a.shape[2:])


def _merged(B, L, Hkv, G, X, dtype):
    """A (B, L, Hkv*G*X) array and its (B, Hkv, G, L, X) head view (no copy between them)."""
    m = np.empty((B, L, Hkv * G * X), dtype=dtype)
    return m, m.reshape(B, L, Hkv, G, X).transpose(0, 2, 3, 1, 4)


def _tiling(B, Hkv, G, Lq, Lk, cut, elems):
    """Tasks (b0, b1, h0, h1) over batch entries and K/V heads, and the query-block height r,
    for tiles of about ``elems`` scores (``cut``: a window, causal included, leaves some keys
    of some rows out). Small heads share a tile: all heads of one batch entry, then several
    batch entries (while there are at least ``TILE_MIN_TASKS`` tasks)."""
    per_head = G * Lq * Lk
    hk = max(1, min(Hkv, elems // max(per_head, 1)))
    nb = 1
    if hk == Hkv:
        nb = max(1, min(B // TILE_MIN_TASKS, elems // max(Hkv * per_head, 1)))
    r = max(16, elems // (nb * hk * G * Lk))
    if cut:
        r = min(r, max(64, Lq // 8))  # finer blocks skip more of what the window leaves out
    r = min(r, Lq)
    tasks = [(b0, min(b0 + nb, B), h0, min(h0 + hk, Hkv))
             for b0 in range(0, B, nb) for h0 in range(0, Hkv, hk)]
    return tasks, r


def _blocks(Lq, Lk, r, o):
    """(i0, i1, c0, c1): query rows i0:i1 meet keys c0:c1, the columns that the window of
    ``o`` (a ``functional.ScoreOptions``; causal is ``right = 0``) leaves to some of them;
    ``c0 == c1`` when it leaves none."""
    for i0 in range(0, Lq, r):
        i1 = min(i0 + r, Lq)
        c0 = 0 if o.left is None else min(Lk, max(0, i0 + o.offset - o.left))
        c1 = Lk if o.right is None else min(Lk, max(0, i1 + o.offset + o.right))
        yield i0, i1, c0, max(c0, c1)


def _cut_columns(o, i0, i1, c0, c1):
    """The key ranges ``(j0, j1)`` within ``c0:c1`` where the window of ``o`` leaves out
    some of the rows ``i0:i1``: right of ``i0 + offset + right``, left of
    ``i1 - 1 + offset - left`` (a causal block: its last ``i1 - i0`` columns)."""
    ranges = []
    if o.right is not None:
        j0 = max(c0, i0 + o.offset + o.right + 1)  # row i0 sees keys up to i0 + offset + right
        if j0 < c1:
            ranges.append((j0, c1))
    if o.left is not None:
        j1 = min(c1, i1 - 1 + o.offset - o.left)  # row i1 - 1 sees keys from its own left edge
        if j1 > c0:
            ranges.append((c0, j1))
    return ranges


def _threads(tasks, scores):
    """Pool threads for ``tasks`` of ``scores`` in all: 0 means in order, BLAS untouched."""
    return pool_threads() if len(tasks) > 1 and scores >= POOL_MIN_SCORES else 0


def _run(tile, tasks, threads):
    """The tiles in order with BLAS as it is (``threads == 0``), else on the pool."""
    if threads == 0:
        for t in tasks:
            tile(*t)
    else:
        with exclusive():  # BLAS is held to one thread inside (npattn.backend: threads)
            run_tasks(tile, tasks, threads)


def _tile_keep(key, p, b0, b1, h0, h1, G, i0, i1, c0, c1, out):
    """Keep-mask of one tile, [nb, hk, G, r, c], written into ``out``: entries
    (b, hkv * G + g, i, j) of the one mask."""
    batch = np.arange(b0, b1)[:, None, None]  # [nb, 1, 1]
    heads = np.arange(h0, h1)[:, None] * G + np.arange(G)[None, :]  # [hk, G]
    return keyed_keep_mask(key, p, [batch, heads], np.arange(i0, i1), np.arange(c0, c1), out=out)


# ------------------------------------------------------------------ memory


class Workspace:
    """The (B, Hq, Lq, Lk) arrays of finished forwards, for the next forwards to reuse.

    A forward's ``e`` (its probabilities before normalisation) and a dropout
    keep-mask it drew are the one large allocation of the kernel, 512 MiB
    for 8 heads of 4096 x 4096 scores in float32; memory that is fresh to
    the process costs page faults to touch, one per page on first write. A
    caller that owns its caches gives
    a cache back with ``give(cache)`` once nothing can read that cache again, and passes the
    workspace to the next forwards (``workspace=``): one of the same size
    and dtype takes the arrays instead of allocating. What a forward writes
    does not depend on whether its arrays were reused.

    ``MultiHeadAttention`` keeps one per module: it gives back the previous
    forward's cache when a new forward succeeds, unless the cache was read
    through ``module.cache`` (it may be assigned back). At most ``SPARES``
    arrays are kept; ``clear()`` frees them. Not for sharing between threads.
    """

    #: Most arrays kept: the ``e`` and a keep-mask of one forward.
    SPARES = 2

    def __init__(self) -> None:
        self.spares: list = []

    def give(self, cache: Any) -> None:
        """Keep the arrays of ``cache`` that the kernel allocated (a NumpySDPACache; anything
        else is ignored). The cache must not be read afterwards. An array kept already (the
        same cache given twice) is kept once, so that two later forwards never share it.

        Parameters
        ----------
        cache : NumpySDPACache
            Its ``exps`` are kept, and its keep-mask when the kernel drew it; the newest
            arrays first, at most ``SPARES`` in all (the oldest let go).
        """
        if not isinstance(cache, NumpySDPACache):
            return
        arrays = [cache.exps]
        if cache.dropout_key is not None:  # drawn by the kernel; a caller's mask stays theirs
            arrays.append(cache.keep)
        arrays = [a for a in arrays if not any(a is s for s in self.spares)]
        self.spares = (arrays + self.spares)[: self.SPARES]

    def take(self, shape: tuple, dtype: Any) -> Optional[np.ndarray]:
        """A kept array of ``shape`` and ``dtype`` (reshaped; it holds stale numbers), or None.

        Parameters
        ----------
        shape : tuple of int
        dtype : numpy dtype

        Returns
        -------
        numpy.ndarray or None
            The first kept array with as many entries and that dtype, taken out of the
            workspace; None when none has them.
        """
        size = math.prod(shape)
        for i, a in enumerate(self.spares):
            if a.size == size and a.dtype == dtype:
                return self.spares.pop(i).reshape(shape)
        return None

    def clear(self) -> None:
        """Free the kept arrays."""
        self.spares = []


def _allocate(workspace, shape, dtype):
    """An array of ``shape`` from ``workspace`` or a new one; either holds old numbers until
    written."""
    a = None if workspace is None else workspace.take(shape, dtype)
    return np.empty(shape, dtype=dtype) if a is None else a


# ------------------------------------------------------------------ forward


class NumpySDPACache(NamedTuple):
    """What the kernel's ``sdpa_backward`` needs from its ``sdpa_forward``."""
    q: Any  #: [B, Hq, Lq, Dh]  compute dtype
    k: Any  #: [B, Hkv, Lk, Dh]
    v: Any  #: [B, Hkv, Lk, Dv]
    exps: Any  #: [B, Hq, Lq, Lk] e = exp(s - m), the softmax before its normalisation
    row_scale: Any  #: [B, Hkv, G, Lq, 1] 1 / rowsum(e) (1 for an empty row): p = e * row_scale
    out: Any  #: [B, Hq, Lq, Dv] output in the compute dtype (a copy), for delta = rowsum(dout * out)
    keep: Any  #: [B, Hkv, G, Lq, Lk] bool keep-mask (broadcast view of a caller's), or None
    dropout_key: Optional[int]  #: the key the mask was drawn from, or None
    dropout_p: float  #: the drop probability
    causal: bool  #: the window (causal included) leaves some keys out: tiles are cut
    scale: float  #: the factor of the scores
    groups: int  #: G
    mask_shape: Optional[tuple]  #: shape of a floating mask, for dmask
    in_dtype: Any  #: dtype of q, k, v; gradients are cast back to it
    lse_rows: Any = None  #: [B, Hkv, G, Lq] log-sum-exp of each row, -inf for an empty row
    options: Any = None  #: functional.ScoreOptions: the window (offset, left, right), causal folded in
    rows: int = 0  #: r, the forward's query-block height: a cut backward must take its blocks

    @property
    def lse(self) -> Any:
        """[B, Hq, Lq] natural log-sum-exp of each row's scores; -inf for a row with nothing to attend."""
        return self.lse_rows.reshape(self.exps.shape[:-1])

    @property
    def probs(self) -> Any:
        """[B, Hq, Lq, Lk] the softmax before dropout (the attention weights), a new array:
        ``exps * row_scale``, 0 where the window leaves a key out (the forward writes
        ``exps`` only in the columns of its blocks)."""
        B, Hq, Lq, Lk = self.exps.shape
        ps = self.row_scale.reshape(B, Hq, Lq, 1)
        if not self.causal:
            return self.exps * ps
        allowed = F.positions_allowed(np, np.arange(Lq), np.arange(Lk), self.options)  # [Lq, Lk]
        p = np.zeros(self.exps.shape, dtype=self.exps.dtype)
        return np.multiply(self.exps, ps, out=p, where=allowed)


def sdpa_forward(q: Any, k: Any, v: Any, *, mask: Any, is_causal: bool, scale: Optional[float],
                 dropout_p: float, dropout_mask: Any, rng: Any, groups: int,
                 options: Optional[F.ScoreOptions] = None,
                 workspace: Optional[Workspace] = None) -> tuple[Any, NumpySDPACache]:
    """Tiled ``softmax(q k^T * scale + mask) v`` on checked NumPy arguments (``accepts``).

    The arguments are those of ``functional.sdpa_forward_core``; of the kernel
    ``options`` only the window (``align``'s offset, ``left``, ``right``) is
    taken (``functional.is_positional``): a tile meets only the key columns
    that the window leaves to some of its rows; the rest of ``e`` is never written
    (``cache.probs`` is 0 there).
    ``workspace`` (a ``Workspace``) lends arrays instead of new ones.
    Returns ``(out, NumpySDPACache)``; ``cache.probs`` forms the weights
    before dropout, ``cache.exps * cache.row_scale``.

    Parameters
    ----------
    q : numpy.ndarray, shape (B, Hq, Lq, Dh)
    k : numpy.ndarray, shape (B, Hkv, Lk, Dh)
    v : numpy.ndarray, shape (B, Hkv, Lk, Dv)
    mask : numpy.ndarray, broadcastable to (B, Hq, Lq, Lk), or None
        Boolean (True = may attend) or floating (added to the scores).
    is_causal : bool
    scale : float or None
        None: ``1 / sqrt(Dh)``.
    dropout_p : float
        Drop probability.
    dropout_mask : numpy bool array, broadcastable to (B, Hq, Lq, Lk), or None
        The keep-mask to apply; None: drawn when ``dropout_p`` is not 0.
    rng : int, SeedSequence, BitGenerator, Generator or None
        One key is drawn from it (``backend.dropout_key``) when a mask is drawn.
    groups : int
        G = Hq // Hkv.
    options : ScoreOptions, optional
        None: no window beyond ``is_causal``.
    workspace : Workspace, optional
        None: new arrays.

    Returns
    -------
    out : numpy.ndarray, shape (B, Hq, Lq, Dv), dtype of ``q``
        A view of an array in the merged layout (B, Lq, Hq * Dv) (float16: a copy).
    cache : NumpySDPACache
    """
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv] -> [B, Hq, Lq, Dv]
    in_dtype = q.dtype
    work = np.float32 if in_dtype == np.float16 else in_dtype
    if work != in_dtype:
        q, k, v = (t.astype(work) for t in (q, k, v))
        if mask is not None and mask.dtype != np.bool_:
            mask = mask.astype(work)
    q, k, v = (row_major(t) for t in (q, k, v))  # row-major matrices: the same bits in any layout
    G = groups
    o = F.causal_options(is_causal, options)
    cut = o.left is not None or o.right is not None  # some rows leave some keys out
    B, Hq, Lq, Dh = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    full = (B, Hq, Lq, Lk)
    full5 = (B, Hkv, G, Lq, Lk)
    key = None
    keep = None
    if dropout_mask is not None:
        keep = _grouped(np.broadcast_to(dropout_mask, full), Hkv, G)  # [B, Hkv, G, Lq, Lk] view
    elif dropout_p != 0.0:
        key = dropout_key(rng)  # the one draw of every implementation
        keep = _allocate(workspace, full5, np.bool_)  # filled per tile (the blocks' columns)
    fmask = bmask = None
    mask_shape = None
    if mask is not None:
        if mask.dtype == np.bool_:
            bmask = _grouped(np.broadcast_to(mask, full), Hkv, G)
        else:
            mask_shape = tuple(mask.shape)
            fmask = _grouped(np.broadcast_to(mask, full), Hkv, G)
    drop_scale = 1.0 / (1.0 - float(dropout_p)) if keep is not None else 1.0

    exps = _allocate(workspace, full5, work)  # [B, Hkv, G, Lq, Lk]: only blocks' columns written
    row_scale = np.empty((B, Hkv, G, Lq, 1), dtype=work)  # [B, Hkv, G, Lq, 1]
    lse = np.empty((B, Hkv, G, Lq), dtype=work)  # [B, Hkv, G, Lq]
    out_m, out = _merged(B, Lq, Hkv, G, Dv, work)  # [B, Lq, Hq*Dv], [B, Hkv, G, Lq, Dv] view
    q5 = _grouped(q, Hkv, G)  # [B, Hkv, G, Lq, Dh] view
    kT = np.swapaxes(k, -1, -2)[:, :, None]  # [B, Hkv, 1, Dh, Lk] view, broadcast over G
    v5 = v[:, :, None]  # [B, Hkv, 1, Lk, Dv] view
    ones = np.ones((Lk, 1), dtype=work)  # [Lk, 1]: row sums as a matrix-vector product
    tasks, r = _tiling(B, Hkv, G, Lq, Lk, cut, TILE_ELEMS)
    neg_inf = -math.inf
    # the window's pattern on a block depends on its shape and j0 - i0 alone; tiles on
    # the pool may both fill an entry, with the same array
    edges: dict = {}

    def left_out(i0, i1, j0, j1):  # [r, j1 - j0] bool: True where the window leaves a key out
        shape = (i1 - i0, j1 - j0, j0 - i0)
        if shape not in edges:
            edges[shape] = ~F.positions_allowed(np, np.arange(i0, i1), np.arange(j0, j1), o)
        return edges[shape]

    def tile(b0, b1, h0, h1):  # batch entries b0:b1, K/V heads h0:h1
        # the tile's operands as contiguous copies (BLAS is faster on them than on the
        # strided head views), scale folded into q
        qs = q5[b0:b1, h0:h1] * scale  # [nb, hk, G, Lq, Dh]
        kTt = np.ascontiguousarray(kT[b0:b1, h0:h1])  # [nb, hk, 1, Dh, Lk]
        vt = np.ascontiguousarray(v5[b0:b1, h0:h1])  # [nb, hk, 1, Lk, Dv]
        scratch = np.empty((b1 - b0) * (h1 - h0) * G * r * Lk, dtype=work)  # one block's scores
        # |s_ij| <= |q_i * scale| |k_j| (Cauchy-Schwarz): the rows' bounds on their scores
        bound = None
        if fmask is None:  # a floating mask may add anything
            with np.errstate(over="ignore", invalid="ignore"):  # inf or NaN: the max is taken
                # (einsum: NumPy's sum over a short last axis runs row by row)
                k_norm = np.sqrt(np.max(np.einsum("...ij,...ij->...j", kTt, kTt)))  # largest |k_j|
                bound = np.sqrt(np.einsum("...i,...i->...", qs, qs)) * k_norm  # [nb, hk, G, Lq]
        for i0, i1, c0, c1 in _blocks(Lq, Lk, r, o):
            if c1 == c0:  # the window leaves these rows nothing: zero output, lse = -inf
                out[b0:b1, h0:h1, :, i0:i1] = 0.0
                lse[b0:b1, h0:h1, :, i0:i1] = neg_inf
                row_scale[b0:b1, h0:h1, :, i0:i1] = 1.0
                continue
            c = c1 - c0
            dst = exps[b0:b1, h0:h1, :, i0:i1, c0:c1]  # [nb, hk, G, r, c] view of the cache's e
            # the scores in a contiguous scratch array that stays in cache (BLAS writes the
            # cache's large array more slowly); exp writes e into the cache's array when
            # rows are whole, else (rows shorter than Lk are strided, and NumPy's passes
            # over them run at half speed) in the scratch array, copied once done
            p = scratch[: dst.size].reshape(dst.shape)  # [nb, hk, G, r, c]
            np.matmul(qs[..., i0:i1, :], kTt[..., c0:c1], out=p)  # 1. s = q k^T * scale
            if fmask is not None:  # 4. floating mask: z = s + mask
                np.add(p, fmask[b0:b1, h0:h1, :, i0:i1, c0:c1], out=p)
            if bmask is not None:  # 4. boolean mask: z = where(mask, s, -inf)
                np.copyto(p, neg_inf, where=~bmask[b0:b1, h0:h1, :, i0:i1, c0:c1])
            for j0, j1 in _cut_columns(o, i0, i1, c0, c1):  # 4. the window, where its edges cross
                np.copyto(p[..., j0 - c0 : j1 - c0], neg_inf, where=left_out(i0, i1, j0, j1))
            m = None  # 5. softmax; every |s| <= EXP_BOUND: exp(s) neither overflows nor underflows, m = 0
            if bound is None or not np.max(bound[..., i0:i1]) <= EXP_BOUND:  # (NaN: shift)
                m = np.max(p, axis=-1, keepdims=True)  # 5. m  [nb, hk, G, r, 1]
                m[m == neg_inf] = 0.0  # fully masked row: no -inf - -inf
                np.subtract(p, m, out=p)
            e = np.exp(p, out=dst if c == Lk else p)  # 5. e = exp(z - m)
            s = np.matmul(e, ones[:c])  # 5. rowsum(e), by BLAS [nb, hk, G, r, 1]
            empty = s == 0.0
            s[empty] = 1.0  # rows with nothing to attend stay 0
            lse_blk = np.log(s) if m is None else m + np.log(s)  # lse = m + log(rowsum(e))
            lse_blk[empty] = neg_inf  # -inf for an empty row
            lse[b0:b1, h0:h1, :, i0:i1] = lse_blk[..., 0]
            ps = np.reciprocal(s, out=s)  # 5. p = e * ps, ps = 1 / rowsum(e): kept, not applied
            row_scale[b0:b1, h0:h1, :, i0:i1] = ps
            if e is not dst:
                dst[...] = e
            a = e
            if keep is not None:  # 6. a = where(keep, p / (1 - p_drop), 0) = where(keep, e, 0) * ps'
                kp = keep[b0:b1, h0:h1, :, i0:i1, c0:c1]
                if key is not None:
                    _tile_keep(key, dropout_p, b0, b1, h0, h1, G, i0, i1, c0, c1, out=kp)
                a = np.multiply(e, kp)
                ps = ps * drop_scale  # ps' = ps / (1 - p_drop)
            # 7. out = a v = (e v) * ps: rows scaled on the way into the merged layout
            # (BLAS writes a contiguous array faster than the strided head view)
            ev = np.matmul(a, vt[..., c0:c1, :])  # [nb, hk, G, r, Dv]
            np.multiply(ev, ps, out=out[b0:b1, h0:h1, :, i0:i1])

    _run(tile, tasks, _threads(tasks, B * Hq * Lq * Lk))

    heads = out_m.reshape(B, Lq, Hq, Dv).transpose(0, 2, 1, 3)  # [B, Hq, Lq, Dv] view
    result = heads if work == in_dtype else heads.astype(in_dtype)
    saved = heads
    if work == in_dtype:  # a copy in the merged layout (one contiguous copy), as a head view
        saved = out_m.copy().reshape(B, Lq, Hq, Dv).transpose(0, 2, 1, 3)
    cache = NumpySDPACache(q, k, v, exps.reshape(full), row_scale, saved, keep, key, float(dropout_p),
                           cut, scale, G, mask_shape, in_dtype, lse, o, r)
    return result, cache


def keep_mask_of(cache: NumpySDPACache) -> Any:
    """The keep-mask (B, Hq, Lq, Lk) a forward used, or None without dropout. A mask the
    kernel drew is a new array (the cache's may go back to a ``Workspace`` and be drawn
    over); a caller's is returned as it was broadcast.

    Parameters
    ----------
    cache : NumpySDPACache

    Returns
    -------
    keep : numpy bool array, shape (B, Hq, Lq, Lk), or None
        True = kept; None when the forward was given no mask and drew none.
    """
    if cache.keep is None:
        return None
    B, Hq, Lq, Lk = cache.exps.shape
    if cache.dropout_key is None:
        return cache.keep.reshape(B, Hq, Lq, Lk)
    if not cache.causal:
        return cache.keep.reshape(B, Hq, Lq, Lk).copy()
    # causal forwards skip the blocks above the diagonal: draw the whole mask again
    return keep_mask(cache.dropout_key, cache.dropout_p, (B, Hq, Lq, Lk), np)


# ------------------------------------------------------------------ backward


def sdpa_backward(dout: Any, cache: NumpySDPACache, *, dlse: Any = None) -> SDPAGrads:
    """Gradients ``SDPAGrads(dq, dk, dv, dmask, None)`` of ``sdpa_forward``, tile by tile;
    ``dlse`` [B, Hq, Lq] is an upstream gradient of ``cache.lse`` (checked by the dispatcher).

    Parameters
    ----------
    dout : numpy.ndarray, shape (B, Hq, Lq, Dv), dtype of ``q``
        Checked by the dispatcher, as ``dlse``.
    cache : NumpySDPACache
    dlse : numpy.ndarray, shape (B, Hq, Lq), optional
        None: no gradient reaches ``lse``.

    Returns
    -------
    SDPAGrads
        In the dtype of ``q``: ``dq`` (B, Hq, Lq, Dh), ``dk`` (B, Hkv, Lk, Dh),
        ``dv`` (B, Hkv, Lk, Dv), ``dmask`` in the floating mask's shape as given (None for a
        boolean mask or none), ``dsinks`` None (the kernel takes no sinks).
    """
    # [B, Hq, Lq, Dv] -> [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv], mask shape
    q, k, v = cache.q, cache.k, cache.v
    work = q.dtype
    if dout.dtype != work:
        dout = dout.astype(work)
    dout = row_major(dout)
    G = cache.groups
    B, Hq, Lq, Dh = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    exps = _grouped(cache.exps, Hkv, G)  # [B, Hkv, G, Lq, Lk] e, with p = e * row_scale
    row_scale = cache.row_scale  # [B, Hkv, G, Lq, 1]
    keep = cache.keep
    causal = cache.causal  # tiles cut by the window (causal included)
    o = F.PLAIN if cache.options is None else cache.options
    ds_full = None
    if cache.mask_shape is not None:  # dmask needs every ds; keep them
        ds_full = (np.zeros if causal else np.empty)((B, Hkv, G, Lq, Lk), dtype=work)
    dq_m, dq = _merged(B, Lq, Hkv, G, Dh, work)  # [B, Hkv, G, Lq, Dh] view
    dk_m, dk = _merged(B, Lk, Hkv, 1, Dh, work)  # [B, Hkv, 1, Lk, Dh] view
    dv_m, dv = _merged(B, Lk, Hkv, 1, Dv, work)  # [B, Hkv, 1, Lk, Dv] view
    q5, do5, out5 = (_grouped(t, Hkv, G) for t in (q, dout, cache.out))
    dlse5 = None  # [B, Hkv, G, Lq, 1]; 0 on rows with nothing to attend (lse = -inf, p = 0):
    if dlse is not None:  # their dlse does not matter, and an inf there would give 0 * inf
        empty = cache.lse_rows[..., None] == -math.inf
        dlse5 = np.where(empty, 0.0, _grouped(dlse[..., None], Hkv, G)).astype(work)
    vT = np.swapaxes(v, -1, -2)[:, :, None]  # [B, Hkv, 1, Dv, Lk] view
    k5 = k[:, :, None]  # [B, Hkv, 1, Lk, Dh]
    tasks, r = _tiling(B, Hkv, G, Lq, Lk, causal, BACKWARD_TILE_FACTOR * TILE_ELEMS)
    if causal:  # the forward wrote e (and a drawn keep-mask) only in the columns of its own
        r = cache.rows  # blocks: a taller block here would read columns it left unwritten
    scale, drop_scale = cache.scale, 1.0 / (1.0 - cache.dropout_p)

    def kv_add(acc, a, b):  # acc [nb, hk, c, X] += sum_g a[:, :, g]^T b[:, :, g]: a K/V head
        # sums its G query heads' terms one by one (no [nb, hk, G, c, X] temporary)
        for g in range(G):  # a [nb, hk, G, r, c], b [nb, hk, G, r, X]
            acc += np.matmul(np.swapaxes(a[:, :, g], -1, -2), b[:, :, g])

    def tile(b0, b1, h0, h1):  # batch entries b0:b1, K/V heads h0:h1
        # The cache keeps e and ps = 1 / rowsum(e), p = e * ps, and a = p * keep * c with
        # c = 1 / (1 - p_drop). The row factors move onto dout's rows, do' = dout * ps * c:
        #   dv = a^T dout = (e * keep)^T do'
        #   ds = p * (dp - delta) = e * (keep * (do' v^T) - delta * ps)
        # and without dropout delta * ps joins the GEMM as one more column:
        #   do' v^T - delta ps = [do', -delta ps] [v, 1]^T
        # The tile's operands are contiguous copies, scale folded into q and k (BLAS is
        # faster on them than on the strided head views).
        nb, hk = b1 - b0, h1 - h0
        ps = row_scale[b0:b1, h0:h1]  # [nb, hk, G, Lq, 1]
        qs = q5[b0:b1, h0:h1] * scale  # [nb, hk, G, Lq, Dh]
        ks = k5[b0:b1, h0:h1] * scale  # [nb, hk, 1, Lk, Dh]
        # 5. softmax backward: rowsum(dp * p) = rowsum(dout * out), as out = a v
        delta = np.einsum("...i,...i->...", do5[b0:b1, h0:h1], out5[b0:b1, h0:h1])[..., None]  # [nb, hk, G, Lq, 1]
        if dlse5 is not None:  # lse adds d lse / ds_j = p_j: ds = p * (dp - delta + dlse)
            delta -= dlse5[b0:b1, h0:h1]
        fold = keep is None  # delta joins the da GEMM
        W = Dv + 1 if fold else Dv
        doa = np.empty((nb, hk, G, Lq, W), dtype=work)  # [nb, hk, G, Lq, W]: do' (and -delta ps)
        np.multiply(do5[b0:b1, h0:h1], ps * drop_scale, out=doa[..., :Dv])
        dop = doa[..., :Dv]  # [nb, hk, G, Lq, Dv] view: do'
        vTa = np.empty((nb, hk, 1, W, Lk), dtype=work)  # [nb, hk, 1, W, Lk]: v^T (and a row of ones)
        vTa[..., :Dv, :] = vT[b0:b1, h0:h1]
        if fold:
            doa[..., Dv:] = -(delta * ps)  # (NumPy 2.4's in-place float32 negative of this
            # strided column gives wrong numbers: not used)
            vTa[..., Dv, :] = 1.0
        else:
            delta *= ps  # delta ps
        blocks = list(_blocks(Lq, Lk, r, o))
        # GEMMs write the merged layout of dq, dk, dv directly (``out=``: BLAS takes its row
        # stride); dk does when one block meets all keys and rows (G = 1) and dv when it is one
        # GEMM, else they are accumulated
        whole_dk = G == 1 and len(blocks) == 1 and blocks[0][2:] == (0, Lk)
        # dk_acc, dv_acc: accumulated block by block below, None where one GEMM writes it whole
        dk_acc: Any = None if whole_dk else np.zeros((nb, hk, Lk, Dh), dtype=work)  # [nb, hk, Lk, Dh]
        whole_dv = keep is None and not causal
        dv_acc: Any = None
        if whole_dv:  # 7. dv = e^T do' in one GEMM over all query rows of the G heads
            eT = np.swapaxes(exps[b0:b1, h0:h1].reshape(nb, hk, G * Lq, Lk), -1, -2)  # [nb, hk, Lk, G Lq]
            np.matmul(eT, dop.reshape(nb, hk, G * Lq, Dv), out=dv[b0:b1, h0:h1, 0])
        else:  # accumulated block by block below
            dv_acc = np.zeros((nb, hk, Lk, Dv), dtype=work)  # [nb, hk, Lk, Dv]
        for i0, i1, c0, c1 in blocks:
            if c1 == c0:  # rows the window leaves nothing: p = 0, so dq = 0
                dq[b0:b1, h0:h1, :, i0:i1] = 0.0
                continue
            e = exps[b0:b1, h0:h1, :, i0:i1, c0:c1]  # [nb, hk, G, r, c]
            da = None if ds_full is None else ds_full[b0:b1, h0:h1, :, i0:i1, c0:c1]  # dmask: kept
            # 7. da = do' v^T (fold: minus delta ps)
            da = np.matmul(doa[..., i0:i1, :], vTa[..., c0:c1], out=da)  # [nb, hk, G, r, c]
            if whole_dv:
                pass
            elif keep is None:  # 7. dv = e^T do'
                kv_add(dv_acc[..., c0:c1, :], e, dop[..., i0:i1, :])
            else:
                kp = keep[b0:b1, h0:h1, :, i0:i1, c0:c1]
                ek = np.multiply(e, kp)  # 7. dv = (e * keep)^T do'
                kv_add(dv_acc[..., c0:c1, :], ek, dop[..., i0:i1, :])
                np.multiply(da, kp, out=da)  # 6. dp = where(keep, da / (1 - p), 0), c in do'
                np.subtract(da, delta[..., i0:i1, :], out=da)  # 5. dp - delta, in units of ps
            np.multiply(da, e, out=da)  # 5. ds = p * (dp - delta) = e * (...) ps
            np.matmul(da, ks[..., c0:c1, :], out=dq[b0:b1, h0:h1, :, i0:i1])  # 1. dq = ds k * scale
            if whole_dk:  # 1. dk = ds^T q * scale
                np.matmul(np.swapaxes(da, -1, -2), qs, out=dk[b0:b1, h0:h1])
            else:
                kv_add(dk_acc[..., c0:c1, :], da, qs[..., i0:i1, :])
        if not whole_dk:
            dk[b0:b1, h0:h1, 0] = dk_acc
        if not whole_dv:
            dv[b0:b1, h0:h1, 0] = dv_acc

    _run(tile, tasks, _threads(tasks, B * Hq * Lq * Lk))

    dq = dq_m.reshape(B, Lq, Hq, Dh).transpose(0, 2, 1, 3)  # [B, Hq, Lq, Dh] view
    dk = dk_m.reshape(B, Lk, Hkv, Dh).transpose(0, 2, 1, 3)  # [B, Hkv, Lk, Dh] view
    dv = dv_m.reshape(B, Lk, Hkv, Dv).transpose(0, 2, 1, 3)  # [B, Hkv, Lk, Dv] view
    dmask = None
    if ds_full is not None:
        dmask = sum_to_shape(np, ds_full.reshape(B, Hq, Lq, Lk), cache.mask_shape or ())
    if cache.in_dtype != work:
        dq, dk, dv = (t.astype(cache.in_dtype) for t in (dq, dk, dv))
        if dmask is not None:
            dmask = dmask.astype(cache.in_dtype)
    return SDPAGrads(dq, dk, dv, dmask, None)


# ------------------------------------------------------------------ projections

#: A projection runs on the tile pool when its GEMM has at least this many
#: multiply-adds (rows x Din x Dout).
POOL_MIN_LINEAR = 1 << 28

#: A projection on the pool is cut into this many tasks by rows (of ``y`` and
#: ``dx``; ``dw`` into as many more, partial sums over the same rows): large
#: GEMMs, whose number does not depend on the pool's threads (nor do the numbers).
LINEAR_PARTS = 4


def linear_applies(x: Any, w: Any) -> bool:
    """Whether ``linear_forward`` runs ``x @ w.T`` on the tile pool: NumPy arrays of matching
    widths and a GEMM of at least ``POOL_MIN_LINEAR`` multiply-adds. (With one pool thread
    the blocks run in order, BLAS still at one thread: the same numbers as on more.)

    Parameters
    ----------
    x : array, shape (..., Din)
    w : array, shape (Dout, Din)

    Returns
    -------
    bool
    """
    if not (is_numpy_array(x) and is_numpy_array(w) and x.ndim >= 1 and w.ndim == 2):
        return False
    return x.shape[-1] == w.shape[1] and x.size * w.shape[0] >= POOL_MIN_LINEAR


def _row_blocks(kind, n):
    cuts = [n * i // LINEAR_PARTS for i in range(LINEAR_PARTS + 1)]
    return [(kind, i0, i1) for i0, i1 in zip(cuts[:-1], cuts[1:]) if i1 > i0]


def linear_forward(x: Any, w: Any, b: Any = None) -> tuple[Any, Any]:
    """``functional.linear_forward`` (``y = x @ w.T + b``) on checked NumPy arrays, its GEMM
    in ``LINEAR_PARTS`` blocks of rows on the tile pool with BLAS at one thread.

    BLAS's own threads would otherwise keep spinning after the GEMM and take
    the cores from the attention tiles that follow. Returns
    ``(y, functional.LinearCache)``.

    Parameters
    ----------
    x : numpy.ndarray, shape (..., Din)
    w : numpy.ndarray, shape (Dout, Din)
    b : numpy.ndarray, shape (Dout,), optional

    Returns
    -------
    y : numpy.ndarray, shape (..., Dout), dtype of ``x``
    cache : LinearCache
    """
    # [..., Din], [Dout, Din], [Dout] -> [..., Dout]
    x2 = x.reshape(-1, x.shape[-1])  # [N, Din]
    y2 = np.empty((x2.shape[0], w.shape[0]), dtype=x.dtype)  # [N, Dout]
    wT = w.T  # [Din, Dout] view

    def task(_, i0, i1):
        np.matmul(x2[i0:i1], wT, out=y2[i0:i1])
        if b is not None:
            y2[i0:i1] += b

    _run(task, _row_blocks("y", x2.shape[0]), pool_threads())  # BLAS at one thread
    return y2.reshape(*x.shape[:-1], w.shape[0]), F.LinearCache(x, w, b is not None)


def linear_backward(dy: Any, cache: Any) -> tuple[Any, Any, Any]:
    """``functional.linear_backward`` on checked NumPy arrays: ``dx = dy @ w`` and
    ``dw = dy^T x`` in ``LINEAR_PARTS`` blocks of rows on the tile pool; ``db = sum(dy)``.
    One projection of ``linear_backwards``.

    Parameters
    ----------
    dy : numpy.ndarray, shape (..., Dout)
    cache : LinearCache
        Of ``linear_forward`` or ``functional.linear_forward``.

    Returns
    -------
    dx : numpy.ndarray, shape (..., Din)
    dw : numpy.ndarray, shape (Dout, Din)
    db : numpy.ndarray, shape (Dout,) or None
    """
    # [..., Dout] -> [..., Din], [Dout, Din], [Dout]
    return linear_backwards([(dy, cache)])[0]


def linear_backwards(pairs: Any) -> list:
    """``functional.linear_backward`` of several projections ``[(dy, cache), ...]`` on
    checked NumPy arrays, all their GEMMs in one run of the tile pool (BLAS at one thread).

    For each: ``dx = dy @ w`` by blocks of rows; ``dw = dy^T x`` as the sum of the
    blocks' ``dy[i0:i1]^T x[i0:i1]``, added in block order (fixed blocks: the numbers
    do not depend on the pool's threads); ``db = sum(dy)``. Returns a list of
    ``(dx, dw, db)``, one per pair, each what ``linear_backward`` returns for it.

    Parameters
    ----------
    pairs : sequence of (dy, cache)
        ``dy`` (..., Dout) and the ``LinearCache`` of its forward, as ``linear_backward``
        takes them.

    Returns
    -------
    list of (dx, dw, db)
        In the order of ``pairs``.
    """
    # [(..., Dout), LinearCache] -> [(..., Din), (Dout, Din), (Dout)]
    jobs = []  # per pair: dy2 [N, Dout], x2 [N, Din], w, dx2 [N, Din], dw [Dout, Din], parts
    tasks = []
    for n, (dy, cache) in enumerate(pairs):
        x, w = cache.x, cache.w
        dy2 = dy.reshape(-1, dy.shape[-1])  # [N, Dout]
        x2 = x.reshape(-1, x.shape[-1])  # [N, Din]
        blocks = _row_blocks("rows", x2.shape[0])
        dx2 = np.empty(x2.shape, dtype=x.dtype)  # [N, Din]
        # the blocks' terms of dw are summed in float32 for float16 and dw rounded once, as
        # the reference's single GEMM (NumPy's float16 matmul accumulates in float32)
        work = F.compute_dtype(np, x.dtype)  # float32 for float16, else x's dtype
        dw = np.zeros(w.shape, dtype=work)  # [Dout, Din]: block 0's term (0 without rows)
        parts = np.empty((max(len(blocks) - 1, 0), *w.shape), dtype=work)  # the other blocks'
        jobs.append((dy2, x2, w, dx2, dw, parts))
        tasks += [(n, "dx", i0, i1, p) for p, (_, i0, i1) in enumerate(blocks)]
        tasks += [(n, "dw", i0, i1, p) for p, (_, i0, i1) in enumerate(blocks)]

    def task(n, kind, i0, i1, p):
        dy2, x2, w, dx2, dw, parts = jobs[n]
        if kind == "dx":
            np.matmul(dy2[i0:i1], w, out=dx2[i0:i1])
        else:
            out = dw if p == 0 else parts[p - 1]
            np.matmul(dy2[i0:i1].T, x2[i0:i1], out=out, dtype=out.dtype)

    _run(task, tasks, pool_threads())  # BLAS at one thread
    results = []
    for (_, cache), (dy2, x2, w, dx2, dw, parts) in zip(pairs, jobs):
        for part in parts:  # dw = block 0's + block 1's + ..., in block order
            dw += part
        dw = dw if dw.dtype == x2.dtype else dw.astype(x2.dtype)
        db = F.half_sum(np, dy2, axis=0) if cache.has_bias else None  # [Dout]
        results.append((dx2.reshape(cache.x.shape), dw, db))
    return results
