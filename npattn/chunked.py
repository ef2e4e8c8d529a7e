"""Chunk-parallel attention for dask arrays: one task per chunk, the blocked steps inside it.

``npattn.attention`` dispatches here (``impl="chunked"``, and ``"auto"`` on
dask arrays). The arrays' own chunks are the plan:

* batch entries: the chunks of ``q`` along axis 0;
* heads: the chunks of ``k`` along axis 1 (K/V heads); under grouped-query
  attention a chunk of ``q`` holds the G query heads of each of its K/V heads;
* query rows: the chunks of ``q`` along axis 2 (*query chunking*);
* keys: the chunks of ``k`` along axis 2 (*key chunking*).

The other inputs are rechunked to that plan (nothing happens when they match
already) and the head widths are one chunk each. A task sees one chunk of
queries against one chunk of keys, as NumPy arrays, and runs
``npattn.blocked`` on them: its scores are formed one block of ``bq x bk``
per head at a time, whatever the chunk lengths. What a task forms whole is
its part of a drawn dropout mask (``Bc x Hc x ri x ck`` booleans, hashed a
slab of rows at a time), a quarter of the pair's float32 scores; a floating
mask arrives as a chunk of that size.

The kernel options of ``npattn.functional.sdpa_forward`` (``is_causal`` in
either alignment, a window, softcap, ALiBi, sinks, segments) are the blocked
algorithm's, with the task's chunks at their global positions: a pair of
chunks starting at query row ``i0`` and key ``j0`` is the blocked forward of
its chunks with the diagonal ``j = i + offset`` moved to ``offset + i0 - j0``
(the window and ALiBi read ``j - (i + offset)``), and with its chunks of
ALiBi's slopes (heads) and of the segment ids (queries, keys). A sink is one
logit per row, not per pair: the pairs run without it, and the merge (step
2.) counts it once.

Forward. For every chunk ``(b, h, i)`` of the output and every key chunk
``j`` it meets (the pairs that ``is_causal`` or the window leave out whole,
``functional.block_visible``, are left out of the graph):

1. task ``(b, h, i, j)``: the blocked forward of query chunk ``i`` against key
   chunk ``j``: ``o_ij`` (normalised by its own row sum), the row maximum
   ``m_ij`` and the row sum ``l_ij = sum_{k in j} exp(z_k - m_ij)``;
2. task ``(b, h, i)``, the blocked algorithm's merge across chunks:
   ``m = max_j m_ij`` over the chunks where the row attends something,
   ``w_ij = l_ij exp(m_ij - m)``, ``l = sum_j w_ij``,
   ``out = sum_j w_ij o_ij / l`` (0 for a row with nothing to attend). A sink
   is one more part, ``o = 0``, ``m = sink``, ``l = 1`` (``l = 0`` for a sink
   of -inf), as in the blocked forward, which starts each row from it.

``m`` and ``l`` are kept apart, as in ``npattn.blocked`` (exact at large
scores). Without key chunking and without sinks step 2 has one pair and passes
it on as it is (the task stays in the graph); with sinks it merges that pair
with the sink.

Backward. With the merged ``out``, ``m``, ``l`` of query chunk ``i``:

3. task ``(b, h, i, j)``: the blocked backward of that pair of chunks, which
   rebuilds ``p = exp(z - m) / l`` with the *merged* row statistics, so its
   ``dq_ij``, ``dk_ij``, ``dv_ij`` are the pair's exact shares;
4. ``dq(b, h, i) = sum_j dq_ij``; ``dk(b, h, j) = sum_i dk_ij`` and
   ``dv`` likewise: one task per output chunk. A floating mask's gradient is
   the ``ds`` of each pair, summed to the mask's own shape;
5. with sinks, task ``(b, h, i)``: the rows' ``dsink = p_sink * (-delta)``,
   ``p_sink = exp(sink - m) / l`` (the blocked backward's), summed over the
   chunk's batch entries and rows, and one task per head chunk sums those.

The graph has ``O(chunks)`` tasks, not a layer per array operation. Dropout
from a generator draws one key on the caller's side; each task draws its own
part of the one keep-mask from ``npattn.backend.keyed_keep_mask`` with global
coordinates, so no full-size mask exists anywhere and the mask is the NumPy
run's, bit for bit, whatever the chunking (the output, merged across key
chunks, equals it to rounding). A caller's keep-mask is chunked
like the inputs.

Results are dask arrays; nothing is computed until the caller computes them.
On a threaded scheduler npattn's tasks run one at a time per process (each on
npattn's tile pool: ``npattn.backend.exclusive``); a ``dask.distributed``
cluster runs one per worker process in parallel.

Shape legend: B batch, Hq query heads, Hkv K/V heads, G = Hq // Hkv, Lq / Lk
query / key lengths, Dh key width, Dv value width; ``(b, h, i, j)`` chunk
indices along batch, K/V heads, query rows and keys.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, NamedTuple, Optional

import numpy as np

from . import blocked
from . import functional as F
from . import validation as V
from .backend import device_of, dropout_key, is_dask_array, keyed_keep_mask, namespace, scalar
from .functional import SDPAGrads

__all__ = ["ChunkPlan", "ChunkedSDPACache", "accepts", "sdpa_forward", "sdpa_backward", "keep_mask_of"]


def accepts(q, k, v, mask=None, dropout_mask=None) -> bool:
    """Whether this implementation takes these arguments: dask arrays q (B, Hq, Lq, Dh),
    k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv) of one B and known chunk sizes, and masks
    that broadcast to (B, Hq, Lq, Lk) without growing it.

    Parameters
    ----------
    q : array, shape (B, Hq, Lq, Dh)
    k : array, shape (B, Hkv, Lk, Dh)
    v : array, shape (B, Hkv, Lk, Dv)
        Hkv >= 1 divides Hq.
    mask, dropout_mask : array, optional
        None: not given.

    Returns
    -------
    bool
        False for an array that is not a dask array, one of unknown chunk sizes (a NaN in
        its shape) or shapes other than these.
    """
    arrays = (q, k, v, mask, dropout_mask)
    if not all(a is None or is_dask_array(a) for a in arrays):
        return False
    if any(math.isnan(n) for a in arrays if a is not None for n in a.shape):
        return False  # unknown chunk sizes
    return V.heads_layout(q, k, v, mask, dropout_mask)


# ------------------------------------------------------------------ the plan


class ChunkPlan(NamedTuple):
    """Chunk boundaries along (B, Hkv, Lq, Lk) and the group size G."""

    b: tuple  #: chunk lengths along the batch
    h: tuple  #: along the K/V heads
    i: tuple  #: along the query rows
    j: tuple  #: along the keys
    G: int  #: query heads per K/V head

    def starts(self, axis: str) -> list:
        """Where the chunks along ``axis`` ("b", "h", "i" or "j") start, and the end."""
        sizes = getattr(self, axis)
        return [0, *np.cumsum(sizes).tolist()]


def _nonempty(chunks) -> tuple:
    """Chunk lengths without empty chunks (dask allows them; a pair of them has no rows)."""
    kept = tuple(int(n) for n in chunks if n)
    return kept or tuple(int(n) for n in chunks[:1])


def _plan(q, k, G) -> ChunkPlan:
    return ChunkPlan(b=_nonempty(q.chunks[0]), h=_nonempty(k.chunks[1]), i=_nonempty(q.chunks[2]),
                     j=_nonempty(k.chunks[2]), G=G)


def _rechunk(a, plan: ChunkPlan, kinds: tuple):
    """``a`` (4-D) rechunked to the plan: ``kinds[axis]`` is ``"b"``, ``"hq"`` (query
    heads), ``"hk"`` (K/V heads), ``"i"`` or ``"j"``, or None for one chunk; an axis of
    size 1 (a broadcast mask axis) stays one chunk."""
    sizes = {"b": plan.b, "hq": tuple(plan.G * n for n in plan.h), "hk": plan.h, "i": plan.i,
             "j": plan.j}
    return a.rechunk(tuple((n,) if kind is None or n == 1 else sizes[kind]
                           for n, kind in zip(a.shape, kinds)))


_MASK = ("b", "hq", "i", "j")  # how a mask over (B, Hq, Lq, Lk) is chunked


def _pad4(a):
    """``a`` with leading 1-axes up to 4 axes (a mask that broadcasts).

    New axes by indexing, not ``reshape``: dask's reshape fails on an axis of
    length 1 chunked ``(1, 0)`` (an IndexError, or a graph with a missing key)."""
    return a if a.ndim == 4 else a[(None,) * (4 - a.ndim)]


def _mask_key(mask4, b, h, i, j):
    """Key of the mask chunk that pair ``(b, h, i, j)`` reads (0 on a broadcast axis)."""
    idx = [b, h, i, j]
    return (mask4.name, *(0 if mask4.numblocks[a] == 1 else idx[a] for a in range(4)))


# ------------------------------------------------------------------ one task


class _Pair(NamedTuple):
    """What a task needs beyond its arrays: where its chunks lie and the options."""

    b0: int  #: first batch entry
    h0: int  #: first query head
    i0: int  #: first query row
    j0: int  #: first key
    options: F.ScoreOptions  #: the call's window (causal folded in), offset and softcap; no arrays
    scale: float  #: the factor of the scores
    dropout_p: float  #: the drop probability
    key: Optional[int]  #: dropout key (a generated keep-mask), or None
    G: int  #: query heads per K/V head
    block_q: Optional[int]  #: the blocked algorithm's block sizes inside the task, or None
    block_k: Optional[int]  #: (its defaults)


def _pair_keep(pair: _Pair, q, k, keep):
    """The pair's keep-mask: the caller's chunk, or its part of the drawn one (global coordinates)."""
    if pair.key is None:
        return keep
    Bc, Hc, ri, ck = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    lead = [np.arange(pair.b0, pair.b0 + Bc)[:, None], np.arange(pair.h0, pair.h0 + Hc)[None, :]]
    return keyed_keep_mask(pair.key, pair.dropout_p, lead, pair.i0 + np.arange(ri),
                           pair.j0 + np.arange(ck))  # [Bc, Hc, ri, ck]


def _pair_options(pair: _Pair, alibi, q_segments, k_segments) -> F.ScoreOptions:
    """The call's options for the pair's chunks: local row ``r`` is query ``i0 + r`` and local
    column ``c`` key ``j0 + c``, so ``j - (i + offset) = c - (r + offset + i0 - j0)``; the
    chunks of the slopes [Bc|1, Hc, 1, 1] and segment ids [Bc, 1, ri, 1], [Bc, 1, 1, ck]."""
    o = pair.options
    return o._replace(offset=o.offset + pair.i0 - pair.j0, alibi=alibi, q_segments=q_segments,
                      k_segments=k_segments)


def _pair_cache(pair: _Pair, q, k, v, mask, keep, alibi, q_segments, k_segments):
    keep = _pair_keep(pair, q, k, keep)
    return blocked.blocked_cache(q, k, v, mask=mask, is_causal=False, scale=pair.scale,
                                 dropout_p=pair.dropout_p if keep is not None else 0.0,
                                 dropout_mask=keep, groups=pair.G, block_q=pair.block_q,
                                 block_k=pair.block_k,
                                 options=_pair_options(pair, alibi, q_segments, k_segments))


def _pair_forward(pair: _Pair, q, k, v, mask, keep, alibi, q_segments, k_segments):
    """1. One query chunk against one key chunk: ``(o_ij, m_ij, l_ij)`` (compute dtype)."""
    # [Bc, Hc, ri, Dh], [Bc, Hkc, ck, Dh], [Bc, Hkc, ck, Dv] -> [Bc, Hc, ri, Dv], [.., 1], [.., 1]
    keep = _pair_keep(pair, q, k, keep)
    _, c = blocked.sdpa_blocked_forward_core(
        q, k, v, mask=mask, is_causal=False, scale=pair.scale,
        dropout_p=pair.dropout_p if keep is not None else 0.0, dropout_mask=keep, rng=None,
        groups=pair.G, block_q=pair.block_q, block_k=pair.block_k,
        options=_pair_options(pair, alibi, q_segments, k_segments))
    return blocked.rows_of(c)


def _sink_part(sinks, like):
    """The sink [1, Hc, 1, 1] as one more part of a row's merge: ``o = 0``, ``m = sink``,
    ``l = exp(sink - m) = 1`` (0 for a sink of -inf: no sink), shaped like part ``like``."""
    o, m, _ = like
    m_s, l_s = blocked.sink_start(np, sinks.astype(m.dtype, copy=False), np.zeros_like(m))
    return np.zeros_like(o), np.where(l_s == 0.0, 0.0, m_s).astype(m.dtype), l_s  # 9.: m = 0 if empty


def _empty_rows(shape, Dv, dtype, sinks=None):
    """2. The rows of a chunk ``shape`` (Bc, Hc, ri) that no key chunk meets: out 0, and
    ``m = 0, l = 0`` (nothing to attend) or the sink's part."""
    o = np.zeros(shape + (Dv,), dtype=dtype)
    m, l = np.zeros(shape + (1,), dtype=dtype), np.zeros(shape + (1,), dtype=dtype)
    return (o, m, l) if sinks is None else _sink_part(sinks, (o, m, l))


def _merge(parts, sinks=None):
    """2. The merge across key chunks: ``(out, m, l)`` of the whole row from its pairs, and
    from its sink [1, Hc, 1, 1] (None: no sinks)."""
    if sinks is not None:
        parts = [*parts, _sink_part(sinks, parts[0])]
    if len(parts) == 1:
        return parts[0]
    # a pair where the row attends nothing has l = 0 (and m = 0): it must not set the maximum
    ms = [np.where(l == 0.0, -np.inf, m) for _, m, l in parts]
    m = functools.reduce(np.maximum, ms)  # [Bc, Hc, ri, 1]
    m = np.where(m == -np.inf, 0.0, m).astype(parts[0][1].dtype)
    w = [l * np.exp(mj - m) for (_, _, l), mj in zip(parts, ms)]  # exp(-inf) = 0
    l = functools.reduce(operator.add, w)
    acc = functools.reduce(operator.add, [wj * o for wj, (o, _, _) in zip(w, parts)])
    out = acc / np.where(l == 0.0, 1.0, l)
    return out.astype(parts[0][0].dtype), m, l.astype(parts[0][2].dtype)


def _pair_backward(pair: _Pair, q, k, v, mask, keep, alibi, q_segments, k_segments, dout, out,
                   m, l, dlse):
    """3. The pair's shares ``(dq_ij, dk_ij, dv_ij, dmask_ij)`` from the merged row statistics
    (sink included) and the rows' ``dlse`` ([Bc, Hc, ri, 1], or None)."""
    c = _pair_cache(pair, q, k, v, mask, keep, alibi, q_segments, k_segments)
    dq, dk, dv, dmask, _ = blocked.sdpa_blocked_backward_core(
        dout, blocked.with_rows(c, out, m, l), dlse=dlse)
    return dq, dk, dv, dmask


def _sink_grad(sinks, dout, out, m, l, dlse):
    """5. ``dsink`` of one chunk of rows, summed over its batch entries and rows: [Hc].

    The blocked backward's ``delta`` and per-row sink gradient, with the merged rows."""
    # [1, Hc, 1, 1], [Bc, Hc, ri, Dv], [Bc, Hc, ri, Dv], [Bc, Hc, ri, 1] x 2 (and dlse) -> [Hc]
    delta = blocked.row_delta(np, dout, out, l, dlse)  # [Bc, Hc, ri, 1]
    return np.sum(blocked.sink_grad_rows(np, sinks, m, l, delta), axis=(0, 2, 3))


def _sum(parts, field, shape, dtype):
    """4. The sum of one field of the pairs' gradients (zeros when no pair met the chunk)."""
    if not parts:
        return np.zeros(shape, dtype=dtype)
    return functools.reduce(operator.add, [p[field] for p in parts])


def _keep_chunk(key, p, b0, h0, i0, j0, shape):
    """One chunk (Bc, Hc, ri, ck) of the generated keep-mask."""
    lead = [np.arange(b0, b0 + shape[0])[:, None], np.arange(h0, h0 + shape[1])[None, :]]
    return keyed_keep_mask(key, p, lead, i0 + np.arange(shape[2]), j0 + np.arange(shape[3]))


# ------------------------------------------------------------------ forward


class ChunkedSDPACache(NamedTuple):
    """What the chunked ``sdpa_backward`` needs from ``sdpa_forward``: dask arrays of the
    inputs, the merged output and row statistics, and the plan of chunk pairs."""
    q: Any  #: [B, Hq, Lq, Dh] dask, compute dtype, rechunked to the plan
    k: Any  #: [B, Hkv, Lk, Dh]
    v: Any  #: [B, Hkv, Lk, Dv]
    mask: Any  #: [B|1, Hq|1, Lq|1, Lk|1] dask, chunked to the plan, or None
    keep: Any  #: the caller's keep-mask likewise, or None
    out: Any  #: [B, Hq, Lq, Dv] dask, compute dtype: the merged output
    m: Any  #: [B, Hq, Lq, 1] merged row maximum
    l: Any  #: [B, Hq, Lq, 1] merged row sum
    plan: ChunkPlan  #: the chunks of the forward, which the backward takes again
    is_causal: bool  #: causal attention (also folded into ``options``)
    options: F.ScoreOptions  #: causal folded in; arrays as dask chunked to the plan (_OPTION_KINDS)
    scale: float  #: the factor of the scores
    dropout_p: float  #: the drop probability
    dropout_key: Optional[int]  #: key of the drawn keep-mask, or None
    mask_shape: Optional[tuple]  #: shape of a floating mask as given, for dmask
    in_dtype: Any  #: dtype of q, k, v; gradients are cast back to it
    block_q: Optional[int]  #: the blocked algorithm's block sizes inside each task, or None
    block_k: Optional[int]  #: (its defaults)

    @property
    def lse(self) -> Any:
        """[B, Hq, Lq] dask: natural log-sum-exp of each row (sink included), ``m + log(l)``;
        -inf for a row with nothing to attend."""
        xp = namespace(self.m)
        empty = self.l == 0.0
        l_safe = xp.where(empty, scalar(xp, 1.0, self.l), self.l)
        lse = xp.where(empty, scalar(xp, -math.inf, self.l), self.m + xp.log(l_safe))
        return xp.reshape(lse, tuple(self.m.shape[:-1]))


def _pairs(plan: ChunkPlan, options: F.ScoreOptions):
    """``(b, h, i, j)`` of every pair of chunks in the graph, in order: those where some query
    may attend some key by the window (causal folded in)."""
    si, sj = plan.starts("i"), plan.starts("j")
    for b in range(len(plan.b)):
        for h in range(len(plan.h)):
            for i in range(len(plan.i)):
                for j in range(len(plan.j)):
                    if F.block_visible(options, si[i], si[i + 1], sj[j], sj[j + 1]):
                        yield b, h, i, j


def _pair_of(c, b, h, i, j) -> _Pair:
    plan = c.plan
    scalars = c.options._replace(alibi=None, sinks=None, q_segments=None, k_segments=None)
    return _Pair(b0=plan.starts("b")[b], h0=plan.G * plan.starts("h")[h], i0=plan.starts("i")[i],
                 j0=plan.starts("j")[j], options=scalars, scale=c.scale,
                 dropout_p=c.dropout_p, key=c.dropout_key, G=plan.G, block_q=c.block_q,
                 block_k=c.block_k)


def _array(graph, name, deps, chunks, dtype):
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    hlg = HighLevelGraph.from_collections(name, graph, dependencies=[d for d in deps if d is not None])
    return da.Array(hlg, name, chunks, dtype=dtype, meta=np.empty((0,) * len(chunks), dtype=dtype))


def _inputs(c, b, h, i, j):
    """Keys of the chunks that pair ``(b, h, i, j)`` reads: q, k, v, mask, keep, ALiBi's
    slopes, the query and key segment ids (None for an array not given)."""
    o = c.options
    return ((c.q.name, b, h, i, 0), (c.k.name, b, h, j, 0), (c.v.name, b, h, j, 0),
            *(None if a is None else _mask_key(a, b, h, i, j)
              for a in (c.mask, c.keep, o.alibi, o.q_segments, o.k_segments)))


def _row_keys(c, b, h, i, *arrays):
    """Keys of chunk ``(b, h, i)`` of arrays over the rows (B, Hq, Lq, n) (None: not given)."""
    return tuple(None if a is None else (a.name, b, h, i, 0) for a in arrays)


#: How each option array of ``functional.ScoreOptions`` (over the scores (B, Hq, Lq, Lk)) is
#: chunked to the plan, as ``_rechunk``'s kinds
_OPTION_KINDS = {"alibi": ("b", "hq", None, None), "sinks": (None, "hq", None, None),
                 "q_segments": ("b", None, "i", None), "k_segments": ("b", None, None, "j")}


def sdpa_forward(q: Any, k: Any, v: Any, *, mask: Any, is_causal: bool, scale: Optional[float],
                 dropout_p: float, dropout_mask: Any, rng: Any, groups: int,
                 block_q: Optional[int] = None, block_k: Optional[int] = None,
                 options: Optional[F.ScoreOptions] = None) -> tuple[Any, ChunkedSDPACache]:
    """Chunk-parallel ``softmax(q k^T * scale + mask) v`` on checked dask arguments (``accepts``).

    The arguments are those of ``functional.sdpa_forward_core`` (``options`` its kernel
    options, their arrays dask arrays) plus the blocked algorithm's block lengths inside
    each task. Returns ``(out, ChunkedSDPACache)``; ``out`` is a dask array chunked as the
    plan: ``q``'s batch and row chunks, the heads in ``k``'s head chunks times G, its last
    axis one chunk.

    Parameters
    ----------
    q : dask array, shape (B, Hq, Lq, Dh)
    k : dask array, shape (B, Hkv, Lk, Dh)
    v : dask array, shape (B, Hkv, Lk, Dv)
        The chunks of ``q`` (batch, rows) and ``k`` (heads, keys) make the plan (module
        docstring); the other arrays are rechunked to it.
    mask : dask array, broadcastable to (B, Hq, Lq, Lk), or None
        Boolean (True = may attend) or floating (added to the scores).
    is_causal : bool
    scale : float or None
        None: ``1 / sqrt(Dh)``.
    dropout_p : float
        Drop probability.
    dropout_mask : dask bool array, broadcastable to (B, Hq, Lq, Lk), or None
        The keep-mask to apply; None: drawn when ``dropout_p`` is not 0.
    rng : int, SeedSequence, BitGenerator, Generator or None
        One key is drawn from it (``backend.dropout_key``) when a mask is drawn.
    groups : int
        G = Hq // Hkv.
    block_q, block_k : int, optional
        Block lengths of the blocked algorithm inside each task; None: its defaults.
    options : ScoreOptions, optional
        The kernel options; None: none (``is_causal`` is folded in either way).

    Returns
    -------
    out : dask array, shape (B, Hq, Lq, Dv), dtype of ``q``
        Chunked as ``cache.q``, the plan's: ``q``'s batch and row chunks, the heads in
        ``k``'s head chunks times G.
    cache : ChunkedSDPACache
    """
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv] -> [B, Hq, Lq, Dv]
    from dask.base import tokenize

    G = groups
    in_dtype = q.dtype
    work = np.dtype(np.float32) if in_dtype in (np.float16,) else np.dtype(in_dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    plan = _plan(q, k, G)
    q = _rechunk(q.astype(work), plan, ("b", "hq", "i", None))  # [B, Hq, Lq, Dh]
    k = _rechunk(k.astype(work), plan, ("b", "hk", "j", None))  # [B, Hkv, Lk, Dh]
    v = _rechunk(v.astype(work), plan, ("b", "hk", "j", None))  # [B, Hkv, Lk, Dv]
    mask_shape = None
    if mask is not None:
        if mask.dtype != np.bool_:
            mask_shape = tuple(mask.shape)
            mask = mask.astype(work)
        mask = _rechunk(_pad4(mask), plan, _MASK)
    keep = None if dropout_mask is None else _rechunk(_pad4(dropout_mask), plan, _MASK)
    key = dropout_key(rng) if dropout_p != 0.0 and dropout_mask is None else None
    o = F.causal_options(is_causal, options)  # the arrays rechunked to the plan
    o = o._replace(**{name: _rechunk(getattr(o, name), plan, kinds)
                      for name, kinds in _OPTION_KINDS.items() if getattr(o, name) is not None})
    c = ChunkedSDPACache(q=q, k=k, v=v, mask=mask, keep=keep, out=None, m=None, l=None, plan=plan,
                         is_causal=bool(is_causal), options=o, scale=scale,
                         dropout_p=float(dropout_p), dropout_key=key, mask_shape=mask_shape,
                         in_dtype=in_dtype, block_q=block_q, block_k=block_k)

    token = tokenize(q, k, v, mask, keep, is_causal, tuple(o), scale, dropout_p, key, G, block_q,
                     block_k)
    part, rows = "npattn-pair-forward-" + token, "npattn-merge-" + token
    names = {x: f"npattn-{x}-" + token for x in ("out", "m", "l")}
    graph: dict = {}
    parts: dict = {}
    for b, h, i, j in _pairs(plan, o):
        graph[(part, b, h, i, j)] = (functools.partial(_pair_forward, _pair_of(c, b, h, i, j)),
                                     *_inputs(c, b, h, i, j))
        parts.setdefault((b, h, i), []).append((part, b, h, i, j))
    hq = tuple(G * n for n in plan.h)
    for b, h, i in np.ndindex(len(plan.b), len(hq), len(plan.i)):
        # a chunk of rows that no key chunk meets (a window) merges its sink alone, or is empty
        sink = None if o.sinks is None else (o.sinks.name, 0, h, 0, 0)
        keys = parts.get((b, h, i), [])
        if keys:
            graph[(rows, b, h, i)] = (_merge, keys, sink)
        else:
            shape = (plan.b[b], hq[h], plan.i[i])
            graph[(rows, b, h, i)] = (_empty_rows, shape, v.shape[3], work, sink)
        for field, x in enumerate(("out", "m", "l")):
            graph[(names[x], b, h, i, 0)] = (operator.getitem, (rows, b, h, i), field)
    deps = [q, k, v, mask, keep, o.alibi, o.sinks, o.q_segments, o.k_segments]
    lead = (plan.b, hq, plan.i)
    out = _array(graph, names["out"], deps, lead + ((v.shape[3],),), work)
    m = _array(graph, names["m"], deps, lead + ((1,),), work)
    l = _array(graph, names["l"], deps, lead + ((1,),), work)
    c = c._replace(out=out, m=m, l=l)
    return (out if work == in_dtype else out.astype(in_dtype)), c


def keep_mask_of(cache: ChunkedSDPACache) -> Any:
    """The keep-mask (B, Hq, Lq, Lk) a forward used, as a dask array, or None without dropout.

    Parameters
    ----------
    cache : ChunkedSDPACache

    Returns
    -------
    keep : dask bool array, shape (B, Hq, Lq, Lk), or None
        True = kept: the caller's ``dropout_mask`` broadcast, or the drawn mask, one task
        per chunk of the plan; None when the forward was given no mask and drew none.
    """
    import dask.array as da
    from dask.base import tokenize

    c = cache
    full = tuple(c.q.shape[:3]) + (c.k.shape[2],)
    if c.keep is not None:
        return da.broadcast_to(c.keep, full)
    if c.dropout_key is None:
        return None
    plan = c.plan
    name = "npattn-keep-" + tokenize(c.dropout_key, c.dropout_p, plan)
    hq = tuple(plan.G * n for n in plan.h)
    sb, sh, si, sj = plan.starts("b"), [0, *np.cumsum(hq).tolist()], plan.starts("i"), plan.starts("j")
    graph = {(name, b, h, i, j): (_keep_chunk, c.dropout_key, c.dropout_p, sb[b], sh[h], si[i], sj[j],
                                  (plan.b[b], hq[h], plan.i[i], plan.j[j]))
             for b, h, i, j in np.ndindex(len(plan.b), len(hq), len(plan.i), len(plan.j))}
    return _array(graph, name, [], (plan.b, hq, plan.i, plan.j), np.dtype(np.bool_))


# ------------------------------------------------------------------ backward


def sdpa_backward(dout: Any, cache: ChunkedSDPACache, *, dlse: Any = None) -> SDPAGrads:
    """Gradients ``SDPAGrads(dq, dk, dv, dmask, dsinks)`` of ``sdpa_forward`` as dask arrays,
    pair by pair (``dsinks`` (Hq,) with sinks, else None); ``dlse`` [B, Hq, Lq] is an upstream
    gradient of ``cache.lse``.

    Parameters
    ----------
    dout : dask array, shape (B, Hq, Lq, Dv), dtype of ``q``
        Checked against ``cache.out``.
    cache : ChunkedSDPACache
    dlse : dask array, shape (B, Hq, Lq), optional
        None: no gradient reaches ``lse``.

    Returns
    -------
    SDPAGrads
        Dask arrays in the dtype of ``q``: ``dq`` (B, Hq, Lq, Dh), ``dk`` (B, Hkv, Lk, Dh),
        ``dv`` (B, Hkv, Lk, Dv), ``dmask`` in the floating mask's shape as given (None for a
        boolean mask or none), ``dsinks`` (Hq,) or None.
    """
    # [B, Hq, Lq, Dv] -> [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv], mask shape, [Hq]
    from dask.base import tokenize

    c = cache
    V.check_grad("dout", dout, shape=tuple(c.out.shape), dtype=c.in_dtype, xp=namespace(c.q),
                 device=device_of(c.q), of="the forward's out")
    plan = c.plan
    work = c.q.dtype
    dout = dout.astype(work).rechunk(c.out.chunks)  # [B, Hq, Lq, Dv]
    if dlse is not None:
        dlse = dlse.astype(work).reshape(tuple(c.m.shape)).rechunk(c.m.chunks)  # [B, Hq, Lq, 1]
    token = tokenize(dout, c.out, c.q, c.k, c.v, c.mask, c.keep, tuple(c.options), c.dropout_key,
                     dlse)
    part = "npattn-pair-backward-" + token
    names = {x: f"npattn-{x}-" + token for x in ("dq", "dk", "dv", "dmask", "dsink-rows", "dsinks")}
    graph: dict = {}
    to_dq: dict = {}
    to_dkv: dict = {}
    to_dmask: dict = {}
    for b, h, i, j in _pairs(plan, c.options):
        inputs = _inputs(c, b, h, i, j)
        row = _row_keys(c, b, h, i, dout, c.out, c.m, c.l, dlse)
        graph[(part, b, h, i, j)] = (functools.partial(_pair_backward, _pair_of(c, b, h, i, j)),
                                     *inputs, *row)
        to_dq.setdefault((b, h, i), []).append((part, b, h, i, j))
        to_dkv.setdefault((b, h, j), []).append((part, b, h, i, j))
        if c.mask_shape is not None:
            to_dmask.setdefault(inputs[3][1:], []).append((part, b, h, i, j))
    Dh, Dv = c.q.shape[3], c.v.shape[3]
    hq = tuple(plan.G * n for n in plan.h)
    for b in range(len(plan.b)):
        for h in range(len(plan.h)):
            for i in range(len(plan.i)):
                graph[(names["dq"], b, h, i, 0)] = (_sum, to_dq.get((b, h, i), []), 0,
                                                    (plan.b[b], hq[h], plan.i[i], Dh), work)
            for j in range(len(plan.j)):
                kv = to_dkv.get((b, h, j), [])
                graph[(names["dk"], b, h, j, 0)] = (_sum, kv, 1, (plan.b[b], plan.h[h], plan.j[j], Dh), work)
                graph[(names["dv"], b, h, j, 0)] = (_sum, kv, 2, (plan.b[b], plan.h[h], plan.j[j], Dv), work)
    o = c.options
    deps = [dout, c.out, c.m, c.l, c.q, c.k, c.v, c.mask, c.keep, dlse, o.alibi, o.sinks,
            o.q_segments, o.k_segments]
    dsinks = None
    if o.sinks is not None:  # 5. per chunk of rows, then per head chunk
        for b, h, i in np.ndindex(len(plan.b), len(hq), len(plan.i)):
            graph[(names["dsink-rows"], b, h, i)] = (
                _sink_grad, (o.sinks.name, 0, h, 0, 0),
                *_row_keys(c, b, h, i, dout, c.out, c.m, c.l, dlse))
        for h in range(len(hq)):
            rows = [(names["dsink-rows"], b, h, i) for b, i in np.ndindex(len(plan.b), len(plan.i))]
            graph[(names["dsinks"], h)] = (functools.reduce, operator.add, rows)
        dsinks = _array(graph, names["dsinks"], deps, (hq,), work)
    dq = _array(graph, names["dq"], deps, (plan.b, hq, plan.i, (Dh,)), work)
    dk = _array(graph, names["dk"], deps, (plan.b, plan.h, plan.j, (Dh,)), work)
    dv = _array(graph, names["dv"], deps, (plan.b, plan.h, plan.j, (Dv,)), work)
    dmask = None
    if c.mask_shape is not None:
        mchunks = c.mask.chunks
        for idx in np.ndindex(*c.mask.numblocks):
            shape = tuple(mchunks[a][idx[a]] for a in range(4))
            graph[(names["dmask"],) + idx] = (_sum, to_dmask.get(idx, []), 3, shape, work)
        dmask = _array(graph, names["dmask"], deps, mchunks, work).reshape(c.mask_shape)
    grads = [dq, dk, dv, dmask, dsinks]
    if c.in_dtype != work:
        grads = [None if g is None else g.astype(c.in_dtype) for g in grads]
    return SDPAGrads(*grads)
